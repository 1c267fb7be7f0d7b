"""The data store: immutable blob files on the volume, staged writes, checksummed block reads.

Layout under the data directory:

    blobs/<id & 0xff as 2 hex>/<id as 16 hex>   committed content, never modified in place
    staging/<id as 16 hex>                        content being committed by a handle
    staging/<session>/<id as 16 hex>              the same, of one host of a shared pool

A writer fills a staging file (made ahead by the volume helper: kvfs/files/spares.py);
committing publishes it (rename into blobs/) after the metadata commit that makes it visible,
by the publisher (kvfs/files/writing.py). A committed blob whose publication failed stays in
staging/ (readers find it there) until a later flush, release or recovery publishes it: staged
data is deleted only while no commit names it. After a crash, `recover` rolls forward staging
files the metadata already names and deletes the rest, so nothing leaks and no data file is
scanned.

Files may have holes: extending a file by truncate or by writing past its end allocates
nothing, and a blob's `allocated` bytes (what the volume holds for it, what the capacity
counts and `du` shows) can be far less than its size.

Checksums are xxh3-64 per BLOCK_SIZE block, computed as sequential writes stream in (whatever
their request boundaries; blocks written out of sequence are hashed once at commit) and
verified on every read from the volume.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvfs.records import BlobInfo, fail
from kvfs.volume_helper import move

BLOCK_SIZE = 1 << 20  # checksum granularity; also the largest request the kernel sends
MAX_FILE_SIZE = (1 << 44) - 4096  # as ext4 with 4 KiB blocks: larger sizes get EFBIG
VERIFY_RUN_BLOCKS = 8  # blocks one worker verifies in a row when a whole blob is checked
ALLOCATION_UNIT = 4096  # a write may allocate up to this much beyond its own length
FALLOC_FL_KEEP_SIZE = 0x01  # linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
SUMS_AT_CLOSE_MAX = 64 << 10  # kernel-written files up to this size are hashed at their close
READ_WHOLE_MAX = 64 << 10  # files up to this size are hashed without looking for holes
PAGE = mmap.PAGESIZE  # O_DIRECT reads go into page-aligned buffers, in whole pages
_HASHERS = ThreadPoolExecutor(4, thread_name_prefix="kvfs-hash")  # blocks hashed at commit


def data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The (start, end) ranges of a file below `size` that hold data: everything else is a
    hole (reads as zeros, takes no room)."""
    position = 0
    while position < size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:  # only a hole is left
                return
            raise
        if start >= size:
            return
        position = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, position


def copy_data(source: int, target: int, size: int, short: str) -> None:
    """Copy the first `size` bytes of `source` into `target` (its data, not its holes), and
    make `target` that size; `short`: the error if `source` ends before."""
    for start, end in data_ranges(source, size):
        while start < end:
            done = os.copy_file_range(source, target, end - start, start, start)
            if done == 0:
                raise OSError(errno.EIO, short)
            start += done
    os.ftruncate(target, size)


@functools.cache
def zero_sum(length: int) -> int:
    """The checksum of a block that lies in a hole."""
    return xxhash.xxh3_64_intdigest(bytes(length))


def block_length(size: int, block: int) -> int:
    return min(BLOCK_SIZE, size - block * BLOCK_SIZE)


