"""Settings of the Kubernetes backend (read only by eagle3.k8s; stage code never sees them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KubernetesSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(None, description="Namespace; default the kubeconfig context's (or in-cluster).")
    context: str | None = Field(None, description="kubeconfig context; default the current one.")
    image: str = Field("ghcr.io/eagle3ctl/eagle3:0.1.0", description="Stage image (GPU variant) for extract/train/evaluate.")
    cpu_image: str = Field("ghcr.io/eagle3ctl/eagle3-cpu:0.1.0", description="CPU-only stage image for generate/vocab/export.")
    serve_image: str = Field("ghcr.io/eagle3ctl/eagle3-serve:0.1.0", description="vLLM image with eagle3 installed.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs of one node; GPU stages request all of them.")
    nodes: int = Field(1, ge=1, description="Nodes for extract/train (torchrun over an Indexed Job).")
