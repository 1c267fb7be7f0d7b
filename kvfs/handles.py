"""Open files: snapshot readers, staged writers, commit on close, and page-cache policy.

Close-to-open isolation: a read handle reads the blob the inode pointed at when it was opened;
a write handle fills a private staged blob that its flush (close) commits in one metadata
transaction. Concurrent writers of one name each have their own blob; the last to close wins.

Page cache: the first read of a version bypasses the kernel page cache (direct_io): the kernel
then sends a whole chunk's requests at once, so they are answered as the volume delivers,
without filling pages nobody may read again. A version opened again is read through the page
cache and kept there across opens (keep_cache): committed blobs are immutable, so a chunk
read by several instances is then served from kernel memory. Handles that could disagree
with the cached pages bypass it too: writers, and readers opened while a writer is open or
another handle of the same inode reads a different version.

The kernel keeps one size and one page cache per inode, and a writer's open (O_TRUNC) and
writes change them for every handle. So a writer of a file that page-cache readers have open
waits (up to WRITER_WAIT_SECONDS) for them to close, and stat shows the committed size only.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count
from typing import TypeVar

import trio

from kvfs.cache import BlockCache
from kvfs.data import ChecksumError, DataStore, StagedFile
from kvfs.meta import BlobInfo, Inode, MetaStore, fail
from kvfs.space import Space
from kvfs.stats import Stats
from kvfs.tempnames import SharedTempNames, tgid_of

log = logging.getLogger(__name__)

WRITER_WAIT_SECONDS = 2.0
T = TypeVar("T")


@dataclass(eq=False)
class Handle:
    fh: int
    ino: int
    writable: bool
    append: bool
    version: int  # committed version this handle reads (readers) or is based on (writers)
    blob: BlobInfo | None
    fd: int | None  # the blob's file, held open so unlink/replace cannot take it away
    staged: StagedFile | None = None
    page_cache: bool = False  # reads go through the kernel page cache (not direct_io)
    process: int = 0  # of a writer: who opened it (see tempnames)


@dataclass(eq=False)
class OpenInode:
    inode: Inode
    handles: set[Handle] = field(default_factory=set)
    unlinked: bool = False
    writers_waiting: int = 0
    readers_gone: trio.Event | None = None  # set when the last page-cache reader closes

    def page_cache_readers(self) -> bool:
        return any(handle.page_cache for handle in self.handles)


@dataclass(frozen=True, slots=True)
class Opened:
    fh: int
    direct_io: bool
    keep_cache: bool


class FileTable:
    def __init__(self, meta: MetaStore, data: DataStore, cache: BlockCache, stats: Stats,
                 space: Space, on_dropped: Callable[[Inode], None]) -> None:
        self.meta = meta
        self.data = data
        self.cache = cache
        self.stats = stats
        self.space = space
        self.on_dropped = on_dropped  # tell the kernel a file vanished (corrupt data)
        self._handles: dict[int, Handle] = {}
        self._open: dict[int, OpenInode] = {}
        self._cached_version: dict[int, int] = {}  # what the kernel page cache may hold
        self._read_directly: dict[int, int] = {}  # versions read once, bypassing the cache
        self.temp_names = SharedTempNames()
        self._next_fh = count(1)

    # -- attributes ----------------------------------------------------------------------

    def attributes(self, ino: int) -> Inode:
        """The committed inode (also of files unlinked while open)."""
        state = self._open.get(ino)
        return state.inode if state and state.unlinked else self.meta.get(ino)

    def is_open(self, ino: int) -> bool:
        return ino in self._open

    # -- open / close --------------------------------------------------------------------

    async def open(self, inode: Inode, flags: int, pid: int) -> Opened:
        if inode.is_dir:
            raise fail(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if flags & os.O_TRUNC and not writable:  # O_RDONLY|O_TRUNC truncates, as on Linux
            inode = await self.truncate_path(inode, 0)
        if writable and await self._wait_for_page_cache_readers(inode.ino):
            inode = self.meta.get(inode.ino)  # it may have changed meanwhile
        blob = self.meta.blob(inode.blob) if inode.blob else None
        fd = self._open_blob(inode, blob)
        handle = Handle(next(self._next_fh), inode.ino, writable, bool(flags & os.O_APPEND),
                        inode.version, blob, fd)
        if writable:
            handle.process = tgid_of(pid)
            self.temp_names.writer_opened(inode.ino, handle.process)
        self.space.touch(inode.ino)
        state = self._open.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        contended = state.writers_waiting or any(
            h.version != inode.version or h.writable for h in state.handles)
        state.handles.add(handle)
        self._handles[handle.fh] = handle
        if writable and flags & os.O_TRUNC:
            self.truncate(handle, 0)
        keep = self._cached_version.get(inode.ino) == inode.version
        first_read = self._read_directly.get(inode.ino) != inode.version
        if not (writable or keep) and fd is not None:
            self.data.will_read(fd)  # the kernel's pages are not there: reads will come here
        if writable or contended or (first_read and not keep):
            if not writable:
                self._read_directly[inode.ino] = inode.version
            return Opened(handle.fh, direct_io=True, keep_cache=True)
        handle.page_cache = True
        self._cached_version[inode.ino] = inode.version
        return Opened(handle.fh, direct_io=False, keep_cache=keep)

    async def _wait_for_page_cache_readers(self, ino: int) -> bool:
        """Let page-cache readers of `ino` finish before a writer changes the kernel's view
        of it; returns whether there was anything to wait for."""
        state = self._open.get(ino)
        if state is None or not state.page_cache_readers():
            return False
        state.writers_waiting += 1
        try:
            with trio.move_on_after(WRITER_WAIT_SECONDS):
                while state.page_cache_readers():
                    if state.readers_gone is None:
                        state.readers_gone = trio.Event()
                    await state.readers_gone.wait()
            if state.page_cache_readers():
                log.info("writer of %r proceeds with readers still open", state.inode.name)
        finally:
            state.writers_waiting -= 1
        return True

    def _open_blob(self, inode: Inode, blob: BlobInfo | None) -> int | None:
        if blob is None:
            return None
        try:
            return self.data.open_blob(blob.blob_id)
        except FileNotFoundError:
            self._drop_damaged(inode, f"data file of blob {blob.blob_id:016x} is missing")
            raise fail(errno.ENOENT) from None

    def handle(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise fail(errno.EBADF)
        return handle

    def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        if handle.writable:
            self.temp_names.writer_closed(handle.ino, handle.process)
        try:
            self.flush(handle)
        finally:
            self._discard_staged(handle)
            if handle.fd is not None:
                os.close(handle.fd)
            state = self._open[handle.ino]
            state.handles.discard(handle)
            if state.readers_gone is not None and not state.page_cache_readers():
                state.readers_gone.set()
                state.readers_gone = None
            if not state.handles:
                del self._open[handle.ino]

    def forget(self, ino: int) -> None:
        """The kernel dropped the inode, and with it any cached pages."""
        self._cached_version.pop(ino, None)
        self._read_directly.pop(ino, None)

    def unlinked(self, inode: Inode) -> None:
        """An entry was removed or replaced: keep serving open handles, free its blob."""
        state = self._open.get(inode.ino)
        if state is not None:
            state.inode = replace(inode, nlink=0)
            state.unlinked = True
        self._cached_version.pop(inode.ino, None)
        self._read_directly.pop(inode.ino, None)
        self.free_blob(inode.blob)

    def free_blob(self, blob_id: int) -> None:
        if blob_id:
            self.data.remove(blob_id)
            self.cache.drop_blob(blob_id)
            self.meta.reaped([blob_id])

    # -- data ----------------------------------------------------------------------------

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        handle = self.handle(fh)
        self.space.touch(handle.ino)
        if handle.staged is not None:
            data = handle.staged.read(offset, size)
        elif handle.blob is None:
            data = b""
        else:
            try:
                data = await self.cache.read(handle.fd, handle.blob, offset, size)
            except ChecksumError as error:
                self._drop_damaged(self._open[handle.ino].inode, str(error), handle.blob)
                raise fail(errno.EIO) from None
        self.stats.bytes_read += len(data)
        return data

    def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.handle(fh)
        staged = self._staged(handle)
        if handle.append:
            offset = staged.size
        written = self._change(staged, staged.physical_after_write(offset, len(data)),
                               lambda: staged.write(offset, data))
        self.stats.bytes_written += written
        return written

    def truncate(self, handle: Handle, size: int) -> None:
        staged = self._staged(handle)
        self._change(staged, size, lambda: staged.truncate(size))

    async def truncate_path(self, inode: Inode, size: int) -> Inode:
        """truncate(2) without a handle: a write handle opened, resized and closed at once."""
        opened = await self.open(inode, os.O_WRONLY, pid=0)
        try:
            self.truncate(self._handles[opened.fh], size)
        finally:
            self.release(opened.fh)
        return self.attributes(inode.ino)

    def _staged(self, handle: Handle) -> StagedFile:
        if not handle.writable:
            raise fail(errno.EBADF)
        if handle.staged is None:
            handle.staged = StagedFile(self.data, self.meta.allocate_blob_id(), handle.fd,
                                       handle.blob)
        return handle.staged

    def _change(self, staged: StagedFile, physical_after: int, change: Callable[[], T]) -> T:
        """Make room for what `change` will add to the staged file (or ENOSPC), run it, and
        account for what it really added."""
        before = staged.physical
        self.space.reserve(physical_after - before)
        try:
            return change()
        finally:
            self.space.inflight += staged.physical - before

    def flush(self, handle: Handle) -> bool:
        """Commit what this handle wrote: one metadata transaction makes it visible whole.

        Returns whether anything was committed."""
        staged = handle.staged
        if staged is None:
            return False
        try:
            blob = staged.finish(handle.ino)
            inode, old_blob = self.meta.commit_content(handle.ino, blob)
        except OSError as error:
            if error.errno != errno.ENOENT:
                raise
            self._discard_staged(handle)  # the file was removed meanwhile: its writes go too
            return False
        self.data.publish(blob.blob_id)
        self.space.inflight -= staged.physical
        staged.close()
        handle.staged = None
        self.free_blob(old_blob)
        # Later writes on this handle start from what it just committed.
        if handle.fd is not None:
            os.close(handle.fd)
        handle.blob, handle.version = blob, inode.version
        handle.fd = self.data.open_blob(blob.blob_id)
        self._open[handle.ino].inode = inode
        self.stats.commits += 1
        return True

    def _discard_staged(self, handle: Handle) -> None:
        if handle.staged is not None:
            self.space.inflight -= handle.staged.physical
            handle.staged.close()
            self.data.discard_staging(handle.staged.blob_id)
            handle.staged = None

    def _drop_damaged(self, inode: Inode, reason: str, blob: BlobInfo | None = None) -> None:
        """Never serve bad bytes: count, log and drop the file so readers see a miss."""
        self.stats.checksum_errors += 1
        log.error("dropping %r (ino %d): %s", inode.name, inode.ino, reason)
        try:
            current = None if self._is_unlinked(inode.ino) else self.meta.get(inode.ino)
        except FileNotFoundError:
            current = None
        if current is None or (blob is not None and current.blob != blob.blob_id):
            return  # already replaced or removed: only this snapshot was bad
        dropped = self.meta.drop_file(inode.ino)
        if dropped is not None:
            self.unlinked(dropped)
            self.on_dropped(dropped)

    def _is_unlinked(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and state.unlinked
