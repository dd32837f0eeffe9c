"""A tiny target shaped like Kimi-K2.5 as it really is: wrapper, tokenizer, chat template.

- Model: transformers' ``Kimi_K25ForConditionalGeneration`` (``model_type: kimi_k25``): a
  vision tower and projector around a DeepseekV3 text model (MLA + MoE), the language model
  at ``model.language_model``, fields in ``text_config`` (vLLM's
  ``model_executor/models/kimi_k25.py`` builds the same: ``language_model`` from
  ``config.text_config`` as a DeepseekV2/V3 model). Tiny widths, real structure.
- Checkpoint: written as Kimi-K2.5's own is (:func:`write_as_kimi_checkpoint`), which both
  transformers and vLLM load: its tensor names, architecture name, vision fields and a
  ``preprocessor_config.json`` with the ``media_proc_cfg`` vLLM builds its image processor from.
- Tokenizer: tiktoken style, as Kimi ships it: a ``tiktoken.model`` file of base64 token
  bytes and ranks, with Kimi's named special tokens at Kimi's offsets above the base
  vocabulary (163,584 base + 256 special = 163,840 in the real one), the unnamed slots
  ``<|reserved_token_N|>``. transformers reads it through its tiktoken converter.
- Chat template: Kimi-K2.5's behaviour: the generation prompt ends in ``<think>`` (the
  response starts inside the reasoning) and assistant turns up to the last plain assistant
  answer are historical, their reasoning blanked to ``<think></think>`` - which is where a
  finished conversation's last turn lands.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

TIKTOKEN_FILE = "tiktoken.model"
NUM_SPECIAL_SLOTS = 256
# Kimi's named special tokens by offset above the base vocabulary (163584 + offset in Kimi-K2.5;
# media ids 163602..163605 as Kimi_K25Config's vision_start/end and image token ids say).
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>",
    20: "<|media_end|>", 21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}
# Think tags are plain added tokens: the server's text keeps them (skip_special_tokens).
NOT_SPECIAL = {"<think>", "</think>"}
BOS, EOS, IM_END, PAD, UNK = "[BOS]", "[EOS]", "<|im_end|>", "[PAD]", "[UNK]"

# Kimi-K2.5's template as its behaviour is described: roles as <|im_ROLE|>ROLE<|im_middle|>...<|im_end|>;
# every assistant turn up to the last one without tool calls is history, rendered <think></think>
# + content; later ones (a tool-calling turn in progress) keep their reasoning; the generation
# prompt opens the think block.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ '<|im_system|>system<|im_middle|>' + m['content'] + '<|im_end|>' }}"
    "{%- elif m['role'] == 'user' -%}{{ '<|im_user|>user<|im_middle|>' + m['content'] + '<|im_end|>' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{%- if loop.index0 <= ns.last -%}{{ '<think></think>' }}"
    "{%- else -%}{{ '<think>' + (m.get('reasoning_content') or '') + '</think>' }}{%- endif -%}"
    "{{ (m['content'] or '') + '<|im_end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|><think>' }}{%- endif -%}"
)


def _unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def write_tiktoken_tokenizer(out_dir: Path, texts: list[str], vocab_size: int, model_max_length: int) -> int:
    """Train a byte-level BPE on ``texts``, write it Kimi's way; returns the base vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    to_byte = _unicode_to_bytes()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])  # rank = id: merges in training order
    lines = [f"{base64.b64encode(bytes(to_byte[c] for c in token)).decode()} {rank}" for token, rank in vocab]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TIKTOKEN_FILE).write_text("\n".join(lines) + "\n")
    base = len(vocab)
    decoder = {str(base + off): {"content": t, "special": t not in NOT_SPECIAL, "lstrip": False, "rstrip": False,
                                 "normalized": False, "single_word": False}
               for off, t in sorted(SPECIAL_OFFSETS.items())}
    config = {"tokenizer_class": "TokenizersBackend", "vocab_file": TIKTOKEN_FILE, "added_tokens_decoder": decoder,
              "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
              "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return base


def special_id(base: int, token: str) -> int:
    return base + next(off for off, t in SPECIAL_OFFSETS.items() if t == token)


def fix_think_tags(out_dir: Path) -> None:
    """Load the tiktoken files through transformers' converter and save ``tokenizer.json`` beside them.

    The converter adds every token above the base vocabulary as special; Kimi's think tags
    are not (vLLM's kimi_k2 reasoning parser finds them in the detokenized text, which
    servers produce with ``skip_special_tokens``), so they are re-added as plain tokens.
    """
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir)
    tok._tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in sorted(NOT_SPECIAL)])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)


