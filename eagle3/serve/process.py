"""A local OpenAI-compatible server as a child process: start, wait until ready, stop.

Shared by the vLLM launcher (``eagle3.serve.vllm``) and the local backend. The server runs
in its own process group so stopping it takes its workers too (vLLM's tensor-parallel
workers hold GPU memory until they exit). Readiness is ``GET /v1/models`` answering 200,
not ``/health``: vLLM answers /health before the model is loaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from eagle3.errors import StageError

READY_POLL_S = 1.0
STOP_GRACE_S = 60.0


class ServerProcess:
    def __init__(self, cmd: list[str], base_url: str, log_path: Path, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 1800, name: str = "server") -> None:
        self.cmd, self.base_url, self.log_path = cmd, base_url.rstrip("/"), log_path
        self.env, self.startup_timeout_s, self.name = env, startup_timeout_s, name
        self.proc: subprocess.Popen | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def launch(self) -> None:
        """Start the process (returns at once); :meth:`wait_ready` waits for the model."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             start_new_session=True)
            except OSError as e:
                raise StageError(f"cannot start {self.name} ({self.cmd[0]}): {e.strerror}") from None

    def wait_ready(self) -> str:
        """Poll ``/v1/models`` until it answers; the base URL (…/v1). Raises if the process dies or times out."""
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self._stopping:
                    raise StageError(f"{self.name} was stopped while starting")
                rc = self.proc.poll()
                if rc is not None:
                    raise StageError(f"{self.name} exited with code {rc} while starting; see {self.log_path}: "
                                     f"{last_line(self.log_path)}")
                try:
                    if client.get(f"{self.base_url}/models").status_code == 200:
                        return self.base_url
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise StageError(f"{self.name} did not answer {self.base_url}/models within "
                                     f"{self.startup_timeout_s:.0f}s (serve.startup_timeout_s); see {self.log_path}")
                time.sleep(READY_POLL_S)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; return once the leader has exited."""
        self._stopping = True
        if self.proc is None:
            return
        stop_process_group(self.proc.pid, grace_s, self.proc)


def stop_process_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> bool:
    """Terminate a process group politely, then by force. True if anything was signalled."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        if proc is not None:
            proc.wait()
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None and not group_alive(pgid):
            return True
        if proc is None and not group_alive(pgid):
            return True
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait()
    while group_alive(pgid) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    return True


def group_alive(pgid: int) -> bool:
    """Does any non-zombie process of the group remain? (A zombie holds no memory or GPU.)"""
    proc = Path("/proc")
    if proc.is_dir():
        for d in proc.iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tagged_groups(tag_name: str, tag: str) -> list[int]:
    """Process groups of live processes (ours, Linux /proc) whose environment has ``tag_name=tag``."""
    want = f"{tag_name}={tag}".encode()
    groups: set[int] = set()
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if want not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
        except OSError:  # gone, or not ours
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z":
            groups.add(int(fields[2]))
    return sorted(groups)


def proc_cmdline(pid: int) -> str | None:
    """The command line of a live process (Linux /proc), or None when unknown."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace") or None


def last_line(path: Path, default: str = "(no output)") -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return default
    return lines[-1][-300:] if lines else default
