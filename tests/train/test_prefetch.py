import threading

import pytest

from eagle3.train.prefetch import Prefetcher


def test_same_items_in_the_same_order():
    with Prefetcher(iter(range(50)), depth=3) as p:
        assert list(p) == list(range(50))
        assert next(p, None) is None  # exhausted stays exhausted


def test_producer_failure_is_raised_at_its_place():
    def source():
        yield 1
        yield 2
        raise OSError("shard-000003.safetensors: truncated")

    with Prefetcher(source()) as p:
        assert next(p) == 1 and next(p) == 2
        with pytest.raises(OSError, match="truncated"):
            next(p)


def test_close_mid_stream_stops_the_producer():
    produced = []

    def source():
        for i in range(10_000):
            produced.append(i)
            yield i

    p = Prefetcher(source(), depth=2)
    assert next(p) == 0
    p.close()
    assert not any(t.name == "batch-prefetch" and t.is_alive() for t in threading.enumerate())
    assert len(produced) < 10  # bounded look-ahead, not the whole epoch


def _batches(n: int):
    import torch

    from eagle3.train.data import Batch

    for i in range(n):
        g = torch.Generator().manual_seed(i)
        yield Batch(torch.randint(0, 100, (2, 8), generator=g), torch.ones(2, 8, dtype=torch.uint8),
                    torch.randn(2, 8, 12, generator=g), torch.randn(2, 8, 4, generator=g), tokens=16 - i)


def test_ahead_on_device_hands_out_every_batch_in_order_then_none():
    import torch

    from eagle3.train.prefetch import AheadOnDevice

    ahead = AheadOnDevice(_batches(3), torch.device("cpu"))
    got = [ahead.take() for _ in range(3)]
    assert [b.tokens for b in got] == [16, 15, 14]
    for b, want in zip(got, _batches(3)):
        assert all(torch.equal(x, y) for x, y in zip(b.tensors(), want.tensors()))
    assert ahead.take() is None and ahead.take() is None  # exhausted stays exhausted


def test_ahead_on_device_takes_at_most_one_batch_ahead():
    import torch

    from eagle3.train.prefetch import AheadOnDevice

    taken = []

    def source():
        for b in _batches(10):
            taken.append(b.tokens)
            yield b

    ahead = AheadOnDevice(source(), torch.device("cpu"))
    ahead.take()
    ahead.take()
    assert len(taken) <= 3  # a step that stops here leaves the rest of the epoch unread
