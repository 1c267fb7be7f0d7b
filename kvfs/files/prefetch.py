"""Prefetch from lookups: a prompt's chunks start loading when the engine looks them up.

LMCache's `fs` plugin `stat`s every chunk of a prompt at lookup time, in vLLM's scheduler, and
reads them when the model runner loads the request, a scheduling step or a queue wait later;
vLLM's own tier calls `exists()` per block the same way. kvfs sees those lookups. A lookup of
a stored chunk that is not wholly in memory queues it; a few chunks at a time, in lookup order
(the order the prompt is read), once the burst of lookups pauses, are read and verified in the
background by the same check an open makes (`Verifier.verify(force=True)`), which leaves them
in the page cache. An open that arrives meanwhile joins the check in flight; one that finds it
done passes straight through.
Where most readers are O_DIRECT (vLLM's tier), the page cache would not serve them: the
prefetch is the check alone, read with O_DIRECT, so that their opens need none (`--verify
once`; under `--verify open` every O_DIRECT open checks, and nothing is prefetched).
No byte reaches a reader unverified: a blob whose data file changed after its prefetch is
checked again at open by the usual rule.

Only loads: a lookup starts a prefetch only as part of a burst, the same process's second
lookup of a stored chunk within BURST_SECONDS: an engine looks up a prompt's chunks one after
another, while `stat` of a file by an operator is one lookup. Listings (`ls -l`, `du`,
`find`) mostly look nothing up (readdirplus carries the attributes), but where the kernel
kept a directory's listing and dropped its entries (memory pressure: a full run's `ls -lR`
over a million names prefetched 1 GiB of chunks), they look up every name in a burst: the
lookups of LISTING_TOOLS never prefetch. Chunks smaller than
MIN_BYTES are not worth it. The budget (`--prefetch`, 0 turns it off) caps the bytes queued
and in flight; lookups beyond it are not prefetched. Prefetched bytes that no reader opened
within WASTE_SECONDS count as wasted (`.kvfs/stats`).

In a shared pool each host prefetches into its own page cache; nothing is staged or counted
against the pool's capacity.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

import trio

from kvfs.caller import Caller
from kvfs.data.residency import wholly_resident
from kvfs.data.store import ChecksumError, DataStore
from kvfs.data.verify import Verifier, VerifyMode
from kvfs.meta import Inode, MetaStore
from kvfs.meta.calls import MetaCalls
from kvfs.observe.stats import Stats
from kvfs.pool.sessions import Session

log = logging.getLogger(__name__)

DEFAULT_BUDGET = 2 << 30  # bytes queued and in flight at most
CHUNKS_IN_FLIGHT = 4
MIN_BYTES = 1 << 20
BURST_SECONDS = 1.0
# Prefetch reads start once lookups pause this long: a burst of lookups (vLLM's scheduler
# checks every block of a prompt, one after another) runs at full speed, and the reads
# fill the gap before the loads instead of slowing every lookup of the burst (on a small
# machine reads beside the lookups take the CPUs the lookups need).
QUIET_SECONDS = 0.005
DEFER_SECONDS_MAX = 0.05  # ... but under lookups that never pause, one starts this often
WASTE_SECONDS = 60.0
PROCESSES_KEPT = 4096  # threads -> processes remembered (lookups come from a few engines)
# Commands that stat what they list and never load it (by the calling thread's name).
LISTING_TOOLS = frozenset({"ls", "du", "find", "stat", "tree", "ncdu", "gdu", "dust", "bfs",
                           "fd", "eza", "exa", "lsd", "rsync", "tar", "updatedb", "getfattr"})
DIRECT_WEIGHT = 0.25  # weight of each read open in the share of O_DIRECT readers


@dataclass(frozen=True, slots=True)
class Wanted:
    ino: int
    blob_id: int
    size: int


class Prefetcher:
    def __init__(self, meta: MetaStore, data: DataStore, verifier: Verifier, session: Session,
                 stats: Stats, budget: int) -> None:
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.verifier = verifier
        self.session = session
        self.stats = stats
        self.budget = budget
        self._queue: deque[Wanted] = deque()
        self._queued: set[int] = set()  # blobs queued or in flight
        self._committed_bytes = 0  # queued and in flight
        self._work = trio.Event()
        self._slots = trio.Semaphore(CHUNKS_IN_FLIGHT)
        self._last_lookup: dict[int, tuple[float, Wanted | None]] = {}  # process -> last hit
        # thread -> process (None: a listing tool's)
        self._processes: OrderedDict[int, int | None] = OrderedDict()
        self._unopened: OrderedDict[int, tuple[int, float]] = OrderedDict()  # blob -> bytes, when
        self._direct_readers = 0.0  # share of recent read opens that were O_DIRECT
        self._looked_up_at = 0.0  # the last lookup of a stored chunk (monotonic)

    def load_direct_readers(self, path: Path) -> None:
        """Start from the share of O_DIRECT readers the last mount saw: the first lookups
        after a remount come before any open tells, and reading a verified blob ahead of
        an O_DIRECT reader reads it twice."""
        with contextlib.suppress(OSError, ValueError):
            self._direct_readers = min(1.0, max(0.0, float(path.read_text())))

    def save_direct_readers(self, path: Path) -> None:
        path.write_text(f"{self._direct_readers:.3f}\n")

    # -- on the request path ---------------------------------------------------------------

    def wants(self, inode: Inode) -> bool:
        """Whether a lookup of `inode` concerns the prefetcher: a stored chunk."""
        return (bool(self.budget) and not inode.is_dir and inode.blob != 0
                and inode.size >= MIN_BYTES)

    def looked_up(self, inode: Inode, caller: Caller) -> None:
        """A lookup found `inode` by name: queue it if it is part of a burst of lookups of
        stored chunks by one process."""
        if not self.wants(inode):
            return
        process = self._process(caller)
        if process is None:
            return
        now = self._looked_up_at = time.monotonic()
        wanted = Wanted(inode.ino, inode.blob, inode.size)
        last = self._last_lookup.pop(process, None)
        self._last_lookup[process] = (now, None)
        if last is None or now - last[0] > BURST_SECONDS:
            self._last_lookup[process] = (now, wanted)  # alone so far: prefetched if a second comes
            self._forget_old_lookups(now)
            return
        if last[1] is not None:
            self._enqueue(last[1])
        self._enqueue(wanted)

    def opened(self, blob_id: int, direct: bool) -> None:
        """A reader (`direct`: an O_DIRECT one) opened `blob_id`: what was prefetched of it was
        used."""
        self._direct_readers = self._direct_readers * (1 - DIRECT_WEIGHT) + DIRECT_WEIGHT * direct
        found = self._unopened.pop(blob_id, None)
        if found is not None:
            self.stats.prefetch_used_bytes += found[0]
        self._count_waste()

    def _enqueue(self, wanted: Wanted) -> None:
        if wanted.blob_id in self._queued:
            return
        if self._committed_bytes + wanted.size > self.budget:
            self.stats.prefetch_over_budget += 1
            return
        self._queue.append(wanted)
        self._queued.add(wanted.blob_id)
        self._committed_bytes += wanted.size
        self._work.set()

    def _process(self, caller: Caller) -> int | None:
        """The caller's process (FUSE names the calling thread), None for a listing tool;
        read once per thread."""
        if caller.pid in self._processes:
            return self._processes[caller.pid]
        found, command = caller.process_and_command()
        process = None if command in LISTING_TOOLS else found
        self._processes[caller.pid] = process
        if len(self._processes) > PROCESSES_KEPT:
            self._processes.popitem(last=False)
        return process

    def _forget_old_lookups(self, now: float) -> None:
        while self._last_lookup:
            process, (when, _) = next(iter(self._last_lookup.items()))
            if now - when <= BURST_SECONDS:
                break
            del self._last_lookup[process]

    def _count_waste(self) -> None:
        now = time.monotonic()
        while self._unopened:
            blob_id, (size, when) = next(iter(self._unopened.items()))
            if now - when <= WASTE_SECONDS:
                break
            del self._unopened[blob_id]
            self.stats.prefetch_wasted_bytes += size

    # -- in the background -----------------------------------------------------------------

    async def run(self) -> None:
        """Prefetch queued chunks, CHUNKS_IN_FLIGHT at a time, in lookup order."""
        async with trio.open_nursery() as nursery:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                while self._queue:
                    await self._lookups_paused(time.monotonic() + DEFER_SECONDS_MAX)
                    await self._slots.acquire()
                    nursery.start_soon(self._prefetch, self._queue.popleft())
                self._count_waste()

    async def _lookups_paused(self, deadline: float) -> None:
        while (wait := min(self._looked_up_at + QUIET_SECONDS, deadline) - time.monotonic()) > 0:
            await trio.sleep(wait)

    async def _prefetch(self, wanted: Wanted) -> None:
        try:
            await self._load(wanted)
        except ChecksumError as error:  # the open finds it again: EIO, and the file dropped
            log.warning("prefetch: %s", error)
        except OSError as error:  # removed or replaced meanwhile: nothing to load
            log.debug("prefetch of blob %016x: %s", wanted.blob_id, error)
        except Exception:  # never the mount's end: the open does the work itself
            self.stats.background_errors += 1
            log.exception("prefetch of blob %016x failed", wanted.blob_id)
        finally:
            self._slots.release()
            self._queued.discard(wanted.blob_id)
            self._committed_bytes -= wanted.size

    async def _load(self, wanted: Wanted) -> None:
        inode, blob = await self.meta_call(self.meta.content.get, wanted.ino)
        if blob is None or blob.blob_id != wanted.blob_id or blob.pending:
            return  # replaced, or its sums are not taken yet: the open does it all
        # Readers mostly O_DIRECT (vLLM's tier): the head start is the check alone, read with
        # O_DIRECT too; there is none where each O_DIRECT open checks anyway (--verify open).
        direct = self._direct_readers > 0.5
        if direct and self.verifier.mode is VerifyMode.OPEN:
            return
        await self.session.hold(blob.blob_id)
        try:
            fd = self.data.open_blob(blob.blob_id)
            try:
                if ((direct or wholly_resident(fd, blob.size))
                        and self.verifier.checked(fd, blob.blob_id)):
                    return
                self._unopened[blob.blob_id] = (blob.size, time.monotonic())  # (until opened)
                try:
                    await self.verifier.verify(fd, blob, direct=direct, force=True)
                except BaseException:
                    self._unopened.pop(blob.blob_id, None)
                    raise
            finally:
                os.close(fd)
        finally:
            await self.session.release(blob.blob_id)
        self.stats.prefetch_bytes += blob.size
