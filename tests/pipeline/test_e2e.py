"""`eagle3ctl run pipeline` end to end on the tiny targets through the real local backend.

Real pieces only: `transformers serve` for the target, every stage as a subprocess, a
file:// store. Concurrency is asserted from the start/end times the run records.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eagle3.generate.tokenized import read_tokenized  # noqa: F401  (fails early if the contract module moved)
from eagle3.stages import ORDER, STAGES
from eagle3.store.local import LocalStore
from tests.committed import path_of
from tests.waiting import HANG_GUARD_S, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_GUARD_S)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def target_cache(tiny_cache_dir) -> Path:
    return tiny_cache_dir


def write_config(workdir: Path, arch: str, cache: Path, **over) -> Path:
    """examples/tiny*.yaml, made smaller still (the server takes a free port: none is configured)."""
    example = EXAMPLES / ("tiny.yaml" if arch == "llama" else "tiny-deepseek.yaml")
    cfg = yaml.safe_load(example.read_text())
    cfg["store"]["uri"] = f"file://{workdir / 'store'}"
    cfg["target"]["cache_dir"] = str(cache)
    cfg["generate"].update(max_samples=8, max_tokens=16, concurrency=2)
    cfg["train"].update(max_steps=3, checkpoint_every=1, log_every=1)
    cfg["evaluate"].update(num_prompts=2, max_new_tokens=8)
    for dotted, value in over.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def eagle3ctl(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
    return subprocess.run([sys.executable, "-m", "eagle3.cli.app", *args], cwd=workdir, env=env,
                          capture_output=True, text=True)


def start_eagle3ctl(workdir: Path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
    return subprocess.Popen([sys.executable, "-m", "eagle3.cli.app", *args], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def recorded(workdir: Path, run_id: str) -> dict:
    """The run's state record, in the store."""
    return json.loads((workdir / "store" / run_id / "_run/state.json").read_text())


def manifests(store: Path, run_id: str) -> dict[str, bytes]:
    return {n: (store / run_id / n / "manifest.json").read_bytes()
            for n in ORDER if (store / run_id / n / "manifest.json").exists()}


