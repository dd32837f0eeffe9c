"""The tiny pipeline the reliability trials run: examples/tiny.yaml, smaller, cut into many
resumable pieces (parts of 2 samples, shards of 160 tokens, a checkpoint every 3 steps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


def write_config(workdir: Path, run_id: str, store_uri: str, cache: Path, steps: int, prompts: int) -> Path:
    cfg: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    cfg["run_id"] = run_id
    cfg["store"]["uri"] = store_uri
    cfg["target"]["cache_dir"] = str(cache)
    cfg["generate"].update(max_samples=12, max_tokens=24, concurrency=2, part_size=2)
    cfg["extract"].update(shard_tokens=160, batch_tokens=160)
    cfg["train"].update(max_steps=steps, checkpoint_every=3, log_every=3)
    cfg["evaluate"].update(num_prompts=prompts, max_new_tokens=24)
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