def build_tokenizer(out_dir: Path, texts: list[str], vocab_size: int, model_max_length: int):
    """The tiny Kimi tokenizer written to ``out_dir`` and loaded back as the stages load it."""
    from transformers import AutoTokenizer

    write_tiktoken_tokenizer(out_dir, texts, vocab_size, model_max_length)
    fix_think_tags(out_dir)
    # No transformers image processor ships with the tiny target (it needs torchvision): the
    # tokenizer is its processor, which is what `transformers serve` loads for a text-only chat.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["processor_class"] = config["tokenizer_class"]
    config_path.write_text(json.dumps(config, indent=1) + "\n")
    return AutoTokenizer.from_pretrained(out_dir)


def kimi_config(text_config, base: int, num_tokens: int):
    """Kimi-K2.5's wrapper config around a DeepseekV3 ``text_config`` (tiny vision tower)."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig

    vision = Kimi_K25VisionConfig(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
                                  num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return Kimi_K25Config(
        text_config=text_config, vision_config=vision, projection_hidden_size=32,
        image_token_id=special_id(base, "<|media_pad|>"), video_token_id=num_tokens,
        vision_start_token_id=special_id(base, "<|media_begin|>"), vision_end_token_id=special_id(base, "<|media_end|>"),
        tie_word_embeddings=False, bos_token_id=text_config.bos_token_id, eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    )


# transformers 5 saves kimi_k25 with its load-time renames reversed, and three come out unlike
# Kimi-K2.5's checkpoint (which vLLM's KimiK25 loader reads; transformers loads either):
# (saved name prefix, Kimi-K2.5's).
_KIMI_PREFIXES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.", "mm_projector."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)
# What vLLM's Kimi image processor reads from preprocessor_config.json (Kimi-K2.5 ships one); vLLM
# builds it at start-up even for text-only use. Small limits: an image is at most 64 tokens.
MEDIA_PROC_CFG = {
    "in_patch_limit": 256, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 16,
    "in_patch_limit_each_frame": 256, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}
ARCHITECTURE = "KimiK25ForConditionalGeneration"  # Kimi-K2.5's config.json (vLLM's registry name)


def kimi_tensor_name(saved: str) -> str:
    """The name Kimi-K2.5's checkpoint gives a tensor transformers saved as ``saved``."""
    for old, new in _KIMI_PREFIXES:
        if saved.startswith(old):
            return new + saved[len(old):]
    return saved


def write_as_kimi_checkpoint(out_dir: Path) -> None:
    """Rewrite a saved tiny Kimi model in place as Kimi-K2.5's checkpoint is laid out.

    - Tensor names as Kimi-K2.5's (:func:`kimi_tensor_name`).
    - ``architectures``: ``KimiK25ForConditionalGeneration``; vLLM's config reads the image
      token as ``media_placeholder_token_id`` and the vision position grid as
      ``init_pos_emb_{height,width,time}``: both spellings are kept.
    - ``preprocessor_config.json`` with :data:`MEDIA_PROC_CFG`.
    """
    from safetensors.torch import load_file, save_file

    weights = out_dir / "model.safetensors"
    tensors = load_file(weights)
    save_file({kimi_tensor_name(k): v for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config["media_placeholder_token_id"] = config["image_token_id"]
    vision = config["vision_config"]
    for axis in ("height", "width", "time"):
        vision[f"init_pos_emb_{axis}"] = vision[f"pos_emb_{axis}"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