def block_sums(fd: int, size: int, known: dict[int, int] | None = None,
               buffer: memoryview | None = None) -> array:
    """The xxh3 of every block of a file: `known` ones as given, holes without reading,
    the rest read and hashed. Without `buffer`, side by side in worker threads (xxhash lets
    go of the GIL), from the page cache where they were just written; with one (page-aligned,
    BLOCK_SIZE), one at a time into it, so that `fd` may bypass the page cache (`uncached`)."""
    if 0 < size <= READ_WHOLE_MAX and not known and buffer is None:  # (a store's close:
        return array("Q", [xxhash.xxh3_64_intdigest(os.pread(fd, size, 0))])  # one read)
    known = known or {}
    blocks = -(-size // BLOCK_SIZE)
    sums = array("Q", [zero_sum(BLOCK_SIZE)]) * blocks
    if blocks:
        sums[-1] = zero_sum(block_length(size, blocks - 1))
    # A small file is read whole: a hole reads as zeros, whose sum is the hole's, and finding
    # holes (two lseeks) costs more than reading it.
    ranges = [(0, size)] if 0 < size <= READ_WHOLE_MAX else data_ranges(fd, size)
    unhashed = [block for start, end in ranges
                for block in range(start // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1)
                if block not in known]

    def hash_block(block: int) -> int:
        return xxhash.xxh3_64_intdigest(
            os.pread(fd, block_length(size, block), block * BLOCK_SIZE))

    def hash_block_into_buffer(block: int) -> int:
        assert buffer is not None
        length = block_length(size, block)
        got = os.preadv(fd, [buffer[:page_rounded(length)]], block * BLOCK_SIZE)
        return xxhash.xxh3_64_intdigest(buffer[:min(got, length)])

    if buffer is not None:
        digests: Iterable[int] = map(hash_block_into_buffer, unhashed)
    else:  # (one block: here, a worker's hand-off would cost more than the hash)
        digests = _HASHERS.map(hash_block, unhashed) if len(unhashed) > 1 else map(
            hash_block, unhashed)
    for block, digest in zip(unhashed, digests, strict=True):
        sums[block] = digest
    for block, digest in known.items():
        sums[block] = digest
    return sums


def page_rounded(length: int) -> int:
    return -(-length // PAGE) * PAGE


def aligned_buffer(size: int = BLOCK_SIZE) -> memoryview:
    """A page-aligned buffer (anonymous memory), as O_DIRECT reads need."""
    return memoryview(mmap.mmap(-1, size))


@contextlib.contextmanager
def uncached(fd: int) -> Iterator[int]:
    """`fd`'s file opened again with O_DIRECT, for reads whose bytes nobody will take from
    memory (checks ahead of an O_DIRECT reader, sums of a blob not in memory): they then
    neither fill nor evict the page cache. `fd` itself where the volume refuses O_DIRECT.
    Reads go into page-aligned buffers, in whole pages (`page_rounded`)."""
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        yield fd
        return
    try:
        yield direct
    finally:
        os.close(direct)


def writable_length(offset: int, length: int) -> int:
    """How much of a write at `offset` fits below the largest size: the rest is cut off (a
    short write, as Linux does); nothing fits: EFBIG."""
    if not length:
        return 0
    if offset >= MAX_FILE_SIZE:
        raise fail(errno.EFBIG)
    return min(length, MAX_FILE_SIZE - offset)


def check_file_size(size: int) -> None:
    if size > MAX_FILE_SIZE:
        raise fail(errno.EFBIG)


def check_blob_size(fd: int, info: BlobInfo) -> None:
    """ChecksumError unless a blob's data file has the size committed (all that can be
    checked of a blob whose sums are pending)."""
    size = os.fstat(fd).st_size
    if size != info.size:
        raise ChecksumError(f"blob {info.blob_id:016x}: data file has {size} bytes, "
                            f"expected {info.size}")


def allocated_bytes(fd: int, size: int) -> int:
    """Bytes a file takes on the volume, not counting preallocation past its end (XFS)."""
    return _allocated(os.fstat(fd), size)


def _allocated(status: os.stat_result, size: int) -> int:
    rounded = -(-size // ALLOCATION_UNIT) * ALLOCATION_UNIT
    return min(status.st_blocks * 512, rounded)


class ChecksumError(Exception):
    """Data on the volume does not match its recorded checksum (or is missing/short)."""


class DataStore:
    def __init__(self, root: Path, fsync: bool = False, session: str = "") -> None:
        """`session`: this host's staging directory in a shared pool ("": staging/ itself)."""
        self.blobs_dir = root / "blobs"
        self.staging_root = root / "staging"
        self.staging_dir = self.staging_root / session if session else self.staging_root
        self.shared = bool(session)
        self.fsync = fsync
        for shard in range(256):
            (self.blobs_dir / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._blobs = os.fspath(self.blobs_dir)
        self._staging = os.fspath(self.staging_dir)

    # Paths as strings: a flush on the loop builds three, and pathlib costs ~10 µs each.
    def path(self, blob_id: int) -> str:
        return f"{self._blobs}/{blob_id & 0xFF:02x}/{blob_id:016x}"

    def staging_path(self, blob_id: int) -> str:
        return f"{self._staging}/{blob_id:016x}"

    def create_staging(self, blob_id: int) -> int:
        return os.open(self.staging_path(blob_id), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def stage_again(self, blob_id: int, published: bool, new_id: int) -> int:
        """A second name in staging/ for a committed blob's file, to commit it anew: the
        kernel wrote into it after its commit (a passthrough writer open past a flush)."""
        os.link(self.path(blob_id) if published else self.staging_path(blob_id),
                self.staging_path(new_id))
        return os.open(self.staging_path(new_id), os.O_RDWR | os.O_CLOEXEC)

    def sync_volume(self) -> None:
        """Flush everything written to the volume (syncfs: one journal commit and one device
        flush for every file written since the last)."""
        fd = os.open(self.staging_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _libc.syncfs(fd):
                error = ctypes.get_errno()
                raise OSError(error, os.strerror(error))
        finally:
            os.close(fd)

    def publish(self, blob_id: int) -> None:
        error = move(self.staging_path(blob_id), self.path(blob_id))
        if error:
            raise OSError(error, os.strerror(error))

    def discard_staging(self, blob_id: int) -> None:
        _unlink_quietly(self.staging_path(blob_id))

    def open_blob(self, blob_id: int) -> int:
        """Open a committed blob: published, or still in staging/ (being published, or
        publishing failed). It moves atomically from one to the other: looked for in blobs/,
        staging/, then blobs/ again."""
        try:
            return os.open(self.path(blob_id), os.O_RDONLY | os.O_CLOEXEC)
        except OSError as published_error:
            for staged in self._staged_copies(blob_id):
                try:
                    return os.open(staged, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
            try:
                return os.open(self.path(blob_id), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise published_error from None

    def _staged_copies(self, blob_id: int) -> list[Path]:
        """Where a committed, unpublished blob may be: this host's staging directory, or
        (shared pool) the host's that committed it."""
        name = f"{blob_id:016x}"
        if not self.shared:
            return [self.staging_dir / name]
        return [self.staging_dir / name, *(path for path in self.staging_root.glob(f"*/{name}")
                                           if path.parent != self.staging_dir)]

    def staged_anywhere(self, blob_id: int) -> bool:
        """Whether some host still has the blob in its staging directory (publishing it)."""
        return any(path.exists() for path in self._staged_copies(blob_id))

    @staticmethod
    def will_read(fd: int) -> None:
        """The blob will be read whole (LMCache reads every chunk whole): have the kernel
        start reading it from the volume now, in the background."""
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)

    def remove(self, blob_id: int) -> None:
        """Delete a blob file (also an unpublished one); handles that have it open keep
        reading it until they close."""
        _unlink_quietly(self.path(blob_id))
        _unlink_quietly(self.staging_path(blob_id))

    def recover(self, is_committed: Callable[[int], bool],
                directory: Path | None = None) -> tuple[int, int]:
        """Finish or discard what a crash left in a staging directory (this host's, or a
        dead host's); returns (published, discarded)."""
        published = discarded = 0
        for entry in os.scandir(directory or self.staging_dir):
            try:
                blob_id = int(entry.name, 16)
            except ValueError:
                continue  # not kvfs's
            if entry.is_dir(follow_symlinks=False):
                continue  # a host's staging directory: that host's, or its reaper's
            if is_committed(blob_id):
                os.rename(entry.path, self.path(blob_id))
                published += 1
            else:
                _unlink_quietly(entry.path)
                discarded += 1
        return published, discarded

    def read_blocks(self, fd: int, info: BlobInfo, first: int,
                    buffers: Sequence[bytearray | memoryview]) -> list[memoryview]:
        """Read blocks first, first+1, ... of a blob into `buffers` (BLOCK_SIZE each) in one
        call, verify each checksum, and return views of the bytes read. The last block is
        read in whole pages, so `fd` may be an O_DIRECT one (`uncached`)."""
        start = first * info.block_size
        end = min(info.size, start + len(buffers) * info.block_size)
        views = [memoryview(buffer)[: min(info.block_size, end - offset)]
                 for buffer, offset in zip(buffers, range(start, end, info.block_size),
                                           strict=False)]
        if views:
            last = len(views) - 1
            reads = views[:last] + [memoryview(buffers[last])[:page_rounded(len(views[last]))]]
            got = os.preadv(fd, reads, start)
        else:
            got = 0
        if got < end - start:
            raise ChecksumError(f"blob {info.blob_id:016x}: {got} bytes at {start}, "
                                f"expected {end - start}")
        for index, view in enumerate(views, first):
            if xxhash.xxh3_64_intdigest(view) != info.sums[index]:
                raise ChecksumError(f"blob {info.blob_id:016x}: block {index} checksum mismatch")
        return views

    @staticmethod
    def data_runs(fd: int, info: BlobInfo, run_blocks: int) -> list[tuple[int, int]]:
        """What must be read to verify a whole blob: (first block, count) runs of at most
        `run_blocks` blocks that hold data. Checks on the way, without reading, the file's
        size and that every block in a hole has the checksum of zeros (ChecksumError)."""
        size = os.fstat(fd).st_size
        if size != info.size:
            raise ChecksumError(f"blob {info.blob_id:016x}: data file has {size} bytes, "
                                f"expected {info.size}")
        with_data = sorted({block for start, end in data_ranges(fd, info.size)
                            for block in range(start // info.block_size,
                                               (end - 1) // info.block_size + 1)})
        for block in set(range(len(info.sums))) - set(with_data):
            if info.sums[block] != zero_sum(block_length(info.size, block)):
                raise ChecksumError(f"blob {info.blob_id:016x}: block {block} is a hole "
                                    "but its checksum is not that of zeros")
        runs: list[tuple[int, int]] = []
        for block in with_data:
            first, count = runs[-1] if runs else (-1, 0)
            if first + count == block and count < run_blocks:
                runs[-1] = (first, count + 1)
            else:
                runs.append((block, 1))
        return runs

    def check_run(self, fd: int, info: BlobInfo, first: int, count: int,
                  buffer: bytearray | memoryview) -> int:
        """Read and verify `count` blocks from `first` one by one through one reused buffer
        (it stays in the CPU cache: twice as fast as large buffers); returns bytes read."""
        done = 0
        for block in range(first, first + count):
            done += len(self.read_blocks(fd, info, block, [buffer])[0])
        return done

    def verify(self, info: BlobInfo) -> str | None:
        """Check a whole blob (fsck); returns what is wrong, or None when it is intact (of a
        blob whose sums are pending, only its size can be checked)."""
        try:
            fd = self.open_blob(info.blob_id)
        except FileNotFoundError:
            return "data file missing"
        try:
            if info.pending:
                check_blob_size(fd, info)
                return None
            buffer = bytearray(info.block_size)
            for first, count in self.data_runs(fd, info, VERIFY_RUN_BLOCKS):
                self.check_run(fd, info, first, count, buffer)
        except ChecksumError as error:
            return str(error)
        finally:
            os.close(fd)
        return None


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
        self.fd = store.create_staging(blob_id) if fd is None else fd
        self.size = base.size if base is not None else 0  # logical size of the new content
        self.physical = 0  # bytes it takes on the volume (the base is not copied yet)
        self.sums: dict[int, int] = {}
        self.changed = False  # nothing to commit until a write or truncate lands
        self.direct = False  # its writer writes O_DIRECT (recorded with the blob)
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
                                                        blob_id))
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
        is staged again under the same name (its blob id is still this host's alone)."""
        os.makedirs(self.store.staging_dir, exist_ok=True)  # (before the rejoin makes it)
        fd = self.store.create_staging(self.blob_id)
        try:
            copy_data(self.fd, fd, self.size, "staged file shorter than written")
        except BaseException:
            os.close(fd)
            self.store.discard_staging(self.blob_id)
            raise
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
        self.physical = _allocated(status, self.size)
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

    def finish(self, ino: int, hash_later: bool = False, sync: bool = True) -> BlobInfo:
        """Hash what was not hashed while streaming (or, `hash_later`, leave the sums to be
        taken after the commit), flush where the store syncs (unless not `sync`: the caller
        has the volume synced before the commit); the blob is final. Idempotent until the
        next change."""
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
        if self.store.fsync and sync:
            os.fdatasync(self.fd)
        self._finished = BlobInfo(self.blob_id, ino, self.size, self.physical, BLOCK_SIZE, sums,
                                  pending, self.direct)
        return self._finished

    def mark_committed(self) -> None:
        """The metadata commit naming this blob went through: never deleted from here on."""
        self.committed = True

    def flushed(self) -> None:
        """Its content is committed and published: nothing to commit until the next change."""
        self.changed = False

    def publish(self) -> None:
        if not self.published:
            self.store.publish(self.blob_id)  # (a rename moves the ctime, not what _seen holds)
            self.published = True

    def publishing_paths(self) -> tuple[str, str]:
        """(where it is staged, where it is published): for another process to rename."""
        return self.store.staging_path(self.blob_id), self.store.path(self.blob_id)

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
            self.store.discard_staging(self.blob_id)


def _file_state(fd: int) -> tuple[int, int]:
    """Size and mtime: every write moves the mtime (fine-grained once kvfs has looked,
    Linux >= 6.13). Not the ctime, which a second name's removal moves too."""
    return _state_of(os.fstat(fd))


def _state_of(status: os.stat_result) -> tuple[int, int]:
    return status.st_size, status.st_mtime_ns


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
