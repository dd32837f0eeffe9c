"""``eagle3ctl status``, ``logs STAGE`` and ``show drafter``: look at a run, from any shell."""

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
    """Each stage's state from its manifest (complete / incomplete and why / not run) with key stats.

    With --run-id alone the run is judged against the config recorded in the store for it."""
    from rich.console import Console

    from eagle3.pipeline.status import run_summary, status_table

    summary = run_summary(config_from(config, run_id, store), config_given=config is not None)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    console = Console()
    console.print(status_table(summary, console.width))
    if not summary["input_keys_checked"]:
        typer.echo("note: no config given and none recorded in the store: input keys are not checked")


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
    from eagle3.cli.backends import open_backend
    from eagle3.errors import RunNotFound
    from eagle3.pipeline.runstate import RunState
    from eagle3.runs import open_run_store
    from eagle3.stages import get_stage

    if stage != "serve":
        get_stage(stage)
    cfg = config_from(config, run_id, store, backend)
    try:
        b = open_backend(cfg, RunState(open_run_store(cfg, create=False), cfg.run_id))
    except RunNotFound:  # no store folder: nothing ran, so there is no log (and none is made)
        b = None
    lines = b.logs(stage, tail=tail or None) if b is not None else []
    if b is None or (not lines and not follow):
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


@one_line_errors
def show(
    what: Annotated[str, typer.Argument(help="drafter: where the run's exported drafter is (its folder on a file:// "
                                        "store, else its URI), as the export manifest names it.")],
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
) -> None:
    """Print where something of the run is; a stable command for a path that changes with each attempt."""
    from eagle3.errors import ConfigError, RunNotFound
    from eagle3.manifest import verify_stage
    from eagle3.pipeline.report import drafter_location
    from eagle3.runs import open_run_store, require_run

    if what != "drafter":
        raise ConfigError(f"show {what!r}: nothing of that name; show takes: drafter")
    cfg = config_from(config, run_id, store)
    run_store = open_run_store(cfg, create=False)
    require_run(run_store, cfg.run_id)
    v = verify_stage(run_store, cfg.run_id, "export")
    if not v.complete:
        raise RunNotFound(f"run {cfg.run_id} has no exported drafter: export is not complete ({v.reason})")
    typer.echo(drafter_location(cfg, run_store))
