"""Make a small pretrained target for the acceptance-length benchmark (issue 8).

No pretrained weights can be downloaded, so the benchmark trains its own target: a
Llama-style causal LM with its own byte-level BPE tokenizer, trained for a fixed time on
the Python source files the machine already has (its site-packages). A held-out set of
files (chosen by a hash of the path, so the split is the same on every machine) supplies
the evaluation prompts; the rest supplies the training prompts.

The target speaks raw code with one marker: every training document holds one ``<|sep|>``
at a random line end. The chat template renders the user message (a code prefix ending
at a line end) then ``<|sep|>`` as the generation prompt, then the assistant message, so
the "response" that generate collects is the target's own greedy continuation of the code,
and the prompt's tokens stay a prefix of the conversation's tokens (the special token
stops BPE merges across the boundary, as a real chat template's role markers do).

Outputs in ``--work``: ``target/`` (HF dir: model, tokenizer, chat template),
``prompts_train.jsonl``, ``prompts_heldout.jsonl``, ``target_meta.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BOS, EOS, PAD, SEP = "<|bos|>", "<|endoftext|>", "<|pad|>", "<|sep|>"
# Completion with one marker the model saw in training: <bos> prefix <sep> continuation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] or '' }}"
    "{%- else -%}{{ (message['content'] or '') + '<|sep|>' }}{%- endif -%}"
    "{%- endfor -%}"
)
HELDOUT_MOD = 50  # one file in 50 is held out


@dataclass
class TargetRecipe:
    vocab_size: int = 64000
    hidden_size: int = 640
    num_layers: int = 12
    num_heads: int = 10
    num_kv_heads: int = 2
    intermediate_size: int = 1728
    seq_len: int = 1024
    batch_seqs: int = 64
    lr: float = 1.5e-3
    warmup_steps: int = 100
    train_seconds: float = 150.0
    tokenizer_bytes: int = 24 << 20  # text the BPE trainer sees
    corpus_bytes: int = 100 << 20  # text tokenized for LM training (~25M tokens)
    prompts_train: int = 4096
    prompts_heldout: int = 256


TINY = TargetRecipe(vocab_size=2048, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=128, seq_len=128, batch_seqs=8, warmup_steps=5, train_seconds=8.0,
                    tokenizer_bytes=1 << 20, corpus_bytes=2 << 20, prompts_train=48, prompts_heldout=12)


def log(msg: str) -> None:
    print(f"[make_target {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def site_packages() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def collect_files(root: Path, max_file_bytes: int = 200_000) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of .py sources under root, sorted by path."""
    train, heldout = [], []
    for p in sorted(root.rglob("*.py")):
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if not 400 <= size <= max_file_bytes:
            continue
        rel = p.relative_to(root).as_posix()
        (heldout if is_heldout(rel) else train).append(p)
    return train, heldout


def read_text(p: Path) -> str | None:
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if "\x00" not in text else None


def read_budget(files: list[Path], budget: int, seed: int) -> list[str]:
    """Texts of a seeded shuffle of files until ``budget`` characters."""
    order = list(files)
    random.Random(seed).shuffle(order)
    out, total = [], 0
    for p in order:
        t = read_text(p)
        if t is None:
            continue
        out.append(t)
        total += len(t)
        if total >= budget:
            break
    return out


def train_tokenizer(texts: list[str], vocab_size: int, max_len: int):
    from eagle3.targets.tiny import train_bpe

    return train_bpe(texts, vocab_size, [PAD, BOS, EOS, SEP], bos=BOS, eos=EOS, pad=PAD, chat_template=CHAT_TEMPLATE,
                     model_max_length=max_len)


def split_at_line_end(text: str, rng: random.Random) -> tuple[str, str]:
    """Cut before a random newline (prompts end there too); no newline: the end."""
    ends = [m.start() for m in re.finditer("\n", text)] or [len(text)]
    cut = rng.choice(ends)
    return text[:cut], text[cut:]


def pack(tokenizer, texts: list[str], seed: int = 0) -> torch.Tensor:
    """All documents as one int32 stream: <bos> head <sep> tail <eos> <bos> ..."""
    bos, eos, sep = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(SEP)
    rng = random.Random(seed)
    pieces = [p for t in texts for p in split_at_line_end(t, rng)]
    enc = tokenizer.backend_tokenizer.encode_batch(pieces, add_special_tokens=False)
    stream: list[int] = []
    for head, tail in zip(enc[0::2], enc[1::2]):
        stream.append(bos)
        stream.extend(head.ids)
        stream.append(sep)
        stream.extend(tail.ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.int32)


