"""``eagle3ctl status``: each stage's state from the manifests, with what a running run reports.

A run read with ``-c`` is judged against that config (what ``run`` would do with it); a run read
by ``--run-id`` alone against the config recorded in the store for it, the config of its latest
attempt that committed a stage or ended complete (``eagle3.pipeline.runner.ConfigRecord``): the
same answer as ``verify``, from any directory, whatever later attempt failed before committing.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store, stage_input_key
from eagle3.errors import RunNotFound
from eagle3.manifest import verify_stage
from eagle3.pipeline.lease import live_holder
from eagle3.pipeline.runstate import read_state
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

HEADLINE_STATS = ("samples", "num_samples", "tokens", "num_tokens", "coverage", "shards", "steps", "final_loss",
                  "mean_acceptance_length")


def require_run(store: ObjectStore, run_id: str) -> None:
    """A run id the store holds nothing for is a mistake to say, not an empty report."""
    if not store.has_prefix(run_id):
        raise RunNotFound(f"run {run_id} has nothing in {store.uri}: no such run (check -c / --run-id and --store)")


def judged_config(cfg: PipelineConfig, store: ObjectStore, config_given: bool) -> tuple[PipelineConfig, bool]:
    """The config a run's stages are judged against, and whether input keys are checked at all:
    the one given (``-c``); else the one recorded in the store for the run; else none (keys unchecked)."""
    if config_given:
        return cfg, True
    from eagle3.verify import recorded_config

    recorded = recorded_config(store, cfg.run_id)
    if recorded is None:
        return cfg, False
    return recorded.model_copy(update={"run_id": cfg.run_id, "store": cfg.store}), True


def _stage_record(cfg: PipelineConfig, store: ObjectStore, name: str, complete: dict[str, Any],
                  keys_checked: bool) -> tuple[dict[str, Any], Any, list[str]]:
    spec = STAGES[name]
    rec: dict[str, Any] = {"stage": name, "resource": spec.resource}
    missing = [u for u in spec.needs if u not in complete]
    started = store.has_prefix(f"{cfg.run_id}/{name}")
    if missing:
        v = verify_stage(store, cfg.run_id, name)
        rec["state"] = "not run" if v.manifest is None and not started else "incomplete"
        rec["reason"] = f"waits for {', '.join(missing)}"
    else:
        key = stage_input_key(cfg, spec, {u: complete[u] for u in spec.needs}, store) if keys_checked else None
        v = verify_stage(store, cfg.run_id, name, input_key=key)
        if v.complete:
            rec["state"], rec["reason"] = "complete", ""
        elif v.manifest is None and not started:
            rec["state"], rec["reason"] = "not run", ""
        else:  # objects named by their key: the store is in the title
            rec["state"], rec["reason"] = "incomplete", v.reason.replace(f"{store.uri}/", "")
    return rec, v, missing


def collect_status(cfg: PipelineConfig, store: ObjectStore | None = None, keys_checked: bool = True) -> list[dict[str, Any]]:
    """One record per stage: complete / incomplete (with the reason) / not run / waiting for upstream."""
    store = store or open_run_store(cfg, create=False)
    live = read_state(store, cfg.run_id)
    running = live_holder(store, cfg.run_id) is not None
    out: list[dict[str, Any]] = []
    complete: dict[str, Any] = {}
    for name in ORDER:
        rec, v, missing = _stage_record(cfg, store, name, complete, keys_checked)
        if v.complete and v.manifest is not None and not missing:
            complete[name] = v.manifest
        if v.manifest is not None:
            m = v.manifest.manifest
            rec["finished_at"] = m.finished_at
            rec["duration_s"] = m.stats.get("duration_s")
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


def run_summary(cfg: PipelineConfig, config_given: bool = True) -> dict[str, Any]:
    store = open_run_store(cfg, create=False)
    require_run(store, cfg.run_id)
    judged, keys_checked = judged_config(cfg, store, config_given)
    live = read_state(store, cfg.run_id)
    holder = live_holder(store, cfg.run_id)
    return {"run_id": cfg.run_id, "store": store.uri, "backend": judged.backend,
            "in_progress": holder is not None,
            "held_by": {"host": holder.host, "pid": holder.pid, "cwd": holder.cwd} if holder else None,
            "last_outcome": live.get("outcome"),
            "input_keys_checked": keys_checked,
            "serve": {k: live.get("serve", {}).get(k) for k in ("state", "url", "pid", "port")} if live.get("serve") else None,
            "stages": collect_status(judged, store, keys_checked)}


def status_table(summary: dict[str, Any], width: int) -> Table:
    """The summary as a table of ``width`` columns: stage, state and elapsed always; then the note
    (why a stage is incomplete, a running stage's progress), the stats, the finish time, as room allows."""
    from eagle3.backend import Progress
    from eagle3.pipeline.live import fmt_duration, fmt_progress
    from eagle3.pipeline.table import Column, fit

    rows = []
    for s in summary["stages"]:
        stats = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (s.get("stats") or {}).items())
        elapsed = s.get("elapsed_s") if s["state"] == "running" else s.get("duration_s")
        note = s.get("reason") or ""
        if s["state"] == "running" and s.get("progress"):
            p = s["progress"]
            note = fmt_progress(Progress(p.get("done") or 0, p.get("total"), p.get("unit") or ""))
        finished = (s.get("finished_at") or "-")[:19].replace("T", " ")
        rows.append([s["stage"], s["state"], fmt_duration(elapsed), note, stats or "-", finished])
    title = f"run {summary['run_id']} ({summary['store']})" + (" — in progress" if summary["in_progress"] else "")
    columns = [Column("stage", keep=True), Column("state", keep=True), Column("elapsed", keep=True),
               Column("note", fold=True), Column("stats", fold=True), Column("finished")]
    styles = {"complete": "green", "running": "bold cyan", "incomplete": "yellow", "not run": "dim"}
    return fit(title, columns, rows, width, styles)
