"""What travels between device calls (benchmarks/quality/device_transfer.sh): the inductor cache both systems
compile into, and the curve points' per-prompt rows. The device tool brings back at most 8 files and a call
carries 64 MiB, so each must come back whole or not at all, and only when it holds something new."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PIECE = 4096  # bytes a piece; the device's 15 MiB, scaled down


def _call(tmp_path: Path, *functions: str, out: str = "out", path: str | None = None, check: bool = True) -> str:
    """A device call's transfer steps, as device_call.sh runs them, in ``tmp_path``; what they logged. ``path``
    goes first on PATH (a test's own tools); ``check`` False lets the call die."""
    (tmp_path / out).mkdir(exist_ok=True)
    env = {**os.environ, "E3Q": str(tmp_path / "e3q"), "OUT": str(tmp_path / out), "log": str(tmp_path / "log.txt"),
           "CARRIED": str(tmp_path / "carried"), "PIECE_BYTES": str(PIECE)}
    if path:
        env["PATH"] = f"{path}:{env['PATH']}"
    script = ". benchmarks/quality/device_transfer.sh; " + "; ".join(functions)
    done = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=check)
    return done.stdout


def _compile(tmp_path: Path, name: str, size: int = 1000) -> None:
    """A compiled graph in the cache: incompressible bytes, so the pieces' count is predictable."""
    path = tmp_path / "e3q" / "inductor" / "fxgraph" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))


def _pieces(folder: Path) -> list[Path]:
    return sorted(folder.glob("inductor.tgz.part-*"))


def _unpacked(pieces: list[Path], dest: Path) -> set[str]:
    whole = dest / "whole.tgz"
    whole.write_bytes(b"".join(p.read_bytes() for p in pieces))
    with tarfile.open(whole) as tar:
        return {m.name for m in tar.getmembers() if m.isfile()}


def test_the_cache_comes_back_whole_and_only_when_it_grew(tmp_path):
    _compile(tmp_path, "spec_a")
    _compile(tmp_path, "spec_b")
    _call(tmp_path, "inductor_back")
    first = _pieces(tmp_path / "out")
    assert first and _unpacked(first, tmp_path) == {"inductor/fxgraph/spec_a", "inductor/fxgraph/spec_b"}
    _call(tmp_path, "inductor_back", out="out2")  # the next call on the machine compiled nothing new
    assert _pieces(tmp_path / "out2") == []
    _compile(tmp_path, "ours_train")  # ours' first training on this machine
    _call(tmp_path, "inductor_back", out="out3")
    assert "inductor/fxgraph/ours_train" in _unpacked(_pieces(tmp_path / "out3"), tmp_path)
    assert not (tmp_path / "inductor.tgz").exists()  # the whole archive is not left beside the work folder


def test_a_carried_cache_is_unpacked_once_and_not_sent_back_unchanged(tmp_path):
    _compile(tmp_path, "spec_a")
    _call(tmp_path, "inductor_back")
    carried = tmp_path / "carried"
    carried.mkdir()
    for piece in _pieces(tmp_path / "out"):
        (carried / piece.name).write_bytes(piece.read_bytes())
    machine = tmp_path / "next"  # a fresh machine: no work folder yet
    machine.mkdir()
    (machine / "carried").symlink_to(carried)
    logged = _call(machine, "inductor_unpack", "inductor_back")
    assert "carried inductor cache unpacked" in logged
    assert (machine / "e3q" / "inductor" / "fxgraph" / "spec_a").read_bytes() == \
        (tmp_path / "e3q" / "inductor" / "fxgraph" / "spec_a").read_bytes()
    assert _pieces(machine / "out") == []  # what it carried is not sent back
    _compile(machine, "spec_a", 10)  # recompiled on this machine: a later call's unpack must not put back the old one
    recompiled = (machine / "e3q" / "inductor" / "fxgraph" / "spec_a").read_bytes()
    _call(machine, "inductor_unpack")
    assert (machine / "e3q" / "inductor" / "fxgraph" / "spec_a").read_bytes() == recompiled


def test_a_machine_with_nothing_carried_says_it_compiles_cold_once(tmp_path):
    """The sixteenth session's returned pieces were never kept in .inductor/; in the next session speculators'
    warm-up compiled cold for 468 s beside the target and prep (75-100 s with the cache carried), prep was cut,
    and nothing in the log said why: a call with nothing carried says so."""
    logged = _call(tmp_path, "inductor_unpack")
    assert "no carried inductor cache" in logged and ".inductor" in logged
    assert not (tmp_path / "e3q" / "inductor").exists()  # nothing made up: the systems compile into it themselves
    _compile(tmp_path, "spec_a")  # call 1 compiled; call 2 on this machine has its cache and says nothing
    assert _call(tmp_path, "inductor_unpack") == ""


def test_broken_pieces_start_the_call_without_a_cache(tmp_path):
    _compile(tmp_path / "src", "spec_a", 2 * PIECE)  # 3 pieces with the tar headers
    _call(tmp_path / "src", "inductor_back")
    carried = tmp_path / "carried"
    carried.mkdir()
    pieces = _pieces(tmp_path / "src" / "out")
    assert len(pieces) > 1
    for piece in pieces[:-1]:  # the last piece lost in transfer
        (carried / piece.name).write_bytes(piece.read_bytes())
    logged = _call(tmp_path, "inductor_unpack")
    assert "unreadable" in logged and not (tmp_path / "e3q" / "inductor").exists()