def build_model(r: TargetRecipe, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=r.vocab_size, hidden_size=r.hidden_size, num_hidden_layers=r.num_layers,
        num_attention_heads=r.num_heads, num_key_value_heads=r.num_kv_heads,
        head_dim=r.hidden_size // r.num_heads, intermediate_size=r.intermediate_size,
        max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa",
    )
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaForCausalLM(cfg)


def batches(stream: torch.Tensor, r: TargetRecipe, gen: torch.Generator, device: torch.device):
    """Random windows of seq_len+1 tokens: (inputs, labels) [B, seq_len]."""
    n = stream.numel() - r.seq_len - 1
    while True:
        starts = torch.randint(0, n, (r.batch_seqs,), generator=gen)
        idx = starts[:, None] + torch.arange(r.seq_len + 1)[None, :]
        win = stream[idx.to(stream.device)].to(device, non_blocking=True).long()
        yield win[:, :-1], win[:, 1:]


MICRO_TOKENS = 16384


def micro_batches(x: torch.Tensor, y: torch.Tensor):
    """(inputs, labels, share of the batch) in pieces of about MICRO_TOKENS tokens: a 64K-token batch's
    float32 logits over a 64K vocab alone are 16 GiB, which with their gradient did not fit an 80 GB H100
    (the H200 held them). The shares weigh each piece's mean loss into the batch's mean."""
    n = max(1, min(x.shape[0], x.numel() // MICRO_TOKENS))
    for xm, ym in zip(x.chunk(n), y.chunk(n)):
        yield xm, ym, xm.shape[0] / x.shape[0]


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Chunked-free: hidden -> logits in bf16, cross-entropy in float32.
    h = model.model(input_ids=x).last_hidden_state  # [B, T, H]
    logits = model.lm_head(h)  # [B, T, V]
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_lm(model, stream: torch.Tensor, heldout: torch.Tensor, r: TargetRecipe, device: torch.device,
             seed: int) -> dict:
    """Train for r.train_seconds of wall time; cosine LR over the time budget."""
    model.to(device).train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    gen = torch.Generator().manual_seed(seed)
    it = batches(stream, r, gen, device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    t0 = time.monotonic()
    step, tokens, loss_ema = 0, 0, None
    while True:
        frac = (time.monotonic() - t0) / r.train_seconds
        if frac >= 1.0:
            break
        warm = min(1.0, (step + 1) / max(1, r.warmup_steps))
        lr = r.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = next(it)
        loss = 0.0
        for xm, ym, share in micro_batches(x, y):
            with amp:
                part = lm_loss(model, xm, ym) * share
            part.backward()
            loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        if step % 50 == 0 or step == 1:
            lv = float(loss)
            loss_ema = lv if loss_ema is None else 0.8 * loss_ema + 0.2 * lv
            el = time.monotonic() - t0
            log(f"step {step} loss {lv:.3f} lr {lr:.2e} tokens {tokens} tok/s {tokens / el:,.0f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    model.eval()
    held = evaluate_loss(model, heldout, r, device, seed)
    return {"steps": step, "train_tokens": tokens, "train_seconds": round(elapsed, 1),
            "train_tokens_per_s": round(tokens / elapsed), "train_loss_last": loss_ema,
            "heldout_loss": held, "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.type == "cuda" else None}


@torch.no_grad()
def evaluate_loss(model, stream: torch.Tensor, r: TargetRecipe, device: torch.device, seed: int, n: int = 8) -> float:
    if stream.numel() <= r.seq_len + 1:
        return float("nan")
    it = batches(stream, r, torch.Generator().manual_seed(seed + 1), device)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    losses = []
    for _ in range(n):
        x, y = next(it)
        with amp:
            losses.append(sum(float(lm_loss(model, xm, ym)) * share for xm, ym, share in micro_batches(x, y)))
    return sum(losses) / len(losses)


def code_prefix(text: str, rng: random.Random, min_chars: int, max_chars: int) -> str | None:
    """A prefix of the file ending just before a newline (a clean token boundary)."""
    lines = text.split("\n")
    if len(lines) < 12:
        return None
    start = rng.randrange(0, max(1, len(lines) // 2))
    out, n = [], 0
    for line in lines[start:]:
        if n + len(line) + 1 > max_chars:
            break
        out.append(line)
        n += len(line) + 1
    prefix = "\n".join(out).strip("\n").rstrip()
    return prefix if len(prefix) >= min_chars else None


def make_prompts(files: list[Path], n: int, seed: int, min_chars: int = 200, max_chars: int = 1200) -> list[dict]:
    rng = random.Random(seed)
    order = list(files)
    rng.shuffle(order)
    prompts: list[dict] = []
    passes = 0
    while len(prompts) < n and passes < 8:  # several prefixes per file when files are few
        for p in order:
            text = read_text(p)
            prefix = code_prefix(text, rng, min_chars, max_chars) if text else None
            if prefix:
                prompts.append({"messages": [{"role": "user", "content": prefix}]})
                if len(prompts) >= n:
                    break
        passes += 1
    return prompts


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def save_init(model, tokenizer, init_dir: Path) -> None:
    """The untrained target (bf16), for work that needs only its shapes (compiling speculators'
    trainer while the target trains); ``READY`` is written last."""
    init_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(init_dir, state_dict={k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    tokenizer.save_pretrained(init_dir)
    (init_dir / "READY").write_text("untrained\n")


def make_target(work: Path, r: TargetRecipe, corpus_root: Path, device: torch.device, seed: int = 0,
                init_dir: Path | None = None) -> dict:
    from transformers import GenerationConfig

    work.mkdir(parents=True, exist_ok=True)
    meta_path = work / "target_meta.json"
    if meta_path.exists():
        log(f"target already made: {meta_path}")
        return json.loads(meta_path.read_text())
    t0 = time.monotonic()
    train_files, heldout_files = collect_files(corpus_root)
    log(f"corpus {corpus_root}: {len(train_files)} train files, {len(heldout_files)} held-out files")
    texts = read_budget(train_files, r.corpus_bytes, seed)
    held_texts = read_budget(heldout_files, max(r.corpus_bytes // 50, 1 << 20), seed)
    t_read = time.monotonic() - t0
    tok_texts = texts[: max(1, int(len(texts) * r.tokenizer_bytes / max(1, sum(map(len, texts)))))]
    tokenizer = train_tokenizer(tok_texts, r.vocab_size, 8192)
    t_tok = time.monotonic() - t0 - t_read
    log(f"tokenizer: {len(tokenizer)} tokens from {sum(map(len, tok_texts)) / 2**20:.0f} MiB in {t_tok:.0f}s")
    stream, held_stream = pack(tokenizer, texts, seed), pack(tokenizer, held_texts, seed + 1)
    chars_per_token = sum(map(len, texts)) / stream.numel()
    log(f"packed {stream.numel():,} train tokens ({chars_per_token:.2f} chars/token), {held_stream.numel():,} held-out")
    torch.manual_seed(seed)
    model = build_model(r, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f}M parameters; training {r.train_seconds:.0f}s on {device}")
    if init_dir is not None:
        save_init(model, tokenizer, init_dir)
    stats = train_lm(model, stream.to(device) if device.type == "cuda" else stream, held_stream, r, device, seed)
    log(f"trained: {json.dumps(stats)}")
    out = work / "target"
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_jsonl(work / "prompts_train.jsonl", make_prompts(train_files, r.prompts_train, seed))
    write_jsonl(work / "prompts_heldout.jsonl", make_prompts(heldout_files, r.prompts_heldout, seed + 1))
    meta = {"recipe": asdict(r), "parameters": n_params, "corpus_root": str(corpus_root),
            "train_files": len(train_files), "heldout_files": len(heldout_files),
            "corpus_tokens": int(stream.numel()), "chars_per_token": round(chars_per_token, 3),
            "tokenizer_seconds": round(t_tok, 1), "read_seconds": round(t_read, 1), **stats,
            "total_seconds": round(time.monotonic() - t0, 1)}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke-test recipe (seconds)")
    ap.add_argument("--corpus-root", type=Path, default=None, help="default: this Python's site-packages")
    ap.add_argument("--train-seconds", type=float, default=None)
    ap.add_argument("--prompts-train", type=int, default=None)
    ap.add_argument("--init-dir", type=Path, default=None, help="also save the untrained target here first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    r = TINY if args.tiny else TargetRecipe()
    if args.train_seconds is not None:
        r.train_seconds = args.train_seconds
    if args.prompts_train is not None:
        r.prompts_train = args.prompts_train
    meta = make_target(args.work, r, args.corpus_root or site_packages(), torch.device(args.device), init_dir=args.init_dir)
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
