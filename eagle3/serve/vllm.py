"""The ``vllm serve`` command for the target, from the serve and target settings.

The command always carries ``--dtype``: :func:`eagle3.targets.load.target_dtype` resolved for
a GPU where the target's config is at hand, else ``target.dtype`` as set, whose ``auto`` vLLM
resolves by the very rule ``target_dtype`` follows on a GPU.

Here (the local backend) vLLM's CLI runs as a module of this interpreter: a vLLM installed
beside the environment (``pip install --target``, docs/airgapped.md) puts no ``vllm`` on PATH.
``vllm.entrypoints.cli.main`` is the ``vllm`` console script's module, run as ``__main__`` in
0.22.1-0.34.x. The serve image has ``vllm`` on its PATH: Kubernetes runs :data:`IMAGE_VLLM`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from eagle3.settings.serve import ServeSettings
from eagle3.settings.target import TargetSettings

VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"
IMAGE_VLLM = ("vllm",)  # the serve image's entrypoint, on its PATH


def local_vllm() -> list[str]:
    """vLLM's CLI under this interpreter (found wherever this Python finds the ``vllm`` package)."""
    return [sys.executable, "-m", VLLM_CLI_MODULE]


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_present() -> bool:
    """A GPU is visible (without importing torch: backends know nothing about it)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return gpu_count() > 0


def gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for ln in out.splitlines() if ln.startswith("GPU "))


def choose_engine(serve: ServeSettings) -> str:
    """vllm or transformers: ``auto`` picks vLLM when it is installed and a GPU is present."""
    if serve.engine != "auto":
        return serve.engine
    return "vllm" if vllm_installed() and cuda_present() else "transformers"


def check_vllm_version() -> None:
    """serve.engine=vllm here: the installed vLLM must be a supported one (one line naming the range)."""
    from eagle3.vllm_version import require_vllm

    require_vllm("serve.engine=vllm")


def serve_dtype(target: TargetSettings, model_path: str) -> str:
    """The dtype ``vllm serve`` runs the target in (see the module docstring)."""
    from pathlib import Path

    if target.dtype != "auto" or not (Path(model_path) / "config.json").is_file():
        return target.dtype
    from eagle3.targets.load import target_dtype

    return target_dtype(target.model_copy(update={"model": model_path}), "cuda")


def vllm_command(serve: ServeSettings, target: TargetSettings, model_path: str,
                 launcher: Sequence[str] | None = None) -> list[str]:
    """``vllm serve MODEL`` with the settings that matter for Kimi-K2.5 on one node; ``launcher`` is
    what runs vLLM's CLI (default :func:`local_vllm`; :data:`IMAGE_VLLM` in the serve image)."""
    cmd = [*(local_vllm() if launcher is None else launcher), "serve", model_path, "--host", serve.host,
           "--port", str(serve.port),
           "--tensor-parallel-size", str(serve.tensor_parallel_size),
           "--served-model-name", target.served_name or model_path]
    if serve.max_model_len:
        cmd += ["--max-model-len", str(serve.max_model_len)]
    if serve.reasoning_parser:
        cmd += ["--reasoning-parser", serve.reasoning_parser]
    if target.trust_remote_code:
        cmd.append("--trust-remote-code")
    cmd += ["--dtype", serve_dtype(target, model_path)]
    return cmd + list(serve.extra_args)
