"""The race: eagle3ctl against vllm-project/speculators, the same drafter trained on the same data for the same
steps, each decoded by one evaluator on the same held-out prompts.

Steps, in order, each leaving ``<work>/<step>.json`` last. A step whose file is there and valid is skipped, so a
stopped race resumes where it stopped (the pipeline and speculators resume inside a step too); a step that runs
discards what the steps after it made from its old output, and they run again:

- ``target``: a Llama trained on the Python sources at hand, and its prompts (``target.py``).
- ``ours``: ``eagle3ctl run pipeline`` on ``race.yaml``: serve, generate, vocab, extract, train, export, evaluate.
- ``spec_data``: the same samples and hidden states in speculators' format; ``spec_train``: speculators' trainer
  on them, configured like ours, its drafter exported as ours is (``speculators_side.py``).
- ``spec_eval``: speculators' drafter decoded as the evaluate stage decodes ours (``evaluate.py``, engine hf).
- ``vllm_ours``, ``vllm_spec``: both drafters in vLLM (engine vllm), where vLLM and a CUDA device are present.

Then ``race.json`` and ``race.png`` (``summary.py``). Run as ``python -m benchmarks.quality.race --work DIR``
from the repository root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.quality import summary
from benchmarks.quality.files import read_result, write_json

REPO = Path(__file__).resolve().parents[2]
RUN = "race"
# The published race, on one GPU.
RACE = {"target_vocab": 64000, "target_hidden": 640, "target_layers": 12, "target_heads": 10, "target_kv_heads": 2,
        "target_intermediate": 1728, "target_chats": 40000, "target_steps": 2000, "target_batch": 32,
        "target_lr": 1e-3, "max_chars": 1200, "train_prompts": 10240, "max_tokens": 128, "concurrency": 256,
        "draft_vocab": 32768, "extract_batch_tokens": 65536, "shard_tokens": 1 << 20, "train_steps": 1000,
        "batch_tokens": 16384, "max_seq_len": 2048, "lr": 2e-3, "optimizer": "muon", "warmup_steps": 30,
        "ttt_steps": 7, "ttt_decay": 0.6, "checkpoint_every": 250, "spec_loss": "kl_div", "eval_prompts": 128,
        "eval_new_tokens": 96, "draft_tokens": 7, "eval_batch": 128, "seed": 0}
# The same steps at test size, on a CPU in minutes.
TEST = {**RACE, "target_vocab": 1000, "target_hidden": 64, "target_layers": 4, "target_heads": 4,
        "target_intermediate": 128, "target_chats": 128, "target_steps": 150, "target_batch": 8, "target_lr": 1e-2,
        "max_chars": 300, "train_prompts": 16, "max_tokens": 24, "concurrency": 4, "draft_vocab": 256,
        "extract_batch_tokens": 1024, "shard_tokens": 4096, "train_steps": 40, "batch_tokens": 512,
        "max_seq_len": 256, "lr": 3e-3, "warmup_steps": 4, "ttt_steps": 3, "checkpoint_every": 4, "eval_prompts": 6,
        "eval_new_tokens": 24, "draft_tokens": 3, "eval_batch": 6}
SCALES = {"race": RACE, "test": TEST}
HELP = {"target_chats": "code chats the target is pretrained on", "target_steps": "the target's pretraining steps",
        "target_batch": "chats per pretraining step", "max_chars": "longest code prefix or answer, in characters",
        "train_prompts": "prompts generate answers (the training samples)", "max_tokens": "generate: tokens per answer",
        "concurrency": "generate: requests in flight", "train_steps": "optimizer steps, each side",
        "batch_tokens": "tokens per optimizer step, each side", "lr": "peak learning rate, each side",
        "optimizer": "adamw or muon, each side", "spec_loss": "speculators' --loss-fn (kl_div: its EAGLE-3 default)",
        "eval_prompts": "held-out prompts decoded", "eval_new_tokens": "tokens decoded per held-out prompt",
        "draft_tokens": "k: drafts per verify step", "eval_batch": "hf evaluator: prompts decoded together"}
# ours' own train settings (the train stage's names), beyond what both sides share
OURS = {"teacher_temperature": 0.1, "lm_head": "target-frozen", "loss_tokens": "all"}


class StepFailed(Exception):
    pass


@dataclass
class Race:
    work: Path
    recipe: dict

    def file(self, step: str) -> Path:
        return self.work / f"{step}.json"

    def result(self, step: str) -> dict | None:
        return read_result(self.file(step))

    @property
    def config(self) -> Path:
        return self.work / "race.yaml"


def sh(cmd: list[str], cwd: Path = REPO) -> None:
    """Run ``cmd``; on Ctrl-C or SIGTERM (which its process group got too) wait for it to stop itself first."""
    proc = subprocess.Popen(cmd, cwd=cwd)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.wait()
        raise
    if rc != 0:
        raise StepFailed(f"{' '.join(cmd[:4])} ... exited {rc}")


def module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.quality.{name}", *args]


def pipeline_config(race: Race) -> dict:
    r, w = race.recipe, race.work
    return {
        "run_id": RUN, "backend": "local", "store": {"uri": f"file://{w / 'store'}"},
        "target": {"model": str(w / "target"), "dtype": "bfloat16"},
        "serve": {"engine": "auto", "startup_timeout_s": 1800},
        "generate": {"prompts": str(w / "prompts_train.jsonl"), "concurrency": r["concurrency"],
                     "max_tokens": r["max_tokens"], "max_length": r["max_seq_len"], "part_size": 1024},
        "vocab": {"draft_vocab_size": r["draft_vocab"]},
        "extract": {"storage_dtype": "bfloat16", "batch_tokens": r["extract_batch_tokens"],
                    "shard_tokens": r["shard_tokens"]},
        "drafter": {"rms_norm_eps": 1e-5},  # the target's, as speculators' drafter takes it
        # max_steps ends training (and the cosine); epochs only has to be large enough
        "train": {"epochs": 1000, "max_steps": r["train_steps"], "batch_tokens": r["batch_tokens"],
                  "max_seq_len": r["max_seq_len"], "lr": r["lr"], "optimizer": r["optimizer"],
                  "warmup_steps": r["warmup_steps"], "ttt_steps": r["ttt_steps"], "ttt_decay": r["ttt_decay"],
                  "checkpoint_every": r["checkpoint_every"], "log_every": 5, "eval_fraction": 0.02,
                  "weight_decay": 0.0, **r["ours"]},
        "evaluate": {"prompts": str(w / "prompts_heldout.jsonl"), "num_prompts": r["eval_prompts"],
                     "num_draft_tokens": r["draft_tokens"], "max_new_tokens": r["eval_new_tokens"],
                     "batch_size": r["eval_batch"]},
    }


def speculators_argv(target: str, data: Path, save: Path, aux_ids: list[int], draft_vocab: int, r: dict) -> list[str]:
    """speculators' trainer configured like our drafter: one Llama layer of the target's width, residual from
    ``fc`` (no norm before it, none before the residual, none on the output), full attention, our draft vocab,
    TTT steps and decay, its loss ``r["loss"]``, the same optimizer, peak lr, warmup and cosine, tokens per step
    and steps (``r``: the race's shared recipe)."""
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", target, "--data-path", str(data),
            "--save-path", str(save), "--log-dir", str(save / "logs"), "--draft-vocab-size", str(draft_vocab),
            "--d2t-path", str(data / f"d2t-{draft_vocab}.npy"), "--t2d-path", str(data / f"t2d-{draft_vocab}.npy"),
            "--target-layer-ids", *map(str, aux_ids), "--num-layers", "1",
            "--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual", "--full-attention-indices", "0",
            "--ttt-steps", str(r["ttt_steps"]), "--ttt-step-loss-decay", str(r["ttt_decay"]), "--loss-fn", r["loss"],
            # its default fused Triton loss breaks torch 2.11's dynamo inside its compiled forward; eager works
            "--loss-implementation", "eager", "--optimizer", r["optimizer"], "--lr", str(r["lr"]),
            "--weight-decay", "0.0", "--scheduler-type", "cosine", "--scheduler-warmup-steps", str(r["warmup_steps"]),
            "--epochs", str(r["epochs"]), "--max-steps", str(r["train_steps"]), "--checkpoint-freq", "1.0",
            "--total-seq-len", str(r["batch_tokens"]), "--train-data-ratio", "0.98", "--on-missing", "raise",
            "--num-workers", "8", "--log-freq", "5", "--hidden-states-dtype", "bfloat16", "--seed", "0"]
    return argv


