"""examples/kimi-k2.5.yaml renders to a valid, complete production run for one 8-GPU node."""

from __future__ import annotations

from pathlib import Path

import yaml

from eagle3.config import PipelineConfig, load_config
from eagle3.k8s.render import render_run
from eagle3.stages import STAGES
from tests.k8s.checks import by_name, pod_specs, validate_strict

EXAMPLE = Path(__file__).parents[2] / "examples" / "kimi-k2.5.yaml"


def test_kimi_example_is_a_complete_valid_run_for_one_8_gpu_node():
    cfg = load_config(EXAMPLE)
    objects = render_run(cfg)
    validate_strict(objects)  # strict, Kubernetes 1.30 and the newest schemas shipped
    ns = cfg.kubernetes.namespace
    # complete: setup, config, server, and one Job per stage
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Job"} == {f"eagle3-{cfg.run_id}-{s}" for s in STAGES}
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
                 "NetworkPolicy"):
        assert any(o["kind"] == kind for o in objects), kind
    # the whole node, for the server and every GPU stage
    dep = by_name(objects, "Deployment", "-serve")
    serve = dep["spec"]["template"]["spec"]["containers"][0]
    assert serve["resources"]["limits"]["nvidia.com/gpu"] == serve["resources"]["requests"]["nvidia.com/gpu"] == "8"
    cmd = serve["command"]
    assert cmd[:3] == ["vllm", "serve", "moonshotai/Kimi-K2.5"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8"
    assert cmd[cmd.index("--reasoning-parser") + 1] == "kimi_k2" and "--trust-remote-code" in cmd
    for stage in ("extract", "train", "evaluate"):
        c = by_name(objects, "Job", f"-{stage}")["spec"]["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "8"
        assert c["image"] == cfg.kubernetes.image
    # the pods read the run's config: aux layer ids in vLLM's convention for L = 61
    config = yaml.safe_load(by_name(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    pod_cfg = PipelineConfig.model_validate(config)
    assert pod_cfg.target.aux_layer_ids == [2, 30, 58] and pod_cfg.target.vocab_size == 163840
    assert pod_cfg.store.uri == cfg.store.uri and pod_cfg.backend == "kubernetes"
    # credentials by reference, each where its stage needs it; every pod non-root
    for name, spec in pod_specs(objects):
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        if not name.endswith("-serve"):
            assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "eagle3-s3", name
        if name.endswith(("-serve", "-extract", "-train", "-evaluate")):
            assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "eagle3-hf", name
        assert spec["securityContext"]["runAsNonRoot"] is True
    gen = by_name(objects, "Job", "-generate")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert gen[gen.index("--endpoint") + 1] == f"http://eagle3-{cfg.run_id}-serve.{ns}.svc:8000/v1"
