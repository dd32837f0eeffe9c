"""Issue 8: acceptance length on a trained target, eagle3ctl against vllm-project/speculators.

Resumable steps under ``--work`` (each leaves ``results/<step>.json``; a rerun skips done
steps, so a second device call on a warm machine carries on where the first stopped):

1. ``target``   make_target.py: BPE tokenizer + ~130M Llama trained on site-packages code.
   ``spec_warm`` speculators' trainer compiled on random samples (nothing timed): a fresh
   machine's inductor cache is cold, and its compile outlasted a call in run 2.
2. ``ours_bf16``  ``eagle3ctl run pipeline`` (local backend) on that target, run ``q-bf16``:
   generate (against serve_batched.py, an OpenAI-compatible batching server standing in
   for vLLM) → vocab → extract (bf16) → train → export → evaluate on held-out prompts.
3. ``spec_data`` q-bf16's samples in speculators' data format (spec_data.py; its own step so
   it can use the end of the call that ran ``ours_bf16``), then
   ``spec``     the same drafter trained by speculators on those samples (spec_train.py),
   exported to our format, evaluated by our evaluate stage (run ``q-spec``).
4. ``ours_fp8``  run ``q-fp8``: the same generate output, extract with float8_e4m3fn storage.
5. ``plot``     acceptance per position of every system that finished; one JSON summary.

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
import time
import urllib.request
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PORT = 8123
STEPS = ("target", "spec_warm", "ours_bf16", "spec_data", "spec", "ours_fp8", "plot")


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.work, self.out = a, a.work.resolve(), a.out.resolve()
        self.deadline = time.monotonic() + a.budget_s
        (self.work / "results").mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.store = self.work / "store"
        self.py = sys.executable

    # -- plumbing ---------------------------------------------------------------------

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')} left {self.left():.0f}s] {msg}", flush=True)

    def sh(self, cmd: list[str], reserve_s: float = 5.0, env: dict | None = None) -> int:
        """Run a command in its own process group under the deadline; its output goes to ours."""
        limit = self.left() - reserve_s
        if limit <= 0:
            self.log(f"no time left for: {' '.join(cmd[:6])}")
            return 124
        self.log("$ " + " ".join(cmd))
        p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            return p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.log(f"deadline: stopping pid {p.pid}")
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            return 124

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

    def config(self, run: str, storage_dtype: str = "bfloat16") -> Path:
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
                      "checkpoint_every": 100000, "log_every": 5, "eval_fraction": 0.02, "weight_decay": 0.0},
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

    def step_target(self) -> dict:
        cmd = [self.py, str(HERE / "make_target.py"), "--work", str(self.work)]
        if self.a.tiny:
            cmd += ["--tiny", "--corpus-root", str(self.a.corpus_root)] if self.a.corpus_root else ["--tiny"]
        if self.a.target_seconds:
            cmd += ["--train-seconds", str(self.a.target_seconds)]
        if self.sh(cmd) != 0:
            raise StepFailed("make_target.py failed")
        return json.loads((self.work / "target_meta.json").read_text())

    def pipeline(self, run: str, storage_dtype: str, need_server: bool) -> int:
        cfg = self.config(run, storage_dtype)
        server = self.start_server() if need_server else None
        try:
            return self.sh([self.py, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(cfg)], reserve_s=15)
        finally:
            if server is not None:
                self.stop_server(server)

    def step_ours(self, run: str, storage_dtype: str) -> dict:
        need_server = True
        if run != "q-bf16" and self.manifest("q-bf16", "generate") and not self.manifest(run, "generate"):
            need_server = not clone_stage(self.store, "q-bf16", run, "generate")
        elif self.manifest(run, "generate"):
            need_server = False
        rc = self.pipeline(run, storage_dtype, need_server)
        result = collect_run(self.store, run)
        result["pipeline_exit_code"] = rc
        if rc != 0 or "evaluate" not in result["stages"]:
            self.log(f"pipeline {run} exit {rc}; stages done: {sorted(result['stages'])}")
            self.save(f"partial_{run}", result)
            raise StepFailed(f"pipeline {run} incomplete (exit {rc})")
        return result

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
                       extra: tuple[str, ...] = ()) -> list[str]:
        """speculators' trainer on ``data``, configured like our drafter (spec_train.py)."""
        a = self.a
        cmd = [self.py, str(HERE / "spec_train.py"), "--target", str(self.work / "target"), "--data", str(data),
               "--save", str(save), "--export", str(export), "--out-json", str(out_json),
               "--aux-layer-ids", *aux, "--draft-vocab-size", str(a.draft_vocab), "--lr", str(a.lr),
               "--warmup-steps", str(a.warmup_steps), "--epochs", str(int(round(a.epochs))),
               "--total-seq-len", str(a.batch_tokens), "--num-workers", "0" if a.tiny else "8"]
        if a.tiny:  # no GPU: speculators' trainer needs one; save its initialized drafter instead
            extra = ("--draft-attn-impl", "sdpa", "--dry-run", *extra)
            save.mkdir(parents=True, exist_ok=True)
        return cmd + (["--", *extra] if extra else [])

    def step_spec_warm(self) -> dict:
        """speculators' trainer for a few steps on random samples, before anything is timed.

        Its ``torch.compile`` of the drafter took > 3.5 min on a fresh machine (run 2), more
        than the call that trains it can spare. Batches are padded to ``--total-seq-len``,
        so the real run (same target, drafter and draft vocab) finds every graph in the
        machine's inductor cache. The trained weights are thrown away; the seconds this took
        are kept as speculators' cold start.
        """
        from eagle3.data.tokenized import from_lists, write_tokenized
        from eagle3.targets.aux_layers import default_aux_layer_ids
        from eagle3.vocab.mapping import build_vocab_mapping, save_vocab_mapping

        cfg = json.loads((self.work / "target" / "config.json").read_text())
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
        if self.sh([self.py, str(HERE / "spec_data.py"), "--target", str(self.work / "target"),
                    "--tokenized", str(warm / "tokenized.safetensors"),
                    "--vocab", str(warm / "vocab_mapping.safetensors"),
                    "--aux-layer-ids", *aux, "--out", str(warm / "data")]) != 0:
            raise StepFailed("spec_data.py failed on the warm-up samples")
        t1 = time.monotonic()
        cmd = self.spec_train_cmd(warm / "data", warm / "ckpt", warm / "export", warm / "train.json", aux,
                                  ("--max-steps", "6"))
        if self.sh(cmd, reserve_s=30) != 0:
            raise StepFailed("speculators' warm-up training failed")
        return {"samples": len(samples), "data_seconds": round(t1 - t0, 1),
                "cold_train_seconds_6_steps": round(time.monotonic() - t1, 1)}

    def step_spec(self) -> dict:
        if not self.done("spec_data"):
            self.save("spec_data", self.step_spec_data())
        aux = self.aux_ids()
        data, save, export = self.work / "spec_data", self.work / "spec_ckpt", self.work / "spec_export"
        shutil.rmtree(save, ignore_errors=True)
        cmd = self.spec_train_cmd(data, save, export, self.work / "spec_train.json", aux)
        if self.sh(cmd, reserve_s=60) != 0:
            raise StepFailed("spec_train.py failed")
        train = json.loads((self.work / "spec_train.json").read_text())
        # Our evaluate stage on their drafter: run q-spec = q-bf16's generate + an export stage holding it.
        if not self.manifest("q-spec", "generate"):
            clone_stage(self.store, "q-bf16", "q-spec", "generate")
        commit_export(self.store, "q-spec", export, {"source": "vllm-project/speculators 0.9.0"})
        cfg = self.config("q-spec")
        if self.sh([self.py, "-m", "eagle3", "stage", "evaluate", "-c", str(cfg)]) != 0:
            raise StepFailed("evaluate of the speculators drafter failed")
        return {"train": train, "evaluate": stage_info(self.store, "q-spec", "evaluate")}

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
        estimates = {"target": 60 if tiny else 200, "spec_warm": 60 if tiny else 300,
                     "ours_bf16": 60 if tiny else 290, "spec_data": 20 if tiny else 45,
                     "spec": 60 if tiny else 250, "ours_fp8": 40 if tiny else 160, "plot": 5}
        status = {}
        for step in steps:
            if self.done(step) and step != "plot":  # the plot is redrawn with whatever finished
                status[step] = "done earlier"
                continue
            # The pipelines resume where a cut-off call left them: start them whenever a minute is left.
            need = 60 if step in ("ours_bf16", "ours_fp8") and not self.a.tiny else estimates[step]
            if step != "plot" and self.left() < need:
                status[step] = f"skipped: {self.left():.0f}s left, needs ~{estimates[step]}s"
                self.log(status[step])
                continue
            if step in ("spec_warm", "ours_bf16", "spec_data", "spec", "ours_fp8") and not self.done("target"):
                status[step] = "skipped: no target"
                continue
            # spec and fp8 reuse q-bf16's samples (and spec its vocab + aux ids), not its drafter.
            q_bf16_ready = self.manifest("q-bf16", "vocab") and self.manifest("q-bf16", "extract")
            if step in ("spec_data", "spec") and not q_bf16_ready:
                status[step] = "skipped: needs q-bf16's vocab and extract stages"
                continue
            if step == "ours_fp8" and not self.manifest("q-bf16", "generate"):
                status[step] = "skipped: needs q-bf16's generate stage"
                continue
            t0 = time.monotonic()
            self.log(f"step {step}")
            try:
                fn = {"target": self.step_target, "spec_warm": self.step_spec_warm,
                      "ours_bf16": lambda: self.step_ours("q-bf16", "bfloat16"),
                      "spec_data": self.step_spec_data, "spec": self.step_spec,
                      "ours_fp8": lambda: self.step_ours("q-fp8", "float8_e4m3fn"), "plot": self.step_plot}[step]
                res = fn()
                res["step_seconds"] = round(time.monotonic() - t0, 1)
                self.save(step, res)
                status[step] = f"done in {res['step_seconds']}s"
            except StepFailed as e:
                status[step] = f"failed: {e}"
                self.log(status[step])
            self.write_summary(status)
        return self.write_summary(status)

    def write_summary(self, status: dict) -> dict:
        from summarize import summarize

        summary = summarize({s: self.done(s) for s in STEPS}, status, vars(self.a))
        (self.out / "quality_h200.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        return summary


class StepFailed(Exception):
    pass


def clone_stage(store: Path, src: str, dst: str, stage: str) -> bool:
    """Copy a committed stage to another run (same objects; the manifest names the new run)."""
    s, d = store / src / stage, store / dst / stage
    if not (s / "manifest.json").exists():
        return False
    shutil.rmtree(d, ignore_errors=True)
    d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(s, d)
    m = json.loads((d / "manifest.json").read_text())
    m["run_id"] = dst
    (d / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    return True


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="state kept between calls (e.g. /tmp/e3q)")
    ap.add_argument("--out", type=Path, required=True, help="where the summary and plot go ($OUT)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny target, few samples")
    ap.add_argument("--corpus-root", type=Path, default=None)
    ap.add_argument("--target-seconds", type=float, default=None)
    ap.add_argument("--max-tokens", type=int, default=192, help="generate: response tokens per prompt")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocab size (default 16384; 512 with --tiny)")
    ap.add_argument("--epochs", type=float, default=2)
    ap.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step (both systems)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=7)
    ap.add_argument("--eval-workers", type=int, default=3, help="evaluate: processes decoding prompts in parallel")
    ap.add_argument("--eval-batch", type=int, default=16, help="evaluate: prompts decoded in lockstep per process")
    ap.add_argument("--serve-batch", type=int, default=1024)
    a = ap.parse_args(argv)
    if a.draft_vocab is None:  # the tiny target's whole vocab is 2048
        a.draft_vocab = 512 if a.tiny else 16384
    sys.path.insert(0, str(HERE))
    summary = Bench(a).run([s for s in a.steps.split(",") if s])
    print(json.dumps(summary.get("headline", summary), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
