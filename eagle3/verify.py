"""Verification of a run's manifests, stage by stage: what ``eagle3ctl verify`` prints.

Every stage of a run that has started must be complete: a stage with no output is a
problem, not "not run". Each stage's input key is recomputed from the config (the one
given, else the config recorded for the run by its latest attempt that committed a stage,
as ``status`` judges it) and its upstream manifests, so
a stage left behind by a changed setting or a rerun upstream is reported as stale, with the
settings that differ when the manifest recorded them. Writes begun and never finished (a
killed writer's partial file or upload) are named after the stages.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from eagle3.config import PipelineConfig
from eagle3.context import open_run_store, stage_input_key
from eagle3.errors import Eagle3Error
from eagle3.manifest import LoadedManifest, verify_stage
from eagle3.stages import ORDER, get_stage, stage_config
from eagle3.store import ObjectStore


def recorded_config(store: ObjectStore, run_id: str) -> PipelineConfig | None:
    """The resolved config of the run's latest attempt that committed a stage (``_run/config.json``)."""
    from eagle3.pipeline.runner import RUN_CONFIG

    key = f"{run_id}/{RUN_CONFIG}"
    try:
        return PipelineConfig.model_validate(json.loads(store.get_bytes(key))) if store.exists(key) else None
    except ValueError:
        return None


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """``section.field: old -> new`` for every leaf that differs."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {json.dumps(a)} -> {json.dumps(b)}")
    return out


def _stale_reason(cfg: PipelineConfig, name: str, m: Any, upstream: dict[str, LoadedManifest], store: ObjectStore) -> str:
    spec = get_stage(name)
    ups = [u for u in spec.needs if m.upstream.get(u) != upstream[u].digest]
    if ups:
        return f"stale: {', '.join(ups)} was rerun after it (its input key no longer matches)"
    if m.config is not None:
        changes = config_changes(m.config, stage_config(cfg, spec, store))
        if changes:
            return "stale: the config changed since it ran (" + "; ".join(changes[:3]) + (" …" if len(changes) > 3 else "") + ")"
    return "stale: its input key no longer matches the config, upstream or code"


def guarded(stage: str, check: Any) -> Any:
    """A stage's content check whose unforeseen failure (a reader refusing a damaged file) is one
    problem of that stage, so verify goes on with the next."""
    if check is None:
        return None

    def run(store: ObjectStore, manifest: Any) -> list[str]:
        try:
            return check(store, manifest)
        except Exception as e:  # noqa: BLE001 - any reader's error is a finding about the stage's objects
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return [f"content check of {stage} could not read its objects: {type(e).__name__}: {first}"]

    return run


def verify_run(cfg: PipelineConfig, stages: list[str] | None, deep: bool, echo: Callable[[str], None],
               config_given: bool = True) -> bool:
    """Print one line per stage (and one per problem); True when every named (else every) stage
    is complete for the config's input keys."""
    from eagle3.pipeline.status import judged_config, require_run

    for name in stages or ():
        get_stage(name)  # an unknown name is a config error, before the store is asked
    store = open_run_store(cfg, create=False)
    require_run(store, cfg.run_id)
    cfg, keys_checked = judged_config(cfg, store, config_given)  # the same judge as `status`
    if not keys_checked:
        echo("note: no config given and none recorded in the store: input keys are not checked")
    ok = True
    complete: dict[str, LoadedManifest] = {}
    for name in ORDER:
        spec = get_stage(name)
        shown = not stages or name in stages
        missing_ups = [u for u in spec.needs if u not in complete]
        key = None if missing_ups or not keys_checked else stage_input_key(
            cfg, spec, {u: complete[u] for u in spec.needs}, store)
        # content checks read upstream objects too: not over an upstream already found damaged
        check = guarded(name, spec.load_check()) if deep and shown and not missing_ups else None
        v = verify_stage(store, cfg.run_id, name, input_key=None, deep=deep and shown, content_check=check)
        problems = list(v.problems)
        if v.manifest is None and not store.has_prefix(f"{cfg.run_id}/{name}"):
            problems = [f"not run: the run has started, and {name} has no output in {store.uri}/{cfg.run_id}/{name}"]
        if v.complete and v.manifest is not None:
            m = v.manifest.manifest
            if key is not None and m.input_key != key:
                problems.append(_stale_reason(cfg, name, m, {u: complete[u] for u in spec.needs}, store))
            elif missing_ups:
                problems.append(f"needs {', '.join(missing_ups)}, which is not complete")
        if not problems and v.manifest is not None:
            complete[name] = v.manifest
        if not shown:
            continue
        if not problems:
            n = len(v.manifest.manifest.objects) if v.manifest else 0
            echo(f"{name}: ok ({n} objects{', deep' if deep else ''})")
        else:
            ok = False
            echo(f"{name}: FAILED")
            for p in problems:
                echo(f"  {p}")
    report_partial_writes(store, [f"{cfg.run_id}/{n}" for n in stages] if stages else [cfg.run_id], echo)
    return ok


SHOWN_PARTIALS = 10


def report_partial_writes(store: ObjectStore, prefixes: list[str], echo: Callable[[str], None]) -> None:
    """Name the writes begun and never finished under ``prefixes`` (none: nothing said). They
    take no part in any stage's verdict; the next ``eagle3ctl run`` removes those idle for a
    whole lease TTL, a write in flight finishes or is removed by its writer."""
    try:
        found = [p for prefix in prefixes for p in store.partial_writes(prefix)]
    except Eagle3Error as e:
        echo(f"note: partial writes not listed: {e}")
        return
    if not found:
        return
    echo(f"partial writes: {len(found)} begun and never finished (the next `eagle3ctl run` removes those idle "
         "over lease_ttl_s)")
    now = time.time()
    for p in found[:SHOWN_PARTIALS]:
        echo(f"  {store.uri}/{p.key}: last written {_age(now - p.written_at)} ago")
    if len(found) > SHOWN_PARTIALS:
        echo(f"  and {len(found) - SHOWN_PARTIALS} more")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f}s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
