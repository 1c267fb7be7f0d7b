"""Metadata engines: where the metadata store (kvfs/meta.py) keeps its records.

An engine offers ordered families of byte keys and values, read in snapshots and changed in
transactions, and nothing about files: the namespace logic is written once, over `Txn`, in
kvfs/meta.py (JuiceFS's transactional key-value engines are the model). `LmdbEngine` is the
embedded one: one LMDB environment on the volume, one named database per family.

Changes of the embedded engine never wait for a disk sync. A change runs at once, in the
caller's thread, against what LMDB holds plus the changes not yet in it (`_Layer`s in memory);
its writes go to the change log (kvfs/changelog.py, a copy into a mapped file, no sync) and
into the newest layer, and the caller returns: the change is visible to every later read and
survives the daemon's death. The committer thread moves the layers into LMDB, one synced
transaction per layer (group commit: everything answered during one sync goes into the next),
run by the LMDB writer process (kvfs/lmdb_writer.py, off this process's GIL), and the log
segments LMDB now holds are deleted. A power loss undoes at most the changes answered since
the last of those syncs (~50 ms) and never breaks the database; `sync()` waits for them.

Reads see one moment: a snapshot takes, under the engine's lock, an LMDB read transaction and
the layers not yet in it, and reads each key from the newest layer that has it, else LMDB.
Each change's writes carry its sequence number, so a snapshot ignores changes made after it
began, and LMDB records the last sequence number it holds, so a layer LMDB already holds is
never counted twice (counters are deltas).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import lmdb

from kvfs.changelog import KEEP, ChangeLog, Pending, Value, Writes, decode, encode
from kvfs.lmdb_writer import LmdbWriter, WriterError, hold_writer_lock

if TYPE_CHECKING:
    from kvfs.write_behind import WriteBehind

log = logging.getLogger(__name__)

T = TypeVar("T")
APPLIED_KEY = b"changes applied"  # settings: the last change LMDB holds (read from LMDB only)
RETRY_SECONDS = 1.0  # a group LMDB refused (a full map) is tried again after this
# A commit waits this long for more changes to join it: under a stream of small changes
# (a store is 4-5 of them) one LMDB transaction and sync takes a burst, not each change.
# Each sync also takes the volume's journal from the stores beside it: 4 KiB stores ran
# 10-15 % faster at 50 ms than at 5 ms (one and 16 threads), no faster beyond. What a power
# loss may undo is that much of the namespace's latest changes; the data written in the last
# seconds is lost anyway unless --fsync syncs it.
COMMIT_GATHER_SECONDS = 0.05
GATHER_BYTES = 64 << 10  # ... unless its changes' encodings pass this: sent at once (a
# group's pages in LMDB are estimated from them: PENDING_PAGE_FACTOR)
MAP_HEADROOM = 0.1  # share of the map (at least MAP_HEADROOM_MIN) kept for removals
MAP_HEADROOM_MIN = 1 << 20
# Map pages a byte of a pending change may take once in LMDB (B-tree and copy-on-write
# overhead): changes answered but not yet applied may bring no more than the headroom, so that
# fast creates cannot answer more than the map will take (a layer that does not fit never lands).
PENDING_PAGE_FACTOR = 4
_COUNT = struct.Struct(">q")  # counters: signed, big-endian (as the u64 of kvfs-2)


class Txn(Protocol):
    """A snapshot or a transaction: families of byte keys in byte order."""

    def get(self, family: str, key: bytes) -> bytes | None: ...

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        """Several records at once (one round trip on a shared engine)."""
        ...

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        """A record and the `to_family` record named by its value's first 8 bytes (a name's
        entry and its inode: one round trip on a shared engine)."""
        ...

    def put(self, family: str, key: bytes, value: bytes) -> None: ...

    def delete(self, family: str, key: bytes) -> bool: ...

    def pop(self, family: str, key: bytes) -> bytes | None: ...

    def discard(self, family: str, key: bytes) -> None:
        """Delete without reading (a shared engine then watches nothing)."""
        ...

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key, value) from the first key >= start, in key order. Callers stop where the
        keys leave the 8-byte prefix they scan (a shared engine partitions by it)."""
        ...

    def clear(self, family: str) -> None: ...

    def known_empty(self, family: str, prefix: bytes) -> None:
        """No key of `family` starts with the 8-byte `prefix` yet (a new directory's
        entries): a shared engine's cache then answers misses there from memory."""
        ...

    def agree_first(self) -> None:
        """A change other hosts' changes build on (of a directory, a removal): a shared
        engine answers it only once the pool has it, never ahead (write-behind)."""
        ...

    def count(self, family: str, key: bytes) -> int:
        """A counter's value (0 if never added to); not read inside a change, so that hot
        counters never make changes conflict."""
        ...

    def counts(self, family: str) -> dict[bytes, int]: ...

    def add(self, family: str, key: bytes, delta: int) -> None: ...


