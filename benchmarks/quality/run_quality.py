"""Issue 21: eagle3ctl against vllm-project/speculators, trained to convergence, one evaluator.

Resumable steps under ``--work`` (each leaves ``results/<step>.json``; a rerun skips done
steps, naming a training saved under other recipe flags, which ``--retrain`` trains again; a
training cut by the deadline resumes from its newest checkpoint on the next call):

1. ``target``     make_target.py: BPE tokenizer + ~130M Llama on site-packages code (held-out loss
   reported). ``spec_warm`` (speculators' cold ``torch.compile`` on random samples, nothing
   timed) runs beside it on the untrained copy.
2. ``prep``       run ``q-v<first vocab>``: generate (against serve_batched.py, standing in for vLLM),
   vocab, extract, through ``eagle3ctl run pipeline``.
3. ``spec_data``  the same samples and hidden states in speculators' format (spec_data.py).
4. per draft vocab V (``--draft-vocabs``), in order: ``ours_vV`` = run ``q-vV``'s train stage
   (generate + extract adopted from the first run by ``--reuse-from``: only vocab and train run),
   ``spec_vV`` = speculators on the same samples, vocab mapping, steps and tokens per step
   (spec_train.py), with its default loss for EAGLE-3 (kl_div); ``specce_vV`` (``--sides``)
   = the same with its ``ce`` loss (cross-entropy on the target's argmax), the control for
   ``--teacher-temperature`` below 1. Each for ``--train-steps`` optimizer steps (ours for
   ``--ours-train-steps`` when given: a race at equal training seconds, which the summary names); every
   checkpoint is copied aside while they train (curve.Snapshots).
5. ``curve``      every kept checkpoint of both systems exported and decoded by the evaluate stage's
   decoder on the same held-out prompts (curve.py); final checkpoints first, one file per point.
6. ``plot``       acceptance vs steps (one PNG) and the summary (summarize.py): acceptance with
   95 % intervals, ratios only where both sides finished.

``--setting NAME`` (device_call.sh's sweep) trains the sides in a folder of their own, ``--work``/sweep/NAME,
and in runs of their own (``q-vV-<8 hex of NAME>``, adopting the race's generate and extract by
``--reuse-from``): their results, recipes, checkpoints and curve points live there, while the target, the
race's data and speculators' copy of it are read from ``--work``. A setting never retrains, replaces or
evaluates anything of the race's own, in its folder or in the store (where adopting only records the hard links'
new fingerprints in the race's ``_verified.json``, as ``--reuse-from`` does).

Every step checks the time left (``--budget-s``) and runs its commands under that deadline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Literal, NoReturn, get_args, get_origin

from files import write_json
from pydantic import ValidationError
from summarize import DONE_EARLIER, DONE_IN, OURS_OWN, SHARED, point_evaluator

from eagle3.settings.train import TrainSettings

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# Ours' own flags default to what the train stage does unset (summarize.RECIPE_DEFAULTS keeps, on purpose, what
# results saved before a flag existed were trained with: those must not move when the stage's defaults do).
STAGE_DEFAULT = {name: field.default for name, field in TrainSettings.model_fields.items()}
# and the values a train setting of a few takes, for the flags that pass one on (--optimizer, --lm-head, ...)
STAGE_CHOICES = {name: get_args(field.annotation) for name, field in TrainSettings.model_fields.items()
                 if get_origin(field.annotation) is Literal}
PORT = 8123
FIXED_STEPS = ("target", "spec_warm", "prep", "spec_data")
# The race's sides: the system each one trains, as the summary and the plot name it.
SIDES = {"ours": "eagle3ctl", "spec": "speculators", "specce": "speculators (ce loss)"}
SPEC_LOSS = {"spec": "kl_div", "specce": "ce"}  # speculators' --loss-fn per side (kl_div: its EAGLE-3 default)
DEFAULT_SIDES = ("ours", "spec")
SETTING_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$")  # a folder name under sweep/, never a path


def race_steps(vocabs: list[int], sides: tuple[str, ...] = DEFAULT_SIDES) -> list[str]:
    """Every step in order: the per-vocab trainings interleave so the first vocab's race finishes first."""
    return [*FIXED_STEPS, *(f"{side}_v{v}" for v in vocabs for side in sides), "curve", "plot"]


def side_and_vocab(step: str) -> tuple[str, int] | None:
    """A training step's side and draft vocab (``specce_v32768`` -> ("specce", 32768)); None for the others."""
    side, sep, vocab = step.rpartition("_v")
    return (side, int(vocab)) if sep and side in SIDES and vocab.isdigit() else None


def needs_speculators(step: str) -> bool:
    """The steps that run speculators' code (its warm-up, its data, a speculators side's training)."""
    trains = side_and_vocab(step)
    return step in ("spec_warm", "spec_data") or (trains is not None and trains[0] in SPEC_LOSS)


