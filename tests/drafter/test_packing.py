"""Packed rows (several samples in one row, a document id per token) train exactly as the
same samples padded one per row: same counted rows, losses, accuracies and gradients."""

import pytest
import torch

from eagle3.drafter.loss import doc_positions, step_inputs, ttt_loss
from eagle3.drafter.caches import TTTCache
from eagle3.drafter.masks import ttt_mask
from tests.drafter.helpers import draft_ids, teacher_batch, tiny_drafter

LENGTHS = [13, 20, 7]


def padded_and_packed(pad_tail: int = 4):
    """The same three samples (prefixes of a tiny target's rows) as a padded batch and as one packed row."""
    target, ids, aux, final, _ = teacher_batch(b=3, t=max(LENGTHS))
    mask = torch.ones_like(ids, dtype=torch.uint8)
    mask[:, :3] = 0  # a prompt span at each sample's start
    for r, n in enumerate(LENGTHS):
        ids[r, n:], mask[r, n:], aux[r, n:], final[r, n:] = 0, 0, 0, 0
    rows = [slice(0, n) for n in LENGTHS]
    packed = [torch.cat([x[r, sl] for r, sl in enumerate(rows)])[None] for x in (ids, mask, aux, final)]
    docs = torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(LENGTHS)])[None]
    packed = [torch.cat([x, torch.zeros(1, pad_tail, *x.shape[2:], dtype=x.dtype)], 1) for x in packed]
    docs = torch.cat([docs, torch.full((1, pad_tail), -1, dtype=torch.int32)], 1)
    head = target.lm_head.weight.detach()[draft_ids()]
    return head, (ids, aux, final, mask), (packed[0], packed[2], packed[3], packed[1]), docs


def test_positions_and_counted_rows_stay_inside_a_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]], dtype=torch.int32)
    assert doc_positions(docs).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    ids = torch.arange(8)[None]
    mask = torch.ones(1, 8, dtype=torch.uint8)
    mask[0, 7] = 0
    _, positions, counted = step_inputs(ids, mask, 1, docs)
    assert positions.tolist() == [[1, 2, 3, 1, 2, 3, 4, 1]]
    # step 1 at row t predicts x_{t+3}: doc 0 (3 tokens) has no such row; doc 1 only row 3 (x_7 is padding)
    assert counted.tolist() == [[False, False, False, True, False, False, False, False]]


def test_packed_row_trains_like_padded_samples():
    head, padded, packed, docs = padded_and_packed()
    m = tiny_drafter().train()
    r1 = ttt_loss(m, head, *padded, steps=4, chain=True)
    g1 = torch.autograd.grad(r1.loss, [m.fc.weight, m.lm_head.weight, m.midlayer.self_attn.q_proj.weight])
    r2 = ttt_loss(m, head, *packed, steps=4, chain=True, doc_ids=docs)
    g2 = torch.autograd.grad(r2.loss, [m.fc.weight, m.lm_head.weight, m.midlayer.self_attn.q_proj.weight])
    assert r1.step_count.tolist() == r2.step_count.tolist()
    assert r1.step_count.tolist()[0] == sum(n - 3 for n in LENGTHS)  # row t counts x_{t+2} (tokens 3..n-1): t = 1..n-3
    torch.testing.assert_close(r1.step_loss, r2.step_loss)
    torch.testing.assert_close(r1.step_acc, r2.step_acc)
    assert torch.equal(r1.chain, r2.chain)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def doc_ids_of(bounds: list[int]) -> torch.Tensor:
    """One packed row with documents [bounds[i], bounds[i+1]); the last span is the padded tail (-1)."""
    docs = torch.empty(1, bounds[-1], dtype=torch.int32)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        docs[0, a:b] = i if b < bounds[-1] else -1
    return docs


def blocks_listed(count: torch.Tensor, indices: torch.Tensor, columns: int, row: int = 0) -> torch.Tensor:
    """One row's block list (count [B, 1, R], indices [B, 1, R, C]) as a bool [R, columns]; its entries must ascend."""
    out = torch.zeros(count.shape[-1], columns, dtype=torch.bool)
    for i, n in enumerate(count[row, 0].tolist()):
        listed = indices[row, 0, i, :n].long()
        assert torch.all(listed[1:] > listed[:-1]), (i, listed)
        out[i, listed] = True
    return out


