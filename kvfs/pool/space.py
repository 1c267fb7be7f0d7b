"""The pool's capacity: accounting, least-recently-used eviction, pins, recency.

One capacity for everything written through the mount, whoever writes it. Used bytes are the
bytes committed blobs take on the volume (kept in the metadata store; holes take none) plus
the room each host claims for what its writers stage: a claim is checked against the
capacity and granted in one step of the metadata engine, in granules, so hosts writing at
once never together pass the capacity; a commit gives back what its file staged in its own
change, and an idle host gives back the rest. The effective capacity is the configured one,
or less when the volume itself has less room.

Eviction drops least-recently-used files, with all their names. It never takes a file that is
open (in a shared pool: on any host), that carries the `user.kvfs.pin` attribute or has a
name below a directory that does.
A request that needs room first chooses its victims (in a worker thread) and evicts them only
if they free enough: a request that cannot fit fails with ENOSPC and evicts nothing. Uses are
recorded in memory and flushed to the metadata store every second and before each eviction.
A background task keeps usage between the watermarks so writers rarely wait. Metadata
transactions and scans run in worker threads, never on the request loop (kvfs/meta/calls.py).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from kvfs.meta import ROOT_INO, Inode, MetaStore, Removed, Usage
from kvfs.meta.calls import MetaCalls, off_loop
from kvfs.observe.stats import Stats
from kvfs.pool.sessions import RELEASE_RETRY_SECONDS, Session
from kvfs.records import FsError, fail

log = logging.getLogger(__name__)

HIGH_WATERMARK = 0.95  # background eviction starts above this share of the capacity
LOW_WATERMARK = 0.90  # ... and stops here
VOLUME_RESERVE = 64 << 20  # left free on the volume for metadata growth ...
VOLUME_RESERVE_SHARE = 0.05  # ... or this share of a small volume
EVICTION_BATCH = 64
TICK_SECONDS = 0.25
RECENCY_FLUSH_SECONDS = 1.0
USES_PER_CHANGE = 64  # uses recorded in one metadata change (on the embedded engine: on the loop)
KERNEL_SHARE_SECONDS = 0.1  # how long the capacity read for kernel writers' share is used
# A claim takes at least this share of the capacity, within bounds: writers claim once per
# many writes, and an idle host gives its spare back (`give_back`).
GRANULE_SHARE = 1 / 64
GRANULE_MIN = 1 << 20
GRANULE_MAX = 64 << 20
EVICTION_ATTEMPTS = 3  # victims opened between choice and eviction are spared: choose again
# Holds that hosts could not release while the metadata was away are released again within
# this long of its return (kvfs/pool/sessions.py); until then they keep their files.
RELEASES_SETTLE_SECONDS = 2 * RELEASE_RETRY_SECONDS
# Room held for a writer whose writes kvfs does not see (passthrough) until its close: twice
# the largest file of the last commits, within these bounds (before any commit, FIRST) ...
KERNEL_WRITER_RESERVE_MAX = 256 << 20
KERNEL_WRITER_RESERVE_FIRST = 64 << 20
KERNEL_WRITER_RESERVE_MIN = 1 << 20
KERNEL_WRITER_SIZES_KEPT = 64
# ... and all of them together at most this share of the capacity: a reservation may evict,
# and many open writers (held open, or small files from many threads) must not empty the pool
# for room they will not use. Writers beyond it are served by the daemon, each write counted.
KERNEL_WRITER_SHARE = 1 / 16


class Space:
    def __init__(self, meta: MetaStore, volume: Path, stats: Stats, session: Session,
                 open_inodes: Callable[[], frozenset[int]],
                 evicted: Callable[[list[Removed]], Awaitable[None]],
                 deletions_done: Callable[[], Awaitable[bool]]) -> None:
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.session = session
        self.volume = volume
        self.stats = stats
        self.open_inodes = open_inodes  # a snapshot, taken on the loop
        self.evicted = evicted  # retires the victims (kvfs/files/retiring.py)
        # ... and waits until removed files' data has left the volume (whether any had not)
        self.deletions_done = deletions_done
        # This host's claim on the pool's room (in the metadata, `MetaStore.pool.claim`) is
        # what its writers staged, what changes under way reserved, and the spare rest.
        self.staged = 0  # bytes this host's open write handles have staged (and reserved)
        self.kernel_reserved = 0  # ... of which held for kernel writers
        self._reserved = 0
        self._spare = 0  # (negative: the kernel wrote more than its writers reserved)
        self._claim_used = False  # staged into since the claim was last ended
        self._granule = GRANULE_MIN
        self._claiming = trio.Lock()
        self._lost = False  # the claim is to be made again under a new session
        self._committed_sizes: deque[int] = deque(maxlen=KERNEL_WRITER_SIZES_KEPT)
        self._uses: dict[int, int] = {}  # ino -> last use (ns), not yet in the metadata store
        self._kernel_share = 0  # room kernel writers may hold together (last known capacity)
        self._kernel_share_until = 0.0
        # the read of the room on its way, and its answer once there (`_read_room`)
        self._room_read: tuple[trio.Event, list[tuple[Usage, int]]] | None = None
        self._evicting = trio.Lock()
        self._flushing = trio.Lock()
        self._pinned_warning = False

    # -- accounting ----------------------------------------------------------------------

    async def used(self) -> int:
        """Bytes committed, and claimed by every host for its writers: what eviction and a
        claim count."""
        return self._held(await self.meta_call(self.meta.recency.usage))

    def _held(self, usage: Usage) -> int:
        """`used`, of a read of the usage (and this host's writes past its claim)."""
        return usage.used + usage.claimed + max(0, -self._spare)

    async def capacity(self) -> int:
        return (await self.room())[0]

    async def room(self) -> tuple[int, int]:
        """(capacity, used bytes): the configured capacity, or what fits on the volume if
        that is less, and the bytes committed and claimed (all of every host's claims)."""
        usage, volume_room = await self._read_room()
        return _fitting(usage, volume_room, self._held(usage))

    async def shown(self) -> tuple[int, int]:
        """`room` as `df` and the stats show it: this host's writers count with what they
        staged and reserve, not with the spare room its claim holds for them."""
        usage, volume_room = await self._read_room()
        return _fitting(usage, volume_room, usage.used + usage.claimed - usage.claimed_here
                        + self.staged + self._reserved)

    async def _read_room(self) -> tuple[Usage, int]:
        """One statvfs and one metadata read (inline on one host, a worker's on a shared
        pool), shared by the callers that ask while it is on its way."""
        pending = self._room_read
        if pending is not None:
            done, answer = pending
            await done.wait()
            if answer:
                return answer[0]
            return await self.meta_call(self._usage_and_volume_room)  # (that one failed)
        done, answer = trio.Event(), []
        self._room_read = (done, answer)
        try:
            answer.append(await self.meta_call(self._usage_and_volume_room))
            return answer[0]
        finally:
            self._room_read = None
            done.set()

    def _volume_room(self) -> int:
        volume = os.statvfs(self.volume)
        reserve = min(VOLUME_RESERVE, int(volume.f_blocks * volume.f_frsize * VOLUME_RESERVE_SHARE))
        return volume.f_bavail * volume.f_frsize - reserve

    def _usage_and_volume_room(self) -> tuple[Usage, int]:
        return self.meta.recency.usage(), self._volume_room()

    async def reserve(self, growth: int) -> None:
        """Make room for `growth` more bytes, evicting only if that makes it fit; ENOSPC
        (evicting nothing) if it cannot. The room comes from this host's claim, claimed
        further when it runs out; the caller's `stage` says what was used of it."""
        if growth <= 0:
            return
        if growth > self._spare:
            await self._claim_for(growth)
        else:
            self._take(growth)

    def _take(self, growth: int) -> None:
        self._spare -= growth
        self._reserved += growth

    async def _claim_for(self, growth: int) -> None:
        """Claim room until this host's spare claim covers `growth` (a granule more where
        the pool has it), and take it; evict what that takes, or ENOSPC."""
        async with self._claiming:
            await self._claim_again()
            evictions, deletions_waited = 0, False
            while growth > self._spare:
                need = growth - self._spare
                amount = max(need, self._granule)
                granted, capacity, used = await self._claim_room(amount)
                if not granted and amount > need:
                    amount = need
                    granted, capacity, used = await self._claim_room(need)
                self._granule = max(GRANULE_MIN, min(GRANULE_MAX, int(capacity * GRANULE_SHARE)))
                if granted:
                    self._spare += amount
                    continue
                if need > capacity:
                    raise fail(errno.ENOSPC)
                if not deletions_waited and await self.deletions_done():
                    deletions_waited = True  # (the room of files removed just now)
                    continue
                # (another host may take what an eviction freed before this claim does)
                if evictions == EVICTION_ATTEMPTS or not await self._evict_for(capacity - need):
                    raise fail(errno.ENOSPC)
                evictions += 1
            self._take(growth)

    async def _claim_room(self, amount: int) -> tuple[bool, int, int]:
        """(Under `_claiming`) `_claim`; where a reaper ended this host's session (it was
        stalled past the session TTL), once more when it has registered again."""
        try:
            return await self.meta_call(self._claim, amount)
        except FsError as error:
            if error.errno != errno.ESTALE:
                raise
        await self.session.catch_up()
        await self._claim_again()
        return await self.meta_call(self._claim, amount)

    def _claim(self, amount: int) -> tuple[bool, int, int]:
        """Claim `amount` bytes (worker): granted where the pool and the volume have them;
        (granted, effective capacity, bytes committed and claimed)."""
        volume_room = self._volume_room()
        granted, capacity, used = self.meta.pool.claim(amount if amount <= volume_room else 0)
        return granted and amount <= volume_room, min(capacity, used + volume_room), used

    async def _claim_again(self) -> None:
        """(Under `_claiming`) After this host rejoined a shared pool under a new session,
        claim there what it holds: the reaper ended the old session's claim."""
        if not self._lost:
            return
        held = self.staged + self._reserved + self._spare
        await self.meta_call(self.meta.pool.add_claim, held)
        self._lost = False

    def session_lost(self) -> None:
        """This host was declared dead and rejoined (kvfs/pool/sessions.py): its claim went
        with its old session."""
        self._lost = True

    async def give_back(self) -> None:
        """Give back spare room: all of it once no writer stages or reserves any (which also
        mends a claim that a commit of unknown outcome left off), else what exceeds two
        granules."""
        async with self._claiming:
            await self._claim_again()
            if self.staged == 0 and self._reserved == 0:
                if self._spare or self._claim_used:
                    self._spare = 0
                    self._claim_used = False
                    await self.meta_call(self.meta.pool.end_claim)
            elif self._spare > 2 * self._granule:
                excess = self._spare - self._granule
                self._spare -= excess
                try:
                    await self.meta_call(self.meta.pool.claim, -excess)
                except FsError as error:  # (ESTALE: the claim went with the session)
                    if error.errno != errno.ESTALE:
                        raise

    async def _evict_for(self, target: int) -> bool:
        """`evict_to(target)`; if that fails just after the metadata came back from an
        outage, once more when the holds released meanwhile have been recorded."""
        if await self.evict_to(target):
            return True
        back_at = self.meta.engine.back_at
        wait = back_at + RELEASES_SETTLE_SECONDS - time.monotonic()
        if not back_at or wait <= 0:
            return False
        await trio.sleep(wait)
        return await self.evict_to(target)

    async def reserve_for_kernel_writer(self) -> int:
        """Room for a passthrough writer, reserved (and counted as staged) until it closes;
        0 where that is not to be had, or would take kernel writers past their share of the
        pool: then kvfs serves the writes and accounts each one exactly."""
        if time.monotonic() >= self._kernel_share_until:
            self._kernel_share = int(await self.capacity() * KERNEL_WRITER_SHARE)
            self._kernel_share_until = time.monotonic() + KERNEL_SHARE_SECONDS
        size = self.kernel_writer_reserve()
        if self.kernel_reserved + size > self._kernel_share:
            return 0
        try:
            await self.reserve(size)
        except FsError:
            return 0
        self.stage(size, reserved=size)
        self.kernel_reserved += size
        return size

    def kernel_writer_reserve(self) -> int:
        """What a kernel writer reserves: twice the largest recent file, within bounds."""
        if not self._committed_sizes:
            return KERNEL_WRITER_RESERVE_FIRST
        return min(KERNEL_WRITER_RESERVE_MAX,
                   max(KERNEL_WRITER_RESERVE_MIN, 2 * max(self._committed_sizes)))

    def kernel_writer_closed(self, reserved: int) -> None:
        self.unstage(reserved)
        self.kernel_reserved -= reserved

    def committed(self, size: int) -> None:
        """A writer committed a file of `size` bytes: sizes kernel writers reserve for."""
        self._committed_sizes.append(size)

    def stage(self, growth: int, reserved: int = 0) -> None:
        """A writer staged `growth` more bytes (negative: it shrank) with room it `reserved`;
        bytes beyond that (the kernel's writes, seen at the end) come from the spare claim."""
        self._reserved -= reserved
        self._spare += reserved - growth
        self.staged += growth
        self._claim_used = True

    def given_back(self, size: int) -> int:
        """The claim a commit of `size` staged bytes gives back in its change: all of it,
        unless this host's claim is to be made again under a new session."""
        return 0 if self._lost else size

    def unstage(self, size: int, given_back: int = 0) -> None:
        """Bytes staged here left: committed (the change gave back `given_back` of the
        claim: it is counted as committed now) or discarded (their room is spare again)."""
        self.staged -= size
        self._spare += size - given_back

    # -- recency -------------------------------------------------------------------------

    def note_use(self, ino: int) -> None:
        """A use of `ino` (lookup, open, read): kept in memory, recorded in batches."""
        now = time.time_ns()
        self._uses[ino] = now

    def take_uses(self) -> dict[int, int]:
        uses, self._uses = self._uses, {}
        return uses

    async def flush_uses(self) -> None:
        """Record the uses kept in memory. On the embedded engine the changes run on the
        loop, USES_PER_CHANGE at a time with a checkpoint between: thousands of uses at once
        would hold every request back meanwhile. One flush at a time: an eviction's
        flush returns once the uses taken before it are recorded too."""
        async with self._flushing:
            uses = list(self.take_uses().items())
            step = max(1, len(uses)) if self.meta_call.blocking else USES_PER_CHANGE
            for first in range(0, len(uses), step):
                try:
                    await self.meta_call(self.meta.recency.record_uses,
                                         dict(uses[first:first + step]))
                except BaseException:  # kept for the next flush (a shared engine may be busy)
                    for ino, used_ns in uses[first:]:
                        self._uses[ino] = max(used_ns, self._uses.get(ino, 0))
                    raise
                await trio.lowlevel.checkpoint()

    # -- eviction ------------------------------------------------------------------------

    async def evict_to(self, target: int, partial: bool = False) -> bool:
        """Evict least-recently-used files until used <= target. If that is impossible,
        evict nothing and return False (with `partial`, evict what can be)."""
        async with self._evicting:
            await self.flush_uses()  # eviction order must include the latest uses
            for _ in range(EVICTION_ATTEMPTS):
                need = await self.used() - target
                if need <= 0:
                    return True
                victims, enough = await off_loop(self._choose, need, self.open_inodes())
                if not enough and not partial:
                    return False
                open_now = self.open_inodes()
                spared = [ino for ino in victims if ino not in open_now]  # opened meanwhile
                dropped = await self.meta_call(self.meta.content.drop_files, spared,
                                               self.session.shared)
                for removed in dropped:
                    self.stats.evictions += 1
                    self.stats.evicted_bytes += removed.inode.allocated
                    # (a store sets the file's last use to its commit: no use came after it)
                    if removed.inode.atime_ns <= removed.inode.mtime_ns:
                        self.stats.evicted_unused_bytes += removed.inode.allocated
                    log.debug("evicted %r (ino %d, %d bytes)", removed.inode.name,
                              removed.inode.ino, removed.inode.allocated)
                await self.evicted(dropped)
                if not enough:
                    return False
            return await self.used() <= target

    def _choose(self, need: int, open_inodes: frozenset[int]) -> tuple[list[int], bool]:
        """Least-recently-used evictable files that free `need` bytes (worker thread), none
        of `open_inodes`; returns them and whether they free enough."""
        pinned = self.meta.recency.pinned()
        victims: list[int] = []
        freed, position = 0, b""
        while freed < need:
            batch = self.meta.recency.least_recent(EVICTION_BATCH, position)
            if not batch:
                return victims, False
            position = batch[-1][0]
            for _, inode in batch:
                if inode.ino not in open_inodes and self._evictable(inode, pinned):
                    victims.append(inode.ino)
                    freed += inode.allocated
                    if freed >= need:
                        break
        return victims, True

    def _evictable(self, inode: Inode, pinned: set[int]) -> bool:
        if inode.ino in pinned:
            return False
        if self.session.shared and any(holder != self.session.id
                                       for holder in self.meta.pool.holders(inode.blob)):
            # Open on another host. This host's opens are `open_inodes`; a hold of its own
            # beyond them is a release still on its way (Redis unreachable meanwhile).
            return False
        parents = [inode.parent] if inode.nlink <= 1 else [
            parent for parent, _ in self.meta.namespace.names(inode.ino)]
        for ino in parents:
            while True:
                if ino in pinned:
                    return False
                if ino == ROOT_INO:
                    break
                ino = self.meta.namespace.get(ino).parent
        return True

    async def trim(self) -> None:
        """Above the high watermark, evict down to the low one (as far as pins allow)."""
        capacity, used = await self.room()
        if used <= HIGH_WATERMARK * capacity:
            return
        reached = await self.evict_to(int(LOW_WATERMARK * capacity), partial=True)
        if not reached and not self._pinned_warning:
            log.warning("pinned and open files alone exceed the capacity")
        self._pinned_warning = not reached

    async def run(self) -> None:
        """Background upkeep: stay under the high watermark, flush recorded uses. A failure
        is logged and counted, and the next tick tries again."""
        last_flush = time.monotonic()
        while True:
            try:
                await self.trim()
                if time.monotonic() - last_flush >= RECENCY_FLUSH_SECONDS:
                    last_flush = time.monotonic()
                    await self.flush_uses()
                await self.give_back()
            except Exception:
                self.stats.background_errors += 1
                log.exception("space upkeep failed")
            await trio.sleep(TICK_SECONDS)


def _fitting(usage: Usage, volume_room: int, used: int) -> tuple[int, int]:
    """(capacity in effect, `used`): the configured one, or what fits on the volume."""
    return max(0, min(usage.capacity, used + volume_room)), used
