"""A mount's life in a shared pool: its session, heartbeat, held blobs, and the clean-up after
hosts that died.

On the embedded engine one host owns the volume (its lock says so) and none of this is needed:
the session is local, holds nothing remotely and reaps nobody. On a shared engine
(kvfs/engines/redis_engine.py) every mount is a session with an id of its own:

- Its staged data lives in `staging/<session>/`, which only it (or whoever reaps it) deletes.
- It renews a heartbeat every TTL/4. A session not seen beating in two checks at least TTL
  apart, while this host's own heartbeats went through, is dead (a Redis restart or stall
  therefore kills nobody); one whose daemon ran on this machine in this boot and has exited
  is dead at once (a daemon restarted after a crash recovers its old session's work now).
  One live host claims it (an atomic removal of its record) and cleans up after it: its
  staged blobs are published (committed) or deleted (not), the files it wrote whose
  checksums were still pending are hashed if it ran on this machine's boot and dropped
  otherwise (their bytes may never have reached the volume), and its holds go. A host only
  stalled that finds itself reaped registers again, as a new session with a staging
  directory and mount record of its own, and loses nothing (kvfs/data/staged.py).
- Its content commits check that the session whose staging directory holds the file is
  still alive (its mark, which the reaper's claim removes: kvfs/meta/content.py), so nothing
  is committed where a reaper deletes; a close that finds it claimed runs the upkeep at once
  (`catch_up`) and commits a copy staged under the new session.
- It holds, in the engine, every blob it has open (`held` records): eviction spares a file
  whose blob any host holds, and a replaced or removed blob's data file is deleted (the
  doomed sweep, every second, on every host) only once no host holds it and no host is still
  publishing it.
- Its writers' room is its claim in the engine (kvfs/pool/space.py), which ends with its
  session, whether it unmounts or a reaper claims it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kvfs.data.store import DataStore
from kvfs.data.volume import Volume, boot_id
from kvfs.meta import Inode, MetaStore, u64
from kvfs.meta.calls import off_loop
from kvfs.observe.stats import Stats
from kvfs.pool.reaper import Leftovers, reap_doomed, reap_session
from kvfs.records import BlobInfo

log = logging.getLogger(__name__)

DEFAULT_TTL = 10.0
SWEEP_SECONDS = 1.0
# A shared pool's releases of holds wait this long, to go to the engine together in one change
# (a hold taken again meanwhile keeps its record: no round trip either way).
RELEASE_GATHER_SECONDS = 0.05
RELEASE_RETRY_SECONDS = 1.0  # after a failed one (the engine unreachable)
# Batches whose blobs are remembered: an open whose change overlapped older ones records its
# hold again (`Session.read_holding`).
RECENT_BATCHES = 64


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _exited_here(record: dict) -> bool:
    """Whether a session's daemon ran on this machine, in this boot and process namespace,
    and is no more: dead for certain, reaped without waiting for its heartbeat to expire (a
    daemon restarted after a crash cleans up after its old self at once)."""
    if (record.get("host") != socket.gethostname() or record.get("boot") != boot_id()
            or record.get("pid_namespace") != _pid_namespace()):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # (another user's process has that pid now)
    return False


def new_session_id(meta: MetaStore) -> bytes:
    """A fresh id for this mount in a shared pool (b"" on one host); the metadata store
    marks what it records for the session with it."""
    meta.session = u64(meta.engine.allocate(b"next_session", 1)) if meta.engine.shared else b""
    return meta.session


@dataclass(frozen=True)
class UpkeepRound:
    """What one upkeep round found, for the loop to apply."""

    lost: bool  # this session had been declared dead (and has rejoined)
    reaped: list[Leftovers]  # what the dead sessions this host cleaned up after left


class Session:
    def __init__(self, volume: Volume, meta: MetaStore, data: DataStore, stats: Stats,
                 mountpoint: Path, ttl: float = DEFAULT_TTL) -> None:
        self.volume = volume
        self.meta = meta
        self.data = data
        self.stats = stats
        self.ttl = ttl
        self.shared = meta.engine.shared
        self.id = meta.session
        # On the loop, once this host learns it was declared dead (its staging reaped).
        self.on_lost: Callable[[], None] = lambda: None
        self._held: Counter[int] = Counter()
        self._recording_locks: dict[int, trio.Lock] = {}
        self._releasing: set[int] = set()  # last local hold gone; its record not yet
        self._releasing_now: set[int] = set()  # ... on its way to the engine
        self._release_failed: set[int] = set()  # ... sent, maybe recorded: to send again
        self._batches_begun = 0  # batches of releases sent so far; the last ones' blobs:
        self._recent_batches: deque[tuple[int, frozenset[int]]] = deque(maxlen=RECENT_BATCHES)
        self._release_wanted = trio.Event()
        self._releases_sent = trio.Event()
        self._seen_dead: dict[bytes, float] = {}  # session -> when first seen not beating
        self._beat_ok = time.monotonic()
        self._sweep_wanted = trio.Event()
        self._upkeep_lock = trio.Lock()
        self._want_sums: Callable[[int], None] = lambda blob_id: None
        self._record: dict[str, Any] = {  # JSON: the session's record
            "host": socket.gethostname(), "pid": os.getpid(), "boot": boot_id(),
            "pid_namespace": _pid_namespace(), "mountpoint": str(mountpoint)}
        if self.shared:
            meta.engine.beat(self.id, ttl)
            meta.pool.register_session(self.id, json.dumps(self._record).encode())
            volume.record_mount(self.id, mountpoint)

    def staging_session(self, session: str) -> bytes | None:
        """The session a staged file's directory (`session`, hex) belongs to, which its
        content commit checks (None on one host)."""
        return bytes.fromhex(session) if self.shared else None

    # -- holds ---------------------------------------------------------------------------

    async def hold(self, blob_id: int) -> None:
        """This host has `blob_id` open (before it opens the data file). In a shared pool
        the first hold of a blob is recorded in the engine, one at a time per blob, and after
        any release of it on its way there (`send_releases`)."""
        if self.hold_standing(blob_id):
            return
        async with self._recording(blob_id):
            while blob_id in self._releasing_now:  # (it must not land after this hold)
                await self._releases_sent.wait()
            if not (self._held[blob_id] or blob_id in self._releasing):
                self._release_failed.discard(blob_id)
                await off_loop(self.meta.pool.hold, blob_id, self.id)
            self._releasing.discard(blob_id)
            self._add_hold(blob_id)

    def hold_standing(self, blob_id: int) -> bool:
        """Hold `blob_id` if that needs no record in the engine: on one host, or where this
        host's hold of it stood all along (held, or its release not yet on its way, and no
        record of it under way: no host can have deleted its data since). False:
        `read_holding` records one."""
        if self.shared and not ((self._held[blob_id] or blob_id in self._releasing)
                                and blob_id not in self._releasing_now
                                and blob_id not in self._recording_locks):
            return False
        self._releasing.discard(blob_id)
        self._add_hold(blob_id)
        return True

    async def read_holding(self, ino: int) -> tuple[Inode, BlobInfo | None]:
        """(Shared pool) Inode `ino` and its blob, read in the change that records this
        host's hold of that blob: a reader's open in one worker call. The blob, if any, is
        held (released with `release`)."""
        while True:
            in_flight, begun = frozenset(self._releasing_now), self._batches_begun
            inode, blob = await off_loop(self.meta.content.get_held, ino, self.id)
            if blob is None or not await self._held_by_change(blob.blob_id, in_flight, begun):
                return inode, blob
            # Recorded again after a release that may have erased the first record: the
            # blob's data is safe only if the inode still names it (a blob is doomed only
            # once replaced or removed), else the new one is held instead.
            try:
                inode, again = await off_loop(self.meta.content.get, ino)
            except BaseException:
                await self.release(blob.blob_id)
                raise
            if again is not None and again.blob_id == blob.blob_id:
                return inode, again
            await self.release(blob.blob_id)

    async def _held_by_change(self, blob_id: int, in_flight: frozenset[int], begun: int
                              ) -> bool:
        """Count a hold a change recorded before this host knew which blob it was; returns
        whether it was recorded again: a release of that blob on its way to the engine
        meanwhile (`in_flight` then, or a batch begun after the `begun`-th) may have landed
        after the hold. Counted at once, so that this host's other handles of the blob,
        closing meanwhile, queue no release of it."""
        self._add_hold(blob_id)
        self._releasing.discard(blob_id)
        self._release_failed.discard(blob_id)
        if not (blob_id in in_flight or self._released_since(blob_id, begun)):
            return False
        try:
            async with self._recording(blob_id):
                while blob_id in self._releasing_now:
                    await self._releases_sent.wait()
                self._release_failed.discard(blob_id)  # (the batch may have failed)
                await off_loop(self.meta.pool.hold, blob_id, self.id)
        except BaseException:
            await self.release(blob_id)
            raise
        return True

    def _released_since(self, blob_id: int, begun: int) -> bool:
        """Whether a batch of releases begun after the `begun`-th carried `blob_id` (or may
        have: one no longer remembered)."""
        if begun < self._batches_begun - len(self._recent_batches):
            return True
        return any(blob_id in blobs for number, blobs in self._recent_batches if number > begun)

    def hold_committing(self, blob_id: int) -> bytes | None:
        """Hold a new blob this host is about to commit: no other host can know it yet, so in
        a shared pool its commit records the hold (returns the session to record it for)."""
        self._add_hold(blob_id)
        return self.id if self.shared else None

    def _add_hold(self, blob_id: int) -> None:
        self._held[blob_id] += 1
        self.stats.blobs_held = len(self._held)

    async def release(self, blob_id: int) -> None:
        if self._drop_hold(blob_id) and self.shared:
            self._releasing.add(blob_id)  # recorded by `send_releases`, with others
            self._release_wanted.set()

    def _drop_hold(self, blob_id: int) -> bool:
        """One hold less; returns whether it was the last."""
        self._held[blob_id] -= 1
        if self._held[blob_id] > 0:
            return False
        del self._held[blob_id]
        self.stats.blobs_held = len(self._held)
        return True

    @contextlib.asynccontextmanager
    async def _recording(self, blob_id: int) -> AsyncIterator[None]:
        lock = self._recording_locks.setdefault(blob_id, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and not lock.statistics().tasks_waiting:
                self._recording_locks.pop(blob_id, None)

    async def send_releases(self) -> None:
        """Background (shared only): record the releases of holds, gathered for
        RELEASE_GATHER_SECONDS into one change; a failed change is tried again."""
        if not self.shared:
            return
        while True:
            await self._release_wanted.wait()
            await trio.sleep(RELEASE_GATHER_SECONDS)
            self._release_wanted = trio.Event()
            self._releasing_now = self._releasing | self._release_failed
            self._releasing, self._release_failed = set(), set()
            self._batches_begun += 1
            self._recent_batches.append((self._batches_begun, frozenset(self._releasing_now)))
            failed = False
            try:
                await off_loop(self.meta.pool.release_many, sorted(self._releasing_now), self.id)
            except Exception as error:
                failed = True
                self.stats.background_errors += 1
                log.warning("recording %d released holds failed (%s); trying again",
                            len(self._releasing_now), error)
                self._release_failed |= self._releasing_now  # (a hold records itself anew)
                self._release_wanted.set()
            finally:
                self._releasing_now = set()
                self._releases_sent.set()
                self._releases_sent = trio.Event()
            if failed:
                await trio.sleep(RELEASE_RETRY_SECONDS)

    # -- upkeep --------------------------------------------------------------------------

    async def run(self, want_sums: Callable[[int], None]) -> None:
        """Heartbeat and the reaping of dead sessions (shared only)."""
        if not self.shared:
            return
        self._want_sums = want_sums
        while True:
            await self._round()
            await trio.sleep(self.ttl / 4)

    async def catch_up(self) -> None:
        """(A commit found the session it staged under claimed by a reaper) An upkeep round
        now, which finds this session gone and registers a new one."""
        if self.shared:
            await self._round()

    async def _round(self) -> None:
        async with self._upkeep_lock:
            previous, held = self.id, list(self._held)
            try:
                round_ = await off_loop(self._upkeep, held)
                self.stats.sessions_lost += round_.lost
                if round_.lost:
                    # Staged files go to the new session's directory from now on. The reaper
                    # dropped the old session's holds: none to release; but the rejoin
                    # recorded those held when the round began under the new session, and
                    # those let go meanwhile (their releases went, if at all, under the old
                    # one) are released again, or their data would stay until unmount.
                    self.data.switch_session(self.id.hex())
                    self._releasing = {blob_id for blob_id in held if blob_id not in self._held}
                    if self._releasing:
                        self._release_wanted.set()
                    self.on_lost()
                    await off_loop(self._after_rejoin, previous, list(self._held))
                for leftovers in round_.reaped:
                    self.stats.sessions_reaped += 1
                    for blob_id in leftovers.to_hash:
                        self._want_sums(blob_id)
            except Exception:
                self.stats.background_errors += 1
                log.exception("session upkeep failed")

    def _upkeep(self, held: list[int]) -> UpkeepRound:
        """One round (worker thread; `_seen_dead`, `_beat_ok` and `_record` are the rounds'
        own), on one read of the sessions: beat, then reap. `held`: the blobs this host
        holds, as the loop saw them when the round began."""
        self.meta.engine.beat(self.id, self.ttl)
        self._beat_ok = time.monotonic()
        sessions = self.meta.pool.sessions()
        record = json.dumps(self._record).encode()
        previous = self.id
        # (an update, not a registration: a reaper's claim between the read and here must
        # not be undone, or this host's commits would land in a directory being reaped)
        lost = previous not in sessions or not self.meta.pool.update_session(previous, record)
        if lost:
            log.error("session %s was declared dead by another host (stalled for more than "
                      "%.0f s?): registering again", previous.hex(), self.ttl)
            self._rejoin(held, record)
        reaped = self._reap_dead(sessions, previous)
        if reaped:  # (and what a host gave back of its claim after its reaper ended it)
            self.meta.pool.drop_claims(set(self.meta.pool.sessions()))
        return UpkeepRound(lost, reaped)

    def _rejoin(self, held: list[int], record: bytes) -> None:
        """After being declared dead: the reaper claimed this session, and cleans up its
        staging directory, holds and mount record. Register as a new session, with a
        staging directory and mount record of its own that no reaper of the old one touches
        (open writers' closes stage their data there again, kvfs/data/staged.py)."""
        session = u64(self.meta.engine.allocate(b"next_session", 1))
        self.meta.session = session  # (the sessions its content commits name)
        self.meta.engine.beat(session, self.ttl)
        (self.data.staging_root / session.hex()).mkdir(parents=True, exist_ok=True)
        self.meta.pool.register_session(session, record)
        for blob_id in held:
            self.meta.pool.hold(blob_id, session)
        self.volume.record_mount(session, Path(self._record["mountpoint"]))
        self.id = session

    def _after_rejoin(self, previous: bytes, held: list[int]) -> None:
        """(After `_rejoin`, once new files are staged in the new directory) Holds recorded
        under the old session while it rejoined go, every blob held now is held under the
        new one, and what was staged in the old directory since its reaper cleaned it up (a
        close that staged its file again before the rejoin, spares made meanwhile) goes as
        the reaper's clean-up would: committed blobs published, the rest deleted."""
        self.meta.pool.drop_holds(previous)
        for blob_id in held:
            self.meta.pool.hold(blob_id, self.id)
        directory = self.data.staging_root / previous.hex()
        if directory.is_dir():
            self.data.recover(self.meta.content.is_committed_blob, directory)
            with contextlib.suppress(OSError):  # (its reaper, still at work, removes it)
                directory.rmdir()

    def _reap_dead(self, sessions: dict[bytes, bytes], previous: bytes) -> list[Leftovers]:
        """Claim and clean up after sessions seen dead long enough (not this host's, now or
        before this round); what they left."""
        now = time.monotonic()
        reaped = []
        for session, raw in sessions.items():
            if session in (self.id, previous):
                continue
            record = json.loads(raw)
            if not _exited_here(record):
                if self.meta.engine.alive(session):
                    self._seen_dead.pop(session, None)
                    continue
                first = self._seen_dead.setdefault(session, now)
                if now - first < self.ttl or now - self._beat_ok > self.ttl / 2:
                    continue
            leftovers = reap_session(self.meta, self.data, self.volume, session, record)
            self._seen_dead.pop(session, None)
            if leftovers is not None:  # (else another host claimed it first)
                reaped.append(leftovers)
        return reaped

    # -- the doomed sweep ----------------------------------------------------------------

    def want_sweep(self) -> None:
        """This host doomed a blob: sweep now rather than at the next tick."""
        self._sweep_wanted.set()

    async def sweep_doomed(self) -> None:
        """Delete the data files of doomed blobs no host holds or publishes (shared only:
        on one host the file table's reaper does this as blobs are freed)."""
        if not self.shared:
            return
        while True:
            with trio.move_on_after(SWEEP_SECONDS):
                await self._sweep_wanted.wait()
            self._sweep_wanted = trio.Event()
            try:
                await off_loop(reap_doomed, self.meta, self.data)
            except Exception:
                self.stats.background_errors += 1
                log.exception("deleting doomed data files failed; the next sweep retries")

    def end(self) -> None:
        """A clean unmount: its staging directory goes (what a failed publish left there is
        published), then the session's record and holds, then what is doomed and held by
        nobody else."""
        if not self.shared:
            return
        if self._held:
            log.warning("%d blobs still held at unmount (released now)", len(self._held))
        self.data.recover(self.meta.content.is_committed_blob)
        self.data.staging_dir.rmdir()
        self.meta.pool.end_session(self.id)
        self.volume.forget_mount(self.id)
        reap_doomed(self.meta, self.data)
