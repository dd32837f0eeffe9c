"""``eagle3ctl verify`` on a real S3 server (moto) and on disk: what a user sees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.store import open_store
from tests.fabricated_upstream import commit_fabricated_generate
from tests.fixtures_s3 import MotoS3

EAGLE3CTL = str(Path(sys.executable).parent / "eagle3ctl")  # the installed console script


def _commit_vocab(store_uri: str) -> None:
    cfg = load_config(None, {"run_id": "r1", "store.uri": store_uri, "vocab.draft_vocab_size": 64})
    commit_fabricated_generate(open_store(store_uri), cfg, vocab_size=500)
    run_stage(cfg, "vocab")


def _verify(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["verify", "--run-id", "r1", *args])
    return r.exit_code, r.output


def _raw_key(uri: str, key: str) -> str:
    return f"{uri.split('/', 3)[3]}/{key}"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EAGLE3CTL, *args], capture_output=True, text=True, timeout=120)


def test_local_run_verifies_stage_by_stage(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}"
    _commit_vocab(uri)
    code, out = _verify("--store", uri, "--stage", "vocab", "--deep")
    assert code == 0 and out.strip() == "vocab: ok (3 objects, deep)"
    code, out = _verify("--store", uri, "--stage", "train")
    assert code == 1
    assert out.splitlines() == ["train: FAILED", f"  no manifest at {uri}/r1/train/manifest.json"]


def test_all_stages_reports_not_run(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}"
    _commit_vocab(uri)
    (tmp_path / "r1/generate/metadata.json").unlink()
    code, out = _verify("--store", uri)
    lines = out.splitlines()
    assert code == 1
    assert lines[:2] == ["generate: FAILED", f"  missing object {uri}/r1/generate/metadata.json"]
    assert "vocab: ok (3 objects)" in lines and "train: not run" in lines and "evaluate: not run" in lines


@pytest.mark.s3
def test_s3_truncated_caught_shallow_corrupted_caught_deep(s3_store_uri: str, moto_s3: MotoS3) -> None:
    _commit_vocab(s3_store_uri)
    assert _verify("--store", s3_store_uri, "--stage", "vocab", "--deep") == (0, "vocab: ok (3 objects, deep)\n")
    client = moto_s3.client()
    key = _raw_key(s3_store_uri, "r1/vocab/vocab_mapping.safetensors")
    good = client.get_object(Bucket=moto_s3.bucket, Key=key)["Body"].read()
    flipped = good[:-1] + bytes([good[-1] ^ 0xFF])  # same size, one byte differs
    client.put_object(Bucket=moto_s3.bucket, Key=key, Body=flipped)
    assert _verify("--store", s3_store_uri, "--stage", "vocab") == (0, "vocab: ok (3 objects)\n")  # sizes agree
    code, out = _verify("--store", s3_store_uri, "--stage", "vocab", "--deep")
    assert code == 1
    assert out.splitlines() == [
        "vocab: FAILED",
        f"  corrupted object {s3_store_uri}/r1/vocab/vocab_mapping.safetensors: sha256 differs from the manifest",
    ]
    client.put_object(Bucket=moto_s3.bucket, Key=key, Body=good[: len(good) // 2])
    code, out = _verify("--store", s3_store_uri, "--stage", "vocab")
    assert code == 1
    assert f"  truncated or altered object {s3_store_uri}/r1/vocab/vocab_mapping.safetensors: {len(good) // 2} bytes, manifest says {len(good)}" in out


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
