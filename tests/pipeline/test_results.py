"""What a finished run hands the user: the acceptance length (k, per position), where the drafter is
(and a command that always finds it), a report that says what its numbers mean."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.evaluate.report import summarize
from eagle3.manifest import StageOutput
from eagle3.pipeline.report import MAL_DEFINITION, acceptance_line, to_markdown
from eagle3.pipeline.runner import result_lines
from eagle3.store import open_store
from tests.committed import put_required

runner = CliRunner()


def _report() -> dict:
    """An evaluate report as the stage computes it: 4 verify steps at k=3."""
    return summarize(3, accept_lengths=[4, 2, 3, 1], accepted_at=[3, 2, 1], tokens_generated=10)


def test_the_acceptance_line_adds_up_to_the_mean_acceptance_length():
    report = _report()
    line = acceptance_line(report)
    assert line == ("mean acceptance length 2.5 at k=3: 1 (the target's bonus token) + 0.75 + 0.50 + 0.25 "
                    "(drafts accepted at positions 1..3)")
    parts = [float(x) for x in re.findall(r"\+ (\d\.\d\d)", line)]
    assert 1 + sum(parts) == pytest.approx(report["mean_acceptance_length"])
    assert acceptance_line(None) is None and acceptance_line({"mean_acceptance_length": None}) is None


def test_the_report_states_k_and_defines_the_mean_acceptance_length(tmp_path):
    cfg = load_config(None, {"run_id": "r", "store.uri": f"file://{tmp_path}"})
    md = to_markdown(cfg, [], _report(), "/x/drafter", f"file://{tmp_path}")
    assert "Mean acceptance length: **2.5** with k = 3 draft tokens per verification step." in md
    assert MAL_DEFINITION in md and "bonus token" in MAL_DEFINITION and "k + 1" in MAL_DEFINITION
    assert "| 2 | 0.6667 | 0.5 |" in md  # conditional, cumulative at position 2


def _commit(store, run_id: str, stage: str, objects: dict[str, bytes]) -> None:
    out = StageOutput(store, run_id, stage, f"key-{stage}", {})
    out.begin()
    for name, data in objects.items():
        out.put_bytes(name, data)
    put_required(out, stage)  # the rest of what the stage always writes
    out.commit({})


def test_show_drafter_prints_the_folder_the_export_manifest_names(tmp_path):
    uri = f"file://{tmp_path / 'store'}"
    store = open_store(uri)
    _commit(store, "r", "generate", {"raw_responses.jsonl": b"{}\n"})
    r = runner.invoke(app, ["show", "drafter", "--run-id", "r", "--store", uri])
    assert r.exit_code == 1 and r.output.startswith("error: run r has no exported drafter: export is not complete (no manifest")
    _commit(store, "r", "export", {"config.json": b"{}", "model.safetensors": b"x"})
    r = runner.invoke(app, ["show", "drafter", "--run-id", "r", "--store", uri])
    assert r.exit_code == 0
    folder = tmp_path / "store" / "r" / "export" / json.loads((tmp_path / "store/r/export/manifest.json").read_text())["root"]
    assert r.output.strip() == str(folder) and (folder / "config.json").exists()
    r = runner.invoke(app, ["show", "model", "--run-id", "r", "--store", uri])
    assert r.exit_code == 2 and "show takes: drafter" in r.output


def test_a_finished_run_ends_with_the_acceptance_the_drafter_and_the_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"file://{tmp_path / 'store'}"
    cfg = load_config(None, {"run_id": "r", "store.uri": uri})
    store = open_store(uri)
    _commit(store, "r", "export", {"config.json": b"{}"})
    _commit(store, "r", "evaluate", {"report.json": json.dumps(_report()).encode()})
    lines = result_lines(cfg, exported=True)
    assert lines[0] == f"acceptance: {acceptance_line(_report())}"
    assert lines[1].startswith("drafter: " + str(tmp_path / "store" / "r" / "export" / "attempt-"))
    assert lines[2] == f"  (the folder of this export; `eagle3ctl show drafter --run-id r --store {uri}` prints the run's current one)"
    assert lines[3].startswith("report: ") and lines[3].endswith("/report.md")