def select_steps(text: str, vocabs: list[int], sides: tuple[str, ...] = DEFAULT_SIDES) -> list[str]:
    """``--steps``: names, a side's name (``ours``, ``spec``, ...) for that side at every vocab, ``all`` for every step."""
    every = race_steps(vocabs, sides)
    wanted = set()
    for name in (s for s in text.split(",") if s):
        if name == "all":
            wanted.update(every)
        elif name in sides:
            wanted.update(s for s in every if s.startswith(name + "_v"))
        elif name in every:
            wanted.add(name)
        else:
            raise SystemExit(f"--steps: unknown step {name!r}; steps are {', '.join(every)}, {', '.join(sides)}, all")
    return [s for s in every if s in wanted]


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.work, self.out = a, a.work.resolve(), a.out.resolve()
        # the sides' own state: their results, recipes, checkpoints, curve points and exports (the race's,
        # or a sweep setting's); the target and the data come from self.work
        self.own = self.work / "sweep" / a.setting if a.setting else self.work
        self.deadline = time.monotonic() + a.budget_s
        for folder in {self.work, self.own}:
            (folder / "results").mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = self.work / "store"
        self.py = sys.executable
        self.warm: threading.Thread | None = None  # spec_warm beside the target's training
        self.warm_status = "not run"
        self.target_over = threading.Event()  # make_target has exited (its untrained copy is there or never will be)
        self._spec_probe: str | None = None
        self.steps: list[str] = []  # the steps this call runs (run())

    # -- plumbing ---------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')} left {self.left():.0f}s] {msg}", flush=True)

    def sh(self, cmd: list[str], reserve_s: float = 5.0, env: dict | None = None) -> int:
        """Run a command in its own process group under the deadline (SIGTERM at it: 124)."""
        if self.left() - reserve_s <= 0:
            self.log(f"no time left for: {' '.join(cmd[:6])}")
            return 124
        self.log("$ " + " ".join(cmd))
        p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            return p.wait(timeout=max(0.0, self.left() - reserve_s))
        except subprocess.TimeoutExpired:
            self.log(f"deadline: stopping {' '.join(cmd[:3])} (pid {p.pid}); the next call resumes it")
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=60)  # our train stage checkpoints on SIGTERM
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return 124

    def result_file(self, step: str) -> Path:
        """Where a step's result is: the target's and the data's in --work, the sides' and their curve's in self.own."""
        return (self.work if step in FIXED_STEPS else self.own) / "results" / f"{step}.json"

    def done(self, step: str) -> dict | None:
        p = self.result_file(step)
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, step: str, result: dict) -> dict:
        write_json(self.result_file(step), result)
        return result

    def objects(self):
        from eagle3.store import open_store

        return open_store(f"file://{self.store}")

    def committed(self, run: str, stage: str, name: str | None = None) -> Path | dict | None:
        """A committed stage's manifest stats (name None) or the local path of one of its objects."""
        from eagle3.manifest import read_manifest

        loaded = read_manifest(self.objects(), run, stage)
        if loaded is None:
            return None
        if name is None:
            return loaded.manifest.stats
        return self.store / loaded.manifest.object_key(name)

    def committed_prefix(self, run: str, stage: str) -> str | None:
        """Where a committed stage's objects are (None: not committed)."""
        from eagle3.manifest import read_manifest

        loaded = read_manifest(self.objects(), run, stage)
        return None if loaded is None else loaded.manifest.prefix

    # -- configs ----------------------------------------------------------------------

    @property
    def prep_run(self) -> str:
        """The race's first run, which generates the samples and extracts their hidden states (prep)."""
        return f"q-v{self.a.vocabs[0]}"

    def run_id(self, vocab: int) -> str:
        """The run whose train stage trains ours at draft vocab ``vocab``: q-vV, or for a setting q-vV-<8 hex of its
        name> (a run id is a label: no '_' or '.', at most 42 characters)."""
        if not self.a.setting:
            return f"q-v{vocab}"
        return f"q-v{vocab}-{hashlib.sha256(self.a.setting.encode()).hexdigest()[:8]}"

    def config(self, vocab: int, run: str | None = None) -> Path:
        a, tiny = self.a, self.a.tiny
        run = run or self.run_id(vocab)
        cfg = {
            "run_id": run,
            "backend": "local",
            "store": {"uri": f"file://{self.store}"},
            "target": {"model": str(self.work / "target"), "cache_dir": str(self.work / "cache")},
            "serve": {"endpoint": f"http://127.0.0.1:{PORT}/v1"},
            "generate": {"prompts": str(self.work / "prompts_train.jsonl"), "concurrency": a.serve_batch,
                         "max_tokens": a.max_tokens, "max_length": 2048, "part_size": 1024,
                         "request_timeout_s": 600},
            "vocab": {"draft_vocab_size": vocab},
            "extract": {"storage_dtype": "bfloat16", "batch_tokens": 8192 if tiny else 65536,
                        "shard_tokens": 1 << 18 if tiny else 1 << 20},
            "drafter": {"rms_norm_eps": 1e-5},
            # max_steps bounds training (and the cosine horizon); epochs only has to be large enough
            "train": {"epochs": 1000, "max_steps": self.train_steps("ours"), "batch_tokens": a.batch_tokens,
                      "max_seq_len": 2048, "lr": a.lr, "warmup_steps": a.warmup_steps, "ttt_steps": 7,
                      "ttt_decay": a.ttt_decay, "optimizer": a.optimizer,
                      **{k: getattr(a, k) for k in OURS_OWN},  # ours' own recipe, under the train stage's names
                      "checkpoint_every": a.checkpoint_every, "log_every": 5,
                      "eval_fraction": 0.02, "weight_decay": 0.0, "compile": a.train_compile},
            "evaluate": {"prompts": str(self.work / "prompts_heldout.jsonl"), "num_prompts": a.eval_prompts,
                         "num_draft_tokens": a.draft_tokens, "max_new_tokens": a.eval_new_tokens,
                         "workers": a.eval_workers, "batch_size": a.eval_batch},
        }
        path = self.work / f"{run}.yaml"
        import yaml

        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    def pipeline(self, vocab: int, *until: str, need_server: bool = False, run: str | None = None) -> int:
        """Run ``run``'s pipeline (default the run training ``vocab``) up to the ``until`` stages, in one
        ``eagle3ctl`` call (each cost 12-18 s of start-up on the device machine before the preflight stopped
        importing torch). Every run but prep's adopts its generate and extract with ``--reuse-from`` (copied as
        hard links, verified, committed as its own): only vocab and train run."""
        run = run or self.run_id(vocab)
        cmd = [self.py, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(self.config(vocab, run))]
        cmd += [arg for stage in until for arg in ("--until", stage)]
        if run != self.prep_run:
            cmd += ["--reuse-from", self.prep_run]
        server = self.start_server() if need_server else None
        try:
            return self.sh(cmd, reserve_s=15, env=self.inductor_env())
        finally:
            if server is not None:
                self.stop_server(server)

    # -- the server generate calls ----------------------------------------------------

    def start_server(self) -> subprocess.Popen:
        cmd = [self.py, str(HERE / "serve_batched.py"), str(self.work / "target"), "--port", str(PORT),
               "--max-batch", str(self.a.serve_batch)]
        self.log("$ " + " ".join(cmd))
        p = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2).read()
                return p
            except OSError:
                if p.poll() is not None:
                    raise SystemExit("serve_batched.py exited before answering")
                time.sleep(1)
        raise SystemExit("serve_batched.py did not answer in 120 s")

    def stop_server(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    # -- steps ------------------------------------------------------------------------

    def step_target(self, warm_beside: bool = False) -> dict:
        cmd = [self.py, str(HERE / "make_target.py"), "--work", str(self.work)]
        if self.a.tiny:
            cmd += ["--tiny", "--corpus-root", str(self.a.corpus_root)] if self.a.corpus_root else ["--tiny"]
        if self.a.target_seconds:
            cmd += ["--train-seconds", str(self.a.target_seconds)]
        if self.a.prompts_train:
            cmd += ["--prompts-train", str(self.a.prompts_train)]
        if warm_beside:  # spec_warm in a thread, on the untrained target make_target saves first
            init = self.work / "target_init"
            shutil.rmtree(init, ignore_errors=True)
            cmd += ["--init-dir", str(init)]
            self.warm = threading.Thread(target=self.warm_on, args=(init,), daemon=True)
            self.warm.start()
        try:
            if self.sh(cmd) != 0:
                raise StepFailed("make_target.py failed")
        finally:
            self.target_over.set()
        return json.loads((self.work / "target_meta.json").read_text())

    # -- speculators' cold compile, off the timed path ---------------------------------

    def speculators_missing(self) -> str | None:
        """Why speculators' side cannot run in this Python (None: it can)."""
        if self._spec_probe is None:
            probe = subprocess.run([self.py, "-c", "import speculators, datasets, pyarrow"], capture_output=True, text=True,
                                   check=False)
            self._spec_probe = "" if probe.returncode == 0 else (
                f"skipped: speculators' side needs speculators 0.9.0, datasets and pyarrow "
                f"({probe.stderr.strip().splitlines()[-1]}); device_call.sh installs them from .whl/")
        return self._spec_probe or None

    def inductor_env(self) -> dict:
        """Both systems' compiled graphs in one inductor cache in --work (device_call.sh carries it between
        sessions): without it ours compiled its training afresh each session (~40 s of the first training)."""
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor")}

    def warm_on(self, init: Path) -> None:
        """Thread: spec_warm on the untrained target as soon as make_target has saved it."""
        while not (init / "READY").exists():
            if self.target_over.is_set() and not (init / "READY").exists():
                self.warm_status = "skipped: make_target.py exited without saving the untrained target"
                return
            time.sleep(1)
        t0 = time.monotonic()
        try:
            res = self.step_spec_warm(init)
            res["step_seconds"] = round(time.monotonic() - t0, 1)
            res["in_background_of"] = "target"
            self.save("spec_warm", res)
            self.warm_status = f"done in {res['step_seconds']}s (beside target)"
        except StepFailed as e:
            self.warm_status = f"failed: {e}"
        self.log(f"spec_warm {self.warm_status}")

    def join_warm(self, status: dict) -> None:
        """Before anything timed: the background compile must not share the machine with it."""
        if self.warm is not None:
            if self.warm.is_alive():
                self.log("waiting for spec_warm (speculators' compile) before timing a training")
            self.warm.join()
            status["spec_warm"] = self.warm_status
            self.warm = None

    def step_spec_warm(self, target: Path | None = None) -> dict:
        """speculators' trainer for a few steps on random samples, before anything is timed.

        Its ``torch.compile`` of the drafter took 4-5 min on a fresh machine (runs 2 and 4),
        more than the call that trains it can spare. Batches are padded to ``--total-seq-len``,
        so the real run (same target shapes, drafter and draft vocab) finds every graph in the
        inductor cache; the weights do not matter, so ``target`` may be the untrained one. The
        trained drafter is thrown away; the seconds this took are kept as speculators' cold start,
        per draft vocab and loss (each compiles its own graphs: every speculators side's step asked for, or
        every vocab of every speculators side in ``--sides`` when none is).
        """
        import torch  # here, not at the top: checking a sweep's flags (--check) must not pay its import
        from spec_data import write_vocab

        from eagle3.data.tokenized import from_lists, write_tokenized
        from eagle3.targets.aux_layers import default_aux_layer_ids
        from eagle3.vocab.mapping import build_vocab_mapping, save_vocab_mapping

        target = target or self.work / "target"
        cfg = json.loads((target / "config.json").read_text())
        vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
        warm_dir = self.work / "spec_warm"
        shutil.rmtree(warm_dir, ignore_errors=True)
        warm_dir.mkdir(parents=True)
        g = torch.Generator().manual_seed(0)
        samples = []
        for i in range(24 if self.a.tiny else 96):
            n = int(torch.randint(64 if self.a.tiny else 256, 256 if self.a.tiny else 1024, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            samples.append((i, ids, [0] * (n // 2) + [1] * (n - n // 2)))
        data = from_lists(samples)
        write_tokenized(warm_dir / "tokenized.safetensors", data)
        counts = torch.bincount(data.input_ids.long(), minlength=vocab)
        save_vocab_mapping(warm_dir / "vocab_mapping.safetensors", *build_vocab_mapping(counts, self.a.vocabs[0]))
        aux = [str(i) for i in default_aux_layer_ids(layers)]
        t0 = time.monotonic()
        if self.sh([self.py, str(HERE / "spec_data.py"), "--target", str(target),
                    "--tokenized", str(warm_dir / "tokenized.safetensors"),
                    "--vocab", str(warm_dir / "vocab_mapping.safetensors"),
                    "--aux-layer-ids", *aux, "--out", str(warm_dir / "data")]) != 0:
            raise StepFailed("spec_data.py failed on the warm-up samples")
        t1 = time.monotonic()
        cold = {}
        theirs = [s for s in self.a.sides if s in SPEC_LOSS]
        asked = [sv for sv in map(side_and_vocab, self.steps) if sv and sv[0] in SPEC_LOSS]
        warm = sorted(set(asked), key=lambda sv: self.a.vocabs.index(sv[1])) or [(s, v) for v in self.a.vocabs for s in theirs]
        written = self.a.vocabs[0]
        for side, v in warm:  # each draft vocab and loss is its own set of graphs (the head's and the loss's shapes)
            if v != written:
                write_vocab(*build_vocab_mapping(counts, v), warm_dir / "data")
                written = v
            t2 = time.monotonic()
            cmd = self.spec_train_cmd(warm_dir / "data", warm_dir / f"ckpt-{side}-{v}", warm_dir / f"export-{side}-{v}",
                                      warm_dir / f"train-{side}-{v}.json", aux, ("--max-steps", "6"), target=target,
                                      vocab=v, loss_fn=SPEC_LOSS[side])
            if self.sh(cmd, reserve_s=30, env=self.inductor_env()) != 0:
                raise StepFailed(f"speculators' warm-up training ({SPEC_LOSS[side]}) at draft vocab {v} failed")
            cold[f"{SPEC_LOSS[side]}_v{v}"] = round(time.monotonic() - t2, 1)
        return {"samples": len(samples), "data_seconds": round(t1 - t0, 1), "cold_train_seconds_6_steps": cold}

    # -- the race -----------------------------------------------------------------------

    def step_prep(self) -> dict:
        """The first vocab's run up to its hidden states: generate (the stand-in server runs only for it), vocab, extract."""
        first, run = self.a.vocabs[0], self.prep_run
        if not self.committed(run, "generate") and self.pipeline(first, "generate", need_server=True, run=run) != 0:
            raise StepFailed("generate failed or was cut by the deadline (rerun: it resumes)")
        if self.pipeline(first, "vocab", "extract", run=run) != 0:  # siblings in the DAG: both named
            raise StepFailed("vocab or extract failed or was cut by the deadline (rerun: it resumes)")
        return {st: self.committed(run, st) for st in ("generate", "vocab", "extract")}

    def aux_ids(self) -> list[str]:
        index = json.loads(self.committed(self.prep_run, "extract", "index.json").read_text())
        return [str(i) for i in index["aux_layer_ids"]]

    def step_spec_data(self) -> dict:
        first = self.prep_run
        data = self.work / "spec_data"
        t0 = time.monotonic()
        if not (data / "dataset_info.json").exists() or not (data / "hidden_states").exists():
            shutil.rmtree(data, ignore_errors=True)
            rc = self.sh([self.py, str(HERE / "spec_data.py"), "--target", str(self.work / "target"),
                          "--tokenized", str(self.committed(first, "generate", "tokenized.safetensors")),
                          "--vocab", str(self.committed(first, "vocab", "vocab_mapping.safetensors")),
                          "--aux-layer-ids", *self.aux_ids(), "--out", str(data)])
            if rc != 0:
                raise StepFailed("spec_data.py failed")
        return {"data": str(data), "seconds": round(time.monotonic() - t0, 1)}

    def snapshots(self, side: str, vocab: int) -> Path:
        return self.own / "snapshots" / f"{side}-v{vocab}"

    def begin_training(self, side: str, vocab: int) -> None:
        """A side's training of this call's recipe starts or resumes. What a training of another recipe left
        (its snapshots and curve points, which a point already there is not evaluated again for, and
        speculators' checkpoints, which it would resume from and stop at once) goes first: none of it is
        this training's. The recipe is stamped before anything trains, so a cut training resumes."""
        stamp, recipe = self.own / "recipes" / f"{side}-v{vocab}.json", self.recipe(side)
        stamped = json.loads(stamp.read_text()) if stamp.exists() else recipe
        if stamped != recipe:
            left = [self.snapshots(side, vocab), self.own / "curve" / f"{side}-v{vocab}"]
            if side != "ours":
                left.append(self.own / f"{side}_ckpt_v{vocab}")
            for path in left:
                shutil.rmtree(path, ignore_errors=True)
            self.log(f"{side} draft vocab {vocab}: retraining; removed what the {stamped} training left")
        stamp.parent.mkdir(parents=True, exist_ok=True)
        write_json(stamp, recipe)

    def step_ours(self, vocab: int) -> dict:
        from curve import Snapshots, our_checkpoints
        from summarize import steady

        run = self.run_id(vocab)
        self.begin_training("ours", vocab)
        snaps = self.snapshots("ours", vocab)
        objects = self.objects()
        replaced = self.committed_prefix(run, "train")  # a training of another recipe, until the new one commits
        with Snapshots(lambda: our_checkpoints(objects, run, not_under=replaced), snaps):
            rc = self.pipeline(vocab, "train")
        if rc != 0:
            raise StepFailed(f"{run} train stopped (exit {rc}); its checkpoint resumes it on the next call")
        if replaced is not None and self.committed_prefix(run, "train") == replaced:
            Snapshots(lambda: our_checkpoints(objects, run), snaps).poll()  # the pipeline kept it: same input key
        shutil.copyfile(self.committed(run, "train", "drafter_config.json"), snaps / "drafter_config.json")
        shutil.copyfile(self.committed(run, "vocab", "vocab_mapping.safetensors"), snaps / "vocab_mapping.safetensors")
        stats = self.committed(run, "train")
        metrics = self.committed(run, "train", "metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        coverage = json.loads(self.committed(run, "vocab", "coverage.json").read_text())["coverage"]
        chained = sum(k.startswith("eval_chain_acc_") for k in stats)
        return {"draft_vocab_coverage": coverage, "train": {"steps": stats.get("steps"), "tokens": stats.get("tokens"),
                          "steady_tokens_per_s": steady(records), "loop_tokens_per_s": stats.get("tokens_per_s"),
                          "peak_memory_gib": stats.get("peak_memory_gib"), "resumed_from_step": stats.get("resumed_from_step"),
                          "heldout_loss_0": stats.get("eval_loss_0"), "heldout_acc_0": stats.get("eval_acc_0"),
                          # per TTT step, held-out accuracy given every earlier step right: a greedy estimate a cut evaluation keeps
                          "heldout_chain_acc": [round(stats[f"eval_chain_acc_{k}"], 4) for k in range(chained)]},
                "final_step": stats.get("steps"), **self.recipe("ours")}

    def spec_train_cmd(self, data: Path, save: Path, export: Path, out_json: Path, aux: list[str],
                       extra: tuple[str, ...] = (), target: Path | None = None, vocab: int | None = None,
                       epochs: int = 1, loss_fn: str = "kl_div") -> list[str]:
        """speculators' trainer on ``data``, configured like our drafter (spec_train.py), with its ``loss_fn``."""
        a = self.a
        cmd = [self.py, str(HERE / "spec_train.py"), "--target", str(target or self.work / "target"),
               "--data", str(data), "--save", str(save), "--export", str(export), "--out-json", str(out_json),
               "--aux-layer-ids", *aux, "--draft-vocab-size", str(vocab or a.vocabs[0]), "--lr", str(a.lr),
               "--warmup-steps", str(a.warmup_steps), "--epochs", str(epochs), "--loss-fn", loss_fn,
               "--ttt-decay", str(a.ttt_decay), "--optimizer", a.optimizer,
               "--total-seq-len", str(a.batch_tokens), "--num-workers", "0" if a.tiny else "8"]
        if a.tiny:  # no GPU: speculators' trainer needs one; save its initialized drafter instead
            extra = ("--draft-attn-impl", "sdpa", "--dry-run", *extra)
            save.mkdir(parents=True, exist_ok=True)
        return cmd + (["--", *extra] if extra else [])

    def step_spec(self, vocab: int, side: str = "spec") -> dict:
        from curve import Snapshots, spec_checkpoints
        from spec_data import write_vocab

        from eagle3.vocab.mapping import load_vocab_mapping

        run = self.run_id(vocab)
        if self.pipeline(vocab, "vocab") != 0:  # the same draft vocab as ours
            raise StepFailed(f"{run} vocab failed")
        self.begin_training(side, vocab)
        data, save = self.work / "spec_data", self.own / f"{side}_ckpt_v{vocab}"
        write_vocab(*load_vocab_mapping(self.committed(run, "vocab", "vocab_mapping.safetensors")), data)
        # speculators counts checkpoints in shares of an epoch and runs every epoch asked for (one step and a
        # validation each past --max-steps): epochs from an estimate of its steps per epoch that packing
        # waste only makes larger, so --max-steps stops it inside the last epoch
        tokens = self.committed(self.prep_run, "extract").get("tokens") or 0
        per_epoch = max(1, int(0.98 * tokens) // self.a.batch_tokens)  # its --train-data-ratio 0.98
        epochs = -(-self.a.train_steps // per_epoch)
        freq = min(1.0, self.a.checkpoint_every / per_epoch)
        extra = ("--max-steps", str(self.a.train_steps), "--checkpoint-freq", f"{freq:.4f}")
        out_json = self.own / f"{side}_train_v{vocab}.json"
        cmd = self.spec_train_cmd(data, save, self.own / f"{side}_export_v{vocab}", out_json, self.aux_ids(), extra,
                                  vocab=vocab, epochs=epochs, loss_fn=SPEC_LOSS[side])
        with Snapshots(lambda: spec_checkpoints(save), self.snapshots(side, vocab)):
            rc = self.sh(cmd, reserve_s=30, env=self.inductor_env())
        if rc != 0:
            raise StepFailed(f"spec_train.py stopped (exit {rc}); speculators resumes from {save} on the next call")
        train = json.loads(out_json.read_text())
        return {"train": {k: train.get(k) for k in ("steady_tokens_per_s", "wall_seconds", "peak_memory_gib", "last_step",
                                                    "mean_tokens_per_step", "final_train_metrics", "parts")},
                "final_step": max((s for s, _ in spec_checkpoints(save)), default=None), "epochs": epochs,
                **self.recipe(side)}

    def train_steps(self, side: str) -> int:
        """The optimizer steps a side trains: --train-steps, or for ours --ours-train-steps when given."""
        return (self.a.ours_train_steps if side == "ours" else None) or self.a.train_steps

    def recipe(self, side: str) -> dict:
        """What a side's training result was trained with, beyond the data: a later call with other flags
        must not take it as its own (run() names the difference instead)."""
        own = {k: getattr(self.a, k) for k in OURS_OWN} if side == "ours" else {"loss_fn": SPEC_LOSS[side]}
        # the flags are named as the recipe's keys; train_steps is the side's own
        return {**{k: getattr(self.a, k) for k in SHARED}, "train_steps": self.train_steps(side), **own}

    def recipe_change(self, step: str) -> str | None:
        """How the recipe of ``step``'s saved result differs from this call's flags (None: it does not; a result
        saved before a setting was kept counts as that setting's default)."""
        side = side_and_vocab(step)
        if side is None:
            return None
        from summarize import recipe

        saved = recipe(self.done(step) or {}, ours=side[0] == "ours")
        return ", ".join(f"{k} {saved[k]} (now {v})" for k, v in self.recipe(side[0]).items() if saved[k] != v) or None

    def curve_points(self) -> list[tuple[int, str, int, Path]]:
        """(vocab, side, step, snapshot) of every trained side: each side's final step first, then the
        others by vocab (the first vocab's curve before the others').

        A snapshot at --train-steps or later that is not the final one is not a point: speculators runs
        its last epoch's first batch past --max-steps at lr 0 and saves it as step 1001, the same weights
        as its step-1000 checkpoint, which cost a second evaluation of one drafter per race (31-66 s
        at 128 prompts on an H100)."""
        finals, rest = [], []
        for vocab in self.a.vocabs:
            for side in self.a.sides:
                if not self.done(f"{side}_v{vocab}"):
                    continue
                from curve import snapshot_steps

                points = [(vocab, side, s, p) for s, p in snapshot_steps(self.snapshots(side, vocab))]
                finals += points[-1:]
                rest += [p for p in points[:-1] if p[2] < self.train_steps(side)]
        return finals + sorted(rest, key=lambda p: (self.a.vocabs.index(p[0]), p[2], p[1]))

    def point_file(self, vocab: int, side: str, step: int) -> Path:
        return self.own / "curve" / f"{side}-v{vocab}" / f"step-{step:07d}.json"

    def evaluator(self) -> dict:
        """What a curve point's number depends on besides the drafter: the evaluator's settings."""
        a = self.a
        return {"eval_prompts": a.eval_prompts, "eval_new_tokens": a.eval_new_tokens, "draft_tokens": a.draft_tokens}

    def point(self, vocab: int, side: str, step: int) -> dict | None:
        """A curve point's report if it was evaluated as this call evaluates (None: not, or not yet): a call with
        other --eval-prompts, --eval-new-tokens or --draft-tokens evaluates the final drafter again, and the
        intermediate points it can no longer evaluate (their checkpoints are removed once evaluated) drop out of
        the curve rather than mixing two evaluators in one plot or one ratio."""
        path = self.point_file(vocab, side, step)
        if not path.exists():
            return None
        report = json.loads(path.read_text())
        return report if point_evaluator(report) == self.evaluator() else None

    def step_curve(self) -> dict:
        from curve import evaluate_export, export_our_checkpoint
        from spec_train import export_ours

        evaluated = 0
        for vocab, side, step, snap in self.curve_points():
            path = self.point_file(vocab, side, step)
            if self.point(vocab, side, step) is not None:
                continue
            if evaluated and self.left() < self.curve_need(0):  # this call's points have recorded their time
                raise StepFailed(f"deadline: {evaluated} points evaluated in this call, the rest next call")
            t0 = time.monotonic()
            export = self.own / "exports" / f"{side}-v{vocab}" / snap.name
            if side == "ours":
                ours = self.snapshots("ours", vocab)
                export_our_checkpoint(snap, json.loads((ours / "drafter_config.json").read_text()),
                                      ours / "vocab_mapping.safetensors", export)
            else:
                export_ours(snap, str(self.work / "target"), [int(i) for i in self.aux_ids()], export)
            self.log(f"curve: {side} draft vocab {vocab} step {step}")
            report = evaluate_export(self.config(vocab), export)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, {"step": step, "evaluator": self.evaluator(), **report,
                              "seconds": round(time.monotonic() - t0, 1)}, indent=1)
            shutil.rmtree(export, ignore_errors=True)
            if step != self.done(f"{side}_v{vocab}")["final_step"]:
                shutil.rmtree(snap)  # evaluated: ~0.2 GB a checkpoint at 64K vocab, and the disk holds two copies
                # of the hidden states; the final drafter stays
            evaluated += 1
        return {"points": evaluated}

    def curve_need(self, default: float) -> float:
        """Seconds the next curve point needs: the slowest evaluated so far on this machine + 5 s (export, the
        target's load and the decode: 26-38 s at 128 prompts on an H100 with the inductor cache carried), or
        ``default`` before any point recorded its time. One rule for the curve step's start and each point after
        it; a flat 75 s to start skipped a final point with 45 s left."""
        took = [json.loads(p.read_text()).get("seconds")
                for p in (*self.work.glob("curve/*/step-*.json"), *self.work.glob("sweep/*/curve/*/step-*.json"))]
        took = [t for t in took if isinstance(t, (int, float))]
        return math.ceil(max(took)) + 5 if took else default

    def curves(self) -> dict[int, dict[str, list[dict]]]:
        """Per vocab and system, the evaluated points: step, acceptance with its interval, and the steady training
        seconds to that step (the side's steady seconds per step; None when its training did not say)."""
        from summarize import acceptance_ci, steady_train_seconds

        out: dict[int, dict[str, list[dict]]] = {}
        for vocab in self.a.vocabs:
            for side in self.a.sides:
                name = SIDES[side]
                trained = self.done(f"{side}_v{vocab}") or {}
                total = steady_train_seconds(trained)
                per_step = total / trained["final_step"] if total and trained.get("final_step") else None
                points = []
                for p in sorted((self.own / "curve" / f"{side}-v{vocab}").glob("step-*.json")):
                    rep = self.point(vocab, side, int(p.stem.removeprefix("step-")))
                    if rep is None:
                        continue
                    ci = acceptance_ci(rep) or {}
                    points.append({"step": rep["step"], "mean_acceptance_length": rep.get("mean_acceptance_length"),
                                   "ci95": ci.get("ci95"),
                                   "seconds": round(rep["step"] * per_step, 1) if per_step else None})
                if points:
                    out.setdefault(vocab, {})[name] = points
        return out

    def sides(self) -> dict[int, dict[str, dict | None]]:
        """Per vocab, each side's training result (None: not trained) with its final checkpoint's report
        (``final`` None: not evaluated yet)."""
        out: dict[int, dict[str, dict | None]] = {}
        for vocab in self.a.vocabs:
            out[vocab] = {}
            for side in self.a.sides:
                res = self.done(f"{side}_v{vocab}")
                out[vocab][side] = None if res is None else {**res, "final": self.point(vocab, side, res["final_step"])}
        return out

    def step_plot(self) -> dict:
        from plot_quality import plot_curves

        curves = self.curves()
        if curves:
            plot_curves(curves, self.out / "acceptance_vs_steps.png")
        return {"curves": {v: {s: len(p) for s, p in c.items()} for v, c in curves.items()}}

    def run(self, steps: list[str]) -> dict:
        self.steps = steps
        tiny = self.a.tiny
        # seconds a step needs to start (curve, before any point recorded its time: one at 128 prompts took 66 s on an
        # H100 before the inductor cache was carried)
        estimates = {"target": 60 if tiny else 300, "spec_warm": 60 if tiny else 330, "prep": 40 if tiny else 200,
                     "spec_data": 20 if tiny else 60, "curve": 20 if tiny else 75, "plot": 5}
        needs = {"spec_warm": ("target",), "prep": ("target",), "spec_data": ("prep",), "curve": (), "plot": ()}
        for v in self.a.vocabs:
            for side in self.a.sides:
                needs[f"{side}_v{v}"] = ("spec_data",) if side in SPEC_LOSS else ("prep",)
        status = {}
        theirs = [s for s in steps if needs_speculators(s)]
        why_not = self.speculators_missing() if theirs else None  # the probe imports speculators: seconds of a call
        if why_not:
            status.update(dict.fromkeys(theirs, why_not))
            steps = [s for s in steps if s not in theirs]
            self.log(why_not)
        warm_beside = "target" in steps and "spec_warm" in steps and not self.done("target") \
            and not self.done("spec_warm")
        for step in steps:
            if self.done(step) and step not in ("curve", "plot"):  # curve adds the points still missing
                change = self.recipe_change(step)
                if change is None or not self.a.retrain:
                    status[step] = DONE_EARLIER if change is None else (
                        f"{DONE_EARLIER} with {change} (--retrain trains it again)")
                    continue
                # the old result stays until the new one is saved: a cut retraining resumes on the next call
                self.log(f"{step}: done earlier with {change}; retraining")
            if step == "spec_warm" and warm_beside:
                status[step] = "running beside target" if self.warm is not None else self.warm_status
                continue
            missing = [n for n in needs.get(step, ()) if not self.done(n)]
            if missing:
                status[step] = f"skipped: needs {', '.join(missing)}"
                continue
            trains = side_and_vocab(step)
            if trains:
                self.join_warm(status)  # nothing else on the GPU while a system's training is timed
            need = 30 if trains else self.curve_need(estimates["curve"]) if step == "curve" else estimates.get(step, 30)
            if step != "plot" and self.left() < need:
                status[step] = f"skipped: {self.left():.0f}s left, needs ~{need}s"
                self.log(status[step])
                continue
            t0 = time.monotonic()
            self.log(f"step {step}")
            try:
                if trains and trains[0] == "ours":
                    res = self.step_ours(trains[1])
                elif trains:
                    res = self.step_spec(trains[1], trains[0])
                else:
                    res = {"target": lambda: self.step_target(warm_beside), "spec_warm": self.step_spec_warm,
                           "prep": self.step_prep, "spec_data": self.step_spec_data, "curve": self.step_curve,
                           "plot": self.step_plot}[step]()
                res["step_seconds"] = round(time.monotonic() - t0, 1)
                self.save(step, res)
                status[step] = f"{DONE_IN}{res['step_seconds']}s"
            except StepFailed as e:
                status[step] = f"failed: {e}"
                self.log(status[step])
            self.write_summary(status)
        self.join_warm(status)
        return self.write_summary(status)

    def write_summary(self, status: dict) -> dict:
        from summarize import summarize

        summary = summarize(self.done("target"), self.sides(), status, vars(self.a), SIDES)
        summary["curves"] = self.curves()  # the plot's points ($OUT brings back few files)
        write_json(self.out / "quality_race.json", summary)
        return summary


class StepFailed(Exception):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors as one line (no usage block): a sweep quotes them as its own."""

    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"run_quality: {message}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The race's flags with their defaults filled in; bad ones end the call in one line."""
    ap = OneLineParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # a sweep names settings by flag
    ap.add_argument("--work", type=Path, required=True, help="state kept between calls (e.g. /tmp/e3q)")
    ap.add_argument("--out", type=Path, required=True, help="where the summary and plot go ($OUT)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--steps", default="all", help="step names, or a side's name (its step at every vocab), or all")
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES), help=f"the sides raced, of {', '.join(SIDES)} "
                    "(specce: speculators with its ce loss, the control for --teacher-temperature below 1)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny target, few samples")
    ap.add_argument("--retrain", action="store_true", help="a training saved under other recipe flags trains again "
                    "with this call's (without it, it is named and kept)")
    ap.add_argument("--corpus-root", type=Path, default=None)
    ap.add_argument("--target-seconds", type=float, default=None, help="target training (default 270; tiny 8)")
    ap.add_argument("--prompts-train", type=int, default=None, help="generate: training prompts (default 10240; "
                    "tiny the recipe's 48)")
    ap.add_argument("--max-tokens", type=int, default=160, help="generate: response tokens per prompt")
    ap.add_argument("--draft-vocabs", default=None, help="comma list; the first is the main race "
                    "(default 16384,32768,64000; tiny 512,1024,2048); the target's vocab = no mapping")
    ap.add_argument("--train-steps", type=int, default=None, help="optimizer steps, both systems (default 1200; tiny 12)")
    ap.add_argument("--ours-train-steps", type=int, default=None, help="ours' optimizer steps when not "
                    "--train-steps: a race at equal training seconds (speculators' steps times the throughput "
                    "ratio), which the summary names as such; the acceptance goal is set at equal steps")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints = curve points "
                    "(default 200; tiny 4)")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step (both systems)")
    ap.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (both systems)")
    ap.add_argument("--optimizer", choices=STAGE_CHOICES["optimizer"], default="adamw", help="both systems: AdamW, or Muon "
                    "over the layer's matrices and AdamW over the head and norms (speculators' default; train.optimizer)")
    ap.add_argument("--ttt-decay", type=float, default=STAGE_DEFAULT["ttt_decay"],
                    help="loss weight of TTT step k is decay**k (both systems)")
    ap.add_argument("--teacher-temperature", type=float, default=STAGE_DEFAULT["teacher_temperature"],
                    help="ours: train.teacher_temperature (below 1 sharpens the teacher for greedy decoding, which "
                    "the evaluator measures)")
    ap.add_argument("--lm-head", choices=STAGE_CHOICES["lm_head"], default=STAGE_DEFAULT["lm_head"],
                    help="ours: train.lm_head (target-frozen keeps the target's head rows, as speculators does)")
    ap.add_argument("--min-lr-ratio", type=float, default=STAGE_DEFAULT["min_lr_ratio"],
                    help="ours: train.min_lr_ratio, where the cosine ends (speculators' cosine ends at 0)")
    ap.add_argument("--adamw-lr", type=float, default=STAGE_DEFAULT["adamw_lr"], help="ours with --optimizer muon: "
                    "train.adamw_lr, the peak lr of the draft head and norms (default --lr; speculators' head is frozen)")
    ap.add_argument("--feature-noise", type=float, default=STAGE_DEFAULT["feature_noise"],
                    help="ours: train.feature_noise, uniform noise on the aux hidden states relative to each layer's "
                    "rms, a regulariser for the race's few samples trained several epochs (0: off)")
    ap.add_argument("--muon-weight-decay", type=float, default=STAGE_DEFAULT["muon_weight_decay"],
                    help="ours with --optimizer muon: train.muon_weight_decay (speculators' default 0.1)")
    ap.add_argument("--seed", type=int, default=STAGE_DEFAULT["seed"],
                    help="ours: train.seed, the drafter's init, the data order and the train stage's own held-out "
                    "split; a sweep of seeds at one recipe measures how far one training of ours varies on a target "
                    "(speculators keeps its seed 0)")
    ap.add_argument("--loss-tokens", choices=STAGE_CHOICES["loss_tokens"], default=STAGE_DEFAULT["loss_tokens"],
                    help="ours: train.loss_tokens, the tokens of a sample that teach the drafter: the response's "
                    "(assistant, as speculators' data has it) or every one, the prompt's too (all: the target's "
                    "logits at each position teach, from the same samples and hidden states)")
    ap.add_argument("--train-compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--eval-new-tokens", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--eval-workers", type=int, default=1, help="evaluate: processes decoding prompts in parallel "
                    "(each loads the target: a cost per curve point)")
    ap.add_argument("--eval-batch", type=int, default=64, help="evaluate: prompts decoded in lockstep per process "
                    "(all of them by default: one batch per curve point)")
    ap.add_argument("--serve-batch", type=int, default=2048, help="stand-in server batch = generate's concurrency")
    ap.add_argument("--setting", default=None, help="a sweep setting's name: its sides train, and their results and "
                    "points go, under --work/sweep/NAME, in runs of their own that adopt the race's samples and hidden "
                    "states; nothing of the race's own is touched")
    ap.add_argument("--check", action="store_true", help="check every flag and the steps named, then exit: "
                    "nothing runs (a sweep checks all its settings so before the first trains)")
    a = ap.parse_args(argv)
    a.sides = tuple(s for s in a.sides.split(",") if s)
    if a.setting is not None and not SETTING_NAME.match(a.setting):
        raise SystemExit(f"--setting {a.setting!r}: letters, digits, '.', '_' and '-', starting with a letter or "
                         "digit, at most 120 characters (it names a folder)")
    if a.sides[:1] != ("ours",) or not set(a.sides) <= set(SIDES) or len(set(a.sides)) != len(a.sides):
        raise SystemExit(f"--sides: ours first, then any of {', '.join(s for s in SIDES if s != 'ours')}, each once")
    try:  # the train stage's own bounds: ours' flags become its settings
        TrainSettings(ttt_decay=a.ttt_decay, **{k: getattr(a, k) for k in OURS_OWN})
    except ValidationError:
        raise SystemExit("--teacher-temperature and --adamw-lr must be above 0, --ttt-decay in (0, 1], "
                         "--min-lr-ratio in [0, 1], --feature-noise and --muon-weight-decay at least 0 (the train "
                         "stage's bounds)") from None
    a.vocabs = [int(v) for v in (a.draft_vocabs or ("512,1024,2048" if a.tiny else "16384,32768,64000")).split(",")]
    if a.train_steps is None:
        a.train_steps = 12 if a.tiny else 1200
    if a.train_steps < 1 or (a.ours_train_steps is not None and a.ours_train_steps < 1):
        raise SystemExit("--train-steps and --ours-train-steps must be at least 1")
    if a.checkpoint_every is None:
        a.checkpoint_every = 4 if a.tiny else 200
    if a.target_seconds is None and not a.tiny:
        a.target_seconds = 270
    if a.prompts_train is None and not a.tiny:
        a.prompts_train = 10240
    if a.tiny:
        a.batch_tokens = min(a.batch_tokens, 2048)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    steps = select_steps(a.steps, a.vocabs, a.sides)
    if a.check:
        return 0
    sys.path.insert(0, str(HERE))
    summary = Bench(a).run(steps)
    print(json.dumps(summary["headline"], indent=2, default=str))
    print(json.dumps(summary["status"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
