"""Metadata engines: where the metadata store (kvfs/meta.py) keeps its records.

An engine offers ordered families of byte keys and values, read in snapshots and changed in
transactions, and nothing about files: the namespace logic is written once, over `Txn`, in
kvfs/meta.py (JuiceFS's transactional key-value engines are the model). `LmdbEngine` is the
embedded one: one LMDB environment on the volume, one named database per family.

Group commit: every change runs in the engine's one committer thread. Changes that queue while
a commit syncs go into the next transaction together, each in a nested transaction of its own
(one that fails undoes only itself), and share its one sync; each caller returns once the
commit holding its change is durable.
"""

from __future__ import annotations

import errno
import logging
import struct
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from queue import SimpleQueue
from typing import Protocol, TypeVar

import lmdb

from kvfs.records import fail

log = logging.getLogger(__name__)

T = TypeVar("T")
GROUP_MAX = 256  # changes committed together at most
MAP_HEADROOM = 0.1  # share of the map (at least MAP_HEADROOM_MIN) kept for removals
MAP_HEADROOM_MIN = 1 << 20
_COUNT = struct.Struct(">q")  # counters: signed, big-endian (as the u64 of kvfs-2)


class Txn(Protocol):
    """A snapshot or a transaction: families of byte keys in byte order."""

    def get(self, family: str, key: bytes) -> bytes | None: ...

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        """Several records at once (one round trip on a shared engine)."""
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

    def count(self, family: str, key: bytes) -> int:
        """A counter's value (0 if never added to); not read inside a change, so that hot
        counters never make changes conflict."""
        ...

    def counts(self, family: str) -> dict[bytes, int]: ...

    def add(self, family: str, key: bytes, delta: int) -> None: ...


class Engine(Protocol):
    shared: bool  # whether other hosts use the same metadata at the same time
    conflicts: int  # changes run again because another change got in their way

    def snapshot(self) -> AbstractContextManager[Txn]: ...

    def change(self, change: Callable[[Txn], T]) -> T:
        """Run `change` in a transaction; returns once it is durable. Errors it raises come
        back to the caller, and its writes are undone; ENOSPC when the engine is full."""
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

    def sync(self) -> None: ...

    def close(self) -> None: ...


class _LmdbTxn:
    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
        self._txn = txn
        self._dbs = dbs

    def get(self, family: str, key: bytes) -> bytes | None:
        return self._txn.get(key, db=self._dbs[family])

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        return [self._txn.get(key, db=self._dbs[family]) for key in keys]

    def put(self, family: str, key: bytes, value: bytes) -> None:
        self._txn.put(key, value, db=self._dbs[family])

    def delete(self, family: str, key: bytes) -> bool:
        return self._txn.delete(key, db=self._dbs[family])

    def pop(self, family: str, key: bytes) -> bytes | None:
        return self._txn.pop(key, db=self._dbs[family])

    def discard(self, family: str, key: bytes) -> None:
        self._txn.delete(key, db=self._dbs[family])

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        cursor = self._txn.cursor(db=self._dbs[family])
        if cursor.set_range(start):
            yield from cursor

    def clear(self, family: str) -> None:
        self._txn.drop(self._dbs[family], delete=False)

    def count(self, family: str, key: bytes) -> int:
        raw = self._txn.get(key, db=self._dbs[family])
        return _COUNT.unpack(raw)[0] if raw else 0

    def counts(self, family: str) -> dict[bytes, int]:
        return {bytes(key): _COUNT.unpack(raw)[0] for key, raw in self.scan(family)}

    def add(self, family: str, key: bytes, delta: int) -> None:
        self._txn.put(key, _COUNT.pack(self.count(family, key) + delta), db=self._dbs[family])


class _LmdbSnapshot:
    """A read transaction as a context manager (a plain class: lookups are the hot path)."""

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database]) -> None:
        self._txn = txn
        self._dbs = dbs

    def __enter__(self) -> Txn:
        return _LmdbTxn(self._txn, self._dbs)

    def __exit__(self, *exc: object) -> None:
        self._txn.abort()


