"""Where a training step's time goes: torch.profiler over a few optimizer steps of the real loop.

``train.profile_steps = "A:B"`` profiles steps A..B-1 (0-based, after compiling has had
its first steps) and writes into a directory:

- ``summary.json``: wall time per step, device busy time per step (the sum of its
  kernels' and copies' durations: well below the wall means the step waits on the host —
  kernel launches, Python, the data thread, garbage collection), device events per step,
  the time the loop waited for its next batch and Python's garbage-collection pauses,
  and the top kernels and host operators;
- ``kernels.txt`` / ``host_ops.txt``: torch's tables, by device time and by host time;
- ``trace.json.gz``: the timeline for chrome://tracing or Perfetto.

Only the process that writes the stage output profiles (rank 0).
"""

from __future__ import annotations

import gc
import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

_DEVICE_TYPES = (DeviceType.CUDA, DeviceType.PrivateUse1)


def device_busy(events: Any) -> tuple[float, int]:
    """(microseconds the device ran kernels and copies, how many it ran) among profiler events."""
    busy, n = 0.0, 0
    for e in events:
        if e.device_type in _DEVICE_TYPES and not e.is_user_annotation:
            busy += e.self_device_time_total
            n += 1
    return busy, n


def _top(averages: Any, key: str, n: int, steps: int, device: bool = False) -> list[dict[str, Any]]:
    """The top ``n`` by ``key``; ``device``: device events alone (kernels, copies), not the host
    operators that launched them, which carry the same device time."""
    rows = [e for e in averages if not device or getattr(e, "device_type", None) in _DEVICE_TYPES]
    rows = sorted(rows, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"name": e.key[:120], "ms_per_step": round(getattr(e, key) / 1000 / steps, 3), "calls_per_step": round(e.count / steps, 1)}
            for e in rows if getattr(e, key) > 0]


class StepProfiler:
    """Call :meth:`before_step` with the 0-based index of the step about to run and
    :meth:`after_step` with the number of steps done; :meth:`add_wait` adds time the loop
    waited for a batch. Steps [A, B) are profiled — from the first step run inside them, when
    a resumed run starts there. Inactive (every call a no-op) without a range."""

    def __init__(self, steps: tuple[int, int] | None, device: torch.device, out_dir: Path) -> None:
        self.range = steps
        self.device, self.out_dir = device, out_dir
        self.summary: dict[str, Any] | None = None
        self._prof: Any = None
        self._t0 = 0.0
        self._start = 0
        self._wait = 0.0
        self._gc_ms = 0.0
        self._gc_start = 0.0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc_ms += 1000 * (time.perf_counter() - self._gc_start)

    def before_step(self, step: int) -> None:
        if self.range is None or self.summary is not None or self._prof is not None or not self.range[0] <= step < self.range[1]:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        gc.callbacks.append(self._gc_callback)
        self._wait, self._gc_ms, self._start = 0.0, 0.0, step
        self._t0 = time.perf_counter()

    def add_wait(self, seconds: float) -> None:
        if self._prof is not None:
            self._wait += seconds

    def after_step(self, steps_done: int) -> None:
        if self._prof is None or self.range is None or steps_done < self.range[1]:
            return
        self.finish(steps_done)

    def finish(self, steps_done: int) -> None:
        """Stop and write (also when the loop ends inside the profiled range)."""
        if self._prof is None or self.range is None:
            return
        self._sync()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        gc.callbacks.remove(self._gc_callback)
        steps = max(1, steps_done - self._start)
        busy_us, device_events = device_busy(prof.events())
        averages = prof.key_averages()
        cuda = self.device.type == "cuda"
        self.summary = {
            "steps": [self._start, self._start + steps],
            "wall_ms_per_step": round(1000 * wall / steps, 2),
            "device_busy_ms_per_step": round(busy_us / 1000 / steps, 2) if cuda else None,
            "device_busy_frac": round(busy_us / 1e6 / wall, 3) if cuda else None,
            "device_events_per_step": round(device_events / steps, 1) if cuda else None,
            "data_wait_ms_per_step": round(1000 * self._wait / steps, 2),
            "gc_ms_per_step": round(self._gc_ms / steps, 2),
            "top_kernels": _top(averages, "self_device_time_total", 15, steps, device=True) if cuda else [],
            "top_host_ops": _top(averages, "self_cpu_time_total", 15, steps),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        if cuda:
            (self.out_dir / "kernels.txt").write_text(
                averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=80) + "\n")
        (self.out_dir / "host_ops.txt").write_text(
            averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80) + "\n")
        raw = self.out_dir / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(self.out_dir / "trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()

    def files(self) -> list[Path]:
        if self.summary is None:
            return []
        return sorted(p for p in self.out_dir.iterdir() if p.is_file())
