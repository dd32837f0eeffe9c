"""Shards written and stored on a background thread while the next one is extracted."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from eagle3.extract.shards import HiddenShard, shard_name, write_shard_to
from eagle3.manifest import ObjectWriter


class ShardWriter:
    """Streams each finished shard into the store (hashed on the way), one shard behind extraction.

    The GPU does not wait for disk or object store: shard k is written while shard k+1 is
    extracted (file writes, uploads and hashing release the GIL). The shard's bytes go from
    its tensors straight into the store's writer — no scratch file, no serialized copy — so
    a ``file://`` store writes each byte once and S3 gets a multipart upload. At most one
    shard is in flight: a process holds two shards in host memory. A failed write surfaces
    at the next :meth:`submit` or at :meth:`close`; shards stored before it stay journaled,
    so a rerun adopts them.
    """

    def __init__(self, objects: ObjectWriter) -> None:
        self.objects = objects
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._inflight: Future | None = None
        self.bytes_written = 0
        self.waited_s = 0.0  # seconds extraction spent waiting for the previous shard's write

    def _write(self, index: int, shard: HiddenShard) -> None:
        with self.objects.writer(shard_name(index)) as sink:
            write_shard_to(sink, shard)  # type: ignore[arg-type]
        self.bytes_written += self.objects.entries[shard_name(index)].size

    def wait(self) -> None:
        if self._inflight is not None:
            t0 = time.perf_counter()
            inflight, self._inflight = self._inflight, None
            try:
                inflight.result()
            finally:
                self.waited_s += time.perf_counter() - t0

    def submit(self, index: int, shard: HiddenShard) -> None:
        self.wait()
        self._inflight = self._pool.submit(self._write, index, shard)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: let the in-flight shard finish (it is journaled), keep the first error
            self.close()
        except Exception:
            pass
