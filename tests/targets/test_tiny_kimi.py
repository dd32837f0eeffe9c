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



def test_built_as_kimi_k25s_checkpoint_is_laid_out(tiny_target_dir):
    """What vLLM's KimiK25 model reads: Kimi-K2.5's names for the architecture, the tensors, the image
    token and the vision grid; a media_proc_cfg; MLA head dims its prefill kernels take; DeepSeek-V3's router."""
    from safetensors import safe_open
    from transformers import AutoProcessor

    d = tiny_target_dir("kimi")
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["media_placeholder_token_id"] == config["image_token_id"]
    vision, text = config["vision_config"], config["text_config"]
    assert all(vision[f"init_pos_emb_{a}"] == vision[f"pos_emb_{a}"] for a in ("height", "width", "time"))
    assert (text["qk_nope_head_dim"], text["qk_rope_head_dim"], text["v_head_dim"]) == (128, 64, 128)
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")
    media = json.loads((d / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert media["patch_size"] == vision["patch_size"] and media["merge_kernel_size"] == 2
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.0.self_attn.kv_b_proj.weight" in names
    assert "language_model.model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert {"mm_projector.pre_norm.weight", "vision_tower.patch_embed.proj.weight"} <= names
    assert not [n for n in names if n.startswith(("model.", "vision_tower.encoder.patch_embed.")) or ".blocks." in n
                and n.startswith("language_model.")]
    assert type(AutoProcessor.from_pretrained(d)).__name__ == "TokenizersBackend"  # the tokenizer, as before


def test_kimi_layout_loads_to_the_tensors_transformers_saved(tmp_path):
    """The rewritten checkpoint loads in transformers to exactly the model it saved."""
    import shutil

    import torch
    from transformers import AutoModelForImageTextToText

    from eagle3.targets.tiny import tiny_config
    from eagle3.targets.tiny_kimi import kimi_config, write_as_kimi_checkpoint

    torch.manual_seed(0)
    config = kimi_config(tiny_config("kimi", 300, 299, 298, 297), 40, 300)
    saved, kimi = tmp_path / "saved", tmp_path / "kimi"
    AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(saved)
    shutil.copytree(saved, kimi)
    write_as_kimi_checkpoint(kimi)
    a, b = (AutoModelForImageTextToText.from_pretrained(p, dtype=torch.float32).eval() for p in (saved, kimi))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)



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
