"""``eagle3ctl run``: hold the run, check everything that can be checked, then run the scheduler.

The run is held through its lease in the store (``eagle3.pipeline.lease``): a second
``eagle3ctl`` on any machine is refused while the first lives, and takes over when it is
gone, stopping what it left running. Config errors, unknown stage names, missing store
credentials, an unusable backend and settings that a stage to run would fail on (the whole
DAG's preflight) are reported before anything starts. SIGTERM is handled like Ctrl-C:
every child is stopped cleanly and the next run resumes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from eagle3.backend import Backend
from eagle3.config import PipelineConfig
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.inputs import FILE_FIELDS, local_file, record_digests
from eagle3.pipeline.lease import Lease, hostname
from eagle3.pipeline.live import LiveView, make_view
from eagle3.pipeline.preflight import check_run, stages_to_run
from eagle3.pipeline.runstate import RunState, run_dir
from eagle3.pipeline.scheduler import RunResult, Scheduler, Selection
from eagle3.runs import RUN_CONFIG, open_run_store
from eagle3.signals import sigterm_as_interrupt
from eagle3.store import ObjectStore

def check_engine(cfg: PipelineConfig) -> None:
    """A serve engine that cannot start here, or images nobody built, are config errors before anything starts."""
    if cfg.backend == "local" and cfg.serve.engine == "vllm" and not cfg.serve.endpoint:
        from eagle3.serve.vllm import vllm_installed

        if not vllm_installed():
            raise ConfigError("serve.engine is 'vllm' but vLLM is not installed here; use engine: auto or transformers")
    if cfg.backend == "kubernetes":
        from eagle3.settings.kubernetes import IMAGE_FIELDS, PLACEHOLDER_REGISTRY

        used = [f for f in IMAGE_FIELDS if f != "serve_image" or not cfg.serve.endpoint]
        unset = [f"kubernetes.{f}" for f in used if getattr(cfg.kubernetes, f).startswith(PLACEHOLDER_REGISTRY + "/")]
        if unset:
            raise ConfigError(f"{', '.join(unset)}: {PLACEHOLDER_REGISTRY} is a placeholder; build and push the images "
                              f"to your registry (docs/images.md) and name them in the config")


def stop_orphans(cfg: PipelineConfig, backend: Backend, state: RunState, echo: Callable[[str], None]) -> None:
    """Stop what an earlier, killed eagle3ctl of this run left running (its stages run in their own
    process groups, so they outlive it), found from the run's state record, from any directory."""
    if cfg.backend != "local":
        return  # Kubernetes: Jobs of the same input key are attached to, not stopped
    host = state.data.get("host")
    if host and host != hostname():
        if not state.data.get("finished", True):
            echo(f"warning: run {cfg.run_id} last ran on {host}; what it started there cannot be checked from here")
        return
    for what in backend.down():
        echo(f"stopped {what}, left running by an earlier attempt")


def start_record(cfg: PipelineConfig, state: RunState) -> None:
    """The run's state record for this attempt: who runs it, where its logs are."""
    from eagle3.serve.process import proc_cmdline

    state.data["stages"], state.data["serve"] = {}, {}
    state.set(run_id=cfg.run_id, backend=cfg.backend, host=hostname(), local_dir=str(state.dir),
              scheduler_pid=os.getpid(), scheduler_cmd=proc_cmdline(os.getpid()), started_at=time.time(),
              finished=False, ended_at=None, outcome=None)


class ConfigRecord:
    """Records this attempt's config as the run's (``RUN_CONFIG``) once it commits a stage, or ends
    with every stage complete for it: ``status`` and ``verify`` without ``-c`` judge the run by the
    config its output was made with, never by an attempt that failed before committing anything.
    Local prompt files are recorded by absolute path (they key by content): the same from any directory."""

    def __init__(self, cfg: PipelineConfig, store: ObjectStore, on_change: Callable[[Any, str], None]) -> None:
        self.cfg, self.store, self.forward, self.done = cfg, store, on_change, False

    def on_change(self, sched: Any, message: str) -> None:
        if not self.done and any(row.state == "done" for row in sched.rows.values()):
            self.record()
        self.forward(sched, message)

    def record(self) -> None:
        data = self.cfg.model_dump(mode="json")
        for section, name in FILE_FIELDS:
            path = local_file(data[section][name])
            if path is not None:
                data[section][name] = str(path.resolve())
        self.store.put_bytes(f"{self.cfg.run_id}/{RUN_CONFIG}", json.dumps(data, indent=2).encode())
        self.done = True


