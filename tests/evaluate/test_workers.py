"""The worker machinery on its own, with a decoder test double (spawned workers import this module)."""

import multiprocessing
import os
from contextlib import closing, contextmanager
from functools import partial

import pytest
import torch

from eagle3.errors import StageError
from eagle3.evaluate.workers import WorkerTraceback, decode_here, decode_in_workers


@contextmanager
def squaring_decoder(raise_on=None, exit_on=None, fail_loading=False):
    """Test double for ``eagle3.evaluate.stage.open_hf_decoder``: decodes an int into its square
    (and the torch threads of the process); raises on ``raise_on``, dies on ``exit_on``."""
    if fail_loading:
        raise OSError("cannot load the target\nsecond line of the message")

    def decode(index, x):
        if x == raise_on:
            raise ValueError(f"bad item {x}")
        if x == exit_on:
            os._exit(7)  # as the OOM killer would: no exception, no message
        return x * x, torch.get_num_threads()

    yield decode


def collect(stream):
    with closing(stream):
        return dict(stream)


def test_workers_decode_every_item_once_with_the_threads_split():
    items = list(range(8))
    here = list(decode_here(squaring_decoder, (), items))
    assert here == [(i, (i * i, torch.get_num_threads())) for i in items]  # in order, in this process
    results = collect(decode_in_workers(squaring_decoder, (), items, workers=2))
    assert results == {i: (i * i, max(1, torch.get_num_threads() // 2)) for i in items}
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
