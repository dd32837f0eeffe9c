"""scripts/vllm_wheelhouse.py: what it reads of the machine, what it refuses, how it packs.

The resolution and the download talk to PyPI and are not run here; everything they are fed
and everything made of their output is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_wheelhouse.py"
spec = importlib.util.spec_from_file_location("vllm_wheelhouse", SCRIPT)
wh = importlib.util.module_from_spec(spec)
sys.modules["vllm_wheelhouse"] = wh
spec.loader.exec_module(wh)


def test_a_pip_freeze_gives_pinned_versions_and_bare_names_are_kept_apart():
    pinned, bare = wh.read_have(
        "# image\nTorch==2.11.0\ntyping_extensions==4.16.0\nnumpy\n-e git+https://x/y#egg=z\n"
        "mypkg @ file:///src/mypkg\nrequests[socks]==2.32.0\n")
    assert pinned == {"torch": "2.11.0", "typing-extensions": "4.16.0", "requests": "2.32.0"}
    assert bare == {"numpy", "mypkg"}


def test_an_unreadable_have_line_is_one_clear_error():
    with pytest.raises(wh.WheelhouseError, match="cannot read 'torch>=2'"):
        wh.read_have("torch>=2\n")


def test_platform_tags_cover_every_older_glibc_and_the_legacy_names():
    tags = wh.platform_tags("manylinux_2_35_x86_64")
    assert tags[0] == "manylinux_2_35_x86_64" and tags.index("manylinux_2_28_x86_64") < tags.index("manylinux_2_17_x86_64")
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    with pytest.raises(wh.WheelhouseError, match="want manylinux_2_N_ARCH"):
        wh.platform_tags("linux_x86_64")


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    path = tmp_path / "vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.99.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("vllm-0.99.0.dist-info/METADATA", meta)
    return path


def test_direct_conflicts_read_the_wheels_own_requirements_with_their_markers(tmp_path):
    wheel = _wheel(tmp_path, ["torch==2.14.0", "numpy<2.4", "triton>=3.5", 'six>=1.16; python_version > "3.11"',
                              'pywin32; sys_platform == "win32"', 'pytest; extra == "test"'])
    found = wh.direct_conflicts(wheel, {"torch": "2.11.0", "numpy": "2.5.2", "triton": "3.6.0", "six": "1.0",
                                        "pywin32": "1", "pytest": "1"}, "3.12", "x86_64")
    assert set(found) == {"torch", "numpy", "six"}
    assert found["torch"] == "torch==2.14.0 (the machine has 2.11.0)"
    assert wh.direct_conflicts(wheel, {"six": "1.0"}, "3.11", "x86_64") == {}


def test_a_vllm_built_for_another_torch_than_the_machines_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    have = tmp_path / "freeze.txt"
    have.write_text("torch==2.11.0\nnumpy==2.5.2\n")
    out = tmp_path / "wh"

    def fake_resolve(args, pinned, bare, work):
        return ["vllm==0.99.0"]

    def fake_download(args, requirements, dest):
        _wheel(dest, ["torch==2.14.0", "numpy<2.4"])

    monkeypatch.setattr(wh, "resolve", fake_resolve)
    monkeypatch.setattr(wh, "download", fake_download)
    rc = wh.main(["0.99.0", "--have", str(have), "--out", str(out), "--exclude-newer", "2026-01-01T00:00:00Z"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "vllm==0.99.0 is built for another torch than the machine's: torch==2.14.0 (the machine has 2.11.0)" in err


def test_pieces_join_back_into_the_tar_their_checksum_names(tmp_path):
    out = tmp_path / "wh"
    out.mkdir()
    for name, size in (("a-1-py3-none-any.whl", 300_000), ("b-2-py3-none-any.whl", 2_500_000)):
        (out / name).write_bytes(bytes(range(256)) * (size // 256))
    (out / "requirements.txt").write_text("a==1\nb==2\n")
    (out / "constraints.txt").write_text("torch==2.11.0\n")
    (out / "SHA256SUMS").write_text("")
    wh.write_pieces(out, piece_mib=1)
    pieces = sorted(out.glob("wheelhouse.tar.0*"))
    assert len(pieces) == 3 and all(p.stat().st_size <= 1 << 20 for p in pieces)
    joined = b"".join(p.read_bytes() for p in pieces)
    digest = (out / "wheelhouse.tar.sha256").read_text().split()[0]
    assert hashlib.sha256(joined).hexdigest() == digest
    (tmp_path / "wheelhouse.tar").write_bytes(joined)
    listing = subprocess.run(["tar", "-tf", str(tmp_path / "wheelhouse.tar")], capture_output=True, text=True).stdout
    assert sorted(listing.split()) == sorted(f"wheelhouse/{n}" for n in (
        "a-1-py3-none-any.whl", "b-2-py3-none-any.whl", "requirements.txt", "constraints.txt", "SHA256SUMS"))


def test_a_missing_have_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert wh.main(["0.26.0", "--have", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: --have {tmp_path / 'nope.txt'}: no such file\n"
