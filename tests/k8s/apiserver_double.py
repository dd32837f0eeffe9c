"""ApiServerDouble: a strict test double of one namespace of a Kubernetes API server, in memory.

Not a cluster: no controllers, scheduler or kubelet run here; tests play them by writing
status through the cluster-side methods (``upsert``, ``remove``, ``compact``). What the real API
server would refuse, the double refuses, for every call from the client side:

- RBAC: only what the Role's rules grant (the chart's rendered Role), else Forbidden (403);
- schema: every object created or updated is validated strictly (unknown fields fail) against
  the official schemas of the oldest and the newest supported Kubernetes (kubernetes-validate);
  a JobSet (a CRD) against its v1alpha2 fields, with its Job template as a batch/v1 Job;
  plus the Job validation rules the backend relies on (backoffLimitPerIndex needs Indexed, …);
- label selectors (=, ==, !=, in, notin, exists, !exists) and the field selectors the API
  supports for the kind (others: 400), applied to list and watch;
- resourceVersion: each write gets the next one; an update with a stale one is a Conflict
  (409); a create that carries one is Invalid; a watch from a version older than the retained
  history (``compact``) is Gone (410), as is one cut off mid-stream (``expire_watch_after``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator

import kubernetes_validate

from eagle3.k8s.kube import AlreadyExists, Conflict, Forbidden, Gone, Invalid, KubeError, NotFound
from eagle3.k8s.permissions import RESOURCES, granted
from tests.k8s.checks import K8S_VERSIONS

KINDS = {**RESOURCES, "Role": ("rbac.authorization.k8s.io", "roles"),
         "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"), "Secret": ("", "secrets")}
API_VERSIONS = {"": "v1", "apps": "apps/v1", "batch": "batch/v1", "networking.k8s.io": "networking.k8s.io/v1",
                "rbac.authorization.k8s.io": "rbac.authorization.k8s.io/v1", "jobset.x-k8s.io": "jobset.x-k8s.io/v1alpha2"}
FIELD_SELECTORS = {"*": {"metadata.name", "metadata.namespace"},
                   "Event": {"involvedObject.kind", "involvedObject.name", "involvedObject.namespace", "reason", "type"},
                   "Pod": {"status.phase", "spec.nodeName"}, "Job": {"status.successful"}}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_TERM = re.compile(r"\s*(!?)([A-Za-z0-9./_-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


class BadRequest(KubeError):
    pass


def split_terms(selector: str) -> list[str]:
    """A selector's terms: commas separate them, except inside `in (a,b)`."""
    terms, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    return [t for t in terms + [cur] if t.strip()]


def label_match(labels: dict[str, str], selector: str | None) -> bool:
    for term in split_terms(selector or ""):
        m = _TERM.match(term)
        if not m:
            raise BadRequest(f"unable to parse requirement: {term!r}", 400)
        neg, key, op, value, setop, values = m.groups()
        if op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif setop:
            vs = {v.strip() for v in values.split(",")}
            ok = labels.get(key) in vs if setop == "in" else labels.get(key) not in vs
        else:
            ok = (key in labels) != bool(neg)
        if not ok:
            return False
    return True


def _field(obj: dict, path: str) -> str:
    cur: object = obj
    for part in path.split("."):
        cur = cur.get(part, "") if isinstance(cur, dict) else ""
    return "" if cur is None else str(cur)


def field_match(kind: str, obj: dict, selector: str | None) -> bool:
    for term in split_terms(selector or ""):
        key, op, value = re.match(r"^([^!=]+)(==|=|!=)(.*)$", term.strip()).groups()
        if key not in FIELD_SELECTORS["*"] | FIELD_SELECTORS.get(kind, set()):
            raise BadRequest(f'field label not supported: {key}', 400)
        if (_field(obj, key) == value) != (op != "!="):
            return False
    return True


# -- validation ------------------------------------------------------------------------

