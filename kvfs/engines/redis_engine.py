"""The shared metadata engine: Redis, for a pool that several hosts mount at once.

The same families of ordered byte keys as the embedded engine (kvfs/engines/lmdb_engine.py),
laid out so that hosts rarely contend (JuiceFS on Redis is the model). Keys, all under one hash tag
(`{kvfs}`, so that a Redis Cluster keeps them on one node):

    {kvfs}:<family>:<key>              a record (string)
    {kvfs}:<family>/<partition>        sorted set of the keys of one partition, for scans:
                                       dirlist, links, xattr, held, holding: one set per
                                       inode, blob or session (the keys' first 8 bytes, in
                                       hex); recency: 16 sets by key hash; pins, doomed,
                                       pending, sessions: one set each
    {kvfs}:<family>                    hash of integers (counters, models): HINCRBY deltas
    {kvfs}:beat:<session>              a host's heartbeat; expires unless renewed
    {kvfs}:batch:<engine id>           a write-behind sender's last batch and its answer, so
                                       that a batch sent again is not applied twice, and
                                       the reaper of a dead session knows what of its
                                       journal Redis has (kvfs/engines/write_behind.py); expires
                                       after a week

Every member of a sorted set has score 0, so that ZRANGEBYLEX walks keys in byte order.
Families without a set (inode, dentry, blob, symlink, settings) are scanned only by fsck,
with SCAN.

A change is one optimistic transaction: the change runs against a write buffer, reading
records with plain GETs (one round trip each, no WATCH); its commit is one script
(COMMIT_SCRIPT) that checks that every record it read still holds what it read and only then
applies its writes, and a conflict runs it again, after a short random wait (for up to
CHANGE_SECONDS; then EAGAIN). A change that
scans a partition WATCHes it (a script cannot compare a scan cheaply), and its script then
runs inside MULTI/EXEC. A change that fails
(ENOENT, or a record that contradicts another) fails only if what it read is still current:
its reads are not one snapshot, so it may have seen half of another host's change.

Counters are added with HINCRBY inside the MULTI and read by nobody inside a change, so that
the hot counters (used bytes, files, per-model usage) never make two changes conflict. Id
stocks are taken with HINCRBY.

A change that writes `dentry` or `inode` records (what a kernel caches: names and attributes)
publishes their keys on `{kvfs}:changes` inside its MULTI, tagged with the writing engine's
id; every mount subscribes (`watch`) and invalidates those names and attributes in its own
kernel, so that kernels may cache them for seconds and still see other hosts' changes within
milliseconds. A lookup reads a name's entry and its inode in one round trip (a script).
Announcements carry the values written. Each host keeps a cache of those records
(`RecordCache`): what it last read, wrote or was announced, missing names too. Changes read
from it without a round trip: their commit script checks every read, so a stale one only
makes the change run again. The kernel's lookups and getattrs (`cached` snapshots) read from
it too, on the daemon's loop when it has the record (a name another host just stored is
found without a round trip); everything else reads Redis.

When Redis cannot be reached, a request fails with EIO after two attempts (each at most 1 s to
connect, 2 s to answer), and requests fail at once for the next half second; the pool of
connections reconnects when Redis is back.
"""

from __future__ import annotations

import errno
import heapq
import logging
import marshal
import os
import random
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from enum import Enum
from itertools import islice
from pathlib import Path
from typing import Literal, NoReturn, TypeVar, cast
from urllib.parse import urlparse

import hiredis
import redis
import trio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvfs.engines.changelog import ChangeLog
from kvfs.engines.interface import RoundTripNeeded, get_through
from kvfs.engines.redis_loop import (
    CONNECT_TIMEOUT,
    REQUEST_TIMEOUT,
    LoopConnection,
    LoopConnectionError,
    packed_command,
)
from kvfs.engines.write_behind import APPLIED, TAKEN, WriteBehind
from kvfs.records import FsError, fail

log = logging.getLogger(__name__)

