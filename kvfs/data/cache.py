"""Read cache with readahead: verified blocks of committed blobs, in a fixed memory arena.

Memory: one mapping of `capacity` bytes, faulted in once at the first read the daemon serves
(a mount whose reads all pass through the kernel never maps it) and cut into block-sized
slots, so the cache never exceeds its size and never pays page faults on the read path (fresh
pages cap volume reads far below what reused ones reach).

Reads: volume reads run in worker threads, in runs of up to RUN_BYTES (one preadv each), so the
event loop keeps answering the kernel's 128 KiB - 1 MiB requests from memory while the next run
loads. When a file is read, runs up to `readahead` bytes ahead of the request start in the
background: an LMCache chunk is in flight whole after its first request. Every block's checksum
is verified before anything is served. Blobs are immutable, so cached blocks never go stale;
blocks of deleted blobs are dropped. Least recently used blocks give up their slots first.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections import OrderedDict

import trio

from kvfs.data.store import BLOCK_SIZE, DataStore
from kvfs.observe.stats import Stats
from kvfs.records import BlobInfo

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_READAHEAD_BYTES = 32 << 20
RUN_BYTES = 4 << 20  # one volume read
VOLUME_READERS = 2  # readahead runs loading at once; a reader's own block never waits for them


class BlockCache:
    def __init__(self, data: DataStore, stats: Stats, capacity: int = DEFAULT_CACHE_BYTES,
                 readahead: int = DEFAULT_READAHEAD_BYTES, run: int = RUN_BYTES) -> None:
        self.data = data
        self.stats = stats
        slots = max(4, capacity // BLOCK_SIZE)
        self.capacity = slots * BLOCK_SIZE
        self.readahead = min(readahead, self.capacity // 2)
        self.run = run
        self.used = 0
        self._arena: mmap.mmap | None = None
        self._free: list[memoryview] = []
        self._blocks: OrderedDict[tuple[int, int], tuple[memoryview, int]] = OrderedDict()
        self._by_blob: dict[int, set[int]] = {}
        self._loading: dict[tuple[int, int], trio.Event] = {}
        self._horizon: dict[int, int] = {}  # blob -> first block readahead has not reached
        self._limiter = trio.CapacityLimiter(VOLUME_READERS)
        self._urgent = trio.CapacityLimiter(VOLUME_READERS)  # blocks a request waits for
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Background readahead runs in this nursery (without one, reads are on demand)."""
        self._nursery = nursery

    async def read(self, fd: int, info: BlobInfo, offset: int, size: int
                   ) -> bytes | bytearray | memoryview:
        """Bytes [offset, offset+size) of a blob, verified; raises ChecksumError."""
        end = min(offset + size, info.size)
        if offset >= end:
            return b""
        first, last = offset // info.block_size, (end - 1) // info.block_size
        self._read_ahead(fd, info, last + 1)
        if first == last:  # served straight from the cached block: no copy, no await after
            start = first * info.block_size
            return (await self._block(fd, info, first))[offset - start: end - start]
        joined = bytearray()
        for block in range(first, last + 1):  # copied at once: a slot may be reused later
            start = block * info.block_size
            joined += (await self._block(fd, info, block))[max(offset - start, 0): end - start]
        return joined

    async def _block(self, fd: int, info: BlobInfo, block: int) -> memoryview:
        key = (info.blob_id, block)
        while True:
            cached = self._blocks.get(key)
            if cached is not None:
                self._blocks.move_to_end(key)
                slot, length = cached
                return slot[:length]
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()  # if that load failed, the loop loads it here and raises
        count = self._run_length(info, block, len(info.sums))
        slots = self._take_slots(count) or [memoryview(bytearray(BLOCK_SIZE))]
        views = await self._run(fd, info, block, slots,
                                self._mark_loading(info, block, len(slots)), self._urgent)
        return views[0]

    def _run_length(self, info: BlobInfo, block: int, end: int) -> int:
        """How many blocks from `block` (absent) on to load in one run: up to `end`, one run
        at most, stopping at a block that is cached or loading already."""
        most = min(self.run // info.block_size, end - block)
        count = 1
        while count < most and not self._present(info.blob_id, block + count):
            count += 1
        return count

    def _present(self, blob_id: int, block: int) -> bool:
        return (blob_id, block) in self._blocks or (blob_id, block) in self._loading

    def _read_ahead(self, fd: int, info: BlobInfo, block: int) -> None:
        if self._nursery is None:
            return
        end = min(len(info.sums), block + self.readahead // info.block_size)
        block = max(block, self._horizon.get(info.blob_id, 0))  # scheduled already up to here
        if block >= end:
            return
        self._horizon[info.blob_id] = end
        runs = []
        while block < end:
            if self._present(info.blob_id, block):
                block += 1
                continue
            slots = self._take_slots(self._run_length(info, block, end))
            if not slots:
                break  # every slot is busy loading: the reader catches up first
            runs.append((block, slots, self._mark_loading(info, block, len(slots))))
            block += len(slots)
        if runs:  # one task loads them in file order: the next block a reader needs comes first
            self._nursery.start_soon(self._load_in_order, os.dup(fd), info, runs)

    def _map_arena(self) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
        self._arena = mmap.mmap(-1, self.capacity, flags=flags)
        arena = memoryview(self._arena)
        self._free = [arena[start: start + BLOCK_SIZE]
                      for start in range(0, self.capacity, BLOCK_SIZE)]

    def _take_slots(self, count: int) -> list[memoryview]:
        """Up to `count` free slots, giving up least recently used blocks for them."""
        if self._arena is None:
            self._map_arena()
        while len(self._free) < count and self._blocks:
            (blob_id, index), (slot, length) = self._blocks.popitem(last=False)
            self._release(blob_id, index, slot, length)
        split = max(0, len(self._free) - count)
        taken = self._free[split:]
        del self._free[split:]
        return taken

    def _release(self, blob_id: int, index: int, slot: memoryview, length: int) -> None:
        self.used -= length
        self._free.append(slot)
        blocks = self._by_blob[blob_id]
        blocks.discard(index)
        if not blocks:
            del self._by_blob[blob_id]
            self._horizon.pop(blob_id, None)  # a later read starts readahead afresh

    def _mark_loading(self, info: BlobInfo, block: int, count: int) -> trio.Event:
        event = trio.Event()
        for index in range(block, block + count):
            self._loading[(info.blob_id, index)] = event
        return event

    async def _load_in_order(self, fd: int, info: BlobInfo,
                             runs: list[tuple[int, list[memoryview], trio.Event]]) -> None:
        """Readahead: load runs one after another; on a failure the rest are given up (their
        waiters woken) and left to the readers that need them, who then get the error."""
        try:
            for position, (block, slots, event) in enumerate(runs):
                try:
                    await self._run(fd, info, block, slots, event, self._limiter)
                except Exception as error:  # the reader that needs the block meets it itself
                    self.stats.readahead_errors += 1
                    log.warning("readahead of blob %016x stopped: %s", info.blob_id, error)
                    for later in runs[position + 1:]:
                        self._finish_run(info, *later, loaded=False)
                    return
        finally:
            os.close(fd)

    async def _run(self, fd: int, info: BlobInfo, block: int, slots: list[memoryview],
                   event: trio.Event, limiter: trio.CapacityLimiter) -> list[memoryview]:
        """Read and verify blocks into `slots` in a worker thread."""
        loaded = False
        try:
            views = await trio.to_thread.run_sync(self.data.read_blocks, fd, info, block, slots,
                                                  limiter=limiter)
            loaded = self._loading.get((info.blob_id, block)) is event  # not dropped meanwhile
            if loaded:
                for index, (slot, view) in enumerate(zip(slots, views, strict=True), block):
                    self._insert((info.blob_id, index), slot, len(view))
            return views
        finally:
            self._finish_run(info, block, slots, event, loaded)

    def _finish_run(self, info: BlobInfo, block: int, slots: list[memoryview], event: trio.Event,
                loaded: bool) -> None:
        """A run is over: free its slots unless cached, clear its marks, wake its waiters."""
        if not loaded:
            self._free.extend(slot for slot in slots if slot.obj is self._arena)
        for index in range(block, block + len(slots)):
            if self._loading.get((info.blob_id, index)) is event:
                del self._loading[(info.blob_id, index)]
        event.set()

    def _insert(self, key: tuple[int, int], slot: memoryview, length: int) -> None:
        if slot.obj is not self._arena:
            return  # a temporary buffer of a read that found every slot busy
        self._blocks[key] = (slot, length)
        self._by_blob.setdefault(key[0], set()).add(key[1])
        self.used += length

    def drop_blob(self, blob_id: int) -> None:
        for index in list(self._by_blob.get(blob_id, ())):
            slot, length = self._blocks.pop((blob_id, index))
            self._release(blob_id, index, slot, length)
        for key in [key for key in self._loading if key[0] == blob_id]:
            del self._loading[key]
        self._horizon.pop(blob_id, None)
