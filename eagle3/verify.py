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

import time
from typing import Callable

from eagle3.config import PipelineConfig
from eagle3.contract import NOT_STARTED, StageVerdict, judge_run, key_change
from eagle3.errors import Eagle3Error
from eagle3.runs import judged_config, open_run_store, require_run
from eagle3.stages import ORDER, get_stage
from eagle3.store import ObjectStore


def _problems(cfg: PipelineConfig, store: ObjectStore, sv: StageVerdict) -> list[str]:
    """What keeps the stage from being complete, as verify says it; none when it is."""
    if sv.state == NOT_STARTED:
        return [f"not run: the run has started, and {sv.stage} has no output in {store.uri}/{cfg.run_id}/{sv.stage}"]
    problems = sv.check.damage  # what is wrong with the output itself, first
    if not problems and sv.check.stale:
        problems.append(key_change(cfg, store, sv).describe(
            "stale: {} was rerun after it (its input key no longer matches)",
            "stale: the config changed since it ran ({})",
            "stale: its input key no longer matches the config, upstream or code"))
    elif not problems and sv.waits_for:
        problems.append(f"needs {', '.join(sv.waits_for)}, which is not complete")
    return problems


def verify_run(cfg: PipelineConfig, stages: list[str] | None, deep: bool, echo: Callable[[str], None],
               config_given: bool = True) -> bool:
    """Print one line per stage (and one per problem); True when every named (else every) stage
    is complete for the config's input keys."""
    for name in stages or ():
        get_stage(name)  # an unknown name is a config error, before the store is asked
    store = open_run_store(cfg, create=False)
    require_run(store, cfg.run_id)
    cfg, keys_checked = judged_config(cfg, store, config_given)  # the same judge as `status`
    if not keys_checked:
        echo("note: no config given and none recorded in the store: input keys are not checked")
    shown = [n for n in ORDER if not stages or n in stages]
    ok = True
    for name, sv in judge_run(cfg, store, keys=keys_checked, deep=shown if deep else ()).items():
        if name not in shown:
            continue
        problems = _problems(cfg, store, sv)
        if not problems:
            n = len(sv.manifest.manifest.objects) if sv.manifest else 0
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
