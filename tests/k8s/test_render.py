"""The rendered run: valid against the official schemas, and the production conventions hold."""

from __future__ import annotations

import pytest
import yaml

from eagle3.config import PipelineConfig, load_config
from eagle3.errors import ConfigError
from eagle3.k8s.render import CHART_DIR, render_run, render_yaml, values_from_config
from eagle3.stages import STAGES
from tests.k8s.checks import by_name, pod_specs, validate_strict
from tests.k8s.conftest import SECRET_VALUES

GPU_STAGES = [s for s, spec in STAGES.items() if spec.resource == "gpu"]
CPU_STAGES = [s for s, spec in STAGES.items() if spec.resource == "cpu"]


def test_every_object_is_valid_for_1_30_and_the_newest(prod_cfg):
    objects = render_run(prod_cfg)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "Job", "NetworkPolicy", "PersistentVolumeClaim", "Role", "RoleBinding",
                     "Service", "ServiceAccount"]
    validate_strict(objects)


def test_gpu_pods_request_the_whole_node_and_cpu_jobs_none(prod_cfg):
    objects = render_run(prod_cfg)
    for stage in GPU_STAGES:
        res = by_name(objects, "Job", f"-{stage}")["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == "8" and res["requests"]["nvidia.com/gpu"] == "8", stage
    for stage in CPU_STAGES:
        job = by_name(objects, "Job", f"-{stage}")
        res = job["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res["limits"] and res["limits"]["memory"] == res["requests"]["memory"]
        assert job["spec"]["template"]["spec"]["containers"][0]["image"] == prod_cfg.kubernetes.cpu_image
    serve = by_name(objects, "Deployment", "-serve")["spec"]["template"]["spec"]
    assert serve["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # placement constraints go to GPU pods only
    for stage in GPU_STAGES:
        spec = by_name(objects, "Job", f"-{stage}")["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["priorityClassName"] == "eagle3-batch" and spec["runtimeClassName"] == "nvidia"
    assert "nodeSelector" not in by_name(objects, "Job", "-vocab")["spec"]["template"]["spec"]


def test_vllm_deployment_has_production_defaults(prod_cfg):
    objects = render_run(prod_cfg)
    dep = by_name(objects, "Deployment", "-serve")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    # /v1/models needs the API key: an exec probe reads it from the pod's env (never a literal header)
    assert c["startupProbe"]["exec"]["command"] == ["python3", "-m", "eagle3.k8s.probe", "--port", "8000"]
    assert c["readinessProbe"]["exec"]["command"] == c["startupProbe"]["exec"]["command"]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 1800
    cmd = c["command"]
    assert cmd[:3] == ["vllm", "serve", "moonshotai/Kimi-K2.5"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "8" and "--trust-remote-code" in cmd
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0" and cmd[cmd.index("--reasoning-parser") + 1] == "kimi_k2"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "eagle3-model-cache"
    assert pod["terminationGracePeriodSeconds"] >= 60
    pvc = by_name(objects, "PersistentVolumeClaim", "model-cache")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Ti"
    svc = by_name(objects, "Service", "-serve")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    generate = by_name(objects, "Job", "-generate")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert generate[generate.index("--endpoint") + 1] == "http://eagle3-prod-1-serve.ml.svc:8000/v1"


def test_jobs_run_the_stage_entrypoint_with_failure_policy(prod_cfg):
    objects = render_run(prod_cfg)
    for stage in STAGES:
        job = by_name(objects, "Job", f"-{stage}")
        spec = job["spec"]
        cmd = spec["template"]["spec"]["containers"][0]["command"]
        entry = cmd[1:] if cmd[0] == "eagle3" else cmd[cmd.index("eagle3.cli.stage") + 1:]  # torchrun: extract, train
        assert entry[:4] == ["stage", stage, "-c", "/etc/eagle3/config.yaml"]
        assert spec["backoffLimit"] == 3 and spec["activeDeadlineSeconds"] == prod_cfg.kubernetes.deadline_s[stage]
        assert spec["ttlSecondsAfterFinished"] == prod_cfg.kubernetes.ttl_s
        rules = spec["podFailurePolicy"]["rules"]
        assert {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [ConfigError.exit_code]}} in rules
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
        assert spec["template"]["spec"]["restartPolicy"] == "Never"


def test_labels_find_every_run_object(prod_cfg):
    objects = render_run(prod_cfg)
    for o in objects:
        labels = o["metadata"]["labels"]
        for key in ("name", "instance", "version", "part-of", "managed-by"):
            assert f"app.kubernetes.io/{key}" in labels, (o["kind"], key)
        shared = o["kind"] in ("ServiceAccount", "Role", "RoleBinding", "PersistentVolumeClaim")
        assert (labels.get("eagle3.io/run") == "prod-1") != shared, o["metadata"]["name"]
        if o["kind"] == "Job":
            assert labels["eagle3.io/stage"] in STAGES
            assert o["spec"]["template"]["metadata"]["labels"]["eagle3.io/run"] == "prod-1"


def test_pods_are_non_root_without_privilege_escalation(prod_cfg):
    objects = render_run(prod_cfg)
    specs = pod_specs(objects)
    assert len(specs) == len(STAGES) + 1
    for name, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["automountServiceAccountToken"] is False, name  # stage pods need no API access
        assert spec["imagePullSecrets"] == [{"name": "ghcr"}]
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


SECRETS_OF = {  # env var -> the Secret it comes from, per pod: each stage gets only what it needs
    "serve": {"HF_TOKEN": "eagle3-hf", "VLLM_API_KEY": "eagle3-serve-api-key"},
    "generate": {"AWS_ACCESS_KEY_ID": "eagle3-s3", "AWS_SECRET_ACCESS_KEY": "eagle3-s3", "EAGLE3_API_KEY": "eagle3-serve-api-key"},
    "vocab": {"AWS_ACCESS_KEY_ID": "eagle3-s3", "AWS_SECRET_ACCESS_KEY": "eagle3-s3"},
    "export": {"AWS_ACCESS_KEY_ID": "eagle3-s3", "AWS_SECRET_ACCESS_KEY": "eagle3-s3"},
    **{gpu: {"AWS_ACCESS_KEY_ID": "eagle3-s3", "AWS_SECRET_ACCESS_KEY": "eagle3-s3", "HF_TOKEN": "eagle3-hf"} for gpu in GPU_STAGES},
}


def test_each_pod_gets_only_the_secrets_its_stage_needs(prod_cfg):
    objects = render_run(prod_cfg)
    seen = set()
    for o in objects:
        stage = o["metadata"]["labels"].get("eagle3.io/stage")
        if o["kind"] not in ("Job", "Deployment"):
            continue
        env = o["spec"]["template"]["spec"]["containers"][0]["env"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env if "valueFrom" in e}
        assert refs == SECRETS_OF[stage], stage
        seen.add(stage)
    assert seen == set(SECRETS_OF)
    by_var = {e["name"]: e for e in by_name(objects, "Job", "-generate")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert by_var["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "eagle3-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert by_var["EAGLE3_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "eagle3-serve-api-key", "key": "api-key"}


def test_credentials_come_from_secret_references_only(prod_cfg):
    objects = render_run(prod_cfg)
    for name, spec in pod_specs(objects):
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert all("value" not in env[k] for k in SECRET_VALUES if k in env), name
        assert "VLLM_API_KEY" not in str(spec["containers"][0]["command"])  # never on a command line (vLLM logs its args)
    text = render_yaml(prod_cfg)
    for value in SECRET_VALUES.values():
        assert value not in text


def test_only_the_runs_generate_pods_may_reach_the_server(prod_cfg):
    objects = render_run(prod_cfg)
    policy = by_name(objects, "NetworkPolicy", "-serve")
    serve = by_name(objects, "Deployment", "-serve")
    generate = by_name(objects, "Job", "-generate")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == serve["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector / ipBlock: this namespace's pods only
    assert all(generate.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items())
    assert peer["podSelector"]["matchLabels"]["eagle3.io/run"] == "prod-1"
    assert peer["podSelector"]["matchLabels"]["eagle3.io/stage"] == "generate"
    for stage in ("vocab", "extract", "train", "export", "evaluate"):
        labels = by_name(objects, "Job", f"-{stage}")["spec"]["template"]["metadata"]["labels"]
        assert not all(labels.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items()), stage
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_no_secrets_configured_means_no_secret_env(tmp_path):
    cfg = load_config(None, {"store.uri": "s3://b/p"})
    cfg = cfg.model_copy(update={"kubernetes": cfg.kubernetes.model_copy(update={"api_key_secret": None})})
    for _, spec in pod_specs(render_run(cfg)):
        assert not any("valueFrom" in e for e in spec["containers"][0]["env"])


def test_configmap_holds_the_run_config(prod_cfg):
    cm = by_name(render_run(prod_cfg), "ConfigMap", "-config")
    config = yaml.safe_load(cm["data"]["config.yaml"])
    expected = values_from_config(prod_cfg)["config"]
    # Helm writes numbers its own way (1e-06); what matters is that pods load the same config.
    assert PipelineConfig.model_validate(config) == PipelineConfig.model_validate(expected)
    assert config["run_id"] == "prod-1" and config["backend"] == "kubernetes"
    assert config["target"]["cache_dir"].startswith("/var/cache/eagle3")


def test_multi_node_train_runs_torchrun_over_an_indexed_job(prod_cfg):
    cfg = prod_cfg.model_copy(update={"kubernetes": prod_cfg.kubernetes.model_copy(update={"nodes": 2})})
    objects = render_run(cfg)
    validate_strict(objects)
    for stage in ("extract", "train"):
        job = by_name(objects, "Job", f"-{stage}")
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
        svc = by_name(objects, "Service", f"-{stage}")
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        spec = job["spec"]["template"]["spec"]
        assert spec["subdomain"] == svc["metadata"]["name"]
        cmd = spec["containers"][0]["command"]
        assert cmd[0] == "eagle3-torchrun" and "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd
        assert "--node-rank=$(JOB_COMPLETION_INDEX)" in cmd
        assert f"--master-addr={job['metadata']['name']}-0.{svc['metadata']['name']}" in cmd
        assert cmd[cmd.index("-m") + 1:][:3] == ["eagle3.cli.stage", "stage", stage]
    assert "completionMode" not in by_name(objects, "Job", "-evaluate")["spec"]  # evaluate stays on one node


def test_one_node_runs_extract_and_train_under_torchrun_on_every_gpu(prod_cfg):
    objects = render_run(prod_cfg)  # one node of 8 GPUs
    validate_strict(objects)
    for stage in ("extract", "train"):
        job = by_name(objects, "Job", f"-{stage}")
        assert "completionMode" not in job["spec"]
        cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
        assert cmd[:3] == ["eagle3-torchrun", "--standalone", "--nproc-per-node=8"]
        assert cmd[cmd.index("-m") + 1:][:3] == ["eagle3.cli.stage", "stage", stage]
    assert by_name(objects, "Job", "-evaluate")["spec"]["template"]["spec"]["containers"][0]["command"][0] == "eagle3"


def test_jobset_switch_renders_jobsets(prod_cfg):
    k8s = prod_cfg.kubernetes.model_copy(update={"nodes": 2, "multi_node": "jobset"})
    objects = render_run(prod_cfg.model_copy(update={"kubernetes": k8s}))
    validate_strict(objects)
    js = by_name(objects, "JobSet", "-train")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["metadata"]["labels"]["eagle3.io/stage"] == "train"
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == job["parallelism"] == 2 and job["completionMode"] == "Indexed"
    name = js["metadata"]["name"]
    assert f"--master-addr={name}-node-0-0.{name}" in job["template"]["spec"]["containers"][0]["command"]
    role = by_name(objects, "Role", "eagle3")
    assert any("jobset.x-k8s.io" in r["apiGroups"] for r in role["rules"])


def test_role_is_least_privilege(prod_cfg):
    role = by_name(render_run(prod_cfg), "Role", "eagle3")
    resources = {res for r in role["rules"] for res in r["resources"]}
    assert "secrets" not in resources and "pods/exec" not in resources and "roles" not in resources
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in role["rules"])
    assert ["get", "list", "watch", "create", "delete"] == next(r["verbs"] for r in role["rules"] if r["resources"] == ["jobs"])


def test_external_endpoint_renders_no_server(prod_cfg):
    cfg = prod_cfg.model_copy(update={"serve": prod_cfg.serve.model_copy(update={"endpoint": "http://vllm.shared:8000/v1"})})
    objects = render_run(cfg)
    assert not [o for o in objects if o["kind"] == "Deployment"]
    assert "--endpoint" not in by_name(objects, "Job", "-generate")["spec"]["template"]["spec"]["containers"][0]["command"]


def test_file_store_needs_a_pvc():
    with pytest.raises(ConfigError, match="kubernetes.store_pvc"):
        render_run(load_config(None, {"store.uri": "file:///data/store"}))
    cfg = load_config(None, {"store.uri": "file:///data/store", "kubernetes.store_pvc": "store"})
    job = by_name(render_run(cfg), "Job", "-vocab")["spec"]["template"]["spec"]
    assert {"name": "store", "mountPath": "/data/store"} in job["containers"][0]["volumeMounts"]


def test_tensor_parallel_beyond_the_node_is_a_config_error(prod_cfg):
    cfg = prod_cfg.model_copy(update={"serve": prod_cfg.serve.model_copy(update={"tensor_parallel_size": 16})})
    with pytest.raises(ConfigError, match="gpus_per_node"):
        render_run(cfg)


def test_default_values_list_the_registry_stages():
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert [s["name"] for s in values["run"]["stages"]] == list(STAGES)
    assert [s["resource"] for s in values["run"]["stages"]] == [s.resource for s in STAGES.values()]


def qos_class(spec: dict) -> str:
    """The QoS class the kubelet gives a pod (the rules of pkg/apis/core/helper/qos)."""
    res = [c.get("resources", {}) for c in spec["containers"]]
    if all(r.get("limits", {}).get(k) and r["limits"][k] == r.get("requests", {}).get(k) for r in res for k in ("cpu", "memory")):
        return "Guaranteed"
    return "Burstable" if any(r.get("requests") or r.get("limits") for r in res) else "BestEffort"


def test_gpu_pods_are_guaranteed_with_the_shm_counted(prod_cfg):
    objects = render_run(prod_cfg)
    for name, spec in pod_specs(objects):
        assert qos_class(spec) == "Guaranteed", name  # never evicted before BestEffort/Burstable pods
    for stage in [*GPU_STAGES, "serve"]:
        kind = "Deployment" if stage == "serve" else "Job"
        c = by_name(objects, kind, f"-{stage}")["spec"]["template"]["spec"]["containers"][0]
        # 8 GPUs: 8 CPUs and 96Gi each by default, plus the 64Gi memory-backed /dev/shm
        assert c["resources"]["requests"] == {"cpu": "64", "memory": "832Gi", "nvidia.com/gpu": "8"}, stage
    k8s = prod_cfg.kubernetes.model_copy(update={"gpu_cpu": "100", "gpu_memory": "1500Gi", "shm_size": "512Mi"})
    objects = render_run(prod_cfg.model_copy(update={"kubernetes": k8s}))
    res = by_name(objects, "Job", "-train")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"] == res["requests"] == {"cpu": "100", "memory": "1536512Mi", "nvidia.com/gpu": "8"}


def test_a_cpu_only_cluster_gives_gpu_class_pods_the_cpu_resources_plus_shm():
    cfg = load_config(None, {"store.uri": "s3://b/p", "kubernetes.gpus_per_node": 0, "kubernetes.shm_size": "1Gi",
                             "kubernetes.cpu_resources": {"cpu": "500m", "memory": "2Gi"}})
    res = by_name(render_run(cfg), "Job", "-extract")["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"] == res["requests"] == {"cpu": "500m", "memory": "3Gi"}
