"""Read cache with readahead: verified blocks of committed blobs, LRU, bounded in bytes.

Volume reads run in worker threads, in runs of `run` bytes (one preadv each), so the event loop
keeps answering the kernel's 128 KiB - 1 MiB requests from memory while the next run loads.
When a file is read, runs up to `readahead` bytes ahead of the request are started in the
background: an LMCache chunk is in flight whole after its first request. Every block's checksum
is verified before anything is served. Blobs are immutable, so cached blocks never go stale;
blocks of deleted blobs are dropped. Memory stays within `capacity` (least recently used
blocks go first), plus the runs being loaded.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import trio

from kvfs.data import ChecksumError, DataStore
from kvfs.meta import BlobInfo

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_READAHEAD_BYTES = 32 << 20
RUN_BYTES = 8 << 20  # one volume read
VOLUME_READERS = 2  # runs loading at once
SPARE_BUFFERS = 16  # block buffers kept for reuse: allocating and zeroing them is costly


class BlockCache:
    def __init__(self, data: DataStore, capacity: int = DEFAULT_CACHE_BYTES,
                 readahead: int = DEFAULT_READAHEAD_BYTES, run: int = RUN_BYTES) -> None:
        self.data = data
        self.capacity = capacity
        self.readahead = min(readahead, capacity // 2)
        self.run = run
        self.used = 0
        self._blocks: OrderedDict[tuple[int, int], memoryview] = OrderedDict()
        self._spare: list[bytearray] = []
        self._by_blob: dict[int, set[int]] = {}
        self._loading: dict[tuple[int, int], trio.Event] = {}
        self._limiter = trio.CapacityLimiter(VOLUME_READERS)
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Background readahead runs in this nursery (without one, reads are on demand)."""
        self._nursery = nursery

    async def read(self, fd: int, info: BlobInfo, offset: int, size: int) -> bytes | memoryview:
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
        for block in range(first, last + 1):  # copied at once: a buffer may be reused later
            start = block * info.block_size
            joined += (await self._block(fd, info, block))[max(offset - start, 0): end - start]
        return joined

    async def _block(self, fd: int, info: BlobInfo, block: int) -> memoryview:
        key = (info.blob_id, block)
        while True:
            cached = self._blocks.get(key)
            if cached is not None:
                self._blocks.move_to_end(key)
                return cached
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()  # if that load failed, the loop loads it here and raises
        buffers = await self._load(fd, info, block, self._run_length(info, block, len(info.sums)))
        return buffers[0]

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
        while block < end:
            if self._present(info.blob_id, block):
                block += 1
                continue
            count = self._run_length(info, block, end)
            self._nursery.start_soon(self._load_quietly, os.dup(fd), info, block, count,
                                     self._mark_loading(info, block, count))
            block += count

    def _mark_loading(self, info: BlobInfo, block: int, count: int) -> trio.Event:
        event = trio.Event()
        for index in range(block, block + count):
            self._loading[(info.blob_id, index)] = event
        return event

    async def _load(self, fd: int, info: BlobInfo, block: int, count: int) -> list[memoryview]:
        return await self._run(os.dup(fd), info, block, count,
                               self._mark_loading(info, block, count))

    async def _load_quietly(self, fd: int, info: BlobInfo, block: int, count: int,
                            event: trio.Event) -> None:
        """A readahead run: a failure is left for the reader that needs the block."""
        try:
            await self._run(fd, info, block, count, event)
        except ChecksumError as error:
            log.debug("readahead stopped: %s", error)

    async def _run(self, fd: int, info: BlobInfo, block: int, count: int,
                   event: trio.Event) -> list[memoryview]:
        """Read and verify blocks in a worker thread; `fd` is ours to close."""
        buffers = [self._spare.pop() if self._spare else bytearray(info.block_size)
                   for _ in range(count)]
        try:
            views = await trio.to_thread.run_sync(self.data.read_blocks, fd, info, block,
                                                  buffers, limiter=self._limiter)
            if self._loading.get((info.blob_id, block)) is event:  # else: blob dropped meanwhile
                for index, view in enumerate(views, block):
                    self._insert((info.blob_id, index), view)
            return views
        except BaseException:
            self._recycle(buffers)
            raise
        finally:
            os.close(fd)
            for index in range(block, block + count):
                if self._loading.get((info.blob_id, index)) is event:
                    del self._loading[(info.blob_id, index)]
            event.set()

    def _insert(self, key: tuple[int, int], view: memoryview) -> None:
        self._blocks[key] = view
        self._by_blob.setdefault(key[0], set()).add(key[1])
        self.used += len(view)
        while self.used > self.capacity and len(self._blocks) > 1:
            (blob_id, index), old = self._blocks.popitem(last=False)
            self._forget(old)
            blocks = self._by_blob[blob_id]
            blocks.discard(index)
            if not blocks:
                del self._by_blob[blob_id]

    def _forget(self, view: memoryview) -> None:
        self.used -= len(view)
        self._recycle([view.obj])

    def _recycle(self, buffers: list) -> None:
        room = SPARE_BUFFERS - len(self._spare)
        self._spare.extend(buffers[:room])

    def drop_blob(self, blob_id: int) -> None:
        for index in self._by_blob.pop(blob_id, set()):
            self._forget(self._blocks.pop((blob_id, index)))
        for key in [key for key in self._loading if key[0] == blob_id]:
            del self._loading[key]
