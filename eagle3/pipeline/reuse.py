"""Reuse another run's committed stages: ``eagle3ctl run pipeline --reuse-from RUN``.

A sweep that changes only what later stages hash (the draft vocab, training settings) need
not generate its data or extract hidden states again. Before the scheduler starts, each
stage this run would run is *adopted* from run RUN (same store), in DAG order, when:

- RUN's committed manifest records the same stage config (what the input key hashes,
  ``Manifest.config``) and code version as this run's, and its input key is the one they give;
- each of this run's upstream stages holds what RUN's stage was computed from: it was
  adopted from that very manifest, or it lists the same objects (names, sizes, sha256);
- RUN's stage verifies (every object's size and content digest, as a skip checks them).

Adopting copies RUN's objects into this run's own attempt folder through the store (a hard
link on disk, a server-side copy on S3), each copy refused if its source changed since it
was verified, and commits them with the usual :class:`StageOutput` commit: this run's own
input key (``stage_input_key``), the sha256s of RUN's verified manifest, the copies'
fingerprints, RUN's stats plus ``reused_from``. Nothing of this run points into RUN's
prefix, so RUN may be rerun or removed later. A kill mid-adoption leaves an uncommitted
attempt folder, which the next adoption resumes; whatever does not match simply runs.

A hard link shares the inode, and linking moves the inode's ctime, which is part of the
local store's fingerprint: the new fingerprint is recorded for both runs (RUN's
``_verified.json`` and this run's manifest), so neither re-hashes at its next skip. A later
link or unlink of the same file (a third run adopting it, RUN's rerun sweeping its old
attempt) moves it again; the holders then re-hash those objects once, and record that.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from eagle3 import __version__
from eagle3.config import RUN_ID_RULE, PipelineConfig, is_run_id
from eagle3.contract import StageVerdict, judge_run
from eagle3.errors import ConfigError, ManifestError, StoreError
from eagle3.manifest import (
    ATTEMPT,
    JOURNAL,
    SMALL_OBJECT,
    LoadedManifest,
    Manifest,
    StageOutput,
    Verdict,
    attempt_root,
    committed_root,
    compute_input_key,
    read_manifest,
    remember_verified,
    verify_stage,
)
from eagle3.stages import ORDER, STAGES, StageSpec, stage_config
from eagle3.store import ObjectStore

COPY_THREADS = 8  # server-side copies in flight at once (S3); links are instant either way


@dataclass
class Adoption:
    stage: str
    objects: int
    bytes: int
    seconds: float


def content_digest(m: Manifest) -> str:
    """What a stage output holds, whoever wrote it: its objects' names, sizes and sha256s."""
    rows = sorted((o.key, o.size, o.sha256) for o in m.objects)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _first_difference(ours: dict, theirs: dict, where: str = "") -> str:
    for k in sorted(set(ours) | set(theirs)):
        a, b = ours.get(k), theirs.get(k)
        if a != b:
            return _first_difference(a, b, f"{where}{k}.") if isinstance(a, dict) and isinstance(b, dict) else where + k
    return where.rstrip(".") or "the config"


def mismatch(cfg: PipelineConfig, store: ObjectStore, spec: StageSpec, upstream: dict[str, LoadedManifest],
             source: str, theirs: LoadedManifest, source_manifests: dict[str, LoadedManifest | None]) -> str | None:
    """Why run ``source``'s committed ``spec`` output is not this run's (None: it is, if it verifies)."""
    m = theirs.manifest
    if m.config is None:
        return "its manifest records no stage config (written by an older eagle3)"
    if m.code_version != __version__:
        return f"it was made by eagle3 {m.code_version}, this is {__version__}"
    ours = json.loads(json.dumps(stage_config(cfg, spec, store)))
    if ours != m.config:
        return f"{_first_difference(ours, m.config)} differs"
    if compute_input_key(spec.name, m.config, m.upstream, m.code_version) != m.input_key:
        return "its input key is not the one its recorded config gives"
    for up, mine in upstream.items():
        want = m.upstream.get(up)
        if want is not None and (mine.manifest.stats.get("reused_from") or {}).get("manifest_digest") == want:
            continue  # this run's upstream was adopted from exactly what it was computed from
        their_up = source_manifests.get(up)
        if (want is None or their_up is None or their_up.digest != want
                or content_digest(their_up.manifest) != content_digest(mine.manifest)):
            return f"this run's {up} differs from the {up} it was computed from"
    return None


