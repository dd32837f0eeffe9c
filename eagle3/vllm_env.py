"""The environment of every vLLM the product starts: ``vllm serve``, extraction's and evaluation's engines.

vLLM's sampler (``v1/sample/ops/topk_topp_sampler.py``) imports FlashInfer when the engine
starts on CUDA unless ``VLLM_USE_FLASHINFER_SAMPLER=0``. FlashInfer is a large optional
package that a vLLM installed from a wheelhouse may leave out (docs/airgapped.md); where it
is not importable, the variable is set to 0 (vLLM samples with its own kernels), unless the
user set it. Found with ``importlib.util.find_spec``: importing FlashInfer initialises CUDA.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def vllm_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a vLLM process needs beyond ``environ`` (default: this process's); never one set there."""
    environ = os.environ if environ is None else environ
    if FLASHINFER_SAMPLER_ENV not in environ and not flashinfer_installed():
        return {FLASHINFER_SAMPLER_ENV: "0"}
    return {}


def apply_vllm_env() -> None:
    """:func:`vllm_env` set in this process, before it builds a ``vllm.LLM`` (vLLM's processes inherit it)."""
    os.environ.update(vllm_env())
