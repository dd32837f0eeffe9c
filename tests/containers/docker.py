"""Small helpers to drive the Docker CLI from tests (real engine, real images)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build-images.sh"
IMAGE_TAG = "container-test"


def docker_problem() -> str | None:
    """Why Docker is not usable here, or None when an engine answers."""
    if shutil.which("docker") is None:
        return "no docker CLI (scripts/ci-docker.sh installs docker.io and starts dockerd)"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "`docker info` timed out"
    if r.returncode != 0 or not r.stdout.strip():
        last = (r.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"no Docker engine answers ({last}); run scripts/ci-docker.sh"
    return None


def build_cpu_image() -> tuple[str, str]:
    """Build the CPU stage image with scripts/build-images.sh; (image ref, the script's log)."""
    env = {**os.environ, "TAG": IMAGE_TAG, "PYTHON": sys.executable}
    env.pop("REGISTRY", None)
    r = subprocess.run(["bash", str(BUILD_SCRIPT), "cpu"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=2700)  # a first build on a fresh machine: ~15-20 min
    if r.returncode != 0:
        raise AssertionError(f"image build failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return r.stdout.strip().splitlines()[-1], r.stderr


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def explain(self) -> str:
        return f"$ {' '.join(self.argv)}\nexit {self.returncode}\n--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}"


@dataclass
class StageRunner:
    """Runs containers of one image the way a backend would: host network, config read-only."""

    image: str
    config_dir: Path  # mounted read-only at /config
    cache_dir: Path  # mounted at /eagle3-cache (the built tiny target lives here)
    env: dict[str, str] = field(default_factory=dict)  # passed by name (-e NAME), never on the argv
    started: list[str] = field(default_factory=list)

    def _argv(self, entrypoint: str | None, args: list[str], detach: bool = False, name: str | None = None) -> list[str]:
        argv = ["docker", "run", "--network", "host", "--read-only", "--tmpfs", "/tmp",
                "-v", f"{self.config_dir}:/config:ro", "-v", f"{self.cache_dir}:/eagle3-cache",
                "--tmpfs", "/work:uid=10001,gid=10001", "--tmpfs", "/home/eagle3:uid=10001,gid=10001"]
        argv += ["-d"] if detach else ["--rm"]
        if name:
            argv += ["--name", name]
        for k in self.env:
            argv += ["-e", k]
        if entrypoint:
            argv += ["--entrypoint", entrypoint]
        return argv + [self.image, *args]

    def run(self, args: list[str], entrypoint: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 600) -> Result:
        argv = self._argv(entrypoint, args)
        run_env = {**os.environ, **self.env, **(env or {})}
        r = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=timeout)
        return Result(argv, r.returncode, r.stdout, r.stderr)

    def start(self, args: list[str], entrypoint: str | None = None) -> str:
        name = f"eagle3-test-{uuid.uuid4().hex[:8]}"
        argv = self._argv(entrypoint, args, detach=True, name=name)
        r = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise AssertionError(f"could not start container: {r.stderr.strip()}")
        self.started.append(name)
        return name

    def logs(self, name: str) -> str:
        r = subprocess.run(["docker", "logs", "--tail", "40", name], capture_output=True, text=True, timeout=30)
        return r.stdout + r.stderr

    def running(self, name: str) -> bool:
        r = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True,
                           timeout=30)
        return r.stdout.strip() == "true"

    def stop(self, name: str) -> None:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        if name in self.started:
            self.started.remove(name)

    def stop_all(self) -> None:
        for name in list(self.started):
            self.stop(name)


def wait_for_models(base_url: str, runner: StageRunner, container: str) -> list[str]:
    """Poll ``/v1/models`` of a server container until it lists a model (however long its start takes
    on a loaded machine; pytest-timeout guards a hang); its ids. The container exiting is a failure."""
    while True:
        if not runner.running(container):
            raise AssertionError(f"server container exited:\n{runner.logs(container)}")
        try:
            r = httpx.get(f"{base_url}/models", timeout=None)
            ids = [m["id"] for m in r.json().get("data", [])] if r.status_code == 200 else []
            if ids:
                return ids
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
