"""Kill the tiny pipeline again and again, in every stage, then check nothing was lost or doubled.

One uninterrupted generation is the reference. A run is killed at each point of ``KILLS`` in
turn (SIGKILL or SIGINT to ``eagle3ctl``, or SIGKILL to a stage's process group), each
attempt resuming the last; the final attempt runs to the end. Then: ``verify --deep``
passes, every sample id is there once, the samples and answers are the reference's, no
committed manifest changed after its commit, and no process of the run is left running.

Every kill point is an event of the pipeline's own: the stage's state in the run's record,
and the objects its attempt has journaled in the store. No trial waits for a length of time
or races a deadline, so a loaded machine makes the test slower, never red; pytest-timeout's
limit (``HANG_GUARD_S``) is only there for a hang.

Set ``EAGLE3_RELIABILITY_REPORT=DIR`` to keep the figures (docs/reliability.md quotes them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3.generate.tokenized import read_tokenized
from eagle3.extract.shards import read_shard
from eagle3.stages import ORDER
from eagle3.store.local import LocalStore
from tests.committed import path_of
from tests.reliability import tiny_run
from tests.waiting import HANG_GUARD_S, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(HANG_GUARD_S)]


@dataclass(frozen=True)
class Kill:
    stage: str  # where the kill is meant to land
    after: int  # ...once this many of the stage's objects were journaled in this attempt (0: once it runs)
    signal: int
    target: str  # "cli": eagle3ctl alone (its children live on); "stage": the stage's process group

    def __str__(self) -> str:
        return f"{self.stage}+{self.after} {signal.Signals(self.signal).name} {self.target}"


KILLS = [
    Kill("serve", 0, signal.SIGKILL, "cli"),
    Kill("generate", 1, signal.SIGINT, "cli"),
    Kill("generate", 1, signal.SIGKILL, "cli"),
    Kill("generate", 1, signal.SIGKILL, "stage"),
    Kill("vocab", 0, signal.SIGKILL, "cli"),
    Kill("extract", 1, signal.SIGINT, "cli"),
    Kill("extract", 1, signal.SIGKILL, "stage"),
    Kill("train", 1, signal.SIGKILL, "cli"),
    Kill("train", 1, signal.SIGINT, "cli"),
    Kill("train", 0, signal.SIGKILL, "stage"),
    Kill("export", 0, signal.SIGKILL, "cli"),
    Kill("evaluate", 1, signal.SIGINT, "cli"),
    Kill("evaluate", 1, signal.SIGKILL, "cli"),
    Kill("evaluate", 0, signal.SIGKILL, "stage"),
]


def write_config(workdir: Path, cache: Path) -> Path:
    return tiny_run.write_config(workdir, "rel", f"file://{workdir / 'store'}", cache, steps=24, prompts=8)


def _sigint_as_at_a_terminal() -> None:
    """Give the CLI the default SIGINT disposition, as a shell in a terminal does.

    A test run started in the background (``.ci/run &``, nohup) inherits SIGINT ignored, and
    Python keeps an inherited SIG_IGN: the Ctrl-C trials would then watch the pipeline run to
    the end instead of testing what Ctrl-C does.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Pipeline:
    """``eagle3ctl run pipeline`` in a working directory, and what its store says."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config, self.store = workdir, config, workdir / "store"
        self.run = workdir / "store" / "rel"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}

    def start(self, log: Path) -> subprocess.Popen:
        out = open(log, "wb")
        return subprocess.Popen([sys.executable, "-m", "eagle3.cli.app", "run", "pipeline", "-c", str(self.config)],
                                cwd=self.workdir, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_sigint_as_at_a_terminal)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "eagle3.cli.app", *args, "-c", str(self.config)],
                              cwd=self.workdir, env=self.env, capture_output=True, text=True)

    def state(self) -> dict:
        try:
            return json.loads((self.run / "_run/state.json").read_text())
        except (OSError, ValueError):
            return {}

    def journaled(self, stage: str) -> int:
        return sum(1 for _ in (self.run / stage).glob("attempt-*/_journal/**/*.json"))

    def manifests(self) -> dict[str, bytes]:
        return {n: (self.run / n / "manifest.json").read_bytes() for n in ORDER if (self.run / n / "manifest.json").exists()}


def _running(state: dict, proc: subprocess.Popen, stage: str) -> bool:
    if state.get("scheduler_pid") != proc.pid:
        return False  # the record of an earlier attempt
    if stage == "serve":
        return state.get("serve", {}).get("state") == "starting" and bool(state.get("serve", {}).get("pid"))
    return state.get("stages", {}).get(stage, {}).get("state") == "running"


def _running_now(state: dict, proc: subprocess.Popen) -> list[str]:
    if state.get("scheduler_pid") != proc.pid:
        return []
    return [n for n, s in state.get("stages", {}).items() if s.get("state") == "running"]


def _signal(p: Pipeline, proc: subprocess.Popen, kill: Kill) -> bool:
    """Send ``kill``; False when its stage's process was already gone (it ended just then)."""
    if kill.target == "cli":
        proc.send_signal(kill.signal)
        return True
    state = p.state()
    pid = state["serve"]["pid"] if kill.stage == "serve" else state["stages"][kill.stage]["pid"]
    try:
        os.killpg(pid, kill.signal)
    except ProcessLookupError:
        return False
    return True


