"""Serve a target locally with ``transformers serve`` (the CPU / no-vLLM stand-in).

``transformers serve`` is a real OpenAI-compatible server (FastAPI + uvicorn). Given a
model positionally it is *pinned* to it: the model is loaded at startup, ``/v1/models``
lists it under exactly the string it was started with, and a request naming another
model gets a 400. We start it with :func:`eagle3.targets.load.resolve_target`'s result,
which is also what :func:`eagle3.targets.load.served_model_name` returns, so generate's
requests always name the served model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import StageError
from eagle3.serve.process import ServerProcess
from eagle3.settings.serve import ServeSettings
from eagle3.targets.load import resolve_target, target_dtype
from eagle3.settings.target import TargetSettings

STOP_GRACE_S = 10.0  # a tiny CPU server exits at once on SIGTERM; vLLM's grace is process.STOP_GRACE_S


@dataclass(frozen=True)
class ServerCommand:
    argv: list[str]
    env: dict[str, str]  # additions to the parent environment
    base_url: str  # ends in /v1
    model: str  # the model id the server lists and requests must carry


def serve_device_type(device: str) -> str:
    """cuda or cpu: where ``transformers serve --device DEVICE`` puts the model (auto: a GPU when one is visible)."""
    if device == "auto":
        from eagle3.serve.vllm import cuda_present

        return "cuda" if cuda_present() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def transformers_serve_command(target: TargetSettings, serve: ServeSettings, device: str = "auto") -> ServerCommand:
    """The argv and env that serve ``target`` with ``transformers serve`` on ``serve.host:port``."""
    model = resolve_target(target)
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise StageError("`transformers` CLI not found; install transformers[serving]")
    argv = [exe, "serve", "--host", serve.host, "--port", str(serve.port), "--device", device, "--log-level", "warning"]
    argv += ["--dtype", target_dtype(target, serve_device_type(device))]
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


@contextmanager
def local_server(target: TargetSettings, serve: ServeSettings, device: str = "auto",
                 log_path: Path | None = None) -> Iterator[str]:
    """Start ``transformers serve`` for ``target``, wait until it serves the model, yield the base URL, stop it.

    Start, readiness and stop are :class:`eagle3.serve.process.ServerProcess`'s (own
    process group; SIGTERM, then SIGKILL after ``STOP_GRACE_S``), as for the local backend.
    """
    cmd = transformers_serve_command(target, serve, device)
    with tempfile.TemporaryDirectory(prefix="eagle3-serve-") as tmp:
        server = ServerProcess(cmd.argv, cmd.base_url, log_path or Path(tmp) / "server.log",
                               env={**os.environ, **cmd.env}, startup_timeout_s=serve.startup_timeout_s,
                               name=f"transformers serve ({cmd.model})")
        server.launch()
        try:
            served = served_models(server.wait_ready())
            if cmd.model not in served:  # another server answered on our port
                raise StageError(f"{cmd.base_url} serves {', '.join(served) or 'no models'}, not {cmd.model}; "
                                 "is another server on that port?")
            yield cmd.base_url
        finally:
            server.stop(STOP_GRACE_S)


def served_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """Model ids ``GET {base_url}/models`` lists (empty if it does not answer a model list)."""
    try:
        with urllib.request.urlopen(f"{base_url}/models", timeout=timeout_s) as r:
            return [m["id"] for m in json.loads(r.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []
