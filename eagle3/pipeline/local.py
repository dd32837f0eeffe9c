"""The embedded default backend: stages are subprocesses on this machine.

Each stage runs ``python -m eagle3 stage NAME -c <run dir>/config.yaml``, the same
entrypoint the images run, in its own process group, its output in
``.eagle3/runs/<run_id>/logs/<stage>.log`` (earlier attempts kept as
``<stage>.attempt-N.log``). The config file is the fully resolved config (CLI overrides
included), so every child sees exactly what the scheduler saw. The server is
``transformers serve`` (vLLM when installed and a GPU is present), on a free port unless
``serve.port`` names one. Process ids, their host and command lines go to the run's state
record in the store, so ``status``, ``logs`` and ``down`` work from any shell and directory,
and the run that takes over a killed one's lease stops what it left running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from eagle3.config import PipelineConfig
from eagle3.errors import StageError
from eagle3.backend import Backend, Progress, StageHandle, StageOutcome
from eagle3.pipeline.lease import hostname, live_holder, pid_alive
from eagle3.pipeline.runstate import RunState
from eagle3.processes import processes_per_node
from eagle3.progress import parse_progress
from eagle3.serve.process import (ServerProcess, group_alive, last_line, proc_cmdline, stop_process_group,
                                  tagged_groups)
from eagle3.serve.vllm import choose_engine, gpu_count, vllm_command

CANCEL_GRACE_S = 30.0  # train checkpoints on SIGTERM; give it time
LOG_TAIL = 15


@dataclass
class _Attempt:
    proc: subprocess.Popen
    log: Path
    offset: int = 0
    progress: Progress | None = None
    first: tuple[float, float] | None = None  # (time, done) of the first progress line
    tail: list[str] = field(default_factory=list)


def write_resolved_config(cfg: PipelineConfig, path: Path) -> Path:
    """The whole config as YAML, for child processes. Holds no secrets: credentials live in the env."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Resolved by eagle3ctl for this run (config file + EAGLE3_* env + CLI flags). Do not edit.\n"
    path.write_text(header + yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


RUN_TAG = "EAGLE3_RUN_TAG"  # in every child's environment: finds strays the state record missed


def run_tag(run_id: str, store_uri: str) -> str:
    """``<run_id>@<store URI>``, the URI as the opened store spells it (file:// paths absolute)."""
    return f"{run_id}@{store_uri}"


def child_env(extra: dict[str, str] | None = None, tag: str | None = None) -> dict[str, str]:
    """The parent's environment minus EAGLE3_* config overrides (already in the resolved config:
    env outranks the YAML in a child, and would undo a CLI flag), plus the run's tag."""
    from eagle3.config import PipelineConfig

    fields = {f.upper() for f in PipelineConfig.model_fields}
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("EAGLE3_") and k[7:].split("__")[0] in fields) and k != RUN_TAG}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if tag is not None:
        env[RUN_TAG] = tag
    return {**env, **(extra or {})}


def rotate_log(log: Path) -> None:
    """Keep the previous attempt's log as <stage>.attempt-N.log."""
    if log.exists():
        n = 1
        while log.with_name(f"{log.stem}.attempt-{n}.log").exists():
            n += 1
        log.rename(log.with_name(f"{log.stem}.attempt-{n}.log"))


