"""``eagle3ctl init``: a commented config, generated from the settings models so it never drifts.

Every field appears with its default and its description as a comment; the result loads
back as a valid config and passes the run's checks for the model it names (tests check both):
a default that cannot hold for the target (a draft vocab larger than its vocab) is replaced by
one derived from it, and ``run_id`` stays unset, so the run is named after the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from eagle3.config import PipelineConfig
from eagle3.errors import ConfigError, Eagle3Error

WIDTH = 100


def _comment(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    words, lines, cur = text.split(), [], ""
    for w in words:
        if cur and len(indent) + 2 + len(cur) + 1 + len(w) > WIDTH:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}" if cur else w
    lines.append(cur)
    return [f"{indent}# {ln}" for ln in lines]


def _scalar(key: str, value: Any, indent: str) -> list[str]:
    dumped = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False, width=10_000).strip()
    if dumped.startswith("{") and dumped.endswith("}"):
        dumped = dumped[1:-1]
    return [f"{indent}{dumped}"]


def _doc(info: Any, sub: type[BaseModel] | None) -> str | None:
    if info.description:
        return info.description
    if sub is None:
        return None
    import sys

    module_doc = sys.modules[sub.__module__].__doc__ if sub.__module__ != "eagle3.config" else None
    lines = (sub.__doc__ or module_doc or "").strip().splitlines()
    return lines[0] if lines else None


def _sub_model(info: Any) -> type[BaseModel] | None:
    a = info.annotation
    return a if isinstance(a, type) and issubclass(a, BaseModel) else None


def _model_lines(model: type[BaseModel], values: dict[str, Any], indent: str) -> list[str]:
    lines: list[str] = []
    for name, info in model.model_fields.items():
        value = values.get(name)
        sub = _sub_model(info)
        lines += _comment(_doc(info, sub), indent)
        if sub is not None:
            lines.append(f"{indent}{name}:")
            lines += _model_lines(sub, value or {}, indent + "  ")
        else:
            lines += _scalar(name, value, indent)
    return lines


def config_template(overrides: dict[str, Any] | None = None) -> str:
    """The whole config with defaults (plus ``overrides``, dotted keys) and a comment per field.

    ``run_id`` stays unset unless given: the run is then named after the file, as documented."""
    from eagle3.config import load_config

    cfg = load_config(None, overrides or {})
    values = cfg.model_dump(mode="json")
    values["run_id"] = (overrides or {}).get("run_id")
    head = ["# eagle3ctl pipeline config. Every key is optional; defaults are shown.",
            "# Environment overrides: EAGLE3_<SECTION>__<KEY>, e.g. EAGLE3_TRAIN__LR=3e-4.",
            "# Credentials (S3 keys, HF token) never go here: they come from the environment.", ""]
    body: list[str] = []
    for name, info in PipelineConfig.model_fields.items():
        sub = _sub_model(info)
        doc = _doc(info, sub)
        if sub is None:
            body += _comment(doc, "") + _scalar(name, values[name], "")
        else:
            body += ["", *_comment(doc or f"{name} settings", ""), f"{name}:"] + _model_lines(sub, values[name], "  ")
    return "\n".join(head + body) + "\n"


def target_vocab_here(model: str, cache_dir: str) -> int | None:
    """The target's vocab size when it can be read on this machine without loading it (a builtin
    target, a local folder); None for a hub id. A local path without a config is an error."""
    from eagle3.pipeline.preflight import local_model_problem
    from eagle3.targets.load import builtin_arch, target_config_for_checks, target_vocab_size
    from eagle3.settings.target import TargetSettings

    try:
        arch = builtin_arch(model)
    except Eagle3Error as e:
        raise ConfigError(f"target.model: {e}") from None
    if arch is not None:
        from eagle3.targets.tiny import built_target_dir, tiny_vocab_size

        built = built_target_dir(arch, Path(cache_dir))
        if built is None:
            return tiny_vocab_size(arch)
        model = str(built)
    problem = local_model_problem(model)
    if problem:
        raise ConfigError(problem)
    if not Path(model).expanduser().is_dir():
        return None  # a hub id: read where it is downloaded
    try:
        return target_vocab_size(target_config_for_checks(TargetSettings(model=model)))
    except Eagle3Error as e:
        raise ConfigError(f"target.model: {e}") from None


def derived_overrides(overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Defaults that cannot hold for the target, replaced by values derived from it, and a line for each."""
    from eagle3.config import load_config

    cfg = load_config(None, overrides)
    vocab = target_vocab_here(cfg.target.model, cfg.target.cache_dir)
    if vocab is None:
        return overrides, [f"note: target {cfg.target.model} is not on this machine; vocab.draft_vocab_size stays "
                           f"{cfg.vocab.draft_vocab_size} (it must not exceed the target's vocab)"]
    if cfg.vocab.draft_vocab_size <= vocab or overrides.get("vocab.draft_vocab_size") is not None:
        return overrides, []
    return {**overrides, "vocab.draft_vocab_size": vocab}, [
        f"vocab.draft_vocab_size: {vocab}, the target's whole vocab (the default {cfg.vocab.draft_vocab_size} exceeds it)"]


def write_config(path: Path, overrides: dict[str, Any] | None = None, overwrite: bool = False) -> tuple[Path, list[str]]:
    """Write the config (derived for its target) to ``path``; the lines saying what was derived.
    Makes no folder: a missing one is an error."""
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass --force to overwrite it")
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; name a file, e.g. {path / 'eagle3.yaml'}")
    if not path.parent.is_dir():
        raise ConfigError(f"folder {path.parent} does not exist; create it first")
    overrides, notes = derived_overrides({k: v for k, v in (overrides or {}).items() if v is not None})
    path.write_text(config_template(overrides))
    return path, notes
