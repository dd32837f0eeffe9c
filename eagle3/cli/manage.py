"""``eagle3ctl init``, ``report`` and ``down``: write a config, summarise a run, stop a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle3.cli.common import BackendOpt, ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors


@one_line_errors
def init(
    path: Annotated[Path, typer.Argument(help="Where to write the config.")] = Path("eagle3.yaml"),
    model: Annotated[Optional[str], typer.Option("--model", help="target.model to put in the config.")] = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a config with every setting, its default and what it means."""
    from eagle3.config import derived_run_id
    from eagle3.pipeline.init import write_config

    out, notes = write_config(path, {"target.model": model, "run_id": run_id, "store.uri": store}, overwrite=force)
    for line in notes:
        typer.echo(line)
    named = run_id or f"{derived_run_id(out)} (named after the file; set run_id in it to choose a name)"
    typer.echo(f"wrote {out}, run {named}; run it with: eagle3ctl run pipeline -c {out}")


@one_line_errors
def report(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    html: Annotated[bool, typer.Option("--html", help="One self-contained HTML file instead of Markdown.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the report and its plots.")] = None,
) -> None:
    """Summarise the run: key stats per stage, loss curves, acceptance per position, vocab coverage."""
    from eagle3.pipeline.report import build_report

    typer.echo(str(build_report(config_from(config, run_id, store), out, html=html)))


@one_line_errors
def down(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    backend: BackendOpt = None,
) -> None:
    """Stop whatever the run started (server, stages); the store is left as it is."""
    from eagle3.cli.backends import open_backend
    from eagle3.errors import RunNotFound
    from eagle3.pipeline.runstate import RunState
    from eagle3.runs import open_run_store

    cfg = config_from(config, run_id, store, backend)
    try:  # a local run with no store folder has started nothing; a cluster's objects are looked up there
        run_store = open_run_store(cfg, create=cfg.backend != "local")
    except RunNotFound:
        typer.echo(f"nothing of run {cfg.run_id} is running")
        return
    removed = open_backend(cfg, RunState(run_store, cfg.run_id)).down()
    for what in removed:
        typer.echo(f"stopped {what}")
    if not removed:
        typer.echo(f"nothing of run {cfg.run_id} is running")