def adopt(cfg: PipelineConfig, store: ObjectStore, spec: StageSpec, upstream: dict[str, LoadedManifest],
          key: str, source: str, verdict: Verdict) -> LoadedManifest:
    """Copy a verified stage output of run ``source`` into this run and commit it (module docstring)."""
    assert verdict.manifest is not None
    theirs = verdict.manifest.manifest
    out = StageOutput(store, cfg.run_id, spec.name, key, {u: v.digest for u, v in upstream.items()},
                      root=attempt_root(key, committed_root(store, cfg.run_id, spec.name)),
                      config=stage_config(cfg, spec, store))
    out.begin()  # an adoption (or a run of the stage) killed in this folder: its journal is offered
    wanted = {o.key: o for o in theirs.objects}
    keep = {f"{out.prefix}/{n}" for n in wanted} | {f"{out.prefix}/{ATTEMPT}"}
    store.delete_many([k for k in store.list(out.prefix)
                       if k not in keep and not k.startswith(f"{out.prefix}/{JOURNAL}/")])
    recovered = out.recovered()
    todo = []
    for o in theirs.objects:
        r = recovered.get(o.key)
        if r is not None and (r.size, r.sha256) == (o.size, o.sha256) and store.size(f"{out.prefix}/{o.key}") == o.size:
            out.adopt(o.key)
        else:
            todo.append(o)
    with ThreadPoolExecutor(COPY_THREADS) as pool:
        moved = dict(zip((o.key for o in todo), pool.map(
            lambda o: out.copy_in(o.key, theirs.object_key(o.key), o, verdict.fingerprints.get(o.key)), todo)))
    # a hard link moved the source's fingerprint (its ctime); its content is the one just verified
    relinked = {k: fp for k, fp in moved.items() if fp != verdict.fingerprints.get(k) and wanted[k].size > SMALL_OBJECT}
    if relinked:
        remember_verified(store, source, spec.name, theirs.root, relinked)
    reused = {"run": source, "stage": spec.name, "manifest_digest": verdict.manifest.digest}
    return out.commit({**theirs.stats, "reused_from": reused})


def reuse_stages(cfg: PipelineConfig, store: ObjectStore, source: str, selected: set[str],
                 force: tuple[str, ...] = (), echo: Callable[[str], None] = print,
                 in_flight: Callable[[str, str], bool] | None = None) -> list[Adoption]:
    """Adopt from run ``source`` every stage of ``selected`` (not forced, not complete here) whose
    output would be the same (module docstring); one line per stage adopted or refused."""
    reuse = Reuse(cfg, store, source, _source_manifests(cfg, store, source), in_flight, echo)
    judge_run(cfg, store, force=force,
              settle=lambda sv: reuse.settle(sv) if sv.stage in selected and sv.stage not in force else None)
    return reuse.adopted


def _source_manifests(cfg: PipelineConfig, store: ObjectStore, source: str) -> dict[str, LoadedManifest | None]:
    """Run ``source``'s committed manifests, by stage; a ConfigError when it is no other run with one."""
    if not is_run_id(source):
        raise ConfigError(f"--reuse-from {source!r}: a run id {RUN_ID_RULE}")
    if source == cfg.run_id:
        raise ConfigError(f"--reuse-from {source}: that is this run; name the run to reuse stages from")
    theirs: dict[str, LoadedManifest | None] = {}
    for name in ORDER:
        try:
            theirs[name] = read_manifest(store, source, name)
        except ManifestError:
            theirs[name] = None  # unparsable: nothing to reuse there
    if not any(theirs.values()):
        raise ConfigError(f"--reuse-from {source}: run {source} has no committed stage in {store.uri}")
    return theirs


@dataclass
class Reuse:
    """Adopting run ``source``'s stages into this run, one stage at a time as the walk reaches it."""

    cfg: PipelineConfig
    store: ObjectStore
    source: str
    theirs: dict[str, LoadedManifest | None]  # the source run's committed manifests
    in_flight: Callable[[str, str], bool] | None
    echo: Callable[[str], None]
    adopted: list[Adoption] = field(default_factory=list)

    def settle(self, sv: StageVerdict) -> LoadedManifest | None:
        """The source run's output of the stage ``sv`` judged, adopted when it is this run's and
        verifies (``judge_run``'s ``settle``); else None, and one line saying why not."""
        found = self.theirs[sv.stage]
        if found is None:
            return None
        name, spec, key = sv.stage, STAGES[sv.stage], sv.input_key
        assert key is not None
        why = mismatch(self.cfg, self.store, spec, sv.upstream, self.source, found, self.theirs)
        if why is None and self.in_flight is not None and self.in_flight(name, key):
            why = "an attempt of its own for this input key may still be running; it resumes"
        verdict = verify_stage(self.store, self.source, name) if why is None else None
        if verdict is not None and not verdict.complete:
            why = f"run {self.source}'s {name} does not verify: {verdict.reason}"
        if why is not None:
            self.echo(f"{name}: not reused from run {self.source}: {why}")
            return None
        assert verdict is not None
        return self._adopt(sv, key, verdict)

    def _adopt(self, sv: StageVerdict, key: str, verdict: Verdict) -> LoadedManifest | None:
        t0 = time.monotonic()
        try:
            committed = adopt(self.cfg, self.store, STAGES[sv.stage], sv.upstream, key, self.source, verdict)
        except (StoreError, ManifestError) as e:
            self.echo(f"{sv.stage}: not reused from run {self.source}: copying failed: {e}")
            return None
        objects = committed.manifest.objects
        a = Adoption(sv.stage, len(objects), sum(o.size for o in objects), time.monotonic() - t0)
        self.adopted.append(a)
        self.echo(f"{a.stage}: adopted from run {self.source} into run {self.cfg.run_id} ({a.objects} objects, "
                  f"{a.bytes / 2**20:,.1f} MiB, {a.seconds:.1f}s)")
        return committed


def unfinished_attempt(store: ObjectStore, run_id: str) -> Callable[[str, str], bool]:
    """``in_flight`` for backends whose stages outlive the CLI (a Kubernetes Job left running):
    an attempt folder of this input key not yet committed may belong to one."""

    def check(stage: str, key: str) -> bool:
        root = attempt_root(key, committed_root(store, run_id, stage))
        return store.exists(f"{run_id}/{stage}/{root}/{ATTEMPT}")

    return check
