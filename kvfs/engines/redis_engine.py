"""The shared metadata engine: Redis, for a pool that several hosts mount at once.

The same families of ordered byte keys as the embedded engine (kvfs/engines/lmdb_engine.py),
laid out so that hosts rarely contend (JuiceFS on Redis is the model): the key layout, the
commit script and the announcements' format are in kvfs/engines/redis_layout.py, each host's
cache of records in kvfs/engines/redis_cache.py.

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

Every round trip has a deadline (`deadline`, the mount's --deadline): half of it for Redis's
answer, over two attempts (a third of each to connect), the other half for the wait of a
request for a worker thread (kvfs/meta/calls.py); a commit from the loop gets the same half.
When Redis cannot be reached or does not answer within it, the request fails with EIO
(counted: `timeouts`, `unreachable`), and requests fail at once for the next half second;
the pool of connections reconnects when Redis is back.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import random
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import TypeVar, cast
from urllib.parse import urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from kvfs.engines.interface import CAPACITY, CLAIM_PREFIX, RoundTripNeeded
from kvfs.engines.redis_cache import Cached, NotCached, RecordCache
from kvfs.engines.redis_change import Change, Reader
from kvfs.engines.redis_layout import (
    ALLOCATE_SCRIPT,
    CHANGES_CHANNEL,
    CLAIM_SCRIPT,
    COMMIT_SCRIPT,
    DEFAULT_DEADLINE,
    ENGINE_ID_BYTES,
    INDEXED,
    LOOKUP_SCRIPT,
    PAGE,
    PARTITIONED,
    POOL_KEY,
    PREFIX,
    announced,
    counter_key,
    keys_of,
    record_key,
    replies,
    reply,
    set_keys,
)
from kvfs.engines.redis_loop import NOT_SERVING, LoopConnection, LoopConnectionError
from kvfs.records import FsError, fail

log = logging.getLogger(__name__)

T = TypeVar("T")
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
WATCH_POLL_SECONDS = 0.5  # how soon the watcher notices the engine closing
# After a wake-up the watcher lets announcements gather this long before it reads again: a
# storing host hears its own three per store, and each wake-up costs CPU and takes the GIL
# from the loop (a store's announcements are read in one wake-up instead; the
# first of a burst is still read at once).
WATCH_GATHER_SECONDS = 0.005


SENTINEL_SCHEME = "redis+sentinel"


def sentinel_address(url: str) -> tuple[list[tuple[str, int]], str, int]:
    """The sentinels, master name and database of a
    redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] address."""
    parsed = urlparse(url)
    try:
        sentinels = [(host, int(port)) for host, _, port in
                     (address.rpartition(":") for address in parsed.netloc.split(","))]
        master, _, db = parsed.path.strip("/").partition("/")
        if not master or not all(host for host, _ in sentinels):
            raise ValueError(url)
        return sentinels, master, int(db or 0)
    except ValueError:
        raise ValueError(f"not a {SENTINEL_SCHEME}://HOST:PORT[,HOST:PORT...]/MASTER[/DB] "
                         f"address: {url}") from None


class RedisEngine:
    """Metadata in a Redis server that every host of the pool reaches (see above)."""

    shared = True

    def __init__(self, url: str, deadline: float = DEFAULT_DEADLINE) -> None:
        self.url = url
        self.deadline = deadline
        attempt = deadline / 2 / ATTEMPTS
        connect, answer = attempt / 3, attempt * 2 / 3
        retry = Retry(ExponentialBackoff(cap=attempt / 10, base=0.02), ATTEMPTS - 1)
        parsed = urlparse(url)
        if parsed.scheme == SENTINEL_SCHEME:
            sentinels, master, db = sentinel_address(url)
            sentinel = Sentinel(sentinels, sentinel_kwargs={
                "socket_connect_timeout": connect, "socket_timeout": answer})
            self.client = sentinel.master_for(master, db=db, socket_connect_timeout=connect,
                                              socket_timeout=answer, retry=retry)
            self.loop_connection = LoopConnection(url, deadline / 2, db=db, locate=lambda:
                                                  sentinel.discover_master(master))
        elif parsed.scheme == "redis" and parsed.hostname:
            self.client = redis.Redis.from_url(url, socket_connect_timeout=connect,
                                               socket_timeout=answer, retry=retry)
            self.loop_connection = LoopConnection(url, deadline / 2)
        else:
            raise ValueError(f"not a redis://HOST:PORT/DB or {SENTINEL_SCHEME}://HOST:PORT"
                             f"[,HOST:PORT...]/MASTER[/DB] address: {url}")
        self._down_until = 0.0
        self.back_at = 0.0
        self.conflicts = 0
        self.timeouts = 0  # round trips Redis did not answer within the deadline
        self.unreachable = 0  # round trips refused: Redis down, or just found down
        self._room = (0.0, True)
        self._lock = threading.Lock()
        self.id = os.urandom(ENGINE_ID_BYTES)
        self.cache = RecordCache()
        self._memory_only = threading.local()  # `from_memory` on this thread
        self.channel = CHANGES_CHANNEL % self.client.get_connection_kwargs().get("db", 0)
        self._on_loop = threading.local()  # `pending`: changes `change_on_loop` will commit
        self.loop_commits = 0  # changes committed from the loop (`change_on_loop`)
        self.lookup_script = self.client.register_script(LOOKUP_SCRIPT)
        self.commit_script = self.client.register_script(COMMIT_SCRIPT)
        self.allocate_script = self.client.register_script(ALLOCATE_SCRIPT)
        self.claim_script = self.client.register_script(CLAIM_SCRIPT)
        self.pool_guard: bytes | None = None  # this mount's pool (`guard`): commits check it
        self.pool_lost = False  # Redis holds another pool, or none: nothing is served
        # Records this host alone writes (`own`), as it last wrote or read them: changes
        # read them without a round trip, and their commit script checks them.
        self._own: set[bytes] = set()
        self._owned: dict[bytes, bytes] = {}
        self._closing = threading.Event()
        self._subscribed = False
        self._watcher: threading.Thread | None = None
        self.call(self.client.ping)

    # -- errors --------------------------------------------------------------------------

    def call(self, method: Callable[..., T], *args: object) -> T:
        """One request; EIO (logged once per outage) when Redis cannot be reached, ENOSPC
        when it is past its maxmemory (it then refuses every write and script)."""
        self.round_trip_allowed()
        if self.pool_lost:
            raise fail(errno.EIO)
        if time.monotonic() < self._down_until:
            self.unreachable += 1
            raise fail(errno.EIO)
        try:
            result = method(*args)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            self._went_down(error, isinstance(error, redis.TimeoutError))
            raise fail(errno.EIO) from None
        except redis.exceptions.OutOfMemoryError:
            raise fail(errno.ENOSPC) from None
        except redis.ResponseError as error:
            if not str(error).startswith(NOT_SERVING):
                raise
            self._went_down(error, False)  # (not run: a replica, or a master short of them)
            raise fail(errno.EIO) from None
        if self._down_until:
            self._came_back()
        return result

    def _went_down(self, error: Exception, timed_out: bool) -> None:
        with self._lock:
            if timed_out:
                self.timeouts += 1
            else:
                self.unreachable += 1
            if not self._down_until:
                log.error("metadata engine %s unreachable: %s", self.url, error)
            self._down_until = time.monotonic() + DOWN_SECONDS

    def _came_back(self) -> None:
        with self._lock:
            if self._down_until:
                log.warning("metadata engine %s reachable again", self.url)
                self.back_at = time.monotonic()
            self._down_until = 0.0

    # -- the pool's identity --------------------------------------------------------------

    def identity(self) -> bytes | None:
        """The identity of the pool Redis holds: b"" for a pool without one, None if Redis
        holds no pool (no format record)."""
        held, pool = replies(self.call(self.client.mget,
                                       [record_key("settings", b"format"), POOL_KEY]))
        return None if held is None else pool or b""

    def claim_identity(self, candidate: bytes) -> bytes:
        """Give the pool Redis holds the identity `candidate` unless it has one (hosts that
        mount a new pool together agree); returns the pool's identity."""
        self.call(lambda: self.client.set(POOL_KEY, candidate, nx=True))
        return reply(self.call(self.client.get, POOL_KEY)) or candidate

    def guard(self, pool: bytes) -> None:
        """From now on every commit and id allocation checks that Redis holds `pool`."""
        self.pool_guard = pool

    def check_pool(self) -> None:
        """(Watcher, once a second, and before the cache is trusted again) Whether Redis
        still holds this mount's pool."""
        if (self.pool_guard is not None and not self.pool_lost
                and reply(self.call(self.client.get, POOL_KEY)) != self.pool_guard):
            self.lose_pool()

    def lose_pool(self) -> None:
        """Redis holds another pool or none (emptied by a restart without its files, a
        FLUSHALL, a failover to an empty replica): this mount can vouch for nothing it would
        read there, so every request fails EIO from now on."""
        with self._lock:
            if not self.pool_lost:
                log.error("metadata engine %s no longer holds this mount's pool: serving "
                          "nothing more; unmount every host, then run kvfs fsck --data DIR "
                          "--meta %s --repair", self.url, self.url)
            self.pool_lost = True
        self.cache.enable(False)

    # -- the Engine interface ------------------------------------------------------------

    def snapshot(self, cached: bool = False) -> Reader:
        return Reader(self, cached)

    def change(self, change: Callable[[Change], T]) -> T:
        pending = getattr(self._on_loop, "pending", None)
        if pending is not None:
            return self._change_for_loop(change, pending)
        return self._change(change)

    def _change(self, change: Callable[[Change], T]) -> T:
        deadline = time.monotonic() + CHANGE_SECONDS
        attempt = 0
        while True:
            with self.client.pipeline(transaction=True) as pipe:
                txn = Change(self, pipe)
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
            self._forget_owned(txn.read)
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
        if self.pool_lost:
            raise fail(errno.EIO)
        if time.monotonic() < self._down_until:
            self.unreachable += 1
            raise fail(errno.EIO)
        pending: list[Change] = []  # (the one change, once `function` has made it)
        self._on_loop.pending = pending
        try:
            with self.from_memory():
                result = function()
        finally:
            self._on_loop.pending = None
        if not pending:
            return result
        [txn] = pending
        try:
            await txn.commit_on_loop(self.loop_connection)
        except redis.WatchError:
            self.cache.drop(txn.read)
            self._forget_owned(txn.read)
            self.conflicts += 1
            raise RoundTripNeeded from None
        except LoopConnectionError as error:
            self._went_down(error, error.timed_out)
            raise fail(errno.EIO) from None
        self.loop_commits += 1
        if self._down_until:
            self._came_back()
        return result

    def _change_for_loop(self, change: Callable[[Change], T], pending: list[Change]) -> T:
        """(`change_on_loop`) Run `change` from the cache; its commit joins `pending`."""
        if pending:  # (a second change would read the first one's writes before they land)
            raise RoundTripNeeded
        with self.client.pipeline(transaction=True) as pipe:  # (no round trip: never used)
            txn = Change(self, pipe)
            try:
                result = change(txn)
            except RoundTripNeeded:
                raise
            except Exception:
                raise RoundTripNeeded from None
        pending.append(txn)
        return result

    def own(self, family: str, key: bytes, value: bytes) -> None:
        """`family`'s record `key` is this host's alone to write, and holds `value`."""
        record = record_key(family, key)
        self._own.add(record)
        self._owned[record] = value

    def _forget_owned(self, records: Iterable[bytes]) -> None:
        """(A change that read them conflicted) read them from Redis next time."""
        for record in records:
            self._owned.pop(record, None)

    def read(self, family: str, records: list[bytes], cached: bool = True
             ) -> list[bytes | None]:
        """Records (their Redis keys) of one family: from the cache where it has them
        (`cached`: for a change, whose commit checks them), the rest in one round trip."""
        if cached and self._owned and all(record in self._owned for record in records):
            return [self._owned[record] for record in records]
        kept = self.cache.cacheable(family)
        if not kept:
            fetched = self._fetch(records)
            for record, value in zip(records, fetched, strict=True):
                if record in self._own and value is not None:
                    self._owned[record] = value
            return fetched
        found: list[Cached] = [NotCached.MISS] * len(records)
        if cached:
            found = [self.cache.get(record) for record in records]
        missing = [record for record, value in zip(records, found, strict=True)
                   if value is NotCached.MISS]
        if not missing:
            return cast("list[bytes | None]", found)
        moment = self.cache.changes
        fetched = self._fetch(missing)
        self.cache.keep(missing, fetched, moment)
        by_record = dict(zip(missing, fetched, strict=True))
        return [by_record[record] if value is NotCached.MISS else value
                for record, value in zip(records, found, strict=True)]

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
            return [reply(self.call(self.client.get, records[0]))]
        return replies(self.call(self.client.mget, records)) if records else []

    def read_through(self, family: str, key: bytes, to_family: str, cached: bool = True
                     ) -> tuple[bytes | None, bytes | None]:
        """A record and the `to_family` record its value's first 8 bytes name (a name's
        entry and its inode): from the cache (`cached`, as in `read`), or in one round trip
        (a script)."""
        record = record_key(family, key)
        kept = self.cache.cacheable(family)
        entry: Cached = NotCached.MISS
        if kept and cached:
            entry = self.cache.get(record)
        if entry is not NotCached.MISS:
            if entry is None:
                return None, None
            return entry, self.read(to_family, [record_key(to_family, bytes(entry[:8]))],
                                    cached)[0]
        prefix = record_key(to_family, b"")
        moment = self.cache.changes
        fetched, referred = self.call(self.lookup_script, [record], [prefix])
        if kept:
            self.cache.keep([record], [fetched], moment)
        if fetched is None:
            return None, None
        inode = prefix + bytes(fetched[:8])
        if kept and self.cache.cacheable(to_family):
            self.cache.keep([inode], [referred], moment)
        return fetched, referred

    def allocate(self, key: bytes, count: int) -> int:
        """Add `count` to the counter `key` (in this mount's pool only); returns its new
        value."""
        value = self.call(self.allocate_script, [POOL_KEY, counter_key("counters")],
                          [self.pool_guard or b"", key, count])
        if value is None:
            self.lose_pool()
            raise fail(errno.EIO)
        return int(value)

    @property
    def loop_drops(self) -> dict[str, int]:
        return dict(self.loop_connection.drops)

    def claim(self, session: bytes, amount: int, live_mark: bytes | None = None
              ) -> tuple[bool, int, int]:
        mark = record_key("settings", live_mark or b"")
        answer = self.call(self.claim_script,
                           [POOL_KEY, counter_key("counters"), record_key("settings", CAPACITY),
                            mark],
                           [self.pool_guard or b"", CLAIM_PREFIX + session, amount,
                            b"1" if live_mark is not None else b""])
        if answer is None:
            self.lose_pool()
            raise fail(errno.EIO)
        granted, capacity, held = (int(value) for value in answer)
        if granted < 0:
            raise fail(errno.ESTALE)
        return bool(granted), capacity, held

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
        """Redis has every change answered (each is answered once it does); Redis persists
        them by its own settings (the README says which kvfs needs)."""
        return True

    def watch(self, changed: Callable[[str, bytes], None]) -> None:
        if self._watcher is not None:
            raise RuntimeError("this engine already watches other hosts' changes")
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
                            self.check_pool()
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
            # lookups from now on, so opens must reach Redis too), if it still holds the pool.
            self._came_back()
            with suppress(FsError):
                self.check_pool()
            if not self.pool_lost:
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
        self.cache.pushed([(record_key(family, key), value)  # before the kernel re-asks
                           for family, key, value in records])
        for family, key, _ in records:
            try:
                changed(family, key)
            except Exception:
                log.exception("handling another host's change of %s %r failed", family, key)

    def close(self) -> None:
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
        if family in PARTITIONED or family in INDEXED:
            streams = [self._walk_set(conn, index_set, family, start)
                       for index_set in set_keys(family, start)]
            yield from streams[0] if len(streams) == 1 else heapq.merge(*streams)
            return
        keys = sorted(key[len(record_key(family, b"")):] for key in self.call(
            lambda: list(self.client.scan_iter(match=record_key(family, b"*"), count=1000))))
        keys = [key for key in keys if key >= start]
        for first in range(0, len(keys), PAGE):
            page = keys[first:first + PAGE]
            values = replies(self.call(self.client.mget,
                                        [record_key(family, k) for k in page]))
            yield from ((k, v) for k, v in zip(page, values, strict=True) if v is not None)

    def _walk_set(self, conn: redis.Redis | redis.client.Pipeline, set_key: bytes,
                  family: str, start: bytes) -> Iterator[tuple[bytes, bytes]]:
        low = b"[" + start
        while True:
            keys = keys_of(self.call(conn.zrangebylex, set_key, low, b"+", 0, PAGE))
            if not keys:
                return
            values = replies(self.call(conn.mget, [record_key(family, key) for key in keys]))
            for key, value in zip(keys, values, strict=True):
                if value is not None:
                    yield key, value
            if len(keys) < PAGE:
                return
            low = b"(" + keys[-1]
