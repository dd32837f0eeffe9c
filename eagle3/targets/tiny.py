"""Tiny targets built from config and briefly pretrained: real architectures, no model hub.

Two architectures, each small enough that a 512-token forward takes milliseconds on CPU:

- ``llama``: ``LlamaForCausalLM`` (GQA, SwiGLU, RoPE).
- ``deepseek``: ``DeepseekV3ForCausalLM`` with MLA (q/kv LoRA ranks, split rope/nope
  head dims) and MoE (routed + shared experts, first layer dense): Kimi-K2.5's shape.
- ``kimi``: that DeepseekV3 text model inside Kimi-K2.5's multimodal wrapper, with a
  tiktoken-style tokenizer carrying Kimi's special tokens and a chat template that behaves
  like Kimi-K2.5's (:mod:`eagle3.targets.tiny_kimi`).

Both share a byte-level BPE tokenizer trained in-process on a built-in corpus, saved as a
``PreTrainedTokenizerFast`` with a chat template that renders an assistant message's
``reasoning_content`` as ``<think>…</think>`` before its content. Like real targets, the
model's ``vocab_size`` (lm_head rows) is padded above ``len(tokenizer)``.

The random model is then pretrained for a few seconds on one CPU thread on synthetic
chats (:mod:`eagle3.targets.tiny_pretrain`) so that its greedy answers are regular text
with ``<think>`` reasoning: a drafter has something to learn, and reasoning capture is
exercised against a real server.

A build is deterministic for a given (arch, seed): same bytes every time (same machine
and torch version).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path

ARCHS = ("llama", "deepseek", "kimi")
# Bump when the recipe changes: cached builds are keyed by it.
RECIPE_VERSION = 3
COMPLETE_MARKER = ".eagle3-tiny-target.json"

TOKENIZER_VOCAB = 1000
VOCAB_PAD_MULTIPLE = 128  # model vocab_size = len(tokenizer) rounded up (lm_head rows > tokens)
NUM_LAYERS = 6
HIDDEN = 64
MAX_POSITIONS = 4096
INIT_STD = 0.02

PAD, BOS, IM_START, IM_END, THINK, END_THINK = "<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, IM_END]
# Added but not special: servers decode with skip_special_tokens, and inline reasoning must
# survive that (as Qwen3's and Kimi's think tags do).
THINK_TOKENS = [THINK, END_THINK]

# Renders system/user/assistant turns ChatML-style; an assistant message's reasoning
# (reasoning_content, or reasoning) goes first, inside <think>…</think>.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}"
    "{%- if reasoning -%}{{ '<think>\n' + reasoning + '\n</think>\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{{ (message['content'] or '') + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

_SUBJECTS = ["the model", "a student", "the server", "my friend", "the cat", "a robot", "the teacher", "our team",
             "the compiler", "a river", "the city", "the scientist", "this function", "the kernel", "a painter"]
_VERBS = ["explains", "computes", "writes", "reads", "builds", "finds", "sorts", "draws", "measures", "answers",
          "translates", "predicts", "summarizes", "checks", "plans"]
_OBJECTS = ["a short poem", "the prime numbers", "a recipe for bread", "the shortest path", "a list of cities",
            "the meaning of life", "a python script", "the weather tomorrow", "a story about dragons",
            "the sum of two numbers", "an email to a colleague", "the history of tea", "a sorting algorithm",
            "the speed of light", "a haiku about autumn"]
_ENDINGS = [".", "!", "?", " quickly.", " carefully.", " step by step.", " in one sentence.", " with examples."]
_REASONING = ["Let me think about this.", "First, I consider the question.", "The user wants a clear answer.",
              "I should check each step.", "Okay, so the key idea is simple.", "Wait, let me verify that."]


def corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """A deterministic built-in corpus: chat-like English, code, numbers, think tags, and
    the pretraining chats' text (so their words are single tokens)."""
    from eagle3.targets.tiny_pretrain import synthetic_chats

    rng = random.Random(seed)
    lines = [m["content"] + "\n" + m.get("reasoning_content", "")
             for chat in synthetic_chats(num_lines // 4, seed) for m in chat]
    for i in range(num_lines):
        kind = i % 5
        if kind == 0:
            lines.append(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
        elif kind == 2:
            name = rng.choice(["add", "sort_items", "fib", "parse", "main", "load_data"])
            lines.append(f"def {name}(x, y):\n    return x + y  # {rng.choice(_VERBS)}")
        elif kind == 3:
            lines.append(f"{THINK}\n{rng.choice(_REASONING)} {rng.choice(_REASONING)}\n{END_THINK}\nSure!")
        else:
            lines.append(f"User: Please {rng.choice(_VERBS)[:-1]} {rng.choice(_OBJECTS)}. Assistant: Of course, here it is.")
    return lines


def train_bpe(texts: list[str], vocab_size: int, special_tokens: list[str], bos: str, eos: str, pad: str,
              chat_template: str, model_max_length: int, added_tokens: tuple[str, ...] | list[str] = ()):
    """A byte-level BPE tokenizer trained in-process on ``texts``, as a ``PreTrainedTokenizerFast``
    with its chat template; ``added_tokens`` are added after training, not special (think tags)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, model_max_length=model_max_length
    )
    fast.chat_template = chat_template
    return fast


def train_tokenizer(seed: int = 0):
    """The tiny targets' tokenizer: byte-level BPE on the built-in corpus, ChatML with think tags."""
    return train_bpe(corpus(seed=seed), TOKENIZER_VOCAB, SPECIAL_TOKENS, bos=BOS, eos=IM_END, pad=PAD,
                     chat_template=CHAT_TEMPLATE, model_max_length=MAX_POSITIONS, added_tokens=THINK_TOKENS)


def _padded_vocab(n_tokens: int) -> int:
    return -(-n_tokens // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def tiny_vocab_size(arch: str, seed: int = 0) -> int:
    """The ``vocab_size`` a tiny target of ``arch`` is built with, from its tokenizer alone (seconds,
    no model built): what ``eagle3ctl init`` sizes the draft vocab by before the target exists."""
    if arch == "kimi":
        import tempfile

        from eagle3.targets import tiny_kimi

        with tempfile.TemporaryDirectory(prefix="eagle3-tiny-kimi-") as tmp:
            return len(tiny_kimi.build_tokenizer(Path(tmp), corpus(seed=seed), TOKENIZER_VOCAB, MAX_POSITIONS))
    return _padded_vocab(len(train_tokenizer(seed)))


def tiny_config(arch: str, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    common = dict(
        vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=NUM_LAYERS,
        max_position_embeddings=MAX_POSITIONS, initializer_range=INIT_STD, rms_norm_eps=1e-6,
        pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=False,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **common)
    if arch in ("deepseek", "kimi"):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
            # MLA: low-rank q and kv, the head split into nope/rope parts with DeepSeek-V3's and Kimi-K2.5's
            # head dims (128, 64; v 128): vLLM's MLA prefill kernels take only a few (nope, rope, v) shapes.
            # Two such heads learn the pretraining chats in the seconds it runs (four do not).
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            # MoE: 8 routed experts (top-2 of 2 groups), 1 shared, first layer dense. The router is
            # DeepSeek-V3's (sigmoid scores, a correction bias), which transformers always computes;
            # vLLM reads it from these two fields (its defaults: softmax, no bias).
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            topk_method="noaux_tc", scoring_func="sigmoid",
            **common,
        )
    raise ValueError(f"unknown tiny target architecture {arch!r}; choose one of {', '.join(ARCHS)}")


def build_tiny_target(arch: str, out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny pretrained target (model + tokenizer + chat template) as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from eagle3.targets.tiny_pretrain import pretrain

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny target architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if arch == "kimi":
        return _build_tiny_kimi(out_dir, seed)
    tokenizer = train_tokenizer(seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = tiny_config(arch, _padded_vocab(len(tokenizer)), ids[PAD], ids[BOS], ids[IM_END])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    pretrain(model, tokenizer, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[IM_END], pad_token_id=ids[PAD], do_sample=False
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _build_tiny_kimi(out_dir: Path, seed: int) -> Path:
    """Kimi-K2.5's wrapper around the tiny DeepseekV3; vocab = base + 256 special slots, unpadded, as Kimi's."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from eagle3.targets import tiny_kimi
    from eagle3.targets.tiny_pretrain import pretrain

    tokenizer = tiny_kimi.build_tokenizer(out_dir, corpus(seed=seed), TOKENIZER_VOCAB, MAX_POSITIONS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (tiny_kimi.PAD, tiny_kimi.BOS, tiny_kimi.IM_END)}
    text = tiny_config("kimi", len(tokenizer), ids[tiny_kimi.PAD], ids[tiny_kimi.BOS], ids[tiny_kimi.IM_END])
    config = tiny_kimi.kimi_config(text, len(tokenizer) - tiny_kimi.NUM_SPECIAL_SLOTS, len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    pretrain(model, tokenizer, seed)
    model.generation_config = GenerationConfig(bos_token_id=ids[tiny_kimi.BOS], eos_token_id=ids[tiny_kimi.IM_END],
                                               pad_token_id=ids[tiny_kimi.PAD], do_sample=False)
    model.save_pretrained(out_dir)
    tiny_kimi.write_as_kimi_checkpoint(out_dir)
    return out_dir


def _cached_dir(arch: str, cache_dir: Path, seed: int) -> Path:
    return Path(cache_dir).resolve() / f"tiny-{arch}-s{seed}-r{RECIPE_VERSION}"


def built_target_dir(arch: str, cache_dir: Path, seed: int = 0) -> Path | None:
    """The cached directory of a tiny target if it is built, else None (builds nothing, imports no torch)."""
    final = _cached_dir(arch, cache_dir, seed)
    return final if (final / COMPLETE_MARKER).exists() else None


def builtin_target_dir(arch: str, cache_dir: Path, seed: int = 0) -> Path:
    """Build (once) and return the cached directory of a tiny target.

    Safe against concurrent builders: each builds in a private folder and renames it into
    place; a folder counts as built only once its marker file exists.
    """
    final = _cached_dir(arch, cache_dir, seed)
    if (final / COMPLETE_MARKER).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.building")
    try:
        build_tiny_target(arch, tmp, seed)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"arch": arch, "seed": seed, "recipe": RECIPE_VERSION}) + "\n")
        if final.exists() and not (final / COMPLETE_MARKER).exists():
            shutil.rmtree(final, ignore_errors=True)  # a stale half-built folder from an older layout
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / COMPLETE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
