"""Issue 8: acceptance length on a trained target, eagle3ctl against vllm-project/speculators.

Resumable steps under ``--work`` (each leaves ``results/<step>.json``; a rerun skips done
steps, so a later device call on a warm machine carries on where one stopped). The order
lets one device call hold the whole race: nothing else runs on the GPU while a system's
training is timed, and untimed work overlaps.

1. ``target``     make_target.py: BPE tokenizer + ~130M Llama trained on site-packages code.
   ``spec_warm``  speculators' trainer compiled on random samples, nothing timed (its cold
   ``torch.compile`` takes ~5 min). With ``target`` in the same call it runs in the
   background on the *untrained* target (same shapes, same graphs) while the target trains.
2. ``prep``       run ``q-bf16``'s generate (against serve_batched.py, an OpenAI-compatible
   batching server standing in for vLLM), vocab and extract (bf16) stages.
3. ``spec_data``  q-bf16's samples in speculators' data format (spec_data.py).
4. ``train_ours`` q-bf16's train and export stages (timed: waits for ``spec_warm``).
5. ``train_spec`` the same drafter trained by speculators on the same samples (spec_train.py,
   timed), exported to our format as run ``q-spec``'s export stage.
6. ``train_fp8``  run ``q-fp8``: q-bf16's generate and vocab output, extract with float8_e4m3fn storage, train, export.
7. ``evaluate``   every trained drafter through our evaluate stage on the same held-out prompts,
   all at once (acceptance is not timed); results ``ours_bf16``, ``spec``, ``ours_fp8``.
8. ``plot``       acceptance per position of every system that finished; one JSON summary.
9. ``diagnose``   diagnose_ttt.py on q-bf16's drafter, and on one drafter per ``--variant
   NAME:key=value,...`` (q-bf16's samples and hidden states, train settings overridden, run
   ``q-v-NAME``): training-time accuracy per TTT step against token-by-token drafting.

Every step checks the time left (``--budget-s``) before it starts and runs its commands
under that deadline, so a slow step cuts itself short and the summary is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PORT = 8123
STEPS = ("target", "spec_warm", "prep", "spec_data", "train_ours", "train_spec", "train_fp8", "evaluate", "plot",
         "diagnose")
RESULTS = STEPS + ("ours_bf16", "spec", "ours_fp8", "evaluate_partial")  # written by the evaluate step


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.work, self.out = a, a.work.resolve(), a.out.resolve()
        self.deadline = time.monotonic() + a.budget_s
        (self.work / "results").mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = self.work / "store"
        self.py = sys.executable
        self.warm: threading.Thread | None = None  # spec_warm beside the target's training
        self.warm_status = "not run"
        self.target_over = threading.Event()  # make_target has exited (its untrained copy is there or never will be)

    # -- plumbing ---------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')} left {self.left():.0f}s] {msg}", flush=True)

    def sh(self, cmd: list[str], reserve_s: float = 5.0, env: dict | None = None) -> int:
        """Run a command in its own process group under the deadline; its output goes to ours."""
        if self.left() - reserve_s <= 0:
            self.log(f"no time left for: {' '.join(cmd[:6])}")
            return 124
        return self.sh_all({"": cmd}, reserve_s, env)[""]

    def sh_all(self, cmds: dict[str, list[str]], reserve_s: float = 5.0, env: dict | None = None) -> dict[str, int]:
        """Run commands side by side under the deadline; exit code by name (124: stopped at the deadline)."""
        procs = {}
        for name, cmd in cmds.items():
            self.log(f"[{name}] $ " + " ".join(cmd) if name else "$ " + " ".join(cmd))
            procs[name] = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, start_new_session=True)
        end = time.monotonic() + self.left() - reserve_s
        rcs = {}
        for name, p in procs.items():
            try:
                rcs[name] = p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"deadline: stopping {name or ' '.join(cmds[name][:3])} (pid {p.pid})")
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                rcs[name] = 124
        return rcs

    def done(self, step: str) -> dict | None:
        p = self.work / "results" / f"{step}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def save(self, step: str, result: dict) -> dict:
        (self.work / "results" / f"{step}.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    def manifest(self, run: str, stage: str) -> dict | None:
        p = self.store / run / stage / "manifest.json"
        return json.loads(p.read_text()) if p.exists() else None

    # -- configs ----------------------------------------------------------------------

    def config(self, run: str, storage_dtype: str = "bfloat16", train: dict | None = None) -> Path:
        a, tiny = self.a, self.a.tiny
        cfg = {
            "run_id": run,
            "backend": "local",
            "store": {"uri": f"file://{self.store}"},
            "target": {"model": str(self.work / "target"), "cache_dir": str(self.work / "cache")},
            "serve": {"endpoint": f"http://127.0.0.1:{PORT}/v1"},
            "generate": {"prompts": str(self.work / "prompts_train.jsonl"), "concurrency": 1024,
                         "max_tokens": a.max_tokens, "max_length": 2048, "part_size": 1024,
                         "request_timeout_s": 300},
            "vocab": {"draft_vocab_size": a.draft_vocab},
            "extract": {"storage_dtype": storage_dtype, "batch_tokens": 8192 if tiny else 65536,
                        "shard_tokens": 1 << 18 if tiny else 1 << 20},
            "drafter": {"rms_norm_eps": 1e-5},
            "train": {"epochs": a.epochs, "batch_tokens": a.batch_tokens, "max_seq_len": 2048, "lr": a.lr,
                      "warmup_steps": a.warmup_steps, "ttt_steps": 7, "ttt_decay": 0.8,
                      "checkpoint_every": 100000, "log_every": 5, "eval_fraction": 0.02, "weight_decay": 0.0,
                      "compile": a.train_compile, **({"profile_steps": a.profile_train} if a.profile_train else {}),
                      **(train or {})},
            "evaluate": {"prompts": str(self.work / "prompts_heldout.jsonl"), "num_prompts": a.eval_prompts,
                         "num_draft_tokens": a.draft_tokens, "max_new_tokens": a.eval_new_tokens,
                         "workers": a.eval_workers, "batch_size": a.eval_batch},
        }
        path = self.work / f"{run}.yaml"
        import yaml

        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

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

    def spec_env(self) -> dict:
        """speculators' inductor cache in --work (device_call.sh carries it between sessions)."""
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
        trained drafter is thrown away; the seconds this took are kept as speculators' cold start.
        """
        from eagle3.data.tokenized import from_lists, write_tokenized
        from eagle3.targets.aux_layers import default_aux_layer_ids
        from eagle3.vocab.mapping import build_vocab_mapping, save_vocab_mapping

        target = target or self.work / "target"
        cfg = json.loads((target / "config.json").read_text())
        vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
        warm = self.work / "spec_warm"
        shutil.rmtree(warm, ignore_errors=True)
        warm.mkdir(parents=True)
        g = torch.Generator().manual_seed(0)
        samples = []
        for i in range(24 if self.a.tiny else 96):
            n = int(torch.randint(64 if self.a.tiny else 256, 256 if self.a.tiny else 1024, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            samples.append((i, ids, [0] * (n // 2) + [1] * (n - n // 2)))
        data = from_lists(samples)
        write_tokenized(warm / "tokenized.safetensors", data)
        counts = torch.bincount(data.input_ids.long(), minlength=vocab)
        save_vocab_mapping(warm / "vocab_mapping.safetensors", *build_vocab_mapping(counts, self.a.draft_vocab))
        aux = [str(i) for i in default_aux_layer_ids(layers)]
        t0 = time.monotonic()
        if self.sh([self.py, str(HERE / "spec_data.py"), "--target", str(target),
                    "--tokenized", str(warm / "tokenized.safetensors"),
                    "--vocab", str(warm / "vocab_mapping.safetensors"),
                    "--aux-layer-ids", *aux, "--out", str(warm / "data")]) != 0:
            raise StepFailed("spec_data.py failed on the warm-up samples")
        t1 = time.monotonic()
        cmd = self.spec_train_cmd(warm / "data", warm / "ckpt", warm / "export", warm / "train.json", aux,
                                  ("--max-steps", "6"), target=target)
        if self.sh(cmd, reserve_s=30, env=self.spec_env()) != 0:
            raise StepFailed("speculators' warm-up training failed")
        return {"samples": len(samples), "data_seconds": round(t1 - t0, 1),
                "cold_train_seconds_6_steps": round(time.monotonic() - t1, 1)}

    # -- the race -----------------------------------------------------------------------

    def pipeline(self, run: str, storage_dtype: str, need_server: bool, until: str | None = None,
                 train: dict | None = None) -> int:
        cfg = self.config(run, storage_dtype, train)
        server = self.start_server() if need_server else None
        cmd = [self.py, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(cfg)]
        try:
            return self.sh(cmd + (["--until", until] if until else []), reserve_s=15)
        finally:
            if server is not None:
                self.stop_server(server)

    def step_prep(self) -> dict:
        """q-bf16 up to its hidden states: generate (the stand-in server runs only for it), vocab, extract."""
        if not self.manifest("q-bf16", "generate"):
            if self.pipeline("q-bf16", "bfloat16", need_server=True, until="generate") != 0:
                raise StepFailed("q-bf16 generate failed")
        for stage in ("vocab", "extract"):  # siblings in the DAG: --until one leaves the other out
            if self.pipeline("q-bf16", "bfloat16", need_server=False, until=stage) != 0:
                raise StepFailed(f"q-bf16 {stage} failed")
        return {st: stage_info(self.store, "q-bf16", st) for st in ("generate", "vocab", "extract")}

    def step_train_ours(self) -> dict:
        if self.pipeline("q-bf16", "bfloat16", need_server=False, until="export") != 0:
            raise StepFailed("q-bf16 train/export failed")
        self.keep_profile("q-bf16", trace=True)
        self.save("ours_bf16", collect_run(self.store, "q-bf16"))  # its training numbers in the summary before evaluate
        return {st: stage_info(self.store, "q-bf16", st) for st in ("train", "export")}

    def keep_profile(self, run: str, trace: bool) -> None:
        """--profile-train: the train stage's profile tables (and its trace) into $OUT, which takes 8 files."""
        prof = self.store / run / "train" / "profile"
        if not (prof / "summary.json").exists():
            return
        parts = [prof / n for n in ("summary.json", "kernels.txt", "host_ops.txt") if (prof / n).exists()]
        (self.out / f"train_profile_{run}.txt").write_text("\n\n".join(p.read_text() for p in parts))
        if trace and (prof / "trace.json.gz").exists():
            shutil.copyfile(prof / "trace.json.gz", self.out / f"train_trace_{run}.json.gz")

    def step_train_fp8(self) -> dict:
        """q-fp8 = q-bf16's samples and draft vocab (copied), hidden states stored as fp8, trained alike."""
        if not self.manifest("q-fp8", "vocab"):
            clone_rekeyed(self.store, "q-bf16", "q-fp8", ("generate", "vocab"), self.config("q-fp8", "float8_e4m3fn"))
        if self.pipeline("q-fp8", "float8_e4m3fn", need_server=False, until="export") != 0:
            raise StepFailed("q-fp8 vocab/extract/train/export failed")
        self.keep_profile("q-fp8", trace=False)
        self.save("ours_fp8", collect_run(self.store, "q-fp8"))  # its training numbers in the summary before evaluate
        return {st: stage_info(self.store, "q-fp8", st) for st in ("vocab", "extract", "train", "export")}

    def aux_ids(self) -> list[str]:
        index = json.loads((self.store / "q-bf16" / "extract" / "index.json").read_text())
        return [str(i) for i in index["aux_layer_ids"]]

    def step_spec_data(self) -> dict:
        src, data = self.store / "q-bf16", self.work / "spec_data"
        t0 = time.monotonic()
        if not (data / "dataset_info.json").exists() or not (data / "hidden_states").exists():
            shutil.rmtree(data, ignore_errors=True)
            rc = self.sh([self.py, str(HERE / "spec_data.py"), "--target", str(self.work / "target"),
                          "--tokenized", str(src / "generate" / "tokenized.safetensors"),
                          "--vocab", str(src / "vocab" / "vocab_mapping.safetensors"),
                          "--aux-layer-ids", *self.aux_ids(), "--out", str(data)])
            if rc != 0:
                raise StepFailed("spec_data.py failed")
        return {"data": str(data), "seconds": round(time.monotonic() - t0, 1)}

    def spec_train_cmd(self, data: Path, save: Path, export: Path, out_json: Path, aux: list[str],
                       extra: tuple[str, ...] = (), target: Path | None = None) -> list[str]:
        """speculators' trainer on ``data``, configured like our drafter (spec_train.py)."""
        a = self.a
        cmd = [self.py, str(HERE / "spec_train.py"), "--target", str(target or self.work / "target"),
               "--data", str(data), "--save", str(save), "--export", str(export), "--out-json", str(out_json),
               "--aux-layer-ids", *aux, "--draft-vocab-size", str(a.draft_vocab), "--lr", str(a.lr),
               "--warmup-steps", str(a.warmup_steps), "--epochs", str(int(round(a.epochs))),
               "--total-seq-len", str(a.batch_tokens), "--num-workers", "0" if a.tiny else "8"]
        if a.tiny:  # no GPU: speculators' trainer needs one; save its initialized drafter instead
            extra = ("--draft-attn-impl", "sdpa", "--dry-run", *extra)
            save.mkdir(parents=True, exist_ok=True)
        return cmd + (["--", *extra] if extra else [])

    def step_train_spec(self) -> dict:
        if not self.done("spec_data"):
            self.save("spec_data", self.step_spec_data())
        aux = self.aux_ids()
        data, save, export = self.work / "spec_data", self.work / "spec_ckpt", self.work / "spec_export"
        shutil.rmtree(save, ignore_errors=True)
        cmd = self.spec_train_cmd(data, save, export, self.work / "spec_train.json", aux)
        if self.sh(cmd, reserve_s=60, env=self.spec_env()) != 0:
            raise StepFailed("spec_train.py failed")
        # Run q-spec = q-bf16's generate + an export stage holding their drafter, for our evaluate stage.
        if not self.manifest("q-spec", "generate"):
            clone_rekeyed(self.store, "q-bf16", "q-spec", ("generate",), self.config("q-spec"))
        commit_export(self.store, "q-spec", export, {"source": "vllm-project/speculators 0.9.0"})
        return {"train": json.loads((self.work / "spec_train.json").read_text())}

    def step_evaluate(self) -> dict:
        """Every trained drafter's evaluate stage at once, on the same held-out prompts."""
        pipeline = [self.py, "-m", "eagle3.cli.app", "run", "pipeline", "-c"]
        cmds = {}
        if self.done("train_ours"):
            cmds["q-bf16"] = pipeline + [str(self.config("q-bf16"))]
        if self.done("train_spec"):
            cmds["q-spec"] = [self.py, "-m", "eagle3", "stage", "evaluate", "-c", str(self.config("q-spec"))]
        if self.done("train_fp8"):
            cmds["q-fp8"] = pipeline + [str(self.config("q-fp8", "float8_e4m3fn"))]
        rcs = self.sh_all(cmds, reserve_s=10)  # run() starts this step only when some drafter is trained
        out = {"exit_codes": rcs}
        for run in ("q-bf16", "q-fp8"):
            if run in cmds:
                self.save("ours_bf16" if run == "q-bf16" else "ours_fp8", collect_run(self.store, run))
        if "q-spec" in cmds:
            self.save("spec", {"train": self.done("train_spec")["train"],
                               "evaluate": stage_info(self.store, "q-spec", "evaluate")})
        partial = self.work / "results" / "evaluate_partial.json"
        partial.unlink(missing_ok=True)  # an earlier cut-off attempt's numbers must not outlive this one
        if any(rcs.values()):
            out["partial"] = partial_acceptance(self.store, list(cmds), self.a.draft_tokens)
            self.save("evaluate_partial", out)
            raise StepFailed(f"evaluate exit codes {rcs}; acceptance on the prompts every run finished: "
                             f"{ {r: v.get('mean_acceptance_length') for r, v in out['partial'].items()} }")
        return out

    def train_info(self, run: str) -> dict:
        """The train stage's stats, with steady tokens/s from its metrics (compile start-up left out)."""
        from summarize import steady

        metrics = self.store / run / "train" / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        return {**stage_info(self.store, run, "train"), "steady_tokens_per_s": steady(records)}

    def diagnose_run(self, run: str) -> dict:
        out = self.work / "diagnose" / f"{run}.json"
        cmd = [self.py, str(HERE / "diagnose_ttt.py"), "--store", str(self.store), "--run", run,
               "--steps", "7", "--batch-tokens", str(self.a.batch_tokens), "--max-seq-len", "2048", "--out", str(out)]
        if self.sh(cmd, reserve_s=5) != 0:
            raise StepFailed(f"diagnose_ttt failed on {run}")
        return json.loads(out.read_text())

    def step_diagnose(self) -> dict:
        """q-bf16's drafter (when trained), then each --variant trained on q-bf16's hidden states and diagnosed."""
        result: dict = {}

        def keep(run: str, entry: dict) -> None:  # $OUT holds every drafter diagnosed so far
            result[run] = entry
            (self.out / "diagnose.json").write_text(json.dumps(result, indent=2, default=str) + "\n")

        if self.done("train_ours"):
            keep("q-bf16", {"train": self.train_info("q-bf16"), "diagnose": self.diagnose_run("q-bf16")})
        for name, overrides in self.a.variant:
            run = f"q-v-{name}"
            if not self.manifest(run, "extract"):
                clone_rekeyed(self.store, "q-bf16", run, ("generate", "vocab", "extract"),
                              self.config(run, "bfloat16", overrides))
            self.log(f"variant {name}: train {overrides}")
            if self.pipeline(run, "bfloat16", need_server=False, until="train", train=overrides) != 0:
                keep(run, {"overrides": overrides, "error": "train failed"})
                continue
            keep(run, {"overrides": overrides, "train": self.train_info(run), "diagnose": self.diagnose_run(run)})
        return result

    def step_plot(self) -> dict:
        from plot_quality import plot_acceptance

        systems = {}
        for name, step, run in (("eagle3ctl (bf16)", "ours_bf16", "q-bf16"), ("speculators", "spec", "q-spec"),
                                ("eagle3ctl (fp8 storage)", "ours_fp8", "q-fp8")):
            rep = self.store / run / "evaluate" / "report.json"
            if self.done(step) and rep.exists():
                systems[name] = json.loads(rep.read_text())
        if systems:
            plot_acceptance(systems, self.out / "acceptance_per_position_h200.png")
        return {"systems": sorted(systems)}

    def run(self, steps: list[str]) -> dict:
        tiny = self.a.tiny
        estimates = {"target": 60 if tiny else 200, "spec_warm": 60 if tiny else 330, "prep": 40 if tiny else 200,
                     "spec_data": 20 if tiny else 45, "train_ours": 40 if tiny else 90,
                     "train_spec": 40 if tiny else 120, "train_fp8": 40 if tiny else 100,
                     "evaluate": 30 if tiny else 120, "plot": 5, "diagnose": 30 if tiny else 60}
        resumable = ("prep", "train_ours", "train_fp8", "evaluate")  # our stages resume where a cut-off call left them
        needs = {"spec_warm": ("target",), "prep": ("target",), "spec_data": ("prep",), "train_ours": ("prep",),
                 "train_spec": ("spec_data",), "train_fp8": ("prep",), "diagnose": ("prep",)}
        timed = ("train_ours", "train_spec", "train_fp8")
        # speculators' compile beside the target's training, when both are still to do in this call
        warm_beside = "target" in steps and "spec_warm" in steps and not self.done("target") \
            and not self.done("spec_warm")
        status = {}
        for step in steps:
            if self.done(step) and step != "plot":  # the plot is redrawn with whatever finished
                status[step] = "done earlier"
                continue
            if step == "spec_warm" and warm_beside:
                status[step] = "running beside target" if self.warm is not None else self.warm_status
                continue
            missing = [n for n in needs.get(step, ()) if not self.done(n)]
            if missing:
                status[step] = f"skipped: needs {', '.join(missing)}"
                continue
            if step == "evaluate" and not any(self.done(t) for t in ("train_ours", "train_spec", "train_fp8")):
                status[step] = "skipped: no drafter is trained"
                continue
            if step in timed or step == "plot":
                self.join_warm(status)
            need = 60 if step in resumable and not tiny else estimates[step]
            if step != "plot" and self.left() < need:
                status[step] = f"skipped: {self.left():.0f}s left, needs ~{estimates[step]}s"
                self.log(status[step])
                continue
            t0 = time.monotonic()
            self.log(f"step {step}")
            try:
                fn = {"target": lambda: self.step_target(warm_beside), "spec_warm": self.step_spec_warm,
                      "prep": self.step_prep, "spec_data": self.step_spec_data, "train_ours": self.step_train_ours,
                      "train_spec": self.step_train_spec, "train_fp8": self.step_train_fp8,
                      "evaluate": self.step_evaluate, "plot": self.step_plot, "diagnose": self.step_diagnose}[step]
                res = fn()
                res["step_seconds"] = round(time.monotonic() - t0, 1)
                self.save(step, res)
                status[step] = f"done in {res['step_seconds']}s"
            except StepFailed as e:
                status[step] = f"failed: {e}"
                self.log(status[step])
            self.write_summary(status)
        self.join_warm(status)
        return self.write_summary(status)

    def write_summary(self, status: dict) -> dict:
        from summarize import summarize

        summary = summarize({s: self.done(s) for s in RESULTS}, status, vars(self.a))
        (self.out / "quality_h200.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return summary


class StepFailed(Exception):
    pass


def parse_variant(text: str) -> tuple[str, dict]:
    """'NAME:key=value,key=value' → (NAME, {key: value}) with YAML scalars (false, 3, 0.5, sdpa)."""
    import yaml

    name, _, rest = text.partition(":")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"variant {text!r}: NAME:key=value,... with a plain name")
    pairs = [p.split("=", 1) for p in rest.split(",") if p]
    if any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"variant {text!r}: each setting is key=value")
    return name, {k.strip(): yaml.safe_load(v) for k, v in pairs}


