"""Each host's cache of the Redis records kernels cache (names and attributes), kept true
by the announcements of other hosts' changes (kvfs/engines/redis_engine.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from enum import Enum
from itertools import islice
from typing import Literal

from kvfs.engines.redis_layout import ANNOUNCED, complete_prefix

CACHED_RECORDS = 100_000  # of the ANNOUNCED families, per host (the oldest go first)


class NotCached(Enum):
    MISS = 0  # not in the cache (None there is a record known to be absent)


Cached = bytes | None | Literal[NotCached.MISS]


class RecordCache:
    """What this host last read, wrote or was pushed of the records kernels cache
    (ANNOUNCED: names and attributes), kept only while other hosts' announcements reach this
    host (`enable`). Changes read from it: their commit script checks each read, so a stale
    one makes the change run again (`RedisEngine.change` drops what it read), never go
    wrong. The kernel's lookups and getattrs read from it too (`cached` snapshots).

    How it stays true: changes are counted, each record remembers the count at its last
    change, and a read (or this host's write) is kept only if its record did not change
    while it was on its way (the count, `changes`, taken before it set out).
    Announcements come in commit order and carry the values written: one sets the record
    when it is absent or was set by an earlier announcement, and drops it otherwise (what
    this host read or wrote itself cannot be ordered against it). Thread-safe: the daemon's
    worker threads and the watcher share one.

    A directory this host made starts out complete (`known_empty`): every entry it gains is
    written here or announced, so a name missing from the cache is missing from the
    directory, and lookups of new names there (a store's) need no round trip. It stays
    complete until one of its entries leaves the cache (evicted, or dropped as uncertain)."""

    def __init__(self) -> None:
        self._records: dict[bytes, bytes | None] = {}  # oldest first (evicted first)
        self._pushed: set[bytes] = set()  # records whose value came with an announcement
        self._complete: set[bytes] = set()  # record prefixes whose every record is here
        # record -> `changes` at its last change, oldest first; records forgotten here
        # (past CACHED_RECORDS) changed at `_forgotten` at the latest.
        self._changed: dict[bytes, int] = {}
        self._forgotten = 0
        self._lock = threading.Lock()
        self._on = False
        self.changes = 0  # of any record: taken before a read or write sets out

    @staticmethod
    def cacheable(family: str) -> bool:
        return family in ANNOUNCED

    def get(self, record: bytes) -> Cached:
        found = self._records.get(record, NotCached.MISS)
        if found is NotCached.MISS and complete_prefix(record) in self._complete:
            return None  # (`_pop` leaves the complete set before the record goes)
        return found

    def _quiet_since(self, record: bytes, moment: int) -> bool:
        """(lock held) Whether `record` has not changed since `changes` was `moment`."""
        return self._changed.get(record, self._forgotten) <= moment

    def _mark_changed(self, records: Iterable[bytes]) -> None:
        """(lock held) One more change, of these records."""
        self.changes += 1
        for record in records:
            self._changed.pop(record, None)  # (moved to the end: the newest)
            self._changed[record] = self.changes
        if len(self._changed) > CACHED_RECORDS:  # forget the oldest tenth
            for record in list(islice(self._changed, CACHED_RECORDS // 10)):
                self._forgotten = self._changed.pop(record)

    def keep(self, records: list[bytes], values: list[bytes | None], moment: int) -> None:
        """Keep what a read that set out when `changes` was `moment` found, except records
        changed meanwhile (also a record whose key the read only learnt on its way)."""
        if not self._on:
            return
        with self._lock:
            for record, value in zip(records, values, strict=True):
                if self._quiet_since(record, moment):
                    self._set(record, value)

    def wrote(self, written: list[tuple[bytes, bytes | None]], moment: int,
              emptied: list[bytes]) -> None:
        """A change of this host's, which set out when `changes` was `moment`, committed
        these (record, value): reads on their way are stale; each value is kept unless its
        record changed meanwhile. `emptied`: record prefixes it made that no record had (a
        new directory's)."""
        with self._lock:
            if self._on:
                self._complete.update(emptied)
            for record, value in written:
                if self._on and self._quiet_since(record, moment):
                    self._set(record, value)
                else:
                    self._pop(record)
            self._mark_changed(record for record, _ in written)

    def pushed(self, written: list[tuple[bytes, bytes | None]]) -> None:
        """Another host committed these (record, value), announced in commit order."""
        with self._lock:
            for record, value in written:
                if self._on and (record in self._pushed or record not in self._records):
                    self._set(record, value)
                    self._pushed.add(record)
                else:
                    self._pop(record)
            self._mark_changed(record for record, _ in written)

    def drop(self, records: Iterable[bytes]) -> None:
        """A change of this host's found these stale."""
        with self._lock:
            dropped = list(records)
            for record in dropped:
                self._pop(record)
            self._mark_changed(dropped)

    def enable(self, on: bool) -> None:
        """On once announcements reach this host, off when they may not: either way what
        is kept goes (announcements were missed meanwhile)."""
        with self._lock:
            self._complete.clear()
            self._records.clear()
            self._pushed.clear()
            self._changed.clear()
            self.changes += 1
            self._forgotten = self.changes  # (every read on its way is stale)
            self._on = on

    def _set(self, record: bytes, value: bytes | None) -> None:
        """(lock held) Set a record read or written here; the oldest go past the limit."""
        self._pushed.discard(record)
        self._records[record] = value
        while len(self._records) > CACHED_RECORDS:
            oldest = next(iter(self._records))
            if self._records[oldest] is None:  # (still absent: its directory stays complete)
                del self._records[oldest]
                self._pushed.discard(oldest)
            else:
                self._pop(oldest)

    def _pop(self, record: bytes) -> None:
        self._complete.discard(complete_prefix(record))
        self._records.pop(record, None)
        self._pushed.discard(record)