JOBSET_FIELDS = {
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
             "coordinator", "managedBy", "ttlSecondsAfterFinished"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
    "rule": {"name", "action", "onJobFailureReasons", "targetReplicatedJobs"},
    "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded", "PodFailurePolicy"}


def _only(obj: dict, allowed: set[str], where: str) -> None:
    extra = set(obj) - allowed
    if extra:
        raise Invalid(f"{where}: unknown field(s) {sorted(extra)}", 422)


def validate_jobset(obj: dict) -> None:
    """The JobSet v1alpha2 fields the CRD's schema allows; each Job template as a batch/v1 Job."""
    _only(obj, {"apiVersion", "kind", "metadata", "spec"}, "JobSet")
    spec = obj["spec"]
    _only(spec, JOBSET_FIELDS["spec"], "JobSet.spec")
    _only(spec.get("network", {}), JOBSET_FIELDS["network"], "JobSet.spec.network")
    fp = spec.get("failurePolicy", {})
    _only(fp, JOBSET_FIELDS["failurePolicy"], "JobSet.spec.failurePolicy")
    for rule in fp.get("rules", []):
        _only(rule, JOBSET_FIELDS["rule"], "JobSet.spec.failurePolicy.rules[]")
        if rule.get("action") not in JOBSET_ACTIONS or not re.match(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", rule.get("name", "")):
            raise Invalid(f"JobSet failurePolicy rule {rule}: action or name invalid", 422)
        if set(rule.get("onJobFailureReasons", [])) - JOB_FAILURE_REASONS:
            raise Invalid(f"JobSet failurePolicy rule {rule['name']}: unknown onJobFailureReasons", 422)
    for rj in spec["replicatedJobs"]:
        _only(rj, JOBSET_FIELDS["replicatedJob"], "JobSet.spec.replicatedJobs[]")
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}-0"},
               **{k: v for k, v in rj["template"].items() if k == "spec"}}
        validate_object(job)


def validate_job_rules(job: dict) -> None:
    """Rules of the Job API beyond its schema (pkg/apis/batch/validation) that the chart must meet."""
    spec = job["spec"]
    indexed = spec.get("completionMode") == "Indexed"
    problems = []
    if not indexed and ("backoffLimitPerIndex" in spec or "maxFailedIndexes" in spec):
        problems.append("spec.backoffLimitPerIndex/maxFailedIndexes: requires indexed completion mode")
    if "maxFailedIndexes" in spec and "backoffLimitPerIndex" not in spec:
        problems.append("spec.maxFailedIndexes: requires backoffLimitPerIndex")
    if indexed and "completions" not in spec:
        problems.append("spec.completions: Required value when completionMode is Indexed")
    if "maxFailedIndexes" in spec and spec["maxFailedIndexes"] > spec.get("completions", 0):
        problems.append("spec.maxFailedIndexes: must be less than or equal to completions")
    restart = spec["template"]["spec"].get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        problems.append('spec.template.spec.restartPolicy: valid values: "OnFailure", "Never"')
    rules = spec.get("podFailurePolicy", {}).get("rules", [])
    if rules and restart != "Never":
        problems.append("spec.podFailurePolicy: only supported with restartPolicy Never")
    containers = {c["name"] for c in spec["template"]["spec"]["containers"]}
    for r in rules:
        if r["action"] == "FailIndex" and "backoffLimitPerIndex" not in spec:
            problems.append("spec.podFailurePolicy.rules: FailIndex rule action requires the backoffLimitPerIndex to be set")
        name = r.get("onExitCodes", {}).get("containerName")
        if name is not None and name not in containers:
            problems.append(f"spec.podFailurePolicy.rules: containerName {name!r} is not a container of the pod")
    if problems:
        raise Invalid(f"Job.batch {job['metadata']['name']!r} is invalid: " + "; ".join(problems), 422)


