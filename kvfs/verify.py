"""Verifying blobs before the kernel reads them, and block sums taken after a kernel write.

Before a blob is handed to the kernel (passthrough) it is verified whole (`Verifier`): its
data blocks are read in runs of several MiB, in worker threads, and checked against their
xxh3 sums; that read leaves the blob in the page cache, where the reader then finds it. A blob
that is wholly in memory (cachestat(2)) and was verified, or written by kvfs itself, since its
data file last changed (same inode and ctime) is not read again. Those marks outlive a remount
of the same boot (`save`/`load`): the page cache does too.

Blobs the kernel wrote (passthrough writers) get their sums after the commit, in the
background (`LateHasher`).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path

import trio

from kvfs.data import BLOCK_SIZE, VERIFY_RUN_BLOCKS, ChecksumError, DataStore, block_sums
from kvfs.meta import MetaStore
from kvfs.offloop import off_loop
from kvfs.passthrough import wholly_resident
from kvfs.records import BlobInfo
from kvfs.stats import Stats
from kvfs.volume import boot_id

log = logging.getLogger(__name__)

VERIFY_THREADS = 4  # runs in flight at once


class Verifier:
    """Whole-blob verification before a blob is passed through."""

    def __init__(self, data: DataStore, stats: Stats) -> None:
        self.data = data
        self.stats = stats
        # blob -> (inode, ctime) of its data file when its page cache was last known good
        self._verified: dict[int, tuple[int, int]] = {}
        self._running: dict[int, trio.Event] = {}  # verifications under way
        self._buffers = [bytearray(BLOCK_SIZE) for _ in range(VERIFY_THREADS)]  # reused
        self._free = trio.Semaphore(VERIFY_THREADS)

    async def verify(self, fd: int, info: BlobInfo) -> None:
        """Return once every block of the blob is checked; raises ChecksumError."""
        while (running := self._running.get(info.blob_id)) is not None:
            await running.wait()  # readers opening one chunk at once read it once
        mark = _file_mark(fd)
        if self._verified.get(info.blob_id) == mark and wholly_resident(fd, info.size):
            self.stats.verifications_skipped += 1
            return
        self._verified.pop(info.blob_id, None)
        self._running[info.blob_id] = trio.Event()
        try:
            runs = self.data.data_runs(fd, info, VERIFY_RUN_BLOCKS)
            try:
                async with trio.open_nursery() as nursery:
                    for first, count in runs:
                        nursery.start_soon(self._verify_run, fd, info, first, count)
            except ExceptionGroup as group:  # one bad run is the answer; others go with it
                raise group.exceptions[0] from None
            self._verified[info.blob_id] = mark
        finally:
            self._running.pop(info.blob_id).set()

    async def _verify_run(self, fd: int, info: BlobInfo, first: int, count: int) -> None:
        async with self._free:
            buffer = self._buffers.pop()
            try:
                done = await off_loop(self.data.check_run, fd, info, first, count, buffer)
            finally:
                self._buffers.append(buffer)
        self.stats.verified_bytes += done

    def written(self, blob_id: int, fd: int) -> None:
        """kvfs just wrote and hashed this blob: its page cache holds what was checksummed."""
        self.mark(blob_id, _file_mark(fd))

    def mark(self, blob_id: int, mark: tuple[int, int]) -> None:
        self._verified[blob_id] = mark

    def forget(self, blob_id: int) -> None:
        self._verified.pop(blob_id, None)

    def save(self, path: Path) -> None:
        """Keep the marks for the next mount of this boot (written at unmount)."""
        lines = [boot_id()] + [f"{blob:x} {ino} {ctime}"
                                for blob, (ino, ctime) in self._verified.items()]
        temporary = path.with_suffix(".tmp")
        temporary.write_text("\n".join(lines) + "\n")
        temporary.rename(path)

    def load(self, path: Path) -> None:
        """Take the marks a clean unmount of this boot left, once (the file goes)."""
        try:
            boot, *lines = path.read_text().splitlines()
            path.unlink()
        except (OSError, ValueError):
            return
        if boot != boot_id():
            return  # the page cache did not survive a reboot
        for line in lines:
            blob, ino, ctime = line.split()
            self._verified[int(blob, 16)] = (int(ino), int(ctime))


class LateHasher:
    """Block sums of blobs the kernel wrote (passthrough writes), taken after their commit
    in the background so that the writer's close does not wait for them. An open of such a
    blob takes them first (once, however many open it at once)."""

    def __init__(self, data: DataStore, meta: MetaStore, verifier: Verifier,
                 stats: Stats) -> None:
        self.data = data
        self.meta = meta
        self.verifier = verifier
        self.stats = stats
        self._queue: deque[int] = deque()
        self._wanted = trio.Event()
        self._running: dict[int, trio.Event] = {}

    def want(self, blob_id: int) -> None:
        self._queue.append(blob_id)
        self._wanted.set()

    async def run(self) -> None:
        """Background: take the sums of wanted blobs in turn; a failure is logged and
        counted (an open of that blob tries again and fails alone)."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            while self._queue:
                blob_id = self._queue.popleft()
                try:
                    await self.take_sums(blob_id)
                except Exception:
                    self.stats.background_errors += 1
                    log.exception("taking the block sums of blob %016x failed", blob_id)

    def take_remaining_sums(self) -> None:
        """At unmount: take the sums still to be taken (a reboot would drop those files)."""
        for blob_id, _ in self.meta.pending():
            try:
                take_sums(self.meta, self.data, blob_id)
            except (OSError, ChecksumError) as error:
                log.error("taking the block sums of blob %016x failed: %s", blob_id, error)

    async def take_sums(self, blob_id: int) -> None:
        """Return once the blob has its sums (or is gone); ChecksumError if its data file
        does not have the size committed, OSError if it cannot be read."""
        while (running := self._running.get(blob_id)) is not None:
            await running.wait()
        self._running[blob_id] = trio.Event()
        try:
            mark = await off_loop(take_sums, self.meta, self.data, blob_id)
            if mark is not None:
                self.verifier.mark(blob_id, mark)  # what was just hashed is in memory
                self.stats.hashed_after_close += 1
        finally:
            self._running.pop(blob_id).set()



def take_sums(meta: MetaStore, data: DataStore, blob_id: int) -> tuple[int, int] | None:
    """Take and record the block sums of a blob the kernel wrote (blocking); returns its data
    file's mark if it did, None if there was nothing to do. ChecksumError if the data file
    does not have the size committed."""
    info = meta.blob_info(blob_id)
    if info is None or not info.pending:
        return None
    try:
        fd = data.open_blob(blob_id)
    except FileNotFoundError:
        return None  # removed meanwhile
    try:
        size = os.fstat(fd).st_size
        if size != info.size:
            raise ChecksumError(f"blob {blob_id:016x}: data file has {size} bytes, "
                                f"expected {info.size}")
        # One thread: the writers and readers keep the other cores.
        sums = block_sums(fd, info.size, side_by_side=False)
        return _file_mark(fd) if meta.record_sums(blob_id, sums) is not None else None
    finally:
        os.close(fd)


def _file_mark(fd: int) -> tuple[int, int]:
    """What changes when a data file is replaced or written behind kvfs."""
    status = os.fstat(fd)
    return status.st_ino, status.st_ctime_ns

