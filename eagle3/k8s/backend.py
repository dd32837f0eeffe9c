"""The Kubernetes backend: stages as Jobs, the server as a vLLM Deployment + Service.

Objects come from the chart (``eagle3.k8s.render``), rendered once per run; this module
only submits, follows and deletes them. Jobs are followed with watches from the last
resourceVersion (a 410 Gone is answered by listing again); trouble is reported once, as
one line: Pending with the scheduler's event, ImagePullBackOff, OOMKilled, exit codes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error, StageError
from eagle3.k8s import diagnose
from eagle3.k8s.kube import AlreadyExists, Forbidden, Gone, KubeClient
from eagle3.k8s.render import release_name, render_run, stage_objects
from eagle3.pipeline.backend import Backend, Progress, StageHandle, StageOutcome

PENDING_TIMEOUT_S = 600.0  # an unschedulable pod fails the stage after this (autoscalers get a chance)
WATCH_TIMEOUT_S = 1.0
GONE_TIMEOUT_S = 300.0  # deleted pods must be gone within this (on top of their grace period)
LOG_TAIL = 15
PROGRESS_EVERY_S = 5.0
RUN_KINDS = ("JobSet", "Job", "Deployment", "Service", "ConfigMap", "Pod")  # what `down` deletes, by run label


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, cfg: PipelineConfig, state: Any = None, api: Any = None,
                 echo: Callable[[str], None] | None = None, pending_timeout_s: float = PENDING_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.api = api or KubeClient.connect(cfg.kubernetes.context, cfg.kubernetes.namespace)
        self.namespace = self.api.namespace
        self.echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
        self.pending_timeout_s, self.clock = pending_timeout_s, clock
        self.selector = f"eagle3.io/run={cfg.run_id}"
        self._objects: list[dict] | None = None
        self._prepared = False

    # -- objects
    @property
    def objects(self) -> list[dict]:
        if self._objects is None:
            self._objects = render_run(self.cfg, self.namespace)
        return self._objects

    def _of_kind(self, *kinds: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] in kinds]

    def _create(self, obj: dict, replace: bool = False) -> None:
        try:
            self.api.create(obj)
        except AlreadyExists:
            if replace:
                current = self.api.get(obj["kind"], obj["metadata"]["name"]) or {}
                body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current.get("metadata", {}).get("resourceVersion")}}
                self.api.replace(body)

    def _prepare(self) -> None:
        """The namespace setup (if missing) and the run's ConfigMap (always this config)."""
        if self._prepared:
            return
        for obj in self._of_kind("ServiceAccount", "Role", "RoleBinding"):
            if self.api.get(obj["kind"], obj["metadata"]["name"]) is None:
                try:
                    self.api.create(obj)
                except Forbidden:
                    raise Eagle3Error(f"namespace {self.namespace} has no {obj['kind']} {obj['metadata']['name']} and this "
                                      f"user may not create it: install the chart first (helm install {release_name(self.cfg)} "
                                      f"charts/eagle3 -n {self.namespace})") from None
        for obj in self._of_kind("ConfigMap"):
            self._create(obj, replace=True)
        self._prepared = True

    # -- serve
    def serve_url(self) -> str:
        svc = next(o for o in self._of_kind("Service") if o["metadata"]["labels"].get("eagle3.io/stage") == "serve")
        return f"http://{svc['metadata']['name']}.{self.namespace}.svc:{self.cfg.serve.port or 8000}/v1"

    def start_serve(self) -> str:
        self._prepare()
        for obj in self._of_kind("PersistentVolumeClaim"):
            self._create(obj)  # the shared model cache: created once, never replaced
        for obj in stage_objects(self.objects, "serve"):
            self._create(obj, replace=True)
        self._wait_serve_ready()
        return self.serve_url()

    def _serve_selector(self) -> str:
        return f"{self.selector},eagle3.io/stage=serve"

    def _wait_serve_ready(self) -> None:
        deadline = self.clock() + self.cfg.serve.startup_timeout_s
        pending_since: float | None = None
        reported: set[str] = set()
        pods, rv = self.api.list("Pod", self._serve_selector())
        by_name = {p["metadata"]["name"]: p for p in pods}
        while self.clock() < deadline:
            live = [p for p in by_name.values() if not p["metadata"].get("deletionTimestamp")]
            if any(diagnose.pod_ready(p) for p in live):
                return
            events = self.api.list("Event", field_selector="involvedObject.kind=Pod")[0] if live else []
            for pod in live:
                problem = diagnose.pod_problem(pod, events)
                if problem is None:
                    continue
                line, fatal = problem
                if line not in reported:
                    reported.add(line)
                    self.echo(f"serve: {line}")
                if fatal or line.startswith(("exit code", "OOMKilled")):
                    raise StageError(f"the server did not start: {line}")
                if line.startswith("Pending"):
                    pending_since = self.clock() if pending_since is None else pending_since
                    if self.clock() - pending_since > self.pending_timeout_s:
                        raise StageError(f"the server did not start: {line}")
            try:
                for kind, pod in self.api.watch("Pod", rv, selector=self._serve_selector(), timeout_s=WATCH_TIMEOUT_S):
                    rv = pod["metadata"].get("resourceVersion", rv)
                    if kind == "DELETED":
                        by_name.pop(pod["metadata"]["name"], None)
                    elif kind != "BOOKMARK":
                        by_name[pod["metadata"]["name"]] = pod
            except Gone:
                pods, rv = self.api.list("Pod", self._serve_selector())
                by_name = {p["metadata"]["name"]: p for p in pods}
        raise StageError(f"the server was not ready within serve.startup_timeout_s={self.cfg.serve.startup_timeout_s:.0f}s")

    def stop_serve(self) -> None:
        """Delete the Deployment and Service; return once the server's pods are gone (GPUs free)."""
        for obj in stage_objects(self.objects, "serve"):
            self.api.delete(obj["kind"], obj["metadata"]["name"], propagation="Foreground")
        self._wait_pods_gone(self._serve_selector(), "serve")

    def _wait_pods_gone(self, selector: str, what: str) -> None:
        deadline = self.clock() + self.cfg.kubernetes.termination_grace_s + GONE_TIMEOUT_S
        pods, rv = self.api.list("Pod", selector)
        left = {p["metadata"]["name"] for p in pods}
        while left:
            if self.clock() > deadline:
                raise StageError(f"{what}: pods {', '.join(sorted(left))} still exist after deletion; their GPUs are not free")
            try:
                for kind, pod in self.api.watch("Pod", rv, selector=selector, timeout_s=WATCH_TIMEOUT_S):
                    rv = pod["metadata"].get("resourceVersion", rv)
                    if kind == "DELETED":
                        left.discard(pod["metadata"]["name"])
                    elif kind in ("ADDED", "MODIFIED"):
                        left.add(pod["metadata"]["name"])
            except Gone:
                pods, rv = self.api.list("Pod", selector)
                left = {p["metadata"]["name"] for p in pods}

    # -- stages
    def _stage_selector(self, stage: str) -> str:
        return f"{self.selector},eagle3.io/stage={stage}"

    def submit(self, stage: str, endpoint: str | None = None, input_key: str | None = None,
               force: bool = False) -> StageHandle:
        self._prepare()
        objs = stage_objects(self.objects, stage)
        job = next((o for o in objs if o["kind"] in ("Job", "JobSet")), None)
        if job is None:
            raise StageError(f"stage {stage}: the chart rendered no Job for it")
        name = job["metadata"]["name"]
        if self.api.get(job["kind"], name) is not None:  # an earlier attempt: the stage resumes in a new one
            self.api.delete(job["kind"], name, propagation="Foreground")
            self._wait_pods_gone(self._stage_selector(stage), stage)
            self._wait_object_gone(job["kind"], name)
        for obj in objs:
            self._create(obj, replace=obj["kind"] == "Service")
        _, rv = self.api.list(job["kind"], field_selector=f"metadata.name={name}")
        return StageHandle(stage, name, time.time(), {"kind": job["kind"], "rv": rv, "job": None, "reported": set(),
                                                     "pending_since": None, "progress_at": None, "progress": None})

    def _wait_object_gone(self, kind: str, name: str) -> None:
        deadline = self.clock() + GONE_TIMEOUT_S
        while self.api.get(kind, name) is not None:
            if self.clock() > deadline:
                raise StageError(f"{kind} {name} is still being deleted after {GONE_TIMEOUT_S:.0f}s")
            _, rv = self.api.list(kind, field_selector=f"metadata.name={name}")
            try:
                for ev, _obj in self.api.watch(kind, rv, field_selector=f"metadata.name={name}", timeout_s=WATCH_TIMEOUT_S):
                    if ev == "DELETED":
                        return
            except Gone:
                continue

    def _follow(self, handle: StageHandle) -> dict | None:
        """Advance the Job watch from its last resourceVersion; list again after 410 Gone."""
        x, kind, fs = handle.extra, handle.extra["kind"], f"metadata.name={handle.ref}"
        try:
            for ev, obj in self.api.watch(kind, x["rv"], field_selector=fs, timeout_s=WATCH_TIMEOUT_S):
                x["rv"] = obj["metadata"].get("resourceVersion", x["rv"])
                if ev in ("ADDED", "MODIFIED"):
                    x["job"] = obj
                elif ev == "DELETED":
                    x["job"] = {"deleted": True}
        except Gone:
            items, x["rv"] = self.api.list(kind, field_selector=fs)
            x["job"] = items[0] if items else {"deleted": True}
        return x["job"]

    def poll(self, handle: StageHandle) -> StageOutcome | None:
        job = self._follow(handle)
        if job is not None and job.get("deleted"):
            return StageOutcome(handle.stage, False, f"Job {handle.ref} was deleted", self.logs(handle.stage, tail=LOG_TAIL))
        if job is not None and diagnose.job_complete(job):
            return StageOutcome(handle.stage, True, "", self.logs(handle.stage, tail=LOG_TAIL))
        pods = self.api.list("Pod", self._stage_selector(handle.stage))[0]
        events = self.api.list("Event", field_selector="involvedObject.kind=Pod")[0] if pods else []
        problems = [p for p in (diagnose.pod_problem(pod, events) for pod in pods) if p]
        for line, _fatal in problems:
            if line not in handle.extra["reported"]:
                handle.extra["reported"].add(line)
                self.echo(f"{handle.stage}: {line}")
        failed = diagnose.job_failure(job) if job else None
        if failed:
            pod_lines = [line for line, _ in problems if not line.startswith("Pending")]
            reason = pod_lines[0] if pod_lines else failed
            return StageOutcome(handle.stage, False, reason, self.logs(handle.stage, tail=LOG_TAIL))
        fatal = next((line for line, f in problems if f), None)
        pending = next((line for line, _ in problems if line.startswith("Pending")), None)
        if pending and all(p["status"].get("phase") == "Pending" for p in pods):
            if handle.extra["pending_since"] is None:
                handle.extra["pending_since"] = self.clock()
            if self.clock() - handle.extra["pending_since"] > self.pending_timeout_s:
                fatal = f"{pending} (still Pending after {self.pending_timeout_s:.0f}s)"
        else:
            handle.extra["pending_since"] = None
        if fatal:
            self.cancel(handle)
            return StageOutcome(handle.stage, False, fatal, self.logs(handle.stage, tail=LOG_TAIL))
        return None

    def progress(self, handle: StageHandle) -> Progress | None:
        from eagle3.pipeline.local import parse_progress

        x = handle.extra
        if x["progress_at"] is not None and self.clock() - x["progress_at"] < PROGRESS_EVERY_S:
            return x["progress"]
        x["progress_at"] = self.clock()
        for line in reversed(self.logs(handle.stage, tail=50)):
            rec = parse_progress(line)
            if rec is not None:
                extra = {k: v for k, v in rec.items() if k not in ("stage", "done", "total", "unit", "rate")}
                x["progress"] = Progress(rec.get("done", 0.0), rec.get("total"), rec.get("unit", ""), rec.get("rate"), extra)
                break
        return x["progress"]

    def cancel(self, handle: StageHandle) -> None:
        """Delete the Job (and its pods: SIGTERM, then the grace period; train checkpoints)."""
        self.api.delete(handle.extra.get("kind", "Job"), handle.ref, propagation="Foreground")

    def _latest_pod(self, stage: str) -> dict | None:
        pods = self.api.list("Pod", self._stage_selector(stage))[0]
        # multi-node: rank 0 (completion index 0) speaks for the stage
        rank0 = [p for p in pods if p["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", "0") == "0"]
        return diagnose.newest(rank0 or pods)

    def logs(self, stage: str, follow: bool = False, tail: int | None = None) -> list[str]:
        pod = self._latest_pod(stage)
        if pod is None:
            return []
        if follow:
            lines = []
            for line in self.api.stream_logs(pod["metadata"]["name"], self._container(stage)):
                lines.append(line)
            return lines[-tail:] if tail else lines
        return self.api.logs(pod["metadata"]["name"], self._container(stage), tail=tail)

    @staticmethod
    def _container(stage: str) -> str:
        return "serve" if stage == "serve" else "stage"

    def down(self) -> list[str]:
        """Delete every object labelled with this run (Jobs with their pods); keep PVCs and RBAC."""
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
