"""Verifying blobs before the kernel reads them, and block sums taken after a kernel write.

Before a blob is handed to the kernel (passthrough) it is verified whole (`Verifier`): its
data blocks are read in runs of several MiB, in worker threads, and checked against their
xxh3 sums. For a buffered reader that read leaves the blob in the page cache, where the reader
then finds it; for an O_DIRECT reader it bypasses the page cache too (`uncached`), since the
reader will not read from memory. When a check may be skipped is the mount's `VerifyMode`;
in every mode a blob whose data file changed since it was checked (another inode or mtime:
replaced, written behind kvfs) is checked again. Not the ctime: publishing (a rename) moves
it, and a mark taken in a worker could then land after the rename it should have followed.
The marks outlive a remount of the same boot (`save`/`load`), not a crash or a reboot.

Blobs the kernel wrote (passthrough writers) get their sums after the commit, in the
background (`LateHasher`), read from memory when they are all there and with O_DIRECT when
not (an O_DIRECT writer's bytes): the sums never pull a blob into the page cache. An O_DIRECT
writer's sums wait while kernel writers keep committing (HASH_QUIET_SECONDS), at most
HASH_DELAY_SECONDS: reading its bytes back from the volume during a store burst takes the
volume's bandwidth from the writers. A buffered writer's bytes are hashed from memory at
once, which costs the volume nothing. An open of a blob still without sums takes them first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from enum import StrEnum
from pathlib import Path

import trio

from kvfs.data.residency import wholly_resident
from kvfs.data.store import (
    VERIFY_RUN_BLOCKS,
    ChecksumError,
    DataStore,
    aligned_buffer,
    block_sums,
    check_blob_size,
    uncached,
)
from kvfs.data.volume import boot_id
from kvfs.meta import MetaStore
from kvfs.meta.calls import off_loop
from kvfs.observe.stats import Stats
from kvfs.records import BlobInfo

log = logging.getLogger(__name__)

VERIFY_THREADS = 4  # runs in flight at once
HASH_QUIET_SECONDS = 0.5  # late sums wait until no kernel writer has committed for this long
HASH_DELAY_SECONDS = 10.0  # ... or until the oldest has waited this long (bounds how long
# a blob is unprotected against the volume: a crash or a bad block before its sums are taken)


class VerifyMode(StrEnum):
    """Which bytes can reach a reader unverified (README, "What kvfs guarantees")."""

    ONCE = "once"  # checked once per host since the data file last changed; device trusted
    OPEN = "open"  # checked at every open, unless verified and wholly in memory (buffered)
    ALWAYS = "always"  # the daemon serves every read and checks each block it serves


class Verifier:
    """Whole-blob verification before a blob is passed through."""

    def __init__(self, data: DataStore, stats: Stats, mode: VerifyMode) -> None:
        self.data = data
        self.stats = stats
        self.mode = mode
        # blob -> (inode, mtime) of its data file when its page cache was last known good
        self._verified: dict[int, tuple[int, int]] = {}
        self._running: dict[int, trio.Event] = {}  # verifications under way
        self._buffers = [aligned_buffer() for _ in range(VERIFY_THREADS)]  # reused
        self._free = trio.Semaphore(VERIFY_THREADS)

    async def verify(self, fd: int, info: BlobInfo, direct: bool, force: bool = False) -> None:
        """Return once the blob may be passed to a reader (`direct`: an O_DIRECT one): every
        block checked now, or before and still good by the mode's rule (`force`, a prefetch:
        checked now unless a check just ended). ChecksumError."""
        joined = info.blob_id in self._running
        self.stats.verifications_joined += joined
        while (running := self._running.get(info.blob_id)) is not None:
            await running.wait()  # readers opening one chunk at once (or a prefetch) read it once
        mark = _file_mark(fd)
        if ((joined or not force) and self._verified.get(info.blob_id) == mark
                and self._still_good(fd, info, direct)):
            self.stats.verifications_skipped += 1
            return
        self._verified.pop(info.blob_id, None)
        self._running[info.blob_id] = trio.Event()
        try:
            runs = self.data.data_runs(fd, info, VERIFY_RUN_BLOCKS)
            with uncached(fd) if direct else contextlib.nullcontext(fd) as read_fd:
                try:
                    async with trio.open_nursery() as nursery:
                        for first, count in runs:
                            nursery.start_soon(self._verify_run, read_fd, info, first, count)
                except ExceptionGroup as group:  # one bad run is the answer; others go too
                    raise group.exceptions[0] from None
            self._verified[info.blob_id] = mark
        finally:
            self._running.pop(info.blob_id).set()

    def _still_good(self, fd: int, info: BlobInfo, direct: bool) -> bool:
        """A blob checked since its data file last changed: in `once` mode that is enough;
        in `open` mode only a buffered reader, and only if the blob is wholly in memory
        (the checked pages), may skip the check."""
        if self.mode is VerifyMode.ONCE:
            return True
        return not direct and wholly_resident(fd, info.size)

    async def _verify_run(self, fd: int, info: BlobInfo, first: int, count: int) -> None:
        async with self._free:
            buffer = self._buffers.pop()
            try:
                done = await off_loop(self.data.check_run, fd, info, first, count, buffer)
            finally:
                self._buffers.append(buffer)
        self.stats.verified_bytes += done

    def checked(self, fd: int, blob_id: int) -> bool:
        """Whether the blob was checked since its data file last changed."""
        return self._verified.get(blob_id) == _file_mark(fd)

    def written(self, blob_id: int, fd: int) -> None:
        """kvfs just wrote and hashed this blob: its page cache holds what was checksummed."""
        self.mark(blob_id, _file_mark(fd))

    def mark(self, blob_id: int, mark: tuple[int, int]) -> None:
        self._verified[blob_id] = mark

    def forget(self, blob_id: int) -> None:
        self._verified.pop(blob_id, None)

    def save(self, path: Path) -> None:
        """Keep the marks for the next mount of this boot (written at unmount)."""
        lines = [boot_id()] + [f"{blob:x} {ino} {mtime}"
                                for blob, (ino, mtime) in self._verified.items()]
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
            blob, ino, mtime = line.split()
            self._verified[int(blob, 16)] = (int(ino), int(mtime))


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
        self._in_memory: deque[int] = deque()
        self._on_volume: deque[tuple[int, float]] = deque()  # (blob, when wanted)
        self._last_busy = 0.0
        self._wanted = trio.Event()
        self._running: dict[int, trio.Event] = {}

    def want(self, blob_id: int, on_volume: bool = False) -> None:
        """`on_volume`: its bytes are not in memory (an O_DIRECT writer's): held until the
        kernel's I/O is quiet."""
        self.kernel_busy()  # (also called before the loop runs)
        if on_volume:
            self._on_volume.append((blob_id, self._last_busy))
        else:
            self._in_memory.append(blob_id)
        self._wanted.set()

    def kernel_busy(self) -> None:
        """The kernel writes or reads blobs without sums (a commit, an open): sums read
        from the volume would take its bandwidth now."""
        self._last_busy = time.monotonic()

    async def run(self) -> None:
        """Background: take the sums of wanted blobs in turn (those on the volume once
        kernel writers are quiet); a failure is logged and counted (an open of that blob
        tries again and fails alone)."""
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            while self._in_memory or self._on_volume:
                if self._in_memory:
                    blob_id = self._in_memory.popleft()
                elif await self._writers_quiet():
                    blob_id, _ = self._on_volume.popleft()
                else:
                    continue  # a blob in memory came meanwhile
                try:
                    await self.take_sums(blob_id)
                except Exception:
                    self.stats.background_errors += 1
                    log.exception("taking the block sums of blob %016x failed", blob_id)

    async def _writers_quiet(self) -> bool:
        """Wait until the kernel has been quiet (`kernel_busy`) for HASH_QUIET_SECONDS, or the
        oldest blob on the volume has waited HASH_DELAY_SECONDS; False, at once, when a blob
        in memory is wanted meanwhile."""
        while not self._in_memory:
            due = min(self._last_busy + HASH_QUIET_SECONDS,
                      self._on_volume[0][1] + HASH_DELAY_SECONDS)
            now = time.monotonic()
            if now >= due:
                return True
            self._wanted = trio.Event()
            with trio.move_on_after(due - now):
                await self._wanted.wait()
        return False

    def take_remaining_sums(self) -> None:
        """At unmount: take the sums still to be taken (a reboot would drop those files),
        marking what they checked as the background does."""
        for blob_id, _ in self.meta.content.pending():
            try:
                mark = take_sums(self.meta, self.data, blob_id)
                if mark is not None:
                    self.verifier.mark(blob_id, mark)
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
    info = meta.content.blob_info(blob_id)
    if info is None or not info.pending:
        return None
    try:
        fd = data.open_blob(blob_id)
    except FileNotFoundError:
        return None  # removed meanwhile
    try:
        check_blob_size(fd, info)
        # One thread: the writers and readers keep the other cores.
        resident = wholly_resident(fd, info.size)
        with contextlib.nullcontext(fd) if resident else uncached(fd) as read_fd:
            sums = block_sums(read_fd, info.size, buffer=aligned_buffer())
        return _file_mark(fd) if meta.content.record_sums(blob_id, sums) is not None else None
    finally:
        os.close(fd)


def _file_mark(fd: int) -> tuple[int, int]:
    """What changes when a data file is replaced or written behind kvfs (the mtime is
    fine-grained once looked at, Linux >= 6.13)."""
    status = os.fstat(fd)
    return status.st_ino, status.st_mtime_ns

