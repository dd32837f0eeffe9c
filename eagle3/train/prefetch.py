"""Batches made ahead of time on a background thread, so the accelerator never waits for them.

Reading a shard (from the store), cutting and padding samples and dequantising fp8
hidden states all run on the CPU; done inline they leave the GPU idle between steps.
:class:`Prefetcher` runs the batch iterator on a thread ``depth`` batches ahead, in the
same order (resume and determinism are unchanged). A failure in the producer is raised
in the consumer at the batch where it happened.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

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
