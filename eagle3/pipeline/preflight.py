"""Checks for the whole DAG before any stage starts, so a bad setting costs nothing.

``stages_to_run`` decides, from the manifests, which stages this run will start (selected,
and forced, or not complete for the key they would have, or downstream of one that runs),
and why each one with committed output runs again; ``check_run`` then checks every setting
those stages depend on that can be checked here: the prompt files (parsed, counted, and the
longest measured against ``generate.max_length``), a local target folder (present, with a
config; its tokenizer loads), the draft vocab against the target's vocab, the aux layer ids
against its layers, the tokenizer against ``target.vocab_size``, and (through each stage's
own hook) whether the target fits the engine that would load it. The stages check the same
again when they start (on Kubernetes the target may only exist in the cluster); none of
them uncommits anything before its own checks pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from eagle3.config import PipelineConfig
from eagle3.contract import StageVerdict, judge_run, key_change
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.inputs import FILE_FIELDS, local_file
from eagle3.stages import ORDER, STAGES
from eagle3.store import ObjectStore

# Stages whose inputs include the target model's layers (aux ids) or its vocab.
_NEEDS_AUX = {"extract", "train", "export", "evaluate"}
# Stages that render prompts with the target's tokenizer.
_NEEDS_TOKENIZER = {"generate", "evaluate"}
MAX_LINES_NAMED = 5


def stages_to_run(cfg: PipelineConfig, store: ObjectStore, selected: set[str], force: tuple[str, ...],
                  reasons: dict[str, str] | None = None) -> set[str]:
    """The selected stages this run will start, judged as the scheduler will judge them; ``reasons``
    (when given) gets, for each of them that has committed output, why it runs again."""
    runs: set[str] = set()
    why = reasons if reasons is not None else {}
    for name, sv in judge_run(cfg, store, force=force).items():
        rerun_ups = [up for up in STAGES[name].needs if up in runs]
        if name not in selected or sv.complete or (sv.waits_for and not rerun_ups):
            continue  # complete, or blocked (the scheduler says so)
        runs.add(name)
        if sv.manifest is not None:
            why[name] = (f"{', '.join(rerun_ups)} runs again" if rerun_ups else
                         "--force" if name in force else _rerun_reason(cfg, sv, store))
    return runs


def _rerun_reason(cfg: PipelineConfig, sv: StageVerdict, store: ObjectStore) -> str:
    """Why a stage with a manifest is not complete: what changed since it ran, or what of its output is damaged."""
    assert sv.manifest is not None
    if sv.check.stale:
        return key_change(cfg, store, sv).describe("{} changed since it ran", "the config changed ({})",
                                                   "its input key changed (the code version or a setting it hashes)")
    damaged = sv.check.damage
    reason = damaged[0] if damaged else sv.check.reason
    # object names relative to its attempt folder
    return reason.replace(f"{store.uri}/{sv.manifest.manifest.prefix}/", "")


def local_model_problem(model: str) -> str | None:
    """What is wrong with a ``target.model`` that names a folder on this machine; None for a hub id
    (``org/name``) or a good folder. A path is one that exists, is absolute, starts with ``.`` or
    ``~``, or has more than one ``/``."""
    if model.startswith("builtin:"):
        return None
    path = Path(model).expanduser()
    looks_local = path.exists() or model.startswith(("/", ".", "~")) or model.count("/") > 1
    if not looks_local:
        return None
    if not path.exists():
        return f"target.model: no such folder: {path}"
    if not path.is_dir():
        return f"target.model: {path} is not a folder (a Hugging Face model folder with config.json)"
    if not (path / "config.json").is_file():
        return f"target.model: {path} has no config.json (not a Hugging Face model folder)"
    return None


def _target_config(cfg: PipelineConfig) -> tuple[Any, str] | None:
    """The target's config when it is on this machine (a local folder or a builtin target).

    Read without torch or transformers where its config.json allows (target_config_for_checks):
    the stages run in their own processes, and this one only checks."""
    from eagle3.targets.load import builtin_arch, resolve_target, target_config_for_checks
    from eagle3.targets.tiny import built_target_dir

    problem = local_model_problem(cfg.target.model)
    if problem:
        raise ConfigError(problem)
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
    prompts = _read_prompt_files(cfg, to_run, problems)
    try:
        found = _target_config(cfg)
    except Eagle3Error as e:
        raise ConfigError("; ".join([*problems, str(e)])) from None
    if found is None:
        echo(f"preflight: target {cfg.target.model} is not on this machine; its checks run in the stages")
    else:
        problems += _target_problems(cfg, to_run, *found)
        problems += _stage_hooks(cfg, to_run)  # they read the target too (e.g. does it fit the engine)
        if not problems and "generate" in prompts:
            problems += _prompt_length_problems(cfg, prompts["generate"])
    if problems:
        raise ConfigError("; ".join(problems))
    for section, parsed in prompts.items():
        echo(f"preflight: {section}.prompts: {len(parsed):,} prompts")


def _read_prompt_files(cfg: PipelineConfig, to_run: set[str], problems: list[str]) -> dict[str, list[Any]]:
    """The prompts of every prompt file a stage to run reads here (local or builtin), parsed; a
    file that does not parse, is empty or binary adds its one line to ``problems``."""
    from eagle3.generate.prompts import parse_prompts, read_prompts_bytes

    out: dict[str, list[Any]] = {}
    for section, name in FILE_FIELDS:
        spec = getattr(getattr(cfg, section), name)
        if section not in to_run or not spec or (local_file(spec) is None and not spec.startswith("builtin:")):
            continue  # unset (evaluate: generate's own), or s3:// and uploaded copies: the stage reads them
        try:
            out[section] = parse_prompts(read_prompts_bytes(spec), spec, cfg.generate.system_prompt)
        except Eagle3Error as e:
            problems.append(f"{section}.{name}: {e}")
    return out


def _prompt_length_problems(cfg: PipelineConfig, prompts: list[Any]) -> list[str]:
    """Prompts that cannot fit ``generate.max_length`` tokens, rendered by the target's chat template
    with its generation prompt, as the server sees them.

    Cheap for the usual file: no token has more bytes than the vocab's longest, so a prompt of more
    than ``max_length`` times that many bytes is too long without tokenizing it (a 20 MB line is
    refused at once); a prompt of at most ``max_length / 2`` bytes fits (each token is at least one
    byte, and half of ``max_length`` is left for the template). Only prompts between the two
    are rendered and counted, and only then is the tokenizer loaded with transformers."""
    limit = cfg.generate.max_length
    sizes = [(p, sum(len(m["content"].encode()) for m in p.messages)) for p in prompts]
    unsure = [(p, n) for p, n in sizes if n > limit // 2]
    if not unsure:
        return []
    widest = _longest_token_bytes(cfg)
    too_long: list[tuple[int, str]] = [(p.line, f"at least {-(-n // widest):,}") for p, n in unsure if n > limit * widest]
    measure = [p for p, n in unsure if n <= limit * widest]
    if measure:
        from eagle3.generate.render import encode, generation_prompt
        from eagle3.targets.load import load_tokenizer

        tokenizer = load_tokenizer(cfg.target)
        for p in measure:
            n = len(encode(tokenizer, generation_prompt(tokenizer, p.messages)))
            if n > limit:
                too_long.append((p.line, f"{n:,}"))
    if not too_long:
        return []
    too_long.sort()
    lines = ", ".join(str(line) for line, _ in too_long[:MAX_LINES_NAMED])
    more = f" (+{len(too_long) - MAX_LINES_NAMED} more)" if len(too_long) > MAX_LINES_NAMED else ""
    first_line, first_n = too_long[0]
    return [f"generate.prompts {cfg.generate.prompts}: line{'s' if len(too_long) > 1 else ''} {lines}{more} "
            f"longer than generate.max_length={limit} tokens (line {first_line}: {first_n} tokens with the chat "
            f"template); shorten or drop {'them' if len(too_long) > 1 else 'it'}, or raise generate.max_length"]


def _longest_token_bytes(cfg: PipelineConfig) -> int:
    """Bytes of the vocab's longest token (its UTF-8 spelling: at least the bytes it stands for)."""
    from eagle3.targets.load import load_tokenizer, resolve_target

    tokenizer_json = Path(cfg.target.tokenizer or resolve_target(cfg.target)).expanduser() / "tokenizer.json"
    vocab: Any = None
    if tokenizer_json.is_file():
        try:
            from tokenizers import Tokenizer

            vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 - unreadable by the tokenizers library: transformers says why
            vocab = None
    if vocab is None:
        vocab = load_tokenizer(cfg.target).get_vocab()
    return max((len(t.encode()) if isinstance(t, str) else len(t) for t in vocab), default=1) or 1


def _target_problems(cfg: PipelineConfig, to_run: set[str], config: Any, source: str) -> list[str]:
    from eagle3.targets.aux_layers import resolve_aux_layer_ids
    from eagle3.targets.load import check_vocab_size, num_layers, target_vocab_size, tokenizer_size_for_checks

    problems = []
    vocab, layers = target_vocab_size(config), num_layers(config)
    if "vocab" in to_run and cfg.vocab.draft_vocab_size > vocab:
        problems.append(f"vocab.draft_vocab_size={cfg.vocab.draft_vocab_size} exceeds the target's vocab size "
                        f"{vocab} ({source}): set it to {vocab} or less")
    if to_run & _NEEDS_AUX:
        try:
            resolve_aux_layer_ids(cfg.target.aux_layer_ids, layers)
        except ValueError as e:
            problems.append(f"target.aux_layer_ids: {e}")
    if to_run & _NEEDS_TOKENIZER or cfg.target.vocab_size is not None:
        try:  # the tokenizer loads, and fits the target's vocab
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
