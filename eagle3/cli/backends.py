"""The backend a run's stages run on, chosen here, at the top: the scheduler drives any
:class:`eagle3.backend.Backend`, and neither the pipeline nor the Kubernetes package imports the other."""

from __future__ import annotations

from typing import Any

from eagle3.backend import Backend
from eagle3.config import PipelineConfig
from eagle3.errors import ConfigError


def open_backend(cfg: PipelineConfig, state: Any) -> Backend:
    """The backend named by the config (``--backend`` overrides it); ``state`` is the run's
    :class:`eagle3.pipeline.runstate.RunState`."""
    if cfg.backend == "local":
        from eagle3.pipeline.local import LocalBackend

        return LocalBackend(cfg, state)
    try:
        from eagle3.k8s.backend import KubernetesBackend
    except ImportError as e:
        raise ConfigError(f"backend 'kubernetes' is not available: cannot import eagle3.k8s.backend ({e})") from None
    return KubernetesBackend(cfg, state)
