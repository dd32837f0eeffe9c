"""Multi-node extract/train fail and restart as a whole (torchrun's rendezvous needs every node):
one failed or evicted index fails the Indexed Job, and eagle3ctl starts all nodes again."""

from __future__ import annotations

import pytest

from eagle3.config import load_config
from eagle3.errors import ConfigError
from eagle3.k8s.render import render_run
from tests.k8s.apiserver_double import validate_object
from tests.k8s.checks import by_name, validate_strict
from tests.k8s.conftest import job_status, make_backend, pod, prepared_api

KEY = "f" * 64


def two_nodes(cfg, **extra):
    k8s = cfg.kubernetes.model_copy(update={"nodes": 2, "model_cache_access_mode": "ReadWriteMany", **extra})
    return cfg.model_copy(update={"kubernetes": k8s})


def test_an_indexed_job_fails_as_a_whole(prod_cfg):
    objects = render_run(two_nodes(prod_cfg))
    validate_strict(objects)
    for stage in ("extract", "train"):
        job = by_name(objects, "Job", f"-{stage}")
        validate_object(job)  # the Job API's own rules too (backoffLimitPerIndex needs Indexed, …)
        spec = job["spec"]
        assert spec["backoffLimitPerIndex"] == 0 and spec["maxFailedIndexes"] == 0  # one failed index fails the Job
        rules = spec["podFailurePolicy"]["rules"]
        assert {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
        assert not any(r["action"] == "Ignore" for r in rules)  # an evicted index is never recreated alone
        assert job["metadata"]["annotations"]["eagle3.io/restarts"] == "0"
    single = by_name(objects, "Job", "-evaluate")["spec"]
    assert "backoffLimitPerIndex" not in single and single["backoffLimit"] == 3


def test_a_jobset_restarts_every_node_and_fails_on_a_config_error(prod_cfg):
    objects = render_run(two_nodes(prod_cfg, multi_node="jobset"))
    js = by_name(objects, "JobSet", "-train")
    validate_object(js)
    fp = js["spec"]["failurePolicy"]
    assert fp["maxRestarts"] == 3
    assert fp["rules"] == [{"name": "configError", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    child = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert child["backoffLimit"] == 0  # any failed pod fails its child Job, so the JobSet restarts all
    assert child["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [2]}}]


def test_several_nodes_with_a_read_write_once_cache_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="kubernetes.model_cache_access_mode") as e:
        load_config(None, {"kubernetes.nodes": 2})
    assert "ReadWriteMany" in str(e.value) and e.value.exit_code == 2
    assert load_config(None, {"kubernetes.nodes": 2, "kubernetes.model_cache_access_mode": "ReadWriteMany"}).kubernetes.nodes == 2


@pytest.fixture
def mn(prod_cfg, clock):
    cfg = two_nodes(prod_cfg)
    api = prepared_api(cfg)
    return make_backend(cfg, api, clock), api


def _fail_index(api, job: str, index: int, reason: str, message: str, **pod_kw) -> None:
    api.upsert(pod(f"{job}-{index}-x", "train", phase="Failed", index=index, **pod_kw))
    job_status(api, job, "Failed", reason, message)
    # the kubelet ends the pods once the Job is deleted
    api.on_watch.append(lambda fake, kind: kind == "Pod" and [fake.remove("Pod", n) for (k, n) in list(fake.objects)
                                                              if k == "Pod" and n.startswith(job)])


def test_one_failed_index_restarts_every_node_counting_up_to_backoff_limit(mn):
    backend, api = mn
    h = backend.submit("train", input_key=KEY, force=True)
    uid = api.objects[("Job", h.ref)]["metadata"]["uid"]
    for n in (1, 2, 3):
        _fail_index(api, h.ref, 1, "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes",
                    terminated={"exitCode": 1, "reason": "Error"})
        assert backend.poll(h) is None  # restarted, still running
        job = api.objects[("Job", h.ref)]
        assert job["metadata"]["uid"] != uid and job["metadata"]["annotations"]["eagle3.io/restarts"] == str(n)
        assert "--force" not in job["spec"]["template"]["spec"]["containers"][0]["command"]  # the restart resumes
        assert job["metadata"]["annotations"]["eagle3.io/input-key"] == KEY
        assert f"restarting all 2 nodes, resuming from the checkpoint (restart {n}/3)" in backend.echoed[-1]
        uid = job["metadata"]["uid"]
    _fail_index(api, h.ref, 0, "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes",
                terminated={"exitCode": 1, "reason": "Error"})
    outcome = backend.poll(h)
    assert not outcome.succeeded and outcome.reason.startswith("exit code 1 (pod")


def test_an_evicted_node_restarts_every_node_without_counting(mn):
    backend, api = mn
    h = backend.submit("train", input_key=KEY)
    _fail_index(api, h.ref, 1, "PodFailurePolicy",
                "Pod ml/x has condition DisruptionTarget matching FailJob rule at index 1",
                terminated={"exitCode": 143, "reason": "Error"},
                conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}])
    assert backend.poll(h) is None
    assert api.objects[("Job", h.ref)]["metadata"]["annotations"]["eagle3.io/restarts"] == "0"
    assert "a pod was evicted or preempted; restarting all 2 nodes" in backend.echoed[-1]


def test_a_config_error_on_one_node_fails_the_stage_at_once(mn):
    backend, api = mn
    h = backend.submit("train", input_key=KEY)
    _fail_index(api, h.ref, 0, "PodFailurePolicy",
                "Container stage for pod ml/x failed with exit code 2 matching FailJob rule at index 0",
                terminated={"exitCode": 2, "reason": "Error"})
    outcome = backend.poll(h)
    assert not outcome.succeeded and outcome.reason.startswith("exit code 2")
    assert ("delete", "Job", h.ref, "Foreground") not in api.calls


def test_a_jobset_is_followed_to_its_completed_condition(prod_cfg, clock):
    cfg = two_nodes(prod_cfg, multi_node="jobset")
    api = prepared_api(cfg)
    backend = make_backend(cfg, api, clock)
    h = backend.submit("train", input_key=KEY)
    assert ("JobSet", h.ref) in api.objects
    assert backend.poll(h) is None
    job_status(api, h.ref, "Completed", "AllJobsCompleted", "jobset completed successfully", kind="JobSet")
    assert backend.poll(h).succeeded  # JobSet says Completed, not Complete
    assert backend.attach("train", KEY).extra["kind"] == "JobSet"
