"""A snapshot (`Reader`) and a change (`Change`) of the Redis engine
(kvfs/engines/redis_engine.py): a change remembers what it read and buffers what it writes, and
commits as one call of the commit script (kvfs/engines/redis_layout.py), which applies its
writes only if every record it read still holds what it read."""

from __future__ import annotations

import errno
import heapq
from collections.abc import Callable, Iterator
from typing import NoReturn, Protocol, TypeVar, cast

import hiredis
import redis
import trio

from kvfs.engines.interface import get_through
from kvfs.engines.redis_cache import RecordCache
from kvfs.engines.redis_layout import (
    ANNOUNCED,
    COMMIT_SCRIPT,
    COUNTERS,
    INDEXED,
    PARTITIONED,
    POOL_KEY,
    ScriptCall,
    announcement,
    counter_key,
    record_key,
    set_key,
    set_keys,
)
from kvfs.engines.redis_loop import LoopConnection
from kvfs.records import fail

T = TypeVar("T")


class RedisAccess(Protocol):
    """What a snapshot and a change use of their engine (RedisEngine)."""

    client: redis.Redis
    id: bytes
    cache: RecordCache
    channel: bytes
    commit_script: redis.commands.core.Script
    pool_guard: bytes | None

    def lose_pool(self) -> None: ...

    def call(self, method: Callable[..., T], *args: object) -> T: ...
    def round_trip_allowed(self) -> None: ...

    def read(self, family: str, records: list[bytes], cached: bool = True
             ) -> list[bytes | None]: ...

    def read_through(self, family: str, key: bytes, to_family: str, cached: bool = True
                     ) -> tuple[bytes | None, bytes | None]: ...

    def scan_stored(self, conn: redis.Redis | redis.client.Pipeline, family: str,
                    start: bytes) -> Iterator[tuple[bytes, bytes]]: ...