class Engine(Protocol):
    shared: bool  # whether other hosts use the same metadata at the same time
    conflicts: int  # changes run again because another change got in their way

    def snapshot(self, cached: bool = False) -> AbstractContextManager[Txn]:
        """Reads of one moment (a shared engine: of Redis now). `cached`: names and
        attributes may come from what this host last saw of them, trailing another host's
        change until its announcement arrives: for answers the kernel caches anyway."""
        ...

    def change(self, change: Callable[[Txn], T]) -> T:
        """Run `change` in a transaction; returns once it is visible to every later read and
        survives the daemon's death (the embedded engine: in its change log; a shared engine:
        committed). Errors it raises come back to the caller, and its writes are undone."""
        ...

    def allocate(self, key: bytes, count: int) -> int:
        """Add `count` to the counter `key` (family `counters`) at once, outside any change;
        returns its new value (id stocks)."""
        ...

    def has_room(self) -> bool:
        """Whether the namespace may grow: removals must always remain possible."""
        ...

    def beat(self, session: bytes, ttl: float) -> None:
        """Say that `session` lives, for `ttl` seconds more."""
        ...

    def alive(self, session: bytes) -> bool: ...

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every change answered so far is durable (survives a power loss), or
        `timeout` seconds pass; returns whether they are."""
        ...

    def watch(self, changed: Callable[[str, bytes], None]) -> None:
        """Call `changed(family, key)`, from a thread of the engine's, for each `dentry` and
        `inode` record other hosts change from now on (a shared engine)."""
        ...

    def watching(self) -> bool:
        """Whether other hosts' changes reach `watch`'s callback now (none are missed)."""
        ...

    def from_memory(self) -> AbstractContextManager[None]:
        """Within it (on the calling thread), a `cached` snapshot read that would need a
        round trip raises RoundTripNeeded instead: the loop tries such reads itself first."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class LoopChanges(Protocol):
    """An engine whose changes may also commit from the trio loop (the shared one: there a
    worker thread costs two hand-offs on top of the round trip)."""

    loop_commits: int  # changes committed from the loop
    id: bytes  # this engine's, in the batches it sends and the changes it announces

    async def change_on_loop(self, function: Callable[[], T]) -> T:
        """Call `function`, which makes one change and has no other effects (it may run
        twice), committing from the loop; RoundTripNeeded where a worker must call it."""
        ...

    def write_behind(self, gather_seconds: float, sync_volume: Callable[[], None],
                     journal: Path) -> WriteBehind:
        """Answer changes ahead of the pool from now on, sent in batches every
        `gather_seconds` (kvfs/write_behind.py), journaled in the directory `journal` (the
        session's staging directory); `sync_volume` flushes the data volume before a batch
        that follows closes. Returns the queue (closes leave their data's sync to it)."""
        ...

    def replay_behind(self, directory: Path, sender: bytes, same_boot: bool
                      ) -> tuple[int, int]:
        """(reaping a dead session) Apply what its write-behind journal in `directory`
        holds that Redis lacks, unless it comes from another boot; delete the journal.
        Returns (applied, not applied)."""
        ...


class RoundTripNeeded(Exception):
    """A read inside `Engine.from_memory` that only a round trip can answer (or a change
    that `LoopChanges.change_on_loop` leaves to a worker)."""


class ChangesPending(Exception):
    """The engine refused room for growth, but holds answered changes it has not applied
    yet (removals among them may free room): wait for them off the loop, then try again."""


