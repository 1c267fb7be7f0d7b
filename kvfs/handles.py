"""Open files: snapshot readers, staged writers, commit on close, and page-cache policy.

Close-to-open isolation: a read handle reads the blob the inode pointed at when it was opened;
a write handle fills a private staged blob that its flush (close) commits in one metadata
transaction. Concurrent writers of one name each have their own blob; the last to close wins.

Page cache: committed blobs are immutable, so a read handle keeps the kernel's cached pages
when they hold the version being opened (keep_cache) and drops them otherwise. Handles that
could disagree with the cached pages bypass the cache (direct_io): writers, and readers opened
while another handle of the same inode reads a different version.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count

from kvfs.cache import BlockCache
from kvfs.data import ChecksumError, DataStore, StagedFile
from kvfs.meta import BlobInfo, Inode, MetaStore, fail
from kvfs.space import Space
from kvfs.stats import Stats

log = logging.getLogger(__name__)


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


@dataclass(eq=False)
class OpenInode:
    inode: Inode
    handles: set[Handle] = field(default_factory=set)
    unlinked: bool = False

    @property
    def staged_size(self) -> int | None:
        sizes = [h.staged.size for h in self.handles if h.staged is not None]
        return max(sizes) if sizes else None


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
        self._next_fh = count(1)

    # -- attributes ----------------------------------------------------------------------

    def attributes(self, ino: int) -> Inode:
        """The inode as a stat of it should show: open-but-unlinked and growing files too."""
        state = self._open.get(ino)
        inode = state.inode if state and state.unlinked else self.meta.get(ino)
        if state is not None and (staged := state.staged_size) is not None:
            inode = replace(inode, size=staged)
        return inode

    def is_open(self, ino: int) -> bool:
        return ino in self._open

    # -- open / close --------------------------------------------------------------------

    def open(self, inode: Inode, flags: int) -> Opened:
        if inode.is_dir:
            raise fail(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        blob = self.meta.blob(inode.blob) if inode.blob else None
        fd = self._open_blob(inode, blob)
        handle = Handle(next(self._next_fh), inode.ino, writable, bool(flags & os.O_APPEND),
                        inode.version, blob, fd)
        self.space.touch(inode.ino)
        state = self._open.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        other_versions = any(h.version != inode.version or h.writable for h in state.handles)
        state.handles.add(handle)
        self._handles[handle.fh] = handle
        if writable and flags & os.O_TRUNC:
            self.truncate(handle, 0)
        if writable or other_versions:
            return Opened(handle.fh, direct_io=True, keep_cache=True)
        keep = self._cached_version.get(inode.ino) == inode.version
        self._cached_version[inode.ino] = inode.version
        return Opened(handle.fh, direct_io=False, keep_cache=keep)

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
        try:
            self.flush(handle)
        finally:
            self._discard_staged(handle)
            if handle.fd is not None:
                os.close(handle.fd)
            state = self._open[handle.ino]
            state.handles.discard(handle)
            if not state.handles:
                del self._open[handle.ino]

    def forget(self, ino: int) -> None:
        """The kernel dropped the inode, and with it any cached pages."""
        self._cached_version.pop(ino, None)

    def unlinked(self, inode: Inode) -> None:
        """An entry was removed or replaced: keep serving open handles, free its blob."""
        state = self._open.get(inode.ino)
        if state is not None:
            state.inode = replace(inode, nlink=0)
            state.unlinked = True
        self._cached_version.pop(inode.ino, None)
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
        before = self._reserve(staged, staged.physical_after_write(offset, len(data)))
        try:
            written = staged.write(offset, data)
        finally:
            self.space.inflight += staged.physical - before
        self.stats.bytes_written += written
        return written

    def truncate(self, handle: Handle, size: int) -> None:
        staged = self._staged(handle)
        before = self._reserve(staged, size)
        try:
            staged.truncate(size)
        finally:
            self.space.inflight += staged.physical - before

    def truncate_path(self, inode: Inode, size: int) -> Inode:
        """truncate(2) without a handle: a write handle opened, resized and closed at once."""
        opened = self.open(inode, os.O_WRONLY)
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

    def _reserve(self, staged: StagedFile, physical_after: int) -> int:
        """Make room for the growth (or ENOSPC); returns the staged bytes before the change."""
        self.space.reserve(physical_after - staged.physical)
        return staged.physical

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
