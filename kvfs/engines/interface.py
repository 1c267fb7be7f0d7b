"""Metadata engines: where the metadata store (kvfs/meta/) keeps its records.

An engine offers ordered families of byte keys and values, read in snapshots and changed in
transactions, and nothing about files: the namespace logic is written once, over `Txn`, in
kvfs/meta/ (JuiceFS's transactional key-value engines are the model). This module is the
interface alone; the engines are the embedded one, LMDB on the volume (kvfs/engines/lmdb_engine.py),
and the shared one, Redis (kvfs/engines/redis_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

# The pool's room, as engines check claims on it (kvfs/pool/space.py): bytes committed blobs
# take (counter USED_BYTES) plus every host's claim (counters CLAIM_PREFIX + its session), at
# most the capacity (settings CAPACITY, a big-endian u64).
USED_BYTES = b"used_bytes"
CLAIM_PREFIX = b"claim:"
CAPACITY = b"capacity"


def claims_total(counters: dict[bytes, int]) -> int:
    """The bytes every host's claims hold, from the counters."""
    return sum(value for key, value in counters.items() if key.startswith(CLAIM_PREFIX))


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

    def count(self, family: str, key: bytes) -> int:
        """A counter's value (0 if never added to); not read inside a change, so that hot
        counters never make changes conflict."""
        ...

    def counts(self, family: str) -> dict[bytes, int]: ...

    def add(self, family: str, key: bytes, delta: int) -> None: ...


class Engine(Protocol):
    shared: bool  # whether other hosts use the same metadata at the same time
    conflicts: int  # changes run again because another change got in their way
    back_at: float  # when it last answered again after an outage (time.monotonic; 0: never)

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

    def claim(self, session: bytes, amount: int, live_mark: bytes | None = None
              ) -> tuple[bool, int, int]:
        """Add `amount` to `session`'s claim on the pool's room at once, outside any change,
        if committed bytes and every claim then stay within the capacity (a negative amount
        always does); returns (granted, capacity, committed bytes and claims before).
        ESTALE, claiming nothing, where the setting `live_mark` is given and absent (a
        reaper ended the session: its claim went with it)."""
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

    @property
    def loop_drops(self) -> dict[str, int]:
        """Times the loop's own connection was dropped, by cause."""
        ...

    async def change_on_loop(self, function: Callable[[], T]) -> T:
        """Call `function`, which makes one change and has no other effects (it may run
        twice), committing from the loop; RoundTripNeeded where a worker must call it."""
        ...


class RoundTripNeeded(Exception):
    """A read inside `Engine.from_memory` that only a round trip can answer (or a change
    that `LoopChanges.change_on_loop` leaves to a worker)."""


class ChangesPending(Exception):
    """The engine refused room for growth, but holds answered changes it has not applied
    yet (removals among them may free room): wait for them off the loop, then try again."""


def get_through(txn: Txn, family: str, key: bytes, to_family: str
                ) -> tuple[bytes | None, bytes | None]:
    """`Txn.get_through` as two reads (where a read costs no round trip)."""
    record = txn.get(family, key)
    return record, None if record is None else txn.get(to_family, bytes(record[:8]))

