"""``eagle3ctl render`` prints exactly what the chart renders for the config, touching no cluster."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.k8s.render import render_run

KIMI = Path(__file__).resolve().parents[2] / "examples" / "kimi-k2.5.yaml"


def test_render_prints_the_chart_objects_for_the_config() -> None:
    result = CliRunner().invoke(app, ["render", "-c", str(KIMI), "--namespace", "llm"])
    assert result.exit_code == 0, result.output
    printed = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert printed == render_run(load_config(KIMI), "llm")
    jobs = {o["metadata"]["labels"]["eagle3.io/stage"] for o in printed if o["kind"] == "Job"}
    assert jobs == {"generate", "vocab", "extract", "train", "export", "evaluate"}


def test_render_bad_config_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kubernetes:\n  gpus_per_nod: 8\n")
    result = CliRunner().invoke(app, ["render", "-c", str(bad)])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid config") and "gpus_per_nod" in lines[0]


def test_render_values_gives_helm_install_the_same_objects(tmp_path: Path) -> None:
    """`eagle3ctl render --values F` then `helm template -f F`: the namespace setup and the run's
    ConfigMap as eagle3ctl renders them, and, with run.objects on, every object of the run."""
    import helm_python as helm

    from eagle3.k8s.render import CHART_DIR, parse_manifests, sort_objects

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "hi"}\n')
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(KIMI.read_text().replace("/data/prompts.jsonl", str(prompts))
                        .replace("uri: s3://my-bucket/eagle3", f"uri: file://{tmp_path}/store")
                        + "  store_pvc: eagle3-store\n")
    out = tmp_path / "values.yaml"
    result = CliRunner().invoke(app, ["render", "-c", str(cfg_file), "--values", str(out), "--controller"])
    assert result.exit_code == 0, result.output
    assert "uploaded" in result.stderr and f"helm install eagle3-kimi-k25-eagle3 charts/eagle3 -n eagle3 -f {out}" in result.stderr
    values = helm.values_from_yaml(out.read_text())
    assert values["config"]["generate"]["prompts"].startswith(f"file://{tmp_path}/store/kimi-k25-eagle3/inputs/")

    def template(v: dict) -> list[dict]:
        with helm.Chart.load(CHART_DIR) as chart:
            chart.validate_schema(v)
            return sort_objects(parse_manifests(chart.render(v, name="eagle3-kimi-k25-eagle3", namespace="eagle3", is_install=True)))

    installed = template(values)
    printed = [d for d in yaml.safe_load_all(CliRunner().invoke(app, ["render", "-c", str(cfg_file)]).stdout) if d]
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in printed}
    kinds = sorted(o["kind"] for o in installed)
    assert kinds == ["ConfigMap", "Job", "Pod", "Role", "RoleBinding", "Secret", "ServiceAccount"]  # controller Job, test Pod
    for o in installed:
        if o["kind"] in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap"):
            assert o == by_key[(o["kind"], o["metadata"]["name"])], o["kind"]
    values["run"]["objects"], values["controller"]["enabled"], values["tests"]["enabled"] = True, False, False
    assert template(values) == printed


def test_render_values_with_a_missing_local_file_is_one_line_naming_the_field(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["render", "-c", str(KIMI), "--values", str(tmp_path / "v.yaml")])
    assert result.exit_code == 2
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: generate.prompts: file not found: /data/prompts.jsonl")
    assert not (tmp_path / "v.yaml").exists()


def test_render_warns_about_a_local_file_it_cannot_see(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["render", "-c", str(KIMI)])
    assert result.exit_code == 0
    assert result.stderr.startswith("warning: generate.prompts: /data/prompts.jsonl does not exist here")
