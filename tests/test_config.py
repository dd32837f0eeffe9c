"""Pipeline config: YAML < EAGLE3_* env < command-line overrides; every error one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import derived_run_id, config_section_dump, load_config
from eagle3.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("EAGLE3_"):
            monkeypatch.delenv(k)


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pipeline.yaml"
    p.write_text(text)
    return p


def _one_line_error(excinfo: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_defaults_validate() -> None:
    cfg = load_config(None)
    assert cfg.run_id == "default" and cfg.store.uri.startswith("file://")
    assert cfg.vocab.draft_vocab_size == 32000


def test_unknown_key_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "train:\n  lrr: 0.1\n"))
    assert _one_line_error(e) == f"invalid config {tmp_path / 'pipeline.yaml'}: train.lrr: unknown key"


def test_unknown_top_level_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"trian: unknown key"):
        load_config(_yaml(tmp_path, "trian:\n  lr: 0.1\n"))


def test_wrong_type_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"vocab\.draft_vocab_size: Input should be a valid integer"):
        load_config(_yaml(tmp_path, "vocab:\n  draft_vocab_size: lots\n"))


def test_processes_per_node_is_a_count_or_auto(tmp_path: Path) -> None:
    cfg = load_config(_yaml(tmp_path, "extract:\n  nproc_per_node: '4'\ntrain:\n  nproc_per_node: auto\n"))
    assert cfg.extract.nproc_per_node == 4 and cfg.train.nproc_per_node == "auto"
    for bad in ("lots", 0):
        with pytest.raises(ConfigError) as e:
            load_config(_yaml(tmp_path, f"train:\n  nproc_per_node: {bad}\n"))
        assert _one_line_error(e).endswith(f"train.nproc_per_node: must be a positive number or 'auto', not {bad!r}")


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("http://bucket/x", "must start with file:// or s3://"),
        ("s3://", "s3:// URI needs a bucket: s3://BUCKET[/PREFIX]"),
        ("/plain/path", "must start with file:// or s3://"),
    ],
)
def test_bad_store_uri(tmp_path: Path, uri: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, f"store:\n  uri: {uri}\n"))
    assert _one_line_error(e).endswith(f"store.uri: {why}")


def test_bad_endpoint_and_run_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"store\.endpoint_url: must be an http\(s\):// URL"):
        load_config(_yaml(tmp_path, "store:\n  endpoint_url: minio:9000\n"))
    with pytest.raises(ConfigError, match=r"run_id: must be lowercase"):
        load_config(None, {"run_id": "My_Run"})


def test_yaml_problems_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"pipeline.yaml line \d+ is not valid YAML"):
        load_config(_yaml(tmp_path, "train:\n  lr: [1\n"))
    with pytest.raises(ConfigError, match=r"must hold a mapping"):
        load_config(_yaml(tmp_path, "- a\n- b\n"))


def test_env_overrides_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TRAIN__LR", "3e-4")
    monkeypatch.setenv("EAGLE3_RUN_ID", "from-env")
    cfg = load_config(_yaml(tmp_path, "run_id: from-yaml\ntrain:\n  lr: 0.1\n  epochs: 3\n"))
    assert cfg.train.lr == 3e-4
    assert cfg.train.epochs == 3  # the rest of the YAML section survives the env override
    assert cfg.run_id == "from-env"


def test_cli_overrides_beat_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TRAIN__LR", "3e-4")
    monkeypatch.setenv("EAGLE3_STORE__URI", "file:///from/env")
    cfg = load_config(
        _yaml(tmp_path, "store:\n  endpoint_url: http://minio:9000\n"),
        {"train.lr": 5e-5, "store.uri": "s3://bucket/p", "run_id": None},
    )
    assert cfg.train.lr == 5e-5
    assert cfg.store.uri == "s3://bucket/p"
    assert cfg.store.endpoint_url == "http://minio:9000"  # sibling keys from YAML kept
    assert cfg.run_id == derived_run_id(tmp_path / "pipeline.yaml")  # a None override means "not given"


def test_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TRAIN__LR", "fast")
    with pytest.raises(ConfigError) as e:
        load_config(None)
    assert _one_line_error(e).endswith("train.lr: Input should be a valid number, unable to parse string as a number (from env EAGLE3_TRAIN__LR)")


def test_env_unknown_nested_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TRAIN__LRR", "1")
    with pytest.raises(ConfigError, match=r"train\.lrr: unknown key \(from env EAGLE3_TRAIN__LRR\)"):
        load_config(None)


def test_env_single_underscore_typo_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TRAIN_LR", "1e-3")
    with pytest.raises(ConfigError) as e:
        load_config(None)
    assert _one_line_error(e) == (
        "environment variable EAGLE3_TRAIN_LR sets no config field; nested fields use '__': EAGLE3_TRAIN__LR"
    )


def test_unrelated_eagle3_env_is_not_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_DEBUG", "1")
    assert load_config(None).run_id == "default"


def test_run_id_is_derived_from_the_config_file_when_unnamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = tmp_path / "a" / "My Pipeline.yaml"
    b = tmp_path / "b" / "My Pipeline.yaml"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("train:\n  lr: 0.1\n")
    ra, rb = load_config(a).run_id, load_config(b).run_id
    assert ra.startswith("my-pipeline-") and len(ra) == len("my-pipeline-") + 6
    assert ra != rb  # same name, other file: another run
    monkeypatch.chdir(a.parent)
    assert load_config("My Pipeline.yaml").run_id == ra  # the same file from another directory: the same run
    a.write_text("train:\n  lr: 0.2\n")
    assert load_config(a).run_id == ra  # edited: still the same run (stages rerun by input key)
    assert load_config(a, {"run_id": "named"}).run_id == "named"


def test_bad_override_names_the_command_line() -> None:
    with pytest.raises(ConfigError, match=r"store\.uri: must start with file:// or s3:// \(from the command line\)"):
        load_config(None, {"store.uri": "ftp://x"})


def test_section_dump_is_json_data() -> None:
    cfg = load_config(None, {"vocab.draft_vocab_size": 64})
    assert config_section_dump(cfg, ["vocab"]) == {"vocab": {"draft_vocab_size": 64}}


def test_cli_prints_config_errors_on_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["verify", "-c", str(_yaml(tmp_path, "store:\n  uri: gs://b\n"))])
    assert r.exit_code == 2
    assert r.output.strip() == f"error: invalid config {tmp_path / 'pipeline.yaml'}: store.uri: must start with file:// or s3://"
