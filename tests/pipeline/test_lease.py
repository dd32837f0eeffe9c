"""The run's lease in the store: two holders never at once; stale ones are taken over, saying so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3.pipeline.lease import LEASE, Lease, RunBusy, live_holder, read_lease
from eagle3.store import ObjectStore, open_store


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}")
    return open_store(request.getfixturevalue("s3_store_uri"))


def test_a_second_holder_is_refused_while_the_first_lives(store: ObjectStore) -> None:
    first = Lease(store, "r1", ttl_s=30, cmd="eagle3ctl run pipeline")
    first.acquire()
    try:
        with pytest.raises(RunBusy, match=rf"run r1 is being run by eagle3ctl pid {os.getpid()} on "):
            Lease(store, "r1", ttl_s=30).acquire()
        assert live_holder(store, "r1").owner == first.record.owner
        other_run = Lease(store, "r2", ttl_s=30)
        other_run.acquire()  # another run is free
        other_run.release()
    finally:
        first.release()
    assert read_lease(store, "r1") is None  # released: deleted
    again = Lease(store, "r1", ttl_s=30)
    again.acquire()
    again.release()


def test_heartbeat_extends_and_a_stale_lease_is_taken_over_with_a_line(store: ObjectStore) -> None:
    first = Lease(store, "r1", ttl_s=5)
    first.acquire()
    first._stop.set()  # its heartbeat thread stops: as if the holder hung
    before = read_lease(store, "r1").expires_at
    time.sleep(0.05)
    assert first.heartbeat() and read_lease(store, "r1").expires_at > before
    rec = read_lease(store, "r1")
    rec.expires_at = time.time() - 1  # the heartbeat stopped a while ago (a frozen laptop)
    rec.heartbeat_at = time.time() - 7
    store.put_bytes(f"r1/{LEASE}", rec.encode())
    lines: list[str] = []
    second = Lease(store, "r1", ttl_s=5, echo=lines.append)
    second.acquire()
    try:
        assert lines == [f"taking over run r1 from eagle3ctl pid {os.getpid()} on {rec.host}: "
                         f"its heartbeat stopped 7s ago"]
        assert second.previous.owner == first.record.owner
        # the old holder wakes up: its heartbeat finds the lease taken and says so
        assert first.heartbeat() is False and first.lost.owner == second.record.owner
        first.release()  # must not delete the new holder's lease
        assert read_lease(store, "r1").owner == second.record.owner
    finally:
        second.release()


def _holder(store_uri: str, ttl: float) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys, time
        from eagle3.pipeline.lease import Lease
        from eagle3.store import open_store
        Lease(open_store({store_uri!r}), "r1", ttl_s={ttl}, cmd="holder").acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_sigkilled_holder_on_this_host_is_taken_over_at_once(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}"
    holder = _holder(uri, ttl=600)  # a long TTL: only the dead pid can free it
    store = open_store(uri)
    with pytest.raises(RunBusy):
        Lease(store, "r1").acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lines: list[str] = []
    lease = Lease(store, "r1", echo=lines.append)
    lease.acquire()
    lease.release()
    assert lines and f"from eagle3ctl pid {holder.pid}" in lines[0] and "its process is gone" in lines[0]


def test_racing_takers_of_a_stale_lease_leave_exactly_one_holder(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    stale = Lease(store, "r1", ttl_s=5)
    stale.acquire()
    stale._stop.set()
    rec = read_lease(store, "r1")
    rec.expires_at = time.time() - 1
    store.put_bytes(f"r1/{LEASE}", rec.encode())
    script = textwrap.dedent(f"""
        import time
        from eagle3.pipeline.lease import Lease, RunBusy
        from eagle3.store import open_store
        import sys
        try:
            l = Lease(open_store({f"file://{tmp_path}"!r}), "r1", ttl_s=30)
            l.acquire()
            print("won", flush=True)
            sys.stdin.read()  # hold the run until every taker has answered
        except RunBusy:
            print("busy", flush=True)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        outs = [p.stdout.readline().strip() for p in procs]  # however late each one starts
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    assert sorted(outs) == ["busy", "busy", "busy", "won"]


def test_lease_record_names_holder_host_pid_and_directory(store: ObjectStore) -> None:
    lease = Lease(store, "r1", ttl_s=30, cmd="eagle3ctl run pipeline -c x.yaml")
    lease.acquire()
    try:
        raw = json.loads(store.get_bytes(f"r1/{LEASE}"))
        assert raw["pid"] == os.getpid() and raw["cwd"] == os.getcwd() and raw["cmd"] == "eagle3ctl run pipeline -c x.yaml"
        assert raw["expires_at"] - raw["heartbeat_at"] == pytest.approx(30)
    finally:
        lease.release()
