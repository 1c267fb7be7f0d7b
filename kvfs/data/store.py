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
import errno
import functools
import mmap
import os
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvfs.data.volume_helper import move
from kvfs.records import BlobInfo, fail

BLOCK_SIZE = 1 << 20  # checksum granularity; also the largest request the kernel sends
MAX_FILE_SIZE = (1 << 44) - 4096  # as ext4 with 4 KiB blocks: larger sizes get EFBIG
VERIFY_RUN_BLOCKS = 8  # blocks one worker verifies in a row when a whole blob is checked
ALLOCATION_UNIT = 4096  # a write may allocate up to this much beyond its own length
FALLOC_FL_KEEP_SIZE = 0x01  # linux/falloc.h
FALLOC_FL_PUNCH_HOLE = 0x02
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
    return status_allocated(os.fstat(fd), size)


def status_allocated(status: os.stat_result, size: int) -> int:
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
        self.session = session
        self.shared = bool(session)
        self.fsync = fsync
        for shard in range(256):
            (self.blobs_dir / f"{shard:02x}").mkdir(parents=True, exist_ok=True)
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        self._blobs = os.fspath(self.blobs_dir)
        self._staging = os.fspath(self.staging_dir)

    # Paths as strings: a flush on the loop builds three, and pathlib is slow at that.
    def path(self, blob_id: int) -> str:
        return f"{self._blobs}/{blob_id & 0xFF:02x}/{blob_id:016x}"

    def switch_session(self, session: str) -> None:
        """(Shared pool) This host staged under another session, which a reaper claimed: its
        new files go to the new session's directory (those staged before keep theirs:
        `directory` in the calls below)."""
        staging_dir = self.staging_root / session
        staging_dir.mkdir(parents=True, exist_ok=True)
        self.staging_dir, self._staging, self.session = staging_dir, os.fspath(staging_dir), session

    def current_staging(self) -> tuple[str, str]:
        """(directory, session) where new files are staged now."""
        return self._staging, self.session

    def staging_path(self, blob_id: int, directory: str | None = None) -> str:
        return f"{directory or self._staging}/{blob_id:016x}"

    def create_staging(self, blob_id: int, directory: str | None = None) -> int:
        return os.open(self.staging_path(blob_id, directory),
                       os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def stage_again(self, blob_id: int, published: bool, new_id: int,
                    directory: str | None = None) -> int:
        """A second name in staging/ for a committed blob's file (staged in `directory`), to
        commit it anew: the kernel wrote into it after its commit (a passthrough writer open
        past a flush)."""
        os.link(self.path(blob_id) if published else self.staging_path(blob_id, directory),
                self.staging_path(new_id))
        return os.open(self.staging_path(new_id), os.O_RDWR | os.O_CLOEXEC)

    def publish(self, blob_id: int, directory: str | None = None) -> None:
        error = move(self.staging_path(blob_id, directory), self.path(blob_id))
        if error:
            raise OSError(error, os.strerror(error))

    def discard_staging(self, blob_id: int, directory: str | None = None) -> None:
        _unlink_quietly(self.staging_path(blob_id, directory))

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
                try:
                    os.rename(entry.path, self.path(blob_id))
                except FileNotFoundError:
                    continue  # (another host cleaning up after the same session moved it)
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


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
