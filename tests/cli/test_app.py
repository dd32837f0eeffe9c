"""eagle3ctl commands at the boundary: one-line errors, init round trip, status, report, down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.manifest import StageOutput
from eagle3.pipeline.report import STAMP_BAND
from eagle3.store import open_store
from tests.committed import key_of, put_required

runner = CliRunner()


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_init_writes_a_commented_config_that_loads_back(workdir):
    r = runner.invoke(app, ["init", "my.yaml", "--model", "builtin:tiny-deepseek", "--run-id", "r1"])
    assert r.exit_code == 0, r.output
    text = (workdir / "my.yaml").read_text()
    assert "# Aux hidden-state layer ids in vLLM's convention" in text
    cfg = load_config(workdir / "my.yaml")
    assert cfg.target.model == "builtin:tiny-deepseek" and cfg.run_id == "r1"
    r = runner.invoke(app, ["init", "my.yaml"])
    assert r.exit_code == 2 and "exists; pass --force" in r.output


def test_config_errors_are_one_line_before_anything_starts(workdir):
    (workdir / "bad.yaml").write_text("train:\n  lr: -1\n")
    r = runner.invoke(app, ["run", "pipeline", "-c", "bad.yaml"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == ["error: invalid config bad.yaml: train.lr: Input should be greater than 0"]
    r = runner.invoke(app, ["run", "pipeline", "--from", "trian", "--store", f"file://{workdir}/s", "--run-id", "x"])
    assert r.exit_code == 2 and "unknown stage 'trian'" in r.output
    assert not (workdir / ".eagle3").exists(), "nothing may start on a config error"


def test_missing_s3_credentials_are_caught_before_anything_starts(workdir, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(workdir / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(workdir / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = runner.invoke(app, ["run", "pipeline", "--store", "s3://bucket/x", "--run-id", "x"])
    assert r.exit_code != 0 and r.output.startswith("error: ") and len(r.output.strip().splitlines()) == 1
    assert not (workdir / ".eagle3").exists()


def _commit(store, cfg, stage, objects: dict[str, bytes], stats: dict):
    from eagle3.contract import stage_input_key, upstream_digests
    from eagle3.stages import STAGES

    spec = STAGES[stage]
    up = upstream_digests(cfg, spec, store)
    out = StageOutput(store, cfg.run_id, stage, stage_input_key(cfg, spec, up), {k: v.digest for k, v in up.items()})
    out.begin()
    for name, data in objects.items():
        out.put_bytes(name, data)
    put_required(out, stage)
    out.commit(stats)


def _png() -> bytes:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def test_status_and_report_read_the_manifests(workdir):
    store_uri = f"file://{workdir}/store"
    cfg = load_config(None, {"store.uri": store_uri, "run_id": "r2"})
    store = open_store(store_uri)
    _commit(store, cfg, "generate", {"raw_responses.jsonl": b"{}\n"}, {"samples": 3})
    _commit(store, cfg, "vocab", {"coverage.png": _png()}, {"coverage": 0.93})

    r = runner.invoke(app, ["status", "--store", store_uri, "--run-id", "r2", "--json"])
    assert r.exit_code == 0, r.output
    stages = {s["stage"]: s for s in json.loads(r.output)["stages"]}
    assert stages["generate"]["state"] == "complete" and stages["generate"]["stats"]["samples"] == 3
    assert stages["vocab"]["state"] == "complete"
    assert stages["extract"]["state"] == "not run"
    assert stages["train"]["reason"] == "waits for extract"

    r = runner.invoke(app, ["status", "--store", store_uri, "--run-id", "r2"])
    assert r.exit_code == 0 and "complete" in r.output and "not run" in r.output

    r = runner.invoke(app, ["report", "--store", store_uri, "--run-id", "r2"])
    assert r.exit_code == 0, r.output
    md = Path(r.output.strip())
    text = md.read_text()
    assert "| coverage | 0.93 |" in text and "![run r2: Draft-vocab coverage](vocab-coverage.png)" in text
    committed = _image(store.get_bytes(key_of(store, 'r2', "vocab", 'coverage.png')))
    copied = _image((md.parent / "vocab-coverage.png").read_bytes())
    # the committed plot under a band that names the run, drawn in it
    assert copied.size == (committed.size[0], committed.size[1] + STAMP_BAND)
    assert copied.crop((0, STAMP_BAND, *copied.size)).tobytes() == committed.convert("RGB").tobytes()
    assert copied.crop((0, 0, copied.size[0], STAMP_BAND)).convert("L").getextrema()[0] < 100
    assert "## extract" in text and "Not complete: no manifest" in text

    r = runner.invoke(app, ["report", "--store", store_uri, "--run-id", "r2", "--html"])
    html = Path(r.output.strip()).read_text()
    assert "data:image/png;base64," in html and "<td>coverage</td>" in html
    assert "<title>EAGLE-3 drafter run r2</title>" in html
    assert html.count("<img ") == html.count("<figcaption>run r2: ") == 1
    from html.parser import HTMLParser

    class Tags(HTMLParser):  # every opened element is closed, in order (void elements aside)
        stack: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag not in ("meta", "img"):
                self.stack.append(tag)

        def handle_endtag(self, tag):
            assert self.stack.pop() == tag, tag

    parser = Tags()
    parser.feed(html)
    assert parser.stack == []


def _image(data: bytes):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(data))


def test_logs_and_down_of_a_run_that_never_ran(workdir):
    r = runner.invoke(app, ["logs", "extract", "--run-id", "nothing"])
    assert r.exit_code == 1 and "no log for extract" in r.output
    r = runner.invoke(app, ["logs", "trian", "--run-id", "nothing"])
    assert r.exit_code == 2 and "unknown stage" in r.output
    r = runner.invoke(app, ["down", "--run-id", "nothing"])
    assert r.exit_code == 0 and "nothing of run nothing is running" in r.output


def test_kubernetes_backend_is_dispatched_by_flag(workdir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "eagle3.k8s.backend", None)  # as if the module were missing
    r = runner.invoke(app, ["down", "--run-id", "x", "--backend", "kubernetes"])
    assert r.exit_code == 2 and "backend 'kubernetes' is not available" in r.output


def test_acceptance_table_takes_plain_or_named_rates():
    from eagle3.pipeline.report import _rates_table

    assert _rates_table([0.5, 0.25])[2:4] == ["| 1 | 0.5 |", "| 2 | 0.25 |"]
    t = _rates_table({"conditional": [0.5, 0.5], "cumulative": [0.5, 0.25]})
    assert t[0] == "| position | conditional | cumulative |" and t[3] == "| 2 | 0.5 | 0.25 |"
    assert _rates_table(None) == []


def test_a_missing_prompts_file_is_a_config_error_before_anything_starts(workdir):
    r = runner.invoke(app, ["run", "pipeline", "--store", f"file://{workdir}/s", "--run-id", "p"],
                      env={"EAGLE3_GENERATE__PROMPTS": str(workdir / "nope.jsonl")})
    assert r.exit_code == 2, r.output
    assert r.output.strip() == f"error: generate.prompts: file not found: {workdir / 'nope.jsonl'}"
    assert not (workdir / ".eagle3").exists()
