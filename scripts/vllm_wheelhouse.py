"""Assemble the wheels a GPU machine without internet needs to run a given vLLM release.

An air-gapped GPU node (or image) usually already holds a CUDA PyTorch and a scientific
stack. Installing vLLM there must add what is missing and nothing else: a second torch,
numpy or transformers shadowing the machine's own breaks its CUDA build. This script

1. reads what the machine already has (``--have``: its ``pip freeze``, or bare names
   where versions are unknown),
2. resolves ``vllm==VERSION`` for the machine's Python and platform with ``uv pip
   compile``, as PyPI stood when that release came out (``--exclude-newer``, by default
   the release's own upload time), holding the machine's pinned packages at their
   versions (a conflict, e.g. vLLM 0.34 on a torch 2.11 machine, is an error here, not a
   broken install there) and leaving its unpinned ones out,
3. downloads the resulting wheels (``pip download --no-deps``) for that platform,
4. writes ``requirements.txt`` (what to install), ``constraints.txt`` (the machine's own
   versions, so an install keeps its torch), ``SHA256SUMS``, and, with ``--pieces``,
   ``wheelhouse.tar`` split into pieces for a channel with a size limit.

Run it on any machine with internet; carry the output folder to the GPU machine and
install there (docs/airgapped.md):

    python scripts/vllm_wheelhouse.py 0.26.0 --have freeze.txt --out wheelhouse-0.26.0 \\
        --add apache-tvm-ffi --leave-out flashinfer-python
    pip install --no-index --find-links wheelhouse-0.26.0 -c wheelhouse-0.26.0/constraints.txt \\
        -r wheelhouse-0.26.0/requirements.txt

Needs ``uv`` (``pip install uv``) for the resolution and ``pip`` for the download.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple"
NEVER = 'sys_platform == "never"'  # an override under this marker drops a package from the resolution


class WheelhouseError(Exception):
    """A condition the user must change: one line, exit 2."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_have(text: str) -> tuple[dict[str, str], set[str]]:
    """A ``pip freeze`` (or a list of names) -> ({name: version} pinned, {names} without a version)."""
    pinned: dict[str, str] = {}
    bare: set[str] = set()
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*(?:==\s*([^\s;]+))?(?:\s*@.*)?", line)
        if not m:
            raise WheelhouseError(f"--have: cannot read {raw.strip()!r} (want NAME==VERSION or NAME)")
        name, version = normalize(m.group(1)), m.group(2)
        if version and "@" not in line:
            pinned[name] = version
        else:
            bare.add(name)
    return pinned, bare - set(pinned)