class LocalBackend(Backend):
    name = "local"

    def __init__(self, cfg: PipelineConfig, state: RunState, cancel_grace_s: float = CANCEL_GRACE_S) -> None:
        self.cfg, self.state, self.cancel_grace_s = cfg, state, cancel_grace_s
        self.logs_dir = (state.dir / "logs").resolve()
        self.config_path = (state.dir / "config.yaml").resolve()
        self._config_written = False  # written on first use: `logs`/`down` from another shell must not touch it
        self._attempts: dict[str, _Attempt] = {}
        self._server: ServerProcess | None = None
        self._gpus: int | None = None
        self.tag = run_tag(cfg.run_id, state.store.uri)

    # -- stages ----------------------------------------------------------------------

    def _ensure_config(self) -> None:
        if not self._config_written:
            write_resolved_config(self.cfg, self.config_path)
            self._config_written = True

    def stage_command(self, stage: str, endpoint: str | None = None, force: bool = False) -> list[str]:
        args = ["-m", "eagle3", "stage", stage, "-c", str(self.config_path)]
        if endpoint:
            args += ["--endpoint", endpoint]
        if force:
            args += ["--force"]
        nproc = self._procs(stage) if stage in ("extract", "train") else 1
        if nproc > 1:
            # eagle3-torchrun: torchrun that keeps the stage's exit code (2 = bad input), not its 1
            return [sys.executable, "-m", "eagle3.cli.launch", "--standalone", "--nproc-per-node", str(nproc), *args]
        return [sys.executable, *args]

    def _procs(self, stage: str) -> int:
        """torchrun processes of a GPU stage: its nproc_per_node (auto = this machine's GPUs, 1 on CPU)."""
        settings = getattr(self.cfg, stage)
        return processes_per_node(settings.nproc_per_node, settings.device, self.gpu_count)

    def submit(self, stage: str, endpoint: str | None = None, input_key: str | None = None,
               force: bool = False) -> StageHandle:
        log = self.logs_dir / f"{stage}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(log)
        self._ensure_config()
        cmd = self.stage_command(stage, endpoint, force)
        with open(log, "wb") as f:
            f.write(f"$ {' '.join(cmd)}\n".encode())
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=child_env(tag=self.tag), start_new_session=True)
        try:
            self.state.update("stages", stage, pid=proc.pid, cmd=" ".join(cmd), log=str(log))
        except BaseException:  # unrecorded, the scheduler would not know to stop it: stop it now
            stop_process_group(proc.pid, self.cancel_grace_s, proc)
            raise
        self._attempts[stage] = _Attempt(proc, log)
        return StageHandle(stage, ref=str(proc.pid), started_at=time.time(), extra={"pgid": proc.pid, "log": str(log)})

    def _read_new(self, a: _Attempt) -> None:
        try:
            with open(a.log, "rb") as f:
                f.seek(a.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # only whole lines
        a.offset += end
        for raw in data[:end].decode(errors="replace").splitlines():
            rec = parse_progress(raw)
            if rec is None:
                if raw.strip():
                    a.tail = (a.tail + [raw])[-LOG_TAIL:]
                continue
            now, done = time.time(), float(rec.get("done") or 0)
            if a.first is None:
                a.first = (now, done)
            rate = rec.get("rate")
            if rate is None and now - a.first[0] > 0.5:
                rate = (done - a.first[1]) / (now - a.first[0])
            extra = {k: v for k, v in rec.items() if k not in ("stage", "done", "total", "unit", "rate")}
            a.progress = Progress(done, rec.get("total"), str(rec.get("unit") or ""), rate, extra)

    def poll(self, handle: StageHandle) -> StageOutcome | None:
        a = self._attempts[handle.stage]
        rc = a.proc.poll()
        self._read_new(a)
        if rc is None:
            return None
        self._read_new(a)
        if rc == 0:
            return StageOutcome(handle.stage, True)
        errors = [ln for ln in a.tail if ln.startswith("error:")]
        if errors:
            reason = errors[-1][len("error:"):].strip()
        elif rc < 0:
            reason = f"killed by signal {-rc}"
        else:
            reason = f"exit code {rc}"
        return StageOutcome(handle.stage, False, f"{reason} (log: {a.log})", list(a.tail))

    def progress(self, handle: StageHandle) -> Progress | None:
        a = self._attempts.get(handle.stage)
        if a is None:
            return None
        self._read_new(a)
        return a.progress

    def cancel(self, handle: StageHandle) -> None:
        a = self._attempts.get(handle.stage)
        if a is not None:
            stop_process_group(a.proc.pid, self.cancel_grace_s, a.proc)

    def logs(self, stage: str, follow: bool = False, tail: int | None = None) -> list[str]:
        host = self.state.data.get("host")
        if host and host != hostname():
            raise StageError(f"run {self.cfg.run_id} ran on {host}: its logs are there, in {self.logs_dir}")
        log = self.logs_dir / f"{stage}.log"
        try:
            lines = log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        return lines[-tail:] if tail else lines

    # -- the server ------------------------------------------------------------------

    def start_serve(self) -> str:
        serve, target = self.cfg.serve, self.cfg.target
        if serve.port is None:  # not configured: a free one, so runs side by side never clash
            serve = serve.model_copy(update={"port": free_port(serve.host)})
        engine = choose_engine(serve)
        log = self.logs_dir / "serve.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        rotate_log(log)
        if port_in_use(_client_host(serve.host), serve.port):
            # Another server there would answer /v1/models in place of ours and hold the GPUs.
            raise StageError(f"port {serve.port} on {serve.host} is already in use (another server?); "
                             f"stop it, or set serve.port, or point serve.endpoint at it")
        if engine == "vllm":
            from eagle3.serve.vllm import check_vllm_version
            from eagle3.targets.load import resolve_target
            from eagle3.vllm_env import vllm_env

            check_vllm_version()
            model = resolve_target(target)
            cmd, env = vllm_command(serve, target, model), vllm_env()
            base_url = f"http://{_client_host(serve.host)}:{serve.port}/v1"
        else:
            from transformers.utils import logging as hf_logging

            from eagle3.serve.local import transformers_serve_command

            hf_logging.disable_progress_bar()  # a builtin target is built here: no bars over the live table
            sc = transformers_serve_command(target, serve, device="auto")
            cmd, env, base_url = sc.argv, sc.env, sc.base_url
        self._server = ServerProcess(cmd, base_url, log, env=child_env(env, tag=self.tag),
                                     startup_timeout_s=serve.startup_timeout_s, name=f"{engine} server")
        self._server.launch()
        try:
            self.state.update("serve", None, pid=self._server.pid, cmd=" ".join(cmd), engine=engine, log=str(log),
                              port=serve.port, host=hostname())
        except BaseException:  # a server failed to start is never stopped by the scheduler: stop it here
            self._server.stop()
            raise
        return self._server.wait_ready()

    def stop_serve(self) -> None:
        if self._server is not None:
            self._server.stop()
            self.state.update("serve", None, pid=None)

    # -- housekeeping ----------------------------------------------------------------

    def down(self) -> list[str]:
        """Stop what the run's state record says it started: first the live eagle3ctl holding the
        run's lease (it stops its own children), then any stage or server process group still
        alive. Works from any directory on the host that ran them."""
        store = self.state.store
        removed = []
        holder = live_holder(store, self.cfg.run_id)
        if holder is not None and (holder.host, holder.pid) != (hostname(), os.getpid()):
            if holder.host != hostname():
                raise StageError(f"run {self.cfg.run_id} is being run by {holder.describe()}; "
                                 f"stop it there (eagle3ctl down on {holder.host})")
            if _ours(holder.pid, holder.cmd):
                os.kill(holder.pid, signal.SIGTERM)
                deadline = time.monotonic() + self.cancel_grace_s + 70
                while pid_alive(holder.pid) and time.monotonic() < deadline:
                    time.sleep(0.2)
                removed.append(f"eagle3ctl run (pid {holder.pid})")
        data = self.state.reload()
        host = data.get("host")
        if host and host != hostname():
            if any(s.get("pid") for s in [*data.get("stages", {}).values(), data.get("serve", {})]):
                raise StageError(f"run {self.cfg.run_id} last ran on {host}: its processes can only be stopped there")
            return removed
        for name, s in sorted(data.get("stages", {}).items()):
            pid = s.get("pid")
            if pid and group_alive(pid) and _ours(pid, s.get("cmd")) and stop_process_group(pid, self.cancel_grace_s):
                removed.append(f"stage {name} (process group {pid})")
        serve = data.get("serve", {})
        pid = serve.get("pid")
        if pid and group_alive(pid) and _ours(pid, serve.get("cmd")) and stop_process_group(pid, 60.0):
            removed.append(f"serve (process group {pid})")
        # Strays the record never named (killed between a process's start and its record): by tag.
        for pgid in tagged_groups(RUN_TAG, self.tag):
            if pgid != os.getpgrp() and stop_process_group(pgid, self.cancel_grace_s):
                removed.append(f"process group {pgid} (tagged with run {self.cfg.run_id})")
        if data.get("serve", {}).get("pid"):
            self.state.update("serve", None, pid=None)
        return removed

    def gpu_count(self) -> int:
        if self._gpus is None:
            self._gpus = gpu_count()
        return self._gpus


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick); the server binds it moments later."""
    with socket.socket() as s:
        s.bind((_client_host(host), 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def _ours(pid: int, recorded_cmd: str | None) -> bool:
    """The process we recorded, not a recycled pid: its command line is the one we started."""
    current = proc_cmdline(pid)
    if current is None:
        return True  # the leader is gone (or no /proc) but its group lives on, e.g. torchrun workers
    # A script started by its shebang shows the interpreter first: "python3 /venv/bin/transformers serve …".
    return recorded_cmd is not None and (current == recorded_cmd or current.endswith(" " + recorded_cmd))


__all__ = ["LocalBackend", "child_env", "last_line", "write_resolved_config"]