@dataclass
class _Layer:
    """Changes not yet in LMDB: per family and key, the versions (seq, value, delta), oldest
    first. Only the engine's lock holder appends; snapshots read the versions they may see."""

    families: dict[str, dict[bytes, list[tuple[int, Value, int]]]] = field(default_factory=dict)
    last_seq: int = 0
    size: int = 0  # bytes of the changes' encodings (what they may take in the map)
    payloads: list[bytes] = field(default_factory=list)  # the changes' encodings, in order

    def add(self, seq: int, writes: Writes, payload: bytes = b"") -> None:
        self.size += len(payload)
        if payload:
            self.payloads.append(payload)
        for family, keys in writes.items():
            versions = self.families.setdefault(family, {})
            for key, (value, delta) in keys.items():
                versions.setdefault(key, []).append((seq, value, delta))
        self.last_seq = seq

    def folded(self) -> Writes:
        """The layer's end state per key, for one LMDB transaction."""
        writes: Writes = {}
        for family, keys in self.families.items():
            folded = writes.setdefault(family, {})
            for key, versions in keys.items():
                value: Value = KEEP
                delta = 0
                for _, changed, added in versions:
                    if changed is not KEEP:
                        value, delta = changed, 0
                    delta += added
                folded[key] = [value, delta]
        return writes


def layer_of(payloads: Iterable[bytes], last_seq: int) -> _Layer:
    """One layer of encoded changes, through `last_seq` (kvfs/lmdb_writer.py)."""
    layer = _Layer()
    for payload in payloads:
        layer.add(last_seq, decode(payload))
    return layer


def open_environment(path: Path, families: tuple[str, ...], map_size: int,
                     readonly: bool = False
                     ) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    """The engine's LMDB environment and its databases, one per family (the daemon and its
    LMDB writer open it alike)."""
    # metasync=False: a power loss may undo the last commits but never breaks the database.
    env = lmdb.open(str(path), map_size=map_size, max_dbs=32, metasync=False,
                    readahead=False, readonly=readonly, lock=True)
    try:
        return env, {family: env.open_db(family.encode(), create=not readonly)
                     for family in families}
    except BaseException:
        env.close()  # else this process could never open the environment again
        raise


def write_layer(env: lmdb.Environment, dbs: dict[str, lmdb._Database], layer: _Layer) -> None:
    """A layer into LMDB in one synced transaction, with the last seq it holds; not again
    if LMDB holds it already (a writer process that ended between its commit and its reply:
    the layer is sent once more)."""
    with env.begin(write=True) as txn:
        applied = txn.get(APPLIED_KEY, db=dbs["settings"])
        if applied is not None and int(applied) >= layer.last_seq:
            return
        _apply(txn, dbs, layer.folded())
        txn.put(APPLIED_KEY, str(layer.last_seq).encode(), db=dbs["settings"])


def _apply(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], writes: Writes) -> None:
    for family, keys in writes.items():
        db = dbs[family]
        for key, (value, delta) in keys.items():
            if value is None:
                txn.delete(key, db=db)
            elif value is not KEEP:
                txn.put(key, value, db=db)
            if delta:
                raw = txn.get(key, db=db)
                txn.put(key, _COUNT.pack((_COUNT.unpack(raw)[0] if raw else 0) + delta), db=db)


def get_through(txn: Txn, family: str, key: bytes, to_family: str
                ) -> tuple[bytes | None, bytes | None]:
    """`Txn.get_through` as two reads (where a read costs no round trip)."""
    record = txn.get(family, key)
    return record, None if record is None else txn.get(to_family, bytes(record[:8]))


def _layered_on(stored: bytes | None, value: Value, delta: int) -> bytes | None:
    """A record as the layers leave it: `value` replaces what LMDB holds unless KEEP, and a
    counter's `delta` is added."""
    current = stored if isinstance(value, EllipsisType) else value
    if delta:
        return _COUNT.pack((_COUNT.unpack(current)[0] if current else 0) + delta)
    return current


