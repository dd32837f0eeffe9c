"""Verification of a run's manifests, shallow or deep, stage by stage."""

from __future__ import annotations

from typing import Callable

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store
from eagle3.manifest import verify_stage
from eagle3.stages import ORDER, get_stage


def verify_run(cfg: PipelineConfig, stages: list[str] | None, deep: bool, echo: Callable[[str], None]) -> bool:
    """Print one line per stage (and per problem); True when every named (else every started) stage is complete."""
    store = open_run_store(cfg)
    ok = True
    for name in stages or list(ORDER):
        spec = get_stage(name)
        if not stages and not store.list(f"{cfg.run_id}/{name}"):
            echo(f"{name}: not run")
            continue
        check = spec.load_check() if deep else None
        v = verify_stage(store, cfg.run_id, name, deep=deep, content_check=check)
        if v.complete:
            n = len(v.manifest.manifest.objects) if v.manifest else 0
            echo(f"{name}: ok ({n} objects{', deep' if deep else ''})")
        else:
            ok = False
            echo(f"{name}: FAILED")
            for p in v.problems:
                echo(f"  {p}")
    return ok