class LmdbEngine:
    """The embedded engine: LMDB in the volume's `meta/` directory."""

    shared = False
    conflicts = 0  # one writer at a time: changes never conflict

    def __init__(self, path: Path, families: tuple[str, ...], map_size: int,
                 readonly: bool = False) -> None:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        # metasync=False: a power loss may undo the last commits but never breaks the database.
        self.env = lmdb.open(str(path), map_size=map_size, max_dbs=32, metasync=False,
                             readahead=False, readonly=readonly, lock=True)
        self._dbs = {family: self.env.open_db(family.encode(), create=not readonly)
                     for family in families}
        self._committer = None if readonly else _GroupCommitter(self)

    def snapshot(self) -> _LmdbSnapshot:
        return _LmdbSnapshot(self.env.begin(), self._dbs)

    def change(self, change: Callable[[Txn], T]) -> T:
        assert self._committer is not None, "a read-only engine changes nothing"
        return self._committer.run(change)

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
        info, page = self.env.info(), self.env.stat()["psize"]
        limit = info["map_size"] - max(MAP_HEADROOM * info["map_size"], MAP_HEADROOM_MIN)
        if (info["last_pgno"] + 1) * page <= limit:
            return True
        with self.env.begin() as txn:
            dbs = [None, *self._dbs.values()]
            used = sum(s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
                       for s in (txn.stat(db) if db is not None else txn.stat() for db in dbs))
        return used * page <= limit

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self._committer is not None:
            self._committer.stop()
        self.env.close()

    def begin_group(self) -> lmdb.Transaction[bytes]:
        return self.env.begin(write=True)

    def nested(self, parent: lmdb.Transaction[bytes]) -> tuple[lmdb.Transaction[bytes], Txn]:
        txn = self.env.begin(write=True, parent=parent)
        return txn, _LmdbTxn(txn, self._dbs)


class _GroupCommitter:
    """The one thread that makes every change of an LmdbEngine (group commit, above)."""

    def __init__(self, engine: LmdbEngine) -> None:
        self.engine = engine
        self._queue: SimpleQueue[tuple[Callable[[Txn], object], Future] | None] = SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kvfs-commit", daemon=True)
        self._thread.start()

    def run(self, change: Callable[[Txn], T]) -> T:
        future: Future[T] = Future()
        self._queue.put((change, future))
        return future.result()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _serve(self) -> None:
        stopping = False
        while not stopping:
            group: list[tuple[Callable[[Txn], object], Future]] = []
            while not group or (len(group) < GROUP_MAX and not self._queue.empty()):
                item = self._queue.get()
                if item is None:
                    stopping = True
                    break
                group.append(item)
            try:
                self._commit(group)
            except BaseException as error:  # never leave a caller waiting for ever
                log.exception("group commit failed")
                for _, future in group:
                    if not future.done():
                        future.set_exception(error)

    def _commit(self, group: list[tuple[Callable[[Txn], object], Future]]) -> None:
        outcomes: list[tuple[object, BaseException | None]] = []
        try:
            txn = self.engine.begin_group()
            try:
                outcomes = [self._apply(txn, change) for change, _ in group]
                txn.commit()
            except BaseException:
                txn.abort()
                raise
        except BaseException as error:  # nothing of the group is committed
            failure = fail(errno.ENOSPC) if isinstance(error, lmdb.MapFullError) else error
            outcomes = [(None, failure)] * len(group)
        for (_, future), (result, exc) in zip(group, outcomes, strict=True):
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)

    def _apply(self, parent: lmdb.Transaction[bytes], change: Callable[[Txn], object]
               ) -> tuple[object, BaseException | None]:
        nested, txn = self.engine.nested(parent)
        try:
            result = change(txn)
            nested.commit()
        except BaseException as error:
            nested.abort()
            return None, fail(errno.ENOSPC) if isinstance(error, lmdb.MapFullError) else error
        return result, None
