"""Every Kubernetes object of a run, rendered from the Helm chart shipped in this package.

The chart's templates are the one place objects are written: ``values_from_config`` maps a
pipeline config to chart values (a pure function), and Helm's own engine (helm-python-sdk,
offline) renders them. So ``eagle3ctl render -c CONFIG`` and
``helm template eagle3-<run> charts/eagle3 -f <(values)`` yield the same objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from eagle3.config import PipelineConfig
from eagle3.errors import ConfigError
from eagle3.k8s import quantity
from eagle3.k8s.permissions import JOBSET_CALLS, RUN_CALLS, role_rules
from eagle3.stages import STAGES

CHART_DIR = Path(__file__).parent / "chart"
CONFIG_PATH = "/etc/eagle3/config.yaml"
MODEL_CACHE_MOUNT = "/var/cache/eagle3"
MULTI_NODE_STAGES = ("extract", "train")  # stages that run under torchrun across nodes

# Creation order: what a later object refers to exists first.
KIND_ORDER = ("ServiceAccount", "Role", "RoleBinding", "Secret", "ConfigMap", "PersistentVolumeClaim",
              "NetworkPolicy", "Service", "Deployment", "Job", "JobSet", "Pod")
CPU_PER_GPU = 8  # default CPU of a GPU pod, per GPU (an 8-GPU node of 112-192 cores keeps room for the system)
MEMORY_PER_GPU_GI = 96  # default memory of a GPU pod besides /dev/shm, per GPU


def release_name(cfg: PipelineConfig) -> str:
    return cfg.kubernetes.release or f"eagle3-{cfg.run_id}"


def serve_engine(cfg: PipelineConfig) -> str:
    """vllm unless asked for transformers, or auto on a cluster without GPUs."""
    if cfg.serve.engine == "auto":
        return "vllm" if cfg.kubernetes.gpus_per_node > 0 else "transformers"
    return cfg.serve.engine


def serve_command(cfg: PipelineConfig) -> list[str]:
    """The server container's command: ``vllm serve …`` written out, or the eagle3 launcher."""
    k8s = cfg.kubernetes
    if serve_engine(cfg) == "vllm" and not cfg.target.model.startswith("builtin:"):
        from eagle3.serve.vllm import IMAGE_VLLM, vllm_command

        if cfg.serve.tensor_parallel_size > max(k8s.gpus_per_node, 1):
            raise ConfigError(f"serve.tensor_parallel_size={cfg.serve.tensor_parallel_size} exceeds "
                              f"kubernetes.gpus_per_node={k8s.gpus_per_node}")
        serve = cfg.serve.model_copy(update={"host": "0.0.0.0", "port": cfg.serve.port or 8000})
        return vllm_command(serve, cfg.target, cfg.target.model, IMAGE_VLLM) + list(k8s.vllm_args)
    # Built-in targets are built first, and the CPU stand-in is `transformers serve`.
    return ["python", "-m", "eagle3.k8s.serve", "-c", CONFIG_PATH]


def _store_mount(cfg: PipelineConfig) -> dict[str, str]:
    uri = cfg.store.uri
    if uri.startswith("s3://"):
        return {"pvc": "", "mountPath": "/var/lib/eagle3/store"}
    path = uri[len("file://"):]
    if not cfg.kubernetes.store_pvc:
        raise ConfigError(f"store.uri={uri}: a file:// store on Kubernetes needs kubernetes.store_pvc "
                          "(a PVC every pod mounts), or use an s3:// store")
    if not path.startswith("/"):
        raise ConfigError(f"store.uri={uri}: on Kubernetes a file:// store needs an absolute path (file:///PATH)")
    return {"pvc": cfg.kubernetes.store_pvc, "mountPath": path.rstrip("/") or "/"}


def pod_config(cfg: PipelineConfig) -> dict[str, Any]:
    """The config every pod reads: this run's, with the target cache on the model-cache volume."""
    data = cfg.model_dump(mode="json")
    data["backend"] = "kubernetes"
    data["target"]["cache_dir"] = f"{MODEL_CACHE_MOUNT}/targets"  # volatile: not part of input keys
    return data


def gpu_pod_resources(cfg: PipelineConfig) -> tuple[str, str]:
    """(cpu, memory) of a GPU pod, requests = limits: Guaranteed QoS, with /dev/shm in the memory
    (a memory-backed emptyDir is charged to the pod). A CPU-only cluster uses cpu_resources."""
    k8s = cfg.kubernetes
    n = k8s.gpus_per_node
    cpu = k8s.gpu_cpu or (str(CPU_PER_GPU * n) if n else k8s.cpu_resources.cpu)
    mem = k8s.gpu_memory or (f"{MEMORY_PER_GPU_GI * n}Gi" if n else k8s.cpu_resources.memory)
    return quantity.cpu(quantity.parse(cpu)), quantity.memory(quantity.parse(mem) + quantity.parse(k8s.shm_size))


