"""examples/kind.yaml: the CPU-only profile the kind e2e tests run (MinIO as the S3 store)."""

from __future__ import annotations

from pathlib import Path

import yaml

from eagle3.config import load_config
from eagle3.k8s.render import render_run
from tests.k8s.apiserver_double import validate_object
from tests.k8s.checks import by_name, pod_specs, validate_strict
from tests.k8s.test_render import qos_class

REPO = Path(__file__).parents[2]
EXAMPLE = REPO / "examples" / "kind.yaml"
MINIO = REPO / "tests" / "kind" / "minio.yaml"


def test_the_kind_profile_renders_valid_cpu_only_objects():
    cfg = load_config(EXAMPLE)
    objects = render_run(cfg, "eagle3")
    validate_strict(objects)
    for o in objects:
        if o["kind"] in ("Job", "Deployment"):
            validate_object(o)
    for name, spec in pod_specs(objects):
        c = spec["containers"][0]
        assert c["image"] == "eagle3-cpu:dev" and c["imagePullPolicy"] == "Never", name
        assert "nvidia.com/gpu" not in c["resources"]["limits"], name
        assert qos_class(spec) == "Guaranteed", name
        assert not any(v.get("persistentVolumeClaim", {}).get("claimName") == "eagle3-store" for v in spec["volumes"])
    config = yaml.safe_load(by_name(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    assert config["store"] == {"uri": "s3://eagle3/kind", "endpoint_url": "http://eagle3-minio:9000", "region": "us-east-1",
                               "max_attempts": 10, "retry_mode": "standard"}
    vocab = {e["name"]: e for e in by_name(objects, "Job", "-vocab")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert vocab["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "eagle3-minio", "key": "AWS_SECRET_ACCESS_KEY"}


def test_the_minio_manifest_is_valid_and_gives_the_secret_the_profile_names():
    docs = [d for d in yaml.safe_load_all(MINIO.read_text()) if d]
    validate_strict(docs)
    secret = next(d for d in docs if d["kind"] == "Secret")
    cfg = load_config(EXAMPLE)
    assert secret["metadata"]["name"] == cfg.kubernetes.s3_secret
    assert set(secret["stringData"]) == {cfg.kubernetes.s3_access_key_key, cfg.kubernetes.s3_secret_key_key}
    svc = next(d for d in docs if d["kind"] == "Service")
    assert cfg.store.endpoint_url == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"


def test_the_generated_kind_values_are_what_render_writes_today():
    """eagle3/k8s/chart/ci/kind-values.yaml is generated (its first line says how): every setting a config section
    has is there with the value render gives it now. A setting added to a stage without regenerating the file
    breaks this, not the kind e2e run that installs it."""
    from eagle3.k8s.render import install_values

    kept = yaml.safe_load((REPO / "eagle3" / "k8s" / "chart" / "ci" / "kind-values.yaml").read_text())
    assert install_values(load_config(EXAMPLE), controller=True) == kept
