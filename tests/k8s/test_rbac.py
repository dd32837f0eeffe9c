"""RBAC comes from one list of the backend's calls: the chart's Role grants exactly those, a run
makes exactly those (every one of them, nothing else), and a call the Role lacks is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3.k8s.kube import Forbidden
from eagle3.k8s.permissions import JOBSET_CALLS, RUN_CALLS, granted, role_rules, run_calls
from eagle3.k8s.render import CHART_DIR, render_run
from tests.k8s.checks import by_name
from tests.k8s.conftest import FakeClock, job_status, make_backend, pod, prepared_api, scheduling_event
from tests.k8s.fake_kube import FakeKubeApi, role_rules_of

KEY = "d" * 64


def triples(calls) -> set[tuple[str, str, str]]:
    return {(c.verb, c.group, c.resource) for c in calls}


def test_the_charts_default_rules_are_the_call_list():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["rbac"]["rules"] == role_rules(RUN_CALLS)
    assert values["rbac"]["jobsetRules"] == role_rules(JOBSET_CALLS)


@pytest.mark.parametrize("multi_node", ["indexed", "jobset"])
def test_the_rendered_role_grants_exactly_the_calls(prod_cfg, multi_node):
    k8s = prod_cfg.kubernetes.model_copy(update={"multi_node": multi_node})
    role = by_name(render_run(prod_cfg.model_copy(update={"kubernetes": k8s})), "Role", "eagle3")
    assert granted(role["rules"]) == triples(run_calls(multi_node == "jobset"))
    resources = {res for r in role["rules"] for res in r["resources"]}
    assert not resources & {"secrets", "pods/exec", "roles", "rolebindings", "serviceaccounts/token"}
    assert all("*" not in r["verbs"] + r["resources"] + r["apiGroups"] for r in role["rules"])


def _run_everything(cfg, api, clock):
    """A run that touches every path: server up and down, stages submitted, followed, failed,
    replaced, attached, logs and progress, a multi-node restart, a second run, down."""
    b = make_backend(cfg, api, clock)
    name = f"eagle3-{cfg.run_id}-serve"
    api.on_watch.append(lambda fake, kind: kind == "Pod" and ("Pod", f"{name}-0") not in fake.objects
                        and fake.upsert(pod(f"{name}-0", "serve", ready=True)))
    b.start_serve()
    api.on_watch.clear()
    h = b.submit("generate", input_key=KEY)
    api.upsert(pod(f"{h.ref}-a", "generate", phase="Pending"))
    scheduling_event(api, f"{h.ref}-a", "0/1 nodes are available: 1 Insufficient cpu.")
    assert b.poll(h) is None
    api.upsert(pod(f"{h.ref}-a", "generate"))
    api.pod_logs[f"{h.ref}-a"] = ['EAGLE3_PROGRESS {"stage": "generate", "done": 1, "total": 2, "unit": "samples"}']
    b.progress(h)
    job_status(api, h.ref, "Complete")
    assert b.poll(h).succeeded
    api.on_watch.append(lambda fake, kind: kind == "Pod" and ("Pod", f"{name}-0") in fake.objects and fake.remove("Pod", f"{name}-0"))
    b.stop_serve()
    api.on_watch.clear()
    h = b.submit("train", input_key=KEY)
    api.upsert(pod(f"{h.ref}-0", "train", phase="Failed", terminated={"exitCode": 1}, index=0))
    job_status(api, h.ref, "Failed", "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes")
    api.on_watch.append(lambda fake, kind: kind == "Pod" and ("Pod", f"{h.ref}-0") in fake.objects and fake.remove("Pod", f"{h.ref}-0"))
    assert b.poll(h) is None  # restarted as a whole
    api.on_watch.clear()
    b.logs("train", tail=5)
    again = make_backend(cfg, api, clock)  # a later eagle3ctl
    assert again.attach("train", KEY) is not None
    for obj in b.objects:  # a server an earlier eagle3ctl left: replaced, not refused
        if obj["metadata"].get("labels", {}).get("eagle3.io/stage") == "serve":
            api.upsert(obj)
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    again.start_serve()
    api.on_watch.append(lambda fake, kind: kind == "Pod" and ("Pod", f"{name}-0") in fake.objects and fake.remove("Pod", f"{name}-0"))
    again.submit("vocab", input_key=KEY)  # replaces nothing; the ConfigMap is updated
    h = again.submit("train", input_key="e" * 64)  # another key: the running Job is replaced
    again.cancel(h)
    again.down()
    return b


def test_a_run_makes_exactly_the_listed_calls(prod_cfg, clock):
    k8s = prod_cfg.kubernetes.model_copy(update={"nodes": 2, "model_cache_access_mode": "ReadWriteMany"})
    cfg = prod_cfg.model_copy(update={"kubernetes": k8s})
    api = prepared_api(cfg)
    _run_everything(cfg, api, clock)
    made = api.server.rbac_calls
    listed = {(c.verb, c.kind) for c in RUN_CALLS}
    assert made <= listed, f"calls the Role does not list: {sorted(made - listed)}"
    assert made == listed, f"listed but never made (grant nothing more): {sorted(listed - made)}"


def test_a_call_the_role_does_not_grant_is_refused(prod_cfg, clock):
    """The Role before this change had no update on deployments: an earlier run's server could not be replaced."""
    rules = [r for r in role_rules_of(render_run(prod_cfg, "ml"))]
    rules = [dict(r, verbs=[v for v in r["verbs"] if not (r["resources"] == ["deployments"] and v == "update")]) for r in rules]
    api = FakeKubeApi("ml", rules)
    for obj in render_run(prod_cfg, "ml"):
        if obj["kind"] in ("ServiceAccount",) or obj["metadata"].get("labels", {}).get("eagle3.io/stage") == "serve":
            api.upsert(obj)
    b = make_backend(prod_cfg, api, FakeClock())
    with pytest.raises(Forbidden, match='cannot update resource "deployments" in API group "apps"'):
        b.start_serve()


def test_the_double_validates_what_the_backend_sends(prod_cfg, api, clock):
    """An object the official schema rejects never reaches the double's store."""
    from eagle3.k8s.kube import Invalid

    b = make_backend(prod_cfg, api, clock)
    b.prepare()
    cm = by_name(b.objects, "ConfigMap", "-config")
    with pytest.raises(Invalid, match="invalid for Kubernetes 1.30.0"):
        api.create({**cm, "metadata": {**cm["metadata"], "name": "x"}, "binaryData": {"a": 1}})


def test_selfcheck_source_is_the_list():
    text = (Path(__file__).parents[2] / "eagle3" / "k8s" / "selfcheck.py").read_text()
    assert "run_calls(" in text and "RUN_PERMISSIONS" not in text
