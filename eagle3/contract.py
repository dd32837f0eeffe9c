"""The stage contract, walked once: each stage's verdict for a run, in DAG order.

A stage is complete only when its manifest verifies (``eagle3.manifest.verify_stage``) for the
input key that its config and its upstream stages' manifests give (``stage_input_key``); a stage
with an upstream stage that is not complete waits for it. ``judge_run`` walks the stages in DAG
order and gives each one's verdict, with the key and the upstream manifests it was judged by:
preflight, ``status``, the scheduler, ``--reuse-from`` and ``verify`` all read it. A stage that
starts computes its key the same way (``eagle3.context.run_stage``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.errors import UpstreamMissing
from eagle3.manifest import ContentCheck, LoadedManifest, Verdict, compute_input_key, stage_prefix, verify_stage
from eagle3.stages import ORDER, STAGES, StageSpec, ancestors, stage_config
from eagle3.store import ObjectStore

COMPLETE, INCOMPLETE, NOT_STARTED = "complete", "incomplete", "not started"


@dataclass
class StageVerdict:
    """One stage of a run as the contract judges it."""

    stage: str
    state: str  # COMPLETE, INCOMPLETE, or NOT_STARTED (no manifest, and nothing written)
    reason: str  # why it is not complete ("" when it is)
    check: Verdict  # what its manifest and objects were found to be
    input_key: str | None  # the key it was judged by; None while an upstream waits, or when keys are not checked
    upstream: dict[str, LoadedManifest]  # the complete upstream manifests its key hashes
    waits_for: tuple[str, ...] = ()  # upstream stages that are not complete

    @property
    def complete(self) -> bool:
        return self.state == COMPLETE

    @property
    def manifest(self) -> LoadedManifest | None:
        return self.check.manifest


def upstream_digests(cfg: PipelineConfig, spec: StageSpec, store: ObjectStore) -> dict[str, LoadedManifest]:
    """Shallow-verify each upstream stage; raise one line naming the first that is not complete."""
    out = {}
    for up in spec.needs:
        v = verify_stage(store, cfg.run_id, up)
        if not v.complete:
            raise UpstreamMissing(f"stage {spec.name} needs {up}, which is not complete: {v.reason}")
        assert v.manifest is not None
        out[up] = v.manifest
    return out


def stage_input_key(cfg: PipelineConfig, spec: StageSpec, upstream: dict[str, LoadedManifest],
                    store: ObjectStore | None = None) -> str:
    return compute_input_key(spec.name, stage_config(cfg, spec, store), {k: v.digest for k, v in upstream.items()})


Settle = Callable[[StageVerdict], LoadedManifest | None]


def judge_run(cfg: PipelineConfig, store: ObjectStore, *, keys: bool = True, force: Collection[str] = (),
              deep: Collection[str] = (), until: str | None = None,
              settle: Settle | None = None) -> dict[str, StageVerdict]:
    """Each stage's verdict for the run, in DAG order; ``until``: that stage and the stages it reads only.

    ``keys=False`` judges manifests without their input keys (no config to judge them by). A stage
    of ``force`` counts as not complete. A stage of ``deep`` has every object re-hashed, and its
    content checked once its upstream stages are complete. ``settle`` is asked about each stage
    that is not complete while its upstream stages are: a manifest it returns (an output it
    committed meanwhile, as ``--reuse-from`` adopts one) counts as the stage's.
    """
    names = ORDER if until is None else tuple(n for n in ORDER if n == until or n in ancestors(until))
    verdicts: dict[str, StageVerdict] = {}
    complete: dict[str, LoadedManifest] = {}
    for name in names:
        v = judge_stage(cfg, store, STAGES[name], complete, keys=keys, forced=name in force, deep=name in deep)
        if not v.complete and not v.waits_for and settle is not None:
            settled = settle(v)
            if settled is not None:
                v = StageVerdict(name, COMPLETE, "", Verdict(name, True, manifest=settled), v.input_key, v.upstream)
        verdicts[name] = v
        if v.complete:
            assert v.manifest is not None
            complete[name] = v.manifest
    return verdicts


def judge_stage(cfg: PipelineConfig, store: ObjectStore, spec: StageSpec, complete: dict[str, LoadedManifest],
                keys: bool = True, forced: bool = False, deep: bool = False) -> StageVerdict:
    """One stage's verdict, given the stages found complete before it: its input key from their
    manifests, then its own manifest checked against that key."""
    waits = tuple(u for u in spec.needs if u not in complete)
    upstream = {u: complete[u] for u in spec.needs if u in complete}
    key = stage_input_key(cfg, spec, upstream, store) if keys and not waits else None
    # content checks read upstream objects too: not over an upstream that is not complete
    check = guarded(spec.name, spec.load_check()) if deep and not waits else None
    v = verify_stage(store, cfg.run_id, spec.name, input_key=key, deep=deep, content_check=check)
    started = v.manifest is not None or store.has_prefix(stage_prefix(cfg.run_id, spec.name))
    state = INCOMPLETE if started else NOT_STARTED
    if waits:
        return StageVerdict(spec.name, state, f"waits for {', '.join(waits)}", v, None, upstream, waits)
    if v.complete and not forced:
        return StageVerdict(spec.name, COMPLETE, "", v, key, upstream)
    return StageVerdict(spec.name, state, "--force" if v.complete else v.reason, v, key, upstream)


def guarded(stage: str, check: ContentCheck | None) -> ContentCheck | None:
    """A stage's content check whose unforeseen failure (a reader refusing a damaged file) is one
    problem of that stage, so the walk goes on with the next."""
    if check is None:
        return None

    def run(store: ObjectStore, manifest: Any) -> list[str]:
        try:
            return check(store, manifest)
        except Exception as e:  # noqa: BLE001 - any reader's error is a finding about the stage's objects
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return [f"content check of {stage} could not read its objects: {type(e).__name__}: {first}"]

    return run


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


@dataclass(frozen=True)
class KeyChange:
    """Why a committed output's input key is not the one its verdict computed."""

    upstream: list[str]  # upstream stages whose manifest is not the one it was computed from
    settings: list[str]  # else the settings that differ, when the manifest recorded its config

    def describe(self, upstream: str, settings: str, otherwise: str) -> str:
        """One line: ``upstream`` with the changed stages for ``{}``, else ``settings`` with the
        first three changed settings, else ``otherwise`` (the code, or a setting not recorded)."""
        if self.upstream:
            return upstream.format(", ".join(self.upstream))
        if self.settings:
            return settings.format("; ".join(self.settings[:3]) + (" …" if len(self.settings) > 3 else ""))
        return otherwise


def key_change(cfg: PipelineConfig, store: ObjectStore, v: StageVerdict) -> KeyChange:
    """What changed since the stage's committed output was made (its verdict found it stale)."""
    assert v.manifest is not None
    m = v.manifest.manifest
    ups = [u for u in v.upstream if m.upstream.get(u) != v.upstream[u].digest]
    if ups or m.config is None:
        return KeyChange(ups, [])
    return KeyChange([], config_changes(m.config, stage_config(cfg, STAGES[v.stage], store)))
