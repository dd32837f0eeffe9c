"""``eagle3ctl render``: every Kubernetes object of the run as YAML, touching no cluster; or, with
``--values FILE``, the Helm values that make ``helm install -f FILE`` create the same objects."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from eagle3.cli.common import ConfigOpt, RunIdOpt, StoreOpt, config_from, one_line_errors


@one_line_errors
def render(
    config: ConfigOpt = None,
    run_id: RunIdOpt = None,
    store: StoreOpt = None,
    namespace: Annotated[Optional[str], typer.Option("--namespace", "-n", help="Namespace (default: config, kubeconfig, else 'default').")] = None,
    values: Annotated[Optional[Path], typer.Option("--values", help="Write the Helm values for `helm install -f FILE` instead (local input files are uploaded to the store first).")] = None,
    controller: Annotated[bool, typer.Option("--controller", help="With --values: run the whole pipeline in-cluster (the controller Job).")] = False,
) -> None:
    """Print every object of the run (the Helm chart rendered with values from the config)."""
    from eagle3.k8s.inputs import local_inputs, local_path, with_inputs

    cfg = config_from(config, run_id, store)
    if values is not None:
        import yaml

        from eagle3.k8s.inputs import upload_inputs
        from eagle3.k8s.render import install_values, release_name
        from eagle3.runs import open_run_store

        inputs = local_inputs(cfg)  # the controller reads them from the store: they must exist here
        if inputs:
            for line in upload_inputs(open_run_store(cfg), inputs):
                typer.echo(line, err=True)
        values.write_text(yaml.safe_dump(install_values(with_inputs(cfg, inputs), controller), sort_keys=False))
        ns = f" -n {namespace or cfg.kubernetes.namespace}" if (namespace or cfg.kubernetes.namespace) else ""
        typer.echo(f"wrote {values}: helm install {release_name(cfg)} charts/eagle3{ns} -f {values}", err=True)
        return
    from eagle3.k8s.render import render_yaml

    inputs = local_inputs(cfg, missing_ok=True)
    found = {i.field for i in inputs}
    for field, value in (("generate.prompts", cfg.generate.prompts), ("evaluate.prompts", cfg.evaluate.prompts)):
        if local_path(value) is not None and field not in found:
            typer.echo(f"warning: {field}: {value} does not exist here; a run uploads it to the store "
                       f"(<run>/inputs/<sha256>/) before the first Job, and the pods read it from there", err=True)
    typer.echo(render_yaml(with_inputs(cfg, inputs), namespace), nl=False)
