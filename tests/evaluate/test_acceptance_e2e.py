"""End to end on a tiny target: a drafter trained on the target's own greedy outputs
is accepted (mean acceptance length well above 1) when it drafts for the target on
held-out prompts.

The builtin tiny target is pretrained on templated chats with ``<think>`` reasoning
(``eagle3.targets.tiny_pretrain``), so its greedy answers are regular text a drafter can
learn. Evaluate uses the builtin prompts generate did not use (generate.max_samples is
below their number), so acceptance measures generalisation, not memorisation; a
misalignment anywhere in the chain (aux ids, shard alignment, d2t, export names, decode
alignment) keeps acceptance at ~1.0.

generate -> vocab -> extract -> train -> export -> evaluate, through the stage entrypoint
on a file:// store. Only generate is replaced (named fixture below): instead of
``transformers serve`` + HTTP, the same greedy decoding runs in-process and is written in
generate's agreed format.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3.config import PipelineConfig
from eagle3.context import run_stage
from eagle3.generate.prompts import load_prompts
from eagle3.generate.samples import token_frequencies
from eagle3.generate.tokenized import from_lists, write_tokenized
from eagle3.manifest import StageOutput
from eagle3.store import open_store
from tests.extract.pipeline import pipeline_config
from tests.committed import key_of

NUM_TRAIN_PROMPTS = 48
MAX_NEW_TOKENS = 64
MIN_ACCEPTANCE = 1.5  # measured ~3 (k=3); a broken chain gives ~1.0


def commit_greedy_generate(cfg: PipelineConfig, target_dir: Path) -> int:
    """Generate stage stand-in: the target's greedy responses to generate's prompts, decoded
    in-process (HF, fp32) and written as generate writes them. Returns the sample count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.evaluate.spec_decode import greedy_generate

    g = cfg.generate
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = {int(model.config.eos_token_id)}
    samples, raw = [], []
    for p in load_prompts(g.prompts, g.system_prompt, g.max_samples, g.seed):
        head = tokenizer(tokenizer.apply_chat_template(p.messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
        reply = greedy_generate(model, head, MAX_NEW_TOKENS, eos)
        samples.append((p.sample_id, head + reply, [0] * len(head) + [1] * len(reply)))
        raw.append({"id": p.sample_id, "messages": p.messages, "content": tokenizer.decode(reply),
                    "finish_reason": "stop" if reply[-1] in eos else "length", "error": None})
    data = from_lists(samples)
    store = open_store(cfg.store.uri)
    out = StageOutput(store, cfg.run_id, "generate", "greedy-fixture", {})
    out.begin()
    with tempfile.TemporaryDirectory() as tmp:
        write_tokenized(Path(tmp) / "tokenized.safetensors", data)
        out.put_file("tokenized.safetensors", Path(tmp) / "tokenized.safetensors")
        save_file({"counts": token_frequencies(data, model.config.vocab_size)}, str(Path(tmp) / "token_freq.safetensors"))
        out.put_file("token_freq.safetensors", Path(tmp) / "token_freq.safetensors")
    out.put_bytes("raw_responses.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in raw))
    meta = {"samples": len(samples), "tokens": data.num_tokens, "target_vocab_size": model.config.vocab_size}
    out.put_json("metadata.json", meta)
    out.commit(meta)
    return len(samples)


@pytest.mark.slow
def test_trained_drafter_is_accepted(tmp_path, tiny_target_dir):
    target_dir = tiny_target_dir("llama")
    cfg = pipeline_config(tmp_path / "store", target_dir, **{
        "generate.max_samples": NUM_TRAIN_PROMPTS,
        "vocab.draft_vocab_size": 256,
        "extract.shard_tokens": 4096,
        "train.max_steps": 120, "train.epochs": 100.0, "train.batch_tokens": 1024, "train.lr": 3e-3, "train.warmup_steps": 10,
        "train.ttt_steps": 3, "train.eval_fraction": 0.0, "train.checkpoint_every": 1000, "train.device": "cpu",
        "evaluate.num_prompts": 8, "evaluate.max_new_tokens": MAX_NEW_TOKENS, "evaluate.num_draft_tokens": 3,
        "evaluate.check_greedy": 8, "evaluate.device": "cpu",
    })
    assert commit_greedy_generate(cfg, target_dir) == NUM_TRAIN_PROMPTS
    for stage in ("vocab", "extract", "train", "export", "evaluate"):
        run_stage(cfg, stage)
    report = json.loads(open_store(cfg.store.uri).get_bytes(key_of(open_store(cfg.store.uri), 't', "evaluate", 'report.json')))
    print("e2e acceptance:", report["mean_acceptance_length"], report["acceptance_rate_per_position"])
    assert report["held_out"] is True, report["prompt_source"]
    assert report["greedy_check"]["all_match"] is True
    assert report["mean_acceptance_length"] > MIN_ACCEPTANCE, report["acceptance_rate_per_position"]
