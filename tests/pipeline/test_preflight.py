"""The whole DAG's preflight: bad settings a stage would fail on are refused before anything starts,
in one line, and nothing finished is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from eagle3.cli.app import app
from eagle3.config import load_config
from eagle3.context import run_stage
from eagle3.errors import ConfigError
from eagle3.pipeline.preflight import check_run, stages_to_run
from eagle3.stages import ORDER
from eagle3.store import open_store
from tests.fabricated_upstream import commit_fabricated_generate


def _cfg(tmp_path: Path, tiny_cache_dir: Path, **over):
    return load_config(None, {"run_id": "p", "store.uri": f"file://{tmp_path}/store", "target.model": "builtin:tiny-llama",
                              "target.cache_dir": str(tiny_cache_dir), "vocab.draft_vocab_size": 64, **over})


def test_every_bad_setting_is_named_in_one_line(tmp_path: Path, tiny_cache_dir: Path) -> None:
    cfg = _cfg(tmp_path, tiny_cache_dir, **{"vocab.draft_vocab_size": 5000, "target.aux_layer_ids": [2, 3, 9],
                                            "target.vocab_size": 2048})
    with pytest.raises(ConfigError) as e:
        check_run(cfg, set(ORDER))
    msg = str(e.value)
    assert "\n" not in msg
    assert "vocab.draft_vocab_size=5000 exceeds the target's vocab size 1024" in msg
    assert "target.aux_layer_ids: aux layer ids [9] out of range for a target with 6 layers (0..5)" in msg
    assert "target.vocab_size is 2048 but the target config" in msg
    check_run(_cfg(tmp_path, tiny_cache_dir), set(ORDER))  # the same target, good settings: passes


def test_only_stages_that_will_run_are_checked(tmp_path: Path, tiny_cache_dir: Path) -> None:
    cfg = _cfg(tmp_path, tiny_cache_dir)
    store = open_store(cfg.store.uri)
    assert stages_to_run(cfg, store, set(ORDER), ()) == set(ORDER)
    commit_fabricated_generate(store, cfg, vocab_size=1024)
    run_stage(cfg, "vocab")
    assert stages_to_run(cfg, store, set(ORDER), ()) == {"extract", "train", "export", "evaluate"}
    assert stages_to_run(cfg, store, set(ORDER), ("vocab",)) == {"vocab", "extract", "train", "export", "evaluate"}
    bigger = _cfg(tmp_path, tiny_cache_dir, **{"vocab.draft_vocab_size": 128})
    assert stages_to_run(bigger, store, set(ORDER), ()) == {"vocab", "extract", "train", "export", "evaluate"}
    # a same-size byte flip in vocab's output: it must run again, so its settings are checked again
    from tests.committed import path_of

    f = path_of(store, "p", "vocab", "vocab_mapping.safetensors")
    data = bytearray(f.read_bytes())
    data[-3] ^= 1
    f.write_bytes(bytes(data))
    assert "vocab" in stages_to_run(cfg, store, set(ORDER), ())


def test_a_refused_rerun_leaves_the_finished_output_alone(tmp_path: Path, tiny_cache_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, tiny_cache_dir)
    store = open_store(cfg.store.uri)
    commit_fabricated_generate(store, cfg, vocab_size=1024)
    run_stage(cfg, "vocab")
    before = {k: store.get_bytes(k) for k in store.list("p/vocab")}
    config = tmp_path / "bad.yaml"
    config.write_text(f"run_id: p\nstore:\n  uri: {cfg.store.uri}\ntarget:\n  model: builtin:tiny-llama\n"
                      f"  cache_dir: {tiny_cache_dir}\nvocab:\n  draft_vocab_size: 5000\n")
    r = CliRunner().invoke(app, ["run", "stage", "vocab", "-c", str(config), "--force"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: vocab.draft_vocab_size=5000 exceeds the target's vocab size 1024")
    assert {k: store.get_bytes(k) for k in store.list("p/vocab")} == before
    assert not store.exists("p/_run/lease.json"), "the lease is released on a refused run"


@pytest.mark.parametrize("endpoint, why", [
    ("localhost:8000/v1", "has no scheme: write http://localhost:8000/v1"),
    ("http://host:99999/v1", "port 99999 is out of range"),
    ("ftp://host/v1", "is not an http(s)://HOST[:PORT][/PATH] URL"),
])
def test_an_endpoint_url_of_the_wrong_shape_is_a_config_error(endpoint: str, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, {"serve.endpoint": endpoint})
    assert why in str(e.value) and "serve.endpoint" in str(e.value)
