"""Serve a target locally with ``transformers serve`` (the CPU / no-vLLM stand-in).

``transformers serve`` is a real OpenAI-compatible server (FastAPI + uvicorn). Given a
model positionally it is *pinned* to it: the model is loaded at startup, ``/v1/models``
lists it under exactly the string it was started with, and a request naming another
model gets a 400. We start it with :func:`eagle3.targets.load.resolve_target`'s result,
which is also what :func:`eagle3.targets.load.served_model_name` returns, so generate's
requests always name the served model.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from eagle3.errors import StageError
from eagle3.serve.settings import ServeSettings
from eagle3.targets.load import resolve_target
from eagle3.targets.settings import TargetSettings

POLL_INTERVAL_S = 0.5
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]  # additions to the parent environment
    base_url: str  # ends in /v1
    model: str  # the model id the server lists and requests must carry


def transformers_serve_command(target: TargetSettings, serve: ServeSettings, device: str = "auto") -> ServerCommand:
    """The argv and env that serve ``target`` with ``transformers serve`` on ``serve.host:port``."""
    model = resolve_target(target)
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise StageError("`transformers` CLI not found; install transformers[serving]")
    argv = [exe, "serve", "--host", serve.host, "--port", str(serve.port), "--device", device, "--log-level", "warning"]
    if target.dtype != "auto":
        argv += ["--dtype", target.dtype]
    if target.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += [*serve.extra_args, model]
    env = {
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",  # else the CLI asks PyPI for a newer version at startup
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if Path(model).is_dir():
        env["HF_HUB_OFFLINE"] = "1"  # a local directory needs no hub
    host = "127.0.0.1" if serve.host in ("0.0.0.0", "::") else serve.host
    return ServerCommand(argv, env, f"http://{host}:{serve.port}/v1", model)


def wait_for_models(base_url: str, model: str, timeout_s: float, proc: subprocess.Popen | None = None,
                    log: Path | None = None) -> None:
    """Poll ``/v1/models`` until it lists ``model``; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise StageError(f"model server exited with code {proc.returncode} before serving {model}"
                                 + (f": {_last_line(log)}" if log else ""))
            try:
                r = client.get(f"{base_url}/models")
                if r.status_code == 200 and any(m.get("id") == model for m in r.json().get("data", [])):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(POLL_INTERVAL_S)
    raise StageError(f"model server at {base_url} did not list {model} within {timeout_s:.0f}s")


def stop_process(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@contextmanager
def local_server(target: TargetSettings, serve: ServeSettings, device: str = "auto",
                 log_path: Path | None = None) -> Iterator[str]:
    """Start ``transformers serve`` for ``target``, wait for ``/v1/models``, yield the base URL, stop it."""
    cmd = transformers_serve_command(target, serve, device)
    log_dir = None
    if log_path is None:
        log_dir = tempfile.mkdtemp(prefix="eagle3-serve-")
        log_path = Path(log_dir) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_models(cmd.base_url, cmd.model, serve.startup_timeout_s, proc, log_path)
        yield cmd.base_url
    finally:
        stop_process(proc)
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


def _last_line(path: Path | None) -> str:
    try:
        lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()] if path else []
    except OSError:
        return "(no log)"
    return lines[-1].strip()[:300] if lines else "(empty log)"