def _aim(p: Pipeline, proc: subprocess.Popen, kill: Kill, seen: dict) -> tuple[Kill, str] | None:
    """Where ``kill`` lands now, judged from the run's record and the store; None: not yet.

    The planned stage may run out under the trial (it commits before enough of it was
    journaled) or have been committed by an earlier attempt: then the kill lands in whatever
    stage of this attempt runs now (or, for the CLI, between stages), so every trial hits a
    live pipeline instead of waiting for it to finish."""
    state = p.state()
    if _running(state, proc, kill.stage):
        if "base" not in seen:  # the stage's journal when this attempt was first seen running it
            seen["base"] = p.journaled(kill.stage)
        if p.journaled(kill.stage) - seen["base"] >= kill.after:
            return kill, kill.stage
        return None
    if "base" not in seen and (kill.stage == "serve" or not (p.run / kill.stage / "manifest.json").exists()):
        return None  # the planned stage is still ahead
    running = _running_now(state, proc)
    if running:
        return Kill(running[0], kill.after, kill.signal, kill.target), f"after {kill.stage} ({running[0]} running)"
    if "base" in seen and kill.target == "cli" and state.get("scheduler_pid") == proc.pid:
        return kill, f"after {kill.stage}"  # between stages: the scheduler alone is hit
    return None


def kill_at(p: Pipeline, kill: Kill, log: Path) -> dict:
    """Start an attempt, kill it where ``kill`` says (see ``_aim``); what happened."""
    planned = str(kill)
    proc = p.start(log)
    seen: dict = {}
    landed: list[tuple[Kill, str]] = []

    def hit() -> bool:
        aim = _aim(p, proc, kill, seen)
        if aim is not None and _signal(p, proc, aim[0]):
            landed.append(aim)
        return bool(landed)

    try:
        if not until(hit, proc):
            return {"kill": planned, "landed": None, "rc": proc.returncode}  # the attempt ended first
        rc = proc.wait()  # however long stopping its stages takes
    finally:
        if proc.poll() is None:  # a failure above, or the hang guard: stop the whole attempt
            os.killpg(proc.pid, signal.SIGKILL)
    kill, where = landed[0]
    if kill.target == "cli" and kill.signal == signal.SIGINT:
        # Ctrl-C stops the attempt with 130 (stages stopped, nothing committed half-way);
        # 0 would mean it was ignored and the pipeline ran on to the end under the trial.
        assert rc == 130, f"{kill}: Ctrl-C ended with {rc}; log {log}"
    return {"kill": planned, "landed": where, "rc": rc}


