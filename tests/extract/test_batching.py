import torch

from eagle3.extract.batching import padded_tokens, plan_batches, plan_shards, right_pad


def test_shards_cover_samples_in_order_and_are_deterministic():
    lengths = torch.tensor([5, 9, 3, 12, 1, 7, 7, 2])
    plans = plan_shards(lengths, shard_tokens=10)
    assert [(p.first, p.end) for p in plans] == [(0, 2), (2, 4), (4, 7), (7, 8)]
    assert [p.num_tokens for p in plans] == [14, 15, 15, 2]
    assert [p.index for p in plans] == [0, 1, 2, 3]
    assert plan_shards(lengths, 10) == plans
    assert sum(p.num_tokens for p in plans) == int(lengths.sum())


def test_batches_respect_the_padded_budget_and_bucket_by_length():
    lengths = [100, 3, 50, 48, 5, 4, 300, 49]
    batches = plan_batches(lengths, batch_tokens=120)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 120
    assert [6] in batches  # longer than the budget: alone
    assert sorted([2, 7]) in [sorted(b) for b in batches]  # 50 and 49 share a batch
    waste = 1 - sum(lengths) / padded_tokens(lengths, batches)
    assert waste < 0.1


def test_right_pad():
    ids, real = right_pad([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]]
    assert real.tolist() == [[True, True, True], [True, False, False]]
