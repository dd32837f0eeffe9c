"""Settings of the Kubernetes backend (read only by eagle3.k8s; stage code never sees them).

Every field lands in the Helm chart's values through ``eagle3.k8s.render.values_from_config``;
the chart's templates are the only place Kubernetes objects are written.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P)?$"


class Resources(BaseModel):
    """Requests (= limits for memory) of a CPU-only container."""

    model_config = ConfigDict(extra="forbid")

    cpu: str = Field("2", pattern=_QUANTITY, description="CPU request (and limit).")
    memory: str = Field("8Gi", pattern=_QUANTITY, description="Memory request and limit.")


class Toleration(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(None, description="Taint key (e.g. nvidia.com/gpu).")
    operator: str = Field("Exists", pattern="^(Exists|Equal)$", description="Exists or Equal.")
    value: str | None = Field(None, description="Taint value (operator Equal).")
    effect: str | None = Field(None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$", description="Taint effect; empty matches all.")


# No public registry holds the images: the user builds and pushes them (docs/images.md). The
# defaults name this placeholder so that a config left at them says so instead of pulling.
PLACEHOLDER_REGISTRY = "registry.example.com/eagle3"
IMAGE_FIELDS = ("image", "cpu_image", "serve_image")


class KubernetesSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(None, description="Namespace; default the kubeconfig context's (or in-cluster).")
    context: str | None = Field(None, description="kubeconfig context; default the current one.")
    release: str | None = Field(None, description="Helm release name the objects carry (app.kubernetes.io/instance); default eagle3-<run_id>.")
    image: str = Field(f"{PLACEHOLDER_REGISTRY}/eagle3:0.1.0", description="Stage image (GPU variant) for extract/train/evaluate. "
                       "Built and pushed by you (docs/images.md): the default names a placeholder registry.")
    cpu_image: str = Field(f"{PLACEHOLDER_REGISTRY}/eagle3-cpu:0.1.0", description="CPU-only stage image for generate/vocab/export "
                           "and the controller. Built and pushed by you (docs/images.md).")
    serve_image: str = Field(f"{PLACEHOLDER_REGISTRY}/eagle3-serve:0.1.0", description="vLLM image with eagle3 installed. "
                             "Built and pushed by you (docs/images.md).")
    image_pull_policy: str = Field("IfNotPresent", pattern="^(Always|IfNotPresent|Never)$", description="imagePullPolicy of every container.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Names of docker-registry Secrets for private images.")
    gpus_per_node: int = Field(8, ge=0, description="GPUs of one node; GPU stages and the server request all of them (0: CPU-only cluster such as kind).")
    gpu_resource: str = Field("nvidia.com/gpu", description="Extended resource name of a GPU.")
    nodes: int = Field(1, ge=1, description="Nodes for extract/train (torchrun over an Indexed Job + headless Service, or a JobSet).")
    multi_node: str = Field("indexed", pattern="^(indexed|jobset)$", description="Multi-node mechanism: an Indexed Job + headless Service, or a JobSet (needs the JobSet controller).")
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="torchrun rendezvous port on pod 0.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of GPU pods (serve, extract, train, evaluate).")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of GPU pods.")
    priority_class: str | None = Field(None, description="priorityClassName of GPU pods.")
    runtime_class: str | None = Field(None, description="runtimeClassName of GPU pods (e.g. nvidia).")
    service_account: str = Field("eagle3", description="ServiceAccount of the controller (with the run Role) and of stage pods (no token mounted).")
    s3_secret: str | None = Field(None, description="Secret holding the store's S3 keys (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY); none: workload identity.")
    s3_access_key_key: str = Field("AWS_ACCESS_KEY_ID", description="Key of the access key id in s3_secret.")
    s3_secret_key_key: str = Field("AWS_SECRET_ACCESS_KEY", description="Key of the secret access key in s3_secret.")
    hf_secret: str | None = Field(None, description="Secret holding a Hugging Face token (HF_TOKEN) for gated models.")
    hf_token_key: str = Field("HF_TOKEN", description="Key of the token in hf_secret.")
    api_key_secret: str | None = Field("eagle3-serve-api-key", description="Secret holding the server's API key (vLLM --api-key, sent by generate); `helm install` creates it with a random key; none: no key (the NetworkPolicy still admits only the run's generate pods).")
    api_key_key: str = Field("api-key", description="Key of the API key in api_key_secret.")
    model_cache_pvc: str = Field("eagle3-model-cache", description="PVC holding downloaded target weights (HF_HOME); shared across runs, never deleted by down.")
    model_cache_size: str = Field("2Ti", pattern=_QUANTITY, description="Size of the model-cache PVC when it is created.")
    model_cache_storage_class: str | None = Field(None, description="storageClassName of the model-cache PVC; default the cluster's.")
    model_cache_access_mode: str = Field("ReadWriteOnce", pattern="^(ReadWriteOnce|ReadWriteMany|ReadWriteOncePod)$", description="Access mode of the model-cache PVC (ReadWriteMany for multi-node).")
    store_pvc: str | None = Field(None, description="PVC mounted at the path of a file:// store in every pod (single-node clusters such as kind); production uses s3://.")
    shm_size: str = Field("64Gi", pattern=_QUANTITY, description="Size of the /dev/shm memory volume of GPU pods (NCCL, dataloaders); counted in their memory request and limit.")
    gpu_cpu: str | None = Field(None, pattern=_QUANTITY, description="CPU request = limit of GPU pods (server, extract, train, evaluate); none: 8 per GPU (Guaranteed QoS, whole cores).")
    gpu_memory: str | None = Field(None, pattern=_QUANTITY, description="Memory of GPU pods besides /dev/shm (request = limit = this + shm_size); none: 96Gi per GPU.")
    cpu_resources: Resources = Field(default_factory=Resources, description="Requests/limits of CPU stage pods and the controller.")
    backoff_limit: int = Field(3, ge=0, description="Job backoffLimit: retries of a failed stage pod (a resumed stage continues).")
    deadline_s: dict[str, int] = Field(
        default_factory=lambda: {"generate": 86400, "vocab": 3600, "extract": 172800, "train": 259200, "export": 3600, "evaluate": 21600},
        description="activeDeadlineSeconds per stage.",
    )
    ttl_s: int = Field(604800, ge=0, description="ttlSecondsAfterFinished of finished Jobs (their logs stay readable until then).")
    termination_grace_s: int = Field(120, ge=1, description="terminationGracePeriodSeconds of the server and GPU pods (frees GPU memory, lets train checkpoint).")
    vllm_args: list[str] = Field(default_factory=list, description="Extra vllm serve arguments (after those from serve.*).")
    startup_failure_threshold: int = Field(180, ge=1, description="Startup probe attempts (every 10 s) before the server pod is restarted: loading 1T weights takes long.")
    pending_timeout_s: float | None = Field(None, gt=0, description="Fail a stage whose pods stay Pending (unschedulable) this long; none: wait, reporting the scheduler's event every few minutes (a shared or autoscaling GPU cluster).")
    cancel_on_interrupt: bool = Field(False, description="Ctrl-C / SIGTERM deletes the running Jobs; default: leave them running (detach) for the next run to attach to (`eagle3ctl down` cancels).")

    @model_validator(mode="after")
    def _multi_node_cache(self) -> KubernetesSettings:
        if self.nodes > 1 and self.model_cache_access_mode != "ReadWriteMany":
            raise ValueError(f"nodes={self.nodes} needs model_cache_access_mode: ReadWriteMany (kubernetes.model_cache_access_mode is "
                             f"{self.model_cache_access_mode}: the extract/train pods on other nodes could not mount the model cache)")
        return self

    @field_validator("deadline_s")
    @classmethod
    def _deadlines(cls, v: dict[str, int]) -> dict[str, int]:
        for stage, seconds in v.items():
            if seconds < 1:
                raise ValueError(f"{stage}: must be at least 1 second")
        return v
