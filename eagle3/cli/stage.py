"""``eagle3 stage NAME``: the one entrypoint every backend runs for a stage."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from eagle3.cli.common import HELP, ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors, run_app

app = typer.Typer(add_completion=False, no_args_is_help=True, context_settings=HELP, help="Run one eagle3 pipeline stage.")


@app.callback()
def _root() -> None:
    """eagle3: stage entrypoints (the images run these)."""


@app.command("stage")
@one_line_errors
def stage(
    name: Annotated[str, typer.Argument(help="generate, vocab, extract, train, export or evaluate")],
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    endpoint: Annotated[Optional[str], typer.Option(help="OpenAI-compatible base URL (generate).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rerun even if complete.")] = False,
) -> None:
    """Run stage NAME unless its manifest is complete for the same input key."""
    from eagle3.context import rank, run_stage

    from eagle3.errors import ConfigError
    from eagle3.settings.serve import check_endpoint_url

    cfg = config_from(config, run_id, store)
    if endpoint is not None:
        try:
            endpoint = check_endpoint_url(endpoint)
        except ValueError as e:
            raise ConfigError(f"--endpoint: {e}") from None
    stats = run_stage(cfg, name, force=force, endpoint=endpoint or cfg.serve.endpoint)
    if stats is not None and rank() == 0:  # under torchrun only rank 0 commits
        typer.echo(f"stage {name}: committed", err=True)


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