def clone_rekeyed(store: Path, src: str, dst: str, stages: tuple[str, ...], config: Path) -> None:
    """Copy committed stages (in pipeline order) to another run so that its pipeline skips them:
    each copied manifest names the new run, the new digests of its copied upstream manifests
    and the input key that ``config`` gives with them (a plain copy changes the upstream
    digests, and every downstream stage would run again). Each stage is copied and re-keyed
    beside its place and moved in last, so a kill leaves either no copy or a finished one."""
    from eagle3.config import load_config
    from eagle3.context import stage_input_key
    from eagle3.manifest import Manifest, read_manifest
    from eagle3.stages import get_stage
    from eagle3.store.open import open_store

    cfg = load_config(config)
    objects = open_store(f"file://{store}")
    for stage in stages:
        s, d, tmp = store / src / stage, store / dst / stage, store / dst / f".{stage}.cloning"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(s, tmp)
        spec = get_stage(stage)
        upstream = {up: read_manifest(objects, dst, up) for up in spec.needs}
        if any(v is None for v in upstream.values()):
            raise StepFailed(f"clone {dst}/{stage}: an upstream stage is not cloned first")
        m = Manifest.model_validate_json((tmp / "manifest.json").read_bytes())
        m.run_id = dst
        m.upstream = {k: v.digest for k, v in upstream.items()}
        m.input_key = stage_input_key(cfg, spec, upstream)
        (tmp / "manifest.json").write_bytes(m.model_dump_json(indent=2).encode() + b"\n")
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)


