"""The scheduler's order, concurrency, failure handling and skipping, from recorded times."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.config import load_config
from eagle3.errors import ConfigError, StoreError
from eagle3.pipeline.runstate import RunState, read_state
from eagle3.pipeline.scheduler import Scheduler, Selection
from eagle3.stages import ORDER, STAGES
from eagle3.store import open_store
from tests.pipeline.fakes import FakeBackend

DURATIONS = {"generate": 0.1, "vocab": 0.4, "extract": 0.2, "train": 0.1, "export": 0.05, "evaluate": 0.05}


def setup(tmp_path: Path, **cfg_over):
    cfg = load_config(None, {"store.uri": f"file://{tmp_path / 'store'}", "run_id": "t1", **cfg_over})
    store = open_store(cfg.store.uri)
    return cfg, store


def run(cfg, store, tmp_path, selection=None, **kw):
    backend = FakeBackend(cfg, store, durations=dict(DURATIONS), **kw)
    state = RunState(store, cfg.run_id, tmp_path / "state")
    result = Scheduler(cfg, backend, store, selection, state=state, poll_interval=0.01).run()
    return backend, result, state


def test_runs_in_dag_order_with_vocab_overlapping_extract(tmp_path):
    cfg, store = setup(tmp_path)
    b, result, state = run(cfg, store, tmp_path, ends_after_start_of={"vocab": "extract"})
    assert result.ok, result.failures
    assert sorted(b.submitted) == sorted(ORDER)
    for name in ORDER:
        for up in STAGES[name].needs:
            assert b.runs[up].end <= b.runs[name].start, f"{name} started before {up} ended"
    vocab, extract = b.runs["vocab"], b.runs["extract"]
    assert vocab.start < extract.end and extract.start < vocab.end, "vocab should run while extract does"
    # Serve: started once, for generate only, confirmed stopped before the first GPU stage.
    (serve,) = b.serve_runs
    assert serve.end is not None and serve.end <= extract.start
    assert serve.end >= b.runs["generate"].end
    assert b.endpoints["generate"] == "http://fake:8000/v1"
    # GPU stages never overlap each other.
    gpu = sorted((b.runs[n].start, b.runs[n].end) for n in ORDER if STAGES[n].resource == "gpu")
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(gpu, gpu[1:]))
    # The state file records the same story for other shells.
    assert {n: s["state"] for n, s in read_state(store, cfg.run_id)["stages"].items()} == {n: "done" for n in ORDER}
    assert read_state(store, cfg.run_id)["serve"]["state"] == "stopped"
    assert result.rows["train"].gpu_hours(0) > 0 and result.rows["vocab"].gpu_hours(0) is None


def test_failure_blocks_dependents_and_lets_independent_stages_finish(tmp_path):
    cfg, store = setup(tmp_path)
    b, result, _ = run(cfg, store, tmp_path, fail={"extract"})
    states = {n: r.state for n, r in result.rows.items()}
    assert states == {"generate": "done", "vocab": "done", "extract": "failed", "train": "blocked",
                      "export": "blocked", "evaluate": "blocked"}
    assert [f.stage for f in result.failures] == ["extract"]
    assert result.failures[0].log_tail[-1] == "error: simulated failure"
    assert "needs extract, which failed" in result.rows["train"].reason
    assert not result.ok


def test_rerun_of_a_complete_pipeline_skips_every_stage_saying_why(tmp_path):
    cfg, store = setup(tmp_path)
    run(cfg, store, tmp_path)
    b, result, _ = run(cfg, store, tmp_path)
    assert result.ok and b.submitted == [] and b.serve_runs == []
    for row in result.rows.values():
        assert row.state == "skipped"
        assert row.reason.startswith("complete, input key matches manifest of ")


def test_config_change_reruns_the_stage_and_its_dependents_only(tmp_path):
    cfg, store = setup(tmp_path)
    run(cfg, store, tmp_path)
    cfg2, _ = setup(tmp_path, **{"vocab.draft_vocab_size": 100})
    b, result, _ = run(cfg2, store, tmp_path)
    assert result.ok
    assert sorted(b.submitted) == ["evaluate", "export", "train", "vocab"]
    assert b.serve_runs == []


def test_force_reruns_the_stage_and_therefore_its_dependents(tmp_path):
    cfg, store = setup(tmp_path)
    run(cfg, store, tmp_path)
    b, result, _ = run(cfg, store, tmp_path, Selection(force=("extract",)))
    assert result.ok
    assert sorted(b.submitted) == ["evaluate", "export", "extract", "train"]


def test_from_and_until_bound_the_stages_run(tmp_path):
    cfg, store = setup(tmp_path)
    b, result, _ = run(cfg, store, tmp_path, Selection(until=("vocab",)))
    assert sorted(b.submitted) == ["generate", "vocab"]
    assert result.rows["train"].state == "excluded" and result.ok
    b, result, _ = run(cfg, store, tmp_path, Selection(start="extract"))
    assert sorted(b.submitted) == ["evaluate", "export", "extract", "train"]
    assert result.rows["generate"].state == "skipped" and result.ok


def test_a_stage_whose_upstream_is_outside_the_selection_and_incomplete_is_blocked(tmp_path):
    cfg, store = setup(tmp_path)
    b, result, _ = run(cfg, store, tmp_path, Selection(only=("vocab",)))
    assert b.submitted == [] and result.rows["vocab"].state == "blocked"
    assert result.rows["vocab"].reason == "needs generate, which was not selected to run and is not complete"


def test_an_external_endpoint_starts_no_server(tmp_path):
    cfg, store = setup(tmp_path, **{"serve.endpoint": "http://elsewhere:9000/v1"})
    b, result, _ = run(cfg, store, tmp_path, Selection(until=("generate",)))
    assert result.ok and b.serve_runs == []
    assert b.endpoints["generate"] == "http://elsewhere:9000/v1"


def test_interrupt_cancels_running_stages_and_stops_the_server(tmp_path):
    cfg, store = setup(tmp_path)
    b, result, state = run(cfg, store, tmp_path, interrupt_in="extract", ends_after_start_of={"vocab": "extract"})
    assert result.interrupted and not result.ok
    assert "extract" in b.cancelled and set(b.cancelled) <= {"extract", "vocab"}, "running stages are cancelled"
    assert all(s.end is not None for s in b.serve_runs)
    assert all(r.state in ("done", "stopped", "skipped") for r in result.rows.values())
    # The next run resumes and completes.
    b2, result2, _ = run(cfg, store, tmp_path)
    assert result2.ok and not (set(b2.submitted) & {n for n, r in result.rows.items() if r.state == "done"})


def test_until_repeated_selects_each_stage_and_its_upstreams():
    assert Selection(until=("vocab", "extract")).stages() == {"generate", "vocab", "extract"}
    assert Selection(until=("vocab", "train")).stages() == {"generate", "vocab", "extract", "train"}
    assert Selection(start="vocab", until=("vocab", "extract")).stages() == {"vocab"}  # extract is not after vocab


def test_bad_stage_names_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown stage 'trian'"):
        Selection(start="trian").stages()
    with pytest.raises(ConfigError, match="unknown stage 'extrct'"):
        Selection(until=("vocab", "extrct")).stages()
    with pytest.raises(ConfigError, match="--force generate"):
        Selection(start="extract", force=("generate",)).stages()


class _ServeFails(FakeBackend):
    """Test double whose server never comes up."""

    def start_serve(self) -> str:
        raise RuntimeError("transformers server exited with code 1 while starting")

    def logs(self, stage, follow=False, tail=None):
        return ["OSError: no such model"] if stage == "serve" else []


def test_a_server_that_does_not_start_fails_generate_with_its_reason(tmp_path):
    cfg, store = setup(tmp_path)
    b = _ServeFails(cfg, store, durations=dict(DURATIONS))
    result = Scheduler(cfg, b, store, poll_interval=0.01).run()
    assert result.rows["generate"].state == "failed" and b.submitted == []
    (f,) = result.failures
    assert f.reason == "the serve endpoint did not start: transformers server exited with code 1 while starting"
    assert f.log_tail == ["OSError: no such model"]
    assert all(result.rows[n].state == "blocked" for n in ORDER if n != "generate")


def _drop_from_manifest(store, run_id: str, stage: str, pattern: str) -> None:
    """Edit a committed manifest as a tamperer (or a buggy writer) would: one object entry removed."""
    import json
    from fnmatch import fnmatchcase

    key = f"{run_id}/{stage}/manifest.json"
    m = json.loads(store.get_bytes(key))
    kept = [o for o in m["objects"] if not fnmatchcase(o["key"], pattern)]
    assert len(kept) == len(m["objects"]) - 1
    store.put_bytes(key, json.dumps({**m, "objects": kept}).encode())


@pytest.mark.parametrize("stage,pattern,problem", [
    ("evaluate", "report.json", "manifest of t1/evaluate lists no object 'report.json', which the stage always writes"),
    ("extract", "shards/shard-*", "manifest of t1/extract lists 0 objects 'shards/shard-*.safetensors'; its "
                                  "index.json lists 1"),
])
def test_a_manifest_missing_a_required_object_is_incomplete_for_status_verify_and_the_scheduler(
        tmp_path, stage, pattern, problem):
    from eagle3.pipeline.status import collect_status
    from eagle3.pipeline.scheduler import descendants
    from eagle3.verify import verify_run

    cfg, store = setup(tmp_path)
    run(cfg, store, tmp_path)
    _drop_from_manifest(store, cfg.run_id, stage, pattern)
    status = {r["stage"]: r for r in collect_status(cfg, store)}
    assert (status[stage]["state"], status[stage]["reason"]) == ("incomplete", problem)
    lines: list[str] = []
    for deep in (False, True):
        assert not verify_run(cfg, [stage], deep, lines.append)
    assert lines.count(f"  {problem}") == 2
    b, result, _ = run(cfg, store, tmp_path)  # the stage reruns (and so does what hashes its manifest)
    assert result.ok and sorted(b.submitted) == sorted({stage} | descendants(stage))
    assert collect_status(cfg, store)[ORDER.index(stage)]["state"] == "complete"


class StoreFailsOnProgress(RunState):
    """The run's state record on a store that starts failing every write (its retry budget spent)
    once the scheduler records ``stage``'s first progress: the failure comes mid-stage."""

    def __init__(self, store, run_id, local_dir, stage: str) -> None:
        super().__init__(store, run_id, local_dir)
        self.stage, self.failing = stage, False

    def save(self) -> None:
        if self.failing or self.data["stages"].get(self.stage, {}).get("progress"):
            self.failing = True
            raise StoreError(f"writing {self.store.uri}/{self.key}: S3 error SlowDown (max retries reached)")
        super().save()


@pytest.mark.parametrize("stage", ["generate", "extract"])  # the server up / vocab and extract running
def test_a_store_error_mid_stage_stops_every_running_stage_and_the_server_as_ctrl_c_does(tmp_path, stage):
    cfg, store = setup(tmp_path)
    backend = FakeBackend(cfg, store, durations={**DURATIONS, stage: 600.0, "vocab": 600.0})
    state = StoreFailsOnProgress(store, cfg.run_id, tmp_path / "state", stage)
    lines: list[str] = []
    sched = Scheduler(cfg, backend, store, state=state, poll_interval=0.01, on_change=lambda s, msg: lines.append(msg))
    with pytest.raises(StoreError, match="S3 error SlowDown"):  # the error that ended the run, not a later one
        sched.run()
    running = {"generate"} if stage == "generate" else {"vocab", "extract"}
    assert set(backend.cancelled) == running and all(backend.runs[n].end for n in running)
    assert backend.serve_runs and all(s.end is not None for s in backend.serve_runs)  # the server stopped
    assert {n for n, r in sched.rows.items() if r.state == "stopped"} >= running
    assert f"{stage}: stopped (interrupted; the next run resumes it)" in lines  # said, though not recorded
