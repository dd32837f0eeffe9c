"""``eagle3ctl render``: every Kubernetes object of the run as YAML, touching no cluster."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from eagle3.cli.common import ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors


@one_line_errors
def render(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    namespace: Annotated[Optional[str], typer.Option("--namespace", "-n", help="Namespace (default: config, kubeconfig, else 'default').")] = None,
) -> None:
    """Print every object of the run (the Helm chart rendered with values from the config)."""
    from eagle3.k8s.render import render_yaml

    typer.echo(render_yaml(config_from(config, run_id, store), namespace), nl=False)