class _LayeredTxn:
    """A snapshot of LMDB under the layers not yet in it; with `writes`, a change that
    collects its writes there (read first)."""

    def __init__(self, lmdb_txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database],
                 layers: list[_Layer], visible: int, writes: Writes | None = None,
                 floor: int = 0) -> None:
        self._txn = lmdb_txn
        self._dbs = dbs
        self._layers = layers[::-1]  # newest first
        self._visible = visible
        self._floor = floor  # versions up to this one are in LMDB already
        self.writes = writes

    def _pending(self, family: str, key: bytes) -> tuple[Value, int]:
        """(value, delta) that the layers (and this change) add to LMDB's record."""
        delta = 0
        if self.writes is not None:
            own = self.writes.get(family, {}).get(key)
            if own is not None:
                if own[0] is not KEEP:
                    return own[0], own[1]
                delta = own[1]
        value, layered = self._layered_value(family, key)
        return value, delta + layered

    def _layered_value(self, family: str, key: bytes) -> tuple[Value, int]:
        """(value, delta) that the layers alone add to LMDB's record."""
        delta = 0
        for layer in self._layers:
            versions = layer.families.get(family, {}).get(key)
            for seq, value, added in reversed(versions or ()):
                if seq > self._visible or seq <= self._floor:
                    continue
                delta += added
                if value is not KEEP:
                    return value, delta
        return KEEP, delta

    def _resolve(self, family: str, key: bytes, stored: bytes | None) -> bytes | None:
        return _layered_on(stored, *self._pending(family, key))

    def _unlayered(self, family: str) -> bool:
        """Whether neither the layers nor this change hold versions of `family`: its reads go
        to LMDB alone, which is what a listing or a lookup of settled names mostly does. (A
        family a layer gains while this view lasts is read the long way, and its versions,
        later than the view, are not seen.)"""
        if self.writes is not None and family in self.writes:
            return False
        for layer in self._layers:  # noqa: SIM110 (a loop: no generator made per read)
            if family in layer.families:
                return False
        return True

    def get(self, family: str, key: bytes) -> bytes | None:
        if self._unlayered(family):
            return self._txn.get(key, db=self._dbs[family])
        value, delta = self._pending(family, key)
        stored = (self._txn.get(key, db=self._dbs[family]) if isinstance(value, EllipsisType)
                  else None)
        return _layered_on(stored, value, delta)

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        if self._unlayered(family):
            read, db = self._txn.get, self._dbs[family]
            return [read(key, db=db) for key in keys]
        return [self.get(family, key) for key in keys]

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        return get_through(self, family, key, to_family)

    def _write(self, family: str, key: bytes) -> Pending:
        if self.writes is None:
            raise TypeError("a snapshot is read-only")
        return self.writes.setdefault(family, {}).setdefault(bytes(key), [KEEP, 0])

    def put(self, family: str, key: bytes, value: bytes) -> None:
        if self.writes is None:
            raise TypeError("a snapshot is read-only")
        self.writes.setdefault(family, {})[bytes(key)] = [bytes(value), 0]

    def delete(self, family: str, key: bytes) -> bool:
        existed = self.get(family, key) is not None
        self.discard(family, key)
        return existed

    def pop(self, family: str, key: bytes) -> bytes | None:
        value = self.get(family, key)
        self.discard(family, key)
        return value

    def discard(self, family: str, key: bytes) -> None:
        self._write(family, key)[:] = [None, 0]

    def known_empty(self, family: str, prefix: bytes) -> None:
        pass  # (LMDB needs no hint)

    def agree_first(self) -> None:
        pass  # (one host: nothing is answered ahead of anyone)

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """LMDB's keys merged with the pending ones, in key order."""
        # (list(): one C call, atomic under the GIL while a change adds keys in another thread)
        pending = {key for layer in self._layers
                   for key in list(layer.families.get(family, {})) if key >= start}
        if self.writes is not None:
            pending.update(key for key in self.writes.get(family, {}) if key >= start)
        ahead = sorted(pending)
        at = 0
        cursor = self._txn.cursor(db=self._dbs[family])
        stored = iter(cursor) if cursor.set_range(start) else iter(())
        for key, value in stored:
            while at < len(ahead) and ahead[at] < key:
                resolved = self._resolve(family, ahead[at], None)
                if resolved is not None:
                    yield ahead[at], resolved
                at += 1
            if at < len(ahead) and ahead[at] == key:
                at += 1
                resolved = self._resolve(family, key, value)
                if resolved is not None:
                    yield key, resolved
            else:
                yield key, value
        for key in ahead[at:]:
            resolved = self._resolve(family, key, None)
            if resolved is not None:
                yield key, resolved

    def clear(self, family: str) -> None:
        for key, _ in list(self.scan(family)):
            self.discard(family, key)

    def count(self, family: str, key: bytes) -> int:
        raw = self.get(family, key)
        return _COUNT.unpack(raw)[0] if raw else 0

    def counts(self, family: str) -> dict[bytes, int]:
        return {bytes(key): _COUNT.unpack(raw)[0] for key, raw in self.scan(family)}

    def add(self, family: str, key: bytes, delta: int) -> None:
        self._write(family, key)[1] += delta


