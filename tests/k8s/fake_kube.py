"""FakeKubeApi: a test double of the Kubernetes API with KubeClient's verbs.

It keeps objects in memory, stamps resourceVersions, records every call, and serves
watches from an event log. Tests script the cluster's side (the Job controller, the
scheduler, the kubelet) by calling ``upsert``/``remove`` or by queueing events and
Gone errors for the next watch. Nothing here talks to a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

from eagle3.k8s.kube import AlreadyExists, Forbidden, Gone


def _matches(obj: dict, selector: str | None, field_selector: str | None) -> bool:
    labels = obj["metadata"].get("labels", {})
    for term in filter(None, (selector or "").split(",")):
        k, v = term.split("=")
        if labels.get(k) != v:
            return False
    for term in filter(None, (field_selector or "").split(",")):
        k, v = term.split("=")
        if k == "metadata.name" and obj["metadata"]["name"] != v:
            return False
        if k == "involvedObject.kind" and obj.get("involvedObject", {}).get("kind") != v:
            return False
    return True


class FakeKubeApi:
    """Test double of ``eagle3.k8s.kube.KubeClient`` (in memory, scripted; no cluster)."""

    def __init__(self, namespace: str = "ml") -> None:
        self.namespace = namespace
        self.objects: dict[tuple[str, str], dict] = {}
        self.events: list[tuple[int, str, str, dict]] = []  # (rv, type, kind, object)
        self.rv = 100
        self.calls: list[tuple] = []
        self.forbidden_kinds: set[str] = set()
        self.gone_next: dict[str, int] = {}  # kind -> how many next watches answer 410
        self.on_watch: list[Callable[[FakeKubeApi, str], None]] = []  # the cluster acting while we watch
        self.pod_logs: dict[str, list[str]] = {}

    # -- the cluster's side
    def upsert(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        key = (obj["kind"], obj["metadata"]["name"])
        kind = "MODIFIED" if key in self.objects else "ADDED"
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self.events.append((self.rv, kind, obj["kind"], copy.deepcopy(obj)))
        return obj

    def remove(self, kind: str, name: str) -> None:
        obj = self.objects.pop((kind, name))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, "DELETED", kind, obj))

    # -- KubeClient's verbs
    def get(self, kind: str, name: str) -> dict | None:
        self.calls.append(("get", kind, name))
        obj = self.objects.get((kind, name))
        return copy.deepcopy(obj) if obj else None

    def list(self, kind: str, selector: str | None = None, field_selector: str | None = None) -> tuple[list[dict], str]:
        self.calls.append(("list", kind, selector, field_selector))
        items = [copy.deepcopy(o) for (k, _), o in sorted(self.objects.items()) if k == kind and _matches(o, selector, field_selector)]
        return items, str(self.rv)

    def create(self, obj: dict) -> dict:
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        if obj["kind"] in self.forbidden_kinds:
            raise Forbidden(f"create {obj['kind']}: forbidden", 403)
        if (obj["kind"], obj["metadata"]["name"]) in self.objects:
            raise AlreadyExists(f"create {obj['kind']} {obj['metadata']['name']}: already exists", 409)
        return self.upsert(obj)

    def replace(self, obj: dict) -> dict:
        self.calls.append(("replace", obj["kind"], obj["metadata"]["name"]))
        return self.upsert(obj)

    def delete(self, kind: str, name: str, propagation: str = "Background") -> bool:
        self.calls.append(("delete", kind, name, propagation))
        if (kind, name) not in self.objects:
            return False
        self.remove(kind, name)
        return True

    def watch(self, kind: str, resource_version: str, selector: str | None = None,
              field_selector: str | None = None, timeout_s: float = 1.0) -> Iterator[tuple[str, dict]]:
        self.calls.append(("watch", kind, resource_version))
        for hook in list(self.on_watch):
            hook(self, kind)
        if self.gone_next.get(kind):
            self.gone_next[kind] -= 1
            raise Gone(f"watch {kind}: too old resource version: {resource_version}", 410)
        start = int(resource_version or 0)
        for rv, typ, k, obj in list(self.events):
            if rv > start and k == kind and _matches(obj, selector, field_selector):
                yield typ, copy.deepcopy(obj)

    def logs(self, pod: str, container: str | None = None, tail: int | None = None) -> list[str]:
        lines = self.pod_logs.get(pod, [])
        return lines[-tail:] if tail else list(lines)

    def stream_logs(self, pod: str, container: str | None = None) -> Iterator[str]:
        yield from self.pod_logs.get(pod, [])