T = TypeVar("T")
PREFIX = b"{kvfs}:"
PARTITIONED = frozenset({"dirlist", "links", "xattr", "held", "holding"})  # by 8-byte prefix
INDEXED = {"recency": 16, "pins": 1, "doomed": 1, "pending": 1, "sessions": 1}  # -> set count
COUNTERS = frozenset({"counters", "models"})
PAGE = 512
# A change that other hosts' changes of what it read keep from committing runs again for this
# long before it fails (EAGAIN): contention ends in seconds, but a fixed number of tries
# fails under heavy churn of one directory on a loaded machine.
CHANGE_SECONDS = 30.0
BACKOFF_BASE = 0.0005  # seconds before a conflicted change runs again, doubling ...
BACKOFF_MAX = 0.05  # ... up to this (randomized: hosts that collided spread out)
ATTEMPTS = 2  # per request, when Redis cannot be reached or does not answer
DOWN_SECONDS = 0.5  # after a connection failure, fail at once for this long
ROOM_CHECK_SECONDS = 1.0
ROOM_SHARE = 0.9  # of Redis's maxmemory the namespace may fill
# Channel of a pool's announcements, per database: Redis delivers a PUBLISH to subscribers on
# every database of the server, and pools in two databases of one server share inode numbers.
CHANGES_CHANNEL = PREFIX + b"changes:%d"
# Families kernels cache -> code in a message (capitals: the message carries the values;
# hosts of one pool run one kvfs version).
ANNOUNCED = {"dentry": b"D", "inode": b"I"}
_FAMILY_OF_CODE = {code: family for family, code in ANNOUNCED.items()}
_DENTRY_PREFIX_LENGTH = len(PREFIX + b"dentry:") + 8  # a dentry record's family and parent
_KEY_LENGTH = struct.Struct(">H")
_VALUE_LENGTH = struct.Struct(">I")
REMOVED = 0xFFFFFFFF  # a value length: the record was removed
ENGINE_ID_BYTES = 8
JOURNAL_MARSHAL_VERSION = 4
# A batch marker outlives its sender by this long: a dead session reaped later (every host down
# meanwhile) would take its journal's applied changes for unsent ones (their commit checks
# would then find them stale: counted as not applied).
MARKER_MS = 7 * 24 * 3600 * 1000
REPLAY_BATCH = 1000  # journaled changes per script call when a dead session's are applied
WATCH_POLL_SECONDS = 0.5  # how soon the watcher notices the engine closing
# After a wake-up the watcher lets announcements gather this long before it reads again: a
# storing host hears its own three per store, and each wake-up costs CPU and takes the GIL
# from the loop (a store's announcements are read in one wake-up instead; the
# first of a burst is still read at once).
WATCH_GATHER_SECONDS = 0.005
CACHED_RECORDS = 100_000  # of the ANNOUNCED families, per host (the oldest go first)
# A batch of changes, each checked against what the ones before it left and applied only if
# every record it read still holds what it read; returns 1 (applied) or 0 per change. ARGV: the
# batch's token ("" for none), how many changes, then per change: its key count, its argument
# count and its arguments: how many records it read, what each held ("" if absent, else "=" +
# value), then per write: op, key index among its keys (0: none), a, b. KEYS: the sender's
# marker (with a token), then per change the records it read and one per write. The
# announcements of the changes applied go out as one message. With a token, the marker keeps
# the batch's answer: a batch sent again (its first reply never came) answers the same without
# applying anything twice. (A single commit is a batch of one, without a token: `batched`.)
# A token is the sequence number of the batch's last change, its changes the ones after the
# previous batch's: where the marker is past the first of them, another sent those already
# under this sender's name (the reaper of a session declared dead while its host was only
# stalled, or that host once awake): they are neither checked nor applied, and answered 2.
COMMIT_SCRIPT = """
local token, count, applied, at, base, channel, message = ARGV[1], tonumber(ARGV[2]), {}, 3, 0
local taken, last = 0, 0
if token ~= '' then
  base = 1
  local done = redis.call('GET', KEYS[1])
  if done then
    local colon = string.find(done, ':', 1, true)
    if string.sub(done, 1, colon) == token .. ':' then
      for i = colon + 1, #done do applied[#applied + 1] = tonumber(string.sub(done, i, i)) end
      return applied
    end
    last = tonumber(string.sub(done, 1, colon - 1))
    taken = last - (tonumber(token) - count)
  end
end
for c = 1, count do
  local keys, args, first = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), at + 2
  local read, ok = tonumber(ARGV[first]), 1
  if c <= taken then
    ok = 2
  else
    for i = 1, read do
      local held, now = ARGV[first + i], redis.call('GET', KEYS[base + i])
      if held == '' then
        if now then ok = 0 break end
      elseif now ~= string.sub(held, 2) then
        ok = 0 break
      end
    end
  end
  if ok == 1 then
    for w = first + read + 1, first + args - 1, 4 do
      local op, key, a, b = ARGV[w], KEYS[base + tonumber(ARGV[w + 1])], ARGV[w + 2], ARGV[w + 3]
      if op == 'S' then redis.call('SET', key, a)
      elseif op == 'D' then redis.call('DEL', key)
      elseif op == 'Z' then redis.call('ZADD', key, 0, a)
      elseif op == 'R' then redis.call('ZREM', key, a)
      elseif op == 'I' then redis.call('HINCRBY', key, a, b)
      elseif op == 'H' then redis.call('HDEL', key, a)
      elseif op == 'P' then  -- (one message for the batch: the engine id once)
        if message then message = message .. string.sub(b, ID_END) else channel, message = a, b end
      end
    end
  end
  applied[c] = ok
  at, base = first + args, base + keys
end
if message then redis.call('PUBLISH', channel, message) end
if token ~= '' and tonumber(token) > last then
  redis.call('SET', KEYS[1], token .. ':' .. table.concat(applied), 'PX', MARKER_MS)
end
return applied
""".replace("ID_END", str(ENGINE_ID_BYTES + 1)).replace("MARKER_MS", str(MARKER_MS))
# A name's entry, then the inode its value starts with: one round trip (keys share {kvfs}).
LOOKUP_SCRIPT = """
local entry = redis.call('GET', KEYS[1])
if not entry then return {false, false} end
return {entry, redis.call('GET', ARGV[1] .. string.sub(entry, 1, 8))}
"""


