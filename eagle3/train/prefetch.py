"""Batches made ahead of time, so the accelerator never waits for them.

Reading a shard (from the store), cutting and padding samples and dequantising fp8
hidden states all run on the CPU; done inline they leave the GPU idle between steps.
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
from typing import Generic, Protocol, TypeVar

import torch

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


class ToDevice(Protocol):
    def to(self, device: torch.device) -> ToDevice: ...

    def tensors(self) -> tuple[torch.Tensor, ...]: ...


B = TypeVar("B", bound=ToDevice)
_UNSET = object()


class AheadOnDevice(Generic[B]):
    """Host batches → device batches; on CUDA the next batch's copy is issued on a side
    stream when a batch is taken, so it runs while that batch's step computes.

    Takes at most one batch from ``source`` ahead of the one handed out. Elsewhere (CPU,
    or no CUDA device) :meth:`take` is ``next(source).to(device)``.
    """

    def __init__(self, source: Iterator[B], device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: object = _UNSET  # the next batch, its copy issued (None: the source is exhausted)

    def _issue(self) -> B | None:
        host = next(self.source, None)
        if host is None or self.stream is None:
            return host
        with torch.cuda.stream(self.stream):
            return host.to(self.device)  # page-locked host memory: an asynchronous copy on the side stream

    def take(self) -> B | None:
        """The next batch on the device, or None once the source is exhausted."""
        current = self._issue() if self._ahead is _UNSET else self._ahead
        if current is None:
            self._ahead = None
            return None
        if self.stream is None:
            self._ahead = _UNSET
            return current.to(self.device)  # type: ignore[return-value]
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)  # the step starts after its batch has arrived
        for t in current.tensors():
            t.record_stream(compute)  # freed after the step, not after the copy
        self._ahead = self._issue()
        return current  # type: ignore[return-value]