class Reader:
    """Reads straight from Redis (or, `cached`, from the cache where it has the record):
    what a snapshot is for this engine (no isolation; the metadata store rereads where two
    records must agree)."""

    def __init__(self, engine: RedisAccess, cached: bool) -> None:
        self.engine = engine
        self.client = engine.client
        self.cached = cached

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, family: str, key: bytes) -> bytes | None:
        return self.engine.read(family, [record_key(family, key)], self.cached)[0]

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        return self.engine.read(family, [record_key(family, key) for key in keys],
                                self.cached)

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        return self.engine.read_through(family, key, to_family, self.cached)

    def count(self, family: str, key: bytes) -> int:
        raw = self.engine.call(self.client.hget, counter_key(family), key)
        return int(raw) if raw is not None else 0

    def counts(self, family: str) -> dict[bytes, int]:
        raw = cast("dict[bytes, bytes]",  # bytes replies (see reply)
                   self.engine.call(self.client.hgetall, counter_key(family)))
        return {key: int(value) for key, value in sorted(raw.items())}

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        yield from self.engine.scan_stored(self.client, family, start)

    def put(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("snapshots are read-only")

    delete = pop = clear = add = discard = known_empty = put


class Change:
    """A transaction: reads are remembered and checked again at commit (COMMIT_SCRIPT);
    writes wait in a buffer until then."""

    def __init__(self, engine: RedisAccess, pipe: redis.client.Pipeline) -> None:
        self.engine = engine
        self.client = engine.client
        self.pipe = pipe  # WATCHes the partitions a scan walks (rare), and commits then
        self.writes: dict[tuple[str, bytes], bytes | None] = {}
        self.adds: list[tuple[str, bytes, int]] = []
        self.cleared: set[str] = set()
        self.watched: set[bytes] = set()
        self.read: dict[bytes, bytes | None] = {}  # records read so far -> what they held
        self.emptied: list[bytes] = []  # key prefixes (records) with no record yet

    def get(self, family: str, key: bytes) -> bytes | None:
        if (family, key) in self.writes:
            return self.writes[family, key]
        if family in self.cleared:
            return None
        record = record_key(family, key)
        if record not in self.read:
            self.read[record] = self.engine.read(family, [record])[0]
        return self.read[record]

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        if family in self.cleared:
            return [self.writes.get((family, key)) for key in keys]
        records = {key: record_key(family, key) for key in keys
                   if (family, key) not in self.writes}
        unread = [record for record in records.values() if record not in self.read]
        if unread:
            self.read.update(zip(unread, self.engine.read(family, unread), strict=True))
        return [self.writes[family, key] if (family, key) in self.writes
                else self.read[records[key]] for key in keys]

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        record = record_key(family, key)
        if (family, key) in self.writes or record in self.read:
            return get_through(self, family, key, to_family)
        entry, referred = self.engine.read_through(family, key, to_family)
        self.read[record] = entry
        if entry is None:
            return None, None
        # (what this change wrote or read before of the second record stays its answer)
        self.read.setdefault(record_key(to_family, bytes(entry[:8])), referred)
        return entry, self.get(to_family, bytes(entry[:8]))

    def put(self, family: str, key: bytes, value: bytes) -> None:
        self.writes[family, bytes(key)] = bytes(value)

    def delete(self, family: str, key: bytes) -> bool:
        return self.pop(family, key) is not None

    def pop(self, family: str, key: bytes) -> bytes | None:
        value = self.get(family, key)
        self.writes[family, bytes(key)] = None
        return value

    def discard(self, family: str, key: bytes) -> None:
        self.writes[family, bytes(key)] = None

    def known_empty(self, family: str, prefix: bytes) -> None:
        if self.engine.cache.cacheable(family):
            self.emptied.append(record_key(family, prefix))

    def record_writes(self) -> list[tuple[bytes, bytes | None]]:
        """(Redis key, value or None) of each record it writes (counters aside)."""
        return [(record_key(family, key), value) for (family, key), value in self.writes.items()
                if family not in COUNTERS]

    def count(self, family: str, key: bytes) -> int:
        raise TypeError("counters are added to, not read, inside a change")

    def add(self, family: str, key: bytes, delta: int) -> None:
        self.adds.append((family, bytes(key), delta))

    def clear(self, family: str) -> None:
        for key, _ in list(self.scan(family)):
            self.writes[family, key] = None
        if family in COUNTERS:
            self.cleared.add(family)

    def counts(self, family: str) -> dict[bytes, int]:
        raise TypeError("counters are added to, not read, inside a change")

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        self.engine.round_trip_allowed()
        if family in PARTITIONED or family in INDEXED:
            unwatched = [key for key in set_keys(family, start) if key not in self.watched]
            if unwatched:
                self.watched.update(unwatched)
                self.pipe.watch(*unwatched)
            stored = self.engine.scan_stored(self.pipe, family, start)
        else:
            stored = self.engine.scan_stored(self.client, family, start)
        buffered = sorted((key, value) for (f, key), value in self.writes.items()
                          if f == family and key >= start)
        last = None
        for key, _, value in heapq.merge(((k, 1, v) for k, v in stored),
                                         ((k, 0, v) for k, v in buffered)):
            if key == last:
                continue  # this change's own write of the key came first
            last = key
            if value is not None:
                yield key, value

    def script_call(self, with_writes: bool) -> ScriptCall:
        """COMMIT_SCRIPT's keys and arguments: the checks, and the writes if `with_writes`."""
        keys = list(self.read)
        checks = [b"" if held is None else b"=" + held for held in self.read.values()]
        if self.engine.pool_guard is not None:  # (first: a change lands in its own pool only)
            keys.insert(0, POOL_KEY)
            checks.insert(0, b"=" + self.engine.pool_guard)
        args: list[bytes | int] = [len(keys), *checks]
        if not with_writes:
            return keys, args

        def op(code: bytes, key: bytes | None, a: bytes = b"", b: bytes | int = 0) -> None:
            if key is not None:
                keys.append(key)
            args.extend((code, len(keys) if key is not None else 0, a, b))

        for family in self.cleared:
            op(b"D", counter_key(family))
        for (family, key), value in self.writes.items():
            index_set = set_key(family, key)
            if family in COUNTERS:
                if value is None:
                    op(b"H", counter_key(family), key)
            elif value is None:
                op(b"D", record_key(family, key))
                if index_set is not None:
                    op(b"R", index_set, key)
            else:
                op(b"S", record_key(family, key), value)
                if index_set is not None:
                    op(b"Z", index_set, key)
        for family, key, delta in self.adds:
            op(b"I", counter_key(family), key, delta)
        changed = [(family, key, value) for (family, key), value in self.writes.items()
                   if family in ANNOUNCED]
        if changed:
            op(b"P", None, self.engine.channel, announcement(self.engine.id, changed))
        return keys, args

    def _run_script(self, with_writes: bool) -> bool:
        """Whether nothing the change read (records, and scanned partitions) has changed;
        if so, and `with_writes`, its writes are applied in the same step."""
        keys, args = self.script_call(with_writes)
        if not self.watched:
            return self._applied(self.engine.commit_script(keys, args))
        self.pipe.multi()
        self.engine.commit_script(keys, args, client=self.pipe)
        try:
            [applied] = self.pipe.execute()
        except redis.WatchError:
            return False
        return self._applied(applied)

    def _applied(self, outcome: object) -> bool:
        """Whether the commit script applied the change (or found its reads current); EIO
        where Redis no longer holds this mount's pool."""
        if outcome == -1 and self.engine.pool_guard is not None:
            self.engine.lose_pool()
            raise fail(errno.EIO)
        return outcome == 1

    def commit(self) -> None:
        written, moment = self.cached_writes()
        try:
            applied = self._run_script(with_writes=True)
        except BaseException:
            self._outcome_unknown(written)
            raise
        self._committed(applied, written, moment)

    async def commit_on_loop(self, connection: LoopConnection) -> None:
        """`commit` from the trio loop (for a change that scanned nothing)."""
        written, moment = self.cached_writes()
        keys, args = self.script_call(with_writes=True)
        try:
            with trio.CancelScope(shield=True):  # once sent, a commit is seen through
                applied = await connection.script(self.engine.commit_script.sha, COMMIT_SCRIPT,
                                                  keys, args)
        except hiredis.ReplyError as error:
            if str(error).startswith("OOM"):  # (past maxmemory: refused, not run)
                raise fail(errno.ENOSPC) from None
            self._outcome_unknown(written)
            raise
        except BaseException:
            self._outcome_unknown(written)
            raise
        self._committed(self._applied(applied), written, moment)

    def cached_writes(self) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """What the commit writes of the cached families, and the cache's count of changes
        before it."""
        cache = self.engine.cache
        written = [(record_key(family, key), value)
                   for (family, key), value in self.writes.items() if cache.cacheable(family)]
        return written, cache.changes

    def _outcome_unknown(self, written: list[tuple[bytes, bytes | None]]) -> None:
        self.engine.cache.drop(record for record, _ in written)  # applied or not: not known

    def _committed(self, applied: bool, written: list[tuple[bytes, bytes | None]],
                   moment: int) -> None:
        if not applied:
            raise redis.WatchError("a record this change read has changed")
        self.engine.cache.wrote(written, moment, self.emptied)

    def still_valid(self) -> bool:
        return self._run_script(with_writes=False)
