"""The run's lease: one object in the store, ``<run_id>/_run/lease.json``, says who runs it.

Two ``eagle3ctl`` processes on any machines never schedule the same run at once: the lease
is taken with a conditional create (``If-None-Match: *`` on S3, ``link(2)`` on file://), kept
alive by a heartbeat that rewrites it only if it is still the version this holder wrote
(``If-Match``), and released with a conditional delete. A lease whose heartbeat stopped
(``expires_at`` passed, or its holder's pid is gone on this very host) is stale: the next
run takes it over, with one line saying from whom, and then stops what the dead holder
left running (the run's state record says which processes). Then the holder removes the
run's partial writes idle for a whole TTL (:meth:`Lease.sweep_partial_writes`).

Expiry compares the holder's clock with the reader's: machines sharing a run must keep
their clocks within ``ttl_s`` of each other (NTP does far better).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from eagle3.errors import Eagle3Error
from eagle3.store import ObjectStore, stale_partial_writes

LEASE = "_run/lease.json"
TTL_S = 60.0


class RunBusy(Eagle3Error):
    """Another live eagle3ctl holds the run."""


@dataclass
class LeaseRecord:
    owner: str  # a random token: this holder, unique across machines and restarts
    host: str
    pid: int
    cmd: str
    cwd: str
    acquired_at: float
    heartbeat_at: float
    expires_at: float
    ttl_s: float

    def encode(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode() + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> LeaseRecord | None:
        try:
            data = json.loads(raw)
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"eagle3ctl pid {self.pid} on {self.host}"

    def stale(self, now: float | None = None) -> str | None:
        """Why this lease no longer holds (its heartbeat stopped), or None while it is alive."""
        now = time.time() if now is None else now
        if self.host == hostname() and not pid_alive(self.pid):
            return f"its process is gone (heartbeat {max(0.0, now - self.heartbeat_at):.0f}s ago)"
        if now > self.expires_at:
            return f"its heartbeat stopped {now - self.heartbeat_at:.0f}s ago"
        return None


def hostname() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Does a process with this pid exist (ours or, with PermissionError, someone else's)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lease(store: ObjectStore, run_id: str) -> LeaseRecord | None:
    got = store.get_versioned(f"{run_id}/{LEASE}")
    return None if got is None else LeaseRecord.decode(got[0])


def live_holder(store: ObjectStore, run_id: str) -> LeaseRecord | None:
    """The holder of the run's lease while it is alive; None when free or stale."""
    rec = read_lease(store, run_id)
    return rec if rec is not None and rec.stale() is None else None


class Lease:
    """Hold a run: :meth:`acquire`, then a heartbeat thread until :meth:`release`.

    ``lost`` is set (to the new holder, when known) if the heartbeat finds the lease taken:
    the scheduler then stops, because another process now owns the run.
    """

    def __init__(self, store: ObjectStore, run_id: str, ttl_s: float = TTL_S, cmd: str = "",
                 echo: Callable[[str], None] = lambda line: None) -> None:
        self.store, self.run_id, self.ttl_s, self.echo = store, run_id, ttl_s, echo
        self.key = f"{run_id}/{LEASE}"
        now = time.time()
        self.record = LeaseRecord(owner=uuid.uuid4().hex, host=hostname(), pid=os.getpid(), cmd=cmd, cwd=os.getcwd(),
                                  acquired_at=now, heartbeat_at=now, expires_at=now + ttl_s, ttl_s=ttl_s)
        self.version: str | None = None
        self.previous: LeaseRecord | None = None  # the stale holder this lease took over from
        self.lost: LeaseRecord | bool = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _fresh(self) -> bytes:
        now = time.time()
        self.record.heartbeat_at, self.record.expires_at = now, now + self.ttl_s
        return self.record.encode()

    def acquire(self) -> None:
        """Take the run, or raise RunBusy naming the live holder."""
        for _ in range(20):  # a few rounds of racing another taker; each round re-reads
            data = self._fresh()
            version = self.store.create_exclusive(self.key, data)
            if version is not None:
                self.version = version
                break
            got = self.store.get_versioned(self.key)
            if got is None:
                continue  # released meanwhile
            other = LeaseRecord.decode(got[0])
            if other is not None and other.owner == self.record.owner:
                self.version = got[1]
                break
            why = other.stale() if other is not None else "it does not parse"
            if why is None:
                assert other is not None
                raise RunBusy(f"run {self.run_id} is being run by {other.describe()} (since "
                              f"{time.strftime('%H:%M:%S', time.localtime(other.acquired_at))}, from {other.cwd}); "
                              f"wait for it, or stop it with `eagle3ctl down`")
            version = self.store.replace_if(self.key, data, got[1])
            if version is not None:
                self.version, self.previous = version, other
                who = other.describe() if other is not None else "an unreadable lease"
                self.echo(f"taking over run {self.run_id} from {who}: {why}")
                break
        else:
            raise RunBusy(f"run {self.run_id}: could not take its lease ({self.store.uri}/{self.key} keeps changing)")
        self._thread = threading.Thread(target=self._beat, name="eagle3-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            self.heartbeat()

    def heartbeat(self) -> bool:
        """Extend the lease; False (and ``lost`` set) when someone else holds it now."""
        if self.version is None or self.lost:
            return False
        try:
            version = self.store.replace_if(self.key, self._fresh(), self.version)
        except Eagle3Error:
            return True  # the store is unreachable for now: retry at the next beat, expiry decides
        if version is None:
            self.lost = read_lease(self.store, self.run_id) or True
            return False
        self.version = version
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.version is not None and not self.lost:
            try:
                self.store.delete_if(self.key, self.version)
            except Eagle3Error:
                pass  # it expires on its own
        self.version = None

    def sweep_partial_writes(self) -> int:
        """Remove the run's partial writes (a killed writer's hidden file or unfinished upload)
        idle for a whole lease TTL: a live writer writes continually, so their writers are gone.
        Called once the run is held and what a killed predecessor left running is stopped; a
        store that will not list them costs a warning, not the run."""
        try:
            stale = stale_partial_writes(self.store, self.run_id, self.ttl_s)
            for partial in stale:
                self.store.remove_partial(partial)
        except Eagle3Error as e:
            self.echo(f"warning: partial writes under {self.store.uri}/{self.run_id} not swept: {e}")
            return 0
        if stale:
            self.echo(f"removed {len(stale)} partial write{'s' * (len(stale) > 1)} an earlier attempt left in "
                      f"{self.store.uri}/{self.run_id} (idle over lease_ttl_s, {self.ttl_s:.0f}s)")
        return len(stale)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
