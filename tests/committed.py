"""Where a committed stage's objects are: its attempt folder, named by the manifest."""

from __future__ import annotations

import os
from fnmatch import fnmatchcase
from pathlib import Path

from eagle3.manifest import ObjectWriter, read_manifest
from eagle3.stages import required_objects
from eagle3.store import ObjectStore


def key_of(store: ObjectStore, run_id: str, stage: str, name: str = "") -> str:
    """Store key of ``name`` in the stage's committed attempt folder (listed in the manifest or not)."""
    loaded = read_manifest(store, run_id, stage)
    assert loaded is not None, f"{run_id}/{stage} is not committed"
    return f"{loaded.manifest.prefix}/{name}".rstrip("/")


def path_of(store: ObjectStore, run_id: str, stage: str, name: str = "") -> Path:
    """Local path of ``name`` in the stage's committed attempt folder (file:// stores)."""
    path = store.local_path(key_of(store, run_id, stage, name))
    assert path is not None
    return path


def attempt_key(store: ObjectStore, run_id: str, stage: str, name: str = "") -> str:
    """Store key of ``name`` in the stage's one attempt folder, committed or not (a killed attempt)."""
    roots = {k.split("/")[2] for k in store.list(f"{run_id}/{stage}") if k.count("/") >= 3}
    assert len(roots) == 1, f"{run_id}/{stage} has attempt folders {sorted(roots)}"
    return f"{run_id}/{stage}/{roots.pop()}/{name}".rstrip("/")


def put_required(out: ObjectWriter, stage: str, text: str = "") -> None:
    """Placeholders for the objects ``stage`` always writes (``StageSpec.required``) that ``out``
    lacks, for test doubles that commit a stage without running it: a pattern gets one object,
    and the index that counts it (written here unless the caller wrote one) lists that one."""
    for r in sorted(required_objects(stage), key=lambda r: r.counted_by is None):
        if any(fnmatchcase(n, r.pattern) for n in out.entries):
            continue
        name = r.pattern.replace("*", "000000")
        if r.counted_by is not None and r.counted_by[0] not in out.entries:
            index, field = r.counted_by
            out.put_json(index, {field: [{"name": name}]})
        placeholder = f"{stage} {name} {text}".strip()
        if name.endswith(".json"):  # what the CLI reads after a run: report.json, and the plots
            out.put_json(name, {"placeholder": placeholder})
        elif name.endswith(".png"):
            out.put_bytes(name, _blank_png())
        else:
            out.put_bytes(name, f"{stage} {name} {text}\n".encode())


def _blank_png() -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    return buf.getvalue()


def flip_in_place(path: Path, keep_mtime: bool = False, offset: int | None = None) -> None:
    """A same-size edit: one byte inverted in place (at ``offset``, else mid-file); ``keep_mtime``
    resets the mtime as a tamperer would (the ctime still moves)."""
    st = path.stat()
    at = st.st_size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