def values_from_config(cfg: PipelineConfig, input_keys: dict[str, str] | None = None, force: tuple[str, ...] = (),
                       restarts: dict[str, int] | None = None) -> dict[str, Any]:
    """Chart values for the run described by ``cfg`` (pure: no cluster, no files). At submit,
    ``input_keys`` annotates a stage's Job, ``force`` adds --force, ``restarts`` counts gang restarts."""
    k8s = cfg.kubernetes
    gpu_cpu, gpu_memory = gpu_pod_resources(cfg)
    stages = [
        {"name": s.name, "resource": s.resource, "multiNode": s.name in MULTI_NODE_STAGES,
         "needsEndpoint": s.needs_endpoint, "deadlineSeconds": k8s.deadline_s.get(s.name, 86400)}
        for s in STAGES.values()
    ]
    return {
        "config": pod_config(cfg),
        "run": {"id": cfg.run_id, "objects": True, "stages": stages, "inputKeys": dict(input_keys or {}),
                "force": list(force), "restarts": dict(restarts or {})},
        "images": {"gpu": k8s.image, "cpu": k8s.cpu_image, "serve": k8s.serve_image,
                   "pullPolicy": k8s.image_pull_policy, "pullSecrets": list(k8s.image_pull_secrets)},
        "serviceAccount": {"create": True, "name": k8s.service_account},
        "rbac": {"rules": role_rules(RUN_CALLS), "jobsetRules": role_rules(JOBSET_CALLS)},
        "secrets": {
            "s3": {"name": k8s.s3_secret or "", "accessKeyIdKey": k8s.s3_access_key_key,
                   "secretAccessKeyKey": k8s.s3_secret_key_key},
            "hf": {"name": k8s.hf_secret or "", "tokenKey": k8s.hf_token_key},
            "apiKey": {"name": k8s.api_key_secret or "", "key": k8s.api_key_key, "create": True},
        },
        "gpu": {"perNode": k8s.gpus_per_node, "resourceName": k8s.gpu_resource, "nodes": k8s.nodes,
                "multiNode": k8s.multi_node, "rendezvousPort": k8s.rendezvous_port,
                "cpu": gpu_cpu, "memory": gpu_memory, "shmSize": k8s.shm_size},
        "scheduling": {"nodeSelector": dict(k8s.node_selector),
                       "tolerations": [t.model_dump(exclude_none=True) for t in k8s.tolerations],
                       "priorityClassName": k8s.priority_class or "", "runtimeClassName": k8s.runtime_class or ""},
        "cpu": {"cpu": k8s.cpu_resources.cpu, "memory": k8s.cpu_resources.memory},
        "modelCache": {"pvc": k8s.model_cache_pvc, "size": k8s.model_cache_size,
                       "storageClass": k8s.model_cache_storage_class or "",
                       "accessMode": k8s.model_cache_access_mode, "mountPath": MODEL_CACHE_MOUNT},
        "store": _store_mount(cfg),
        "serve": {"enabled": cfg.serve.endpoint is None, "command": serve_command(cfg), "port": cfg.serve.port or 8000,
                  "startupFailureThreshold": k8s.startup_failure_threshold,
                  "terminationGracePeriodSeconds": k8s.termination_grace_s},
        "jobs": {"backoffLimit": k8s.backoff_limit, "ttlSecondsAfterFinished": k8s.ttl_s,
                 "terminationGracePeriodSeconds": k8s.termination_grace_s},
        "controller": {"enabled": False, "deadlineSeconds": 604800, "extraArgs": []},
        "tests": {"enabled": False},
    }


def default_namespace(cfg: PipelineConfig) -> str:
    """The config's namespace, else the kubeconfig context's (read from the file only), else default."""
    if cfg.kubernetes.namespace:
        return cfg.kubernetes.namespace
    try:
        from kubernetes import config as kube_config

        contexts, current = kube_config.list_kube_config_contexts()
        chosen = next((c for c in contexts if c["name"] == cfg.kubernetes.context), current) if cfg.kubernetes.context else current
        return (chosen or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig: render works offline, in the default namespace
        return "default"


def render_chart(values: dict[str, Any], release: str, namespace: str, chart_dir: Path = CHART_DIR) -> list[dict]:
    """``helm template RELEASE CHART -n NAMESPACE -f values``: the objects, in creation order."""
    try:
        import helm_python as helm
    except ImportError:
        raise ConfigError("the Kubernetes backend needs Helm's engine: pip install -e '.[k8s]' in the eagle3ctl checkout") from None
    try:
        with helm.Chart.load(chart_dir) as chart:
            chart.validate_schema(values)
            manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    except helm.HelmError as e:
        raise ConfigError(f"chart {chart_dir}: {str(e).splitlines()[0]}") from None
    return sort_objects(parse_manifests(manifests))


def parse_manifests(manifests: dict[str, str]) -> list[dict]:
    objects = []
    for path, text in sorted(manifests.items()):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def sort_objects(objects: list[dict]) -> list[dict]:
    def key(o: dict) -> tuple:
        kind = o.get("kind", "")
        return (KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER), o["metadata"]["name"])

    return sorted(objects, key=key)


def render_run(cfg: PipelineConfig, namespace: str | None = None, **submit: Any) -> list[dict]:
    """Every object of the run (namespace setup, config, server, one Job per stage); ``submit``
    as for ``values_from_config``."""
    return render_chart(values_from_config(cfg, **submit), release_name(cfg), namespace or default_namespace(cfg))


def render_yaml(cfg: PipelineConfig, namespace: str | None = None) -> str:
    return yaml.safe_dump_all(render_run(cfg, namespace), sort_keys=False, explicit_start=True)


def install_values(cfg: PipelineConfig, controller: bool = False) -> dict[str, Any]:
    """Values for ``helm install -f``: the namespace setup, this run's ConfigMap and the test
    hook, exactly as eagle3ctl renders them; the run's Jobs stay with eagle3ctl (run.objects
    false) or, with ``controller``, with the in-cluster controller, which submits them one by one."""
    values = values_from_config(cfg)
    values["run"]["objects"] = False
    values["controller"]["enabled"] = controller
    values["tests"]["enabled"] = True
    return values


def stage_objects(objects: list[dict], stage: str) -> list[dict]:
    """The objects that run one stage: its Job (or JobSet) and, multi-node, its headless Service."""
    return [o for o in objects if o["metadata"].get("labels", {}).get("eagle3.io/stage") == stage]
