"""``eagle3ctl verify`` on a real S3 server (moto) and on disk: what a user sees.

verify fails (exit 1, a line per problem) on a stage of a started run that has no output, on
a stage whose input key no longer matches the config, and on a run id the store has nothing
for; a same-size byte flip is caught without --deep.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.runs import RUN_CONFIG
from eagle3.store import open_store
from tests.committed import key_of, path_of
from tests.fabricated_upstream import commit_fabricated_generate
from tests.fixtures_s3 import MotoS3

EAGLE3CTL = str(Path(sys.executable).parent / "eagle3ctl")  # the installed console script
LATER = ["train: FAILED", "extract: FAILED", "export: FAILED", "evaluate: FAILED"]


def _commit_vocab(store_uri: str, draft: int = 64) -> None:
    cfg = load_config(None, {"run_id": "r1", "store.uri": store_uri, "vocab.draft_vocab_size": draft})
    commit_fabricated_generate(open_store(store_uri), cfg, vocab_size=500)
    run_stage(cfg, "vocab")


def _verify(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["verify", "--run-id", "r1", *args])
    return r.exit_code, r.output


def _raw_key(uri: str, key: str) -> str:
    return f"{uri.split('/', 3)[3]}/{key}"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EAGLE3CTL, *args], capture_output=True, text=True)


def _config(tmp_path: Path, uri: str, draft: int) -> str:
    path = tmp_path / f"cfg-{draft}.yaml"
    path.write_text(f"run_id: r1\nstore:\n  uri: {uri}\nvocab:\n  draft_vocab_size: {draft}\n")
    return str(path)


def test_local_run_verifies_stage_by_stage(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri)
    cfg = _config(tmp_path, uri, 64)
    code, out = _verify("-c", cfg, "--stage", "vocab", "--deep")
    assert code == 0 and out.strip() == "vocab: ok (3 objects, deep)"
    code, out = _verify("-c", cfg, "--stage", "train")
    assert code == 1
    assert out.splitlines() == ["train: FAILED", f"  not run: the run has started, and train has no output in {uri}/r1/train"]


def test_every_stage_of_a_started_run_must_be_complete(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri)
    store = open_store(uri)
    cfg = _config(tmp_path, uri, 64)
    code, out = _verify("-c", cfg)
    lines = out.splitlines()
    assert code == 1 and "generate: ok (4 objects)" in lines and "vocab: ok (3 objects)" in lines
    assert all(f in lines for f in LATER)  # not run is a failure of a started run, not a pass
    assert f"  not run: the run has started, and evaluate has no output in {uri}/r1/evaluate" in lines
    path_of(store, "r1", "generate", "metadata.json").unlink()
    code, out = _verify("-c", cfg)
    lines = out.splitlines()
    assert lines[:2] == ["generate: FAILED", f"  missing object {uri}/{key_of(store, 'r1', 'generate', 'metadata.json')}"]
    assert "vocab: FAILED" in lines and "  needs generate, which is not complete" in lines


def test_a_deleted_stage_folder_fails_verify(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri)
    cfg = _config(tmp_path, uri, 64)
    assert _verify("-c", cfg, "--stage", "vocab")[0] == 0
    shutil.rmtree(tmp_path / "s/r1/vocab")
    code, out = _verify("-c", cfg, "--stage", "vocab")
    assert code == 1 and out.splitlines() == [
        "vocab: FAILED", f"  not run: the run has started, and vocab has no output in {uri}/r1/vocab"]


def test_a_stale_input_key_fails_and_names_the_setting(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri, draft=64)
    code, out = _verify("-c", _config(tmp_path, uri, 32), "--stage", "vocab")
    assert code == 1
    assert out.splitlines() == ["vocab: FAILED",
                                "  stale: the config changed since it ran (vocab.draft_vocab_size: 64 -> 32)"]
    # a rerun upstream makes it stale too, without any setting changed
    cfg = load_config(None, {"run_id": "r1", "store.uri": uri, "vocab.draft_vocab_size": 64})
    commit_fabricated_generate(open_store(uri), cfg, 500, seed=1)  # generate committed anew
    code, out = _verify("-c", _config(tmp_path, uri, 64), "--stage", "vocab")
    assert code == 1 and out.splitlines()[1] == "  stale: generate was rerun after it (its input key no longer matches)"


def test_without_a_config_the_recorded_one_is_used(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri, draft=64)
    store = open_store(uri)
    code, out = _verify("--store", uri, "--stage", "vocab")
    assert code == 0 and out.splitlines() == [
        "note: no config given and none recorded in the store: input keys are not checked", "vocab: ok (3 objects)"]
    recorded = load_config(None, {"run_id": "r1", "store.uri": uri, "vocab.draft_vocab_size": 32})
    store.put_bytes(f"r1/{RUN_CONFIG}", json.dumps(recorded.model_dump(mode="json")).encode())
    code, out = _verify("--store", uri, "--stage", "vocab")
    assert code == 1 and "stale: the config changed since it ran (vocab.draft_vocab_size: 64 -> 32)" in out


def test_an_unknown_run_id_is_an_error(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/s"
    _commit_vocab(uri)
    for cmd in (["verify"], ["verify", "--deep"], ["status"], ["report"]):
        r = CliRunner().invoke(app, [*cmd, "--run-id", "r2", "--store", uri])
        assert r.exit_code == 1, (cmd, r.output)
        assert r.output.strip() == f"error: run r2 has nothing in {uri}: no such run (check -c / --run-id and --store)"


def test_unknown_stage_and_no_config_are_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["verify", "--run-id", "r1", "--stage", "trian"])
    assert r.exit_code == 2 and "unknown stage 'trian'" in r.output
    for cmd in (["verify"], ["status"], ["report"], ["run", "pipeline"], ["down"]):
        r = CliRunner().invoke(app, cmd)
        assert r.exit_code == 2, (cmd, r.output)
        assert r.output.strip() == "error: no config: pass -c CONFIG (`eagle3ctl init` writes one), or --run-id ID for a run in the store"


@pytest.mark.s3
def test_s3_same_size_flip_caught_without_deep_truncation_named(s3_store_uri: str, moto_s3: MotoS3) -> None:
    _commit_vocab(s3_store_uri)
    assert _verify("--store", s3_store_uri, "--stage", "vocab", "--deep")[0] == 0
    client = moto_s3.client()
    store = open_store(s3_store_uri)
    rel = key_of(store, "r1", "vocab", "vocab_mapping.safetensors")
    key = _raw_key(s3_store_uri, rel)
    good = client.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read()
    flipped = good[:-1] + bytes([good[-1] ^ 0xFF])  # same size, one byte differs
    client.put_object(Bucket=moto_s3.bucket, Key=key, Body=flipped)
    code, out = _verify("--store", s3_store_uri, "--stage", "vocab")
    assert code == 1
    assert out.splitlines()[-2:] == [
        "vocab: FAILED", f"  corrupted object {s3_store_uri}/{rel}: sha256 differs from the manifest"]
    client.put_object(Bucket=moto_s3.bucket, Key=key, Body=good[: len(good) // 2])
    code, out = _verify("--store", s3_store_uri, "--stage", "vocab")
    assert code == 1
    assert f"  truncated or altered object {s3_store_uri}/{rel}: {len(good) // 2} bytes, manifest says {len(good)}" in out


@pytest.mark.s3
@pytest.mark.slow
def test_s3_wrong_credentials_is_one_line_from_the_cli(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    r = _cli("verify", "--store", s3_store_uri, "--run-id", "r1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr == f"error: store {s3_store_uri}: S3 refused the credentials (SignatureDoesNotMatch)\n"


@pytest.mark.s3
@pytest.mark.slow
def test_s3_unreachable_endpoint_is_one_line_from_the_cli(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("EAGLE3_STORE__MAX_ATTEMPTS", "2")  # the default budget backs off for a minute first
    r = _cli("verify", "--store", s3_store_uri, "--run-id", "r1")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: store {s3_store_uri}: cannot reach S3 endpoint")


@pytest.mark.s3
def test_s3_missing_credentials_is_one_line(s3_store_uri: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, out = _verify("--store", s3_store_uri)
    assert code == 1
    assert out.strip() == f"error: store {s3_store_uri}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
