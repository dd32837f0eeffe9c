"""The race's target: a Llama trained on the Python sources at hand, with prompts of its own.

No pretrained weights are downloaded: the target is built by the tiny targets' own pieces
(:func:`eagle3.targets.tiny.train_bpe` with their ChatML template, and
:func:`eagle3.targets.tiny_pretrain.pretrain`) at the race's size, on chats made of code. Each
chat's user message is a file's prefix ending at a line end, and the answer is the code that
follows, so the target's greedy answers are code continuations: text a drafter can learn to
predict only in part. One file in 50 (by a hash of its path, the same split on every machine) is
held out: the evaluation prompts come from those files, the training prompts from the rest.

Writes into ``--out``: ``target/`` (model, tokenizer, chat template), ``prompts_train.jsonl``,
``prompts_heldout.jsonl`` and, last, ``target.json`` (what was built, and how well it trained). Run as
``python -m benchmarks.quality.target``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sysconfig
from pathlib import Path

from benchmarks.quality.files import write_json

PROMPTS = ("prompts_train.jsonl", "prompts_heldout.jsonl")
HELDOUT_SHARE = 50  # one file in 50 is held out
BPE_TEXTS = 20_000  # the tokenizer learns from the first chats' messages (~24 MB of code at most)


def code_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the .py files of 400 B to 200 KB under ``root``; the held-out ones are
    those whose path hash ranks in the lowest 1/HELDOUT_SHARE, at least one."""
    files = []
    for p in sorted(root.rglob("*.py")):
        try:
            if 400 <= p.stat().st_size <= 200_000:
                files.append(p)
        except OSError:
            continue
    ranked = sorted(files, key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).hexdigest())
    held = set(ranked[:max(1, len(files) // HELDOUT_SHARE)])
    return [p for p in files if p not in held], [p for p in files if p in held]


def read_code(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if "\x00" not in text else None


def split_code(text: str, rng: random.Random, max_chars: int) -> tuple[str, str] | None:
    """A prefix of whole lines from a random line of the file's first half, and the lines after it, each at most
    ``max_chars``; None for a file too short to give both."""
    lines = text.split("\n")
    if len(lines) < 12:
        return None
    start = rng.randrange(len(lines) // 2)
    cut = rng.randrange(start + 4, len(lines) - 2)
    prefix, rest = "\n".join(lines[start:cut]), "\n".join(lines[cut:])
    if len(prefix) > max_chars:  # whole lines only
        prefix = prefix[-max_chars:].partition("\n")[2]
    if len(rest) > max_chars:
        rest = rest[:max_chars].rpartition("\n")[0]
    prefix = prefix.strip("\n")
    return (prefix, rest) if len(prefix) >= 100 and rest.strip() else None


def code_chats(files: list[Path], n: int, seed: int, max_chars: int) -> list[list[dict]]:
    """``n`` chats (user: a code prefix, assistant: its continuation) from a seeded shuffle of ``files``,
    several cuts per file when the files are few; code holding the chat template's own tokens is left out."""
    from eagle3.targets import tiny

    rng, order, chats = random.Random(seed), list(files), []
    rng.shuffle(order)
    for _ in range(64):
        for p in order:
            text = read_code(p)
            pair = split_code(text, rng, max_chars) if text else None
            if pair and not any(t in pair[0] + pair[1] for t in tiny.SPECIAL_TOKENS + tiny.THINK_TOKENS):
                chats.append([{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}])
            if len(chats) == n:
                return chats
    raise SystemExit(f"target: the corpus gives {len(chats)} code chats, {n} needed; pass a larger --corpus-root")


def write_prompts(path: Path, chats: list[list[dict]]) -> None:
    path.write_text("".join(json.dumps({"messages": chat[:1]}) + "\n" for chat in chats))


def build(out: Path, a: argparse.Namespace) -> dict:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from eagle3.targets import tiny
    from eagle3.targets.tiny_pretrain import pretrain

    train_files, held_files = code_files(a.corpus_root)
    chats = code_chats(train_files, a.chats, a.seed, a.max_chars)
    texts = [m["content"] for chat in chats for m in chat][:BPE_TEXTS]
    tokenizer = tiny.train_bpe(texts, a.vocab, tiny.SPECIAL_TOKENS, bos=tiny.BOS, eos=tiny.IM_END, pad=tiny.PAD,
                               chat_template=tiny.CHAT_TEMPLATE, model_max_length=tiny.MAX_POSITIONS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (tiny.PAD, tiny.BOS, tiny.IM_END)}
    config = LlamaConfig(vocab_size=-(-len(tokenizer) // 128) * 128, hidden_size=a.hidden, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                         intermediate_size=a.intermediate, max_position_embeddings=tiny.MAX_POSITIONS,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=ids[tiny.PAD],
                         bos_token_id=ids[tiny.BOS], eos_token_id=ids[tiny.IM_END])
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(config).to("cuda" if torch.cuda.is_available() else "cpu")
    losses = pretrain(model, tokenizer, a.seed, a.steps, chats=chats, batch=a.batch, lr=a.lr)
    model.generation_config = GenerationConfig(bos_token_id=ids[tiny.BOS], eos_token_id=ids[tiny.IM_END],
                                               pad_token_id=ids[tiny.PAD], do_sample=False)
    model.to(torch.bfloat16).save_pretrained(out / "target")  # bfloat16, the dtype the race serves it in
    tokenizer.save_pretrained(out / "target")
    write_prompts(out / PROMPTS[0], code_chats(train_files, a.train_prompts, a.seed + 1, a.max_chars))
    write_prompts(out / PROMPTS[1], code_chats(held_files, a.heldout_prompts, a.seed + 2, a.max_chars))
    tail = losses[-max(1, len(losses) // 10):]
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": config.vocab_size,
            "layers": a.layers, "hidden_size": a.hidden, "chats": len(chats), "steps": a.steps,
            "final_loss": round(sum(tail) / len(tail), 4), "corpus_root": str(a.corpus_root),
            "train_files": len(train_files), "heldout_files": len(held_files)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus-root", type=Path, default=Path(sysconfig.get_paths()["purelib"]))
    for name, kind in (("vocab", int), ("hidden", int), ("layers", int), ("heads", int), ("kv-heads", int),
                       ("intermediate", int), ("chats", int), ("steps", int), ("batch", int), ("lr", float),
                       ("max-chars", int), ("train-prompts", int), ("heldout-prompts", int), ("seed", int)):
        ap.add_argument(f"--{name}", type=kind, required=True)
    a = ap.parse_args(argv)
    meta = build(a.out, a)
    write_json(a.out / "target.json", {**meta, "paths": [str(a.out / n) for n in (*PROMPTS, "target")]})


if __name__ == "__main__":
    main()