# The client is made without decode_responses (redis-py's default: False), so every reply
# is bytes; redis-py's annotations cover both settings (bytes | str). Replies are narrowed
# here, once, for the type checker (casts: nothing changes at run time).


def _reply(reply: bytes | str | None) -> bytes | None:
    return cast("bytes | None", reply)


def _replies(replies: list[bytes | str | None]) -> list[bytes | None]:
    return cast("list[bytes | None]", replies)


def _keys(replies: list[bytes | str]) -> list[bytes]:
    return cast("list[bytes]", replies)


def _record_key(family: str, key: bytes) -> bytes:
    return PREFIX + family.encode() + b":" + key


def _partition_key(family: str, key: bytes) -> bytes:
    """The sorted set of a PARTITIONED family that indexes `key`."""
    return PREFIX + family.encode() + b"/" + key[:8].hex().encode()


def _set_key(family: str, key: bytes) -> bytes | None:
    """The sorted set that indexes `key` of `family`, if the family has sets."""
    if family in PARTITIONED:
        return _partition_key(family, key)
    shards = INDEXED.get(family)
    if shards is None:
        return None
    shard = zlib.crc32(key) % shards if shards > 1 else 0
    return PREFIX + family.encode() + b"/" + str(shard).encode()


def _set_keys(family: str, start: bytes) -> list[bytes]:
    """The sets a scan of `family` from `start` walks."""
    if family in PARTITIONED:
        return [_partition_key(family, start.ljust(8, b"\0"))]
    return [PREFIX + family.encode() + b"/" + str(shard).encode()
            for shard in range(INDEXED[family])]


def _counter_key(family: str) -> bytes:
    return PREFIX + family.encode()


def _batch_marker(sender: bytes) -> bytes:
    """Where a write-behind sender's last batch and its answer are kept."""
    return PREFIX + b"batch:" + sender.hex().encode()


ScriptCall = tuple[list[bytes], list[bytes | int]]  # a change's part of COMMIT_SCRIPT's call


def batched(calls: list[ScriptCall], marker: bytes = b"", token: bytes = b"") -> ScriptCall:
    """COMMIT_SCRIPT's keys and arguments for changes checked and applied in this order
    (with a `token` kept in `marker`: a batch that may be sent again)."""
    keys: list[bytes] = [marker] if token else []
    args: list[bytes | int] = [token, len(calls)]
    for change_keys, change_args in calls:
        keys += change_keys
        args += [len(change_keys), len(change_args), *change_args]
    return keys, args


def _complete_prefix(record: bytes) -> bytes:
    """The prefix a record of a directory's entries shares with its siblings (`known_empty`):
    the family's and the parent's 8 bytes."""
    return record[:_DENTRY_PREFIX_LENGTH]


def announcement(engine_id: bytes, changed: list[tuple[str, bytes, bytes | None]]) -> bytes:
    """The message that tells other hosts which records a change wrote, and what (None:
    removed): per record its family's code, the key and the value, each with its length."""
    return engine_id + b"".join(
        ANNOUNCED[family] + _KEY_LENGTH.pack(len(key)) + key
        + (_VALUE_LENGTH.pack(REMOVED) if value is None
           else _VALUE_LENGTH.pack(len(value)) + value)
        for family, key, value in changed)


def announced(message: bytes) -> tuple[bytes, list[tuple[str, bytes, bytes | None]]]:
    """(engine id, [(family, key, value)]) of an announcement."""
    changed: list[tuple[str, bytes, bytes | None]] = []
    at = ENGINE_ID_BYTES
    while at < len(message):
        family = _FAMILY_OF_CODE[message[at:at + 1]]
        (length,) = _KEY_LENGTH.unpack_from(message, at + 1)
        at += 1 + _KEY_LENGTH.size
        key = message[at:at + length]
        (size,) = _VALUE_LENGTH.unpack_from(message, at + length)
        at += length + _VALUE_LENGTH.size
        if size == REMOVED:
            changed.append((family, key, None))
        else:
            changed.append((family, key, message[at:at + size]))
            at += size
        if at > len(message):
            raise struct.error("an announcement cut short")
    return message[:ENGINE_ID_BYTES], changed


class _Cached(Enum):
    MISS = 0  # not in the cache (None there is a record known to be absent)


Cached = bytes | None | Literal[_Cached.MISS]


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
        found = self._records.get(record, _Cached.MISS)
        if found is _Cached.MISS and _complete_prefix(record) in self._complete:
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
        self._complete.discard(_complete_prefix(record))
        self._records.pop(record, None)
        self._pushed.discard(record)


