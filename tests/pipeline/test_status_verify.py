"""`status` and `verify` read by --run-id agree, from any directory, judged against the config the run's
output was made with; a failed later attempt changes nothing; a rerun says why each stage reruns.

The pipeline runs through the real CLI, runner and scheduler; the backend is the test double of
tests/pipeline/fakes.py (stages commit real manifests under the input keys the stages compute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.pipeline.runstate import run_dir
from eagle3.stages import ORDER
from eagle3.store import open_store
from tests.committed import path_of
from tests.pipeline.fakes import FakeBackend

runner = CliRunner()


@dataclass
class Project:
    home: Path  # holds prompts.jsonl (named by relative path) and run.yaml
    store: str
    cache: Path
    fails: set[str] = field(default_factory=set)  # stages the double fails

    def config(self, name: str = "run.yaml", **over) -> Path:
        cfg = {"run_id": "r", "store": {"uri": self.store}, "generate": {"prompts": "prompts.jsonl"},
               "target": {"model": "builtin:tiny-llama", "cache_dir": str(self.cache)}, "vocab": {"draft_vocab_size": 64}}
        for dotted, value in over.items():
            section, key = dotted.split(".")
            cfg.setdefault(section, {})[key] = value
        (self.home / name).write_text(yaml.safe_dump(cfg))
        return self.home / name


@pytest.fixture()
def project(tmp_path: Path, tiny_cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    home = tmp_path / "project"
    home.mkdir()
    (home / "prompts.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    p = Project(home, f"file://{tmp_path / 'store'}", tiny_cache_dir)
    p.config()
    monkeypatch.chdir(home)
    monkeypatch.setattr("eagle3.cli.backends.open_backend",
                        lambda cfg, state: FakeBackend(cfg, open_store(cfg.store.uri), fail=p.fails))
    return p


def looks(store: str) -> tuple[dict, int, str]:
    """What `status --json` and `verify` say of run r, read by --run-id alone."""
    s = runner.invoke(app, ["status", "--run-id", "r", "--store", store, "--json"])
    assert s.exit_code == 0, s.output
    v = runner.invoke(app, ["verify", "--run-id", "r", "--store", store])
    return {x["stage"]: x["state"] for x in json.loads(s.output)["stages"]}, v.exit_code, v.output


def test_status_and_verify_agree_from_anywhere_and_ignore_a_failed_attempt(project: Project, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    r = runner.invoke(app, ["run", "pipeline", "-c", "run.yaml"])
    assert r.exit_code == 0, r.output
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for where in (project.home, elsewhere):  # the prompts file is named relative to the project folder
        monkeypatch.chdir(where)
        states, rc, out = looks(project.store)
        assert states == {n: "complete" for n in ORDER} and rc == 0, (where, states, out)

    # a later attempt with a mistyped model: its generate fails, nothing is committed
    monkeypatch.chdir(project.home)
    project.config("typo.yaml", **{"target.model": "someorg/no-such-model"})
    project.fails.add("generate")
    r = runner.invoke(app, ["run", "pipeline", "-c", "typo.yaml"])
    assert r.exit_code == 1 and "stage generate failed" in r.output, r.output
    monkeypatch.chdir(elsewhere)
    states, rc, out = looks(project.store)
    assert states == {n: "complete" for n in ORDER} and rc == 0, (states, out)

    # given the typo config, both judge against it: generate (and all after it) is stale for it
    given = runner.invoke(app, ["status", "-c", str(project.home / "typo.yaml"), "--json"])
    assert {x["stage"]: x["state"] for x in json.loads(given.output)["stages"]}["generate"] == "incomplete"
    assert runner.invoke(app, ["verify", "-c", str(project.home / "typo.yaml")]).exit_code == 1


def test_a_rerun_says_why_each_stage_reruns(project: Project) -> None:
    assert runner.invoke(app, ["run", "pipeline", "-c", "run.yaml"]).exit_code == 0
    victim = path_of(open_store(project.store), "r", "extract", "out.txt")
    victim.write_text(victim.read_text().upper())  # same size, other bytes
    project.config(**{"vocab.draft_vocab_size": 32})
    r = runner.invoke(app, ["run", "pipeline", "-c", "run.yaml"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "vocab: rerun: the config changed (vocab.draft_vocab_size: 64 -> 32)" in lines
    assert "extract: rerun: corrupted object out.txt: sha256 differs from the manifest" in lines
    assert "train: rerun: extract, vocab runs again" in lines
    assert "export: rerun: train, extract, vocab runs again" in lines
    assert "evaluate: rerun: export runs again" in lines
    assert not any(ln.startswith("generate: rerun") for ln in lines), "generate is complete: it is skipped"


def test_local_logs_are_kept_per_store_and_run(tmp_path: Path) -> None:
    one, two = f"file://{tmp_path}/a", f"file://{tmp_path}/b"
    assert run_dir("r", one) != run_dir("r", two) and run_dir("r", one) == run_dir("r", one)
    assert run_dir("r", one).name.startswith("r-") and run_dir("r", one) != run_dir("r2", one)


def test_an_attempt_that_ends_complete_records_its_config_too(project: Project, tmp_path: Path) -> None:
    """A run whose stages were all adopted or skipped commits nothing, yet its output is its config's."""
    assert runner.invoke(app, ["run", "pipeline", "-c", "run.yaml"]).exit_code == 0
    recorded = tmp_path / "store/r/_run/config.json"
    first = json.loads(recorded.read_text())
    assert first["generate"]["prompts"] == str(project.home / "prompts.jsonl"), "by absolute path"
    recorded.unlink()
    r = runner.invoke(app, ["run", "pipeline", "-c", "run.yaml"])
    assert r.exit_code == 0 and r.output.count(": skipped (complete") == len(ORDER)
    assert json.loads(recorded.read_text()) == first
