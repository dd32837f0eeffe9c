"""The quality race's plumbing (benchmarks/quality/): which steps run, and the checkpoint snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.quality_modules import load

run_quality, curve = load("run_quality"), load("curve")


def test_steps_interleave_the_vocabs_and_expand_the_side_names():
    every = run_quality.race_steps([16384, 64000])
    assert every == ["target", "spec_warm", "prep", "spec_data", "ours_v16384", "spec_v16384", "ours_v64000",
                     "spec_v64000", "curve", "plot"]
    assert run_quality.select_steps("all", [16384, 64000]) == every
    assert run_quality.select_steps("plot,spec,prep", [16384, 64000]) == ["prep", "spec_v16384", "spec_v64000", "plot"]
    with pytest.raises(SystemExit, match="unknown step 'train_ours'"):
        run_quality.select_steps("train_ours", [16384])


def _checkpoint(root: Path, step: int) -> Path:
    d = root / f"step-{step:07d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"w" * step)
    (d / "state.json").write_text(json.dumps({"step": step}))
    return d


def test_snapshots_keep_every_checkpoint_the_trainer_prunes(tmp_path):
    ckpts = tmp_path / "store" / "q-v512" / "train" / "attempt-0123456789ab" / "checkpoints"
    dest = tmp_path / "snapshots"
    snaps = curve.Snapshots(lambda: curve.our_checkpoints(tmp_path / "store", "q-v512"), dest, every_s=3600)
    _checkpoint(ckpts, 4)
    snaps.poll()
    first = _checkpoint(ckpts, 8)
    (ckpts / "step-0000004" / "state.json").unlink()  # pruned by the trainer (KEEP newest)
    (first.parent / "step-0000012").mkdir()  # being written: no state.json yet, not copied
    (first.parent / "step-0000012" / "model.safetensors").write_bytes(b"partial")
    snaps.poll()
    assert [s for s, _ in curve.snapshot_steps(dest)] == [4, 8]
    assert (dest / "step-0000008" / "model.safetensors").read_bytes() == b"w" * 8
    assert json.loads((dest / "step-0000004" / "state.json").read_text()) == {"step": 4}


def test_speculators_checkpoints_are_named_by_their_global_step(tmp_path):
    save = tmp_path / "spec_ckpt"
    (save / "0").mkdir(parents=True)
    (save / "0" / "model.safetensors").write_bytes(b"x")
    (save / "0" / "training_state.json").write_text(json.dumps({"epoch": 0, "local_step": 100, "global_step": 100}))
    (save / "1").mkdir()
    (save / "1" / "training_state.json").write_text("{not json")  # being rewritten: skipped this poll
    assert curve.spec_checkpoints(save) == [(100, save / "0")]
    dry = tmp_path / "dry"
    dry.mkdir()
    (dry / "model.safetensors").write_bytes(b"x")  # --dry-run: the initialized drafter in save/ itself
    assert curve.spec_checkpoints(dry) == [(0, dry)]
