import random
import time

import torch

from eagle3.extract.shards import HiddenShard, quantize_fp8
from eagle3.train.data import DataPlan, ShardRef, collate, collate_packed, is_eval_sample, plan_batches, plan_packs
from eagle3.train.schedule import lr_factor


def fake_shard(lengths: list[int], first_id: int = 0, h: int = 4) -> HiddenShard:
    """A shard of random hidden states (float32) with the given sample lengths."""
    t = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return HiddenShard(torch.arange(t, dtype=torch.int32), torch.ones(t, dtype=torch.uint8), offsets,
                       torch.arange(first_id, first_id + len(lengths)), torch.randn(t, 3 * h), torch.randn(t, h))


def test_plan_batches_buckets_and_covers_every_sample_once():
    lengths = [random.Random(i).randint(3, 50) for i in range(60)]
    batches = plan_batches(lengths, 128, random.Random(0))
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(60))
    assert all(max(lengths[i] for i in b) * len(b) <= 128 for b in batches)
    assert plan_batches(lengths, 128, random.Random(0)) == batches  # seeded


def test_plan_packs_fills_rows_and_covers_every_sample_once():
    lengths = [random.Random(i).randint(3, 50) for i in range(60)]
    rows = plan_packs(lengths, 128, random.Random(0))
    assert sorted(i for r in rows for i in r) == list(range(60))
    assert all(sum(lengths[i] for i in r) <= 128 for r in rows)
    assert len(rows) <= -(-sum(lengths) // 128) + 2  # first fit, longest first: close to the minimum
    assert plan_packs(lengths, 128, random.Random(0)) == rows  # seeded


def test_collate_packed_lays_samples_end_to_end_with_document_ids():
    s = fake_shard([3, 6, 4])
    b = collate_packed(s, [[1, 0], [2]], max_seq_len=5, row_tokens=10, num_rows=3, dtype=torch.float32)
    assert b.input_ids.shape == (3, 10) and b.tokens == 5 + 3 + 4
    assert b.doc_ids.tolist() == [[0] * 5 + [1] * 3 + [-1] * 2, [0] * 4 + [-1] * 6, [-1] * 10]  # row 3: shape only
    assert b.input_ids[0, :8].tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert b.loss_mask.tolist() == [[1] * 8 + [0] * 2, [1] * 4 + [0] * 6, [0] * 10]
    assert torch.equal(b.final_hidden[0, 5:8], s.final_hidden[0:3]) and torch.equal(b.aux_hidden[1, :4], s.aux_hidden[9:13])
    tails = [(0, 8), (1, 4), (2, 0)]
    assert all(not x[r, at:].any() for r, at in tails for x in (b.input_ids, b.aux_hidden, b.final_hidden))
    assert b.to(torch.device("cpu")).doc_ids is not None


def test_packed_plan_keeps_one_batch_shape_and_pads_held_out_batches():
    shards = {f"s{i}": fake_shard([5 + (j * 7 + i) % 20 for j in range(12)], first_id=100 * i) for i in range(2)}
    refs = [ShardRef(n, 12, int(s.offsets[-1])) for n, s in shards.items()]
    plan = DataPlan(refs, 60, 20, 0.2, 0, pack=True)  # rows of max_seq_len 20 (24 with pad_to 8), 3 rows a batch
    train = list(plan.iterate(shards.__getitem__, 0, torch.float32, pad_to=8))
    assert {tuple(b.input_ids.shape) for b in train} == {(3, 24)}
    held = [i for sh in shards.values() for i in sh.sample_ids.tolist() if is_eval_sample(i, 0.2, 0)]
    assert sum(b.tokens for b in train) == sum(min(20, int(sh.offsets[j + 1] - sh.offsets[j]))
                                               for sh in shards.values() for j in range(12)
                                               if int(sh.sample_ids[j]) not in held)
    assert all(int((b.doc_ids[r] >= 0).sum()) <= 20 for b in train for r in range(3))  # a row holds max_seq_len at most
    ev = list(plan.iterate(shards.__getitem__, 0, torch.float32, train=False))
    assert ev and all(b.doc_ids is None for b in ev)


def test_eval_hold_out_is_deterministic_and_near_fraction():
    held = [i for i in range(10_000) if is_eval_sample(i, 0.1, 0)]
    assert 800 < len(held) < 1200
    assert held == [i for i in range(10_000) if is_eval_sample(i, 0.1, 0)]
    assert not any(is_eval_sample(i, 0.0, 0) for i in range(100))


def test_ranks_split_shards_and_resume_skip_replays_the_tail():
    shards = {f"s{i}": fake_shard([5 + (j * 7 + i) % 20 for j in range(12)], first_id=100 * i) for i in range(4)}
    refs = [ShardRef(n, 12, int(s.offsets[-1])) for n, s in shards.items()]
    plans = [DataPlan(refs, 64, 16, 0.2, 0, rank, 2) for rank in range(2)]
    assert sorted(plans[0].rank_shards(0) + plans[1].rank_shards(0)) == [0, 1, 2, 3]
    full = [b.input_ids for b in plans[0].iterate(shards.__getitem__, 0, torch.float32)]
    tail = [b.input_ids for b in plans[0].iterate(shards.__getitem__, 0, torch.float32, skip=3)]
    assert len(tail) == len(full) - 3 and all(torch.equal(a, b) for a, b in zip(full[3:], tail))
    ev = [b for b in plans[0].iterate(shards.__getitem__, 0, torch.float32, train=False)]
    assert ev and all(t.shape[1] <= 16 for t in full + [b.input_ids for b in ev])  # max_seq_len cuts


def test_next_shard_is_read_while_this_one_is_batched():
    shards = {f"s{i}": fake_shard([8] * 6, first_id=10 * i) for i in range(3)}
    refs = [ShardRef(n, 6, 48) for n in shards]
    opened = []

    def open_shard(name: str) -> HiddenShard:
        opened.append(name)
        return shards[name]

    it = DataPlan(refs, 16, 16, 0.0, 0).iterate(open_shard, 0, torch.float32)
    next(it)  # the first batch of the first shard
    for _ in range(100):  # the read-ahead runs on a thread: give it a moment
        if len(opened) == 2:
            break
        time.sleep(0.01)
    assert len(opened) == 2  # the second shard is on its way, the third is not
    assert len(list(it)) == 3 * 3 - 1 and len(opened) == 3


def test_collate_pads_right_and_cuts():
    s = fake_shard([3, 6])
    b = collate(s, [0, 1], max_seq_len=5, dtype=torch.float32, pad_to=4)
    assert b.input_ids.shape == (2, 8) and b.tokens == 3 + 5
    assert b.loss_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert torch.equal(b.aux_hidden[1, :5], s.aux_hidden[3:8])


def test_lr_schedule_warmup_then_cosine_to_min():
    f = [lr_factor(s, 4, 20, 0.1) for s in range(25)]
    assert f[0] == 0.25 and f[3] == 1.0
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    assert abs(f[20] - 0.1) < 1e-9 and f[24] == f[20]


def test_malformed_index_is_one_clear_error():
    import pytest

    from eagle3.errors import StageError
    from eagle3.train.data import shard_refs

    with pytest.raises(StageError, match="malformed shard list"):
        shard_refs({"shards": [{"name": "x"}]})
    with pytest.raises(StageError, match="no shards"):
        shard_refs({"shards": []})
    assert shard_refs({"shards": [{"name": "a", "num_samples": 2, "num_tokens": 9}]})[0].num_tokens == 9


def fp8_shard(lengths: list[int], h: int = 4) -> HiddenShard:
    s = fake_shard(lengths, h=h)
    aux, aux_scale = quantize_fp8(s.aux_hidden, groups=3)
    final, final_scale = quantize_fp8(s.final_hidden)
    return HiddenShard(s.input_ids, s.loss_mask, s.offsets, s.sample_ids, aux, final, aux_scale, final_scale)


def test_fp8_batches_travel_raw_and_dequantize_where_used_to_the_host_dequantized_batch():
    """raw_fp8 (the train loop on CUDA): the batch keeps the shard's float8 states and scales (half
    the bytes to copy to the GPU); dequantized there, it equals the batch dequantized on the host."""
    s = fp8_shard([3, 6, 4])
    for make in (lambda raw: collate_packed(s, [[1, 0], [2]], 5, 10, 3, torch.bfloat16, raw_fp8=raw),
                 lambda raw: collate(s, [0, 2], 5, torch.bfloat16, pad_to=4, raw_fp8=raw)):
        host, raw = make(False), make(True)
        assert raw.aux_hidden.dtype == torch.float8_e4m3fn and raw.aux_scale.shape == (*raw.aux_hidden.shape[:2], 3)
        assert host.aux_scale is None and host.dequantized(torch.bfloat16) is host
        used = raw.to(torch.device("cpu")).dequantized(torch.bfloat16)
        assert used.aux_scale is None and used.aux_hidden.dtype == torch.bfloat16
        assert torch.equal(used.aux_hidden, host.aux_hidden) and torch.equal(used.final_hidden, host.final_hidden)
        assert torch.equal(used.input_ids, host.input_ids) and torch.equal(used.loss_mask, host.loss_mask)


def prompted_shard(lengths: list[int], prompt: int, h: int = 4) -> HiddenShard:
    """A shard whose samples' first ``prompt`` tokens are the prompt (loss mask 0), the rest the response."""
    s = fake_shard(lengths, h=h)
    s.loss_mask.copy_(torch.cat([torch.tensor([0] * prompt + [1] * (n - prompt), dtype=torch.uint8) for n in lengths]))
    return s


def test_all_tokens_teaches_every_real_token_of_a_sample_and_nothing_past_it():
    s = prompted_shard([6, 9, 4], prompt=3)
    packed = collate_packed(s, [[1, 0], [2]], max_seq_len=8, row_tokens=16, num_rows=3, dtype=torch.float32, all_tokens=True)
    assert torch.equal(packed.loss_mask.bool(), packed.doc_ids >= 0)  # the prompt's tokens too, never a tail or an empty row
    assert packed.loss_mask.sum() == packed.tokens == 8 + 6 + 4  # sample 1 cut to max_seq_len: its cut tail is not taught
    padded = collate(s, [0, 1, 2], max_seq_len=8, dtype=torch.float32, pad_to=4, all_tokens=True)
    assert padded.loss_mask.tolist() == [[1] * 6 + [0] * 2, [1] * 8, [1] * 4 + [0] * 4]
    # the default is the shard's own mask: the prompt's tokens stay out
    assert collate(s, [0], max_seq_len=8, dtype=torch.float32).loss_mask.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert s.loss_mask[:6].tolist() == [0, 0, 0, 1, 1, 1]  # the shard is not written


def test_all_tokens_reaches_training_batches_only_and_keeps_their_order():
    shards = {f"s{i}": prompted_shard([5 + (j * 7 + i) % 20 for j in range(12)], prompt=4) for i in range(2)}
    for s, first in zip(shards.values(), (0, 100)):
        s.sample_ids.add_(first)
    refs = [ShardRef(n, 12, int(s.offsets[-1])) for n, s in shards.items()]
    for pack in (True, False):
        every, own = (DataPlan(refs, 60, 20, 0.2, 0, pack=pack, all_tokens=a) for a in (True, False))
        train_all = list(every.iterate(shards.__getitem__, 0, torch.float32, pad_to=8))
        train_own = list(own.iterate(shards.__getitem__, 0, torch.float32, pad_to=8))
        assert len(train_all) == len(train_own)
        for x, y in zip(train_all, train_own):  # the same batches, in the same order; only the mask grows
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.aux_hidden, y.aux_hidden)
            assert int(x.loss_mask.sum()) == x.tokens > int(y.loss_mask.sum()) > 0
            assert not (y.loss_mask.bool() & ~x.loss_mask.bool()).any()
        held_all = list(every.iterate(shards.__getitem__, 0, torch.float32, train=False))
        held_own = list(own.iterate(shards.__getitem__, 0, torch.float32, train=False))
        assert held_all and all(torch.equal(x.loss_mask, y.loss_mask) for x, y in zip(held_all, held_own, strict=True))
        assert all(int(x.loss_mask.sum()) < x.tokens for x in held_all)  # held out: the response's tokens alone