def _unpack_killed_after(tmp_path: Path, tool: str) -> None:
    """A carried cache of one graph unpacked by a call killed (its limit) right after ``tool`` did its work."""
    _compile(tmp_path / "src", "spec_a")
    _call(tmp_path / "src", "inductor_back")
    (tmp_path / "carried").mkdir()
    for piece in _pieces(tmp_path / "src" / "out"):
        (tmp_path / "carried" / piece.name).write_bytes(piece.read_bytes())
    (tmp_path / "tools").mkdir()
    dying = tmp_path / "tools" / tool
    dying.write_text(f"#!/bin/sh\n{shutil.which(tool)} \"$@\"\nkill -9 $PPID\n")  # then the call dies
    dying.chmod(0o755)
    _call(tmp_path, "inductor_unpack", path=str(tmp_path / "tools"), check=False)


def test_a_call_killed_as_it_unpacks_leaves_nothing_a_later_call_takes_as_carried(tmp_path):
    """The device call killed (its limit) right after tar wrote the cache, before it was counted as carried: the
    next call on that machine must unpack the pieces again, not keep a cache it would send back as new."""
    _unpack_killed_after(tmp_path, "tar")
    assert not (tmp_path / "e3q" / "inductor").exists()
    assert "carried inductor cache unpacked" in _call(tmp_path, "inductor_unpack")  # the next call, same machine
    assert sorted(p.name for p in (tmp_path / "e3q" / "inductor").rglob("*") if p.is_file()) == ["spec_a"]
    assert not (tmp_path / "e3q" / "inductor.unpacking").exists()
    assert _call(tmp_path, "inductor_back") == "" and _pieces(tmp_path / "out") == []  # nothing new to send


def test_a_call_killed_as_the_unpacked_cache_moves_in_does_not_send_it_back_as_new(tmp_path):
    """Killed right after the unpacked cache was moved into place: it must already be counted as carried, or the
    next call on that machine sends the carried cache back (27 MB of the 64 MiB the next session carries) as new."""
    _unpack_killed_after(tmp_path, "mv")
    assert (tmp_path / "e3q" / "inductor" / "fxgraph" / "spec_a").exists()
    assert _call(tmp_path, "inductor_unpack", "inductor_back") == "" and _pieces(tmp_path / "out") == []


@pytest.mark.parametrize("outputs, size, said", [
    (0, 4 * PIECE, "over 3"),  # 4 pieces: with the repo and .whl the next call could not carry them
    (6, 2 * PIECE + 100, "no room"),  # 6 files + 3 pieces would pass the tool's 8
])
def test_a_cache_that_cannot_travel_is_not_sent_and_is_sent_later(tmp_path, outputs, size, said):
    _compile(tmp_path, "big", size)
    (tmp_path / "out").mkdir()
    for i in range(outputs):
        (tmp_path / "out" / f"result{i}.json").write_text("{}")
    logged = _call(tmp_path, "inductor_back")
    assert said in logged and _pieces(tmp_path / "out") == []
    assert not (tmp_path / "e3q" / "inductor.carried").exists()  # not marked as sent
    if said == "no room":  # a later call with room sends it
        _call(tmp_path, "inductor_back", out="later")
        assert len(_pieces(tmp_path / "later")) == 3


def test_points_come_back_in_one_file_the_races_and_each_settings(tmp_path):
    e3q = tmp_path / "e3q"
    for folder in ("curve/ours-v512", "sweep/adamw_5e-4/curve/ours-v512"):
        (e3q / folder).mkdir(parents=True)
        (e3q / folder / "step-0001000.json").write_text("{}")
    _call(tmp_path, "points_back")
    with tarfile.open(tmp_path / "out" / "curve_points.tgz") as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
    assert files == {"curve/ours-v512/step-0001000.json", "sweep/adamw_5e-4/curve/ours-v512/step-0001000.json"}
    full = tmp_path / "full"
    full.mkdir()
    for i in range(8):
        (full / f"f{i}").write_text("")
    _call(tmp_path, "points_back", out="full")
    assert not (full / "curve_points.tgz").exists()  # a ninth file would not come back


def test_a_second_send_in_one_call_replaces_the_first_whole(tmp_path):
    """Two device_call.sh runs in one device call share $OUT: when the second sends the grown cache, none of
    the first's pieces may stay beside it (cat of the pieces would join a stale tail to the new archive)."""
    _compile(tmp_path, "spec_a", 2 * PIECE)  # 3 pieces
    _call(tmp_path, "inductor_back")
    assert len(_pieces(tmp_path / "out")) == 3
    (tmp_path / "e3q" / "inductor" / "fxgraph" / "spec_a").write_bytes(os.urandom(10))  # the graph recompiled small
    _compile(tmp_path, "ours_train", 10)
    _call(tmp_path, "inductor_back")
    pieces = _pieces(tmp_path / "out")
    assert len(pieces) == 1 and "inductor/fxgraph/ours_train" in _unpacked(pieces, tmp_path)


def test_a_second_points_send_in_one_call_replaces_the_first_in_a_full_out(tmp_path):
    """The twelfth session's third call: a race, then a sweep, in one device call; the race's points came back
    and $OUT then held 8 files with them, so the sweep's points_back kept the race's stale archive (the new
    setting's rows were lost) although replacing it needs no more room."""
    e3q = tmp_path / "e3q"
    (e3q / "curve/ours-v512").mkdir(parents=True)
    (e3q / "curve/ours-v512/step-0001000.json").write_text("{}")
    _call(tmp_path, "points_back")
    for i in range(7):  # with curve_points.tgz: the 8 files a call brings back
        (tmp_path / "out" / f"f{i}").write_text("")
    (e3q / "sweep/muon_4e-3/curve/ours-v512").mkdir(parents=True)
    (e3q / "sweep/muon_4e-3/curve/ours-v512/step-0001000.json").write_text("{}")
    _call(tmp_path, "points_back")
    with tarfile.open(tmp_path / "out" / "curve_points.tgz") as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
    assert "sweep/muon_4e-3/curve/ours-v512/step-0001000.json" in files
