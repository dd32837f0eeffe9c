"""The live stage table and the plain-line view, rendered from a real scheduler run (test double backend)."""

from __future__ import annotations

from rich.console import Console

from eagle3.config import load_config
from eagle3.pipeline.backend import Progress
from eagle3.pipeline.live import PlainView, fmt_progress, fmt_rate, render
from eagle3.pipeline.scheduler import Scheduler
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
    console.print(render(sched))
    text = console.export_text()
    for col in ("stage", "state", "progress", "elapsed", "throughput", "GPU-h"):
        assert col in text
    assert "serve" in text and "stopped" in text
    assert any(ln.endswith("generate: running") for ln in lines)
    assert any(ln.endswith("serve: stopped") for ln in lines)
    assert sum("done" in ln for ln in lines) == 6


def test_progress_cells():
    assert fmt_progress(Progress(5, 20, "samples")) == "5/20 samples (25%)"
    assert fmt_progress(None) == "-"
    assert fmt_rate(Progress(5, 20, "tok", rate=1234.5)) == "1,234.5 tok/s"
