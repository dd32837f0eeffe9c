"""Ordinary conditions of the machine as one line naming the path, and commands that only read creating nothing."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.errors import StoreError
from eagle3.store import open_store
from tests.committed import path_of
from tests.fabricated_upstream import commit_fabricated_generate

runner = CliRunner()


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refusing_folder() -> tuple[Path, str]:
    """A folder the kernel refuses files in, even to root (sysfs), and the reason it gives."""
    folder = Path("/sys/kernel")
    probe = folder / "eagle3-probe"
    try:
        probe.mkdir()
    except OSError as e:
        return folder, e.strerror
    probe.rmdir()
    pytest.skip("no folder here refuses writes (no sysfs)")


def test_a_store_that_refuses_writes_is_one_line_naming_the_object(workdir):
    folder, reason = _refusing_folder()
    r = runner.invoke(app, ["run", "pipeline", "--run-id", "x", "--store", f"file://{folder}"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [f"error: cannot write file://{folder}/x/_run/lease.json: {reason}"]


def test_a_full_disk_is_one_line_naming_the_object(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path}/s")

    def disk_full(fd: int) -> None:  # test double of the OS: the disk fills up as the object is flushed
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("eagle3.store.local.os.fsync", disk_full)
    with pytest.raises(StoreError) as e:
        store.put_bytes("r/gen/part-0.jsonl", b"x" * 100)
    assert str(e.value) == f"cannot write file://{tmp_path}/s/r/gen/part-0.jsonl: No space left on device"
    assert list((tmp_path / "s").rglob("*.partial")) == [], "the half-written file is removed"
    # an error about another file passes through as it is: it is not the store's disk
    with pytest.raises(FileNotFoundError):
        with store.writer("r/k") as w:
            w.write(open(tmp_path / "no-such-input", "rb").read())


def test_an_os_error_in_a_command_is_one_line_with_its_path(workdir):
    store = f"file://{workdir}/s"
    cfg = load_config(None, {"run_id": "r", "store.uri": store})
    commit_fabricated_generate(open_store(store), cfg, vocab_size=1024)
    folder, reason = _refusing_folder()
    r = runner.invoke(app, ["report", "--run-id", "r", "--store", store, "--out", str(folder / "report")])
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [f"error: {folder / 'report'}: {reason}"]


def test_a_binary_config_and_a_duplicate_key_are_config_errors(workdir):
    (workdir / "bin.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    r = runner.invoke(app, ["verify", "-c", "bin.yaml"])
    assert r.exit_code == 2 and r.output.strip() == "error: config file bin.yaml is not text (not UTF-8): is it the YAML config?"
    (workdir / "dup.yaml").write_text("run_id: a\ntrain:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n")
    r = runner.invoke(app, ["verify", "-c", "dup.yaml"])
    assert r.exit_code == 2 and r.output.strip() == "error: config file dup.yaml line 5: duplicate key 'lr'"
    (workdir / "dup2.yaml").write_text("run_id: a\nrun_id: b\n")
    assert "duplicate key 'run_id'" in runner.invoke(app, ["verify", "-c", "dup2.yaml"]).output
    (workdir / "ok.yaml").write_text("train:\n  lr: 0.1\nvocab:\n  draft_vocab_size: 64\n")  # one key in two sections
    assert load_config(workdir / "ok.yaml").train.lr == 0.1
    from eagle3.config import read_config_file

    (workdir / "merge.yaml").write_text("a: &base\n  lr: 1\n  x: 2\nb:\n  <<: *base\n  lr: 3\n")  # a merge may override
    assert read_config_file(workdir / "merge.yaml")["b"] == {"lr": 3, "x": 2}


@pytest.mark.parametrize("argv, code, says", [
    (["status"], 1, "no such store folder"),
    (["verify"], 1, "no such store folder"),
    (["show", "drafter"], 1, "no such store folder"),
    (["report"], 1, "no such store folder"),
    (["logs", "generate"], 1, "no log for generate in run x yet"),
    (["down"], 0, "nothing of run x is running"),
])
def test_commands_that_read_create_nothing(workdir, argv, code, says):
    r = runner.invoke(app, [*argv, "--run-id", "x", "--store", f"file://{workdir}/no/store"])
    assert r.exit_code == code and says in r.output, r.output
    assert list(workdir.iterdir()) == [], "no store folder, no .eagle3"


def test_deep_verify_of_a_zeroed_upstream_object_reports_it_and_goes_on(workdir, tiny_cache_dir):
    store_uri = f"file://{workdir}/s"
    cfg = load_config(None, {"run_id": "z", "store.uri": store_uri, "target.cache_dir": str(tiny_cache_dir),
                             "vocab.draft_vocab_size": 64})
    store = open_store(store_uri)
    commit_fabricated_generate(store, cfg, vocab_size=1024)
    run_stage(cfg, "vocab")
    victim = path_of(store, "z", "generate", "tokenized.safetensors")
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size: only a re-hash or a reader notices
    r = runner.invoke(app, ["verify", "--run-id", "z", "--store", store_uri, "--deep"])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if not ln.startswith("note: ")]  # no config recorded: keys unchecked
    assert lines[:4] == ["generate: FAILED",
                         f"  corrupted object {store_uri}/z/generate/{victim.parent.name}/tokenized.safetensors: "
                         f"sha256 differs from the manifest",
                         "vocab: FAILED", "  needs generate, which is not complete"]
    assert "unexpected" not in r.output and all(f"{n}: " in r.output for n in ("extract", "train", "export", "evaluate"))


def test_a_content_check_that_cannot_read_its_objects_is_one_problem(tmp_path):
    from safetensors.torch import load_file

    from eagle3.contract import guarded

    bad = tmp_path / "zeros.safetensors"
    bad.write_bytes(b"\0" * 64)
    check = guarded("train", lambda store, manifest: load_file(str(bad)) and [])
    (problem,) = check(None, None)
    assert problem.startswith("content check of train could not read its objects: SafetensorError: ")
