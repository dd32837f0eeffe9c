"""eagle3.k8s.kube.KubeClient through the real kubernetes client, against ApiHttpDouble: the API's
paths and verbs on 127.0.0.1, RBAC from the chart's rendered Role, official schemas, 410s."""

from __future__ import annotations

import copy

import pytest
from kubernetes import client as k8s_client

from eagle3.k8s.kube import AlreadyExists, Conflict, Forbidden, Gone, Invalid, KubeClient, KubeError
from eagle3.k8s.render import render_run
from tests.k8s.apiserver_double import ApiServerDouble
from tests.k8s.checks import by_name
from tests.k8s.conftest import job_status, pod
from tests.k8s.fake_kube import role_rules_of
from tests.k8s.http_double import TOKEN, ApiHttpDouble


@pytest.fixture
def objects(prod_cfg):
    return render_run(prod_cfg, "ml")


@pytest.fixture
def server(objects):
    s = ApiServerDouble("ml", role_rules_of(objects))
    for o in objects:
        if o["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            s.upsert(o)  # helm install prepared the namespace
    return s


@pytest.fixture
def http(server):
    with ApiHttpDouble(server) as h:
        yield h


@pytest.fixture
def kube(http):
    conf = k8s_client.Configuration(host=http.url)
    conf.api_key = {"authorization": TOKEN}
    conf.api_key_prefix = {"authorization": "Bearer"}
    return KubeClient(k8s_client.ApiClient(conf), "ml")


def test_create_get_replace_delete_a_configmap(kube, http, objects):
    cm = by_name(objects, "ConfigMap", "-config")
    created = kube.create(cm)
    assert created["metadata"]["resourceVersion"] and created["data"] == cm["data"]
    assert ("POST", "/api/v1/namespaces/ml/configmaps") in http.requests
    got = kube.get("ConfigMap", cm["metadata"]["name"])
    replaced = kube.replace({**got, "data": {"config.yaml": "run_id: x\n"}})
    assert int(replaced["metadata"]["resourceVersion"]) > int(got["metadata"]["resourceVersion"])
    with pytest.raises(Conflict, match="the object has been modified"):
        kube.replace(got)  # its resourceVersion is stale now
    with pytest.raises(AlreadyExists):
        kube.create(cm)
    assert kube.delete("ConfigMap", cm["metadata"]["name"]) is True
    assert kube.delete("ConfigMap", cm["metadata"]["name"]) is False  # gone already: not an error
    assert kube.get("ConfigMap", cm["metadata"]["name"]) is None


def test_jobs_go_to_the_batch_api_and_are_validated(kube, http, objects):
    job = by_name(objects, "Job", "-train")
    kube.create(job)  # a GPU Job: its quantities are strings, which the client (v37) insists on
    assert ("POST", "/apis/batch/v1/namespaces/ml/jobs") in http.requests
    bad = copy.deepcopy(by_name(objects, "Job", "-vocab"))
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8  # not a field of a container
    with pytest.raises(KubeError, match=r"the kubernetes client refused the object: .*gpus"):
        kube.create(bad)  # refused by the client itself, before sending
    bad = copy.deepcopy(by_name(objects, "Job", "-vocab"))
    bad["spec"]["backoffLimitPerIndex"] = 0  # valid by schema, refused by the Job API: needs Indexed
    with pytest.raises(Invalid, match="requires indexed completion mode"):
        kube.create(bad)
    gpu = copy.deepcopy(job)
    gpu["metadata"]["name"] = "int-quantity"
    gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 8
    with pytest.raises(KubeError, match="nvidia.com/gpu"):
        kube.create(gpu)  # what the chart rendered before: the client refused every GPU Job


def test_list_honours_label_and_field_selectors(kube, server):
    server.upsert(pod("a", "vocab"))
    server.upsert(pod("b", "train"))
    server.upsert(pod("c", "train", run="other"))
    items, rv = kube.list("Pod", "eagle3.io/run=prod-1,eagle3.io/stage in (train,extract)")
    assert [p["metadata"]["name"] for p in items] == ["b"] and rv == str(server.rv)
    assert [p["metadata"]["name"] for p in kube.list("Pod", "eagle3.io/stage!=train")[0]] == ["a"]
    assert [p["metadata"]["name"] for p in kube.list("Pod", field_selector="metadata.name=c")[0]] == ["c"]


def test_watch_streams_events_after_the_version_and_raises_gone(kube, server, objects):
    kube.create(by_name(objects, "Job", "-vocab"))
    name = "eagle3-prod-1-vocab"
    _, rv = kube.list("Job", field_selector=f"metadata.name={name}")
    job_status(server, name, "Complete")
    events = list(kube.watch("Job", rv, field_selector=f"metadata.name={name}"))
    assert [(t, o["status"]["conditions"][0]["type"]) for t, o in events] == [("MODIFIED", "Complete")]
    server.compact()
    with pytest.raises(Gone):  # the real server's way: a 200 stream with an ERROR event (code 410)
        list(kube.watch("Job", rv))


def test_a_watch_cut_off_mid_stream_yields_what_came_then_raises_gone(kube, server):
    _, rv = kube.list("Pod")
    server.upsert(pod("a", "vocab"))
    server.upsert(pod("b", "vocab"))
    server.expire_watch_after("Pod", 1)
    seen = []
    with pytest.raises(Gone):
        for _typ, obj in kube.watch("Pod", rv):
            seen.append(obj["metadata"]["name"])
    assert seen == ["a"]


def test_a_call_the_role_does_not_grant_is_forbidden(kube):
    with pytest.raises(Forbidden, match='cannot delete resource "serviceaccounts"'):
        kube.delete("ServiceAccount", "eagle3")
    with pytest.raises(Forbidden, match='cannot get resource "pods"'):
        kube.get("Pod", "x")  # list and watch pods, yes; get: the backend never does


def test_pod_logs_with_a_tail_and_of_a_missing_pod(kube, server):
    server.upsert(pod("p", "vocab"))
    server.pod_logs["p"] = ["one", "two", "three"]
    assert kube.logs("p", "stage", tail=2) == ["two", "three"]
    assert kube.logs("missing", "stage") == []


def test_can_i_asks_a_self_subject_access_review(kube):
    assert kube.can_i("create", "batch", "jobs") is True
    assert kube.can_i("get", "", "pods/log") is True
    assert kube.can_i("get", "", "secrets") is False
    assert kube.can_i("create", "rbac.authorization.k8s.io", "roles") is False


def test_selfcheck_asks_about_every_call_of_a_run(kube, prod_cfg, server):
    from eagle3.errors import Eagle3Error
    from eagle3.k8s.permissions import RUN_CALLS
    from eagle3.k8s.selfcheck import check_api

    line = check_api(prod_cfg, kube)
    assert f"all {len({(c.verb, c.group, c.resource) for c in RUN_CALLS})} calls" in line
    server.grants.discard(("update", "apps", "deployments"))  # a Role without what re-creating the server needs
    with pytest.raises(Eagle3Error, match="may not update deployments.apps"):
        check_api(prod_cfg, kube)


def test_the_backend_runs_a_stage_through_the_real_client(kube, server, prod_cfg):
    from tests.k8s.conftest import FakeClock, make_backend

    backend = make_backend(prod_cfg, kube, FakeClock())
    h = backend.submit("vocab", input_key="b" * 64)
    assert server.objects[("Job", h.ref)]["metadata"]["annotations"]["eagle3.io/input-key"] == "b" * 64
    server.upsert(pod(f"{h.ref}-x", "vocab"))
    server.pod_logs[f"{h.ref}-x"] = ["stage vocab: committed"]
    assert backend.poll(h) is None
    job_status(server, h.ref, "Complete")
    server.compact()  # and the watch's version is too old by now
    outcome = backend.poll(h)
    assert outcome.succeeded and outcome.log_tail == ["stage vocab: committed"]
    assert backend.attach("vocab", "b" * 64).ref == h.ref  # a later eagle3ctl follows it
    assert backend.attach("vocab", "c" * 64) is None
