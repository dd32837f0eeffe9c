"""Kubernetes behind a few kubectl verbs: get, list, create, replace, delete, watch, logs, can_i.

Objects go in and come out as plain dicts (the API's JSON), so the rendered chart objects
are submitted as they are and tests can stand in a test double with the same verbs
(``tests/k8s/fake_kube.py``). The kubernetes client is imported only here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3.errors import Eagle3Error

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

# kind -> (API class, method suffix); JobSet goes through the custom-objects API.
KINDS: dict[str, tuple[str, str]] = {
    "Job": ("BatchV1Api", "namespaced_job"),
    "Deployment": ("AppsV1Api", "namespaced_deployment"),
    "Service": ("CoreV1Api", "namespaced_service"),
    "ConfigMap": ("CoreV1Api", "namespaced_config_map"),
    "PersistentVolumeClaim": ("CoreV1Api", "namespaced_persistent_volume_claim"),
    "Pod": ("CoreV1Api", "namespaced_pod"),
    "Event": ("CoreV1Api", "namespaced_event"),
    "ServiceAccount": ("CoreV1Api", "namespaced_service_account"),
    "NetworkPolicy": ("NetworkingV1Api", "namespaced_network_policy"),
}
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
REQUEST_TIMEOUT_S = 60.0  # one API request; a hung connection must not hang the run


class KubeError(Eagle3Error):
    """The API server refused or failed a request; the message names the verb and object."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    pass


class AlreadyExists(KubeError):
    pass


class Forbidden(KubeError):
    pass


class Conflict(KubeError):
    """409 on update: the object changed since it was read (a stale resourceVersion)."""


class Invalid(KubeError):
    """422: the API server rejected the object (schema or validation)."""


class Gone(KubeError):
    """410: the watch's resourceVersion is too old; list again and watch from the new one."""


def _error(e: Any, what: str) -> KubeError:
    status = getattr(e, "status", 0) or 0
    reason = ""
    try:
        body = json.loads(e.body)
        message, reason = body.get("message") or e.reason, body.get("reason", "")
    except Exception:
        message = getattr(e, "reason", None) or str(e)
    if status == 409:
        cls: type[KubeError] = Conflict if reason == "Conflict" else AlreadyExists
    else:
        cls = {404: NotFound, 403: Forbidden, 410: Gone, 422: Invalid}.get(status, KubeError)
    return cls(f"{what}: {message}", status)


