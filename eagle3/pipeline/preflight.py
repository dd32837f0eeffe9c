"""Checks for the whole DAG before any stage starts, so a bad setting costs nothing.

``stages_to_run`` decides, from the manifests, which stages this run will start (selected,
and forced, or not complete for the key they would have, or downstream of one that runs);
``check_run`` then checks every setting those stages depend on that can be checked here:
the draft vocab against the target's vocab, the aux layer ids against its layers, the
tokenizer against ``target.vocab_size``, prompt files, and (through each stage's own
hook) whether the target fits the engine that would load it. The stages check the same
again when they start (on Kubernetes the target may only exist in the cluster); none of
them uncommits anything before its own checks pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eagle3.config import PipelineConfig
from eagle3.context import stage_input_key
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.inputs import FILE_FIELDS, local_file
from eagle3.manifest import LoadedManifest, verify_stage
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

# Stages whose inputs include the target model's layers (aux ids) or its vocab.
_NEEDS_AUX = {"extract", "train", "export", "evaluate"}


def stages_to_run(cfg: PipelineConfig, store: ObjectStore, selected: set[str], force: tuple[str, ...]) -> set[str]:
    """The selected stages this run will start, judged as the scheduler will judge them."""
    complete: dict[str, LoadedManifest] = {}
    runs: set[str] = set()
    for name in ORDER:
        spec = STAGES[name]
        if any(up in runs for up in spec.needs):
            if name in selected:
                runs.add(name)
            continue
        if not all(up in complete for up in spec.needs):
            continue  # blocked: the scheduler says so
        key = stage_input_key(cfg, spec, {u: complete[u] for u in spec.needs}, store)
        v = verify_stage(store, cfg.run_id, name, input_key=key)
        if v.complete and v.manifest is not None and name not in force:
            complete[name] = v.manifest
        elif name in selected:
            runs.add(name)
    return runs


def _target_config(cfg: PipelineConfig) -> tuple[Any, str] | None:
    """The target's config when it is on this machine (a local folder or a builtin target).

    Read without torch or transformers where its config.json allows (target_config_for_checks):
    the stages run in their own processes, and this one only checks."""
    from eagle3.targets.load import builtin_arch, resolve_target, target_config_for_checks
    from eagle3.targets.tiny import built_target_dir

    arch = builtin_arch(cfg.target.model)
    if arch is not None and built_target_dir(arch, Path(cfg.target.cache_dir)) is None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the builtin target is built here: no bars over the stage table
    source = resolve_target(cfg.target)
    if not Path(source).is_dir():
        return None  # a hub id, or a path that exists only inside the cluster: the stage checks it
    return target_config_for_checks(cfg.target), source


def check_run(cfg: PipelineConfig, to_run: set[str], echo: Callable[[str], None] = lambda line: None) -> None:
    """Raise one ConfigError line naming every setting that would make a stage of ``to_run`` fail."""
    if not to_run:
        return
    problems: list[str] = []
    for section, name in FILE_FIELDS:  # local stages read them here; on Kubernetes they are uploaded from here
        path = local_file(getattr(getattr(cfg, section), name))
        if section in to_run and path is not None and not path.is_file():
            problems.append(f"{section}.{name}: file not found: {path}")
    if problems:  # before loading (or building) the target
        raise ConfigError("; ".join(problems))
    try:
        found = _target_config(cfg)
    except Eagle3Error as e:
        raise ConfigError(str(e)) from None
    if found is None:
        echo(f"preflight: target {cfg.target.model} is not on this machine; its checks run in the stages")
    else:
        problems += _target_problems(cfg, to_run, *found)
        problems += _stage_hooks(cfg, to_run)  # they read the target too (e.g. does it fit the engine)
    if problems:
        raise ConfigError("; ".join(problems))


def _target_problems(cfg: PipelineConfig, to_run: set[str], config: Any, source: str) -> list[str]:
    from eagle3.targets.aux_layers import resolve_aux_layer_ids
    from eagle3.targets.load import check_vocab_size, num_layers, target_vocab_size, tokenizer_size_for_checks

    problems = []
    vocab, layers = target_vocab_size(config), num_layers(config)
    if "vocab" in to_run and cfg.vocab.draft_vocab_size > vocab:
        problems.append(f"vocab.draft_vocab_size={cfg.vocab.draft_vocab_size} exceeds the target's vocab size "
                        f"{vocab} ({source})")
    if to_run & _NEEDS_AUX:
        try:
            resolve_aux_layer_ids(cfg.target.aux_layer_ids, layers)
        except ValueError as e:
            problems.append(f"target.aux_layer_ids: {e}")
    if "generate" in to_run or cfg.target.vocab_size is not None:
        try:
            check_vocab_size(cfg.target, tokenizer_size_for_checks(cfg.target), config)
        except Eagle3Error as e:
            problems.append(str(e))
    return problems


def _stage_hooks(cfg: PipelineConfig, to_run: set[str]) -> list[str]:
    """Each stage's own preflight (``StageSpec.preflight``): e.g. does the target fit the engine."""
    problems = []
    for name in sorted(to_run, key=ORDER.index):
        hook = STAGES[name].load_preflight()
        if hook is None:
            continue
        try:
            hook(cfg)
        except Eagle3Error as e:
            problems.append(str(e))
    return problems
