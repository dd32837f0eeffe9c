"""``eagle3ctl run``: check everything that can be checked, then run the scheduler.

Config errors, unknown stage names, missing store credentials and an unusable backend
are reported before anything starts. SIGTERM is handled like Ctrl-C: every child is
stopped cleanly and the next run resumes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.pipeline.backend import Backend
from eagle3.pipeline.live import LiveView, make_view
from eagle3.pipeline.runstate import RunState, pid_alive, run_dir
from eagle3.pipeline.scheduler import RunResult, Scheduler, Selection


def open_backend(cfg: PipelineConfig, state: RunState) -> Backend:
    """The backend named by the config (``--backend`` overrides it)."""
    if cfg.backend == "local":
        from eagle3.pipeline.local import LocalBackend

        return LocalBackend(cfg, state)
    try:
        from eagle3.k8s.backend import KubernetesBackend
    except ImportError as e:
        raise ConfigError(f"backend 'kubernetes' is not available: cannot import eagle3.k8s.backend ({e})") from None
    return KubernetesBackend(cfg, state)  # type: ignore[call-arg]


def preflight(cfg: PipelineConfig, selection: Selection) -> None:
    """Everything that can fail before a process starts: stage names, store access, serve engine."""
    selection.stages()
    open_run_store(cfg)  # s3://: raises StoreError naming missing credentials or bucket
    if cfg.backend == "local" and cfg.serve.engine == "vllm" and not cfg.serve.endpoint:
        from eagle3.serve.vllm import vllm_installed

        if not vllm_installed():
            raise ConfigError("serve.engine is 'vllm' but vLLM is not installed here; use engine: auto or transformers")
    if cfg.backend == "local":
        _check_local_inputs(cfg, selection)


def _check_local_inputs(cfg: PipelineConfig, selection: Selection) -> None:
    """Prompt files named by local path must exist, where the stage reading them is still to run."""
    from pathlib import Path

    from eagle3.context import stage_input_key
    from eagle3.manifest import verify_stage
    from eagle3.stages import STAGES

    store = open_run_store(cfg)
    selected = selection.stages()
    for stage, field, value in (("generate", "generate.prompts", cfg.generate.prompts),
                                ("evaluate", "evaluate.prompts", cfg.evaluate.prompts)):
        if value is None or value.startswith(("builtin:", "s3://")) or stage not in selected:
            continue
        if Path(value).expanduser().exists():
            continue
        if stage == "generate" and stage not in selection.force:
            key = stage_input_key(cfg, STAGES[stage], {})
            if verify_stage(store, cfg.run_id, stage, input_key=key).complete:
                continue
        raise ConfigError(f"{field}: file not found: {value}")


def claim_run(cfg: PipelineConfig, backend: Backend, state: RunState, echo: Callable[[str], None]) -> None:
    """Refuse a second scheduler for the same run; stop processes an earlier, killed one left behind
    (stages run in their own process groups, so they outlive a SIGKILLed scheduler)."""
    previous = state.data.get("scheduler_pid")
    if previous and previous != os.getpid() and pid_alive(previous) and not state.data.get("finished", True):
        raise ConfigError(f"run {cfg.run_id} is already running (eagle3ctl pid {previous}); "
                          f"wait for it or stop it with `eagle3ctl down`")
    if cfg.backend == "local":
        for what in backend.down():
            echo(f"stopped {what}, left running by an earlier attempt")
    state.data["stages"], state.data["serve"] = {}, {}
    from eagle3.serve.process import proc_cmdline

    state.set(run_id=cfg.run_id, backend=cfg.backend, scheduler_pid=os.getpid(),
              scheduler_cmd=proc_cmdline(os.getpid()), started_at=time.time(),
              finished=False, ended_at=None, outcome=None)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`eagle3ctl down`, a CI timeout) and SIGHUP (terminal closed) stop the run like Ctrl-C."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@dataclass
class PipelineRun:
    cfg: PipelineConfig
    result: RunResult
    state: RunState
    log_dir: str
    tty: bool = False


def run_pipeline(cfg: PipelineConfig, selection: Selection, echo: Callable[[str], None],
                 tty: bool | None = None, poll_interval: float = 0.5) -> PipelineRun:
    preflight(cfg, selection)
    store = open_run_store(cfg)
    state = RunState(run_dir(cfg.run_id))
    backend = open_backend(cfg, state)
    claim_run(cfg, backend, state, echo)
    view = make_view(echo, tty)
    sched = Scheduler(cfg, backend, store, selection, state=state, on_change=view.on_change,
                      poll_interval=poll_interval)
    try:
        with sigterm_as_interrupt(), view:
            result = sched.run()
    except Eagle3Error:
        state.set(finished=True, ended_at=time.time(), outcome="error")
        raise
    outcome = "interrupted" if result.interrupted else ("ok" if result.ok else "failed")
    state.set(finished=True, ended_at=time.time(), outcome=outcome)
    return PipelineRun(cfg, result, state, str(state.dir / "logs"), tty=isinstance(view, LiveView))


def summary_lines(run: PipelineRun) -> list[str]:
    """What the user reads last: why stages were skipped, the one reason for a failure, where things are."""
    from eagle3.pipeline.report import build_report, drafter_location

    r, lines = run.result, []
    for row in r.rows.values():
        if row.state == "skipped" and run.tty:  # plain output already said it, line by line
            lines.append(f"{row.name}: skipped ({row.reason})")
    if r.interrupted:
        lines.append("interrupted: every stage and the server were stopped; rerun the same command to resume")
        return lines
    for f in r.failures:
        lines.append(f"stage {f.stage} failed: {f.reason}")
        if f.log_tail:
            lines.append(f"last log lines of {f.stage}:")
            lines += [f"  | {ln}" for ln in f.log_tail[-10:]]
    blocked = [row for row in r.rows.values() if row.state == "blocked"]
    if blocked:
        lines.append(f"not run because an upstream stage failed or is missing: {', '.join(b.name for b in blocked)}")
        lines += [f"  {b.name}: {b.reason}" for b in blocked]
    if r.ok:
        if r.rows["export"].state in ("done", "skipped"):
            lines.append(f"drafter: {drafter_location(run.cfg)}")
        lines.append(f"report: {build_report(run.cfg)}")
    return lines