def release_time(package: str, version: str) -> datetime:
    """The upload time of the newest file of ``package==version`` on PyPI (its JSON simple API)."""
    req = urllib.request.Request(f"{PYPI_SIMPLE}/{package}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            files = json.load(r)["files"]
    except OSError as e:
        raise WheelhouseError(f"cannot read {package}'s release dates from {PYPI_SIMPLE}: {e}") from None
    pattern = re.compile(rf"^{re.escape(package)}-{re.escape(version)}[-.]", re.IGNORECASE)
    times = [f["upload-time"] for f in files if pattern.match(f["filename"]) and f.get("upload-time")]
    if not times:
        raise WheelhouseError(f"{package}=={version} is not on PyPI")
    return max(datetime.fromisoformat(t.replace("Z", "+00:00")) for t in times)


def parse_platform(platform: str) -> tuple[int, str]:
    """``manylinux_2_28_x86_64`` -> (28, "x86_64")."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(x86_64|aarch64)", platform)
    if not m:
        raise WheelhouseError(f"--platform {platform}: want manylinux_2_N_ARCH, e.g. manylinux_2_28_x86_64")
    return int(m.group(1)), m.group(2)


def platform_tags(platform: str) -> list[str]:
    """``manylinux_2_28_x86_64`` -> every manylinux tag a machine of that glibc accepts, newest first."""
    glibc, arch = parse_platform(platform)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for n, name in legacy.items() if n <= glibc]


def run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise WheelhouseError(f"{what} failed: {' / '.join(detail[-6:])}")
    return proc.stdout


def resolve(args: argparse.Namespace, pinned: dict[str, str], bare: set[str], work: Path) -> list[str]:
    """``uv pip compile`` of vllm==VERSION (+ --add) for the target; the requirement lines to install."""
    uv = shutil.which("uv")
    if uv is None:
        raise WheelhouseError("uv is needed for the resolution: pip install uv")
    wanted = [f"vllm=={args.vllm}", *args.add]
    (work / "in.txt").write_text("\n".join(wanted) + "\n")
    left_out = sorted(bare | {normalize(n) for n in args.leave_out})
    # The machine's versions win over any declared bound (a package's upper bound on numpy, say, is
    # no reason to shadow the machine's numpy); direct conflicts with vLLM are checked after.
    overrides = [f"{n}=={v}" for n, v in sorted(pinned.items())] + [f"{n} ; {NEVER}" for n in left_out]
    (work / "overrides.txt").write_text("\n".join(overrides) + "\n")
    glibc, arch = parse_platform(args.platform)
    cmd = [uv, "pip", "compile", str(work / "in.txt"), "--python-version", args.python,
           "--python-platform", f"{arch}-manylinux_2_{glibc}",
           "--exclude-newer", args.exclude_newer, "--override", str(work / "overrides.txt"), "--no-header", "--no-annotate", "--quiet"]
    now = datetime.now(timezone.utc).isoformat()
    for name in sorted(pinned):  # the machine's own, whenever they were released: checked, never carried
        cmd += ["--no-emit-package", name, "--exclude-newer-package", f"{name}={now}"]
    out = run(cmd, f"resolving vllm=={args.vllm} against the machine's packages")
    return [ln.strip() for ln in out.splitlines() if ln.strip() and not ln.startswith("#")]


def download(args: argparse.Namespace, requirements: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--isolated",
           "--python-version", args.python, "--implementation", "cp", "-d", str(out), "-r", str(requirements)]
    for tag in platform_tags(args.platform):
        cmd += ["--platform", tag]
    run(cmd, "downloading the wheels")


ABI_BOUND = {"torch", "torchvision", "torchaudio"}  # vLLM's compiled kernels are built against these exact versions


def direct_conflicts(vllm_wheel: Path, pinned: dict[str, str], python: str, arch: str) -> dict[str, str]:
    """vLLM's own requirements (its wheel's METADATA) that the machine's pinned versions do not meet."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(vllm_wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    env = {"python_version": python, "python_full_version": f"{python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": arch, "implementation_name": "cpython", "extra": ""}
    found = {}
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        have = pinned.get(normalize(req.name))
        if have is None or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        if not req.specifier.contains(have, prereleases=True):
            found[normalize(req.name)] = f"{req.name}{req.specifier} (the machine has {have})"
    return found


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_pieces(out: Path, piece_mib: int) -> list[Path]:
    """``wheelhouse.tar`` of the wheels and lists, split into ``wheelhouse.tar.NNN`` of at most ``piece_mib``."""
    tar_path = out / "wheelhouse.tar"
    with tarfile.open(tar_path, "w") as tar:
        for p in sorted(out.iterdir()):
            if p.suffix == ".whl" or p.name in ("requirements.txt", "constraints.txt", "SHA256SUMS"):
                tar.add(p, arcname=f"wheelhouse/{p.name}")
    digest, size, piece = sha256(tar_path), tar_path.stat().st_size, piece_mib << 20
    pieces = []
    with tar_path.open("rb") as f:
        for i in range((size + piece - 1) // piece):
            p = out / f"wheelhouse.tar.{i:03d}"
            p.write_bytes(f.read(piece))
            pieces.append(p)
    tar_path.unlink()
    (out / "wheelhouse.tar.sha256").write_text(f"{digest}  wheelhouse.tar\n")
    return pieces


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("vllm", help="the vLLM release, e.g. 0.26.0")
    ap.add_argument("--have", type=Path, required=True,
                    help="what the GPU machine already has: its `pip freeze` (NAME==VERSION lines), or bare names")
    ap.add_argument("--out", type=Path, required=True, help="the wheelhouse folder to write")
    ap.add_argument("--python", default="3.12", help="the machine's Python (default 3.12)")
    ap.add_argument("--platform", default="manylinux_2_28_x86_64", help="the machine's newest manylinux tag")
    ap.add_argument("--exclude-newer", help="resolve as PyPI stood then (RFC 3339); default: the release's upload time")
    ap.add_argument("--add", nargs="*", default=[], help="more requirements, e.g. apache-tvm-ffi")
    ap.add_argument("--leave-out", nargs="*", default=[], help="packages not to carry, e.g. flashinfer-python")
    ap.add_argument("--pieces", type=int, metavar="MIB", help="also write wheelhouse.tar in pieces of MIB MiB")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not args.have.is_file():
            raise WheelhouseError(f"--have {args.have}: no such file")
        pinned, bare = read_have(args.have.read_text(errors="replace"))
        if args.exclude_newer is None:
            args.exclude_newer = (release_time("vllm", args.vllm) + timedelta(minutes=1)).isoformat()
        args.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            lines = resolve(args, pinned, bare, Path(tmp))
        (args.out / "requirements.txt").write_text("\n".join(lines) + "\n")
        (args.out / "constraints.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(pinned.items())))
        download(args, args.out / "requirements.txt", args.out)
        wheels = sorted(args.out.glob("*.whl"))
        vllm_wheel = next(w for w in wheels if w.name.startswith(f"vllm-{args.vllm}-"))
        conflicts = direct_conflicts(vllm_wheel, pinned, args.python, parse_platform(args.platform)[1])
        abi = [text for name, text in conflicts.items() if name in ABI_BOUND]
        if abi:
            raise WheelhouseError(f"vllm=={args.vllm} is built for another torch than the machine's: {'; '.join(abi)}"
                                  " (pick a vLLM release that pins the machine's torch)")
        for c in conflicts.values():
            print(f"note: vllm=={args.vllm} asks for {c}; the machine's version is kept", file=sys.stderr)
        (args.out / "SHA256SUMS").write_text("".join(f"{sha256(w)}  {w.name}\n" for w in wheels))
        total = sum(w.stat().st_size for w in wheels)
        print(f"vllm=={args.vllm}: {len(wheels)} wheels, {total / 2**20:.0f} MiB in {args.out} "
              f"(resolved as of {args.exclude_newer}; {len(pinned)} of the machine's packages held at their "
              f"versions, {len(bare)} left out unchecked)")
        if args.pieces:
            pieces = write_pieces(args.out, args.pieces)
            print(f"wheelhouse.tar in {len(pieces)} pieces of at most {args.pieces} MiB; "
                  f"join: cat wheelhouse.tar.* > wheelhouse.tar && sha256sum -c wheelhouse.tar.sha256")
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
