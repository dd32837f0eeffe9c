"""KubernetesBackend's sequencing and failure reporting against FakeKubeApi (a strict test double:
RBAC from the rendered Role, official schemas, selectors, resourceVersion/410)."""

from __future__ import annotations

import pytest

from eagle3.errors import Eagle3Error, StageError
from tests.k8s.conftest import job_status, pod, scheduling_event
from tests.k8s.fake_kube import FakeKubeApi

RUN = "prod-1"
KEY = "a" * 64


def test_submit_creates_the_stage_job_and_poll_reports_success(backend, api):
    h = backend.submit("vocab", input_key=KEY)
    assert h.ref == f"eagle3-{RUN}-vocab"
    created = [c[1] for c in api.calls if c[0] == "create"]
    assert created == ["ConfigMap", "Job"]  # the namespace setup is helm install's, never the backend's
    job = api.objects[("Job", h.ref)]
    assert job["metadata"]["annotations"]["eagle3.io/input-key"] == KEY
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == ["eagle3", "stage", "vocab"]
    assert "--force" not in job["spec"]["template"]["spec"]["containers"][0]["command"]
    api.upsert(pod(f"{h.ref}-abc", "vocab"))
    assert backend.poll(h) is None
    api.pod_logs[f"{h.ref}-abc"] = ["loading", "stage vocab: committed"]
    job_status(api, h.ref, "Complete")
    outcome = backend.poll(h)
    assert outcome.succeeded and outcome.log_tail[-1] == "stage vocab: committed"


def test_forced_submit_runs_the_stage_with_force(backend, api):
    h = backend.submit("vocab", input_key=KEY, force=True)
    cmd = api.objects[("Job", h.ref)]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[-1] == "--force" and cmd[:2] == ["eagle3", "stage"]
    h = backend.submit("train", input_key=KEY, force=True)  # torchrun: --force goes to the stage, at the end
    cmd = api.objects[("Job", h.ref)]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[0] == "eagle3-torchrun" and cmd[-1] == "--force"


def test_pending_gpu_pod_is_reported_with_its_event_and_waits(backend, api, clock):
    h = backend.submit("extract", input_key=KEY)
    api.upsert(pod(f"{h.ref}-x1", "extract", phase="Pending"))
    msg = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available."
    scheduling_event(api, f"{h.ref}-x1", msg)
    assert backend.poll(h) is None
    clock.t += 60
    assert backend.poll(h) is None
    assert backend.echoed == [f"extract: Pending: {msg}"]  # once at start, not every poll
    clock.t += 300
    assert backend.poll(h) is None  # still waiting: no pending timeout by default
    assert backend.echoed[-1] == f"extract: still Pending: {msg} (Pending for 6 min)"
    clock.t += 86400
    assert backend.poll(h) is None
    assert ("delete", "Job", h.ref, "Foreground") not in api.calls  # a day in the queue: still there
    # once scheduled and running, the report stops
    api.upsert(pod(f"{h.ref}-x1", "extract", phase="Running"))
    n = len(backend.echoed)
    clock.t += 600
    assert backend.poll(h) is None and len(backend.echoed) == n


