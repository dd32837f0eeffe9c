"""Listing a run's train checkpoints from outside the stage: the attempt in progress, else the committed output."""

from __future__ import annotations

import torch

from eagle3.drafter.adapter import EXPORT_KEYS
from eagle3.manifest import StageOutput
from eagle3.store import open_store
from eagle3.train.checkpoint import (
    FILES,
    CheckpointRef,
    drafter_weights,
    run_checkpoints,
    step_dir,
)


def _attempt(store, key: str, steps: list[int], last_incomplete: int | None = None) -> StageOutput:
    out = StageOutput(store, "r", "train", key, {})
    out.begin()
    for step in steps:
        for name in FILES:
            out.put_bytes(f"{step_dir(step)}/{name}", b"x")
    if last_incomplete is not None:  # being written: state.json comes last
        out.put_bytes(f"{step_dir(last_incomplete)}/model.safetensors", b"x")
    return out


def test_the_attempt_in_progress_wins_over_the_committed_output(tmp_path):
    store = open_store(f"file://{tmp_path}")
    assert run_checkpoints(store, "r") == []
    first = _attempt(store, "a" * 64, [2, 4], last_incomplete=6)
    root = f"r/train/{first.root}/checkpoints"
    assert run_checkpoints(store, "r") == [CheckpointRef(2, f"{root}/step-0000002"), CheckpointRef(4, f"{root}/step-0000004")]
    first.commit({})
    assert [c.step for c in run_checkpoints(store, "r")] == [2, 4]  # the committed ones, as listed
    second = _attempt(store, "b" * 64, [])
    assert run_checkpoints(store, "r") == []  # a new training has none yet: not the old run's
    second.put_bytes(f"{step_dir(1)}/state.json", b"{}")
    for name in FILES:
        second.put_bytes(f"{step_dir(3)}/{name}", b"x")
    assert [c.prefix for c in run_checkpoints(store, "r")] == [f"r/train/{second.root}/checkpoints/step-0000003"]


def test_drafter_weights_are_the_export_keys_of_the_checkpoint_model():
    model = {f"drafter.{k}": torch.zeros(1) for k in EXPORT_KEYS} | {"drafter.embed_tokens.weight": torch.zeros(1),
                                                                      "other.weight": torch.zeros(1)}
    assert sorted(drafter_weights(model)) == sorted(EXPORT_KEYS)
