"""The pipeline configuration: one YAML file plus ``EAGLE3_*`` environment overrides.

Each component's settings model lives in :mod:`eagle3.settings`, below every stage that
reads it; this module only composes them and turns validation failures into one line
that names the field.
Nested env overrides use ``__``: ``EAGLE3_TRAIN__LR=3e-4``.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from eagle3.errors import ConfigError
from eagle3.settings.drafter import DrafterSettings
from eagle3.settings.evaluate import EvaluateSettings
from eagle3.settings.export import ExportSettings
from eagle3.settings.extract import ExtractSettings
from eagle3.settings.generate import GenerateSettings
from eagle3.settings.kubernetes import KubernetesSettings
from eagle3.settings.serve import ServeSettings
from eagle3.settings.store import StoreSettings
from eagle3.settings.target import TargetSettings
from eagle3.settings.train import TrainSettings
from eagle3.settings.vocab import VocabSettings

_RUN_ID = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
RUN_ID_RULE = "must be lowercase letters, digits and '-', at most 42 characters (it becomes a label)"


def is_run_id(value: str) -> bool:
    return bool(_RUN_ID.match(value))

ENV_PREFIX = "EAGLE3_"
# Explicit overrides (CLI flags) for the PipelineConfig being built; a settings source of
# their own so they outrank the environment (model_validate would re-read the env).
_OVERRIDES: ContextVar[dict[str, Any]] = ContextVar("eagle3_config_overrides", default={})


class PipelineConfig(BaseSettings):
    """The whole run; validated before anything starts."""

    model_config = SettingsConfigDict(
        env_prefix="EAGLE3_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    run_id: str | None = Field(None, description="Names the run: objects live under <store>/<run_id>/<stage>/. "
                               "Unset: derived from the config file, <file name>-<short hash of its path>.")
    lease_ttl_s: float = Field(60, ge=5, description="The run's lease in the store expires this long after its "
                               "holder's last heartbeat; a stale lease is taken over by the next run.")
    backend: str = Field("local", pattern="^(local|kubernetes)$", description="Where stages run.")
    store: StoreSettings = Field(default_factory=StoreSettings)
    target: TargetSettings = Field(default_factory=TargetSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    generate: GenerateSettings = Field(default_factory=GenerateSettings)
    vocab: VocabSettings = Field(default_factory=VocabSettings)
    extract: ExtractSettings = Field(default_factory=ExtractSettings)
    drafter: DrafterSettings = Field(default_factory=DrafterSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    export: ExportSettings = Field(default_factory=ExportSettings)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and not is_run_id(v):
            raise ValueError(RUN_ID_RULE)
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit overrides (CLI flags) > EAGLE3_* env > YAML file (passed as init).
        return (InitSettingsSource(settings_cls, _OVERRIDES.get()), env_settings, init_settings)


def _format_error(e: ValidationError, source: str, overrides: dict[str, Any] | None = None) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        env = ENV_PREFIX + "__".join(str(x) for x in err["loc"]).upper()
        if overrides and overrides.get(loc) is not None:
            msg += " (from the command line)"
        elif env in os.environ:
            msg += f" (from env {env})"
        parts.append(f"{loc}: {msg}")
    more = f" (+{len(e.errors()) - 3} more)" if len(e.errors()) > 3 else ""
    return f"invalid config {source}: " + "; ".join(parts) + more


def _check_env_names() -> None:
    """EAGLE3_TRAIN_LR (one '_') would be silently ignored: name the typo instead."""
    sections = [k for k, f in PipelineConfig.model_fields.items() if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)]
    for name in os.environ:
        if not name.startswith(ENV_PREFIX) or "__" in name:
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if rest in PipelineConfig.model_fields:
            continue
        for section in sections:
            if rest.startswith(section + "_"):
                field = name[len(ENV_PREFIX) + len(section) + 1:]
                raise ConfigError(
                    f"environment variable {name} sets no config field; nested fields use '__': "
                    f"{ENV_PREFIX}{section.upper()}__{field}"
                )


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides by design
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a folder") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not text (not UTF-8): is it the YAML config?") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or ""
        why = f": {problem}" if problem.startswith("duplicate key") else " is not valid YAML"
        raise ConfigError(f"config file {p}{where}{why}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load YAML (if any), apply ``EAGLE3_*`` env, then explicit overrides (e.g. ``--run-id``).

    Overrides are dotted keys: ``{"store.uri": "s3://b/p"}``.
    """
    data = read_config_file(path) if path else {}
    source = str(path) if path else "(defaults)"
    nested: dict[str, Any] = {}
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        cur = nested
        keys = dotted.split(".")
        for k in keys[:-1]:
            cur = cur.setdefault(k, {})
        cur[keys[-1]] = value
    _check_env_names()
    token = _OVERRIDES.set(nested)
    try:
        cfg = PipelineConfig(**data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source, overrides)) from None
    finally:
        _OVERRIDES.reset(token)
    if cfg.run_id is None:
        cfg.run_id = derived_run_id(path) if path else DEFAULT_RUN_ID
    return cfg


DEFAULT_RUN_ID = "default"


def derived_run_id(path: str | Path) -> str:
    """``<file name>-<6 hex of the absolute path>``: the same file names the same run from any
    directory; editing it keeps the run (stages rerun by input key), another file is another run."""
    import hashlib

    p = Path(path).expanduser().resolve()
    stem = re.sub(r"[^a-z0-9-]+", "-", p.stem.lower()).strip("-")[:32] or "run"
    return f"{stem}-{hashlib.sha256(str(p).encode()).hexdigest()[:6]}"


def config_section_dump(cfg: PipelineConfig, sections: list[str]) -> dict[str, Any]:
    """The parts of the config that matter to a stage, as plain JSON data (for input keys)."""
    full = cfg.model_dump(mode="json")
    return {s: full[s] for s in sections}
