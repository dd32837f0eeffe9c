"""Every Kubernetes API call the backend makes, as (verb, kind): the one list RBAC comes from.

The chart's Role grants exactly these (``role_rules`` writes its rules into the chart values),
``helm test`` asks the API server about each of them (SelfSubjectAccessReview), and the test
double of the API server refuses any call the rendered Role does not grant. A call added to
the backend without a line here fails its tests; a line here no test exercises fails too.
"""

from __future__ import annotations

from dataclasses import dataclass

# kind -> (API group, resource); subresources are written "pods/log".
RESOURCES: dict[str, tuple[str, str]] = {
    "ServiceAccount": ("", "serviceaccounts"),
    "ConfigMap": ("", "configmaps"),
    "PersistentVolumeClaim": ("", "persistentvolumeclaims"),
    "Service": ("", "services"),
    "Pod": ("", "pods"),
    "PodLog": ("", "pods/log"),
    "Event": ("", "events"),
    "Deployment": ("apps", "deployments"),
    "Job": ("batch", "jobs"),
    "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
    "JobSet": ("jobset.x-k8s.io", "jobsets"),
}

VERB_ORDER = ("get", "list", "watch", "create", "update", "delete")


@dataclass(frozen=True)
class Call:
    verb: str
    kind: str
    why: str

    @property
    def group(self) -> str:
        return RESOURCES[self.kind][0]

    @property
    def resource(self) -> str:
        return RESOURCES[self.kind][1]


RUN_CALLS: tuple[Call, ...] = (
    Call("get", "ServiceAccount", "the namespace is prepared (helm install) before the first pod"),
    Call("get", "ConfigMap", "the run's config: its resourceVersion before replacing it"),
    Call("create", "ConfigMap", "the run's config, first run"),
    Call("update", "ConfigMap", "the run's config, a later run"),
    Call("list", "ConfigMap", "down"),
    Call("delete", "ConfigMap", "down"),
    Call("create", "PersistentVolumeClaim", "the shared model cache, once (AlreadyExists is fine)"),
    Call("get", "Deployment", "the server: replace it, or find one an earlier run left before a GPU Job"),
    Call("create", "Deployment", "the server"),
    Call("update", "Deployment", "the server, when an earlier run's is still there"),
    Call("delete", "Deployment", "the server, once generate committed"),
    Call("list", "Deployment", "down"),
    Call("get", "Service", "the server's and multi-node Services: replace"),
    Call("create", "Service", "the server's Service, multi-node headless Services"),
    Call("update", "Service", "those Services, when an earlier run's are still there"),
    Call("delete", "Service", "the server's Service"),
    Call("list", "Service", "down"),
    Call("get", "NetworkPolicy", "the server's NetworkPolicy: replace"),
    Call("create", "NetworkPolicy", "only the run's generate pods reach the server"),
    Call("update", "NetworkPolicy", "the same, when an earlier run's is still there"),
    Call("delete", "NetworkPolicy", "with the server"),
    Call("list", "NetworkPolicy", "down"),
    Call("get", "Job", "attach: an earlier run's Job of the same input key"),
    Call("create", "Job", "a stage"),
    Call("delete", "Job", "a stage of another input key, a cancelled stage, a multi-node restart"),
    Call("list", "Job", "where a watch starts (resourceVersion), after 410 Gone, down"),
    Call("watch", "Job", "follow a stage"),
    Call("list", "Pod", "a stage's pods: diagnosis, logs, readiness, gone"),
    Call("watch", "Pod", "the server ready, pods gone before a GPU Job"),
    Call("delete", "Pod", "down"),
    Call("get", "PodLog", "log tails, progress, eagle3ctl logs"),
    Call("list", "Event", "the scheduler's reason for a Pending pod"),
)

JOBSET_CALLS: tuple[Call, ...] = (
    Call("get", "JobSet", "attach"),
    Call("create", "JobSet", "a multi-node stage (kubernetes.multi_node: jobset)"),
    Call("delete", "JobSet", "cancel, another input key"),
    Call("list", "JobSet", "where a watch starts, after 410 Gone, down"),
    Call("watch", "JobSet", "follow a multi-node stage"),
)


def run_calls(jobset: bool) -> tuple[Call, ...]:
    return RUN_CALLS + (JOBSET_CALLS if jobset else ())


def role_rules(calls: tuple[Call, ...]) -> list[dict]:
    """Role rules granting exactly ``calls``: one rule per (group, resource), verbs in a fixed order."""
    verbs: dict[tuple[str, str], set[str]] = {}
    for c in calls:
        verbs.setdefault((c.group, c.resource), set()).add(c.verb)
    return [{"apiGroups": [group], "resources": [resource], "verbs": [v for v in VERB_ORDER if v in vs]}
            for (group, resource), vs in verbs.items()]


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    """(verb, group, resource) triples a Role's rules grant (no wildcards: the chart writes none)."""
    out = set()
    for r in rules:
        for g in r.get("apiGroups", []):
            for res in r.get("resources", []):
                for v in r.get("verbs", []):
                    out.add((v, g, res))
    return out
