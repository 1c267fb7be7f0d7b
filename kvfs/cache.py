"""Read cache with readahead: verified blocks of committed blobs, LRU, bounded in bytes.

A miss reads a run of `readahead` bytes from the volume in one preadv (a whole LMCache chunk
where it fits) and verifies each block's checksum before anything is served, so the kernel's
128 KiB - 1 MiB requests are answered from memory and never see unverified bytes. Blobs are
immutable, so cached blocks never go stale; blocks of deleted blobs are dropped.
"""

from __future__ import annotations

from collections import OrderedDict

from kvfs.data import DataStore
from kvfs.meta import BlobInfo

DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_READAHEAD_BYTES = 32 << 20


class BlockCache:
    def __init__(self, data: DataStore, capacity: int = DEFAULT_CACHE_BYTES,
                 readahead: int = DEFAULT_READAHEAD_BYTES) -> None:
        self.data = data
        self.capacity = capacity
        self.readahead = readahead
        self.used = 0
        self._blocks: OrderedDict[tuple[int, int], bytearray] = OrderedDict()
        self._by_blob: dict[int, set[int]] = {}

    def read(self, fd: int, info: BlobInfo, offset: int, size: int) -> bytes | memoryview:
        """Bytes [offset, offset+size) of a blob, verified; raises ChecksumError."""
        end = min(offset + size, info.size)
        if offset >= end:
            return b""
        first, last = offset // info.block_size, (end - 1) // info.block_size
        pieces = []
        for block in range(first, last + 1):
            data = memoryview(self._block(fd, info, block))
            start = block * info.block_size
            pieces.append(data[max(offset - start, 0): end - start])
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _block(self, fd: int, info: BlobInfo, block: int) -> bytearray:
        key = (info.blob_id, block)
        cached = self._blocks.get(key)
        if cached is not None:
            self._blocks.move_to_end(key)
            return cached
        run = max(1, min(self.readahead, self.capacity) // info.block_size)
        present = self._by_blob.get(info.blob_id, set())
        count = 1
        while count < run and block + count < len(info.sums) and block + count not in present:
            count += 1
        buffers = self.data.read_blocks(fd, info, block, count)
        for index, buffer in enumerate(buffers, block):
            self._insert((info.blob_id, index), buffer)
        return buffers[0]

    def _insert(self, key: tuple[int, int], buffer: bytearray) -> None:
        self._blocks[key] = buffer
        self._by_blob.setdefault(key[0], set()).add(key[1])
        self.used += len(buffer)
        while self.used > self.capacity and len(self._blocks) > 1:
            (blob_id, index), old = self._blocks.popitem(last=False)
            self._forget(blob_id, index, old)

    def _forget(self, blob_id: int, index: int, buffer: bytearray) -> None:
        self.used -= len(buffer)
        blocks = self._by_blob[blob_id]
        blocks.discard(index)
        if not blocks:
            del self._by_blob[blob_id]

    def drop_blob(self, blob_id: int) -> None:
        for index in self._by_blob.pop(blob_id, set()):
            self.used -= len(self._blocks.pop((blob_id, index)))
