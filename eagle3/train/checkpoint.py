"""Resumable checkpoints in the stage's store folder: ``checkpoints/step-0000500/`` (step, 7 digits).

Objects: ``model.safetensors`` (trainable weights, float32, the drafter's under ``drafter.``),
``optim.pt`` (optimizer + scheduler), ``rng.pt`` (torch/cuda/python/numpy RNG states of every
rank), then ``state.json`` (step, data position, counters) written LAST: a checkpoint is
complete exactly when its state.json is journaled. Only the newest ``KEEP`` are kept.
:func:`run_checkpoints` lists a run's from outside the stage (while it trains, or after).
"""

from __future__ import annotations

import io
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from eagle3.drafter.adapter import EXPORT_KEYS
from eagle3.errors import ManifestError
from eagle3.manifest import (
    StageOutput,
    attempt_prefix,
    read_manifest,
    unfinished_attempts,
)
from eagle3.store import ObjectStore

PREFIX = "checkpoints/"
KEEP = 2
MODEL = "model.safetensors"
FILES = (MODEL, "optim.pt", "rng.pt", "state.json")
DRAFTER_PREFIX = "drafter."  # the training wrapper's name for the drafter module
_STEP_DIR = re.compile(r"^checkpoints/step-(\d{7})/")


def step_dir(step: int) -> str:
    return f"{PREFIX}step-{step:07d}"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optim: dict[str, Any]  # {"optimizer": ..., "scheduler": ...}
    rng: list[dict[str, Any]]  # by rank
    state: dict[str, Any]


def complete_steps(names: list[str]) -> list[int]:
    """Steps whose checkpoint has every file (state.json is written last), ascending."""
    have: dict[int, set[str]] = {}
    for n in names:
        m = _STEP_DIR.match(n)
        if m:
            have.setdefault(int(m.group(1)), set()).add(n[m.end():])
    return sorted(s for s, files in have.items() if set(FILES) <= files)


def save_checkpoint(output: StageOutput, ckpt: Checkpoint, scratch: Path) -> None:
    """Write one checkpoint (state.json last), then drop all but the newest KEEP."""
    d = step_dir(ckpt.step)
    scratch.mkdir(parents=True, exist_ok=True)
    local = scratch / "model.safetensors"
    save_file({k: v.detach().float().cpu().contiguous() for k, v in ckpt.model.items()}, str(local))
    output.put_file(f"{d}/model.safetensors", local)
    local.unlink()
    for name, obj in (("optim.pt", ckpt.optim), ("rng.pt", ckpt.rng)):
        buf = io.BytesIO()
        torch.save(obj, buf)
        output.put_bytes(f"{d}/{name}", buf.getvalue())
    output.put_json(f"{d}/state.json", {"step": ckpt.step, **ckpt.state})
    prune(output)


def prune(output: StageOutput) -> None:
    names = sorted(set(output.entries) | set(output.recovered(PREFIX)))
    keep = set(complete_steps(names)[-KEEP:])
    for n in names:
        m = _STEP_DIR.match(n)
        if m and int(m.group(1)) not in keep:
            output.drop(n)


def load_checkpoint(store: ObjectStore, stage_prefix: str, step: int) -> Checkpoint:
    d = f"{stage_prefix}/{step_dir(step)}"
    model = load_safetensors(store.get_bytes(f"{d}/model.safetensors"))
    optim = torch.load(io.BytesIO(store.get_bytes(f"{d}/optim.pt")), weights_only=True)
    rng = torch.load(io.BytesIO(store.get_bytes(f"{d}/rng.pt")), weights_only=True)
    state = json.loads(store.get_bytes(f"{d}/state.json"))
    return Checkpoint(step, model, optim, rng, state)


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    prefix: str  # store key of the checkpoint's folder (``<run>/train/<attempt>/checkpoints/step-…``)


def run_checkpoints(store: ObjectStore, run_id: str, stage: str = "train") -> list[CheckpointRef]:
    """A run's complete checkpoints, by step: those of its newest unfinished attempt (a training
    running, stopped or killed writes there, and resumes from them), else those its committed
    output lists. Pruning may remove one any moment while training runs."""
    roots = unfinished_attempts(store, run_id, stage)
    if roots:
        prefix = attempt_prefix(run_id, stage, roots[-1])
        names = [k[len(prefix) + 1:] for k in store.list(f"{prefix}/{PREFIX.rstrip('/')}")]
    else:
        try:
            loaded = read_manifest(store, run_id, stage)
        except ManifestError:
            loaded = None
        if loaded is None:
            return []
        prefix, names = loaded.manifest.prefix, loaded.manifest.keys(PREFIX)
    return [CheckpointRef(s, f"{prefix}/{step_dir(s)}") for s in complete_steps(names)]


def drafter_weights(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The exportable drafter weights of a checkpoint's ``model.safetensors`` state."""
    return {k.removeprefix(DRAFTER_PREFIX): v for k, v in model.items() if k.removeprefix(DRAFTER_PREFIX) in EXPORT_KEYS}
