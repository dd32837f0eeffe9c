"""``eagle3ctl``: the user's command. Commands parse, call a library function, print."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from eagle3.cli.common import HELP, ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors, run_app, version_text

app = typer.Typer(add_completion=False, context_settings=HELP, help="Train EAGLE-3 drafters as manifest-checked stages.")


from eagle3.cli import inspect as _inspect  # noqa: E402
from eagle3.cli import manage as _manage  # noqa: E402
from eagle3.cli.render import render as _render  # noqa: E402
from eagle3.cli.run import app as _run_app  # noqa: E402

app.add_typer(_run_app, name="run")
app.command("status")(_inspect.status)
app.command("logs")(_inspect.logs)
app.command("show")(_inspect.show)
app.command("report")(_manage.report)
app.command("down")(_manage.down)
app.command("init")(_manage.init)
app.command("render")(_render)


def _version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """eagle3ctl: run, inspect and verify EAGLE-3 drafter pipelines."""
    if ctx.invoked_subcommand is None:  # bare `eagle3ctl`: the help, and success
        typer.echo(ctx.get_help())
        raise typer.Exit()


@app.command()
@one_line_errors
def verify(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    stage: Annotated[Optional[list[str]], typer.Option("--stage", help="Stage(s) to verify; default all.")] = None,
    deep: Annotated[bool, typer.Option("--deep", help="Also check sha256 and contents.")] = False,
) -> None:
    """Check the run's manifests; exit non-zero naming any missing, truncated or corrupted object."""
    from eagle3.verify import verify_run

    cfg = config_from(config, run_id, store)
    ok = verify_run(cfg, stage or None, deep=deep, echo=typer.echo, config_given=config is not None)
    if not ok:
        raise typer.Exit(1)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
