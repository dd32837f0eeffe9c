"""``eagle3ctl status``: each stage's state from the manifests, with what a running run reports."""

from __future__ import annotations

import time
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store, stage_input_key
from eagle3.errors import RunNotFound
from eagle3.manifest import verify_stage
from eagle3.pipeline.lease import live_holder
from eagle3.pipeline.runstate import read_state
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

HEADLINE_STATS = ("samples", "num_samples", "tokens", "num_tokens", "coverage", "shards", "steps", "final_loss",
                  "mean_acceptance_length", "duration_s")


def require_run(store: ObjectStore, run_id: str) -> None:
    """A run id the store holds nothing for is a mistake to say, not an empty report."""
    if not store.has_prefix(run_id):
        raise RunNotFound(f"run {run_id} has nothing in {store.uri}: no such run (check -c / --run-id and --store)")


def collect_status(cfg: PipelineConfig, store: ObjectStore | None = None) -> list[dict[str, Any]]:
    """One record per stage: complete / incomplete (with the reason) / not run / waiting for upstream."""
    store = store or open_run_store(cfg)
    live = read_state(store, cfg.run_id)
    running = live_holder(store, cfg.run_id) is not None
    out: list[dict[str, Any]] = []
    complete: dict[str, Any] = {}
    for name in ORDER:
        spec = STAGES[name]
        rec: dict[str, Any] = {"stage": name, "resource": spec.resource}
        missing = [u for u in spec.needs if u not in complete]
        started = store.has_prefix(f"{cfg.run_id}/{name}")
        if missing:
            v = verify_stage(store, cfg.run_id, name)
            rec["state"] = "not run" if v.manifest is None and not started else "incomplete"
            rec["reason"] = f"waits for {', '.join(missing)}"
        else:
            key = stage_input_key(cfg, spec, {u: complete[u] for u in spec.needs}, store)
            v = verify_stage(store, cfg.run_id, name, input_key=key)
            if v.complete:
                rec["state"], rec["reason"] = "complete", ""
            elif v.manifest is None and not started:
                rec["state"], rec["reason"] = "not run", ""
            else:
                rec["state"], rec["reason"] = "incomplete", v.reason
        if v.complete and v.manifest is not None and not missing:
            complete[name] = v.manifest
        if v.manifest is not None:
            m = v.manifest.manifest
            rec["finished_at"] = m.finished_at
            rec["stats"] = {k: m.stats[k] for k in HEADLINE_STATS if k in m.stats}
        run_rec = live.get("stages", {}).get(name)
        if run_rec:
            rec["run_state"] = run_rec.get("state")
            if running and run_rec.get("state") == "running" and run_rec.get("started_at"):
                rec["state"], rec["reason"] = "running", ""
                rec["elapsed_s"] = round(time.time() - run_rec["started_at"], 1)
                if run_rec.get("progress"):
                    rec["progress"] = run_rec["progress"]
        out.append(rec)
    return out


def run_summary(cfg: PipelineConfig) -> dict[str, Any]:
    store = open_run_store(cfg)
    require_run(store, cfg.run_id)
    live = read_state(store, cfg.run_id)
    holder = live_holder(store, cfg.run_id)
    return {"run_id": cfg.run_id, "store": cfg.store.uri, "backend": cfg.backend,
            "in_progress": holder is not None,
            "held_by": {"host": holder.host, "pid": holder.pid, "cwd": holder.cwd} if holder else None,
            "last_outcome": live.get("outcome"),
            "serve": {k: live.get("serve", {}).get(k) for k in ("state", "url", "pid", "port")} if live.get("serve") else None,
            "stages": collect_status(cfg, store)}
