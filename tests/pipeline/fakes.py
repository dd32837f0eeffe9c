"""Test doubles for the scheduler: a backend that simulates stages and commits real manifests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from eagle3.config import PipelineConfig
from eagle3.contract import stage_input_key, upstream_digests
from eagle3.manifest import StageOutput
from eagle3.backend import Backend, Progress, StageHandle, StageOutcome
from eagle3.stages import STAGES, stage_config
from eagle3.store import ObjectStore
from tests.committed import put_required


WAIT_FOR_OTHER_S = 120.0  # only a scheduler that never starts the other stage waits this long


@dataclass
class Interval:
    start: float
    end: float | None = None


@dataclass
class FakeBackend(Backend):
    """Test double: each stage 'runs' for a set duration, then commits a one-object manifest
    with the input key the real stage would compute (or fails, if told to)."""

    cfg: PipelineConfig
    store: ObjectStore
    durations: dict[str, float] = field(default_factory=dict)
    fail: set[str] = field(default_factory=set)
    serve_startup: float = 0.05
    interrupt_in: str | None = None  # raise KeyboardInterrupt (Ctrl-C) from the first poll of this stage
    # stage -> another stage that must have started before it ends: concurrency shown by events, not by
    # durations a loaded machine may stretch (an upper bound on the wait keeps a wrong scheduler from hanging)
    ends_after_start_of: dict[str, str] = field(default_factory=dict)
    name: str = "fake"
    runs: dict[str, Interval] = field(default_factory=dict)
    serve_runs: list[Interval] = field(default_factory=list)
    submitted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    endpoints: dict[str, str | None] = field(default_factory=dict)
    t0: float = field(default_factory=time.time)

    def start_serve(self) -> str:
        self.serve_runs.append(Interval(time.time()))
        time.sleep(self.serve_startup)
        return "http://fake:8000/v1"

    def stop_serve(self) -> None:
        time.sleep(0.02)
        self.serve_runs[-1].end = time.time()

    def submit(self, stage: str, endpoint: str | None = None, input_key: str | None = None,
               force: bool = False) -> StageHandle:
        self.submitted.append(stage)
        self.endpoints[stage] = endpoint
        self.runs[stage] = Interval(time.time())
        return StageHandle(stage, ref=f"fake-{stage}", started_at=self.runs[stage].start)

    def poll(self, handle: StageHandle) -> StageOutcome | None:
        if handle.stage == self.interrupt_in:
            raise KeyboardInterrupt
        run = self.runs[handle.stage]
        if time.time() - run.start < self.durations.get(handle.stage, 0.05):
            return None
        other = self.ends_after_start_of.get(handle.stage)
        if other is not None and other not in self.runs and time.time() - run.start < WAIT_FOR_OTHER_S:
            return None
        run.end = time.time()
        if handle.stage in self.fail:
            return StageOutcome(handle.stage, False, "exit code 1: simulated failure", ["line 1", "error: simulated failure"])
        spec = STAGES[handle.stage]
        upstream = upstream_digests(self.cfg, spec, self.store)
        out = StageOutput(self.store, self.cfg.run_id, handle.stage, stage_input_key(self.cfg, spec, upstream, self.store),
                          {k: v.digest for k, v in upstream.items()}, config=stage_config(self.cfg, spec, self.store))
        out.begin()
        out.put_bytes("out.txt", f"{handle.stage}\n".encode())
        put_required(out, handle.stage)
        out.commit({"samples": 1})
        return StageOutcome(handle.stage, True)

    def progress(self, handle: StageHandle) -> Progress | None:
        return Progress(done=time.time() - self.runs[handle.stage].start, total=None, unit="s")

    def cancel(self, handle: StageHandle) -> None:
        self.cancelled.append(handle.stage)
        self.runs[handle.stage].end = time.time()

    def logs(self, stage: str, follow: bool = False, tail: int | None = None) -> list[str]:
        return []

    def down(self) -> list[str]:
        return []

    def gpu_count(self) -> int:
        return 8
