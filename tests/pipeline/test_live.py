"""The live stage table and the plain-line view, rendered from a real scheduler (test double backend), and
the status table: both at 80 and 120 columns."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from eagle3.config import load_config
from eagle3.backend import Progress
from eagle3.pipeline.live import PlainView, fmt_progress, fmt_rate, render
from eagle3.pipeline.scheduler import Scheduler
from eagle3.pipeline.status import status_table
from eagle3.store import open_store
from tests.pipeline.fakes import FakeBackend


def test_table_and_plain_lines_after_a_run(tmp_path):
    cfg = load_config(None, {"store.uri": f"file://{tmp_path}/s", "run_id": "live"})
    store = open_store(cfg.store.uri)
    lines: list[str] = []
    view = PlainView(lines.append)
    sched = Scheduler(cfg, FakeBackend(cfg, store), store, on_change=view.on_change, poll_interval=0.01)
    assert sched.run().ok
    console = Console(width=160, record=True)
    console.print(render(sched, 160))
    text = console.export_text()
    for col in ("stage", "state", "progress", "elapsed", "GPU-h", "note"):
        assert col in text
    assert "throughput" not in text, "no stage reported a rate: the empty column is left out"
    assert "serve" in text and "stopped" in text
    assert any(ln.endswith("generate: running") for ln in lines)
    assert any(ln.endswith("serve: stopped") for ln in lines)
    assert sum("done" in ln for ln in lines) == 6


def test_progress_cells():
    assert fmt_progress(Progress(5, 20, "samples")) == "5/20 samples (25%)"
    assert fmt_progress(Progress(120, 100, "steps")) == "120 steps", "a total the stage ran past is not shown"
    assert fmt_progress(None) == "-"
    assert fmt_rate(Progress(5, 20, "tok", rate=1234.5)) == "1,234.5 tok/s"


def _running_scheduler(tmp_path, gpus: int = 8) -> Scheduler:
    """A scheduler mid-run as the live view sees it: the server up, generate running with a rate,
    train past its estimated total, a stage waiting with a long reason."""
    cfg = load_config(None, {"store.uri": f"file://{tmp_path}/s", "run_id": "live"})
    store = open_store(cfg.store.uri)
    backend = FakeBackend(cfg, store)
    backend.gpu_count = lambda: gpus  # type: ignore[method-assign]
    sched = Scheduler(cfg, backend, store)
    now = time.time()
    sched.serve.state, sched.serve.url, sched.serve.started_at = "running", "http://127.0.0.1:40123/v1", now - 75
    rows = sched.rows
    rows["generate"].state, rows["generate"].started_at = "running", now - 61
    rows["generate"].progress = Progress(1234, 5000, "samples", rate=12.5)
    rows["train"].state, rows["train"].started_at, rows["train"].gpus = "running", now - 3700, gpus
    rows["train"].progress = Progress(120, 100, "steps", rate=1.5)
    rows["extract"].state, rows["extract"].reason = "waiting", "waiting for the GPUs (held by serve)"
    rows["evaluate"].state, rows["evaluate"].reason = "blocked", "needs export, which failed"
    return sched


def rendered(table, width: int) -> tuple[str, list[str], str]:
    """The table as a terminal of ``width`` columns shows it: text, lines, header line. Nothing is wider,
    nothing is cut with an ellipsis, and stage, state and elapsed head it."""
    console = Console(width=width, record=True)
    console.print(table)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(ln.rstrip()) for ln in lines) <= width
    assert "…" not in text, "nothing is cut with an ellipsis"
    header = next(ln for ln in lines if ln.startswith("┃"))
    assert all(col in header for col in ("stage", "state", "elapsed")), header
    return text, lines, header


def assert_rows(lines: list[str], expected: list[tuple[str, str, str]]) -> None:
    """Each (stage, state, elapsed) whole on its stage's row."""
    for stage, state, elapsed in expected:
        row = next(ln for ln in lines if f" {stage} " in ln)
        assert f" {state} " in row and f" {elapsed} " in row, row


