"""Configs for rendering: a production-like run on S3 with credentials from Secrets."""

from __future__ import annotations

import pytest

from eagle3.config import load_config

SECRET_VALUES = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEKEYFORTEST01",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIfakeSecretValueForTest0000",
    "HF_TOKEN": "hf_fakeTokenValueForTest0123456789",
}


@pytest.fixture
def prod_cfg(tmp_path, monkeypatch):
    """A production run: S3 store, HF and S3 Secrets named, GPU scheduling constraints set."""
    for k, v in SECRET_VALUES.items():  # present in the environment: must never be rendered
        monkeypatch.setenv(k, v)
    path = tmp_path / "run.yaml"
    path.write_text("""
run_id: prod-1
backend: kubernetes
store: {uri: s3://drafters/eagle3, endpoint_url: http://minio.storage.svc:9000}
target: {model: moonshotai/Kimi-K2.5, trust_remote_code: true}
serve: {tensor_parallel_size: 8, reasoning_parser: kimi_k2, max_model_len: 32768}
kubernetes:
  namespace: ml
  gpus_per_node: 8
  s3_secret: eagle3-s3
  hf_secret: eagle3-hf
  node_selector: {nvidia.com/gpu.product: NVIDIA-H200}
  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  priority_class: eagle3-batch
  runtime_class: nvidia
  image_pull_secrets: [ghcr]
""")
    return load_config(path)


def prepared_api(cfg, namespace: str = "ml"):
    """A FakeKubeApi whose Role is the one the chart renders for ``cfg``, in a namespace that
    `helm install` prepared (ServiceAccount, Role, RoleBinding present)."""
    from eagle3.k8s.render import render_run
    from tests.k8s.fake_kube import FakeKubeApi, role_rules_of

    objects = render_run(cfg, namespace)
    api = FakeKubeApi(namespace, role_rules_of(objects))
    for obj in objects:
        if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            api.upsert(obj)
    return api


class FakeClock:
    """Test double of time.monotonic: advances only when told to."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def api(prod_cfg):
    return prepared_api(prod_cfg)


def make_backend(cfg, api, clock, **kw):
    from eagle3.k8s.backend import KubernetesBackend

    lines: list[str] = []
    b = KubernetesBackend(cfg, api=api, echo=lines.append, clock=clock, **kw)
    b.echoed = lines
    return b


@pytest.fixture
def backend(prod_cfg, api, clock):
    return make_backend(prod_cfg, api, clock)


def pod(name: str, stage: str, phase: str = "Running", run: str = "prod-1", ready: bool = False,
        waiting: dict | None = None, terminated: dict | None = None, created: str = "2025-01-01T00:00:00Z",
        conditions: list[dict] | None = None, index: int | None = None) -> dict:
    """A pod as the kubelet reports it (cluster side: the test plays the scheduler and kubelet)."""
    state = {"waiting": waiting} if waiting else {"terminated": terminated} if terminated else {"running": {}}
    conds = [{"type": "Ready", "status": "True" if ready else "False"}]
    if phase == "Pending" and not waiting:
        conds.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable"})
    meta = {"name": name, "creationTimestamp": created, "labels": {"eagle3.io/run": run, "eagle3.io/stage": stage}}
    if index is not None:
        meta["annotations"] = {"batch.kubernetes.io/job-completion-index": str(index)}
    return {"kind": "Pod", "metadata": meta,
            "status": {"phase": phase, "conditions": conds + list(conditions or []),
                       "containerStatuses": [] if phase == "Pending" and not waiting else
                       [{"name": "stage", "image": "img", "state": state}]}}


def job_status(api, name: str, condition: str, reason: str = "", message: str = "", kind: str = "Job") -> None:
    """The Job controller writes a finished condition."""
    import copy

    job = copy.deepcopy(api.objects[(kind, name)])
    job["status"] = {"conditions": [{"type": condition, "status": "True", "reason": reason, "message": message}]}
    api.upsert(job)


def scheduling_event(api, pod_name: str, message: str, ts: str = "2025-01-01T00:00:05Z") -> None:
    api.upsert({"kind": "Event", "metadata": {"name": f"{pod_name}.ev"}, "reason": "FailedScheduling",
                "involvedObject": {"kind": "Pod", "name": pod_name}, "lastTimestamp": ts, "message": message})
