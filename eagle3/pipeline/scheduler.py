"""Run the stages as a DAG with resource classes, deciding from the manifests what to run.

The DAG and resource classes come from ``eagle3.stages``. The rules:

- A stage is considered once every upstream stage is done (or skipped) in this run; its
  verdict (``eagle3.contract.judge_run``) then gives its input key, computed exactly as the
  stage itself does, and a stage whose manifest is complete for that key is skipped, saying so.
- ``serve`` is a service node, not a manifest stage: started only when a stage that needs
  the endpoint must run and no ``serve.endpoint`` is configured; stopped, and confirmed
  stopped, as soon as no such stage is left, before any GPU stage is submitted.
- GPU stages hold the node's GPUs exclusively: they never overlap each other or the
  server. CPU stages run alongside anything (``vocab`` runs while ``extract`` does).
- A failed stage blocks its dependents; independent stages still run to the end.
- Ctrl-C / SIGTERM (KeyboardInterrupt here) cancels every running stage and the server;
  the next run resumes, each stage from its own partial progress. An error that ends the
  run (the store failing past its retries, a lost lease) stops them the same way, even
  while the store cannot record it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from eagle3.backend import Backend, Progress, StageHandle, StageOutcome
from eagle3.config import PipelineConfig
from eagle3.contract import StageVerdict, judge_run
from eagle3.errors import ConfigError, Eagle3Error, UpstreamMissing
from eagle3.manifest import verify_stage
from eagle3.pipeline.runstate import RunState
from eagle3.stages import ORDER, STAGES, ancestors, descendants
from eagle3.store import ObjectStore

class LeaseLost(Eagle3Error):
    """Another eagle3ctl took the run over while this one ran."""


TERMINAL = ("skipped", "done", "failed", "blocked", "excluded", "stopped", "detached")
FINISHED_OK = ("skipped", "done")


@dataclass
class StageRow:
    """One stage as the live table and state.json show it."""

    name: str
    resource: str  # cpu | gpu
    state: str = "pending"  # pending waiting running skipped done failed blocked excluded stopped
    reason: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    progress: Progress | None = None
    gpus: int = 0
    handle: StageHandle | None = None
    log_tail: list[str] = field(default_factory=list)

    def elapsed(self, now: float) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at or now) - self.started_at

    def gpu_hours(self, now: float) -> float | None:
        e = self.elapsed(now)
        return None if e is None or not self.gpus else e * self.gpus / 3600


@dataclass
class ServeRow:
    """The endpoint: idle, starting, running, stopping, stopped, failed, or external."""

    state: str = "idle"
    url: str | None = None
    reason: str = ""
    started_at: float | None = None
    ready_at: float | None = None
    ended_at: float | None = None
    gpus: int = 0

    @property
    def holds_gpus(self) -> bool:
        return self.state in ("starting", "running", "stopping")


@dataclass
class Selection:
    """Which stages this run may run: ``--from`` X and its dependents, ``--until`` Y and its upstreams
    (``--until`` repeated: each Y given and its upstreams, e.g. two siblings in the DAG)."""

    start: str | None = None
    until: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # `run stage NAME`
    force: tuple[str, ...] = ()

    def stages(self) -> set[str]:
        for name in (self.start, *self.until, *self.only, *self.force):
            if name is not None and name not in STAGES:
                raise ConfigError(f"unknown stage {name!r}; stages are: {', '.join(ORDER)}")
        chosen = set(ORDER)
        if self.only:
            chosen = set(self.only)
        if self.start:
            chosen &= {self.start} | descendants(self.start)
        if self.until:
            chosen &= set().union(*({y} | ancestors(y) for y in self.until))
        bad = [f for f in self.force if f not in chosen]
        if bad:
            raise ConfigError(f"--force {bad[0]}: the stage is outside the stages selected to run")
        return chosen


@dataclass
class RunResult:
    rows: dict[str, StageRow]
    serve: ServeRow
    failures: list[StageOutcome]
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures and not self.interrupted and all(r.state in FINISHED_OK + ("excluded",) for r in self.rows.values())


def _when(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except ValueError:
        return iso


class Scheduler:
    def __init__(
        self,
        cfg: PipelineConfig,
        backend: Backend,
        store: ObjectStore,
        selection: Selection | None = None,
        state: RunState | None = None,
        on_change: Callable[[Scheduler, str], None] | None = None,
        poll_interval: float = 0.5,
        lease: Any = None,
    ) -> None:
        self.cfg, self.backend, self.store = cfg, backend, store
        self.selection = selection or Selection()
        self.selected = self.selection.stages()
        self.state = state
        self.on_change = on_change or (lambda s, msg: None)
        self.poll_interval = poll_interval
        self.lease = lease  # eagle3.pipeline.lease.Lease: stop if another process takes the run
        self.rows = {n: StageRow(n, STAGES[n].resource) for n in ORDER}
        self.serve = ServeRow(state="external", url=cfg.serve.endpoint) if cfg.serve.endpoint else ServeRow()
        self.failures: list[StageOutcome] = []
        self._serve_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._progress_saved: dict[str, float] = {}
        self.keys: dict[str, str] = {}  # stage -> the input key it was checked (and is submitted) with
        self._stopping = False  # shutting down: recording the state is best effort

    # -- bookkeeping -----------------------------------------------------------------

    def _set(self, name: str, state: str, reason: str = "") -> None:
        row = self.rows[name]
        row.state, row.reason = state, reason
        self._record("stages", name, state=state, reason=reason, started_at=row.started_at,
                     ended_at=row.ended_at, resource=row.resource, gpus=row.gpus,
                     ref=row.handle.ref if row.handle else None, extra=row.handle.extra if row.handle else {})
        self.on_change(self, f"{name}: {state}" + (f" ({reason})" if reason else ""))

    def _set_serve(self, state: str, reason: str = "") -> None:
        self.serve.state, self.serve.reason = state, reason
        s = self.serve
        self._record("serve", None, state=state, reason=reason, url=s.url, started_at=s.started_at,
                     ready_at=s.ready_at, ended_at=s.ended_at)
        self.on_change(self, f"serve: {state}" + (f" ({reason})" if reason else ""))

    def _record(self, section: str, name: str | None, **fields: Any) -> None:
        """Into state.json; while shutting down a store error is not let stop the shutdown."""
        if self.state is None:
            return
        try:
            self.state.update(section, name, **fields)
        except Eagle3Error:
            if not self._stopping:
                raise

    # -- the loop --------------------------------------------------------------------

    def run(self) -> RunResult:
        for name in ORDER:
            if name not in self.selected:
                self._plan_excluded(name)
        try:
            while True:
                self._check_lease()
                self._poll_running()
                self._advance()
                self._manage_serve()
                if self._finished():
                    break
                time.sleep(self.poll_interval)
        except KeyboardInterrupt:
            self._shutdown()
            return RunResult(self.rows, self.serve, self.failures, interrupted=True)
        except BaseException:  # an error ends the run: stop what it started, as Ctrl-C does
            try:
                self._shutdown()
            except Exception as e:  # noqa: BLE001 - the error that ended the run is the one raised
                self.on_change(self, f"while stopping: {e}")
            raise
        self._stop_serve_now()
        return RunResult(self.rows, self.serve, self.failures)

    def _check_lease(self) -> None:
        if self.lease is not None and self.lease.lost:
            other = self.lease.lost
            who = other.describe() if hasattr(other, "describe") else "another process"
            raise LeaseLost(f"run {self.cfg.run_id} was taken over by {who} (this run's heartbeat was late); "
                            f"stopped this run's stages")

    def _finished(self) -> bool:
        busy_serve = self.serve.state in ("starting", "stopping") or (self.serve.state == "running" and self._endpoint_needed())
        return not busy_serve and all(r.state in TERMINAL for r in self.rows.values())

    def _plan_excluded(self, name: str) -> None:
        """A stage outside --from/--until: usable by later stages only if already complete."""
        ups = [self.rows[u] for u in STAGES[name].needs]
        if all(u.state in FINISHED_OK for u in ups):
            complete, why = self._complete(name)
            if complete:
                self.rows[name].state, self.rows[name].reason = "skipped", f"not selected to run; {why}"
                self.on_change(self, f"{name}: skipped ({self.rows[name].reason})")
                return
        self.rows[name].state, self.rows[name].reason = "excluded", "not selected to run, and not complete"
        self.on_change(self, f"{name}: excluded ({self.rows[name].reason})")

    def _judge(self, name: str) -> StageVerdict:
        """The stage's verdict now, its input key remembered; its upstream stages must be complete."""
        verdicts = judge_run(self.cfg, self.store, until=name)
        v = verdicts[name]
        if v.waits_for:
            up = v.waits_for[0]
            raise UpstreamMissing(f"stage {name} needs {up}, which is not complete: {verdicts[up].reason}")
        assert v.input_key is not None
        self.keys[name] = v.input_key
        return v

    def _complete(self, name: str) -> tuple[bool, str]:
        """Complete for the input key the stage would compute now? Upstreams must be complete."""
        v = self._judge(name)
        if v.complete and v.manifest is not None:
            return True, f"complete, input key matches manifest of {_when(v.manifest.manifest.finished_at)}"
        return False, v.reason

    def _advance(self) -> None:
        for name in ORDER:
            row = self.rows[name]
            if row.state not in ("pending", "waiting"):
                continue
            ups = [self.rows[u] for u in STAGES[name].needs]
            bad = [u for u in ups if u.state in ("failed", "blocked", "excluded", "stopped")]
            if bad:
                self._set(name, "blocked", f"needs {bad[0].name}, which {'was not selected to run and is not complete' if bad[0].state == 'excluded' else bad[0].state}")
                continue
            if not all(u.state in FINISHED_OK for u in ups):
                continue
            if row.state == "pending":
                if name not in self.selection.force:
                    try:
                        complete, why = self._complete(name)
                    except Eagle3Error as e:
                        self._fail(StageOutcome(name, False, str(e)))
                        continue
                    if complete:
                        self._set(name, "skipped", why)
                        continue
                    if self._attach(name):
                        continue
                self._set(name, "waiting", "ready")
            self._try_start(name)

    def _try_start(self, name: str) -> None:
        spec = STAGES[name]
        endpoint = None
        if spec.needs_endpoint:
            if self.serve.state in ("external", "running"):
                endpoint = self.serve.url
            elif self.serve.state == "failed":
                try:
                    tail = self.backend.logs("serve", tail=10)
                except Eagle3Error:
                    tail = []
                self._fail(StageOutcome(name, False, f"the serve endpoint did not start: {self.serve.reason}", tail))
                return
            else:
                self._wait(name, "waiting for the serve endpoint")
                return
        if spec.resource == "gpu":
            holder = next((r.name for r in self.rows.values() if r.resource == "gpu" and r.state == "running"), None)
            if holder is None and (self.serve.holds_gpus or (self.serve.state != "external" and self._endpoint_needed())):
                holder = "serve"
            if holder is not None:  # on a machine without GPUs the stages still take turns, but not for GPUs
                self._wait(name, f"waiting for the GPUs (held by {holder})" if self.backend.gpu_count() else
                           f"waiting for {holder} to {'stop' if holder == 'serve' else 'finish'}")
                return
        row = self.rows[name]
        row.started_at, row.ended_at = time.time(), None
        row.gpus = self.backend.gpu_count() if spec.resource == "gpu" else 0
        try:
            if name not in self.keys:  # forced: never checked for completeness
                self._judge(name)
            row.handle = self.backend.submit(name, endpoint=endpoint, input_key=self.keys[name],
                                             force=name in self.selection.force)
        except Eagle3Error as e:
            row.ended_at = time.time()
            self._fail(StageOutcome(name, False, str(e)))
            return
        self._set(name, "running")

    def _unverified(self, name: str) -> str | None:
        """Why a stage that exited cleanly is still not complete for its key (None: it is)."""
        key = self.keys.get(name)
        v = verify_stage(self.store, self.cfg.run_id, name, input_key=key)
        return None if v.complete else v.reason

    def _attach(self, name: str) -> bool:
        """Follow an attempt of this key an earlier CLI started and left running (no resubmit)."""
        try:
            handle = self.backend.attach(name, self.keys[name])
        except Eagle3Error as e:
            self._fail(StageOutcome(name, False, str(e)))
            return True
        if handle is None:
            return False
        row = self.rows[name]
        row.handle, row.started_at, row.ended_at = handle, handle.started_at, None
        row.gpus = self.backend.gpu_count() if STAGES[name].resource == "gpu" else 0
        self._set(name, "running", f"attached to {handle.ref}, started by an earlier run")
        return True

    def _save_progress(self, row: StageRow) -> None:
        """Progress into state.json (every few seconds) so `status` in another shell shows it."""
        now = time.time()
        if self.state is None or row.progress is None or now - self._progress_saved.get(row.name, 0) < 3:
            return
        self._progress_saved[row.name] = now
        p = row.progress
        self.state.update("stages", row.name, progress={"done": p.done, "total": p.total, "unit": p.unit, "rate": p.rate})

    def _wait(self, name: str, reason: str) -> None:
        if self.rows[name].reason != reason:
            self._set(name, "waiting", reason)

    def _fail(self, outcome: StageOutcome) -> None:
        row = self.rows[outcome.stage]
        row.ended_at = row.ended_at or time.time()
        row.log_tail = outcome.log_tail
        self.failures.append(outcome)
        self._set(outcome.stage, "failed", outcome.reason)

    def _poll_running(self) -> None:
        for row in self.rows.values():
            if row.state != "running" or row.handle is None:
                continue
            outcome = self.backend.poll(row.handle)
            if outcome is None:
                row.progress = self.backend.progress(row.handle) or row.progress
                self._save_progress(row)
                continue
            row.ended_at = time.time()
            row.progress = self.backend.progress(row.handle) or row.progress
            if outcome.succeeded:
                unverified = self._unverified(row.name)
                if unverified:  # e.g. an attached Job that succeeded on another key's config
                    self._fail(StageOutcome(row.name, False, f"ended well, but its output does not verify: {unverified}",
                                            outcome.log_tail))
                else:
                    self._set(row.name, "done")
            else:
                self._fail(outcome)

    # -- the server ------------------------------------------------------------------

    def _endpoint_needed(self) -> bool:
        """Is a stage that needs the endpoint still to run (or running)?"""
        return any(STAGES[n].needs_endpoint and r.state in ("pending", "waiting", "running") for n, r in self.rows.items())

    def _manage_serve(self) -> None:
        if self.serve.state == "external":
            return
        wanted = any(STAGES[n].needs_endpoint and r.state == "waiting" for n, r in self.rows.items())
        if self.serve.state == "idle" and wanted:
            self._start_serve_async()
        elif self.serve.state == "running" and not self._endpoint_needed():
            self._stop_serve_async()

    def _start_serve_async(self) -> None:
        self.serve.started_at = time.time()
        self.serve.gpus = self.backend.gpu_count()
        self._set_serve("starting")

        def work() -> None:
            try:
                url = self.backend.start_serve()
            except Exception as e:  # noqa: BLE001 - any failure is reported as the serve row's reason
                with self._lock:
                    if self.serve.state == "starting":
                        self.serve.ended_at = time.time()
                        self._set_serve("failed", str(e) or type(e).__name__)
                return
            with self._lock:
                if self.serve.state == "starting":
                    self.serve.url, self.serve.ready_at = url, time.time()
                    self._set_serve("running")

        self._serve_thread = threading.Thread(target=work, name="eagle3-serve-start", daemon=True)
        self._serve_thread.start()

    def _stop_serve_async(self) -> None:
        self._set_serve("stopping")

        def work() -> None:
            try:
                self.backend.stop_serve()
            finally:
                with self._lock:
                    self.serve.ended_at = time.time()
                    self._set_serve("stopped")

        self._serve_thread = threading.Thread(target=work, name="eagle3-serve-stop", daemon=True)
        self._serve_thread.start()

    def _stop_serve_now(self) -> None:
        if self.serve.state in ("starting", "running"):
            with self._lock:
                self.serve.state = "stopping"
            self.backend.stop_serve()
            self.serve.ended_at = time.time()
            self._set_serve("stopped")
        if self._serve_thread is not None:
            self._serve_thread.join()

    def _shutdown(self) -> None:
        """Ctrl-C / SIGTERM / an error ending the run: stop every running stage and the server,
        then return. Each is stopped even if stopping another, or recording it, fails; the first
        such error is raised once everything was tried."""
        self._stopping = True
        detach = self.backend.detach_on_interrupt
        first: Exception | None = None
        for row in self.rows.values():
            try:
                self._stop_row(row, detach)
            except Exception as e:  # noqa: BLE001 - the other stages and the server must still stop
                first = first or e
        try:
            if not (detach and any(r.state == "detached" for r in self.rows.values())
                    and self._endpoint_needed_by_detached()):  # a detached stage still calls the endpoint
                self._stop_serve_now()
        except Exception as e:  # noqa: BLE001
            first = first or e
        if first is not None:
            raise first

    def _stop_row(self, row: StageRow, detach: bool) -> None:
        if row.state == "running" and row.handle is not None:
            if detach:
                self.backend.detach(row.handle)
                self._set(row.name, "detached", f"left running as {row.handle.ref}; the next run attaches to it")
                return
            self.backend.cancel(row.handle)
            row.ended_at = time.time()
            self._set(row.name, "stopped", "interrupted; the next run resumes it")
        elif row.state in ("pending", "waiting"):
            self._set(row.name, "stopped", "interrupted before it started")

    def _endpoint_needed_by_detached(self) -> bool:
        return any(STAGES[n].needs_endpoint and r.state == "detached" for n, r in self.rows.items())
