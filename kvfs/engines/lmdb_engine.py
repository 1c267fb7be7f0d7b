"""The embedded metadata engine: LMDB on the volume, for a volume one host mounts.

`LmdbEngine` keeps the families of the engine interface (kvfs/engines/interface.py) in one LMDB
environment in the volume's `meta/` directory, one named database per family
(kvfs/engines/lmdb_env.py).

Changes of the embedded engine never wait for a disk sync. A change runs at once, in the
caller's thread, against what LMDB holds plus the changes not yet in it (`Layer`s in memory);
its writes go to the change log (kvfs/engines/changelog.py, a copy into a mapped file, no sync) and
into the newest layer, and the caller returns: the change is visible to every later read and
survives the daemon's death. The committer thread moves the layers into LMDB, one synced
transaction per layer (group commit: everything answered during one sync goes into the next),
and the log segments LMDB now holds are deleted. A power loss undoes at most the changes
answered since the last of those syncs (COMMIT_GATHER_SECONDS) and never breaks the database;
`sync()` waits for them.

Reads see one moment: a snapshot takes, under the engine's lock, an LMDB read transaction and
the layers not yet in it, and reads each key from the newest layer that has it, else LMDB.
Each change's writes carry its sequence number, so a snapshot ignores changes made after it
began, and LMDB records the last sequence number it holds, so a layer LMDB already holds is
never counted twice (counters are deltas).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from types import EllipsisType
from typing import TypeVar

import lmdb

from kvfs.engines.changelog import KEEP, ChangeLog, Pending, Value, Writes, encode
from kvfs.engines.interface import (
    CAPACITY,
    CLAIM_PREFIX,
    USED_BYTES,
    Txn,
    claims_total,
    get_through,
)
from kvfs.engines.lmdb_env import (
    APPLIED_KEY,
    COUNT,
    Layer,
    host_files,
    open_environment,
    write_layer,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_SECONDS = 1.0  # a group LMDB refused (a full map) is tried again after this
# A commit waits this long for more changes to join it: under a stream of small changes
# (a store is 4-5 of them) one LMDB transaction and sync takes a burst, not each change.
# Each sync also takes the volume's journal from the stores beside it, so fewer syncs store
# faster, up to about this gather time and no further. What a power
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


def _layered_on(stored: bytes | None, value: Value, delta: int) -> bytes | None:
    """A record as the layers leave it: `value` replaces what LMDB holds unless KEEP, and a
    counter's `delta` is added."""
    current = stored if isinstance(value, EllipsisType) else value
    if delta:
        return COUNT.pack((COUNT.unpack(current)[0] if current else 0) + delta)
    return current


class _LayeredTxn:
    """A snapshot of LMDB under the layers not yet in it; with `writes`, a change that
    collects its writes there (read first)."""

    def __init__(self, lmdb_txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database],
                 layers: list[Layer], visible: int, writes: Writes | None = None,
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
        return COUNT.unpack(raw)[0] if raw else 0

    def counts(self, family: str) -> dict[bytes, int]:
        return {bytes(key): COUNT.unpack(raw)[0] for key, raw in self.scan(family)}

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
    back_at = 0.0  # (a local file: never away)

    def __init__(self, path: Path, families: tuple[str, ...], map_size: int,
                 readonly: bool = False) -> None:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        self._host_files = host_files(path, readonly)
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
        self._active = Layer()
        self._committing: Layer | None = None
        self._stopping = False
        self._committer_idle = False  # waiting for changes: the next one wakes it
        self.commit_failures = 0
        self._log = ChangeLog(self._host_files)
        self._committer: threading.Thread | None = None
        self._seq = self._applied()
        self._replay(readonly)
        self._measure_map()
        if not readonly:
            self._log.start(self._seq + 1)
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
        layer = Layer()
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
                self._active.add(seq, writes, len(payload))
                self._seq = seq
                if self._committer_idle or self._active.size >= GATHER_BYTES:
                    self._moved.notify_all()
        return result

    def allocate(self, key: bytes, count: int) -> int:
        def change(txn: Txn) -> int:
            txn.add("counters", key, count)
            return txn.count("counters", key)
        return self.change(change)

    def claim(self, session: bytes, amount: int, live_mark: bytes | None = None
              ) -> tuple[bool, int, int]:
        """(One host: no reaper ends its session, `live_mark` is not needed.)"""
        def change(txn: Txn) -> tuple[bool, int, int]:
            counters = txn.counts("counters")
            held = counters.get(USED_BYTES, 0) + claims_total(counters)
            raw = txn.get("settings", CAPACITY)
            capacity = int.from_bytes(raw[:8], "big") if raw else 0
            granted = amount <= 0 or held + amount <= capacity
            if granted and amount:
                txn.add("counters", CLAIM_PREFIX + session, amount)
            return granted, capacity, held
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
            if self._applied() == self._seq:
                self._log.drop_all()
            self._log.close()
        self.env.close()

    def _commit_layers(self) -> None:
        """The committer thread: each layer into LMDB, in one synced transaction."""
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
                self._active = Layer()
            while True:
                try:
                    write_layer(self.env, self._dbs, layer)
                    break
                except lmdb.Error as error:
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