# -- steps: each leaves race.file(step) last -------------------------------------------------------


def step_target(race: Race) -> None:
    r = race.recipe
    flags = {"vocab": "target_vocab", "hidden": "target_hidden", "layers": "target_layers", "heads": "target_heads",
             "kv-heads": "target_kv_heads", "intermediate": "target_intermediate", "chats": "target_chats",
             "steps": "target_steps", "batch": "target_batch", "lr": "target_lr", "max-chars": "max_chars",
             "train-prompts": "train_prompts", "heldout-prompts": "eval_prompts", "seed": "seed"}
    args = [f"--{flag}={r[key]}" for flag, key in flags.items()]
    if r["corpus_root"]:
        args.append(f"--corpus-root={r['corpus_root']}")
    sh(module("target", "--out", str(race.work), *args))


def step_ours(race: Race) -> None:
    from eagle3.manifest import read_manifest
    from eagle3.store import open_store

    sh([sys.executable, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(race.config)], cwd=race.work)
    store = open_store(f"file://{race.work / 'store'}")
    manifests = {stage: read_manifest(store, RUN, stage).manifest for stage in ("generate", "vocab", "extract",
                                                                                "train", "export", "evaluate")}

    def path(stage: str, name: str) -> Path:
        return race.work / "store" / manifests[stage].object_key(name)

    stats = manifests["train"].stats
    records = [json.loads(line) for line in path("train", "metrics.jsonl").read_text().splitlines() if line.strip()]
    files = {"report": path("evaluate", "report.json"), "export": path("export", "config.json").parent,
             "tokenized": path("generate", "tokenized.safetensors"),
             "vocab_mapping": path("vocab", "vocab_mapping.safetensors")}
    write_json(race.file("ours"), {
        "final_step": stats.get("steps"), "tokens": stats.get("tokens"), "steady_tokens_per_s": summary.steady(records),
        "peak_memory_gib": stats.get("peak_memory_gib"), "resumed_from_step": stats.get("resumed_from_step"),
        "draft_vocab_coverage": json.loads(path("vocab", "coverage.json").read_text())["coverage"],
        "aux_layer_ids": json.loads(path("extract", "index.json").read_text())["aux_layer_ids"],
        **{k: str(v) for k, v in files.items()}, "paths": [str(v) for v in files.values()]})


