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