def commit_export(store: Path, run: str, export_dir: Path, stats: dict) -> None:
    """Commit a ready export directory as run/export through the manifest protocol."""
    from eagle3.manifest import StageOutput, compute_input_key
    from eagle3.store import open_store

    st = open_store(f"file://{store}")
    key = compute_input_key("export", {"external": stats}, {})
    out = StageOutput(st, run, "export", key, {})
    out.begin()
    out.put_file("config.json", export_dir / "config.json")
    out.put_file("model.safetensors", export_dir / "model.safetensors")
    out.commit(stats)


def stage_info(store: Path, run: str, stage: str) -> dict:
    p = store / run / stage / "manifest.json"
    if not p.exists():
        return {}
    m = json.loads(p.read_text())
    info = {"stats": m.get("stats", {}), "started_at": m.get("started_at"), "finished_at": m.get("finished_at"),
            "bytes": sum(o["size"] for o in m.get("objects", []))}
    if stage == "extract":
        info["shard_bytes"] = sum(o["size"] for o in m["objects"] if o["key"].startswith("shards/"))
    if stage == "evaluate" and (store / run / stage / "report.json").exists():
        info["report"] = json.loads((store / run / stage / "report.json").read_text())
    return info


def collect_run(store: Path, run: str) -> dict:
    stages = {}
    for stage in ("generate", "vocab", "extract", "train", "export", "evaluate"):
        info = stage_info(store, run, stage)
        if info:
            stages[stage] = info
    if "extract" in stages and (store / run / "extract" / "index.json").exists():
        stages["extract"]["index"] = json.loads((store / run / "extract" / "index.json").read_text())
    return {"run": run, "stages": stages}