def step_spec_data(race: Race) -> None:
    ours = race.result("ours")
    sh(module("speculators_side", "data", "--config", str(race.config), "--tokenized", ours["tokenized"],
              "--vocab-mapping", ours["vocab_mapping"], "--aux-layer-ids", *map(str, ours["aux_layer_ids"]),
              "--out", str(race.work / "spec" / "data"), "--result", str(race.file("spec_data"))))


def step_spec_train(race: Race) -> None:
    r, data, ours = race.recipe, race.result("spec_data"), race.result("ours")
    # speculators runs every epoch asked for; --max-steps stops it inside the last (padding only adds steps)
    per_epoch = max(1, int(0.98 * data["tokens"]) // r["batch_tokens"])
    recipe = {**r, "loss": r["spec_loss"], "epochs": -(-r["train_steps"] // per_epoch)}
    argv = speculators_argv(str(race.work / "target"), Path(data["paths"][0]), race.work / "spec" / "checkpoints",
                            ours["aux_layer_ids"], r["draft_vocab"], recipe)
    sh(module("speculators_side", "train", "--export", str(race.work / "spec" / "export"),
              "--result", str(race.file("spec_train")), "--", *argv))


def evaluate(race: Race, step: str, engine: str, export: str) -> None:
    sh(module("evaluate", "--engine", engine, "--config", str(race.config), "--export", export,
              "--result", str(race.file(step))))


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Race], None]
    needs: tuple[str, ...] = ()
    needs_side: str | None = None  # "speculators" or "vllm": a probe says why it cannot run here
    owns: tuple[str, ...] = ()  # folders of the work folder it writes, besides its result


STEPS = (
    Step("target", step_target, owns=("target",)),
    Step("ours", step_ours, ("target",), owns=("store",)),
    Step("spec_data", step_spec_data, ("ours",), "speculators", owns=("spec/data",)),
    Step("spec_train", step_spec_train, ("spec_data",), "speculators", owns=("spec/checkpoints", "spec/export")),
    Step("spec_eval", lambda race: evaluate(race, "spec_eval", "hf", race.result("spec_train")["export"]),
         ("spec_train",)),
    Step("vllm_ours", lambda race: evaluate(race, "vllm_ours", "vllm", race.result("ours")["export"]), ("ours",),
         "vllm"),
    Step("vllm_spec", lambda race: evaluate(race, "vllm_spec", "vllm", race.result("spec_train")["export"]),
         ("spec_train",), "vllm"),
)


def forget_after(race: Race, name: str) -> None:
    """A step about to run makes its output anew: what the steps after it made from the old one goes (their
    results and folders), so each of them runs again on the new one. Its own folders stay: it resumes from them."""
    made_from = {name}
    for step in STEPS:
        if made_from & set(step.needs):
            made_from.add(step.name)
            race.file(step.name).unlink(missing_ok=True)
            for folder in step.owns:
                shutil.rmtree(race.work / folder, ignore_errors=True)


PROBES = {"speculators": "from benchmarks.quality.speculators_side import speculators_missing as why",
          "vllm": "from benchmarks.quality.evaluate import vllm_missing as why"}


def probe(side: str) -> str | None:
    """Why ``side`` cannot run in this Python (None: it can), asked of a fresh process (imports are heavy)."""
    out = subprocess.run([sys.executable, "-c", f"{PROBES[side]}; print(why() or '')"], cwd=REPO,
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or (f"probing {side} failed: {out.stderr.strip()[-300:]}" if out.returncode else None)


def run(race: Race) -> int:
    """Every step in order (done ones skipped), then the summary; 0 when no step failed."""
    states: dict[str, str] = {}
    unavailable: dict[str, str | None] = {}
    for step in STEPS:
        missing = [n for n in step.needs if states[n] not in ("done", "done earlier")]
        if race.result(step.name) is not None:
            states[step.name] = "done earlier"
        elif step.needs_side and unavailable.setdefault(step.needs_side, probe(step.needs_side)):
            states[step.name] = f"not run: {unavailable[step.needs_side]}"
        elif missing:
            states[step.name] = f"not run: needs {', '.join(missing)}"
        else:
            forget_after(race, step.name)
            print(f"race: {step.name}: running", flush=True)
            try:
                step.run(race)
                states[step.name] = "done" if race.result(step.name) else "failed: it left no valid result"
            except StepFailed as e:
                states[step.name] = f"failed: {e}"
        print(f"race: {step.name}: {states[step.name]}", flush=True)
    results = {s.name: race.result(s.name) for s in STEPS}
    results["ours_report"] = json.loads(Path(results["ours"]["report"]).read_text()) if results["ours"] else None
    out = summary.summarize(results, states, race.recipe)
    write_json(race.work / "race.json", out)
    summary.plot(out, race.work / "race.png")
    print(f"race: results in {race.work / 'race.json'} and {race.work / 'race.png'}", flush=True)
    return 1 if any(s.startswith("failed") for s in states.values()) else 0


def parse_args(argv: list[str] | None) -> tuple[Path, dict]:
    """The work folder and the race's recipe: the scale's values with the flags given over them."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.quality.race", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="the race's folder: its steps' results, store and outputs")
    ap.add_argument("--scale", choices=SCALES, default="race", help="race: the published sizes, for one GPU; "
                    "test: the same steps at test size, on a CPU in minutes")
    ap.add_argument("--corpus-root", default=None, help="the Python sources the target learns from (default: this "
                    "Python's site-packages)")
    ap.add_argument("--ours", action="append", default=[], metavar="SETTING=VALUE", help="one of ours' own train "
                    f"settings, over the race's ({', '.join(f'{k}={v}' for k, v in OURS.items())}); repeatable")
    for key, value in RACE.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                        help=f"{HELP.get(key, key.replace('_', ' '))} (race: {value}, test: {TEST[key]})")
    a = ap.parse_args(argv)
    recipe = {k: v if (v := getattr(a, k)) is not None else SCALES[a.scale][k] for k in RACE}
    recipe["ours"] = dict(OURS)
    for setting in a.ours:
        key, sep, value = setting.partition("=")
        if not sep:
            ap.error(f"--ours {setting!r}: write SETTING=VALUE (a train setting of ours)")
        recipe["ours"][key] = yaml.safe_load(value)
    check_ours(ap, recipe)
    return a.work.resolve(), {**recipe, "scale": a.scale, "corpus_root": a.corpus_root}


def check_ours(ap: argparse.ArgumentParser, recipe: dict) -> None:
    """ours' train settings as the train stage reads them: an unknown or out-of-bounds one is one line, now."""
    from pydantic import ValidationError

    from eagle3.settings.train import TrainSettings

    try:
        TrainSettings(**pipeline_config(Race(Path("."), recipe))["train"])
    except ValidationError as e:
        err = e.errors()[0]
        ap.error(f"train.{'.'.join(map(str, err['loc']))}: {err['msg']}")


def start(work: Path, recipe: dict) -> Race:
    """The race in ``work``, begun now or earlier with this very recipe (another recipe needs another folder)."""
    saved = read_result(work / "recipe.json")
    if saved is not None and saved != recipe:
        changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in recipe.items() if saved.get(k) != v)
        raise SystemExit(f"race: {work} holds a race of another recipe ({changed}); give another --work")
    race = Race(work, recipe)
    work.mkdir(parents=True, exist_ok=True)
    write_json(work / "recipe.json", recipe)
    race.config.write_text(yaml.safe_dump(pipeline_config(race), sort_keys=False))
    return race


def main(argv: list[str] | None = None) -> int:
    work, recipe = parse_args(argv)
    race = start(work, recipe)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as on Ctrl-C: after the step running stops
    try:
        return run(race)
    except KeyboardInterrupt:
        print("race: stopped; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
