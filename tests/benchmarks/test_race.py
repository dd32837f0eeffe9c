"""The race (benchmarks/quality/race.py) run to the end at test size on the CPU: stopped while ours trains, run
again to the end, run a third time with nothing left to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.quality import evaluate, speculators_side

REPO = Path(__file__).resolve().parents[2]
STEPS = ("target", "ours", "spec_data", "spec_train", "spec_eval", "vllm_ours", "vllm_spec")


def race(work: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.quality.race", "--work", str(work), "--scale", "test",
            "--corpus-root", str(REPO / "eagle3")]


def run(cmd: list[str], log: Path) -> list[str]:
    """The race's own lines (``race: <step>: <state>``) of a run that must succeed."""
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    lines = log.read_text().splitlines()
    assert rc == 0, "\n".join(lines[-60:])
    return [line for line in lines if line.startswith("race: ")]


def stop_once_ours_trains(cmd: list[str], work: Path, log: Path) -> int:
    """Start the race and stop it as ``timeout`` does (SIGTERM to its process group) at the train stage's first
    checkpoint, seen in the store; the step that checkpoint belongs to. Waits for the race to end."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            checkpoints = sorted((work / "store" / "race" / "train").glob("*/checkpoints/step-*/state.json"))
            if checkpoints:
                os.killpg(proc.pid, signal.SIGTERM)
                assert proc.wait() == 130, log.read_text()[-3000:]
                return json.loads(checkpoints[0].read_text())["step"]
            time.sleep(0.2)
    raise AssertionError("the race ended before ours trained:\n" + log.read_text()[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_race_runs_to_the_end_redoes_a_step_stopped_midway_and_then_skips_every_step(tmp_path):
    work = tmp_path / "race"
    cmd = race(work)
    first_checkpoint = stop_once_ours_trains(cmd, work, tmp_path / "stopped.log")
    assert (work / "target.json").exists() and not (work / "ours.json").exists()  # stopped midway: no result
    train_done = (work / "store" / "race" / "train" / "manifest.json").exists()  # committed before SIGTERM came

    lines = run(cmd, tmp_path / "second.log")
    assert lines[:3] == ["race: target: done earlier", "race: ours: running", "race: ours: done"]
    out = json.loads((work / "race.json").read_text())
    ours = out["eagle3ctl"]
    assert ours["final_step"] == 40 and ours["steady_tokens_per_s"] > 0 and ours["peak_memory_gib"] is None
    if not train_done:  # the pipeline resumed the training from the checkpoint it wrote on SIGTERM
        assert ours["resumed_from_step"] >= first_checkpoint
    acceptance = ours["acceptance"]
    assert acceptance["prompts"] == 6 and 1.0 < acceptance["mean_acceptance_length"] <= 4.0
    assert acceptance["ci95"][0] <= acceptance["mean_acceptance_length"] <= acceptance["ci95"][1]
    assert len(ours["conditional_per_position"]) == 3
    committed = json.loads(Path(json.loads((work / "ours.json").read_text())["report"]).read_text())
    assert committed["mean_acceptance_length"] == acceptance["mean_acceptance_length"]  # the evaluate stage's report
    missing = speculators_side.speculators_missing()
    if missing is None:  # its trainer needs a GPU: on a CPU it saves its drafter untrained, decoded all the same
        spec = out["speculators"]
        assert spec["final_step"] == 0 and "--dry-run" in spec["note"] and spec["acceptance"]["prompts"] == 6
        assert out["acceptance_ratio"] == "not reported: speculators trained 0 of 40 steps"
    else:
        assert out["speculators"] == f"not run: {missing}"
        assert [out["steps"][s] for s in ("spec_data", "spec_train", "spec_eval")] == [f"not run: {missing}"] * 2 + [
            "not run: needs spec_train"]
    assert out["peak_memory_ratio"].startswith("not reported: CUDA peak memory not measured")
    why = evaluate.vllm_missing()
    assert why is not None and out["vllm"]["eagle3ctl"] == f"not measured: {why}"  # never a stand-in figure
    png = (work / "race.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1320  # 11 in at 120 dpi

    results = {s: (work / f"{s}.json").read_bytes() for s in STEPS if (work / f"{s}.json").exists()}
    lines = run(cmd, tmp_path / "third.log")
    assert [line for line in lines if "running" in line] == []
    assert {line.split(": ")[1] for line in lines if line.endswith("done earlier")} == set(results)
    assert {s: (work / f"{s}.json").read_bytes() for s in results} == results
    again = json.loads((work / "race.json").read_text())
    assert {k: v for k, v in again.items() if k != "steps"} == {k: v for k, v in out.items() if k != "steps"}
