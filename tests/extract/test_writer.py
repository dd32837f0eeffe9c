"""The background shard writer: shards land in order, failures surface, in-flight work finishes."""

import pytest
import torch

from eagle3.extract.shards import HiddenShard, read_shard, shard_name
from eagle3.extract.writer import ShardWriter
from eagle3.manifest import ObjectWriter
from eagle3.store.local import LocalStore


def _shard(seed: int, t: int = 6, h: int = 4) -> HiddenShard:
    g = torch.Generator().manual_seed(seed)
    return HiddenShard(
        input_ids=torch.arange(t, dtype=torch.int32), loss_mask=torch.ones(t, dtype=torch.uint8),
        offsets=torch.tensor([0, t], dtype=torch.int64), sample_ids=torch.tensor([seed], dtype=torch.int64),
        aux_hidden=torch.randn(t, 3 * h, generator=g).bfloat16(), final_hidden=torch.randn(t, h, generator=g).bfloat16(),
    )


def test_shards_are_stored_in_safetensors_and_journaled(tmp_path):
    store = LocalStore(tmp_path / "store")
    objects = ObjectWriter(store, "r", "extract", "attempt-x")
    with ShardWriter(objects) as writer:
        for i in range(3):
            writer.submit(i, _shard(i))
    assert sorted(objects.entries) == [shard_name(i) for i in range(3)]
    assert writer.bytes_written == sum(e.size for e in objects.entries.values())
    for i in range(3):
        got = read_shard(store.local_path(f"r/extract/attempt-x/{shard_name(i)}"))
        assert torch.equal(got.aux_hidden, _shard(i).aux_hidden)
        assert store.exists(f"r/extract/attempt-x/_journal/{shard_name(i)}.json")


def test_a_failed_write_surfaces_and_earlier_shards_stay(tmp_path, monkeypatch):
    objects = ObjectWriter(LocalStore(tmp_path / "store"), "r", "extract", "attempt-x")
    real_writer = objects.writer

    def store_full_on_second(name, journal=True):  # test double: the store refuses shard 1
        if name == shard_name(1):
            raise OSError("No space left on device")
        return real_writer(name, journal)

    monkeypatch.setattr(objects, "writer", store_full_on_second)
    writer = ShardWriter(objects)
    writer.submit(0, _shard(0))
    writer.submit(1, _shard(1))
    with pytest.raises(OSError, match="No space left"):
        writer.submit(2, _shard(2))  # the failure of shard 1 is raised before shard 2 is taken
    writer.close()
    assert sorted(objects.entries) == [shard_name(0)]


def test_a_failing_extraction_still_finishes_the_shard_in_flight(tmp_path):
    objects = ObjectWriter(LocalStore(tmp_path / "store"), "r", "extract", "attempt-x")
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(objects) as writer:
            writer.submit(0, _shard(0))
            raise KeyboardInterrupt  # e.g. the stage is stopped while shard 0 is being written
    assert sorted(objects.entries) == [shard_name(0)]  # journaled: a rerun adopts it
