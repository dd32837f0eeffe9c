"""Pure vocab-mapping functions against brute-force references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.errors import StageError
from eagle3.vocab.mapping import (
    build_vocab_mapping,
    coverage,
    coverage_curve,
    draft_to_target,
    load_vocab_mapping,
    save_vocab_mapping,
    target_to_draft_index,
    validate_vocab_mapping,
)


def reference_top_ids(counts: list[int], n: int) -> list[int]:
    """Brute force: sort (−count, id) pairs, take n, return ascending ids."""
    ranked = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    return sorted(ranked[:n])


@pytest.mark.parametrize("seed", range(8))
def test_top_n_matches_brute_force_with_ties(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    v = int(torch.randint(50, 400, (1,), generator=g))
    counts = torch.randint(0, 6, (v,), generator=g)  # small range: many ties, many zeros
    n = int(torch.randint(1, v + 1, (1,), generator=g))
    d2t, t2d = build_vocab_mapping(counts, n)
    want = reference_top_ids(counts.tolist(), n)
    assert draft_to_target(d2t).tolist() == want
    assert t2d.nonzero().flatten().tolist() == want
    assert validate_vocab_mapping(d2t, t2d, vocab_size=v) == []


def test_offsets_round_trip_and_dtypes() -> None:
    counts = torch.tensor([0, 9, 0, 3, 7, 0, 1, 5], dtype=torch.int64)
    d2t, t2d = build_vocab_mapping(counts, 4)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.shape == (4,) and t2d.shape == (8,)
    # Top 4 are ids 1, 4, 7, 3 → draft ids by ascending target id: 1, 3, 4, 7.
    assert d2t.tolist() == [1 - 0, 3 - 1, 4 - 2, 7 - 3]
    for draft_id in range(4):  # the vLLM convention, spelled out
        target_id = draft_id + int(d2t[draft_id])
        assert t2d[target_id]
        assert int(target_to_draft_index(t2d)[target_id]) == draft_id
    index = target_to_draft_index(t2d)
    assert index.tolist() == [-1, 0, -1, 1, 2, -1, -1, 3]
    assert torch.equal(index[draft_to_target(d2t)], torch.arange(4))


def test_fills_with_lowest_unseen_ids_when_fewer_distinct_seen() -> None:
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[15, 3, 18]] = torch.tensor([5, 2, 2])
    d2t, t2d = build_vocab_mapping(counts, 6)
    assert draft_to_target(d2t).tolist() == [0, 1, 2, 3, 15, 18]
    assert int(t2d.sum()) == 6


def test_full_vocab_is_identity() -> None:
    counts = torch.randint(0, 100, (64,))
    d2t, t2d = build_vocab_mapping(counts, 64)
    assert torch.equal(d2t, torch.zeros(64, dtype=torch.int64))
    assert bool(t2d.all())


@pytest.mark.parametrize(
    ("counts", "n", "match"),
    [
        (torch.ones(10, dtype=torch.int64), 11, "exceeds the target vocab size 10"),
        (torch.ones(10, dtype=torch.int64), 0, "at least 1"),
        (torch.tensor([1, -1, 2]), 2, "non-negative"),
        (torch.ones(10), 2, "integer"),
        (torch.ones(2, 5, dtype=torch.int64), 2, "1-D"),
    ],
)
def test_bad_inputs_are_stage_errors(counts: torch.Tensor, n: int, match: str) -> None:
    with pytest.raises(StageError, match=match):
        build_vocab_mapping(counts, n)


def test_coverage_and_curve() -> None:
    counts = torch.tensor([10, 0, 30, 60], dtype=torch.int64)
    _, t2d = build_vocab_mapping(counts, 2)
    assert coverage(counts, t2d) == pytest.approx(0.9)
    assert coverage(torch.zeros(4, dtype=torch.int64), t2d) == 0.0
    assert coverage_curve(counts, [1, 2, 3, 10]) == [(1, 0.6), (2, 0.9), (3, 1.0), (4, 1.0)]


def test_save_load_round_trip(tmp_path: Path) -> None:
    counts = torch.randint(0, 1000, (500,))
    d2t, t2d = build_vocab_mapping(counts, 100)
    save_vocab_mapping(tmp_path / "m.safetensors", d2t, t2d)
    d2t2, t2d2 = load_vocab_mapping(tmp_path / "m.safetensors")
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)


def test_load_rejects_malformed_mappings(tmp_path: Path) -> None:
    d2t, t2d = build_vocab_mapping(torch.arange(50), 10)
    bad = t2d.clone()
    bad[int(torch.nonzero(~bad)[0])] = True  # one more target marked than draft ids
    save_vocab_mapping(tmp_path / "a.safetensors", d2t, bad)
    with pytest.raises(StageError, match="t2d marks 11 tokens, d2t has 10"):
        load_vocab_mapping(tmp_path / "a.safetensors")
    shifted = d2t.clone()
    shifted[0] += 1  # draft 0 now points at a token t2d does not mark (or collides)
    assert validate_vocab_mapping(shifted, t2d) != []
    save_vocab_mapping(tmp_path / "b.safetensors", d2t + 100, t2d)
    with pytest.raises(StageError, match="outside"):
        load_vocab_mapping(tmp_path / "b.safetensors")
    (tmp_path / "c.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(StageError, match="not a readable safetensors"):
        load_vocab_mapping(tmp_path / "c.safetensors")
    assert validate_vocab_mapping(d2t.to(torch.int32), t2d)[0].startswith("d2t must be int64")
