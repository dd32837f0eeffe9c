"""The stage registry: what each stage reads, which config matters to it, where it runs.

This is data, not orchestration: the stage entrypoint uses it to compute input keys
and check upstream manifests; the backends use it to build the DAG.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from eagle3.config import PipelineConfig


@dataclass(frozen=True)
class Required:
    """An object a stage's manifest must list: a name, or a pattern (``fnmatch``) listed at
    least once, or exactly as often as the list ``counted_by = (object, field)`` of that JSON
    object of the same manifest holds entries (extract: one shard per ``index.json`` shard)."""

    pattern: str
    counted_by: tuple[str, str] | None = None


@dataclass(frozen=True)
class StageSpec:
    name: str
    needs: tuple[str, ...]  # upstream stages whose manifests it reads
    sections: tuple[str, ...]  # config sections that determine its outputs
    resource: str  # "cpu" or "gpu": GPU stages get the node's GPUs exclusively
    entry: str  # "module:function" taking a StageContext, returning stats
    check: str | None  # "module:function" deep content check (store, manifest) -> problems
    description: str
    needs_endpoint: bool = False  # generate: needs the serve stage's endpoint
    preflight: str | None = None  # "module:function" (cfg) -> None, raising a one-line Eagle3Error
    required: tuple[Required, ...] = ()  # objects every commit lists (manifest.missing_required)

    def load_entry(self) -> Callable[..., dict[str, Any]]:
        return _load(self.entry)

    def load_check(self) -> Callable[..., list[str]] | None:
        return _load(self.check) if self.check else None

    def load_preflight(self) -> Callable[..., None] | None:
        return _load(self.preflight) if self.preflight else None


def _load(path: str) -> Any:
    module, func = path.split(":")
    return getattr(importlib.import_module(module), func)


def _names(*names: str) -> tuple[Required, ...]:
    return tuple(Required(n) for n in names)


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("generate", (), ("target", "generate"), "cpu", "eagle3.generate.stage:run", "eagle3.generate.stage:deep_check",
                  "target responses to prompts, tokenized with loss masks", needs_endpoint=True,
                  required=_names("raw_responses.jsonl", "tokenized.safetensors", "token_freq.safetensors",
                                  "metadata.json")),
        StageSpec("vocab", ("generate",), ("vocab",), "cpu", "eagle3.vocab.stage:run", "eagle3.vocab.stage:deep_check",
                  "draft vocab: top-N assistant tokens, d2t/t2d mapping",
                  required=_names("vocab_mapping.safetensors", "coverage.json", "coverage.png")),
        StageSpec("extract", ("generate",), ("target", "extract"), "gpu", "eagle3.extract.stage:run",
                  "eagle3.extract.stage:deep_check", "aux + final hidden states of the target, in shards",
                  preflight="eagle3.targets.fit:preflight_extract",
                  required=(*_names("index.json", "target_head.safetensors"),
                            Required("shards/shard-*.safetensors", counted_by=("index.json", "shards")))),
        StageSpec("train", ("extract", "vocab"), ("drafter", "train"), "gpu", "eagle3.train.stage:run",
                  "eagle3.train.stage:deep_check", "EAGLE-3 drafter training with TTT",
                  required=_names("drafter.safetensors", "drafter_config.json", "metrics.jsonl", "loss.png")),
        StageSpec("export", ("train", "extract", "vocab"), ("export",), "cpu", "eagle3.export.stage:run",
                  "eagle3.export.stage:deep_check", "vLLM/SGLang-loadable drafter directory",
                  required=_names("config.json", "model.safetensors", "SERVING.md")),
        StageSpec("evaluate", ("export", "generate"), ("target", "evaluate"), "gpu", "eagle3.evaluate.stage:run",
                  "eagle3.evaluate.stage:deep_check", "acceptance length on held-out prompts",
                  preflight="eagle3.targets.fit:preflight_evaluate", required=_names("report.json", "acceptance.png")),
    ]
}


def required_objects(stage: str) -> tuple[Required, ...]:
    """What every committed manifest of ``stage`` lists (none for a name outside the registry)."""
    spec = STAGES.get(stage)
    return spec.required if spec is not None else ()


ORDER: tuple[str, ...] = tuple(STAGES)


def ancestors(stage: str) -> set[str]:
    """The stages ``stage`` reads, directly or through others."""
    out: set[str] = set()
    for up in STAGES[stage].needs:
        out |= {up} | ancestors(up)
    return out


def descendants(stage: str) -> set[str]:
    """The stages that read ``stage``, directly or through others."""
    out: set[str] = set()
    for name, spec in STAGES.items():
        if stage in spec.needs:
            out |= {name} | descendants(name)
    return out

# Fields that change how a stage runs but not what it produces: excluded from input keys.
VOLATILE_FIELDS = {
    "target": {"cache_dir", "served_name"},
    "generate": {"concurrency", "request_timeout_s", "max_retries", "part_size"},
    "extract": {"device", "batch_tokens", "nproc_per_node"},
    "train": {"device", "checkpoint_every", "log_every", "compile"},
    "evaluate": {"device", "workers", "batch_size"},
}


def stage_config(cfg: PipelineConfig, spec: StageSpec, store: Any = None) -> dict[str, Any]:
    """The config that determines the stage's outputs; local files it names count by content
    (``eagle3.inputs``: looked up in ``store``'s record of the run when no longer on disk)."""
    from eagle3.inputs import keyed_config

    full = cfg.model_dump(mode="json")
    out = {}
    for section in spec.sections:
        values = {k: v for k, v in full[section].items() if k not in VOLATILE_FIELDS.get(section, set())}
        out[section] = keyed_config(section, values, store, cfg.run_id)
    return out


def get_stage(name: str) -> StageSpec:
    from eagle3.errors import ConfigError

    if name not in STAGES:
        raise ConfigError(f"unknown stage {name!r}; stages are: {', '.join(STAGES)}")
    return STAGES[name]
