"""The vocab stage: token frequencies from generate → draft vocab mapping + coverage.

Reads ``generate/token_freq.safetensors`` (``counts`` int64 [V] over loss-masked
tokens) and writes ``vocab_mapping.safetensors``, ``coverage.json`` and ``coverage.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import load_file

from eagle3.errors import StageError
from eagle3.manifest import Manifest, read_manifest
from eagle3.store import ObjectStore
from eagle3.vocab.mapping import (
    D2T,
    T2D,
    build_vocab_mapping,
    coverage,
    coverage_curve,
    cumulative_coverage,
    save_vocab_mapping,
    validate_vocab_mapping,
)

TOKEN_FREQ = "token_freq.safetensors"
VOCAB_MAPPING = "vocab_mapping.safetensors"
COVERAGE_JSON = "coverage.json"
COVERAGE_PNG = "coverage.png"
CURVE_SIZES = (1000, 2000, 4000, 8000, 16000, 24000, 32000, 48000, 64000, 96000, 128000)


def read_token_counts(path: Path, where: str) -> torch.Tensor:
    """The ``counts`` tensor of a token_freq file, checked; ``where`` names it in errors."""
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise StageError(f"{where} is not a readable safetensors file: {e}") from None
    counts = tensors.get("counts")
    if counts is None:
        raise StageError(f"{where} has no 'counts' tensor")
    if counts.dtype != torch.int64 or counts.dim() != 1 or counts.numel() == 0:
        raise StageError(f"{where}: 'counts' must be int64 [target_vocab_size], got {counts.dtype} {tuple(counts.shape)}")
    if int(counts.min()) < 0:
        raise StageError(f"{where}: 'counts' has negative entries")
    if int(counts.sum()) == 0:
        raise StageError(f"{where} counted no loss-masked tokens: generate produced no assistant tokens")
    return counts


def coverage_report(counts: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor) -> dict[str, Any]:
    n, v = d2t.numel(), counts.numel()
    seen = int((counts > 0).sum())
    return {
        "coverage": round(coverage(counts, t2d), 6),
        "draft_vocab_size": n,
        "target_vocab_size": v,
        "distinct_tokens_seen": seen,
        "unseen_filled": max(n - seen, 0),
        "tokens_counted": int(counts.sum()),
        "coverage_curve": [
            {"draft_vocab_size": k, "coverage": round(c, 6)} for k, c in coverage_curve(counts, [*CURVE_SIZES, n])
        ],
    }


def plot_coverage(counts: torch.Tensor, n: int, cov: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = cumulative_coverage(counts)  # [V]
    v = curve.numel()
    ks = torch.unique(torch.logspace(0, torch.log10(torch.tensor(float(v))), 2000).long().clamp(1, v))  # [<=2000]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ks.numpy(), curve[ks - 1].numpy(), lw=1.5)
    ax.axvline(n, color="tab:red", ls="--", lw=1)
    ax.scatter([n], [cov], color="tab:red", zorder=3, label=f"N={n:,}: {cov:.2%}")
    ax.set_xscale("log")
    ax.set_xlabel("draft vocab size (top-N target tokens)")
    ax.set_ylabel("coverage of assistant tokens")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"Draft vocab coverage (target vocab {v:,})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(ctx: Any) -> dict[str, Any]:
    where = f"{ctx.store.uri}/{ctx.upstream_key('generate', TOKEN_FREQ)}"
    counts = read_token_counts(ctx.upstream_path("generate", TOKEN_FREQ), where)
    n = ctx.cfg.vocab.draft_vocab_size
    if n > counts.numel():
        raise StageError(
            f"vocab.draft_vocab_size={n} exceeds the target vocab size {counts.numel()} (from {where})"
        )
    ctx.progress(0, 3, "steps", force=True)
    d2t, t2d = build_vocab_mapping(counts, n)
    report = coverage_report(counts, d2t, t2d)
    ctx.progress(1, 3, "steps", force=True, coverage=report["coverage"])
    if ctx.output is not None:
        mapping_path = ctx.scratch / VOCAB_MAPPING
        save_vocab_mapping(mapping_path, d2t, t2d)
        ctx.output.put_file(VOCAB_MAPPING, mapping_path)
        ctx.output.put_json(COVERAGE_JSON, report)
        png = ctx.scratch / COVERAGE_PNG
        plot_coverage(counts, n, report["coverage"], png)
        ctx.output.put_file(COVERAGE_PNG, png)
    ctx.progress(3, 3, "steps", force=True)
    return {k: v for k, v in report.items() if k != "coverage_curve"}


def deep_check(store: ObjectStore, manifest: Manifest) -> list[str]:
    """Content checks: the mapping is well-formed, agrees with coverage.json and, when the
    committed generate stage is the one this mapping was built from, equals the mapping
    rebuilt from its token counts."""
    prefix = manifest.prefix
    where = f"{store.uri}/{prefix}/{VOCAB_MAPPING}"
    try:
        tensors = load_safetensors_bytes(store.get_bytes(f"{prefix}/{VOCAB_MAPPING}"))
    except Exception as e:
        return [f"{where} is not a readable safetensors file: {e}"]
    if D2T not in tensors or T2D not in tensors:
        return [f"{where} lacks d2t or t2d"]
    d2t, t2d = tensors[D2T], tensors[T2D]
    problems = [f"{where}: {p}" for p in validate_vocab_mapping(d2t, t2d)]
    if problems:
        return problems
    try:
        report = json.loads(store.get_bytes(f"{prefix}/{COVERAGE_JSON}"))
    except ValueError:
        return [f"{store.uri}/{prefix}/{COVERAGE_JSON} does not parse"]
    if report.get("draft_vocab_size") != d2t.numel() or report.get("target_vocab_size") != t2d.numel():
        problems.append(f"{where}: shapes disagree with {COVERAGE_JSON} (d2t {d2t.numel()}, t2d {t2d.numel()})")
    if manifest.stats.get("coverage") != report.get("coverage"):
        problems.append(f"{prefix}: manifest coverage {manifest.stats.get('coverage')} differs from {COVERAGE_JSON}")
    problems.extend(_check_against_upstream(store, manifest, d2t, t2d, where))
    return problems


def _check_against_upstream(store: ObjectStore, manifest: Manifest, d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> list[str]:
    try:
        up = read_manifest(store, manifest.run_id, "generate")
    except Exception:
        return []
    if up is None or up.digest != manifest.upstream.get("generate"):
        return []  # generate was rerun since: the input key (shallow verify) reports staleness
    try:
        counts = load_safetensors_bytes(store.get_bytes(up.manifest.object_key(TOKEN_FREQ)))["counts"]
        want_d2t, want_t2d = build_vocab_mapping(counts, d2t.numel())
    except Exception as e:
        return [f"{where}: cannot rebuild from generate/{TOKEN_FREQ}: {e}"]
    if not (torch.equal(want_d2t, d2t) and torch.equal(want_t2d, t2d)):
        return [f"{where} is not the top-{d2t.numel()} mapping of generate/{TOKEN_FREQ}"]
    return []