def test_pending_timeout_fails_the_stage_when_set(prod_cfg, api, clock):
    from tests.k8s.conftest import make_backend

    cfg = prod_cfg.model_copy(update={"kubernetes": prod_cfg.kubernetes.model_copy(update={"pending_timeout_s": 300})})
    backend = make_backend(cfg, api, clock)
    h = backend.submit("extract", input_key=KEY)
    api.upsert(pod(f"{h.ref}-x1", "extract", phase="Pending"))
    scheduling_event(api, f"{h.ref}-x1", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert backend.poll(h) is None
    clock.t += 301
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason.startswith("Pending: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")
    assert "kubernetes.pending_timeout_s=300s" in outcome.reason
    assert ("delete", "Job", h.ref, "Foreground") in api.calls  # cancelled, not left queued


def test_image_pull_backoff_fails_at_once(backend, api):
    h = backend.submit("generate", input_key=KEY)
    api.upsert(pod(f"{h.ref}-p", "generate", phase="Pending",
                   waiting={"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x/eagle3-cpu:0.1.0"'}))
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason == f'ImagePullBackOff: pod {h.ref}-p: Back-off pulling image "ghcr.io/x/eagle3-cpu:0.1.0"'
    assert "\n" not in outcome.reason


def test_oom_killed_is_named(backend, api):
    h = backend.submit("train", input_key=KEY)
    api.upsert(pod(f"{h.ref}-t", "train", phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"}))
    job_status(api, h.ref, "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
    outcome = backend.poll(h)
    assert not outcome.succeeded
    assert outcome.reason.startswith("OOMKilled (exit code 137)") and f"pod {h.ref}-t" in outcome.reason


def test_exit_code_of_a_config_error_is_reported(backend, api):
    h = backend.submit("vocab", input_key=KEY)
    api.upsert(pod(f"{h.ref}-v", "vocab", phase="Failed", terminated={"exitCode": 2, "reason": "Error"}))
    job_status(api, h.ref, "Failed", "PodFailurePolicy", "Container stage for pod ml/x failed with exit code 2 matching FailJob rule at index 0")
    outcome = backend.poll(h)
    assert outcome.reason == f"exit code 2 (pod {h.ref}-v)"


def test_deadline_exceeded_without_pod_detail_reports_the_job_condition(backend, api):
    h = backend.submit("export", input_key=KEY)
    job_status(api, h.ref, "Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
    assert backend.poll(h).reason == "DeadlineExceeded: Job was active longer than specified deadline"


def test_an_evicted_pod_of_a_one_node_stage_is_retried_by_the_job_not_failed(backend, api):
    h = backend.submit("train", input_key=KEY)
    evicted = pod(f"{h.ref}-a", "train", phase="Failed", terminated={"exitCode": 143, "reason": "Error"},
                  conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}])
    api.upsert(evicted)
    api.upsert(pod(f"{h.ref}-b", "train", created="2025-01-01T01:00:00Z"))  # the Job's replacement pod
    assert backend.poll(h) is None  # the Job (podFailurePolicy Ignore) carries on
    assert ("delete", "Job", h.ref, "Foreground") not in api.calls


def test_watch_recovers_from_410_gone_by_listing_again(backend, api):
    h = backend.submit("vocab", input_key=KEY)
    job_status(api, h.ref, "Complete")
    api.gone_next["Job"] = 1
    outcome = backend.poll(h)
    assert outcome.succeeded
    lists = [c for c in api.calls if c[:2] == ("list", "Job")]
    assert len(lists) >= 2  # one at submit, one after the Gone


def test_a_watch_cut_off_mid_stream_with_410_resumes_from_a_fresh_list(backend, api):
    h = backend.submit("vocab", input_key=KEY)
    api.upsert(pod(f"{h.ref}-a", "vocab"))
    job = dict(api.objects[("Job", h.ref)], status={"active": 1})
    api.upsert(job)  # one event the watch delivers …
    job_status(api, h.ref, "Complete")  # … and one it is cut off before
    api.expire_watch_after("Job", 1)
    assert backend.poll(h).succeeded  # the list after the 410 has the Complete condition


def test_a_watch_from_a_compacted_version_lists_again(backend, api):
    h = backend.submit("vocab", input_key=KEY)
    job_status(api, h.ref, "Complete")
    api.compact()  # the version the backend watches from is no longer in the history
    assert backend.poll(h).succeeded


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
    assert api.objects[("Deployment", name)]["spec"]["strategy"]["type"] == "Recreate"
    assert ("PersistentVolumeClaim", "eagle3-model-cache") in api.objects
    assert ("NetworkPolicy", name) in api.objects


def test_start_serve_replaces_an_earlier_runs_server(backend, api):
    """An earlier eagle3ctl left the Deployment: it is updated (the Role grants update), not refused."""
    name = f"eagle3-{RUN}-serve"
    for obj in backend.objects:
        if obj["metadata"].get("labels", {}).get("eagle3.io/stage") == "serve":
            api.upsert(obj)
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    backend.start_serve()
    assert ("replace", "Deployment", name) in api.calls and ("replace", "Service", name) in api.calls


def test_start_serve_fails_on_image_pull_backoff(backend, api):
    api.upsert(pod(f"eagle3-{RUN}-serve-0", "serve", phase="Pending",
                   waiting={"reason": "ErrImagePull", "message": "manifest unknown"}))
    with pytest.raises(StageError, match="ErrImagePull: pod eagle3-prod-1-serve-0: manifest unknown"):
        backend.start_serve()


def test_time_pending_for_gpus_does_not_count_against_the_startup_timeout(backend, api, clock):
    name = f"eagle3-{RUN}-serve"
    api.upsert(pod(f"{name}-0", "serve", phase="Pending"))
    scheduling_event(api, f"{name}-0", "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.")
    watches = []

    def scheduler(fake: FakeKubeApi, kind: str) -> None:
        watches.append(kind)
        clock.t += 1000  # the serve pod waits 3 hours for GPUs, beyond startup_timeout_s (1800 s)
        if len(watches) == 11:
            fake.upsert(pod(f"{name}-0", "serve"))  # scheduled: loading starts now
        if len(watches) == 12:
            fake.upsert(pod(f"{name}-0", "serve", ready=True))

    api.on_watch.append(scheduler)
    backend.start_serve()
    assert backend.echoed[0] == "serve: Pending: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    assert any("still Pending" in line for line in backend.echoed)


def test_stop_serve_returns_only_once_the_pods_are_gone(backend, api):
    name = f"eagle3-{RUN}-serve"
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
    assert ("NetworkPolicy", name) not in api.objects and ("Service", name) not in api.objects


def test_stop_serve_gives_up_with_a_clear_line_when_pods_stay(backend, api, clock):
    name = f"eagle3-{RUN}-serve"
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    api.on_watch.append(lambda fake, kind: setattr(clock, "t", clock.t + 60))
    with pytest.raises(StageError, match="still exist after deletion; their GPUs are not free"):
        backend.stop_serve()


def test_a_gpu_job_waits_for_a_server_an_earlier_run_left(backend, api):
    """A detached generate left its server up; the next eagle3ctl followed generate to the end:
    before extract takes the GPUs, that server goes, and its pods are gone."""
    name = f"eagle3-{RUN}-serve"
    for obj in backend.objects:
        if obj["metadata"]["labels"].get("eagle3.io/stage") == "serve":
            api.upsert(obj)
    api.upsert(pod(f"{name}-0", "serve", ready=True))
    api.on_watch.append(lambda fake, kind: ("Pod", f"{name}-0") in fake.objects and fake.remove("Pod", f"{name}-0"))
    backend.submit("extract", input_key=KEY)
    deleted = [i for i, c in enumerate(api.calls) if c == ("delete", "Deployment", name, "Foreground")]
    created = [i for i, c in enumerate(api.calls) if c == ("create", "Job", f"eagle3-{RUN}-extract")]
    assert deleted and created and deleted[0] < created[0]
    assert backend.echoed[0] == "extract: stopping the server an earlier eagle3ctl left running, to free its GPUs"


def test_a_rerun_replaces_a_failed_attempt(backend, api):
    h1 = backend.submit("vocab", input_key=KEY)
    job_status(api, h1.ref, "Failed", "BackoffLimitExceeded")
    assert backend.attach("vocab", KEY) is None  # failed: not followed
    h2 = backend.submit("vocab", input_key=KEY)
    assert h2.ref == h1.ref and api.objects[("Job", h1.ref)].get("status") is None  # a fresh Job
    assert ("delete", "Job", h1.ref, "Foreground") in api.calls
    assert backend.echoed[-1] == f"vocab: deleting the earlier Job {h1.ref}: it failed"


def test_namespace_without_the_chart_is_one_clear_line(prod_cfg, clock):
    from eagle3.k8s.render import render_run
    from tests.k8s.conftest import make_backend
    from tests.k8s.fake_kube import role_rules_of

    bare = FakeKubeApi("ml", role_rules_of(render_run(prod_cfg, "ml")))  # no ServiceAccount
    backend = make_backend(prod_cfg, bare, clock)
    with pytest.raises(Eagle3Error, match=r"no ServiceAccount eagle3: prepare it first \(helm install eagle3-prod-1 charts/eagle3 -n ml\)"):
        backend.submit("vocab", input_key=KEY)
    assert not [c for c in bare.calls if c[0] == "create"]


def test_down_deletes_every_object_of_the_run_by_label(backend, api):
    backend.submit("generate", input_key=KEY)
    api.upsert(pod(f"eagle3-{RUN}-generate-a", "generate"))
    api.upsert(pod("other-run-pod", "generate", run="other"))
    api.upsert({"kind": "Job", "metadata": {"name": "eagle3-other-vocab", "labels": {"eagle3.io/run": "other"}}})
    removed = backend.down()
    assert sorted(removed) == sorted([f"Job/eagle3-{RUN}-generate", f"ConfigMap/eagle3-{RUN}-config",
                                      f"Pod/eagle3-{RUN}-generate-a"])
    assert ("delete", "Job", f"eagle3-{RUN}-generate", "Background") in api.calls
    left = set(api.objects)
    assert ("Job", "eagle3-other-vocab") in left and ("Pod", "other-run-pod") in left
    assert ("ServiceAccount", "eagle3") in left  # namespace setup stays


def test_progress_is_parsed_from_the_pod_log(backend, api):
    h = backend.submit("extract", input_key=KEY)
    api.upsert(pod(f"{h.ref}-e", "extract"))
    api.pod_logs[f"{h.ref}-e"] = ['EAGLE3_PROGRESS {"stage": "extract", "done": 40, "total": 100, "unit": "samples", "shards": 3}']
    p = backend.progress(h)
    assert (p.done, p.total, p.unit, p.extra) == (40, 100, "samples", {"shards": 3})


def test_gpu_count_is_the_whole_allocation(backend):
    assert backend.gpu_count() == 8


def test_interrupt_detaches_unless_told_to_cancel(prod_cfg, api, clock):
    from tests.k8s.conftest import make_backend

    assert make_backend(prod_cfg, api, clock).detach_on_interrupt is True
    cancel = prod_cfg.model_copy(update={"kubernetes": prod_cfg.kubernetes.model_copy(update={"cancel_on_interrupt": True})})
    assert make_backend(cancel, api, clock).detach_on_interrupt is False


def test_no_credential_value_reaches_a_log_line_or_reason(backend, api):
    from tests.k8s.conftest import SECRET_VALUES  # set in the environment by prod_cfg

    h = backend.submit("generate", input_key=KEY)
    api.upsert(pod(f"{h.ref}-s", "generate", phase="Pending",
                   waiting={"reason": "CreateContainerConfigError", "message": 'secret "eagle3-s3" not found'}))
    outcome = backend.poll(h)
    assert outcome.reason == f'CreateContainerConfigError: pod {h.ref}-s: secret "eagle3-s3" not found'
    text = "\n".join([*backend.echoed, outcome.reason, *outcome.log_tail, *map(str, api.calls)])
    for value in SECRET_VALUES.values():
        assert value not in text
        assert all(value not in str(obj) for obj in api.objects.values())


def test_local_prompts_are_uploaded_before_the_first_job_and_the_pods_read_the_copy(tmp_path, clock):
    import yaml

    from eagle3.config import load_config
    from tests.k8s.conftest import make_backend, prepared_api

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "hi"}\n')
    cfg = load_config(None, {"run_id": "up", "store.uri": f"file://{tmp_path}/store", "kubernetes.store_pvc": "store",
                             "generate.prompts": str(prompts), "kubernetes.gpus_per_node": 0})
    api = prepared_api(cfg)
    backend = make_backend(cfg, api, clock)
    backend.submit("generate", input_key=KEY)
    [uploaded] = [line for line in backend.echoed if "uploaded" in line]
    assert uploaded.startswith(f"generate.prompts: uploaded {prompts}")
    config = yaml.safe_load(api.objects[("ConfigMap", "eagle3-up-config")]["data"]["config.yaml"])
    assert config["generate"]["prompts"].startswith(f"file://{tmp_path}/store/up/inputs/")
    assert (tmp_path / "store" / config["generate"]["prompts"].split("/store/", 1)[1]).read_bytes() == b'{"prompt": "hi"}\n'


def test_a_missing_local_prompts_file_stops_the_first_submit_naming_the_field(tmp_path, clock):
    from eagle3.config import load_config
    from eagle3.errors import ConfigError
    from tests.k8s.conftest import make_backend, prepared_api

    cfg = load_config(None, {"run_id": "up", "store.uri": f"file://{tmp_path}/store", "kubernetes.store_pvc": "store",
                             "generate.prompts": str(tmp_path / "gone.jsonl")})
    api = prepared_api(cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"prompts": "builtin:tiny-prompts"})}))
    with pytest.raises(ConfigError, match="generate.prompts: file not found"):
        make_backend(cfg, api, clock).submit("generate", input_key=KEY)
    assert not [c for c in api.calls if c[0] == "create"]