def partial_acceptance(store: Path, runs: list[str], k: int) -> dict:
    """The acceptance report (eagle3.evaluate.report.summarize) of the per-prompt results the runs'
    evaluate stages journaled, over the prompts every run finished, when a deadline cut them short."""
    from eagle3.evaluate.report import summarize as acceptance_report

    journaled = {r: {p.name: json.loads(p.read_text()) for p in (store / r / "evaluate" / "prompts").glob("*.json")}
                 for r in runs}
    common = sorted(set.intersection(*(set(j) for j in journaled.values()))) if journaled else []
    out = {}
    for r, j in journaled.items():
        done = [j[name] for name in common]
        rep = acceptance_report(k, [a for d in done for a in d["accept_lengths"]],
                                [sum(d["accepted_at"][i] for d in done) for i in range(k)],
                                sum(d["tokens_generated"] for d in done))
        out[r] = {"prompts": len(common), **rep}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="state kept between calls (e.g. /tmp/e3q)")
    ap.add_argument("--out", type=Path, required=True, help="where the summary and plot go ($OUT)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny target, few samples")
    ap.add_argument("--corpus-root", type=Path, default=None)
    ap.add_argument("--target-seconds", type=float, default=None)
    ap.add_argument("--prompts-train", type=int, default=None, help="generate: training prompts (default the "
                    "target recipe's 4096)")
    ap.add_argument("--max-tokens", type=int, default=192, help="generate: response tokens per prompt")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocab size (default 16384; 512 with --tiny)")
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step (both systems)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--train-compile", action=argparse.BooleanOptionalAction, default=True,
                    help="train.compile of our runs (--no-train-compile: eager, e.g. to profile evaluate quickly)")
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--eval-workers", type=int, default=3, help="evaluate: processes decoding prompts in parallel")
    ap.add_argument("--eval-batch", type=int, default=16, help="evaluate: prompts decoded in lockstep per process")
    ap.add_argument("--serve-batch", type=int, default=1024)
    ap.add_argument("--profile-train", default=None, metavar="A:B",
                    help="train.profile_steps of our runs; the tables (and bf16's trace) are copied to --out")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="diagnose: also train with these train settings (e.g. eager:compile=false,attention=sdpa)")
    a = ap.parse_args(argv)
    if a.draft_vocab is None:  # the tiny target's whole vocab is 2048
        a.draft_vocab = 512 if a.tiny else 16384
    sys.path.insert(0, str(HERE))
    summary = Bench(a).run([s for s in a.steps.split(",") if s])
    print(json.dumps(summary.get("headline", summary), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
