"""Acceptance of an exported drafter on the race's held-out prompts, by the evaluate stage's own engines.

``hf``: the evaluate stage's decoder and report (:func:`eagle3.evaluate.stage.decode_prompts`,
:func:`~eagle3.evaluate.stage.hf_report`) on the config's held-out prompts, prompt by prompt: what the stage
reports for ours, for any export directory. ``vllm``: :func:`eagle3.evaluate.vllm_engine.run_vllm` on the same
prompts (the target in the dtype its config is saved in, bfloat16 for the race's target), read as the stage
reads it. Run as ``python -m benchmarks.quality.evaluate``; the report is written last, whole.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from contextlib import closing
from pathlib import Path
from typing import Any

from benchmarks.quality.files import write_json


def vllm_missing() -> str | None:
    """Why vLLM cannot measure here (None: it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def hf_report(config: Path, export_dir: Path) -> dict[str, Any]:
    from eagle3.config import load_config
    from eagle3.evaluate.stage import decode_prompts, held_out_prompt_ids, hf_report

    cfg = load_config(config)
    held, prompts = held_out_prompt_ids(cfg)
    items = [(i, p.sample_id, ids) for i, (p, ids) in enumerate(zip(held.prompts, prompts))]
    export_config = json.loads((export_dir / "config.json").read_text())
    results: list[Any] = [None] * len(items)
    with closing(decode_prompts(cfg.target, cfg.evaluate, export_config, export_dir / "model.safetensors",
                                items)) as stream:
        for j, r in stream:
            results[j] = r
    report = hf_report(cfg.evaluate.num_draft_tokens, results)
    return {"engine": "hf", "dtype": cfg.target.dtype, "num_prompts": len(items), "held_out": held.held_out,
            **report}


def vllm_report(config: Path, export_dir: Path) -> dict[str, Any]:
    from eagle3.config import load_config
    from eagle3.evaluate.report import summarize_counts
    from eagle3.evaluate.stage import held_out_prompt_ids
    from eagle3.evaluate.vllm_engine import run_vllm
    from eagle3.targets.load import resolve_target

    cfg = load_config(config)
    _, prompts = held_out_prompt_ids(cfg)
    ev, target = cfg.evaluate, resolve_target(cfg.target)
    saved = json.loads((Path(target) / "config.json").read_text())
    served = saved.get("dtype") or saved.get("torch_dtype") or "bfloat16"  # the target is saved as it is served
    counts = run_vllm(target, export_dir, prompts, ev.num_draft_tokens, ev.max_new_tokens, cfg.target.trust_remote_code,
                      served, ev.vllm)
    import vllm

    return {"engine": "vllm", "vllm_version": vllm.__version__, "dtype": served, "num_prompts": len(prompts),
            **summarize_counts(ev.num_draft_tokens, counts["drafts"], counts["draft_tokens"], counts["accepted"],
                               counts["accepted_per_position"], counts["tokens_generated"])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("hf", "vllm"), required=True)
    ap.add_argument("--config", type=Path, required=True, help="the race's pipeline config")
    ap.add_argument("--export", type=Path, required=True, help="an export directory (config.json, model.safetensors)")
    ap.add_argument("--result", type=Path, required=True)
    a = ap.parse_args(argv)
    report = (hf_report if a.engine == "hf" else vllm_report)(a.config, a.export)
    write_json(a.result, {**report, "export": str(a.export), "paths": [str(a.export)]})


if __name__ == "__main__":
    main()
