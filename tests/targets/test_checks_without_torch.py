"""The checks made before a stage runs read the target's config.json and tokenizer.json without
torch or transformers (most of the CLI's start-up), and agree with what the stages load; where
those files cannot answer, they fall back to transformers and say what it says."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.errors import StageError
from eagle3.targets.fit import Gpus, weight_bytes
from eagle3.targets.load import (
    JsonConfig, hidden_size, load_target_config, load_tokenizer, num_layers, target_config_for_checks, target_vocab_size,
    tokenizer_size_for_checks,
)
from eagle3.settings.target import TargetSettings


@pytest.mark.parametrize("arch", ["llama", "deepseek", "kimi"])
def test_the_light_config_answers_as_autoconfig_does(tiny_target_dir, arch):
    s = TargetSettings(model=str(tiny_target_dir(arch)))
    light, full = target_config_for_checks(s), load_target_config(s)
    assert isinstance(light, JsonConfig)
    for read in (target_vocab_size, num_layers, hidden_size):
        assert read(light) == read(full)
    assert weight_bytes(light) == weight_bytes(full)
    assert tokenizer_size_for_checks(s) == len(load_tokenizer(s))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("field", ["num_hidden_layers", "intermediate_size"])
def test_a_config_without_the_checked_fields_goes_through_transformers(tiny_llama_dir, tmp_path, field):
    target = _copy(tiny_llama_dir, tmp_path / "t")
    config = json.loads((target / "config.json").read_text())
    del config[field]  # LlamaConfig's default (32 layers, 11,008) is what a stage would see
    (target / "config.json").write_text(json.dumps(config))
    got = target_config_for_checks(TargetSettings(model=str(target)))
    assert not isinstance(got, JsonConfig) and getattr(got, field) == {"num_hidden_layers": 32,
                                                                       "intermediate_size": 11008}[field]
    assert weight_bytes(got).params > 0  # the fit estimate reads it


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"vocab_size": true, "num_hidden_layers": 2}'])
def test_an_unreadable_config_fails_as_the_stage_would(tiny_llama_dir, tmp_path, text):
    target = _copy(tiny_llama_dir, tmp_path / "t")
    (target / "config.json").write_text(text)
    s = TargetSettings(model=str(target))
    with pytest.raises(StageError, match="cannot load target config from") as light:
        target_config_for_checks(s)
    with pytest.raises(StageError) as full:
        load_target_config(s)
    assert str(light.value) == str(full.value) and "\n" not in str(light.value)


def test_a_tokenizer_the_tokenizers_library_cannot_count_is_loaded_by_transformers(tiny_llama_dir, tmp_path, monkeypatch):
    target = _copy(tiny_llama_dir, tmp_path / "t")
    s = TargetSettings(model=str(target))
    loaded = []
    from eagle3.targets import load

    real = load.load_tokenizer
    monkeypatch.setattr(load, "load_tokenizer", lambda settings: loaded.append(settings) or real(settings))
    assert tokenizer_size_for_checks(s) == 1002 and not loaded  # tokenizer.json alone
    tok_config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**tok_config, "auto_map": {"AutoTokenizer": ["x.Tok", None]}}))
    assert tokenizer_size_for_checks(s) == 1002  # (without trust_remote_code transformers loads the fast one)
    assert loaded  # a remote-code tokenizer is counted by transformers, never from tokenizer.json
    (target / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (target / "tokenizer.json").write_text("{broken")
    loaded.clear()
    with pytest.raises(StageError, match="cannot load target tokenizer from"):
        tokenizer_size_for_checks(s)
    assert loaded


def test_no_gpu_driver_means_no_gpus(monkeypatch, tmp_path):
    from eagle3.targets import fit

    monkeypatch.setattr(fit, "GPU_DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    assert Gpus.detect() is None


def test_the_dag_preflight_imports_neither_torch_nor_transformers(tiny_cache_dir, tmp_path):
    """Every check of every stage on a built builtin target, in a fresh interpreter: the stages run
    in their own processes, so torch in this one was seconds of start-up for nothing."""
    code = f"""
import sys
from eagle3.config import load_config
from eagle3.pipeline.preflight import check_run
from eagle3.stages import ORDER
from eagle3.targets.tiny import builtin_target_dir
builtin_target_dir("llama", {str(tiny_cache_dir)!r})
loaded = [m for m in ("torch", "transformers") if m in sys.modules]
assert not loaded, loaded  # building is allowed to import them; here the target is built
cfg = load_config(None, {{"run_id": "p", "store.uri": "file://{tmp_path}/store", "target.model": "builtin:tiny-llama",
                         "target.cache_dir": {str(tiny_cache_dir)!r}, "vocab.draft_vocab_size": 64}})
check_run(cfg, set(ORDER))
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