class KubeClient:
    """The real API, through the official kubernetes client."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        from kubernetes import client

        self._client, self._api_client, self.namespace = client, api_client, namespace

    @classmethod
    def connect(cls, context: str | None = None, namespace: str | None = None) -> KubeClient:
        """kubeconfig (context and its namespace), or the in-cluster ServiceAccount."""
        try:
            from kubernetes import client, config
        except ImportError:
            raise KubeError("the Kubernetes backend needs the API client: pip install -e '.[k8s]' in the eagle3ctl checkout") from None
        from kubernetes.config.config_exception import ConfigException

        try:
            if IN_CLUSTER_NAMESPACE.exists() and context is None:
                config.load_incluster_config()
                namespace = namespace or IN_CLUSTER_NAMESPACE.read_text().strip()
            else:
                config.load_kube_config(context=context)
                if namespace is None:
                    _, active = config.list_kube_config_contexts()
                    if context:
                        contexts, _ = config.list_kube_config_contexts()
                        active = next((c for c in contexts if c["name"] == context), active)
                    namespace = (active or {}).get("context", {}).get("namespace")
        except ConfigException as e:
            raise KubeError(f"no Kubernetes credentials: {str(e).splitlines()[0]} (set KUBECONFIG or run in-cluster)") from None
        return cls(client.ApiClient(), namespace or "default")

    # -- plumbing
    def _call(self, kind: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        what = f"{verb} {kind} {args[0] if args and isinstance(args[0], str) else ''}".rstrip()
        try:
            if kind == "JobSet":
                api = self._client.CustomObjectsApi(self._api_client)
                method = getattr(api, f"{verb}_namespaced_custom_object")
                return method(*JOBSET[:2], self.namespace, JOBSET[2], *args, **kwargs)
            api_cls, suffix = KINDS[kind]
            method = getattr(getattr(self._client, api_cls)(self._api_client), f"{verb}_{suffix}")
            if args:
                return method(args[0], self.namespace, *args[1:], **kwargs)
            return method(self.namespace, **kwargs)
        except self._client.ApiException as e:
            raise _error(e, what) from None
        except ValueError as e:  # the client's own validation of a body (pydantic), before sending
            lines = [ln.strip() for ln in str(e).splitlines()[1:3]]  # the field, then why
            raise KubeError(f"{what}: the kubernetes client refused the object: {': '.join(lines) or e}") from None

    def _raw(self, kind: str, verb: str, *args: Any, **kwargs: Any) -> dict:
        resp = self._call(kind, verb, *args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        return json.loads(resp.data)

    # -- verbs
    def get(self, kind: str, name: str) -> dict | None:
        try:
            return self._raw(kind, "read" if kind != "JobSet" else "get", name)
        except NotFound:
            return None

    def list(self, kind: str, selector: str | None = None, field_selector: str | None = None) -> tuple[list[dict], str]:
        """Items and the list's resourceVersion (where a watch starts)."""
        kw = {k: v for k, v in (("label_selector", selector), ("field_selector", field_selector)) if v}
        data = self._raw(kind, "list", **kw)
        return data.get("items", []), data.get("metadata", {}).get("resourceVersion", "")

    def create(self, obj: dict) -> dict:
        return self._raw(obj["kind"], "create", body=obj)

    def replace(self, obj: dict) -> dict:
        return self._raw(obj["kind"], "replace", obj["metadata"]["name"], body=obj)

    def delete(self, kind: str, name: str, propagation: str = "Background") -> bool:
        """False when it was already gone."""
        from kubernetes.client import V1DeleteOptions

        try:
            self._call(kind, "delete", name, body=V1DeleteOptions(propagation_policy=propagation),
                       _request_timeout=REQUEST_TIMEOUT_S)
        except NotFound:
            return False
        return True

    def watch(self, kind: str, resource_version: str, selector: str | None = None,
              field_selector: str | None = None, timeout_s: float = 1.0) -> Iterator[tuple[str, dict]]:
        """(type, object) events after ``resource_version``; raises Gone when it is too old.

        Read straight off the list call with watch=true, not through ``kubernetes.watch.Watch``:
        that one turns every event into a model class (which refuses objects with a missing
        field), and with ``deserialize=False`` it fails on an ERROR event (v37: KeyError
        'raw_object'), which is how the server says 410 in the middle of a stream.
        """
        from kubernetes.watch.watch import iter_resp_lines

        kw = {k: v for k, v in (("label_selector", selector), ("field_selector", field_selector)) if v}
        seconds = max(1, int(timeout_s))
        try:
            resp = self._call(kind, "list", watch=True, resource_version=resource_version, timeout_seconds=seconds,
                              allow_watch_bookmarks=True, _preload_content=False,
                              _request_timeout=seconds + REQUEST_TIMEOUT_S, **kw)
        except KubeError as e:
            raise e.__class__(f"watch {kind}: {e}", e.status) from None
        try:
            for line in iter_resp_lines(resp):
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    st = event.get("object") or {}
                    cls = Gone if st.get("code") == 410 else KubeError
                    raise cls(f"watch {kind}: {st.get('message') or st.get('reason') or 'error'}", st.get("code") or 0)
                yield event["type"], event["object"]
        finally:
            resp.close()
            resp.release_conn()

    def logs(self, pod: str, container: str | None = None, tail: int | None = None) -> list[str]:
        kw: dict[str, Any] = {"container": container} if container else {}
        if tail is not None:
            kw["tail_lines"] = tail
        api = self._client.CoreV1Api(self._api_client)
        try:
            resp = api.read_namespaced_pod_log(pod, self.namespace, _preload_content=False,
                                               _request_timeout=REQUEST_TIMEOUT_S, **kw)
        except self._client.ApiException:
            return []  # the container has not started (or the pod is gone): no log yet
        return resp.data.decode(errors="replace").splitlines()

    def stream_logs(self, pod: str, container: str | None = None) -> Iterator[str]:
        """Follow a pod's log until the container exits."""
        from kubernetes import watch

        api = self._client.CoreV1Api(self._api_client)
        kw = {"container": container} if container else {}
        yield from watch.Watch().stream(api.read_namespaced_pod_log, pod, self.namespace, **kw)

    def can_i(self, verb: str, group: str, resource: str) -> bool:
        sub = resource.split("/", 1)
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                  "spec": {"resourceAttributes": {"namespace": self.namespace, "verb": verb, "group": group,
                                                  "resource": sub[0], "subresource": sub[1] if len(sub) > 1 else ""}}}
        api = self._client.AuthorizationV1Api(self._api_client)
        try:
            resp = api.create_self_subject_access_review(review, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
        except self._client.ApiException as e:
            raise _error(e, "can-i") from None
        return bool(json.loads(resp.data).get("status", {}).get("allowed"))
