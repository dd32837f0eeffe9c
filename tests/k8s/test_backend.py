"""KubernetesBackend's sequencing and failure reporting against FakeKubeApi (a test double)."""

from __future__ import annotations

import pytest

from eagle3.errors import Eagle3Error, StageError
from eagle3.k8s.backend import KubernetesBackend
from tests.k8s.fake_kube import FakeKubeApi

RUN = "prod-1"


class FakeClock:
    """Test double of time.monotonic: advances only when told to."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def api():
    return FakeKubeApi(namespace="ml")


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def backend(prod_cfg, api, clock):
    lines: list[str] = []
    b = KubernetesBackend(prod_cfg, api=api, echo=lines.append, pending_timeout_s=300, clock=clock)
    b.echoed = lines
    return b


def pod(name: str, stage: str, phase: str = "Running", run: str = RUN, ready: bool = False,
        waiting: dict | None = None, terminated: dict | None = None, created: str = "2025-01-01T00:00:00Z") -> dict:
    state = {"waiting": waiting} if waiting else {"terminated": terminated} if terminated else {"running": {}}
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if phase == "Pending" and not waiting:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    return {"kind": "Pod", "metadata": {"name": name, "creationTimestamp": created,
                                        "labels": {"eagle3.io/run": run, "eagle3.io/stage": stage}},
            "status": {"phase": phase, "conditions": conditions,
                       "containerStatuses": [] if phase == "Pending" and not waiting else
                       [{"name": "stage", "image": "img", "state": state}]}}


def job_status(api: FakeKubeApi, name: str, condition: str, reason: str = "", message: str = "") -> None:
    job = api.get("Job", name)
    job["status"] = {"conditions": [{"type": condition, "status": "True", "reason": reason, "message": message}]}
    api.upsert(job)


def test_submit_creates_the_stage_job_and_poll_reports_success(backend, api):
    h = backend.submit("vocab")
    assert h.ref == f"eagle3-{RUN}-vocab"
    created = [c for c in api.calls if c[0] == "create"]
    # namespace setup and config first (they were missing), then the Job
    assert [c[1] for c in created] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Job"]
    job = api.get("Job", h.ref)
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["eagle3", "stage", "vocab"]
    api.upsert(pod(f"{h.ref}-abc", "vocab"))
    assert backend.poll(h) is None
    api.pod_logs[f"{h.ref}-abc"] = ["loading", "stage vocab: committed"]
    job_status(api, h.ref, "Complete")
    outcome = backend.poll(h)
    assert outcome.succeeded and outcome.log_tail[-1] == "stage vocab: committed"


def test_pending_gpu_pod_is_reported_with_its_scheduling_event_then_fails(backend, api, clock):
    h = backend.submit("extract")
    api.upsert(pod(f"{h.ref}-x1", "extract", phase="Pending"))
    api.upsert({"kind": "Event", "metadata": {"name": "ev1"}, "reason": "FailedScheduling",
                "involvedObject": {"kind": "Pod", "name": f"{h.ref}-x1"}, "lastTimestamp": "2025-01-01T00:00:05Z",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."})
    assert backend.poll(h) is None
    assert backend.poll(h) is None
    assert backend.echoed == ["extract: Pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu. "
                              "preemption: 0/3 nodes are available."]  # once, not every poll
    clock.t += 301
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason.startswith("Pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert ("delete", "Job", h.ref, "Foreground") in api.calls  # cancelled, not left queued


def test_image_pull_backoff_fails_at_once(backend, api):
    h = backend.submit("generate")
    api.upsert(pod(f"{h.ref}-p", "generate", phase="Pending",
                   waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x/eagle3-cpu:0.1.0"'}))
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason == f'ImagePullBackOff: pod {h.ref}-p: Back-off pulling image "ghcr.io/x/eagle3-cpu:0.1.0"'
    assert "\n" not in outcome.reason


def test_oom_killed_is_named(backend, api):
    h = backend.submit("train")
    api.upsert(pod(f"{h.ref}-t", "train", phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    job_status(api, h.ref, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason.startswith("OOMKilled (exit code 137)") and f"pod {h.ref}-t" in outcome.reason


def test_exit_code_of_a_config_error_is_reported(backend, api):
    h = backend.submit("vocab")
    api.upsert(pod(f"{h.ref}-v", "vocab", phase="Failed", terminated={"exitCode": 2, "reason": "Error"}))
    job_status(api, h.ref, "Failed", "PodFailurePolicy", "Container stage for pod ml/x failed with exit code 2 matching FailJob rule at index 0")
    outcome = backend.poll(h)
    assert outcome.reason == f"exit code 2 (pod {h.ref}-v)"


def test_deadline_exceeded_without_pod_detail_reports_the_job_condition(backend, api):
    h = backend.submit("export")
    job_status(api, h.ref, "Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
    assert backend.poll(h).reason == "DeadlineExceeded: Job was active longer than specified deadline"


def test_watch_recovers_from_410_gone_by_listing_again(backend, api):
    h = backend.submit("vocab")
    job_status(api, h.ref, "Complete")
    api.gone_next["Job"] = 1
    outcome = backend.poll(h)
    assert outcome.succeeded
    watches = [c for c in api.calls if c[:2] == ("watch", "Job")]
    lists = [c for c in api.calls if c[:2] == ("list", "Job")]
    assert watches and len(lists) >= 2  # one at submit, one after the Gone
    assert h.extra["rv"] == str(api.rv)  # watching resumes from the fresh list's version


def test_start_serve_waits_for_the_startup_probe(backend, api):
    name = f"eagle3-{RUN}-serve"

    def kubelet(fake: FakeKubeApi, kind: str) -> None:
        if kind == "Pod" and ("Pod", f"{name}-0") not in fake.objects:
            fake.upsert(pod(f"{name}-0", "serve"))  # starting, not ready
        elif kind == "Pod":
            fake.upsert(pod(f"{name}-0", "serve", ready=True))

    api.on_watch.append(kubelet)
    url = backend.start_serve()
    assert url == f"http://{name}.ml.svc:8000/v1"
    assert api.get("Deployment", name)["spec"]["strategy"]["type"] == "Recreate"
    assert api.get("PersistentVolumeClaim", "eagle3-model-cache") is not None


def test_start_serve_fails_on_image_pull_backoff(backend, api):
    api.upsert(pod(f"eagle3-{RUN}-serve-0", "serve", phase="Pending",
                   waiting={"reason": "ErrImagePull", "message": "manifest unknown"}))
    with pytest.raises(StageError, match="ErrImagePull: pod eagle3-prod-1-serve-0: manifest unknown"):
        backend.start_serve()


def test_stop_serve_returns_only_once_the_pods_are_gone(backend, api):
    name = f"eagle3-{RUN}-serve"
    backend.start_serve.__func__  # noqa: B018 (the objects come from the rendered chart)
    for obj in backend.objects:
        if obj["metadata"]["labels"].get("eagle3.io/stage") == "serve":
            api.upsert(obj)
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    watches = []

    def kubelet(fake: FakeKubeApi, kind: str) -> None:
        watches.append(kind)
        if len(watches) == 3:  # the pod takes a while to terminate (grace period)
            fake.remove("Pod", f"{name}-0")
        if len(watches) == 2:
            fake.gone_next["Pod"] = 1  # and the watch expires meanwhile

    api.on_watch.append(kubelet)
    backend.stop_serve()
    assert ("Pod", f"{name}-0") not in api.objects
    assert len(watches) >= 3
    assert ("delete", "Deployment", name, "Foreground") in api.calls


def test_stop_serve_gives_up_with_a_clear_line_when_pods_stay(backend, api, clock):
    name = f"eagle3-{RUN}-serve"
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    api.on_watch.append(lambda fake, kind: setattr(clock, "t", clock.t + 60))
    with pytest.raises(StageError, match="still exist after deletion; their GPUs are not free"):
        backend.stop_serve()


def test_a_rerun_replaces_the_previous_attempt(backend, api):
    h1 = backend.submit("vocab")
    job_status(api, h1.ref, "Failed", "BackoffLimitExceeded")
    h2 = backend.submit("vocab")
    assert h2.ref == h1.ref and api.get("Job", h1.ref).get("status") is None  # a fresh Job
    assert ("delete", "Job", h1.ref, "Foreground") in api.calls


def test_unprepared_namespace_without_rights_is_one_clear_line(backend, api):
    api.forbidden_kinds = {"ServiceAccount", "Role", "RoleBinding"}
    with pytest.raises(Eagle3Error, match=r"install the chart first \(helm install eagle3-prod-1 charts/eagle3 -n ml\)"):
        backend.submit("vocab")


def test_down_deletes_every_object_of_the_run_by_label(backend, api):
    backend.submit("generate")
    api.upsert(pod(f"eagle3-{RUN}-generate-a", "generate"))
    api.upsert(pod("other-run-pod", "generate", run="other"))
    api.upsert({"kind": "Job", "metadata": {"name": "eagle3-other-vocab", "labels": {"eagle3.io/run": "other"}}})
    removed = backend.down()
    assert sorted(removed) == sorted([f"Job/eagle3-{RUN}-generate", f"ConfigMap/eagle3-{RUN}-config",
                                      f"Pod/eagle3-{RUN}-generate-a"])
    assert ("delete", "Job", f"eagle3-{RUN}-generate", "Background") in api.calls
    left = {k for k in api.objects}
    assert ("Job", "eagle3-other-vocab") in left and ("Pod", "other-run-pod") in left
    assert ("ServiceAccount", "eagle3") in left  # namespace setup stays


def test_progress_is_parsed_from_the_pod_log(backend, api):
    h = backend.submit("extract")
    api.upsert(pod(f"{h.ref}-e", "extract"))
    api.pod_logs[f"{h.ref}-e"] = ['EAGLE3_PROGRESS {"stage": "extract", "done": 40, "total": 100, "unit": "samples", "shards": 3}']
    p = backend.progress(h)
    assert (p.done, p.total, p.unit, p.extra) == (40, 100, "samples", {"shards": 3})


def test_gpu_count_is_the_whole_allocation(backend):
    assert backend.gpu_count() == 8


def test_no_credential_value_reaches_a_log_line_or_reason(backend, api):
    from tests.k8s.conftest import SECRET_VALUES  # set in the environment by prod_cfg

    h = backend.submit("generate")
    api.upsert(pod(f"{h.ref}-s", "generate", phase="Pending",
                   waiting={"reason": "CreateContainerConfigError", "message": 'secret "eagle3-s3" not found'}))
    outcome = backend.poll(h)
    assert outcome.reason == f'CreateContainerConfigError: pod {h.ref}-s: secret "eagle3-s3" not found'
    text = "\n".join([*backend.echoed, outcome.reason, *outcome.log_tail, *map(str, api.calls)])
    for value in SECRET_VALUES.values():
        assert value not in text
        assert all(value not in str(obj) for obj in api.objects.values())
