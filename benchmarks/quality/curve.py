"""Acceptance against optimizer steps: keep both trainers' checkpoints, export them, one evaluator.

Both trainers keep only their newest checkpoints (ours KEEP of them in the train stage's attempt
folder, listed by ``eagle3.train.checkpoint.run_checkpoints``; speculators one ``<save>/<epoch>/``
it overwrites), so a :class:`Snapshots` thread copies each complete one aside while training
runs. After training, every snapshot becomes an export directory (ours through the export
stage's own writer, ``eagle3.export.directory.write_export``; theirs through
spec_train.export_ours) and goes through :func:`evaluate_export`: the evaluate stage's HF
decoder and report on the same held-out prompts, so every point of every curve comes from one
evaluator.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any, Self

from safetensors.torch import load_file

from eagle3.drafter.model import DrafterConfig
from eagle3.export.directory import CONFIG, MODEL, ServingFacts, write_export
from eagle3.store import ObjectStore
from eagle3.train.checkpoint import drafter_weights, run_checkpoints
from eagle3.vocab.mapping import load_vocab_mapping


def our_checkpoints(store: ObjectStore, run: str, not_under: str | None = None) -> list[tuple[int, Path]]:
    """Complete checkpoints of the run's train stage (file:// store: their folders in place), less those
    under ``not_under``: the committed training a retraining replaces, whose checkpoints run_checkpoints
    lists until the new attempt's folder appears."""
    return [(c.step, store.local_path(c.prefix)) for c in run_checkpoints(store, run)
            if not_under is None or not c.prefix.startswith(f"{not_under}/")]


def spec_checkpoints(save: Path) -> list[tuple[int, Path]]:
    """speculators' checkpoints under ``save``: ``<epoch>/`` with training_state.json (its global step)."""
    out = []
    for state in save.glob("[0-9]*/training_state.json"):
        try:
            out.append((int(json.loads(state.read_text())["global_step"]), state.parent))
        except (ValueError, KeyError, OSError):
            continue  # being rewritten: the next poll sees it whole
    if not out and (save / MODEL).exists():
        out.append((0, save))  # --dry-run (no GPU): the initialized drafter, saved in save/ itself
    return sorted(out)


class Snapshots:
    """Copies every new checkpoint ``find()`` lists into ``dest/step-NNNNNNN/`` (its model file and
    its json files), polling every ``every_s`` on a thread; :meth:`poll` once more at the end."""

    def __init__(self, find: Callable[[], list[tuple[int, Path]]], dest: Path, every_s: float = 1.0) -> None:
        self.find, self.dest, self.every_s = find, dest, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        dest.mkdir(parents=True, exist_ok=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def poll(self) -> None:
        for step, src in self.find():
            dst = self.dest / f"step-{step:07d}"
            if dst.exists():
                continue
            tmp = self.dest / f".step-{step:07d}.copying"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir()
                for f in [src / MODEL, *src.glob("*.json")]:
                    shutil.copyfile(f, tmp / f.name)
                tmp.rename(dst)
            except OSError:  # pruned while copying: that checkpoint is gone, the next one is kept
                shutil.rmtree(tmp, ignore_errors=True)


def snapshot_steps(dest: Path) -> list[tuple[int, Path]]:
    return sorted((int(p.name.removeprefix("step-")), p) for p in dest.glob("step-*") if (p / MODEL).exists())


def export_our_checkpoint(snapshot: Path, drafter_config: dict, vocab_mapping: Path, out: Path,
                          facts: ServingFacts = ServingFacts()) -> Path:
    """One of our train checkpoints as an export directory, by the export stage's own writer
    (``facts``: the run's, :func:`eagle3.export.stage.serving_facts`, for the export stage's very bytes)."""
    d2t, t2d = load_vocab_mapping(vocab_mapping)
    weights = drafter_weights(load_file(str(snapshot / MODEL)))
    write_export(out, DrafterConfig.from_dict(drafter_config), weights, d2t, t2d, facts=facts)
    return out


def evaluate_export(config: Path, export_dir: Path) -> dict[str, Any]:
    """The evaluate stage's hf report for an export directory, on the config's held-out prompts."""
    from eagle3.config import load_config
    from eagle3.evaluate.stage import decode_prompts, held_out_prompt_ids, hf_report

    cfg = load_config(config)
    held, prompts = held_out_prompt_ids(cfg)
    items = [(i, p.sample_id, ids) for i, (p, ids) in enumerate(zip(held.prompts, prompts))]
    export_config = json.loads((export_dir / CONFIG).read_text())
    results: list[Any] = [None] * len(items)
    with closing(decode_prompts(cfg.target, cfg.evaluate, export_config, export_dir / MODEL, items)) as stream:
        for j, r in stream:
            results[j] = r
    report = hf_report(cfg.evaluate.num_draft_tokens, results)
    report["num_prompts"], report["held_out"] = len(items), held.held_out
    return report