@dataclass
class PipelineRun:
    cfg: PipelineConfig
    result: RunResult
    state: RunState
    log_dir: str
    tty: bool = False


def run_pipeline(cfg: PipelineConfig, selection: Selection, echo: Callable[[str], None],
                 open_backend: Callable[[PipelineConfig, RunState], Backend], tty: bool | None = None,
                 poll_interval: float = 0.5, reuse_from: str | None = None) -> PipelineRun:
    """Take the run's lease, stop a killed predecessor's leftovers, adopt what run ``reuse_from``
    already made (``eagle3.pipeline.reuse``), check the whole DAG, then schedule on the backend
    ``open_backend`` gives (the CLI's choice, ``eagle3.cli.backends``)."""
    from eagle3.serve.process import proc_cmdline

    selected = selection.stages()
    check_engine(cfg)
    store = open_run_store(cfg)  # s3://: raises StoreError naming missing credentials or bucket
    lease = Lease(store, cfg.run_id, cfg.lease_ttl_s, cmd=proc_cmdline(os.getpid()) or "", echo=echo)
    lease.acquire()
    try:
        state = RunState(store, cfg.run_id, run_dir(cfg.run_id, store.uri))
        backend = open_backend(cfg, state)
        stop_orphans(cfg, backend, state, echo)
        lease.sweep_partial_writes()
        if reuse_from is not None:
            from eagle3.pipeline.reuse import reuse_stages, unfinished_attempt

            # local stages never outlive this CLI (stop_orphans); a Kubernetes Job may
            live = None if cfg.backend == "local" else unfinished_attempt(store, cfg.run_id)
            reuse_stages(cfg, store, reuse_from, selected, selection.force, echo, live)
        reruns: dict[str, str] = {}
        check_run(cfg, stages_to_run(cfg, store, selected, selection.force, reruns), echo)
        for name, why in reruns.items():
            echo(f"{name}: rerun: {why}")
        record_digests(store, cfg)
        start_record(cfg, state)
        view = make_view(echo, tty)
        recorded = ConfigRecord(cfg, store, view.on_change)
        sched = Scheduler(cfg, backend, store, selection, state=state, on_change=recorded.on_change,
                          poll_interval=poll_interval, lease=lease)
        try:
            with sigterm_as_interrupt(), view:
                result = sched.run()  # an error stops every stage and the server before it is raised
        except Eagle3Error:
            try:
                state.set(finished=True, ended_at=time.time(), outcome="error")
            except Eagle3Error:
                pass  # the store that failed the run may fail this too: the run's error is the one to say
            raise
        if result.ok and not recorded.done:  # every stage complete for this config (skipped or adopted)
            recorded.record()
        outcome = "interrupted" if result.interrupted else ("ok" if result.ok else "failed")
        state.set(finished=True, ended_at=time.time(), outcome=outcome)
        return PipelineRun(cfg, result, state, str(state.dir / "logs"), tty=isinstance(view, LiveView))
    finally:
        lease.release()


def summary_lines(run: PipelineRun) -> list[str]:
    """What the user reads last: why stages were skipped, the one reason for a failure, where things are."""
    r, lines = run.result, []
    for row in r.rows.values():
        if row.state == "skipped" and run.tty:  # plain output already said it, line by line
            lines.append(f"{row.name}: skipped ({row.reason})")
    if r.interrupted:
        detached = [row.name for row in r.rows.values() if row.state == "detached"]
        if detached:
            lines.append(f"detached: {', '.join(detached)} left running; rerun the same command to attach to "
                         f"{'them' if len(detached) > 1 else 'it'}, or `eagle3ctl down` to cancel")
        else:
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
        lines += result_lines(run.cfg, r.rows["export"].state in ("done", "skipped"))
    return lines


def result_lines(cfg: PipelineConfig, exported: bool) -> list[str]:
    """The end of a good run: the acceptance length, where the drafter is (and the command that always
    finds it), where the report is."""
    from eagle3.settings.store import DEFAULT_STORE_URI
    from eagle3.pipeline.report import acceptance_line, build_report, drafter_location, evaluation_report

    store = open_run_store(cfg, create=False)
    lines = []
    headline = acceptance_line(evaluation_report(cfg, store))
    if headline:
        lines.append(f"acceptance: {headline}")
    if exported:
        where = f"--run-id {cfg.run_id}" + (f" --store {store.uri}" if cfg.store.uri != DEFAULT_STORE_URI else "")
        lines.append(f"drafter: {drafter_location(cfg, store)}")
        lines.append(f"  (the folder of this export; `eagle3ctl show drafter {where}` prints the run's current one)")
    lines.append(f"report: {build_report(cfg)}")
    return lines
