"""What a running stage sees: its config, the store, verified upstream manifests, its output.

``run_stage`` is the body of ``eagle3 stage NAME``, the one entrypoint every backend
runs (as a subprocess locally, as the container command on Kubernetes).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import PipelineConfig
from eagle3.contract import stage_input_key, upstream_digests
from eagle3.errors import ManifestError
from eagle3.manifest import (LoadedManifest, ObjectWriter, StageOutput, attempt_prefix, attempt_root, read_manifest,
                             verify_stage)
from eagle3.progress import emit_progress
from eagle3.runs import open_run_store
from eagle3.signals import sigterm_as_interrupt
from eagle3.stages import StageSpec, get_stage, stage_config
from eagle3.store import ObjectStore

def rank() -> int:
    return int(os.environ.get("RANK", "0"))


@dataclass
class StageContext:
    cfg: PipelineConfig
    spec: StageSpec
    store: ObjectStore
    upstream: dict[str, LoadedManifest]
    input_key: str
    output: StageOutput | None  # None on ranks other than 0: they never commit
    scratch: Path
    endpoint: str | None = None
    root: str = ""  # this attempt's folder under <run_id>/<stage>/, the same on every rank
    _last_progress: float = field(default=0.0, repr=False)

    @property
    def run_id(self) -> str:
        return self.cfg.run_id

    @property
    def output_prefix(self) -> str:
        """Where this attempt's objects go (and its checkpoints are), on every rank."""
        return attempt_prefix(self.run_id, self.spec.name, self.root)

    def object_writer(self) -> ObjectWriter:
        """Rank 0's StageOutput; on other ranks a writer into the same attempt folder."""
        if self.output is not None:
            return self.output
        return ObjectWriter(self.store, self.run_id, self.spec.name, self.root)

    def upstream_key(self, stage: str, name: str) -> str:
        return self.upstream[stage].manifest.object_key(name)  # must be listed: fails loudly otherwise

    def upstream_path(self, stage: str, name: str) -> Path:
        """A local path to an upstream object (in place for file://, downloaded for s3://)."""
        key = self.upstream_key(stage, name)
        local = self.store.local_path(key)
        if local is not None:
            return local
        dest = self.scratch / "upstream" / stage / name
        if not dest.exists() or dest.stat().st_size != self.upstream[stage].manifest.object(name).size:
            self.store.get_file(key, dest)
        return dest

    def upstream_bytes(self, stage: str, name: str) -> bytes:
        return self.store.get_bytes(self.upstream_key(stage, name))

    def upstream_json(self, stage: str, name: str) -> Any:
        return json.loads(self.upstream_bytes(stage, name))

    def progress(self, done: float, total: float | None, unit: str, force: bool = False, **extra: Any) -> None:
        """Report progress (at most once a second) as a line the orchestrator parses."""
        t = time.monotonic()
        if not force and t - self._last_progress < 1.0:
            return
        self._last_progress = t
        emit_progress({"stage": self.spec.name, "done": done, "total": total, "unit": unit, **extra})


def run_stage(cfg: PipelineConfig, name: str, force: bool = False, endpoint: str | None = None) -> dict[str, Any] | None:
    """Run one stage unless it is already complete for the same input key.

    Returns the committed stats, or None when the stage was already complete.
    """
    spec = get_stage(name)
    store = open_run_store(cfg)
    upstream = upstream_digests(cfg, spec, store)
    key = stage_input_key(cfg, spec, upstream, store)
    if not force and verify_stage(store, cfg.run_id, name, input_key=key).complete:
        print(f"stage {name}: already complete for this input key; skipping", file=sys.stderr)
        return None
    # The committed output (if any) stays; this attempt writes beside it until its commit.
    try:
        committed = read_manifest(store, cfg.run_id, name)
    except ManifestError:
        committed = None
    root = attempt_root(key, committed.manifest.root if committed else None)
    output = None
    if rank() == 0:
        output = StageOutput(store, cfg.run_id, name, key, {k: v.digest for k, v in upstream.items()}, root=root,
                             config=stage_config(cfg, spec, store))
        output.begin(fresh=force)
    # Stopped (SIGTERM) by the run or `eagle3ctl down`: unwind, so the scratch folder goes and
    # a write in flight is removed; the journal keeps what finished, for the next attempt.
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix=f"eagle3-{name}-") as tmp:
        ctx = StageContext(cfg, spec, store, upstream, key, output, Path(tmp), endpoint=endpoint, root=root)
        stats = spec.load_entry()(ctx)
        if output is not None:
            output.commit(stats)
    return stats