def assert_every_sample_once(store: Path, run_id: str) -> None:
    from eagle3.extract.shards import read_shard

    objects = LocalStore(store)
    ids = [json.loads(ln)["id"] for ln in path_of(objects, run_id, "generate", "raw_responses.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)), "a generated sample appears twice"
    tok = read_tokenized(path_of(objects, run_id, "generate", "tokenized.safetensors"))
    tok_ids = [int(i) for i in tok.sample_ids]
    assert len(tok_ids) == len(set(tok_ids))
    shard_ids = []
    for shard in sorted(path_of(objects, run_id, "extract", "shards").glob("shard-*.safetensors")):
        shard_ids += [int(i) for i in read_shard(shard).sample_ids]
    assert sorted(shard_ids) == sorted(tok_ids), "every tokenized sample is extracted exactly once"


def assert_schedule(state: dict) -> None:
    st, serve = state["stages"], state["serve"]
    for name in ORDER:
        for up in STAGES[name].needs:
            assert st[up]["ended_at"] <= st[name]["started_at"], f"{name} started before {up} ended"
    # The server stops once generate has committed, and before the first GPU stage starts.
    assert st["generate"]["ended_at"] <= serve["ended_at"] <= st["extract"]["started_at"]
    # vocab (CPU) is not held back by the GPU stage: it starts before extract ends.
    assert st["vocab"]["started_at"] < st["extract"]["ended_at"]
    gpu = sorted((st[n]["started_at"], st[n]["ended_at"]) for n in ORDER if STAGES[n].resource == "gpu")
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(gpu, gpu[1:])), "GPU stages overlapped"


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_tiny_pipeline_end_to_end_then_rerun_skips(tmp_path, target_cache, arch):
    config = write_config(tmp_path, arch, target_cache)
    run_id = yaml.safe_load(config.read_text())["run_id"]
    r = eagle3ctl(tmp_path, "run", "pipeline", "-c", str(config))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "drafter: " in r.stdout and "report: " in r.stdout
    assert "\nacceptance: mean acceptance length " in r.stdout and " at k=3: 1 (the target's bonus token) + " in r.stdout
    drafter = Path(r.stdout.split("drafter: ")[1].splitlines()[0])
    assert json.loads((drafter / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert Path(r.stdout.split("report: ")[1].splitlines()[0]).exists()
    state = recorded(tmp_path, run_id)
    assert {n: s["state"] for n, s in state["stages"].items()} == {n: "done" for n in ORDER}
    assert_schedule(state)
    assert_every_sample_once(tmp_path / "store", run_id)
    before = manifests(tmp_path / "store", run_id)

    r = eagle3ctl(tmp_path, "run", "pipeline", "-c", str(config))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ORDER:
        assert f"{name}: skipped (complete, input key matches manifest of " in r.stdout
    # nothing was started: no stage process, no server (benchmarks/bench_skip.py times a no-op rerun)
    again = recorded(tmp_path, run_id)
    assert {n: s.get("pid") for n, s in again["stages"].items()} == {n: None for n in ORDER}
    assert again["serve"].get("started_at") is None
    assert manifests(tmp_path / "store", run_id) == before

    r = eagle3ctl(tmp_path, "verify", "-c", str(config), "--deep")
    assert r.returncode == 0, r.stdout + r.stderr
    r = eagle3ctl(tmp_path, "status", "-c", str(config), "--json")
    assert [s["state"] for s in json.loads(r.stdout)["stages"]] == ["complete"] * len(ORDER)
    if arch == "llama":
        assert_the_race_evaluates_as_the_evaluate_stage(config, drafter, tmp_path / "store", run_id)
        assert_a_bad_setting_is_refused_before_anything_starts(tmp_path, run_id)
        assert_a_draft_vocab_sweep_reuses_the_data_and_hidden_states(tmp_path, run_id)


def assert_the_race_evaluates_as_the_evaluate_stage(config: Path, drafter: Path, store: Path, run_id: str) -> None:
    """benchmarks/quality decodes speculators' drafter through the evaluate stage's own entry points: on the
    exported drafter it must give exactly the committed report's numbers, prompt by prompt."""
    from benchmarks.quality.evaluate import hf_report

    ours = hf_report(config, drafter)
    committed = json.loads(path_of(LocalStore(store), run_id, "evaluate", "report.json").read_text())
    for key in ("mean_acceptance_length", "accepted_per_position", "verify_steps", "num_prompts", "held_out"):
        assert ours[key] == committed[key], key

    def prompts(report: dict) -> list[tuple]:
        return [(r["id"], r["verify_steps"], r["mean_acceptance_length"]) for r in report["per_prompt"]]

    assert prompts(ours) == prompts(committed)


def assert_a_bad_setting_is_refused_before_anything_starts(workdir: Path, run_id: str) -> None:
    """A draft vocab larger than the target's: one line, exit 2, and no finished output touched —
    not even extract's, which --force would rerun."""
    bad = yaml.safe_load((workdir / "pipeline.yaml").read_text())
    bad["vocab"]["draft_vocab_size"] = 100000
    (workdir / "bad.yaml").write_text(yaml.safe_dump(bad))
    before = manifests(workdir / "store", run_id)
    files = sorted(p for p in (workdir / "store" / run_id).rglob("*") if p.is_file() and "_run" not in p.parts)
    r = eagle3ctl(workdir, "run", "pipeline", "-c", str(workdir / "bad.yaml"), "--force", "extract")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [f"error: vocab.draft_vocab_size=100000 exceeds the target's vocab size 1024 "
                                             f"({r.stderr.split('(')[-1].strip()}"]
    assert manifests(workdir / "store", run_id) == before
    assert sorted(p for p in (workdir / "store" / run_id).rglob("*") if p.is_file() and "_run" not in p.parts) == files
    r = eagle3ctl(workdir, "verify", "-c", str(workdir / "pipeline.yaml"), "--deep")
    assert r.returncode == 0, r.stdout + r.stderr


def assert_a_draft_vocab_sweep_reuses_the_data_and_hidden_states(workdir: Path, run_id: str) -> None:
    """Another run at another draft vocab, --reuse-from the first: generate and extract are adopted
    (copied, verified), vocab and train run on them for real, and the first run still verifies."""
    sweep = yaml.safe_load((workdir / "pipeline.yaml").read_text())
    sweep["run_id"], sweep["vocab"]["draft_vocab_size"] = f"{run_id}-v128", 128
    (workdir / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    r = eagle3ctl(workdir, "run", "pipeline", "-c", str(workdir / "sweep.yaml"), "--reuse-from", run_id, "--until", "train")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("generate", "extract"):
        assert f"{name}: adopted from run {run_id} into run {run_id}-v128 (" in r.stdout
    assert f"vocab: not reused from run {run_id}: vocab.draft_vocab_size differs" in r.stdout
    state = recorded(workdir, f"{run_id}-v128")["stages"]
    assert [state[n]["state"] for n in ("generate", "vocab", "extract", "train")] == ["skipped", "done", "skipped", "done"]
    stages = [arg for name in ("generate", "vocab", "extract", "train") for arg in ("--stage", name)]
    for config, named in (("sweep.yaml", stages), ("pipeline.yaml", [])):
        r = eagle3ctl(workdir, "verify", "-c", str(workdir / config), "--deep", *named)
        assert r.returncode == 0, r.stdout + r.stderr


def stage_record(workdir: Path, run_id: str, stage: str) -> dict:
    try:
        return recorded(workdir, run_id)["stages"].get(stage, {})
    except (OSError, ValueError, KeyError):
        return {}


def progress_lines(record: dict) -> int:
    """EAGLE3_PROGRESS lines the stage's attempt has written to its log so far."""
    try:
        return Path(record["log"]).read_text(errors="replace").count("EAGLE3_PROGRESS ")
    except (KeyError, OSError):
        return 0


def test_killed_at_random_points_the_pipeline_resumes_to_completion(tmp_path, target_cache):
    seed = int(os.environ.get("EAGLE3_TEST_SEED", time.time()))
    rng = random.Random(seed)
    config = write_config(tmp_path, "llama", target_cache)
    run_id = yaml.safe_load(config.read_text())["run_id"]
    store = tmp_path / "store"
    committed: dict[str, bytes] = {}
    # One kill while each of these is running, at a random point of its progress (after 0-3 progress
    # lines, or as it ends), by SIGTERM or SIGKILL: points of the stage's own making, not of the clock.
    for stage in ["generate", rng.choice(["vocab", "extract"]), rng.choice(["train", "export", "evaluate"])]:
        proc = start_eagle3ctl(tmp_path, "run", "pipeline", "-c", str(config))
        lines = rng.randint(0, 3)

        def at_the_point() -> bool:
            rec = stage_record(tmp_path, run_id, stage)
            return rec.get("state") in ("done", "skipped", "failed") or (
                rec.get("state") == "running" and progress_lines(rec) >= lines)

        until(at_the_point, proc)
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        proc.send_signal(sig)
        out, _ = proc.communicate()
        if sig == signal.SIGTERM:  # stopped cleanly (or it had already finished)
            assert proc.returncode in (0, 130), f"seed {seed}: " + out[-3000:]
        now = manifests(store, run_id)
        for name, raw in committed.items():
            assert now[name] == raw, f"seed {seed}: committed manifest of {name} changed after killing at {stage}"
        committed = now
    r = eagle3ctl(tmp_path, "run", "pipeline", "-c", str(config))
    assert r.returncode == 0, f"seed {seed}: " + r.stdout[-3000:] + r.stderr[-3000:]
    final = manifests(store, run_id)
    assert set(final) == set(ORDER)
    for name, raw in committed.items():
        assert final[name] == raw, f"seed {seed}: committed manifest of {name} changed on resume"
    assert_every_sample_once(store, run_id)
