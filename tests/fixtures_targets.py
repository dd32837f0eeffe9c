"""Session fixtures: tiny targets built from config, and `transformers serve` running them.

- ``tiny_llama_dir`` / ``tiny_deepseek_dir``: HF directories of the tiny targets
  (built once per session with :func:`eagle3.targets.tiny.build_tiny_target`).
- ``tiny_target_dir(arch)``: the same, by architecture name.
- ``tiny_server(arch)``: a factory; starts (once per session and arch) a real
  ``transformers serve`` for that tiny target and returns a :class:`ServedTarget`.
"""

from __future__ import annotations

import socket
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3.settings.serve import ServeSettings
from eagle3.settings.target import TargetSettings

SERVER_STARTUP_TIMEOUT_S = 300  # CPU shared by many test processes: loading torch can take a while


@dataclass(frozen=True)
class ServedTarget:
    arch: str
    target_dir: Path
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str  # the id the server lists; requests must carry it

    def target_settings(self, **kw) -> TargetSettings:
        return TargetSettings(model=str(self.target_dir), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_cache_dir(tmp_path_factory) -> Path:
    """One ``target.cache_dir`` for the whole session: each tiny target is built (and
    pretrained, ~15 s) once, whichever tests, stages or pipelines ask for it."""
    return tmp_path_factory.mktemp("tiny-targets")


@pytest.fixture(scope="session")
def tiny_target_dir(tiny_cache_dir):
    from eagle3.targets.tiny import builtin_target_dir

    def get(arch: str) -> Path:
        return builtin_target_dir(arch, tiny_cache_dir)

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("llama")


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tiny_target_dir) -> Path:
    return tiny_target_dir("deepseek")


@pytest.fixture(scope="session")
def tiny_server(tiny_target_dir):
    from eagle3.serve.local import local_server

    servers: dict[str, ServedTarget] = {}
    with ExitStack() as stack:

        def get(arch: str) -> ServedTarget:
            if arch not in servers:
                target_dir = tiny_target_dir(arch)
                settings = TargetSettings(model=str(target_dir))
                serve = ServeSettings(port=free_port(), startup_timeout_s=SERVER_STARTUP_TIMEOUT_S)
                base_url = stack.enter_context(local_server(settings, serve, device="cpu"))
                servers[arch] = ServedTarget(arch, target_dir, base_url, str(target_dir))
            return servers[arch]

        yield get
