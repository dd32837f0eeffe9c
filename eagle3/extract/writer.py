"""Shards written and stored on a background thread while the next one is extracted."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from eagle3.extract.shards import HiddenShard, shard_name, write_shard
from eagle3.manifest import ObjectWriter


class ShardWriter:
    """Writes each finished shard (safetensors in scratch) and puts it into the store, one behind.

    The GPU does not wait for disk or object store: shard k is written while shard k+1 is
    extracted (safetensors and hashlib release the GIL). At most one shard is in flight, so a
    process holds two shards in host memory and one shard file on scratch disk. A failed
    write surfaces at the next :meth:`submit` or at :meth:`close`; shards put before it stay
    journaled, so a rerun adopts them.
    """

    def __init__(self, writer: ObjectWriter, scratch: Path) -> None:
        self.writer, self.scratch = writer, scratch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._inflight: Future | None = None
        self.bytes_written = 0
        self.waited_s = 0.0  # seconds extraction spent waiting for the previous shard's write

    def _write(self, index: int, shard: HiddenShard) -> None:
        path = self.scratch / f"shard-{index:06d}.safetensors"
        write_shard(path, shard)
        self.bytes_written += path.stat().st_size
        self.writer.put_file(shard_name(index), path)
        path.unlink()

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
