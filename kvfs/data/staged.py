"""Staged files: a writer's new version of a file, filled in staging/ and committed whole.

A staged file starts empty or as the committed content it rewrites (copied only when a write
needs it: LMCache's whole-chunk writes never copy), is hashed as writes stream in, finished
(the rest hashed, or the sums left for after the commit where the kernel wrote it), committed
by one metadata transaction and published into blobs/ (kvfs/data/store.py has the layout).
"""

from __future__ import annotations

import ctypes
import os
from array import array

import xxhash

from kvfs.data.store import (
    ALLOCATION_UNIT,
    BLOCK_SIZE,
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    SUMS_AT_CLOSE_MAX,
    DataStore,
    block_sums,
    check_file_size,
    copy_data,
    status_allocated,
)
from kvfs.records import BlobInfo, fail

_libc = ctypes.CDLL(None, use_errno=True)  # fallocate(2) with every mode


class StagedFile:
    """The private new content of one write handle, based (lazily) on a committed blob.

    The base is copied only when a write needs it: LMCache's pattern (open, one write of the
    whole chunk from offset 0) never copies. Its holes stay holes.

    Commit is a small state machine that can be retried: `finish` hashes the content (again,
    if written to since), the metadata commit names the blob (`committed`), publishing moves
    it into blobs/ (`published`). Once committed, the staged file is never deleted here."""

    def __init__(self, store: DataStore, blob_id: int, base_fd: int | None,
                 base: BlobInfo | None, fd: int | None = None) -> None:
        """`fd`: the file to stage in, at the blob's staging path already (a spare); None: a
        new one is created there."""
        self.store = store
        self.blob_id = blob_id
        # Where it is staged, and under which session (shared pool): the store's directory
        # when it was made (a host declared dead stages anew in another, `stage_in_current`).
        self.directory, self.session = store.current_staging()
        self.fd = store.create_staging(blob_id, self.directory) if fd is None else fd
        self.size = base.size if base is not None else 0  # logical size of the new content
        self.physical = 0  # bytes it takes on the volume (the base is not copied yet)
        self.sums: dict[int, int] = {}
        self.changed = False  # nothing to commit until a write or truncate lands
        self.committed = False
        self.published = False
        self._finished: BlobInfo | None = None
        self._base = (base_fd, base) if base_fd is not None and base is not None else None
        # Sequential writes are hashed as they stream in, across request boundaries: the
        # hasher holds the block being filled, up to _stream_end (None: not streaming).
        self._hasher = xxhash.xxh3_64()
        self._stream_end: int | None = 0
        self._seen: tuple[int, int] | None = _file_state(self.fd)  # as kvfs last left it

    @classmethod
    def again(cls, committed: StagedFile, blob_id: int) -> StagedFile:
        """New content over a committed staged file's data, changed by kernel writes."""
        staged = cls(committed.store, blob_id, None, None,
                     fd=committed.store.stage_again(committed.blob_id, committed.published,
                                                        blob_id, committed.directory))
        staged._seen = None
        staged.take_kernel_writes()
        return staged

    def kernel_wrote(self) -> bool:
        """Whether the file changed since kvfs last touched it (passthrough writes)."""
        return _file_state(self.fd) != self._seen

    def take_kernel_writes(self) -> None:
        """Adopt what the kernel wrote straight into the file: its size, and every block to
        be hashed again at commit."""
        status = os.fstat(self.fd)
        if _state_of(status) == self._seen:
            return
        self.size = status.st_size
        self.sums.clear()
        self._hasher.reset()
        self._stream_end = None
        self._measure(status)
        self.changed = True

    def growth_bound(self, offset: int, length: int) -> int:
        """The most bytes a write (already cut to fit) can add on the volume (what must be
        reserved first)."""
        base = 0 if self._replaces_base(offset, length) else self.base_allocated()
        return base + length + ALLOCATION_UNIT

    def truncate_growth_bound(self, size: int) -> int:
        """Growing by truncate makes a hole; only a base copy takes room."""
        check_file_size(size)
        return self.base_allocated() if size else 0

    def has_base(self) -> bool:
        """Whether committed content is still to be copied in."""
        return self._base is not None

    def base_allocated(self) -> int:
        """Bytes the committed content not yet copied in takes on the volume."""
        return self._base[1].allocated if self._base else 0

    def fallocate_growth_bound(self, mode: int, offset: int, length: int) -> int:
        """Punching a hole takes no room; other modes at most the range they cover."""
        grows = 0 if mode & FALLOC_FL_PUNCH_HOLE else length + ALLOCATION_UNIT
        return self.base_allocated() + grows

    def _replaces_base(self, offset: int, length: int) -> bool:
        return offset == 0 and length >= self.size

    def _stage_again(self) -> None:
        """Another host reaped this host's staging directory while it stalled (it was
        declared dead), and the file's name went with it: its data, still in the open file,
        is staged again under the same name (its blob id is still this host's alone), in the
        directory the host stages in now."""
        directory, session = self.store.current_staging()
        os.makedirs(directory, exist_ok=True)  # (before the rejoin makes it)
        fd = self.store.create_staging(self.blob_id, directory)
        try:
            copy_data(self.fd, fd, self.size, "staged file shorter than written")
        except BaseException:
            os.close(fd)
            self.store.discard_staging(self.blob_id, directory)
            raise
        self.directory, self.session = directory, session
        seen = self._seen == _file_state(self.fd)
        os.close(self.fd)
        self.fd = fd
        if seen:  # (what the kernel wrote is taken: a new file is not new writes)
            self._seen = _file_state(fd)

    def materialize(self) -> None:
        """Copy the base content in (its data, not its holes), on the first change that
        keeps part of it, or before the kernel writes into the file."""
        if self._base is None:
            return
        base_fd, base = self._base
        copy_data(base_fd, self.fd, base.size, "base blob shorter than recorded")
        self._base = None  # (only now: a copy that failed is made again whole)
        self.sums = dict(enumerate(base.sums))
        self._measure()

    def _measure(self, status: os.stat_result | None = None) -> None:
        """Size on the volume and state, from one fstat (`status`, if just taken)."""
        status = status or os.fstat(self.fd)
        self.physical = status_allocated(status, self.size)
        self._finished = None
        self._seen = _state_of(status)

    def write(self, offset: int, data: bytes | memoryview) -> int:
        if self._base is not None and self._replaces_base(offset, len(data)):
            self._base = None
        self.materialize()
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
        self._measure()
        self.changed = True
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
        check_file_size(size)
        if size == 0:
            self._base = None
        self.materialize()
        self._grow(size)
        os.ftruncate(self.fd, size)
        boundary = size // BLOCK_SIZE
        for block in [b for b in self.sums if b >= boundary]:
            del self.sums[block]
        if self._stream_end != size:
            self._hasher.reset()
            self._stream_end = size if size % BLOCK_SIZE == 0 else None
        self.size = size
        self._measure()
        self.changed = True

    def fallocate(self, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on the staged file. With KEEP_SIZE nothing happens past the end of
        the file: room there would hold volume space that no size or `du` shows, and what
        lies there reads as nothing anyway. A hole punched past the end is punched as asked
        (the volume frees a last block the range covers). Blocks from `offset` on are hashed
        again at commit (a collapse or insert moves all that follow)."""
        check_file_size(offset + length)
        if mode & FALLOC_FL_KEEP_SIZE:
            if offset >= self.size:
                return
            if not mode & FALLOC_FL_PUNCH_HOLE:
                length = min(length, self.size - offset)
        preallocating = mode == FALLOC_FL_KEEP_SIZE  # room only: the content stays
        self.materialize()
        self._grow(offset)
        if _libc.fallocate(self.fd, mode, ctypes.c_long(offset), ctypes.c_long(length)):
            raise fail(ctypes.get_errno())
        if preallocating:
            self._measure()
            return
        for block in [b for b in self.sums if b >= offset // BLOCK_SIZE]:
            del self.sums[block]
        self._hasher.reset()
        self._stream_end = None
        self.size = os.fstat(self.fd).st_size
        self._measure()
        self.changed = True

    def read(self, offset: int, size: int) -> bytes:
        fd = self._base[0] if self._base is not None else self.fd  # reading copies nothing
        return os.pread(fd, size, offset)

    def hashes_later(self, kernel_wrote: bool) -> bool:
        """Whether the sums are taken after the commit: of what the kernel wrote, unless it is
        small enough to read back in one small read at the close."""
        return kernel_wrote and self.size > SUMS_AT_CLOSE_MAX

    def finishes_quickly(self, kernel_wrote: bool) -> bool:
        """Whether `finish` is a few small syscalls (nothing to copy or hash beyond one small
        read), and a sync where the store syncs (`syncs`)."""
        return kernel_wrote and not self.has_base()

    @property
    def syncs(self) -> bool:
        """Whether `finish` flushes the data to the volume (a wait on the disk)."""
        return self.store.fsync

    def finish(self, ino: int, hash_later: bool = False) -> BlobInfo:
        """Hash what was not hashed while streaming (or, `hash_later`, leave the sums to be
        taken after the commit), flush where the store syncs; the blob is final. Idempotent
        until the next change."""
        if self._finished is not None:
            return self._finished
        self.materialize()
        if self.store.shared and not os.fstat(self.fd).st_nlink:
            self._stage_again()
        if hash_later:
            sums, pending = array("Q"), True
        else:
            blocks = -(-self.size // BLOCK_SIZE)
            if self._stream_end == self.size and self.size % BLOCK_SIZE:
                self.sums[blocks - 1] = self._hasher.intdigest()  # the stream's partial block
            sums, pending = block_sums(self.fd, self.size, self.sums), False
        if self.store.fsync:
            os.fdatasync(self.fd)
        self._finished = BlobInfo(self.blob_id, ino, self.size, self.physical, BLOCK_SIZE, sums,
                                  pending)
        return self._finished

    def stage_in_current(self) -> bool:
        """(A commit found its session claimed by a reaper, which may delete this file) Stage
        it again where the host stages now; False if that is where it is. The copy left
        behind goes (a reaper that finds the blob committed would publish it: the same
        bytes, but a second source for one name)."""
        claimed = self.directory
        if claimed == self.store.current_staging()[0]:
            return False
        self._stage_again()
        if self.store.fsync:
            os.fdatasync(self.fd)
        self.store.discard_staging(self.blob_id, claimed)
        return True

    def mark_committed(self) -> None:
        """The metadata commit naming this blob went through: never deleted from here on."""
        self.committed = True

    def flushed(self) -> None:
        """Its content is committed and published: nothing to commit until the next change."""
        self.changed = False

    def publish(self) -> None:
        if not self.published:
            # (a rename moves the ctime, not what _seen holds)
            self.store.publish(self.blob_id, self.directory)
            self.published = True

    def publishing_paths(self) -> tuple[str, str]:
        """(where it is staged, where it is published): for another process to rename."""
        return (self.store.staging_path(self.blob_id, self.directory),
                self.store.path(self.blob_id))

    def published_elsewhere(self) -> None:
        """Another process renamed it (`publishing_paths`)."""
        self.published = True

    def close(self) -> None:
        os.close(self.fd)

    def discard(self) -> None:
        """Close; delete the staged data unless a commit names it (then recovery or a
        later flush publishes it)."""
        self.close()
        if not self.committed:
            self.store.discard_staging(self.blob_id, self.directory)


def _file_state(fd: int) -> tuple[int, int]:
    """Size and mtime: every write moves the mtime (fine-grained once kvfs has looked,
    Linux >= 6.13). Not the ctime, which a second name's removal moves too."""
    return _state_of(os.fstat(fd))


def _state_of(status: os.stat_result) -> tuple[int, int]:
    return status.st_size, status.st_mtime_ns
