"""The tiny Kimi target: Kimi-K2.5's structure, tokenizer and template, through the whole pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eagle3.store.local import LocalStore
from tests.committed import path_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-kimi.yaml"


def test_structure_tokenizer_and_template(tiny_target_dir):
    from transformers import AutoConfig, AutoTokenizer

    from eagle3.targets.load import hidden_size, num_layers, target_vocab_size
    from eagle3.targets.tiny_kimi import NUM_SPECIAL_SLOTS, SPECIAL_OFFSETS, TIKTOKEN_FILE

    d = tiny_target_dir("kimi")
    config = AutoConfig.from_pretrained(d)
    assert config.model_type == "kimi_k25" and config.text_config.model_type == "deepseek_v3"
    assert config.text_config.kv_lora_rank and config.text_config.n_routed_experts  # MLA + MoE
    assert (num_layers(config), hidden_size(config)) == (6, 64) and not config.tie_word_embeddings
    tok = AutoTokenizer.from_pretrained(d)
    base = len(tok) - NUM_SPECIAL_SLOTS
    assert target_vocab_size(config) == len(tok)  # unpadded, as Kimi's 163584 + 256
    assert len((d / TIKTOKEN_FILE).read_text().splitlines()) == base
    for off, name in SPECIAL_OFFSETS.items():
        assert tok.convert_tokens_to_ids(name) == base + off
    assert tok.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    ids = tok("a<think>b</think>c<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b</think>c"  # think tags survive servers



@pytest.mark.slow
def test_tiny_kimi_pipeline_end_to_end(tmp_path, tiny_cache_dir):
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["store"]["uri"] = f"file://{tmp_path / 'store'}"
    cfg["target"]["cache_dir"] = str(tiny_cache_dir)
    cfg["generate"].update(max_samples=8, max_tokens=24, concurrency=2)
    cfg["train"].update(max_steps=3, checkpoint_every=1, log_every=1)
    cfg["evaluate"].update(num_prompts=2, max_new_tokens=8)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "EAGLE3_DEBUG": ""}
    r = subprocess.run([sys.executable, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    store = LocalStore(tmp_path / "store")
    run = cfg["run_id"]
    meta = json.loads(path_of(store, run, "generate", "metadata.json").read_text())
    assert meta["kept"] > 0 and meta["response_tokens_from"].get("text") == meta["kept"]
    assert "think_tags_not_in_text" not in meta["excluded"]
    drafter = json.loads(path_of(store, run, "export", "config.json").read_text())
    assert drafter["max_position_embeddings"] == 4096 and drafter["vocab_size"] == 1256  # the target's
    assert json.loads(path_of(store, run, "evaluate", "report.json").read_text())["mean_acceptance_length"] >= 1
