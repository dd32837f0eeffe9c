"""A run in its store: the store opened for it, and the config recorded for it.

``eagle3ctl run`` records the config of its latest attempt that committed a stage, or ended
with every stage complete, as the run's (``RUN_CONFIG``, written by
``eagle3.pipeline.runner.ConfigRecord``): ``status`` and ``verify`` without ``-c`` judge the
run by it (``judged_config``), from any directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.errors import RunNotFound
from eagle3.store import ObjectStore, open_store

RUN_CONFIG = "_run/config.json"  # the config of the latest attempt that committed a stage or ended complete


def local_store_root(uri: str) -> Path | None:
    """The folder of a ``file://`` store URI (or a plain path); None for s3://."""
    if uri.startswith("s3://"):
        return None
    raw = uri[len("file://"):] if uri.startswith("file://") else uri
    return Path(raw) if raw else None


def open_run_store(cfg: PipelineConfig, create: bool = True) -> ObjectStore:
    """The run's store; ``create=False`` (commands that only read) makes no folder for a
    ``file://`` store that is not there, and says there is no such run."""
    if not create:
        root = local_store_root(cfg.store.uri)
        if root is not None and not root.is_dir():
            raise RunNotFound(f"run {cfg.run_id} has nothing in file://{root.resolve()}: no such store folder "
                              f"(check -c / --run-id and --store)")
    store = open_store(cfg.store.uri, cfg.store.endpoint_url, cfg.store.region, cfg.store.max_attempts,
                       cfg.store.retry_mode)
    check = getattr(store, "check", None)
    if check is not None:
        check()
    return store


def require_run(store: ObjectStore, run_id: str) -> None:
    """A run id the store holds nothing for is a mistake to say, not an empty report."""
    if not store.has_prefix(run_id):
        raise RunNotFound(f"run {run_id} has nothing in {store.uri}: no such run (check -c / --run-id and --store)")


def recorded_config(store: ObjectStore, run_id: str) -> PipelineConfig | None:
    """The resolved config of the run's latest attempt that committed a stage (``_run/config.json``)."""
    key = f"{run_id}/{RUN_CONFIG}"
    try:
        return PipelineConfig.model_validate(json.loads(store.get_bytes(key))) if store.exists(key) else None
    except ValueError:
        return None


def judged_config(cfg: PipelineConfig, store: ObjectStore, config_given: bool) -> tuple[PipelineConfig, bool]:
    """The config a run's stages are judged against, and whether input keys are checked at all:
    the one given (``-c``); else the one recorded in the store for the run; else none (keys unchecked)."""
    if config_given:
        return cfg, True
    recorded = recorded_config(store, cfg.run_id)
    if recorded is None:
        return cfg, False
    return recorded.model_copy(update={"run_id": cfg.run_id, "store": cfg.store}), True
