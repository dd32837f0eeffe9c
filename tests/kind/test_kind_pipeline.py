"""End to end on a kind cluster with examples/kind.yaml: MinIO (tests/kind/minio.yaml) is the S3
store, the chart installs with the values `eagle3ctl render --values --controller` writes, `helm
test` passes (store and every API call of a run), the controller Job runs the whole tiny pipeline
in-cluster with the CPU-only image, failures are one line, `down` cleans up.

Needs `kind` and `docker` (skipped otherwise, saying so). Run: ``pytest -m kind tests/kind``.
Reuse a cluster with ``EAGLE3_KIND_CLUSTER=NAME``; the image ``eagle3-cpu:dev`` is built from
the repository's Dockerfile (VARIANT=cpu) when docker does not have it yet, then loaded into kind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.kind, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("kind") is None or shutil.which("docker") is None,
                                 reason="needs `kind` and `docker` on PATH (see docs/kubernetes.md, 'kind tests')")]

REPO = Path(__file__).parents[2]
CHART = REPO / "charts" / "eagle3"
KIND_EXAMPLE = REPO / "examples" / "kind.yaml"
MINIO = Path(__file__).parent / "minio.yaml"
IMAGE = "eagle3-cpu:dev"
PIPELINE_TIMEOUT_S = 1800


def sh(*cmd: str, timeout: float = 1200) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A kind cluster with the CPU image loaded; yields the kubeconfig path."""
    name = os.environ.get("EAGLE3_KIND_CLUSTER")
    created = name is None
    name = name or f"eagle3-e2e-{uuid.uuid4().hex[:6]}"
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    if created:
        sh("kind", "create", "cluster", "--name", name, "--kubeconfig", str(kubeconfig), "--wait", "180s")
    else:
        kubeconfig.write_text(sh("kind", "get", "kubeconfig", "--name", name))
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        sh("docker", "build", "--build-arg", "VARIANT=cpu", "--build-arg", "BASE_IMAGE=python:3.11-slim-bookworm",
           "-t", IMAGE, str(REPO), timeout=3600)
    sh("kind", "load", "docker-image", IMAGE, "--name", name)
    os.environ["KUBECONFIG"] = str(kubeconfig)
    try:
        yield kubeconfig
    finally:
        if created:
            subprocess.run(["kind", "delete", "cluster", "--name", name], capture_output=True)


@pytest.fixture(scope="module")
def namespace(cluster):
    from kubernetes import client, config, utils

    config.load_kube_config(str(cluster))
    ns = f"eagle3-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api()
    core.create_namespace({"metadata": {"name": ns}})
    # MinIO, its Secret (kubernetes.s3_secret of the profile) and the bucket
    utils.create_from_yaml(client.ApiClient(), str(MINIO), namespace=ns)
    wait_job(ns, "eagle3-minio-bucket", 300)
    yield ns
    core.delete_namespace(ns)


def wait_job(ns: str, name: str, timeout_s: float) -> dict:
    from kubernetes import client

    batch = client.BatchV1Api()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = batch.read_namespaced_job(name, ns).to_dict()
        for c in (job["status"] or {}).get("conditions") or []:
            if c["type"] in ("Complete", "Failed") and c["status"] == "True":
                return job
        time.sleep(5)
    raise AssertionError(f"Job {name} did not finish within {timeout_s}s")


def test_chart_installs_and_the_pipeline_runs_in_cluster(cluster, namespace):
    import helm_python as helm
    from kubernetes import client

    from eagle3.config import load_config
    from eagle3.k8s.render import install_values

    values = install_values(load_config(KIND_EXAMPLE), controller=True)  # = eagle3ctl render --values --controller
    with helm.Config(kubeconfig_path=str(cluster), namespace=namespace) as hc:
        hc.install(str(CHART), "eagle3-kind", values, wait="watcher", timeout=300)
        hc.test("eagle3-kind", timeout=300)  # store and API checks from inside the namespace
        job = wait_job(namespace, "eagle3-kind-e2e-controller", PIPELINE_TIMEOUT_S)
        pods = client.CoreV1Api().list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=controller")
        log = client.CoreV1Api().read_namespaced_pod_log(pods.items[-1].metadata.name, namespace)
        assert any(c["type"] == "Complete" for c in job["status"]["conditions"]), log[-3000:]
        stage_jobs = client.BatchV1Api().list_namespaced_job(namespace, label_selector="eagle3.io/run=kind-e2e,app.kubernetes.io/component=stage")
        done = {j.metadata.labels["eagle3.io/stage"] for j in stage_jobs.items if (j.status.succeeded or 0) >= 1}
        assert done == {"generate", "vocab", "extract", "train", "export", "evaluate"}, log[-3000:]
        # the server was torn down before the GPU-class stages
        assert not client.AppsV1Api().list_namespaced_deployment(namespace, label_selector="eagle3.io/run=kind-e2e").items
        hc.uninstall("eagle3-kind")


def test_backend_reports_an_unpullable_image_in_one_line_and_down_cleans_up(cluster, namespace):
    from eagle3.config import PipelineConfig
    from eagle3.k8s.backend import KubernetesBackend

    data = yaml.safe_load(KIND_EXAMPLE.read_text())
    data["run_id"] = "kind-fail"
    data["kubernetes"] = {**data["kubernetes"], "namespace": namespace, "cpu_image": "eagle3-cpu:missing"}
    import helm_python as helm

    from eagle3.k8s.render import install_values

    cfg = PipelineConfig.model_validate(data)
    with helm.Config(kubeconfig_path=str(cluster), namespace=namespace) as hc:
        hc.install(str(CHART), "eagle3-kind-fail", install_values(cfg), wait="watcher", timeout=300)  # the namespace setup
    lines: list[str] = []
    backend = KubernetesBackend(cfg, echo=lines.append)
    handle = backend.submit("vocab", input_key="0" * 64)
    deadline = time.monotonic() + 300
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        outcome = backend.poll(handle)
    assert outcome is not None and not outcome.succeeded
    assert outcome.reason.startswith("ErrImageNeverPull") and "\n" not in outcome.reason
    removed = backend.down()
    assert "ConfigMap/eagle3-kind-fail-config" in removed
    assert backend.api.list("Job", "eagle3.io/run=kind-fail")[0] == []
