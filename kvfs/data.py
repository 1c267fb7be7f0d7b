"""The data store: immutable blob files on the volume, staged writes, checksummed block reads.

Layout under the data directory:

    blobs/<id & 0xff as 2 hex>/<id as 16 hex>   committed content, never modified in place
    staging/<id as 16 hex>                        content being written by an open handle

A writer fills a staging file; committing publishes it (rename into blobs/) right after the
metadata commit that makes it visible. After a crash, `recover` rolls forward staging files the
metadata already names and deletes the rest, so nothing leaks and no data file is scanned.

Checksums are xxh3-64 per BLOCK_SIZE block, computed as sequential writes stream in (whatever
their request boundaries; blocks written out of sequence are hashed once at commit) and
verified on every read from the volume.
"""

from __future__ import annotations

import contextlib
import errno
import os
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

from kvfs.meta import BlobInfo

BLOCK_SIZE = 1 << 20  # checksum granularity; also the largest request the kernel sends


class ChecksumError(Exception):
    """Data on the volume does not match its recorded checksum (or is missing/short)."""


class DataStore:
    def __init__(self, root: Path, fsync: bool = False) -> None:
        self.blobs_dir = root / "blobs"
        self.staging_dir = root / "staging"
        self.fsync = fsync
        for shard in range(256):
            (self.blobs_dir / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(exist_ok=True)

    def path(self, blob_id: int) -> Path:
        return self.blobs_dir / f"{blob_id & 0xFF:02x}" / f"{blob_id:016x}"

    def staging_path(self, blob_id: int) -> Path:
        return self.staging_dir / f"{blob_id:016x}"

    def create_staging(self, blob_id: int) -> int:
        return os.open(self.staging_path(blob_id), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def publish(self, blob_id: int) -> None:
        os.rename(self.staging_path(blob_id), self.path(blob_id))

    def discard_staging(self, blob_id: int) -> None:
        _unlink_quietly(self.staging_path(blob_id))

    def open_blob(self, blob_id: int) -> int:
        return os.open(self.path(blob_id), os.O_RDONLY | os.O_CLOEXEC)

    @staticmethod
    def will_read(fd: int) -> None:
        """The blob will be read whole (LMCache reads every chunk whole): have the kernel
        start reading it from the volume now, in the background."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def remove(self, blob_id: int) -> None:
        """Delete a blob file; handles that have it open keep reading it until they close."""
        _unlink_quietly(self.path(blob_id))

    def recover(self, is_committed: Callable[[int], bool]) -> tuple[int, int]:
        """Finish or discard what a crash left in staging/; returns (published, discarded)."""
        published = discarded = 0
        for entry in os.scandir(self.staging_dir):
            try:
                blob_id = int(entry.name, 16)
            except ValueError:
                continue
            if is_committed(blob_id):
                self.publish(blob_id)
                published += 1
            else:
                self.discard_staging(blob_id)
                discarded += 1
        return published, discarded

    def read_blocks(self, fd: int, info: BlobInfo, first: int,
                    buffers: Sequence[bytearray | memoryview]) -> list[memoryview]:
        """Read blocks first, first+1, ... of a blob into `buffers` (BLOCK_SIZE each) in one
        call, verify each checksum, and return views of the bytes read."""
        start = first * info.block_size
        end = min(info.size, start + len(buffers) * info.block_size)
        views = [memoryview(buffer)[: min(info.block_size, end - offset)]
                 for buffer, offset in zip(buffers, range(start, end, info.block_size),
                                           strict=False)]
        got = os.preadv(fd, views, start)
        if got != end - start:
            raise ChecksumError(f"blob {info.blob_id:016x}: {got} bytes at {start}, "
                                f"expected {end - start}")
        for index, view in enumerate(views, first):
            if xxhash.xxh3_64_intdigest(view) != info.sums[index]:
                raise ChecksumError(f"blob {info.blob_id:016x}: block {index} checksum mismatch")
        return views

    def verify(self, info: BlobInfo) -> str | None:
        """Check a whole blob; returns what is wrong, or None when it is intact."""
        try:
            fd = self.open_blob(info.blob_id)
        except FileNotFoundError:
            return "data file missing"
        try:
            blocks = len(info.sums)
            buffers = [bytearray(info.block_size) for _ in range(16)]
            for first in range(0, blocks, len(buffers)):
                self.read_blocks(fd, info, first, buffers[: blocks - first])
            if os.fstat(fd).st_size != info.size:
                return f"data file has {os.fstat(fd).st_size} bytes, expected {info.size}"
        except ChecksumError as error:
            return str(error)
        finally:
            os.close(fd)
        return None


class StagedFile:
    """The private new content of one write handle, based (lazily) on a committed blob.

    The base is copied only when a write needs it: LMCache's pattern (open, one write of the
    whole chunk from offset 0) never copies."""

    def __init__(self, store: DataStore, blob_id: int, base_fd: int | None,
                 base: BlobInfo | None) -> None:
        self.store = store
        self.blob_id = blob_id
        self.fd = store.create_staging(blob_id)
        self.size = base.size if base is not None else 0  # logical size of the new content
        self.sums: dict[int, int] = {}
        self._base = (base_fd, base) if base_fd is not None and base is not None else None
        # Sequential writes are hashed as they stream in, across request boundaries: the
        # hasher holds the block being filled, up to _stream_end (None: not streaming).
        self._hasher = xxhash.xxh3_64()
        self._stream_end: int | None = 0

    @property
    def physical(self) -> int:
        """Bytes this staged file holds on the volume (the base is not copied yet)."""
        return 0 if self._base is not None else self.size

    def physical_after_write(self, offset: int, length: int) -> int:
        if self._base is not None and not self._replaces_base(offset, length):
            return max(self.size, offset + length)
        return max(self.physical, offset + length)

    def _replaces_base(self, offset: int, length: int) -> bool:
        return offset == 0 and length >= self.size

    def _materialize(self) -> None:
        """Copy the base content in, on the first change that keeps part of it."""
        if self._base is None:
            return
        base_fd, base = self._base
        self._base = None
        copied = 0
        while copied < base.size:
            done = os.copy_file_range(base_fd, self.fd, base.size - copied, copied, copied)
            if done == 0:
                raise OSError(errno.EIO, "base blob shorter than recorded")
            copied += done
        self.sums = dict(enumerate(base.sums))

    def write(self, offset: int, data: bytes) -> int:
        if self._base is not None and self._replaces_base(offset, len(data)):
            self._base = None
        self._materialize()
        self._grow(offset)
        written = os.pwrite(self.fd, data, offset)
        end = offset + written
        for block in range(offset // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1):
            self.sums.pop(block, None)  # set again below when streamed whole, else at commit
        if offset != self._stream_end:  # out of sequence: restart at a block boundary only
            self._hasher.reset()
            self._stream_end = offset if offset % BLOCK_SIZE == 0 else None
        if self._stream_end is not None:
            self._stream(memoryview(data)[:written], offset)
        self.size = max(self.size, end)
        return written

    def _grow(self, position: int) -> None:
        """Zeros up to `position` join the last block: its sum is no longer that block's."""
        if position > self.size and self.size % BLOCK_SIZE:
            self.sums.pop(self.size // BLOCK_SIZE, None)

    def _stream(self, data: memoryview, offset: int) -> None:
        """Hash bytes that continue the sequential stream; a block's sum is set when full."""
        done = 0
        while done < len(data):
            position = offset + done
            take = min(len(data) - done, BLOCK_SIZE - position % BLOCK_SIZE)
            self._hasher.update(data[done: done + take])
            done += take
            if (position + take) % BLOCK_SIZE == 0:
                self.sums[(position + take) // BLOCK_SIZE - 1] = self._hasher.intdigest()
                self._hasher.reset()
        self._stream_end = offset + len(data)

    def truncate(self, size: int) -> None:
        if size == 0:
            self._base = None
        self._materialize()
        self._grow(size)
        os.ftruncate(self.fd, size)
        boundary = size // BLOCK_SIZE
        for block in [b for b in self.sums if b >= boundary]:
            del self.sums[block]
        if self._stream_end != size:
            self._hasher.reset()
            self._stream_end = size if size % BLOCK_SIZE == 0 else None
        self.size = size

    def read(self, offset: int, size: int) -> bytes:
        self._materialize()
        return os.pread(self.fd, size, offset)

    def finish(self, ino: int) -> BlobInfo:
        """Hash what was not hashed while streaming, flush if asked; the blob is final."""
        self._materialize()
        blocks = -(-self.size // BLOCK_SIZE)
        if self._stream_end == self.size and self.size % BLOCK_SIZE:
            self.sums[blocks - 1] = self._hasher.intdigest()  # the stream's partial last block
        sums = array("Q", bytes(8 * blocks))
        for block in range(blocks):
            digest = self.sums.get(block)
            if digest is None:
                start = block * BLOCK_SIZE
                data = os.pread(self.fd, min(BLOCK_SIZE, self.size - start), start)
                digest = xxhash.xxh3_64_intdigest(data)
            sums[block] = digest
        if self.store.fsync:
            os.fdatasync(self.fd)
        return BlobInfo(self.blob_id, ino, self.size, BLOCK_SIZE, sums)

    def close(self) -> None:
        os.close(self.fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
