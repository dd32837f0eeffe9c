"""evaluate.engine = vllm: serve target + exported drafter in vLLM, read its spec-decode metrics.

Optional (vLLM is never a requirement of the package or the tests). Metric names are
vLLM's own, from ``LLM.get_metrics()`` (as in vLLM's examples/offline_inference/spec_decode.py):
``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
``vllm:spec_decode_num_accepted_tokens`` (counters) and
``vllm:spec_decode_num_accepted_tokens_per_pos`` (a vector, one value per position).
Mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3.errors import StageError
from eagle3.settings.evaluate import VllmEvaluateSettings
from eagle3.vllm_env import apply_vllm_env
from eagle3.vllm_version import require_vllm


def vllm_available() -> bool:
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def spec_decode_counts(metrics: list[Any], k: int) -> dict[str, Any]:
    """Sum vLLM's spec-decode metrics (objects with .name and .value / .values)."""
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            draft_tokens += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for i, v in enumerate(m.values[:k]):
                per_pos[i] += int(v)
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "accepted_per_position": per_pos}


def llm_kwargs(target: str, export_dir: Path, k: int, dtype: str, trust_remote_code: bool,
               tensor_parallel_size: int, engine: VllmEvaluateSettings | None = None) -> dict[str, Any]:
    """Arguments of ``vllm.LLM`` (0.22.1-0.34.x) serving the target with the exported drafter (pure);
    ``engine``: evaluate.vllm (its ``tensor_parallel_size`` resolved by the caller)."""
    engine = engine or VllmEvaluateSettings()
    kwargs = {
        "model": target,
        "dtype": dtype,  # target.dtype resolved as extract resolved it: the hidden states the drafter learned
        "trust_remote_code": trust_remote_code,
        "tensor_parallel_size": tensor_parallel_size,
        "gpu_memory_utilization": engine.gpu_memory_utilization,
        "enforce_eager": engine.enforce_eager,
        "speculative_config": {"method": "eagle3", "model": str(export_dir), "num_speculative_tokens": k},
        "disable_log_stats": False,
    }
    if engine.max_model_len is not None:
        kwargs["max_model_len"] = engine.max_model_len
    return kwargs


def load_llm_class() -> tuple[Any, Any]:
    """(vllm.LLM, vllm.SamplingParams); one clear line where vLLM cannot run."""
    if not vllm_available():
        raise StageError("evaluate.engine=vllm needs vLLM installed and a CUDA device; use evaluate.engine=hf")
    from vllm import LLM, SamplingParams

    return LLM, SamplingParams


def run_vllm(target: str, export_dir: Path, prompts: list[list[int]], k: int, max_new_tokens: int,
             trust_remote_code: bool, dtype: str, engine: VllmEvaluateSettings | None = None) -> dict[str, Any]:
    """Generate greedily with EAGLE-3 speculation in vLLM, the target in ``dtype``; return its acceptance counters."""
    require_vllm("evaluate.engine=vllm")
    llm_cls, params_cls = load_llm_class()
    import torch

    engine = engine or VllmEvaluateSettings()
    tp = engine.tensor_parallel_size or max(torch.cuda.device_count(), 1)
    apply_vllm_env()
    llm = llm_cls(**llm_kwargs(target, export_dir, k, dtype, trust_remote_code, tp, engine))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           params_cls(temperature=0.0, max_tokens=max_new_tokens))
    counts = spec_decode_counts(llm.get_metrics(), k)
    counts["tokens_generated"] = sum(len(o.outputs[0].token_ids) for o in outputs)
    return counts
