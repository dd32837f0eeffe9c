"""The Kubernetes backend: stages as Jobs, the server as a vLLM Deployment + Service.

Objects come from the chart (``eagle3.k8s.render``); this module only submits, follows and
deletes them, making only the calls listed in ``eagle3.k8s.permissions`` (the Role grants those).
A Job carries its stage's input key (annotation ``eagle3.io/input-key``): a later eagle3ctl
finds a running or succeeded Job of the same key and follows it instead of resubmitting, so
Ctrl-C (by default) and a lost CLI leave stages running. Trouble is reported as one line: a
Pending pod with the scheduler's event (again every few minutes; it waits unless
``kubernetes.pending_timeout_s``), ImagePullBackOff, OOMKilled, exit codes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from eagle3.backend import Backend, Progress, StageHandle, StageOutcome
from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error, StageError
from eagle3.k8s import diagnose
from eagle3.k8s.follow import GONE_TIMEOUT_S, ObjectWatch, PendingReport, wait_object_gone, wait_pods_gone
from eagle3.k8s.inputs import local_inputs, upload_inputs, with_inputs
from eagle3.k8s.kube import AlreadyExists, Conflict, KubeClient
from eagle3.k8s.render import MULTI_NODE_STAGES, release_name, render_run, stage_objects
from eagle3.k8s.serving import ServeControl
from eagle3.progress import parse_progress
from eagle3.stages import STAGES

INPUT_KEY = "eagle3.io/input-key"
RESTARTS = "eagle3.io/restarts"
LOG_TAIL = 15
PROGRESS_EVERY_S = 5.0
RUN_KINDS = ("JobSet", "Job", "Deployment", "Service", "NetworkPolicy", "ConfigMap", "Pod")  # what `down` deletes


@dataclass
class Following:
    """What the backend knows of one stage's Job while it follows it."""

    watch: ObjectWatch
    input_key: str | None
    force: bool
    reported: set[str] = field(default_factory=set)
    pending: PendingReport = field(default_factory=PendingReport)
    progress_at: float | None = None
    progress: Progress | None = None


