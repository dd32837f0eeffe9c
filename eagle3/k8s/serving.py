"""The server on Kubernetes: the vLLM Deployment, its Service and NetworkPolicy, up and down.

Ready means a pod passes the startup probe (/v1/models with the API key). Time Pending for GPUs
does not count against ``serve.startup_timeout_s`` (that is for loading weights): it is reported
like a stage's and waits, unless ``kubernetes.pending_timeout_s``. Down means the pods are gone,
so their GPUs are free before a GPU Job is submitted.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from eagle3.config import PipelineConfig
from eagle3.errors import StageError
from eagle3.k8s import diagnose
from eagle3.k8s.follow import GONE_TIMEOUT_S, PendingReport, PodWatch, wait_pods_gone
from eagle3.k8s.kube import AlreadyExists
from eagle3.k8s.render import stage_objects

SERVE_KINDS = ("NetworkPolicy", "Service", "Deployment")  # created in this order, deleted in reverse


class ServeHost(Protocol):
    """What the server's control uses of the Kubernetes backend that holds it."""

    cfg: PipelineConfig
    api: Any
    namespace: str
    objects: list[dict]
    echo: Callable[[str], None]
    clock: Callable[[], float]
    pending_timeout_s: float | None

    def prepare(self) -> None: ...

    def of_kind(self, *kinds: str) -> list[dict]: ...

    def apply(self, obj: dict) -> None: ...

    def stage_selector(self, stage: str) -> str: ...


class ServeControl:
    def __init__(self, backend: ServeHost) -> None:
        self.b = backend

    @property
    def name(self) -> str:
        return f"eagle3-{self.b.cfg.run_id}-serve"

    @property
    def selector(self) -> str:
        return self.b.stage_selector("serve")

    def url(self) -> str:
        return f"http://{self.name}.{self.b.namespace}.svc:{self.b.cfg.serve.port or 8000}/v1"

    def start(self) -> str:
        b = self.b
        b.prepare()
        for pvc in b.of_kind("PersistentVolumeClaim"):
            try:
                b.api.create(pvc)  # the shared model cache: created once, never replaced
            except AlreadyExists:
                pass
        objects = stage_objects(b.objects, "serve")
        for kind in SERVE_KINDS:
            for obj in (o for o in objects if o["kind"] == kind):
                b.apply(obj)
        self._wait_ready()
        return self.url()

    def _wait_ready(self) -> None:
        b, cfg = self.b, self.b.cfg
        loading_since: float | None = None
        pending = PendingReport()
        reported: set[str] = set()
        watch = PodWatch(b.api, self.selector)
        watch.relist()
        while True:
            live = [p for p in watch.pods.values() if not p["metadata"].get("deletionTimestamp")]
            if any(diagnose.pod_ready(p) for p in live):
                return
            scheduled = [p for p in live if diagnose.pod_scheduled(p)]
            unscheduled = [p for p in live if not diagnose.pod_scheduled(p)]
            events = b.api.list("Event", field_selector="involvedObject.kind=Pod")[0] if unscheduled else []
            pending_line = None
            for pod in live:
                problem = diagnose.pod_problem(pod, events)
                if problem is None:
                    continue
                line, fatal = problem
                if line.startswith("Pending"):
                    pending_line = pending_line or line
                    continue
                if line not in reported:
                    reported.add(line)
                    b.echo(f"serve: {line}")
                if fatal or line.startswith(("exit code", "OOMKilled")):
                    raise StageError(f"the server did not start: {line}")
            now = b.clock()
            shown = pending.update(pending_line if unscheduled and not scheduled else None, now)
            if shown:
                b.echo(f"serve: {shown}")
            if b.pending_timeout_s is not None and pending.waited(now) > b.pending_timeout_s:
                raise StageError(f"the server did not start: {pending.line} (still Pending after "
                                 f"kubernetes.pending_timeout_s={b.pending_timeout_s:.0f}s)")
            if scheduled and loading_since is None:
                loading_since = now
            if loading_since is not None and now - loading_since > cfg.serve.startup_timeout_s:
                raise StageError(f"the server was not ready within serve.startup_timeout_s={cfg.serve.startup_timeout_s:.0f}s "
                                 "of being scheduled")
            watch.advance()

    def stop(self) -> None:
        """Delete the Deployment, Service and NetworkPolicy; return once the server's pods are gone."""
        b = self.b
        for kind in reversed(SERVE_KINDS):
            b.api.delete(kind, self.name, propagation="Foreground")
        wait_pods_gone(b.api, self.selector, "serve", b.cfg.kubernetes.termination_grace_s + GONE_TIMEOUT_S, b.clock)

    def stop_leftover(self, stage: str) -> None:
        """Before a GPU Job: a server an earlier eagle3ctl left running (a detached generate) holds the GPUs."""
        if self.b.api.get("Deployment", self.name) is not None:
            self.b.echo(f"{stage}: stopping the server an earlier eagle3ctl left running, to free its GPUs")
            self.stop()
