"""Tiny targets: real HF directories that load, are deterministic, and render reasoning."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from eagle3.targets.tiny import COMPLETE_MARKER, build_tiny_target, builtin_target_dir


def _digests(d):
    """sha256 of every file of the HF directory (the cache's completion marker is not part of it)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != COMPLETE_MARKER}


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_tiny_target_loads_and_runs(arch, tiny_target_dir):
    d = tiny_target_dir(arch)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    cfg = model.config
    assert cfg.num_hidden_layers >= 4
    assert len(tok) < cfg.vocab_size  # padded like real targets: lm_head rows > tokens
    ids = torch.randint(0, len(tok), (1, 64))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, 64, cfg.vocab_size)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    assert torch.isfinite(out.logits).all()


def test_deepseek_has_mla_and_moe(tiny_deepseek_dir):
    cfg = AutoConfig.from_pretrained(tiny_deepseek_dir)
    assert cfg.model_type == "deepseek_v3"
    assert cfg.q_lora_rank and cfg.kv_lora_rank and cfg.qk_rope_head_dim and cfg.qk_nope_head_dim
    assert cfg.n_routed_experts > cfg.num_experts_per_tok >= 2
    assert 0 < cfg.first_k_dense_replace < cfg.num_hidden_layers
    # DeepSeek-V3's head dims (vLLM's MLA prefill kernels take a few shapes) and router (transformers
    # computes sigmoid + correction bias; vLLM reads these fields, its defaults being softmax, no bias).
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert (cfg.topk_method, cfg.scoring_func) == ("noaux_tc", "sigmoid")


def test_chat_template_renders_reasoning_and_generation_prompt(tiny_llama_dir):
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    head = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": "4", "reasoning_content": "add"}],
                                   tokenize=False)
    assert head == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert full == head + "<think>\nadd\n</think>\n4<|im_end|>\n"
    no_reasoning = tok.apply_chat_template(prompt + [{"role": "assistant", "content": "4"}], tokenize=False)
    assert no_reasoning == head + "4<|im_end|>\n"


def test_think_tags_survive_skip_special_tokens(tiny_llama_dir):
    # Servers decode with skip_special_tokens=True; inline reasoning must not vanish.
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok("<think>\nhm\n</think>\nok<|im_end|>").input_ids
    assert tok.convert_tokens_to_ids("<think>") in ids
    assert tok.decode(ids, skip_special_tokens=True) == "<think>\nhm\n</think>\nok"


def test_build_is_deterministic(tmp_path, tiny_llama_dir):
    again = build_tiny_target("llama", tmp_path / "again")
    assert _digests(again) == _digests(tiny_llama_dir)


def test_builtin_dir_is_built_once(tiny_cache_dir):
    first = builtin_target_dir("llama", tiny_cache_dir)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert builtin_target_dir("llama", tiny_cache_dir) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny target architecture"):
        build_tiny_target("gpt2", tmp_path)


@pytest.mark.parametrize("arch", ["llama", pytest.param("deepseek", marks=pytest.mark.slow)])  # MoE decodes slowly
def test_pretrained_target_answers_held_out_prompts_with_reasoning(arch, tiny_target_dir):
    # The last builtin prompts: held out from generate whenever max_samples < NUM_PROMPTS.
    from eagle3.targets.builtin_prompts import builtin_prompts_jsonl
    from eagle3.generate.prompts import parse_prompts
    from eagle3.generate.reasoning import split_inline

    d = tiny_target_dir(arch)
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    eos = model.config.eos_token_id
    replies = []
    for p in parse_prompts(builtin_prompts_jsonl(), "builtin", None)[-3:]:
        head = tok.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True)
        x = tok(head, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(x, max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id)
        replies.append(tok.decode(out[0, x.shape[1]:], skip_special_tokens=True))
    split = [split_inline(r) for r in replies]
    assert all(s.source == "inline" and s.reasoning and s.content for s in split), replies
    # Regular text, not noise: the pretraining templates' words.
    assert all("The user wants" in s.reasoning for s in split), replies


def test_pretraining_chats_follow_the_templates():
    from eagle3.targets.tiny_pretrain import reply, synthetic_chats

    chats = synthetic_chats(50)
    assert chats == synthetic_chats(50)  # deterministic
    for chat in chats:
        last = chat[-1]
        assert last["role"] == "assistant" and last["reasoning_content"].startswith("The user wants")
    from eagle3.targets.builtin_prompts import Request

    assert reply(Request("Define", "rivers", " briefly")) == (
        "The user wants me to define rivers. They want a short answer.",
        "Rivers is a word for something we can study and use.")
    assert reply(Request(a=2, b=3))[1] == "2 plus 3 is 5."


def test_pretraining_on_given_chats_teaches_their_answers_and_restores_the_callers_torch(tiny_llama_dir):
    """The race's target is pretrained so, on chats of its own (code and its continuation)."""
    from eagle3.targets.tiny_pretrain import pretrain

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).train()
    chats = [[{"role": "user", "content": f"def f{i}(x):"}, {"role": "assistant", "content": f"    return x + {i}"}]
             for i in range(4)]
    threads = torch.get_num_threads()
    losses = pretrain(model, tok, seed=0, steps=30, chats=chats, batch=2, lr=3e-3)
    assert len(losses) == 30 and sum(losses[-5:]) < sum(losses[:5]) / 2
    assert torch.get_num_threads() == threads and not torch.are_deterministic_algorithms_enabled()