def _epoch(ts: str | None) -> float:
    try:
        return datetime.fromisoformat((ts or "").replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, cfg: PipelineConfig, state: Any = None, api: Any = None,
                 echo: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 store: Any = None) -> None:
        self.cfg = cfg
        self.api = api or KubeClient.connect(cfg.kubernetes.context, cfg.kubernetes.namespace)
        self.namespace = self.api.namespace
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock
        self.pending_timeout_s = cfg.kubernetes.pending_timeout_s
        self.detach_on_interrupt = not cfg.kubernetes.cancel_on_interrupt
        self.selector = f"eagle3.io/run={cfg.run_id}"
        self._store = store
        self._pod_cfg: PipelineConfig | None = None
        self._objects: list[dict] | None = None
        self._prepared = False
        self._following: dict[str, Following] = {}
        self.serve = ServeControl(self)

    # -- objects
    @property
    def pod_cfg(self) -> PipelineConfig:
        """The config the pods get: local input files replaced by their objects in the store."""
        if self._pod_cfg is None:
            self._pod_cfg = with_inputs(self.cfg, local_inputs(self.cfg))
        return self._pod_cfg

    @property
    def objects(self) -> list[dict]:
        if self._objects is None:
            self._objects = render_run(self.pod_cfg, self.namespace)
        return self._objects

    def of_kind(self, *kinds: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] in kinds]

    def _stage_objects(self, stage: str, input_key: str | None, force: bool, restarts: int = 0) -> list[dict]:
        objects = render_run(self.pod_cfg, self.namespace, input_keys={stage: input_key} if input_key else None,
                             force=(stage,) if force else (), restarts={stage: restarts})
        return stage_objects(objects, stage)

    def apply(self, obj: dict) -> None:
        """Create, or replace what an earlier run left under the same name."""
        for _ in range(3):
            try:
                self.api.create(obj)
                return
            except AlreadyExists:
                current = self.api.get(obj["kind"], obj["metadata"]["name"])
                if current is None:
                    continue  # deleted meanwhile: create again
                rv = current["metadata"]["resourceVersion"]
                try:
                    self.api.replace({**obj, "metadata": {**obj["metadata"], "resourceVersion": rv}})
                    return
                except Conflict:
                    continue  # changed meanwhile: read it again
        raise StageError(f"{obj['kind']} {obj['metadata']['name']} keeps changing under eagle3ctl; is another run using it?")

    def prepare(self) -> None:
        """Before the first pod: the namespace is set up, local inputs are in the store, the run's
        ConfigMap holds the config the pods get."""
        if self._prepared:
            return
        sa = self.cfg.kubernetes.service_account
        if self.api.get("ServiceAccount", sa) is None:
            raise Eagle3Error(f"namespace {self.namespace} has no ServiceAccount {sa}: prepare it first "
                              f"(helm install {release_name(self.cfg)} charts/eagle3 -n {self.namespace})")
        inputs = local_inputs(self.cfg)
        if inputs:
            for line in upload_inputs(self.store, inputs):
                self.echo(line)
        for obj in self.of_kind("ConfigMap"):
            self.apply(obj)
        self._prepared = True

    @property
    def store(self) -> Any:
        if self._store is None:
            from eagle3.runs import open_run_store

            self._store = open_run_store(self.cfg)
        return self._store

    # -- serve
    def serve_url(self) -> str:
        return self.serve.url()

    def start_serve(self) -> str:
        return self.serve.start()

    def stop_serve(self) -> None:
        self.serve.stop()

    # -- stages
    def stage_selector(self, stage: str) -> str:
        return f"{self.selector},eagle3.io/stage={stage}"

    def _job_kind(self, stage: str) -> str:
        k8s = self.cfg.kubernetes
        return "JobSet" if stage in MULTI_NODE_STAGES and k8s.nodes > 1 and k8s.multi_node == "jobset" else "Job"

    def _job_name(self, stage: str) -> str:
        return f"eagle3-{self.cfg.run_id}-{stage}"

    def attach(self, stage: str, input_key: str) -> StageHandle | None:
        """A running or succeeded Job of this stage and input key (an earlier eagle3ctl's): follow it."""
        kind, name = self._job_kind(stage), self._job_name(stage)
        job = self.api.get(kind, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return None
        if job["metadata"].get("annotations", {}).get(INPUT_KEY) != input_key:
            return None  # another config or upstream: submit replaces it
        if diagnose.job_failure(job):
            return None  # failed: submit starts a new attempt, which resumes
        state = "succeeded" if diagnose.job_complete(job) else "running"
        self.echo(f"{stage}: {kind} {name} of this input key is {state}, started by an earlier eagle3ctl: following it")
        return self._handle(stage, kind, name, input_key, False, _epoch(job["metadata"].get("creationTimestamp")))

    def _handle(self, stage: str, kind: str, name: str, input_key: str | None, force: bool, started: float) -> StageHandle:
        watch = ObjectWatch(self.api, kind, name)
        watch.start()
        self._following[stage] = Following(watch, input_key, force)
        return StageHandle(stage, name, started, {"kind": kind, "input_key": input_key})

    def submit(self, stage: str, endpoint: str | None = None, input_key: str | None = None,
               force: bool = False) -> StageHandle:
        self.prepare()
        if STAGES[stage].resource == "gpu":
            self.serve.stop_leftover(stage)
        kind, name = self._job_kind(stage), self._job_name(stage)
        self._replace_earlier(stage, kind, name, input_key, force)
        self._create_stage(stage, input_key, force, restarts=0)
        return self._handle(stage, kind, name, input_key, force, time.time())

    def _replace_earlier(self, stage: str, kind: str, name: str, input_key: str | None, force: bool) -> None:
        job = self.api.get(kind, name)
        if job is None:
            return
        key = job["metadata"].get("annotations", {}).get(INPUT_KEY)
        why = ("--force" if force else "it failed" if diagnose.job_failure(job) else
               "it has another input key (config or upstream changed)" if key != input_key else
               "its output is not complete" if diagnose.job_complete(job) else "it is being replaced")
        self.echo(f"{stage}: deleting the earlier {kind} {name}: {why}")
        self._delete_and_wait(stage, kind, name)

    def _delete_and_wait(self, stage: str, kind: str, name: str) -> None:
        self.api.delete(kind, name, propagation="Foreground")
        wait_pods_gone(self.api, self.stage_selector(stage), stage,
                       self.cfg.kubernetes.termination_grace_s + GONE_TIMEOUT_S, self.clock)
        wait_object_gone(self.api, kind, name, self.clock)

    def _create_stage(self, stage: str, input_key: str | None, force: bool, restarts: int) -> None:
        objs = self._stage_objects(stage, input_key, force, restarts)
        if not any(o["kind"] in ("Job", "JobSet") for o in objs):
            raise StageError(f"stage {stage}: the chart rendered no Job for it")
        for obj in objs:
            if obj["kind"] == "Service":
                self.apply(obj)  # a multi-node stage's headless Service may outlive its Job
            else:
                self.api.create(obj)

    def poll(self, handle: StageHandle) -> StageOutcome | None:
        f = self._following.get(handle.stage) or self._refollow(handle)
        job = f.watch.advance()
        if job is not None and job.get("deleted"):
            return StageOutcome(handle.stage, False, f"{f.watch.kind} {handle.ref} was deleted", self.logs(handle.stage, tail=LOG_TAIL))
        if job is not None and diagnose.job_complete(job):
            return StageOutcome(handle.stage, True, "", self.logs(handle.stage, tail=LOG_TAIL))
        pods = self.api.list("Pod", self.stage_selector(handle.stage))[0]
        pending = [p for p in pods if p.get("status", {}).get("phase") == "Pending"]
        events = self.api.list("Event", field_selector="involvedObject.kind=Pod")[0] if pending else []
        problems = [p for p in (diagnose.pod_problem(pod, events) for pod in pods) if p]
        for line, _fatal in problems:
            if not line.startswith("Pending") and line not in f.reported:
                f.reported.add(line)
                self.echo(f"{handle.stage}: {line}")
        failed = diagnose.job_failure(job) if job else None
        if failed:
            pod_lines = [line for line, _ in problems if not line.startswith("Pending")]
            reason = pod_lines[0] if pod_lines else failed
            if self._gang_restart(handle, f, job, reason):
                return None
            return StageOutcome(handle.stage, False, reason, self.logs(handle.stage, tail=LOG_TAIL))
        fatal = next((line for line, is_fatal in problems if is_fatal), None)
        if fatal is None:
            fatal = self._pending(handle, f, pods, problems)
        if fatal:
            self.cancel(handle)
            return StageOutcome(handle.stage, False, fatal, self.logs(handle.stage, tail=LOG_TAIL))
        return None

    def _pending(self, handle: StageHandle, f: Following, pods: list[dict], problems: list[tuple[str, bool]]) -> str | None:
        """Report an unschedulable stage (first, on a new reason, every few minutes); fail it only
        after kubernetes.pending_timeout_s, when set."""
        line = next((ln for ln, _ in problems if ln.startswith("Pending")), None)
        if line is None or not all(p.get("status", {}).get("phase") == "Pending" for p in pods):
            f.pending.update(None, self.clock())
            return None
        shown = f.pending.update(line, self.clock())
        if shown:
            self.echo(f"{handle.stage}: {shown}")
        if self.pending_timeout_s is not None and f.pending.waited(self.clock()) > self.pending_timeout_s:
            return f"{line} (still Pending after kubernetes.pending_timeout_s={self.pending_timeout_s:.0f}s)"
        return None

    def _gang_restart(self, handle: StageHandle, f: Following, job: dict, reason: str) -> bool:
        """A multi-node Indexed Job failed as a whole (one index failed, or a pod was evicted): start
        every node again, resuming from the checkpoint. JobSets restart themselves (failurePolicy)."""
        k8s = self.cfg.kubernetes
        if f.watch.kind != "Job" or handle.stage not in MULTI_NODE_STAGES or k8s.nodes < 2:
            return False
        cond = next(c for c in job["status"]["conditions"] if c.get("type") == "Failed" and c.get("status") == "True")
        disruption = cond.get("reason") == "PodFailurePolicy" and "DisruptionTarget" in (cond.get("message") or "")
        if not disruption and cond.get("reason") not in ("MaxFailedIndexesExceeded", "FailedIndexes"):
            return False  # a config error (exit 2), the deadline: restarting cannot help
        restarts = int(job["metadata"].get("annotations", {}).get(RESTARTS, "0"))
        if not disruption and restarts >= k8s.backoff_limit:
            return False
        counted = restarts if disruption else restarts + 1
        what = "a pod was evicted or preempted" if disruption else reason
        self.echo(f"{handle.stage}: {what}; restarting all {k8s.nodes} nodes, resuming from the checkpoint"
                  + ("" if disruption else f" (restart {counted}/{k8s.backoff_limit})"))
        self._delete_and_wait(handle.stage, f.watch.kind, handle.ref)
        self._create_stage(handle.stage, f.input_key, False, counted)  # no --force: the new attempt resumes
        f.watch.start()
        f.reported.clear()
        return True

    def _refollow(self, handle: StageHandle) -> Following:
        watch = ObjectWatch(self.api, handle.extra.get("kind", "Job"), handle.ref)
        watch.start()
        f = self._following[handle.stage] = Following(watch, handle.extra.get("input_key"), False)
        return f

    def progress(self, handle: StageHandle) -> Progress | None:
        f = self._following.get(handle.stage) or self._refollow(handle)
        if f.progress_at is not None and self.clock() - f.progress_at < PROGRESS_EVERY_S:
            return f.progress
        f.progress_at = self.clock()
        for line in reversed(self.logs(handle.stage, tail=50)):
            rec = parse_progress(line)
            if rec is not None:
                extra = {k: v for k, v in rec.items() if k not in ("stage", "done", "total", "unit", "rate")}
                f.progress = Progress(rec.get("done", 0.0), rec.get("total"), rec.get("unit", ""), rec.get("rate"), extra)
                break
        return f.progress

    def cancel(self, handle: StageHandle) -> None:
        """Delete the Job (and its pods: SIGTERM, then the grace period; train checkpoints)."""
        self.api.delete(handle.extra.get("kind", "Job"), handle.ref, propagation="Foreground")
        self._following.pop(handle.stage, None)

    def detach(self, handle: StageHandle) -> None:
        """Stop following; the Job runs on and the next eagle3ctl attaches to it."""
        self._following.pop(handle.stage, None)

    def _latest_pod(self, stage: str) -> dict | None:
        pods = self.api.list("Pod", self.stage_selector(stage))[0]
        # multi-node: rank 0 (completion index 0) speaks for the stage
        rank0 = [p for p in pods if p["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", "0") == "0"]
        return diagnose.newest(rank0 or pods)

    def logs(self, stage: str, follow: bool = False, tail: int | None = None) -> list[str]:
        pod = self._latest_pod(stage)
        if pod is None:
            return []
        container = "serve" if stage == "serve" else "stage"
        if follow:
            lines = list(self.api.stream_logs(pod["metadata"]["name"], container))
            return lines[-tail:] if tail else lines
        return self.api.logs(pod["metadata"]["name"], container, tail=tail)

    def down(self) -> list[str]:
        """Delete every object labelled with this run (Jobs with their pods); keep PVCs, RBAC, Secrets."""
        removed = []
        for kind in RUN_KINDS:
            if kind == "JobSet" and self.cfg.kubernetes.multi_node != "jobset":
                continue
            for obj in self.api.list(kind, self.selector)[0]:
                name = obj["metadata"]["name"]
                if self.api.delete(kind, name, propagation="Background"):
                    removed.append(f"{kind}/{name}")
        return removed

    def gpu_count(self) -> int:
        return self.cfg.kubernetes.gpus_per_node * self.cfg.kubernetes.nodes
