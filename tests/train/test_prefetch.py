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