@pytest.mark.parametrize("width", [80, 120])
def test_the_live_table_keeps_stage_state_and_elapsed_at_any_width(tmp_path, width):
    text, lines, header = rendered(render(_running_scheduler(tmp_path), width), width)
    assert_rows(lines, [("serve", "running", "1:15"), ("generate", "running", "1:01"),
                        ("train", "running", "1:01:40"), ("extract", "waiting", "-")])
    assert "120/100" not in text, "done is never shown above total"
    if width == 120:
        for col in ("progress", "note", "throughput"):
            assert col in header
        assert "http://127.0.0.1:40123/v1" in text and "1,234/5,000 samples (25%)" in text and "12.5 samples/s" in text
    else:
        assert "progress" in header and "1,234/5,000 samples (25%)" in text


def column_text(lines: list[str], name: str) -> str:
    """The text of one column of a rendered table, its folded lines joined again."""
    header = next(ln for ln in lines if ln.startswith("┃"))
    bars = [i for i, ch in enumerate(header) if ch == "┃"]
    at = next(k for k in range(len(bars) - 1) if header[bars[k] + 1:bars[k + 1]].strip() == name)
    body = [ln for ln in lines if ln.startswith("│")]
    return "".join(ln[bars[at] + 1:bars[at + 1]].strip() for ln in body)


def _summary(tmp_path) -> dict:
    long_reason = f"corrupted object file://{tmp_path}/store/r/extract/attempt-1/shards/shard-00003.safetensors: sha256 differs"
    stages = [
        {"stage": "generate", "state": "complete", "finished_at": "2026-01-02T03:04:05.1+00:00", "duration_s": 68.8,
         "stats": {"samples": 24, "tokens": 1609}},
        {"stage": "vocab", "state": "complete", "finished_at": "2026-01-02T03:05:05+00:00", "duration_s": 3.9,
         "stats": {"coverage": 0.98765}},
        {"stage": "extract", "state": "incomplete", "reason": long_reason, "finished_at": "2026-01-02T03:06:05+00:00",
         "duration_s": 7.4, "stats": {"samples": 24, "tokens": 1609, "shards": 1}},
        {"stage": "train", "state": "running", "reason": "", "elapsed_s": 3725.0,
         "progress": {"done": 120, "total": 100, "unit": "steps"}},
        {"stage": "export", "state": "not run", "reason": "waits for train"},
        {"stage": "evaluate", "state": "not run", "reason": "waits for export, generate"},
    ]
    return {"run_id": "r", "store": f"file://{tmp_path}/store", "in_progress": True, "stages": stages}


@pytest.mark.parametrize("width", [80, 120])
def test_status_keeps_stage_state_and_elapsed_at_any_width(tmp_path, width):
    text, lines, header = rendered(status_table(_summary(tmp_path), width), width)
    assert "note" in header
    assert_rows(lines, [("generate", "complete", "1:08"), ("extract", "incomplete", "0:07"),
                        ("train", "running", "1:02:05"), ("export", "not run", "-")])
    assert "120 steps" in text and "120/100" not in text
    assert "shard-00003.safetensors:sha256differs" in column_text(lines, "note").replace(" ", ""), "folded, not cut"
    if width == 120:
        assert "stats" in header and "coverage=0.9877" in text


@pytest.mark.parametrize("gpus", [0, 8])
def test_waiting_for_the_gpus_is_said_only_where_there_are_gpus(tmp_path, gpus):
    cfg = load_config(None, {"store.uri": f"file://{tmp_path}/s", "run_id": "cpu"})
    store = open_store(cfg.store.uri)
    backend = FakeBackend(cfg, store, durations={"generate": 0.3, "extract": 0.3})
    backend.gpu_count = lambda: gpus  # type: ignore[method-assign]
    lines: list[str] = []
    assert Scheduler(cfg, backend, store, on_change=PlainView(lines.append).on_change, poll_interval=0.01).run().ok
    waits = [ln.split("] ", 1)[1] for ln in lines if "extract: waiting (waiting" in ln]
    if gpus:
        assert waits and all("waiting for the GPUs (held by " in w for w in waits), waits
    else:
        assert waits and all("GPU" not in w for w in waits), waits
        assert "extract: waiting (waiting for serve to stop)" in waits