def validate_deployment_rules(dep: dict) -> None:
    selector = dep["spec"]["selector"].get("matchLabels", {})
    labels = dep["spec"]["template"]["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in selector.items()):
        raise Invalid(f"Deployment {dep['metadata']['name']}: spec.template.metadata.labels: `selector` does not match template `labels`", 422)


def validate_object(obj: dict) -> None:
    name = obj.get("metadata", {}).get("name", "")
    if not _NAME.match(name) or len(name) > 253:
        raise Invalid(f"{obj.get('kind')} {name!r}: metadata.name: a lowercase RFC 1123 subdomain is required", 422)
    if obj["kind"] == "JobSet":
        validate_jobset(obj)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise Invalid(f"{obj['kind']} {name}: invalid for Kubernetes {version}: {str(e).splitlines()[0]}", 422) from None
    if obj["kind"] == "Job":
        validate_job_rules(obj)
    elif obj["kind"] == "Deployment":
        validate_deployment_rules(obj)


# -- the server ------------------------------------------------------------------------

class ApiServerDouble:
    """One namespace of an API server (a test double); see the module docstring."""

    def __init__(self, namespace: str, role_rules: list[dict]) -> None:
        self.namespace = namespace
        self.grants = granted(role_rules)
        self.objects: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, str, dict]] = []  # (rv, type, kind, object)
        self.rv = 100
        self.oldest_rv = 100  # watches from before this answer 410 (the retained history starts here)
        self.calls: list[tuple] = []  # what the client asked, in order
        self.rbac_calls: set[tuple[str, str]] = set()  # (verb, kind) the client made and RBAC allowed
        self._expire_after: dict[str, int] = {}
        self.pod_logs: dict[str, list[str]] = {}

    # -- the cluster's side (controllers, kubelet, scheduler): unchecked
    def upsert(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        obj.setdefault("apiVersion", API_VERSIONS[KINDS[obj["kind"]][0]])
        obj.setdefault("metadata", {}).setdefault("namespace", self.namespace)
        key = (obj["kind"], obj["metadata"]["name"])
        typ = "MODIFIED" if key in self.objects else "ADDED"
        if typ == "ADDED":
            obj["metadata"].setdefault("creationTimestamp", "2025-01-01T00:00:00Z")
            obj["metadata"].setdefault("uid", f"uid-{self.rv + 1}")
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self.history.append((self.rv, typ, obj["kind"], copy.deepcopy(obj)))
        return copy.deepcopy(obj)

    def remove(self, kind: str, name: str) -> None:
        obj = self.objects.pop((kind, name))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, "DELETED", kind, obj))

    def compact(self) -> None:
        """Forget the history so far (etcd compaction): a watch from an older version gets 410."""
        self.history.clear()
        self.oldest_rv = self.rv

    def expire_watch_after(self, kind: str, events: int) -> None:
        """The next watch of ``kind`` delivers ``events`` events, then is cut off with 410 Gone."""
        self._expire_after[kind] = events

    # -- checks
    def authorize(self, verb: str, kind: str, what: str = "") -> None:
        group, resource = KINDS[kind]
        if (verb, group, resource) not in self.grants:
            base, _, sub = resource.partition("/")
            shown = f"{base}/{sub}" if sub else (f"{resource}.{group}" if group else resource)
            raise Forbidden(f'{shown} {what} is forbidden: User "system:serviceaccount:{self.namespace}:eagle3" '
                            f'cannot {verb} resource "{base}"' + (f' with subresource "{sub}"' if sub else "")
                            + f' in API group "{group}" in the namespace "{self.namespace}"', 403)
        self.rbac_calls.add((verb, kind))

    def allowed(self, verb: str, group: str, resource: str) -> bool:
        """A SelfSubjectAccessReview's answer (every authenticated user may ask)."""
        return (verb, group, resource) in self.grants

    # -- the client's side: every call authorized, every object validated
    def get(self, kind: str, name: str) -> dict:
        self.authorize("get", kind, name)
        obj = self.objects.get((kind, name))
        if obj is None:
            raise NotFound(f'{KINDS[kind][1]} "{name}" not found', 404)
        return copy.deepcopy(obj)

    def list(self, kind: str, selector: str | None = None, field_selector: str | None = None) -> tuple[list[dict], str]:
        self.authorize("list", kind)
        items = [copy.deepcopy(o) for (k, _), o in sorted(self.objects.items())
                 if k == kind and label_match(o["metadata"].get("labels", {}), selector) and field_match(kind, o, field_selector)]
        return items, str(self.rv)

    def create(self, obj: dict) -> dict:
        kind, name = obj["kind"], obj["metadata"]["name"]
        self.authorize("create", kind, name)
        if obj["metadata"].get("resourceVersion"):
            raise Invalid(f"{kind} {name}: metadata.resourceVersion: Invalid value: must be empty on create", 422)
        ns = obj["metadata"].get("namespace")
        if ns not in (None, self.namespace):
            raise BadRequest(f"the namespace of the object ({ns}) does not match the namespace on the request ({self.namespace})", 400)
        validate_object(obj)
        if (kind, name) in self.objects:
            raise AlreadyExists(f'{KINDS[kind][1]} "{name}" already exists', 409)
        return self.upsert(obj)

    def update(self, obj: dict) -> dict:
        kind, name = obj["kind"], obj["metadata"]["name"]
        self.authorize("update", kind, name)
        current = self.objects.get((kind, name))
        if current is None:
            raise NotFound(f'{KINDS[kind][1]} "{name}" not found', 404)
        rv = obj["metadata"].get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise Conflict(f'Operation cannot be fulfilled on {KINDS[kind][1]} "{name}": the object has been modified; '
                           "please apply your changes to the latest version and try again", 409)
        validate_object({**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k != "resourceVersion"}})
        if kind == "Job" and obj["spec"]["template"] != current["spec"]["template"]:
            raise Invalid(f"Job.batch {name!r} is invalid: spec.template: field is immutable", 422)
        return self.upsert(obj)

    def delete(self, kind: str, name: str, propagation: str = "Background") -> None:
        self.authorize("delete", kind, name)
        if propagation not in ("Background", "Foreground", "Orphan"):
            raise BadRequest(f"propagationPolicy {propagation!r} is not supported", 400)
        if (kind, name) not in self.objects:
            raise NotFound(f'{KINDS[kind][1]} "{name}" not found', 404)
        self.remove(kind, name)

    def watch(self, kind: str, resource_version: str, selector: str | None = None,
              field_selector: str | None = None) -> Iterator[tuple[str, dict]]:
        """The events after ``resource_version`` that match, as the API sends them; raises Gone."""
        self.authorize("watch", kind)
        label_match({}, selector), field_match(kind, {}, field_selector)  # a bad selector fails before streaming
        if resource_version in ("", "0"):
            start, backlog = self.rv, [("ADDED", o) for (k, _), o in sorted(self.objects.items()) if k == kind]
        else:
            start, backlog = int(resource_version), []
            if start < self.oldest_rv:
                raise Gone(f"too old resource version: {start} ({self.oldest_rv})", 410)
        events = backlog + [(typ, obj) for rv, typ, k, obj in self.history if rv > start and k == kind]
        limit = self._expire_after.pop(kind, None)
        sent = 0
        for typ, obj in events:
            if not (label_match(obj["metadata"].get("labels", {}), selector) and field_match(kind, obj, field_selector)):
                continue
            if limit is not None and sent >= limit:
                raise Gone(f"too old resource version: {start} ({self.rv})", 410)
            sent += 1
            yield typ, copy.deepcopy(obj)
        if limit is not None and sent >= limit:
            raise Gone(f"too old resource version: {start} ({self.rv})", 410)

    def logs(self, pod: str, tail: int | None = None) -> list[str]:
        self.authorize("get", "PodLog", pod)
        if ("Pod", pod) not in self.objects:
            raise NotFound(f'pods "{pod}" not found', 404)
        lines = self.pod_logs.get(pod, [])
        return lines[-tail:] if tail else list(lines)
