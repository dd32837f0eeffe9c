"""``eagle3ctl status`` and ``eagle3ctl logs STAGE``: look at a run, from any shell."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from eagle3.cli.common import BackendOpt, ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors


@one_line_errors
def status(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Each stage's state from its manifest (complete / incomplete and why / not run) with key stats."""
    from rich.console import Console
    from rich.table import Table

    from eagle3.pipeline.status import run_summary

    summary = run_summary(config_from(config, run_id, store))
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    table = Table(title=f"run {summary['run_id']} ({summary['store']})" + (" — in progress" if summary["in_progress"] else ""),
                  title_justify="left")
    for col in ("stage", "state", "finished", "stats", "note"):
        table.add_column(col, overflow="fold")
    for s in summary["stages"]:
        stats = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in (s.get("stats") or {}).items())
        note = s.get("reason") or ""
        if s["state"] == "running":
            p = s.get("progress") or {}
            done = f"{p['done']:g}/{p['total']:g} {p['unit']}" if p.get("total") else f"{p.get('done', 0):g} {p.get('unit', '')}"
            note = f"{done}, {s['elapsed_s']:.0f}s elapsed" if p else f"{s['elapsed_s']:.0f}s elapsed"
        table.add_row(s["stage"], s["state"], (s.get("finished_at") or "-")[:19], stats or "-", note)
    Console(width=max(100, Console().width)).print(table)


@one_line_errors
def logs(
    stage: Annotated[str, typer.Argument(help="A stage name, or serve.")],
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    backend: BackendOpt = None,
    tail: Annotated[int, typer.Option("--tail", "-n", help="Last N lines (0 = all).")] = 0,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
) -> None:
    """Print the log of the stage's latest attempt."""
    from eagle3.context import open_run_store
    from eagle3.pipeline.runner import open_backend
    from eagle3.pipeline.runstate import RunState
    from eagle3.stages import get_stage

    if stage != "serve":
        get_stage(stage)
    cfg = config_from(config, run_id, store, backend)
    b = open_backend(cfg, RunState(open_run_store(cfg), cfg.run_id))
    lines = b.logs(stage, tail=tail or None)
    if not lines and not follow:
        typer.echo(f"no log for {stage} in run {cfg.run_id} yet", err=True)
        raise typer.Exit(1)
    for ln in lines:
        typer.echo(ln)
    seen = len(b.logs(stage))
    while follow:
        time.sleep(1.0)
        now = b.logs(stage)
        if len(now) < seen:  # a new attempt started
            seen = 0
        for ln in now[seen:]:
            typer.echo(ln)
        seen = len(now)