class _LayeredSnapshot:
    """A read of one moment as a context manager (a plain class: lookups are the hot path)."""

    def __init__(self, txn: _LayeredTxn, lmdb_txn: lmdb.Transaction[bytes]) -> None:
        self._txn = txn
        self._lmdb_txn = lmdb_txn

    def __enter__(self) -> Txn:
        return self._txn

    def __exit__(self, *exc: object) -> None:
        self._lmdb_txn.abort()


class LmdbEngine:
    """The embedded engine: LMDB in the volume's `meta/` directory, with its change log."""

    shared = False
    conflicts = 0  # one writer at a time: changes never conflict

    def __init__(self, path: Path, families: tuple[str, ...], map_size: int,
                 readonly: bool = False) -> None:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        self.env, self._dbs = open_environment(path, families, map_size, readonly)
        try:
            self._open(path, families, map_size, readonly)
        except BaseException:
            self.env.close()  # else this process could never open the environment again
            raise

    def _open(self, path: Path, families: tuple[str, ...], map_size: int,
              readonly: bool) -> None:
        self._lock = threading.RLock()
        self._moved = threading.Condition(self._lock)  # a layer reached LMDB, or news for it
        self._active = _Layer()
        self._committing: _Layer | None = None
        self._stopping = False
        self._committer_idle = False  # waiting for changes: the next one wakes it
        self.commit_failures = 0
        self._log = ChangeLog(path)
        self._committer: threading.Thread | None = None
        self.writer: LmdbWriter | None = None
        if readonly:
            self._seq = self._applied()
            self._replay(readonly)
        else:
            writer_lock = hold_writer_lock(path)  # a killed daemon's writer finishes first
            try:
                self._seq = self._applied()
                self._replay(readonly)
            finally:
                os.close(writer_lock)
        self._measure_map()
        if not readonly:
            self._log.start(self._seq + 1)
            try:
                self.writer = LmdbWriter(path, map_size, families)
            except OSError as error:  # (an interpreter this user may not run again)
                log.warning("the LMDB writer process cannot start (%s): changes move into "
                            "LMDB in this process", error)
            self._committer = threading.Thread(target=self._commit_layers, name="kvfs-commit",
                                               daemon=True)
            self._committer.start()

    def _applied(self) -> int:
        with self.env.begin() as txn:
            raw = txn.get(APPLIED_KEY, db=self._dbs["settings"])
        return int(raw) if raw else 0

    def _replay(self, readonly: bool) -> None:
        """Changes answered before the last daemon stopped that LMDB does not hold yet: into
        LMDB (or, read-only, into memory)."""
        layer = _Layer()
        for seq, writes in self._log.replay(self._seq):
            layer.add(seq, writes)
            self._seq = seq
        if not layer.families:
            if not readonly:
                self._log.drop_all()
            return
        log.info("replaying %d changes from the change log", layer.last_seq - self._applied())
        if readonly:
            self._active = layer
            return
        write_layer(self.env, self._dbs, layer)
        self._log.drop_all()

    def _view(self, writes: Writes | None) -> tuple[_LayeredTxn, lmdb.Transaction[bytes]]:
        """LMDB and the layers it does not hold yet, as of now (the caller holds the lock)."""
        lmdb_txn = self.env.begin()
        layers = [layer for layer in (self._committing, self._active) if layer is not None]
        floor = 0
        # What LMDB holds already is read from LMDB alone: a layer being committed may be
        # in it, and so may part of what a read-only open replayed beside a live daemon.
        # (Otherwise nothing of the layers is: no read of the mark on every lookup.)
        if self._committing is not None or self._committer is None:
            raw = lmdb_txn.get(APPLIED_KEY, db=self._dbs["settings"])
            floor = int(raw) if raw else 0
        return _LayeredTxn(lmdb_txn, self._dbs, layers, self._seq, writes, floor), lmdb_txn

    def snapshot(self, cached: bool = False) -> _LayeredSnapshot:
        with self._lock:
            txn, lmdb_txn = self._view(None)
        return _LayeredSnapshot(txn, lmdb_txn)

    def change(self, change: Callable[[Txn], T]) -> T:
        """Run `change` now; returns once it is visible and in the change log."""
        assert self._committer is not None, "a read-only engine changes nothing"
        writes: Writes = {}
        with self._lock:
            txn, lmdb_txn = self._view(writes)
            try:
                result = change(txn)
            finally:
                lmdb_txn.abort()
            if writes:
                seq = self._seq + 1
                payload = encode(writes)
                self._log.append(seq, payload)
                self._active.add(seq, writes, payload)
                self._seq = seq
                if self._committer_idle or self._active.size >= GATHER_BYTES:
                    self._moved.notify_all()
        return result

    def allocate(self, key: bytes, count: int) -> int:
        def change(txn: Txn) -> int:
            txn.add("counters", key, count)
            return txn.count("counters", key)
        return self.change(change)

    def beat(self, session: bytes, ttl: float) -> None:
        """One host: the volume's lock says who lives."""

    def alive(self, session: bytes) -> bool:
        return True

    def has_room(self) -> bool:
        """LMDB copies on write: near a full map even a removal needs fresh pages."""
        with self._lock:
            pending = sum(layer.size for layer in (self._committing, self._active)
                          if layer is not None) * PENDING_PAGE_FACTOR
        # Refused when the layers not yet in LMDB could take more than the headroom, or the
        # map, as of the last commit, is already into it.
        return pending <= self._headroom and self._map_fits

    def _measure_map(self) -> None:
        """Whether the map leaves its headroom free: measured where only it can change, after
        each commit, so that a create reads no statistics."""
        info, page = self.env.info(), self.env.stat()["psize"]
        self._headroom = max(MAP_HEADROOM * info["map_size"], MAP_HEADROOM_MIN)
        limit = info["map_size"] - self._headroom
        if (info["last_pgno"] + 1) * page <= limit:
            self._map_fits = True
            return
        with self.env.begin() as txn:
            dbs = [None, *self._dbs.values()]
            used = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
                       for s in (txn.stat(db) if db is not None else txn.stat() for db in dbs))
        self._map_fits = used * page <= limit

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until LMDB holds every change answered so far (durable: synced)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._moved:
            target = self._seq
            while self._applied() < target and self._committer is not None \
                    and self._committer.is_alive():
                left = RETRY_SECONDS if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    break
                self._moved.wait(timeout=min(left, RETRY_SECONDS))
            return self._applied() >= target

    def watch(self, changed: Callable[[str, bytes], None]) -> None:
        """One host: nothing changes the metadata behind this host's back."""

    def watching(self) -> bool:
        return True

    def from_memory(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # every read is: the map is in memory

    def close(self) -> None:
        if self._committer is not None:
            with self._moved:
                self._stopping = True
                self._moved.notify_all()
            self._committer.join()
            if self.writer is not None:
                self.writer.close()
            if self._applied() == self._seq:
                self._log.drop_all()
            self._log.close()
        self.env.close()

    def _commit_layers(self) -> None:
        """The committer thread: each layer into LMDB, in one synced transaction of the LMDB
        writer process (kvfs/lmdb_writer.py), waited for without the GIL."""
        while True:
            with self._moved:
                while not self._active.families and not self._stopping:
                    self._committer_idle = True
                    self._moved.wait()
                self._committer_idle = False
                self._moved.wait_for(lambda: self._stopping or self._active.size >= GATHER_BYTES,
                                     timeout=COMMIT_GATHER_SECONDS)
                if not self._active.families:
                    return
                layer = self._committing = self._active
                self._active = _Layer()
            while True:
                try:
                    if self.writer is None:
                        write_layer(self.env, self._dbs, layer)
                    else:
                        self.writer.write(layer.last_seq, layer.payloads)
                    break
                except (WriterError, lmdb.Error) as error:
                    # (answered already: the layer stays in memory and in the log)
                    self.commit_failures += 1
                    log.error("moving changes into LMDB failed (%s); trying again", error)
                    if self._stopping:
                        return  # the change log still holds them: the next mount replays it
                    time.sleep(RETRY_SECONDS)
            self._measure_map()
            with self._moved:
                self._committing = None
                self._moved.notify_all()
            self._log.release(layer.last_seq)
