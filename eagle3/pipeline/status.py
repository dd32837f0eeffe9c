"""``eagle3ctl status``: each stage's state from the manifests, with what a running run reports."""

from __future__ import annotations

import time
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store, stage_input_key
from eagle3.manifest import verify_stage
from eagle3.pipeline.runstate import RunState, pid_alive, run_dir
from eagle3.stages import ORDER, STAGES

HEADLINE_STATS = ("samples", "num_samples", "tokens", "num_tokens", "coverage", "shards", "steps", "final_loss",
                  "mean_acceptance_length", "duration_s")


def collect_status(cfg: PipelineConfig) -> list[dict[str, Any]]:
    """One record per stage: complete / incomplete (with the reason) / not run / waiting for upstream."""
    store = open_run_store(cfg)
    live = RunState.read(run_dir(cfg.run_id))
    running = run_in_progress(live)
    out: list[dict[str, Any]] = []
    complete: dict[str, Any] = {}
    for name in ORDER:
        spec = STAGES[name]
        rec: dict[str, Any] = {"stage": name, "resource": spec.resource}
        missing = [u for u in spec.needs if u not in complete]
        if missing:
            v = verify_stage(store, cfg.run_id, name)
            rec["state"] = "not run" if v.manifest is None and not store.list(f"{cfg.run_id}/{name}") else "incomplete"
            rec["reason"] = f"waits for {', '.join(missing)}"
        else:
            key = stage_input_key(cfg, spec, {u: complete[u] for u in spec.needs})
            v = verify_stage(store, cfg.run_id, name, input_key=key)
            if v.complete:
                rec["state"], rec["reason"] = "complete", ""
            elif v.manifest is None and not store.list(f"{cfg.run_id}/{name}"):
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


def run_in_progress(live: dict[str, Any]) -> bool:
    """A run is in progress while its eagle3ctl process lives (a SIGKILLed one never wrote 'finished')."""
    pid = live.get("scheduler_pid")
    if not live or live.get("finished", True) or not pid:
        return False
    return pid_alive(pid)


def run_summary(cfg: PipelineConfig) -> dict[str, Any]:
    live = RunState.read(run_dir(cfg.run_id))
    return {"run_id": cfg.run_id, "store": cfg.store.uri, "backend": cfg.backend,
            "in_progress": run_in_progress(live), "last_outcome": live.get("outcome"),
            "serve": {k: live.get("serve", {}).get(k) for k in ("state", "url", "pid")} if live.get("serve") else None,
            "stages": collect_status(cfg)}
