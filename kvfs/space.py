"""The pool's capacity: accounting, least-recently-used eviction, pins, recency.

One capacity for everything written through the mount, whoever writes it. Used bytes are the
committed blobs (kept in the metadata store) plus what open write handles have staged. The
effective capacity is the configured one, or less when the volume itself has less room.

Eviction drops least-recently-used committed files. It never takes a file that is open, that
carries the `user.kvfs.pin` attribute or lies below a directory that does. Uses are recorded
in memory and flushed to the metadata store every second and before each eviction. A
background task keeps usage between the watermarks so writers rarely wait; a writer that
still finds no room evicts inline and fails with ENOSPC only when nothing evictable is left.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import trio

from kvfs.meta import ROOT_INO, Inode, MetaStore, fail
from kvfs.stats import Stats

log = logging.getLogger(__name__)

HIGH_WATERMARK = 0.95  # background eviction starts above this share of the capacity
LOW_WATERMARK = 0.90  # ... and stops here
VOLUME_RESERVE = 64 << 20  # left free on the volume for metadata growth ...
VOLUME_RESERVE_SHARE = 0.05  # ... or this share of a small volume
EVICTION_BATCH = 64
TICK_SECONDS = 0.25
RECENCY_FLUSH_SECONDS = 1.0
SLACK_SECONDS = 0.1


class Space:
    def __init__(self, meta: MetaStore, volume: Path, stats: Stats,
                 is_open: Callable[[int], bool], on_evicted: Callable[[Inode], None]) -> None:
        self.meta = meta
        self.volume = volume
        self.stats = stats
        self.is_open = is_open
        self.on_evicted = on_evicted
        self.inflight = 0  # bytes staged by open write handles
        self._uses: dict[int, int] = {}  # ino -> last use (ns), not yet in the metadata store
        # Room measured by the last full check, spent by later reservations until it runs out
        # or gets old (the volume's free space can change behind our back).
        self._slack = 0
        self._slack_until = 0.0

    # -- accounting ----------------------------------------------------------------------

    def used(self) -> int:
        return self.meta.usage().used + self.inflight

    def capacity(self) -> int:
        """The configured capacity, or what fits on the volume if that is less."""
        volume = os.statvfs(self.volume)
        reserve = min(VOLUME_RESERVE, int(volume.f_blocks * volume.f_frsize * VOLUME_RESERVE_SHARE))
        room = volume.f_bavail * volume.f_frsize - reserve
        return max(0, min(self.meta.capacity(), self.used() + room))

    def reserve(self, growth: int) -> None:
        """Make room for `growth` more bytes, evicting if needed; ENOSPC if impossible."""
        if growth <= 0:
            return
        if growth <= self._slack and time.monotonic() < self._slack_until:
            self._slack -= growth  # room known to be there: no statvfs, no metadata read
            return
        capacity = self.capacity()
        if self.used() + growth > capacity and not self.evict_to(capacity - growth):
            raise fail(errno.ENOSPC)
        self._slack = capacity - self.used() - growth
        self._slack_until = time.monotonic() + SLACK_SECONDS

    # -- recency -------------------------------------------------------------------------

    def touch(self, ino: int) -> None:
        self._uses[ino] = time.time_ns()

    def flush_uses(self) -> None:
        if self._uses:
            uses, self._uses = self._uses, {}
            self.meta.touch(uses)

    # -- eviction ------------------------------------------------------------------------

    def evict_to(self, target: int) -> bool:
        """Evict least-recently-used files until used <= target; False if it cannot."""
        self.flush_uses()  # eviction order must include the latest uses
        position = b""
        pinned = self.meta.pinned()
        while self.used() > target:
            batch = self.meta.least_recent(EVICTION_BATCH, position)
            if not batch:
                return False
            position = batch[-1][0]
            for _, inode in batch:
                if self.used() <= target:
                    break
                if self._evictable(inode, pinned):
                    self._evict(inode)
        return True

    def _evictable(self, inode: Inode, pinned: set[int]) -> bool:
        if self.is_open(inode.ino):
            return False
        ino = inode.ino
        while True:
            if ino in pinned:
                return False
            if ino == ROOT_INO:
                return True
            ino = self.meta.get(ino).parent if ino != inode.ino else inode.parent

    def _evict(self, inode: Inode) -> None:
        dropped = self.meta.drop_file(inode.ino)
        if dropped is not None:
            self.stats.evictions += 1
            log.debug("evicted %r (ino %d, %d bytes)", dropped.name, dropped.ino, dropped.size)
            self.on_evicted(dropped)

    def trim(self) -> bool:
        """Above the high watermark, evict down to the low one; False if pins prevent it."""
        capacity = self.capacity()
        if self.used() <= HIGH_WATERMARK * capacity:
            return True
        return self.evict_to(int(LOW_WATERMARK * capacity))

    async def run(self) -> None:
        """Background upkeep: stay under the high watermark, flush recorded uses."""
        last_flush = time.monotonic()
        while True:
            await trio.sleep(TICK_SECONDS)
            self.trim()
            if time.monotonic() - last_flush >= RECENCY_FLUSH_SECONDS:
                self.flush_uses()
                last_flush = time.monotonic()
