"""The stage table a human watches (rich Live on a TTY) or plain lines (CI logs)."""

from __future__ import annotations

import sys
import threading
import time
from datetime import datetime
from typing import Any, Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table

from eagle3.backend import Progress
from eagle3.pipeline.scheduler import Scheduler, ServeRow, StageRow
from eagle3.pipeline.table import Column, fit

STATE_STYLE = {"running": "bold cyan", "done": "green", "skipped": "dim green", "failed": "bold red",
               "blocked": "red", "waiting": "yellow", "stopped": "magenta", "excluded": "dim",
               "starting": "yellow", "stopping": "yellow", "external": "dim green"}


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def fmt_progress(p: Progress | None) -> str:
    """``5/20 samples (25%)``; a total the stage ran past (an estimate) is left out, never shown below done."""
    if p is None:
        return "-"
    done = f"{p.done:,.0f}" if p.done == int(p.done) else f"{p.done:,.2f}"
    if p.total and p.done <= p.total:
        return f"{done}/{p.total:,.0f} {p.unit} ({100 * p.done / p.total:.0f}%)"
    return f"{done} {p.unit}".strip()


def fmt_rate(p: Progress | None) -> str:
    if p is None or p.rate is None:
        return "-"
    return f"{p.rate:,.1f} {p.unit}/s"


COLUMNS = [Column("stage", keep=True), Column("state", keep=True), Column("elapsed", keep=True), Column("progress"),
           Column("note", fold=True), Column("throughput"), Column("GPU-h")]


def stage_cells(row: StageRow, now: float) -> list[str]:
    """One stage's cells, in COLUMNS order."""
    gh = row.gpu_hours(now)
    return [row.name, row.state, fmt_duration(row.elapsed(now)), fmt_progress(row.progress), row.reason,
            fmt_rate(row.progress), f"{gh:.3f}" if gh is not None else "-"]


def serve_cells(s: ServeRow, now: float) -> list[str]:
    """The server's cells, in COLUMNS order; its note is the reason, else the URL it serves."""
    elapsed = None if s.started_at is None else (s.ended_at or now) - s.started_at
    gh = elapsed * s.gpus / 3600 if elapsed is not None and s.gpus else None
    return ["serve", s.state, fmt_duration(elapsed), "-", s.reason or (s.url or ""), "-",
            f"{gh:.3f}" if gh is not None else "-"]


def render(sched: Scheduler, width: int = 120) -> Table:
    """The stage table at ``width`` columns: stage, state and elapsed always; the rest as room allows."""
    now = time.time()
    rows = [serve_cells(sched.serve, now)] if sched.serve.state != "idle" else []
    rows += [stage_cells(row, now) for row in sched.rows.values()]
    return fit(f"eagle3ctl run {sched.cfg.run_id}", COLUMNS, rows, width, STATE_STYLE)


class PlainView:
    """One line per state change, with a timestamp; for logs that are not a terminal."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.echo = echo
        self._lock = threading.Lock()

    def on_change(self, sched: Scheduler, message: str) -> None:
        with self._lock:
            self.echo(f"[{datetime.now().strftime('%H:%M:%S')}] {message}")

    def __enter__(self) -> PlainView:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class LiveView:
    """A rich table redrawn a few times a second; the final table stays on screen."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._live: Live | None = None
        self._sched: Scheduler | None = None

    def on_change(self, sched: Scheduler, message: str) -> None:
        self._sched = sched
        if self._live is not None:
            self._live.update(render(sched, self.console.width))

    def __enter__(self) -> LiveView:
        self._live = Live(console=self.console, refresh_per_second=2, get_renderable=self._renderable)
        self._live.__enter__()
        return self

    def _renderable(self) -> Any:
        return render(self._sched, self.console.width) if self._sched is not None else ""

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)


def make_view(echo: Callable[[str], None], tty: bool | None = None) -> PlainView | LiveView:
    if tty is None:
        tty = sys.stdout.isatty()
    return LiveView() if tty else PlainView(echo)