@pytest.mark.parametrize("bounds", [[0, 70, 200, 330, 379, 384], [0, 128, 256, 384], [0, 384], [0, 5, 384]])
def test_document_block_lists_match_the_dense_mask(bounds):
    """The compiled kernel visits only the listed blocks and skips the mask inside full ones:
    a block is listed iff any of its positions is visible, and full iff all are; the query-side
    lists (walked by the backward pass) are the transposes."""
    from eagle3.drafter.masks import BLOCK, DocBlockMasks

    docs = torch.cat([doc_ids_of(bounds), doc_ids_of([0, 300, 384])])  # a second row: masks are per row
    t, nb = docs.shape[1], docs.shape[1] // BLOCK
    masks = DocBlockMasks(docs)
    for step in range(4):
        bm = masks.for_step(step)
        for row in range(2):
            dense = ttt_mask(t, step, None, docs)[row, 0]  # [T, (step+1)T]
            tiles = dense.view(nb, BLOCK, -1, BLOCK)
            any_, all_ = tiles.any(3).any(1), tiles.all(3).all(1)
            kvb = (step + 1) * nb
            at = (step, row)
            assert torch.equal(blocks_listed(bm.full_kv_num_blocks, bm.full_kv_indices, kvb, row), all_), at
            assert torch.equal(blocks_listed(bm.kv_num_blocks, bm.kv_indices, kvb, row), any_ & ~all_), at
            assert torch.equal(blocks_listed(bm.q_num_blocks, bm.q_indices, nb, row), (any_ & ~all_).T), at
            assert torch.equal(blocks_listed(bm.full_q_num_blocks, bm.full_q_indices, nb, row), all_.T), at


def test_flex_document_mask_equals_dense_mask():
    """Flex attention with the document block mask against SDPA with the dense bool mask, over
    block edges: documents that start mid-block, span blocks, and a padded tail. (Eager flex on
    the CPU applies mask_mod everywhere; the block lists are checked by the test above.)"""
    torch.manual_seed(0)
    heads, kv, d = 4, 2, 16
    docs = doc_ids_of([0, 70, 200, 330, 379, 384])
    t = docs.shape[1]
    caches = {name: TTTCache(name, docs) for name in ("flex", "sdpa")}
    for step in range(3):
        q = torch.randn(1, heads, t, d)
        k, v = torch.randn(1, kv, t, d), torch.randn(1, kv, t, d)
        out = {name: c.attend(q, k, v) for name, c in caches.items()}
        torch.testing.assert_close(out["flex"], out["sdpa"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_row_counts_counted_on_the_host_select_the_same_rows(packed):
    """Given the batch's row counts (made where the batch is made), the loss selects its rows
    without asking the device how many there are, and everything stays the same."""
    from eagle3.drafter.loss import row_counts

    head, padded, packed_row, docs = padded_and_packed()
    args, doc_ids = (packed_row, docs) if packed else (padded, None)
    counts = row_counts(args[3], doc_ids, 4)
    m = tiny_drafter().train()
    r1 = ttt_loss(m, head, *args, steps=4, doc_ids=doc_ids)
    g1 = torch.autograd.grad(r1.loss, [m.fc.weight, m.lm_head.weight])
    r2 = ttt_loss(m, head, *args, steps=4, doc_ids=doc_ids, counts=counts)
    g2 = torch.autograd.grad(r2.loss, [m.fc.weight, m.lm_head.weight])
    assert counts[1:] == r1.step_count.tolist() == r2.step_count.tolist()
    assert counts[0] == int(args[3][:, 1:].sum())  # teacher positions: every j with loss_mask[j+1]
    torch.testing.assert_close(r1.step_loss, r2.step_loss)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="row counts for 2 TTT steps, 4 needed"):
        ttt_loss(m, head, *args, steps=4, doc_ids=doc_ids, counts=counts[:3])


def test_block_lists_made_on_the_host_and_packed_into_one_tensor_are_the_same_lists():
    """The training loop makes every step's block lists on the prefetch thread and copies them in
    one tensor; unpacked they are contiguous views equal to the lists derived from the batch."""
    from eagle3.drafter.masks import LIST_NAMES, DocBlockMasks, pack_block_lists, unpack_block_lists

    docs = torch.cat([doc_ids_of([0, 70, 200, 330, 379, 384]), doc_ids_of([0, 300, 384])])
    flat, layout = pack_block_lists(docs, 4)
    assert pack_block_lists(docs[:, :300], 4) is None  # not whole 128-token blocks: flex is not used
    assert flat.dtype == torch.int32 and flat.dim() == 1
    unpacked = unpack_block_lists(flat, layout)
    derived = DocBlockMasks(docs, steps=4)
    for step in range(4):
        bm = derived.for_step(step)
        for name in LIST_NAMES:
            view = unpacked[step][name]
            assert view.is_contiguous() and view.data_ptr() >= flat.data_ptr()
            assert torch.equal(view, getattr(bm, name)), (step, name)
