"""``eagle3ctl run pipeline`` and ``eagle3ctl run stage NAME``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle3.cli.common import HELP, BackendOpt, ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors

ReuseOpt = Annotated[Optional[str], typer.Option("--reuse-from", metavar="RUN", help="Adopt the stages of run RUN (same store) whose config, code and inputs are this run's, instead of running them: their objects are copied (hard links on disk, server-side copies on S3) and verified first.")]
CancelOpt = Annotated[bool, typer.Option("--cancel", help="Kubernetes: Ctrl-C deletes the running Jobs (default: they run on, and the next run attaches to them).")]

app = typer.Typer(add_completion=False, context_settings=HELP, help="Run the pipeline, or one stage, on the configured backend.")


@app.callback(invoke_without_command=True)
def _group(ctx: typer.Context) -> None:
    """Run the pipeline, or one stage, on the configured backend."""
    if ctx.invoked_subcommand is None:  # bare `eagle3ctl run`: the help, and success
        typer.echo(ctx.get_help())
        raise typer.Exit()


def _finish(run: object) -> None:
    from eagle3.pipeline.runner import summary_lines

    for line in summary_lines(run):  # type: ignore[arg-type]
        typer.echo(line)
    result = run.result  # type: ignore[attr-defined]
    if result.interrupted:
        raise typer.Exit(130)
    if not result.ok:
        raise typer.Exit(1)


def _announce(config: Path | None, cfg: object) -> None:
    from eagle3.cli.common import announce_run_id

    line = announce_run_id(config, cfg)  # type: ignore[arg-type]
    if line:
        typer.echo(line)


def _cancel(cfg: object, cancel: bool) -> object:
    if not cancel:
        return cfg
    k8s = cfg.kubernetes.model_copy(update={"cancel_on_interrupt": True})  # type: ignore[attr-defined]
    return cfg.model_copy(update={"kubernetes": k8s})  # type: ignore[attr-defined]


@app.command("pipeline")
@one_line_errors
def pipeline(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    backend: BackendOpt = None,
    start: Annotated[Optional[str], typer.Option("--from", help="Run this stage and the stages after it only.")] = None,
    until: Annotated[Optional[list[str]], typer.Option("--until", help="Run this stage and the stages before it only "
                                                      "(repeatable: each stage given and the stages before it).")] = None,
    force: Annotated[Optional[list[str]], typer.Option("--force", help="Rerun this stage (and so its dependents) even if complete.")] = None,
    reuse_from: ReuseOpt = None,
    cancel: CancelOpt = False,
) -> None:
    """Run every stage in DAG order; stages complete for the same input key are skipped, partial ones resume."""
    from eagle3.cli.backends import open_backend
    from eagle3.pipeline.runner import run_pipeline
    from eagle3.pipeline.scheduler import Selection

    cfg = _cancel(config_from(config, run_id, store, backend), cancel)
    _announce(config, cfg)
    _finish(run_pipeline(cfg, Selection(start=start, until=tuple(until or ()), force=tuple(force or ())), typer.echo,
                         open_backend=open_backend, reuse_from=reuse_from))


@app.command("stage")
@one_line_errors
def stage(
    name: Annotated[str, typer.Argument(help="generate, vocab, extract, train, export or evaluate")],
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    backend: BackendOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Rerun even if complete.")] = False,
    reuse_from: ReuseOpt = None,
    cancel: CancelOpt = False,
) -> None:
    """Run one stage on the backend (its upstream stages must be complete); starts the server for generate."""
    from eagle3.cli.backends import open_backend
    from eagle3.pipeline.runner import run_pipeline
    from eagle3.pipeline.scheduler import Selection

    cfg = _cancel(config_from(config, run_id, store, backend), cancel)
    _announce(config, cfg)
    _finish(run_pipeline(cfg, Selection(only=(name,), force=(name,) if force else ()), typer.echo,
                         open_backend=open_backend, reuse_from=reuse_from))


__all__ = ["app", "Path"]