class _Reader:
    """Reads straight from Redis (or, `cached`, from the cache where it has the record):
    what a snapshot is for this engine (no isolation; the metadata store rereads where two
    records must agree)."""

    def __init__(self, engine: RedisEngine, cached: bool) -> None:
        self.engine = engine
        self.client = engine.client
        self.cached = cached

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def get(self, family: str, key: bytes) -> bytes | None:
        return self.engine.read(family, [_record_key(family, key)], self.cached)[0]

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        return self.engine.read(family, [_record_key(family, key) for key in keys],
                                self.cached)

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        return self.engine.read_through(family, key, to_family, self.cached)

    def count(self, family: str, key: bytes) -> int:
        self.engine.caught_up()
        raw = self.engine.call(self.client.hget, _counter_key(family), key)
        return int(raw) if raw is not None else 0

    def counts(self, family: str) -> dict[bytes, int]:
        self.engine.caught_up()
        raw = cast("dict[bytes, bytes]",  # bytes replies (see _reply)
                   self.engine.call(self.client.hgetall, _counter_key(family)))
        return {key: int(value) for key, value in sorted(raw.items())}

    def scan(self, family: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        yield from self.engine.scan_stored(self.client, family, start)

    def put(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("snapshots are read-only")

    delete = pop = clear = add = discard = known_empty = agree_first = put


class _Change:
    """A transaction: reads are remembered and checked again at commit (COMMIT_SCRIPT);
    writes wait in a buffer until then."""

    def __init__(self, engine: RedisEngine, pipe: redis.client.Pipeline) -> None:
        self.engine = engine
        self.client = engine.client
        self.pipe = pipe  # WATCHes the partitions a scan walks (rare), and commits then
        self.writes: dict[tuple[str, bytes], bytes | None] = {}
        self.adds: list[tuple[str, bytes, int]] = []
        self.cleared: set[str] = set()
        self.watched: set[bytes] = set()
        self.read: dict[bytes, bytes | None] = {}  # records read so far -> what they held
        self.emptied: list[bytes] = []  # key prefixes (records) with no record yet
        self.agreed = False  # `agree_first`: never answered ahead of Redis
        self.function: Callable[[_Change], object] | None = None  # (answered ahead: to redo)
        self.announcer = engine.id  # whose change other hosts are told it is

    def journaled(self) -> bytes:
        """What the write-behind journal keeps of a change answered ahead (one that scanned
        nothing and cleared nothing: the loop's changes cannot): what its commit checks and
        applies (`from_journal`)."""
        return marshal.dumps((self.read, self.writes, self.adds), JOURNAL_MARSHAL_VERSION)

    @classmethod
    def from_journal(cls, engine: RedisEngine, payload: bytes, announcer: bytes) -> _Change:
        """A journaled change, to commit again (announced as `announcer`'s)."""
        with engine.client.pipeline(transaction=True) as pipe:  # (never used)
            change = cls(engine, pipe)
        change.read, change.writes, change.adds = marshal.loads(payload)
        change.announcer = announcer
        return change

    def get(self, family: str, key: bytes) -> bytes | None:
        if (family, key) in self.writes:
            return self.writes[family, key]
        if family in self.cleared:
            return None
        record = _record_key(family, key)
        if record not in self.read:
            self.read[record] = self.engine.read(family, [record])[0]
        return self.read[record]

    def get_many(self, family: str, keys: list[bytes]) -> list[bytes | None]:
        if family in self.cleared:
            return [self.writes.get((family, key)) for key in keys]
        records = {key: _record_key(family, key) for key in keys
                   if (family, key) not in self.writes}
        unread = [record for record in records.values() if record not in self.read]
        if unread:
            self.read.update(zip(unread, self.engine.read(family, unread), strict=True))
        return [self.writes[family, key] if (family, key) in self.writes
                else self.read[records[key]] for key in keys]

    def get_through(self, family: str, key: bytes, to_family: str
                    ) -> tuple[bytes | None, bytes | None]:
        record = _record_key(family, key)
        if (family, key) in self.writes or record in self.read:
            return get_through(self, family, key, to_family)
        entry, referred = self.engine.read_through(family, key, to_family)
        self.read[record] = entry
        if entry is None:
            return None, None
        # (what this change wrote or read before of the second record stays its answer)
        self.read.setdefault(_record_key(to_family, bytes(entry[:8])), referred)
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
            self.emptied.append(_record_key(family, prefix))

    def agree_first(self) -> None:
        self.agreed = True

    def record_writes(self) -> list[tuple[bytes, bytes | None]]:
        """(Redis key, value or None) of each record it writes (counters aside)."""
        return [(_record_key(family, key), value) for (family, key), value in self.writes.items()
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
            unwatched = [key for key in _set_keys(family, start) if key not in self.watched]
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
        args: list[bytes | int] = [len(keys)]
        args += [b"" if held is None else b"=" + held for held in self.read.values()]
        if not with_writes:
            return keys, args

        def op(code: bytes, key: bytes | None, a: bytes = b"", b: bytes | int = 0) -> None:
            if key is not None:
                keys.append(key)
            args.extend((code, len(keys) if key is not None else 0, a, b))

        for family in self.cleared:
            op(b"D", _counter_key(family))
        for (family, key), value in self.writes.items():
            set_key = _set_key(family, key)
            if family in COUNTERS:
                if value is None:
                    op(b"H", _counter_key(family), key)
            elif value is None:
                op(b"D", _record_key(family, key))
                if set_key is not None:
                    op(b"R", set_key, key)
            else:
                op(b"S", _record_key(family, key), value)
                if set_key is not None:
                    op(b"Z", set_key, key)
        for family, key, delta in self.adds:
            op(b"I", _counter_key(family), key, delta)
        changed = [(family, key, value) for (family, key), value in self.writes.items()
                   if family in ANNOUNCED]
        if changed:
            op(b"P", None, self.engine.channel, announcement(self.announcer, changed))
        return keys, args

    def _run_script(self, with_writes: bool) -> bool:
        """Whether nothing the change read (records, and scanned partitions) has changed;
        if so, and `with_writes`, its writes are applied in the same step."""
        keys, args = batched([self.script_call(with_writes)])
        if not self.watched:
            return self.engine.commit_script(keys, args) == [1]
        self.pipe.multi()
        self.engine.commit_script(keys, args, client=self.pipe)
        try:
            [applied] = self.pipe.execute()
        except redis.WatchError:
            return False
        return applied == [1]

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
        keys, args = batched([self.script_call(with_writes=True)])
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
        self._committed(applied == [1], written, moment)

    def cached_writes(self) -> tuple[list[tuple[bytes, bytes | None]], int]:
        """What the commit writes of the cached families, and the cache's count of changes
        before it."""
        cache = self.engine.cache
        written = [(_record_key(family, key), value)
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


class RedisEngine:
    """Metadata in a Redis server that every host of the pool reaches (see above)."""

    shared = True

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "redis" or not parsed.hostname:
            raise ValueError(f"not a redis://HOST:PORT/DB address: {url}")
        self.url = url
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=REQUEST_TIMEOUT,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), ATTEMPTS - 1))
        self._down_until = 0.0
        self.conflicts = 0
        self._room = (0.0, True)
        self._lock = threading.Lock()
        self.id = os.urandom(ENGINE_ID_BYTES)
        self.cache = RecordCache()
        self._memory_only = threading.local()  # `from_memory` on this thread
        self.channel = CHANGES_CHANNEL % self.client.get_connection_kwargs().get("db", 0)
        self.loop_connection = LoopConnection(url)
        self._on_loop = threading.local()  # `pending`: changes `change_on_loop` will commit
        self.loop_commits = 0  # changes committed from the loop (`change_on_loop`)
        self.behind: WriteBehind[_Change] | None = None  # (`write_behind`)
        self._changed: Callable[[str, bytes], None] | None = None  # (`watch`'s callback)
        self.lookup_script = self.client.register_script(LOOKUP_SCRIPT)
        self.commit_script = self.client.register_script(COMMIT_SCRIPT)
        self._closing = threading.Event()
        self._subscribed = False
        self._watcher: threading.Thread | None = None
        self.call(self.client.ping)

    # -- errors --------------------------------------------------------------------------

    def call(self, method: Callable[..., T], *args: object) -> T:
        """One request; EIO (logged once per outage) when Redis cannot be reached, ENOSPC
        when it is past its maxmemory (it then refuses every write and script)."""
        self.round_trip_allowed()
        if time.monotonic() < self._down_until:
            raise fail(errno.EIO)
        try:
            result = method(*args)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            self._went_down(error)
            raise fail(errno.EIO) from None
        except redis.exceptions.OutOfMemoryError:
            raise fail(errno.ENOSPC) from None
        if self._down_until:
            self._came_back()
        return result

    def _went_down(self, error: Exception) -> None:
        with self._lock:
            if not self._down_until:
                log.error("metadata engine %s unreachable: %s", self.url, error)
            self._down_until = time.monotonic() + DOWN_SECONDS

    def _came_back(self) -> None:
        with self._lock:
            if self._down_until:
                log.warning("metadata engine %s reachable again", self.url)
            self._down_until = 0.0

    # -- the Engine interface ------------------------------------------------------------

    def snapshot(self, cached: bool = False) -> _Reader:
        return _Reader(self, cached)

    def change(self, change: Callable[[_Change], T]) -> T:
        pending = getattr(self._on_loop, "pending", None)
        if pending is not None:
            return self._change_for_loop(change, pending)
        self.caught_up()  # (write-behind: after what this host answered before)
        return self._change(change)

    def _change(self, change: Callable[[_Change], T]) -> T:
        deadline = time.monotonic() + CHANGE_SECONDS
        attempt = 0
        while True:
            with self.client.pipeline(transaction=True) as pipe:
                txn = _Change(self, pipe)
                try:
                    result = self.call(change, txn)
                    self.call(txn.commit)
                    return result
                except redis.WatchError:
                    pass  # another host changed what this change read: run it again
                except Exception:
                    # Reads are not one snapshot: what the change saw may have been half of
                    # another host's change. Only an error drawn from an unchanged view
                    # is the change's answer.
                    if self._down_until or self.call(txn.still_valid):
                        raise
            self.cache.drop(txn.read)  # (what it read may have come stale from the cache)
            self.conflicts += 1
            attempt += 1
            if time.monotonic() >= deadline:
                log.error("a metadata change conflicted %d times in %.0f s", attempt,
                          CHANGE_SECONDS)
                raise fail(errno.EAGAIN)
            time.sleep(random.uniform(0, min(BACKOFF_MAX, BACKOFF_BASE * 2 ** min(attempt, 16))))

    async def change_on_loop(self, function: Callable[[], T]) -> T:
        """Call `function`, whose one change reads from the record cache alone, on the
        calling trio loop, and commit the change from there (`loop_connection`): no worker
        thread. RoundTripNeeded where a worker must call it instead (it may have run up to
        its change): a read the cache lacks, a second change, an error (a worker checks the
        view it came from), a conflict."""
        if time.monotonic() < self._down_until:
            raise fail(errno.EIO)
        pending: list[_Change] = []  # (the one change, once `function` has made it)
        self._on_loop.pending = pending
        try:
            with self.from_memory():
                result = function()
        finally:
            self._on_loop.pending = None
        if not pending:
            return result
        [txn] = pending
        behind = self.behind
        if behind is not None:
            if not txn.agreed and behind.open:
                self._answer_ahead(txn, behind)
                return result
            if not behind.idle():  # (a worker's change waits for the queue first)
                raise RoundTripNeeded
        try:
            await txn.commit_on_loop(self.loop_connection)
        except redis.WatchError:
            self.cache.drop(txn.read)
            self.conflicts += 1
            raise RoundTripNeeded from None
        except LoopConnectionError as error:
            self._went_down(error)
            raise fail(errno.EIO) from None
        self.loop_commits += 1
        if self._down_until:
            self._came_back()
        return result

    def _answer_ahead(self, txn: _Change, behind: WriteBehind[_Change]) -> None:
        """Answer `txn` before Redis has it: it joins the write-behind queue."""
        written, moment = txn.cached_writes()
        behind.queue(txn)
        self.cache.wrote(written, moment, txn.emptied)

    def _change_for_loop(self, change: Callable[[_Change], T], pending: list[_Change]) -> T:
        """(`change_on_loop`) Run `change` from the cache; its commit joins `pending`."""
        if pending:  # (a second change would read the first one's writes before they land)
            raise RoundTripNeeded
        with self.client.pipeline(transaction=True) as pipe:  # (no round trip: never used)
            txn = _Change(self, pipe)
            try:
                result = change(txn)
            except RoundTripNeeded:
                raise
            except Exception:
                raise RoundTripNeeded from None
        txn.function = change
        pending.append(txn)
        return result

    def read(self, family: str, records: list[bytes], cached: bool = True
             ) -> list[bytes | None]:
        """Records (their Redis keys) of one family: what this host answered ahead of Redis
        (write-behind), then from the cache where it has them (`cached`: for a change, whose
        commit checks them), the rest in one round trip. The write-behind sender reads
        Redis alone."""
        ahead, kept = self._known_here(family)
        if not ahead and not kept:
            return self._fetch(records)
        found: list[Cached] = [_Cached.MISS] * len(records)
        if ahead:
            found = [ahead.get(record, _Cached.MISS) for record in records]
        if kept and cached:
            found = [self.cache.get(record) if value is _Cached.MISS else value
                     for record, value in zip(records, found, strict=True)]
        missing = [record for record, value in zip(records, found, strict=True)
                   if value is _Cached.MISS]
        if not missing:
            return cast("list[bytes | None]", found)
        moment = self.cache.changes
        fetched = self._fetch(missing)
        if kept:
            self.cache.keep(missing, fetched, moment)
        by_record = dict(zip(missing, fetched, strict=True))
        return [by_record[record] if value is _Cached.MISS else value
                for record, value in zip(records, found, strict=True)]

    def _known_here(self, family: str) -> tuple[dict[bytes, bytes | None], bool]:
        """(this host's records answered ahead of Redis, whether the cache keeps `family`):
        neither on the write-behind sender, which reads Redis as it is."""
        behind = self.behind
        if behind is None:
            return {}, self.cache.cacheable(family)
        if behind.on_sender():
            return {}, False
        return behind.records, self.cache.cacheable(family)

    @contextmanager
    def from_memory(self) -> Iterator[None]:
        self._memory_only.on = True
        try:
            yield
        finally:
            self._memory_only.on = False

    def round_trip_allowed(self) -> None:
        if getattr(self._memory_only, "on", False):
            raise RoundTripNeeded

    def _fetch(self, records: list[bytes]) -> list[bytes | None]:
        if len(records) == 1:
            return [_reply(self.call(self.client.get, records[0]))]
        return _replies(self.call(self.client.mget, records)) if records else []

    def read_through(self, family: str, key: bytes, to_family: str, cached: bool = True
                     ) -> tuple[bytes | None, bytes | None]:
        """A record and the `to_family` record its value's first 8 bytes name (a name's
        entry and its inode): from the cache (`cached`, as in `read`), or in one round trip
        (a script)."""
        record = _record_key(family, key)
        ahead, kept = self._known_here(family)
        entry = ahead.get(record, _Cached.MISS)
        if entry is _Cached.MISS and kept and cached:
            entry = self.cache.get(record)
        if entry is not _Cached.MISS:
            if entry is None:
                return None, None
            return entry, self.read(to_family, [_record_key(to_family, bytes(entry[:8]))],
                                    cached)[0]
        prefix = _record_key(to_family, b"")
        moment = self.cache.changes
        fetched, referred = self.call(self.lookup_script, [record], [prefix])
        if kept:
            self.cache.keep([record], [fetched], moment)
        if fetched is None:
            return None, None
        inode = prefix + bytes(fetched[:8])
        if inode in ahead:  # (this host changed the inode ahead of Redis)
            return fetched, ahead[inode]
        if kept and self.cache.cacheable(to_family):
            self.cache.keep([inode], [referred], moment)
        return fetched, referred

    def allocate(self, key: bytes, count: int) -> int:
        """Add `count` to the counter `key`; returns its new value."""
        return self.call(self.client.hincrby, _counter_key("counters"), key, count)

    def has_room(self) -> bool:
        """Below Redis's maxmemory (if it has one), with room left for removals: as the
        watcher last found it (`_check_room`, every ROOM_CHECK_SECONDS), else checked here
        (a round trip) once that is twice as old."""
        checked, room = self._room
        if time.monotonic() - checked > 2 * ROOM_CHECK_SECONDS:
            self._check_room()
            room = self._room[1]
        return room

    def _check_room(self) -> None:
        memory = self.call(self.client.info, "memory")
        limit = memory.get("maxmemory", 0)
        self._room = (time.monotonic(), not limit or memory["used_memory"] < ROOM_SHARE * limit)

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until Redis has every change answered so far (write-behind; not while Redis
        cannot be reached); Redis persists them by its own settings (the README says which
        kvfs needs)."""
        if self.behind is None:
            return True
        return self.behind.settle(timeout) if timeout is not None else self.behind.sent()

    # -- write-behind ----------------------------------------------------------------------

    def write_behind(self, gather_seconds: float, sync_volume: Callable[[], None],
                     journal: Path) -> WriteBehind[_Change]:
        self.behind = WriteBehind(self, gather_seconds, sync_volume, ChangeLog(journal))
        return self.behind

    def replay_behind(self, directory: Path, sender: bytes, same_boot: bool
                      ) -> tuple[int, int]:
        """Apply what the write-behind journal in `directory` (a dead session's, whose engine
        id was `sender`) holds past the last batch Redis took from it, in batches checked
        and announced as that sender's (sent again, a batch applies nothing twice: two
        reapers may do this at once); then delete the journal. Returns (applied, not
        applied): stale ones (another host changed what they read), or every one if the
        journal comes from another boot (it and the data it names may have lost their
        tail). Changes its host sent meanwhile (it was only stalled) are neither."""
        journal = ChangeLog(directory)
        first = journal.first()
        if first is None:
            return 0, 0
        marker = _reply(self.call(self.client.get, _batch_marker(sender)))
        sent = int(marker.split(b":")[0]) if marker else 0
        records = [(seq, payload) for seq, payload, _ in journal.records(max(sent, first - 1))]
        answers: Counter[int] = Counter()
        for start in range(0, len(records) if same_boot else 0, REPLAY_BATCH):
            part = records[start:start + REPLAY_BATCH]
            changes = [_Change.from_journal(self, payload, sender) for _, payload in part]
            answers.update(self.commit_batch(changes, b"%d" % part[-1][0], sender))
        journal.drop_all()
        return answers[APPLIED], len(records) - answers[APPLIED] - answers[TAKEN]

    def caught_up(self) -> None:
        """Before a change made the long way, or a read of what a scan or a counter sums
        up: the write-behind queue in Redis (EIO if it cannot get there)."""
        if self.behind is not None and not self.behind.sent():
            raise fail(errno.EIO)  # (the queue waits until Redis is back)

    def unreachable(self) -> bool:
        """Whether the last request found Redis unreachable (for DOWN_SECONDS)."""
        return time.monotonic() < self._down_until

    def commit_batch(self, batch: list[_Change], token: bytes, sender: bytes | None = None
                     ) -> list[int]:
        """Check and apply `batch` in order, in one script call: APPLIED, STALE or TAKEN
        (sent already under this sender's name, COMMIT_SCRIPT) per change.
        Sent again with the same `token` (after a reply that never came), it answers as the
        first time, applying nothing twice. `sender`: the engine whose batch it is (this
        one's, or a dead session's being replayed)."""
        keys, args = batched([change.script_call(with_writes=True) for change in batch],
                             _batch_marker(sender or self.id), token)
        return cast("list[int]", self.call(self._commit_packed, keys, args))

    def _commit_packed(self, keys: list[bytes], args: list[bytes | int]) -> object:
        """COMMIT_SCRIPT's call packed by hiredis in one step (redis-py encodes each argument
        in Python first, which would be most of the sender's time for a large batch)."""
        pool = self.client.connection_pool
        connection = pool.get_connection()
        try:
            for command in ((b"EVALSHA", self.commit_script.sha), (b"EVAL", COMMIT_SCRIPT)):
                connection.send_packed_command([packed_command(
                    (*command, len(keys), *keys, *args))])
                try:
                    return connection.read_response()
                except redis.exceptions.NoScriptError:
                    continue  # (the server lacks the script: send its source)
            raise AssertionError("EVAL answered NOSCRIPT")
        except (redis.ConnectionError, redis.TimeoutError):
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def forget_ahead(self, change: _Change) -> None:
        """What `change` wrote ahead of Redis, which Redis holds otherwise now: out of the
        cache (before its queued values stop answering reads)."""
        self.cache.drop(_record_key(family, key) for family, key in change.writes
                        if family in ANNOUNCED)

    def unsee_ahead(self, change: _Change) -> None:
        """... and the names and attributes it wrote out of this host's kernel (after)."""
        if self._changed is not None:
            for family, key in change.writes:
                if family in ANNOUNCED:
                    self._changed(family, key)

    def watch(self, changed: Callable[[str, bytes], None]) -> None:
        if self._watcher is not None:
            raise RuntimeError("this engine already watches other hosts' changes")
        self._changed = changed
        self._watcher = threading.Thread(target=self._listen, args=(changed,),
                                         name="kvfs-watch", daemon=True)
        self._watcher.start()

    def watching(self) -> bool:
        return self._subscribed

    def _listen(self, changed: Callable[[str, bytes], None]) -> None:
        """Subscribe to other hosts' announcements, again after each lost connection (what
        was published meanwhile is missed: `watching` says so until subscribed again)."""
        while not self._closing.is_set():
            pubsub = self.client.pubsub()
            try:
                pubsub.subscribe(self.channel)
                while not self._closing.is_set():
                    if time.monotonic() - self._room[0] > ROOM_CHECK_SECONDS:
                        with suppress(FsError):  # (so that no change makes the round trip)
                            self._check_room()
                    message = pubsub.get_message(timeout=WATCH_POLL_SECONDS)
                    if message is None:
                        continue
                    while message is not None:  # (the first at once, then what came since)
                        self._heard(message, changed)
                        message = pubsub.get_message(timeout=0)
                    self._closing.wait(WATCH_GATHER_SECONDS)
            except (redis.ConnectionError, redis.TimeoutError) as error:
                if self._subscribed:
                    log.warning("other hosts' changes no longer reach this host: %s", error)
                self._closing.wait(DOWN_SECONDS)
            finally:
                self._subscribed = False
                self.cache.enable(False)
                pubsub.close()

    def _heard(self, message: dict, changed: Callable[[str, bytes], None]) -> None:
        if message["type"] == "subscribe":  # also redis-py's own resubscribe
            # Redis answers again: requests no longer fail at once (the cache answers
            # lookups from now on, so opens must reach Redis too).
            self._came_back()
            self.cache.enable(True)
            self._subscribed = True
        elif message["type"] == "message":
            self._deliver(message["data"], changed)

    def _deliver(self, message: bytes, changed: Callable[[str, bytes], None]) -> None:
        if message.startswith(self.id):
            return  # this host's own kernel and cache saw its changes
        try:
            _, records = announced(message)
        except (KeyError, struct.error):
            log.error("an announcement that is not one: %r", message[:64])
            return
        self.cache.pushed([(_record_key(family, key), value)  # before the kernel re-asks
                           for family, key, value in records])
        for family, key, _ in records:
            try:
                changed(family, key)
            except Exception:
                log.exception("handling another host's change of %s %r failed", family, key)

    def close(self) -> None:
        if self.behind is not None:
            self.behind.close()
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=2 * WATCH_POLL_SECONDS)
        self.client.close()
        self.loop_connection.close()

    # -- sessions ------------------------------------------------------------------------

    def beat(self, session: bytes, ttl: float) -> None:
        self.call(self.client.set, PREFIX + b"beat:" + session, b"1", None,
                  int(ttl * 1000))

    def alive(self, session: bytes) -> bool:
        return bool(self.call(self.client.exists, PREFIX + b"beat:" + session))

    # -- scans ---------------------------------------------------------------------------

    def scan_stored(self, conn: redis.Redis | redis.client.Pipeline, family: str,
                    start: bytes) -> Iterator[tuple[bytes, bytes]]:
        """What Redis holds of `family` from `start`, in key order (for a partitioned
        family: up to the end of start's partition)."""
        self.caught_up()
        if family in PARTITIONED or family in INDEXED:
            streams = [self._walk_set(conn, set_key, family, start)
                       for set_key in _set_keys(family, start)]
            yield from streams[0] if len(streams) == 1 else heapq.merge(*streams)
            return
        keys = sorted(key[len(_record_key(family, b"")):] for key in self.call(
            lambda: list(self.client.scan_iter(match=_record_key(family, b"*"), count=1000))))
        keys = [key for key in keys if key >= start]
        for first in range(0, len(keys), PAGE):
            page = keys[first:first + PAGE]
            values = _replies(self.call(self.client.mget,
                                        [_record_key(family, k) for k in page]))
            yield from ((k, v) for k, v in zip(page, values, strict=True) if v is not None)

    def _walk_set(self, conn: redis.Redis | redis.client.Pipeline, set_key: bytes,
                  family: str, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        low = b"[" + start
        while True:
            keys = _keys(self.call(conn.zrangebylex, set_key, low, b"+", 0, PAGE))
            if not keys:
                return
            values = _replies(self.call(conn.mget, [_record_key(family, key) for key in keys]))
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    yield key, value
            if len(keys) < PAGE:
                return
            low = b"(" + keys[-1]
