"""Batches made ahead of time, so the accelerator never waits for them.

Reading a shard (from the store), cutting and packing samples, counting each TTT step's
rows and making the packed rows' attention block lists run on the CPU (fp8 states stay
fp8 until they are on the GPU); done inline they leave the GPU idle between steps.
:class:`Prefetcher` runs the batch iterator on a thread ``depth`` batches ahead, in the
same order (resume and determinism are unchanged). A failure in the producer is raised
in the consumer at the batch where it happened.

:class:`AheadOnDevice` then copies each batch to the GPU one step ahead, on a side CUDA
stream: on the compute stream the copy of a step's batch (84 MB for 16K tokens of a
640-wide target's bf16 states) would wait for the step before it and delay the next.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

from eagle3.train.data import Batch

T = TypeVar("T")
_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher(Generic[T]):
    def __init__(self, source: Iterator[T], depth: int = 2) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, args=(source,), name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(item):
                    return
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            self._put(_Failure(e))
            return
        self._put(_END)

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            self._thread.join()
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.error
        return item  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the producer (mid-epoch exits: max_steps, SIGTERM, errors) and wait for it."""
        self._stop.set()
        self._done = True
        self._thread.join()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AheadOnDevice:
    """Host batches → device batches; on CUDA each batch's copy is issued on a side stream one
    batch ahead (the first when this is made), so it runs while the step before computes.

    Holds at most one batch taken from ``source`` and not yet handed out. Elsewhere (CPU, or
    ``side_stream=False``) :meth:`take` is ``next(source).to(device)``.
    """

    def __init__(self, source: Iterator[Batch], device: torch.device, side_stream: bool = True) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and side_stream else None
        self._ahead = self._issue() if self.stream is not None else None  # its copy issued; None: exhausted

    def _issue(self) -> Batch | None:
        host = next(self.source, None)
        if host is None:
            return None
        with torch.cuda.stream(self.stream):
            return host.to(self.device)  # page-locked host memory: an asynchronous copy on the side stream

    def take(self) -> Batch | None:
        """The next batch on the device, or None once the source is exhausted."""
        if self.stream is None:
            host = next(self.source, None)
            return None if host is None else host.to(self.device)
        current = self._ahead
        if current is None:
            return None
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)  # the step starts after its batch has arrived
        for t in current.tensors():
            t.record_stream(compute)  # freed after the step, not after the copy
        self._ahead = self._issue()
        return current
