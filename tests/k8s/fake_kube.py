"""FakeKubeApi: a test double with KubeClient's verbs over ApiServerDouble (strict: RBAC from the
rendered Role, official schemas, selectors, resourceVersion/410). Nothing here talks to a cluster.

Tests play the cluster (the Job controller, the scheduler, the kubelet) with ``upsert``/``remove``,
hooks that run whenever the client starts a watch (``on_watch``), ``gone_next`` (the next watches
of a kind answer 410 at once), ``compact`` and ``expire_watch_after``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from eagle3.k8s.kube import Gone, KubeError, NotFound
from tests.k8s.apiserver_double import ApiServerDouble


def role_rules_of(objects: list[dict]) -> list[dict]:
    """The rules of the rendered Role (what the double grants)."""
    return next(o for o in objects if o["kind"] == "Role")["rules"]


class FakeKubeApi:
    """Test double of ``eagle3.k8s.kube.KubeClient`` (same verbs and return values)."""

    def __init__(self, namespace: str, role_rules: list[dict]) -> None:
        self.server = ApiServerDouble(namespace, role_rules)
        self.namespace = namespace
        self.calls = self.server.calls
        self.objects = self.server.objects
        self.pod_logs = self.server.pod_logs
        self.gone_next: dict[str, int] = {}
        self.on_watch: list[Callable[[FakeKubeApi, str], None]] = []

    @property
    def rv(self) -> int:
        return self.server.rv

    # -- the cluster's side
    def upsert(self, obj: dict) -> dict:
        return self.server.upsert(obj)

    def remove(self, kind: str, name: str) -> None:
        self.server.remove(kind, name)

    def compact(self) -> None:
        self.server.compact()

    def expire_watch_after(self, kind: str, events: int) -> None:
        self.server.expire_watch_after(kind, events)

    # -- KubeClient's verbs
    def get(self, kind: str, name: str) -> dict | None:
        self.calls.append(("get", kind, name))
        try:
            return self.server.get(kind, name)
        except NotFound:
            return None

    def list(self, kind: str, selector: str | None = None, field_selector: str | None = None) -> tuple[list[dict], str]:
        self.calls.append(("list", kind, selector, field_selector))
        return self.server.list(kind, selector, field_selector)

    def create(self, obj: dict) -> dict:
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        return self.server.create(obj)

    def replace(self, obj: dict) -> dict:
        self.calls.append(("replace", obj["kind"], obj["metadata"]["name"]))
        return self.server.update(obj)

    def delete(self, kind: str, name: str, propagation: str = "Background") -> bool:
        self.calls.append(("delete", kind, name, propagation))
        try:
            self.server.delete(kind, name, propagation)
        except NotFound:
            return False
        return True

    def watch(self, kind: str, resource_version: str, selector: str | None = None,
              field_selector: str | None = None, timeout_s: float = 1.0) -> Iterator[tuple[str, dict]]:
        self.calls.append(("watch", kind, resource_version))
        for hook in list(self.on_watch):
            hook(self, kind)
        if self.gone_next.get(kind):
            self.server.authorize("watch", kind)
            self.gone_next[kind] -= 1
            raise Gone(f"watch {kind}: too old resource version: {resource_version}", 410)
        yield from self.server.watch(kind, resource_version, selector, field_selector)

    def logs(self, pod: str, container: str | None = None, tail: int | None = None) -> list[str]:
        self.calls.append(("logs", pod, container, tail))
        try:
            return self.server.logs(pod, tail)
        except NotFound:
            return []

    def stream_logs(self, pod: str, container: str | None = None) -> Iterator[str]:
        self.calls.append(("logs", pod, container, None))
        yield from self.server.logs(pod)

    def can_i(self, verb: str, group: str, resource: str) -> bool:
        return self.server.allowed(verb, group, resource)


__all__ = ["FakeKubeApi", "KubeError", "role_rules_of"]