def sample_ids(p: Pipeline) -> tuple[list[int], list[int], list[int], dict[int, str]]:
    """Ids in generate's raw responses, its tokenized samples, and extract's shards (if extracted);
    raw texts by id."""
    store = LocalStore(p.store)
    raw = [json.loads(ln) for ln in path_of(store, "rel", "generate", "raw_responses.jsonl").read_text().splitlines()]
    tok = read_tokenized(path_of(store, "rel", "generate", "tokenized.safetensors"))
    shards = []
    extracted = (p.run / "extract" / "manifest.json").exists()
    for shard in sorted(path_of(store, "rel", "extract", "shards").glob("shard-*.safetensors")) if extracted else []:
        shards += [int(i) for i in read_shard(shard).sample_ids]
    texts = {r["id"]: json.dumps(r.get("messages") or r.get("response") or r, sort_keys=True) for r in raw}
    return [r["id"] for r in raw], [int(i) for i in tok.sample_ids], shards, texts


def processes_of(workdir: Path) -> list[str]:
    """Live processes started for this run: their environment carries its tag, or their command line the workdir."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (f"@file://{workdir / 'store'}".encode() in env or str(workdir) in cmd):
            found.append(f"{d.name}: {cmd[:200]}")
    return found


def test_killed_at_a_dozen_points_the_pipeline_loses_and_doubles_nothing(tmp_path: Path, tiny_cache_dir: Path) -> None:
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "killed"
    ref_dir.mkdir(), run_dir.mkdir()
    ref = Pipeline(ref_dir, write_config(ref_dir, tiny_cache_dir))
    r = ref.cli("run", "pipeline", "--until", "generate")  # what a killed generation must reproduce
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ref_raw, ref_tok, _, ref_texts = sample_ids(ref)

    p = Pipeline(run_dir, write_config(run_dir, tiny_cache_dir))
    trials, committed = [], {}
    for i, kill in enumerate(KILLS):
        trial = kill_at(p, kill, run_dir / f"attempt-{i:02d}.log")
        trials.append(trial)
        now = p.manifests()
        for name, raw in committed.items():
            assert now.get(name) == raw, f"after {kill}: the committed manifest of {name} changed"
        committed = now
    r = p.cli("run", "pipeline")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    final = p.manifests()
    assert set(final) == set(ORDER)
    for name, raw in committed.items():
        assert final[name] == raw, f"the committed manifest of {name} changed on the final resume"

    v = p.cli("verify", "--deep")
    assert v.returncode == 0, v.stdout + v.stderr
    raw, tok, shards, texts = sample_ids(p)
    lost = sorted(set(ref_tok) - set(tok))
    duplicated = len(raw) - len(set(raw)) + len(tok) - len(set(tok)) + len(shards) - len(set(shards))
    assert duplicated == 0, "a sample appears twice"
    assert sorted(raw) == sorted(ref_raw) and sorted(tok) == sorted(ref_tok) and not lost
    assert sorted(shards) == sorted(tok), "every tokenized sample is extracted exactly once"
    assert texts == ref_texts, "a resumed generation answered differently from the uninterrupted one"
    # every eagle3ctl has exited, and stops what it started before it exits (zombies are not counted)
    assert processes_of(run_dir) == [] and processes_of(ref_dir) == [], "a process of the run is still alive"

    landed = [t for t in trials if t["landed"]]
    assert len(landed) >= 12, trials
    in_stage = {t["landed"] for t in landed}
    assert len(in_stage & {"generate", "extract", "train", "export", "evaluate"}) >= 4, trials
    report = {"trials": len(trials), "kills_landed": len(landed), "survived": len(landed), "lost": len(lost),
              "duplicated": duplicated, "samples": len(tok), "trials_detail": trials}
    out = os.environ.get("EAGLE3_RELIABILITY_REPORT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kill_resume.json").write_text(json.dumps(report, indent=2) + "\n")
