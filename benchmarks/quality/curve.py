"""Acceptance against optimizer steps: keep both trainers' checkpoints, export them, one evaluator.

Both trainers keep only their newest checkpoints (ours ``checkpoints/step-NNNNNNN/`` in the
train stage's attempt folder, KEEP of them; speculators one ``<save>/<epoch>/`` it overwrites),
so a :class:`Snapshots` thread copies each complete one aside while training runs. After
training, every snapshot becomes an export directory (ours through the export stage's own
``export_tensors`` / ``build_vllm_config``, theirs through spec_train.export_ours) and goes
through :func:`evaluate_export`: the evaluate stage's HF decoder and report on the same
held-out prompts, so every point of every curve comes from one evaluator.
"""

from __future__ import annotations

import json
import shutil
import threading
from contextlib import closing
from pathlib import Path
from typing import Any, Callable

from safetensors.torch import load_file, save_file

MODEL = "model.safetensors"


def our_checkpoints(store: Path, run: str) -> list[tuple[int, Path]]:
    """Complete checkpoints of run/train in any attempt folder (state.json is written last)."""
    out = []
    for state in (store / run / "train").glob("attempt-*/checkpoints/step-*/state.json"):
        out.append((int(state.parent.name.removeprefix("step-")), state.parent))
    return sorted(out)


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

    def __enter__(self) -> "Snapshots":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
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


def export_our_checkpoint(snapshot: Path, drafter_config: dict, vocab_mapping: Path, out: Path) -> Path:
    """One of our train checkpoints as an export directory, exactly as the export stage writes it."""
    from eagle3.drafter.adapter import EXPORT_KEYS, check_weights
    from eagle3.drafter.model import DrafterConfig
    from eagle3.export.stage import CONFIG, export_tensors
    from eagle3.export.vllm_config import build_vllm_config
    from eagle3.vocab.mapping import load_vocab_mapping

    dcfg = DrafterConfig.from_dict(drafter_config)
    raw = load_file(str(snapshot / MODEL))
    weights = {k.removeprefix("drafter."): v for k, v in raw.items() if k.removeprefix("drafter.") in EXPORT_KEYS}
    problems = check_weights(dcfg, {k: tuple(v.shape) for k, v in weights.items()}, str(snapshot))
    if problems:
        raise ValueError(problems[0])
    d2t, t2d = load_vocab_mapping(vocab_mapping)
    out.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(weights, d2t, t2d), str(out / MODEL), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(build_vllm_config(dcfg, dcfg.aux_layer_ids), indent=2) + "\n")
    return out


def evaluate_export(config: Path, export_dir: Path) -> dict[str, Any]:
    """The evaluate stage's hf report for an export directory, on the config's held-out prompts."""
    from eagle3.config import load_config
    from eagle3.evaluate.stage import decode_prompts, held_out_prompt_ids, hf_report
    from eagle3.export.stage import CONFIG

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
