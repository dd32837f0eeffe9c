"""``eagle3ctl status``: each stage's state from the manifests, with what a running run reports.

A run read with ``-c`` is judged against that config (what ``run`` would do with it); a run read
by ``--run-id`` alone against the config recorded in the store for it, the config of its latest
attempt that committed a stage or ended complete (``eagle3.runs.judged_config``): the
same answer as ``verify``, from any directory, whatever later attempt failed before committing.
"""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table

from eagle3.config import PipelineConfig
from eagle3.contract import NOT_STARTED, StageVerdict, judge_run
from eagle3.pipeline.lease import live_holder
from eagle3.pipeline.runstate import read_state
from eagle3.runs import judged_config, open_run_store, require_run
from eagle3.stages import STAGES
from eagle3.store import ObjectStore

HEADLINE_STATS = ("samples", "num_samples", "tokens", "num_tokens", "coverage", "shards", "steps", "final_loss",
                  "mean_acceptance_length")


def _stage_record(sv: StageVerdict, store: ObjectStore) -> dict[str, Any]:
    rec: dict[str, Any] = {"stage": sv.stage, "resource": STAGES[sv.stage].resource}
    if sv.waits_for:
        rec["state"] = "not run" if sv.state == NOT_STARTED else "incomplete"
        rec["reason"] = sv.reason
    elif sv.complete:
        rec["state"], rec["reason"] = "complete", ""
    elif sv.state == NOT_STARTED:
        rec["state"], rec["reason"] = "not run", ""
    else:  # objects named by their key: the store is in the title
        rec["state"], rec["reason"] = "incomplete", sv.reason.replace(f"{store.uri}/", "")
    if sv.manifest is not None:
        m = sv.manifest.manifest
        rec["finished_at"] = m.finished_at
        rec["duration_s"] = m.stats.get("duration_s")
        rec["stats"] = {k: m.stats[k] for k in HEADLINE_STATS if k in m.stats}
    return rec


def collect_status(cfg: PipelineConfig, store: ObjectStore | None = None, keys_checked: bool = True) -> list[dict[str, Any]]:
    """One record per stage: complete / incomplete (with the reason) / not run / waiting for upstream."""
    store = store or open_run_store(cfg, create=False)
    live = read_state(store, cfg.run_id)
    running = live_holder(store, cfg.run_id) is not None
    out: list[dict[str, Any]] = []
    for name, sv in judge_run(cfg, store, keys=keys_checked).items():
        rec = _stage_record(sv, store)
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
