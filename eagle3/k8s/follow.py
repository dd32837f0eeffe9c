"""Following objects by watch, never by sleep-polling: a watch resumes from the last
resourceVersion it saw, and a 410 Gone (history compacted, or the watch cut off) is answered by
listing again and watching from the list's version."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eagle3.errors import StageError
from eagle3.k8s.kube import Gone

WATCH_TIMEOUT_S = 1.0
GONE_TIMEOUT_S = 300.0  # deleted pods must be gone within this (on top of their grace period)
PENDING_REPORT_EVERY_S = 300.0  # a Pending pod is reported again this often (and when the reason changes)


@dataclass
class ObjectWatch:
    """One named object (a Job, a JobSet), kept current from its watch."""

    api: Any
    kind: str
    name: str
    rv: str = ""
    obj: dict | None = None  # None: not seen yet; {"deleted": True} once gone

    def start(self) -> None:
        items, self.rv = self.api.list(self.kind, field_selector=f"metadata.name={self.name}")
        self.obj = items[0] if items else None

    def advance(self) -> dict | None:
        fs = f"metadata.name={self.name}"
        try:
            for ev, obj in self.api.watch(self.kind, self.rv, field_selector=fs, timeout_s=WATCH_TIMEOUT_S):
                self.rv = obj.get("metadata", {}).get("resourceVersion", self.rv)
                if ev in ("ADDED", "MODIFIED"):
                    self.obj = obj
                elif ev == "DELETED":
                    self.obj = {"deleted": True}
        except Gone:
            items, self.rv = self.api.list(self.kind, field_selector=fs)
            self.obj = items[0] if items else {"deleted": True}
        return self.obj


@dataclass
class PodWatch:
    """The pods matching a label selector, by name, kept current from their watch."""

    api: Any
    selector: str
    rv: str = ""
    pods: dict[str, dict] = field(default_factory=dict)

    def relist(self) -> None:
        items, self.rv = self.api.list("Pod", self.selector)
        self.pods = {p["metadata"]["name"]: p for p in items}

    def advance(self) -> dict[str, dict]:
        try:
            for ev, pod in self.api.watch("Pod", self.rv, selector=self.selector, timeout_s=WATCH_TIMEOUT_S):
                self.rv = pod.get("metadata", {}).get("resourceVersion", self.rv)
                if ev == "DELETED":
                    self.pods.pop(pod["metadata"]["name"], None)
                elif ev in ("ADDED", "MODIFIED"):
                    self.pods[pod["metadata"]["name"]] = pod
        except Gone:
            self.relist()
        return self.pods


def wait_pods_gone(api: Any, selector: str, what: str, timeout_s: float, clock: Callable[[], float]) -> None:
    """Return once no pod matches ``selector`` (their GPUs are free); StageError after ``timeout_s``."""
    deadline = clock() + timeout_s
    watch = PodWatch(api, selector)
    watch.relist()
    while watch.pods:
        if clock() > deadline:
            raise StageError(f"{what}: pods {', '.join(sorted(watch.pods))} still exist after deletion; their GPUs are not free")
        watch.advance()


def wait_object_gone(api: Any, kind: str, name: str, clock: Callable[[], float]) -> None:
    """Return once ``kind/name`` is gone (a Foreground deletion waits for its pods first)."""
    deadline = clock() + GONE_TIMEOUT_S
    watch = ObjectWatch(api, kind, name)
    watch.start()
    while watch.obj is not None and not watch.obj.get("deleted"):
        if clock() > deadline:
            raise StageError(f"{kind} {name} is still being deleted after {GONE_TIMEOUT_S:.0f}s")
        watch.advance()


@dataclass
class PendingReport:
    """When a Pending pod is reported: when first seen, when the scheduler's reason changes, and
    every PENDING_REPORT_EVERY_S while it stays Pending."""

    since: float | None = None
    reported_at: float | None = None
    line: str = ""

    def update(self, line: str | None, now: float) -> str | None:
        """The line to print now, if any (None: nothing new)."""
        if line is None:
            self.since = self.reported_at = None
            self.line = ""
            return None
        if self.since is None:
            self.since = now
        if line != self.line or self.reported_at is None:
            self.line, self.reported_at = line, now
            waited = now - self.since
            return line if waited < 1 else f"{line} (Pending for {waited / 60:.0f} min)"
        if now - self.reported_at >= PENDING_REPORT_EVERY_S:
            self.reported_at = now
            return f"still {line} (Pending for {(now - self.since) / 60:.0f} min)"
        return None

    def waited(self, now: float) -> float:
        return 0.0 if self.since is None else now - self.since
