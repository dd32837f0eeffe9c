"""The worker machinery on its own, with a decoder test double (spawned workers import this module)."""

import multiprocessing
import os
from contextlib import closing, contextmanager
from functools import partial

import pytest
import torch

from eagle3.errors import StageError
from eagle3.evaluate.workers import WorkerTraceback, batches, decode_here, decode_in_workers


@contextmanager
def squaring_decoder(raise_on=None, exit_on=None, fail_loading=False):
    """Test double for ``eagle3.evaluate.stage.open_hf_decoder``: decodes a batch of ints into their
    squares (with the batch's size and the torch threads of the process); raises on ``raise_on``,
    dies on ``exit_on``."""
    if fail_loading:
        raise OSError("cannot load the target\nsecond line of the message")

    def decode(indices, xs):
        assert indices == xs  # the items are their own indices here
        if raise_on in xs:
            raise ValueError(f"bad item {raise_on}")
        if exit_on in xs:
            os._exit(7)  # as the OOM killer would: no exception, no message
        return [(x * x, len(xs), torch.get_num_threads()) for x in xs]

    yield decode


def collect(stream):
    with closing(stream):
        return dict(stream)


def test_workers_decode_every_item_once_with_the_threads_split():
    items = list(range(8))
    here = list(decode_here(squaring_decoder, (), items))
    assert here == [(i, (i * i, 1, torch.get_num_threads())) for i in items]  # in order, in this process
    results = collect(decode_in_workers(squaring_decoder, (), items, workers=2))
    assert results == {i: (i * i, 1, max(1, torch.get_num_threads() // 2)) for i in items}
    assert not multiprocessing.active_children()


@pytest.mark.slow  # ~12 s: two rounds of spawned workers
def test_items_are_decoded_in_batches_of_consecutive_items():
    items = list(range(7))
    assert [list(b) for b in batches(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    here = list(decode_here(squaring_decoder, (), items, batch_size=3))
    assert here == [(i, (i * i, 1 if i == 6 else 3, torch.get_num_threads())) for i in items]
    results = collect(decode_in_workers(squaring_decoder, (), items, workers=2, batch_size=3))
    assert results == {i: (i * i, 1 if i == 6 else 3, max(1, torch.get_num_threads() // 2)) for i in items}
    with pytest.raises(StageError, match=r"^evaluate worker [01] failed on prompts 3-5: ValueError: bad item 4$"):
        collect(decode_in_workers(partial(squaring_decoder, raise_on=4), (), items, workers=2, batch_size=3))
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("kwargs, message", [
    ({"raise_on": 3}, r"evaluate worker [01] failed on prompt 3: ValueError: bad item 3"),
    ({"exit_on": 2}, r"evaluate worker [01] died \(exit code 7\) on prompt 2"),
    ({"fail_loading": True}, r"evaluate worker [01] failed while loading: OSError: cannot load the target"),
])
def test_a_failing_worker_is_one_line_and_every_worker_stops(kwargs, message):
    with pytest.raises(StageError, match=f"^{message}$") as e:
        collect(decode_in_workers(partial(squaring_decoder, **kwargs), (), list(range(6)), workers=2))
    if "exit_on" not in kwargs:
        assert isinstance(e.value.__cause__, WorkerTraceback) and "Traceback" in str(e.value.__cause__)
    assert not multiprocessing.active_children()


def test_failures_name_items_by_their_labels():
    from eagle3.evaluate.workers import _where

    assert _where(range(3, 6), "prompt", None) == "on prompts 3-5"
    # A resumed evaluation decodes the prompts left (here 2, 5, 6, 7): position 1 is prompt 5.
    labels = [2, 5, 6, 7]
    assert _where(range(1, 2), "prompt", labels) == "on prompt 5"
    assert _where(range(1, 4), "prompt", labels) == "on prompts 5-7"
    assert _where(range(0, 2), "prompt", labels) == "on prompts 2, 5"
