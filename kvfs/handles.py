"""Open files: snapshot readers, staged writers, commit on close, page-cache policy, and the
retirement of files that lost their last name.

Close-to-open isolation: a read handle reads the blob the inode pointed at when it was opened;
a write handle fills a private staged blob that its flush (close) commits in one metadata
transaction. Concurrent writers of one name each have their own blob; the last to close wins.
Hashing, the metadata commit and publishing run in worker threads: requests keep flowing.

Passthrough (where the kernel grants it, kvfs/passthrough.py): a reader's open verifies the
whole blob, then hands it to the kernel, which serves every read from the blob's own page
cache without the daemon. All passthrough readers of an inode share one backing file, and the
kernel accepts no other open of the inode beside them: a writer or a reader of another version
waits for them to close (EBUSY if they stay), and readers arriving meanwhile wait too. Opens
the daemon serves (writers, O_DIRECT readers, readers beside a writer) are direct_io.

Without passthrough: the first read of a version bypasses the kernel page cache (direct_io):
the kernel then sends a whole chunk's requests at once, answered as the volume delivers,
without filling pages nobody may read again. A version opened again is read through the page
cache and kept there across opens (keep_cache): committed blobs are immutable, so a chunk
read by several instances is then served from kernel memory. Handles that could disagree
with the cached pages bypass it too: writers, and readers opened while a writer is open or
another handle of the same inode reads a different version.

The kernel keeps one size and one page cache per inode, and a writer's open (O_TRUNC) and
writes change them for every handle. So a writer of a file that page-cache readers have open
waits (up to WRITER_WAIT_SECONDS) for them to close, and stat shows the committed size only.

Retiring: a file whose last name went (unlink, rename over it, eviction, lost data) keeps
serving its open handles; its blob is doomed in the same metadata transaction and its data
file deleted by the reaper, in a worker thread, off the request loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count
from pathlib import Path
from typing import TypeVar

import trio
from pyfuse3 import FileInfo

from kvfs.cache import BlockCache
from kvfs.data import (
    ChecksumError,
    DataStore,
    StagedFile,
    allocated_bytes,
    check_file_size,
    writable_length,
)
from kvfs.meta import Inode, MetaStore, Removed
from kvfs.offloop import MetaReads, off_loop
from kvfs.passthrough import Passthrough
from kvfs.reaper import reap_doomed
from kvfs.records import BlobInfo, FsError, fail
from kvfs.sessions import Session
from kvfs.space import Space
from kvfs.stats import Stats
from kvfs.verify import LateHasher, Verifier

log = logging.getLogger(__name__)

WRITER_WAIT_SECONDS = 2.0
BLOB_ID_BATCH = 256
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
    backing: bool = False  # the kernel does its I/O on a blob file itself (passthrough)
    reserved: int = 0  # room held for a passthrough writer, whose writes kvfs does not see
    kill_privs: Caller | None = None  # a writer without CAP_FSETID: writes clear setuid/gid
    lock: trio.Lock = field(default_factory=trio.Lock)  # one change or commit at a time
    changed_at: int = 0  # when this writer last changed its content (FileTable's clock)

    def own_size(self) -> tuple[int, int] | None:
        """The size and allocated bytes of what this writer has written and not yet
        committed (None: nothing): what it sees of its own file, as on a local disk."""
        staged = self.staged
        if staged is None or staged.committed and not self.backing:
            return None
        if self.backing:  # the kernel writes straight into the file: ask the volume
            size = os.fstat(staged.fd).st_size
            return size, allocated_bytes(staged.fd, size)
        return (staged.size, staged.physical) if staged.changed else None


@dataclass(eq=False)
class Backing:
    """The one backing file the kernel has for an inode while passthrough handles use it:
    a committed blob that readers share, or the staged file of one writer."""

    blob_id: int
    backing_id: int
    users: int = 1
    writable: bool = False


@dataclass(eq=False)
class OpenInode:
    inode: Inode
    handles: set[Handle] = field(default_factory=set)
    backing: Backing | None = None
    unlinked: bool = False
    writers_waiting: int = 0
    kernel_users_gone: trio.Event | None = None  # set when the last kernel reader closes

    def kernel_users(self) -> bool:
        """Handles whose I/O the kernel does without us (page cache, passthrough)."""
        return any(handle.page_cache or handle.backing for handle in self.handles)


@dataclass(frozen=True, slots=True)
class Opened:
    fh: int
    direct_io: bool
    keep_cache: bool
    backing_id: int = 0
    read_only: bool = False

    def file_info(self) -> FileInfo:
        info = FileInfo(fh=self.fh, direct_io=self.direct_io, keep_cache=self.keep_cache)
        if self.backing_id:
            # kvfs's pyfuse3 patch adds FileInfo.backing_id (not in pyfuse3's stubs).
            info.backing_id = self.backing_id  # type: ignore[attr-defined]
        if self.read_only and hasattr(info, "noflush"):  # kvfs's pyfuse3 patch
            info.noflush = True  # its close has nothing to commit: no FLUSH round trip
        return info


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a request: root (CAP_FSETID: writes keep setuid/setgid) or a user."""

    uid: int
    gid: int
    pid: int

    def in_group(self, gid: int) -> bool:
        """Asked only when a write may clear setgid: supplementary groups are in /proc."""
        if gid == self.gid:
            return True
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("Groups:"):
                    return str(gid) in line.split()[1:]
        except OSError:
            pass
        return False


def privileges_to_clear(inode: Inode, writer: Caller) -> int:
    """What a write by `writer` clears, as Linux: nothing for root; setuid; setgid when group
    execute is set or the writer is not in the file's group."""
    if writer.uid == 0:
        return 0
    bits = inode.mode & stat.S_ISUID
    if inode.mode & stat.S_ISGID and (inode.mode & stat.S_IXGRP
                                      or not writer.in_group(inode.gid)):
        bits |= stat.S_ISGID
    return bits


class FileTable:
    def __init__(self, meta: MetaStore, data: DataStore, cache: BlockCache, stats: Stats,
                 space: Space, passthrough: Passthrough, session: Session,
                 on_attributes_changed: Callable[[int], None],
                 on_removed: Callable[[Removed], None]) -> None:
        self.meta = meta
        self.read_meta = MetaReads(meta.engine.shared)
        self.data = data
        self.cache = cache
        self.passthrough = passthrough
        self.verifier = Verifier(data, stats)
        self.hasher = LateHasher(data, meta, self.verifier, stats)
        self.stats = stats
        self.space = space
        self.session = session
        self.on_attributes_changed = on_attributes_changed  # tell the kernel (setuid cleared)
        self.on_removed = on_removed  # tell the kernel names vanished (eviction, lost data)
        self._handles: dict[int, Handle] = {}
        self._open: dict[int, OpenInode] = {}
        self._cached_version: dict[int, int] = {}  # what the kernel page cache may hold
        self._read_directly: dict[int, int] = {}  # versions read once, bypassing the cache
        self._next_fh = count(1)
        self._clock = count(1)  # orders writers' changes: the latest one's size is shown
        self._opening: Counter[int] = Counter()  # opens under way, per inode
        self._blob_ids: range = range(0)
        self._doomed: list[int] = []  # blobs whose data files the reaper deletes
        # Committed blobs a flush is still moving into blobs/, and those of them replaced
        # meanwhile: deleted only once their publishing is over.
        self._publishing: set[int] = set()
        self._doomed_when_published: set[int] = set()
        self._reap_wanted = trio.Event()

    # -- attributes ----------------------------------------------------------------------

    async def attributes(self, ino: int) -> Inode:
        """The committed inode (also of files unlinked while open), with the size of what
        its latest writer on this host wrote: the kernel keeps one size per inode, and a
        writer's fstat and SEEK_END must see its own writes (other handles still read the
        version they opened)."""
        state = self._open.get(ino)
        inode = (state.inode if state and state.unlinked
                 else await self.read_meta(self.meta.get, ino))
        state = self._open.get(ino)  # (it may have changed meanwhile)
        if state is None:
            return inode
        sizes = [(handle.changed_at, own) for handle in state.handles
                 if handle.writable and (own := handle.own_size()) is not None]
        if not sizes:
            return inode
        size, allocated = max(sizes)[1]
        return replace(inode, size=size, allocated=allocated)

    def open_inodes(self) -> frozenset[int]:
        return frozenset(self._open)

    def has_writer(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and any(handle.writable for handle in state.handles)

    # -- open / close --------------------------------------------------------------------

    async def open(self, inode: Inode, flags: int, caller: Caller,
                   created: bool = False) -> Opened:
        """Open a file; `created`: by the request that made it (its maker may write through
        the kernel)."""
        self._opening[inode.ino] += 1  # seen by writers deciding whether they are alone
        try:
            opened = await self._open_file(inode, flags, caller, created)
            return replace(opened, read_only=flags & os.O_ACCMODE == os.O_RDONLY)
        finally:
            self._opening[inode.ino] -= 1
            if not self._opening[inode.ino]:
                del self._opening[inode.ino]

    async def _open_file(self, inode: Inode, flags: int, caller: Caller,
                         created: bool) -> Opened:
        if inode.is_dir:
            raise fail(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if flags & os.O_TRUNC and not writable:  # O_RDONLY|O_TRUNC truncates, as on Linux
            inode = await self.truncate_path(inode, 0, caller)
        if writable:
            await self._wait_for_kernel_users(inode.ino)
        # Read again, with its blob record in one snapshot: commits run in worker threads,
        # so it may have changed since the lookup.
        inode, blob = await self._content(inode.ino)
        if self._backing_conflict(inode.ino, writable, flags, blob):
            await self._wait_for_kernel_users(inode.ino)
            inode, blob = await self._content(inode.ino)
        inode, blob = await self._hold(inode, blob)
        try:
            fd = await self._open_blob(inode, blob)
            if self._passes_through(writable, flags, blob):
                assert blob is not None and fd is not None  # a blob: _open_blob opened it
                await self._verify_whole(inode, blob, fd)
            if self._backing_conflict(inode.ino, writable, flags, blob):
                if fd is not None:
                    os.close(fd)
                raise fail(errno.EBUSY)  # passthrough readers of another version stay open
        except BaseException:
            if blob is not None:
                await self.session.release(blob.blob_id)
            raise
        handle = Handle(next(self._next_fh), inode.ino, writable, bool(flags & os.O_APPEND),
                        inode.version, blob, fd,
                        kill_privs=caller if writable and caller.uid else None)
        self.space.touch(inode.ino)
        state = self._open.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        contended = state.writers_waiting or any(
            h.version != inode.version or h.writable for h in state.handles)
        state.handles.add(handle)
        self._handles[handle.fh] = handle
        if writable and flags & os.O_TRUNC:
            await self.truncate(handle, 0)
            await self._clear_privileges(handle)  # truncation by open is a write: it clears them
        if self.passthrough.available():
            if writable:
                return await self._open_writer(state, handle, flags, created)
            return self._open_for_passthrough(state, handle,
                                              self._passes_through(writable, flags, blob))
        self.stats.opens_daemon += not writable
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

    async def _content(self, ino: int) -> tuple[Inode, BlobInfo | None]:
        """The inode and its blob record, with block sums: those of a blob the kernel wrote
        are taken first if the background has not yet (EIO, the file dropped, if its data
        file is not what was committed)."""
        inode, blob = await self.read_meta(self.meta.content, ino)
        if blob is not None and blob.pending:
            try:
                await self.hasher.take_sums(blob.blob_id)
            except ChecksumError as error:
                await self._drop_damaged(inode, str(error), blob)
                raise fail(errno.EIO) from None
            inode, blob = await self.read_meta(self.meta.content, ino)
        return inode, blob

    async def _hold(self, inode: Inode, blob: BlobInfo | None
                    ) -> tuple[Inode, BlobInfo | None]:
        """Hold the blob about to be opened (released with the handle). In a shared pool the
        hold is recorded first and the inode read again: a blob that another host replaced
        in between may already be on its way out, so the new one is held instead."""
        while blob is not None:
            await self.session.hold(blob.blob_id)
            if not self.session.shared:
                break
            try:
                again, again_blob = await self._content(inode.ino)
            except BaseException:
                await self.session.release(blob.blob_id)  # removed meanwhile, by another host
                raise
            if again_blob is not None and again_blob.blob_id == blob.blob_id:
                return again, again_blob
            await self.session.release(blob.blob_id)
            inode, blob = again, again_blob
        return inode, blob

    def _passes_through(self, writable: bool, flags: int, blob: BlobInfo | None) -> bool:
        """Readers of a committed blob, not O_DIRECT (the kernel would read the blob with
        the caller's flags, and O_DIRECT needs aligned buffers on the volume)."""
        return (not writable and not flags & os.O_DIRECT and blob is not None
                and self.passthrough.available())

    def _backing_conflict(self, ino: int, writable: bool, flags: int,
                          blob: BlobInfo | None) -> bool:
        """The kernel keeps one backing file per inode and then accepts only opens that use
        it: a writer, or a reader of another version, must wait for those readers. So must
        a new reader while a writer waits: the readers drain instead of starving it."""
        state = self._open.get(ino)
        if state is None or state.backing is None:
            return False
        return not (self._passes_through(writable, flags, blob) and blob is not None
                    and state.backing.blob_id == blob.blob_id and not state.backing.writable
                    and not state.writers_waiting)

    async def _verify_whole(self, inode: Inode, blob: BlobInfo, fd: int) -> None:
        """Check every block before the kernel may read the blob (EIO and the file dropped
        if one is bad)."""
        try:
            await self.verifier.verify(fd, blob)
        except ChecksumError as error:
            os.close(fd)
            await self._drop_damaged(inode, str(error), blob)
            raise fail(errno.EIO) from None
        except BaseException:
            os.close(fd)
            raise

    def _open_for_passthrough(self, state: OpenInode, handle: Handle, wanted: bool) -> Opened:
        """With passthrough on the mount: readers share the inode's backing file; the rest
        (O_DIRECT readers, readers while a writer is open) are served by the daemon, always
        direct_io, since the kernel does not mix page-cache and passthrough opens."""
        others_served_here = any(not h.backing for h in state.handles if h is not handle)
        if (wanted and handle.blob is not None and not others_served_here
                and not state.writers_waiting):
            backing = state.backing
            if backing is None:
                backing_id = self.passthrough.register(handle.fd) if handle.fd else None
                if backing_id is not None:
                    backing = state.backing = Backing(handle.blob.blob_id, backing_id, 0)
            if backing is not None and backing.blob_id == handle.blob.blob_id:
                backing.users += 1
                handle.backing = True
                self.stats.opens_passthrough += 1
                return Opened(handle.fh, direct_io=False, keep_cache=False,
                              backing_id=backing.backing_id)
        self.stats.opens_daemon += 1
        return Opened(handle.fh, direct_io=True, keep_cache=True)

    async def _open_writer(self, state: OpenInode, handle: Handle, flags: int,
                           created: bool) -> Opened:
        """The maker of a new file (LMCache's `<key>.tmp`), alone on it, writes through the
        kernel straight into its staged file, in room reserved up front. Others are served
        here, direct_io, each write accounted and hashed as it comes: a reader that opens a
        file beside a kernel writer cannot be (the kernel takes no other open of the inode)
        and waits for it, so rewrites of files others may be reading stay served here."""
        inode = state.inode
        if (not created or flags & os.O_DIRECT or len(state.handles) > 1
                or state.writers_waiting or self._opening[inode.ino] > 1):
            return self._served_writer(handle)
        staged = await self._staged(handle)
        handle.reserved = await self.space.reserve_for_kernel_writer()
        backing_id = self.passthrough.register(staged.fd) if handle.reserved else None
        if backing_id is None:
            self.space.unstage(handle.reserved)
            handle.reserved = 0
            return self._served_writer(handle)
        state.backing = Backing(staged.blob_id, backing_id, writable=True)
        handle.backing = True
        handle.changed_at = next(self._clock)
        self.stats.write_opens_passthrough += 1
        return Opened(handle.fh, direct_io=False, keep_cache=False, backing_id=backing_id)

    def _served_writer(self, handle: Handle) -> Opened:
        self.stats.write_opens_daemon += 1
        return Opened(handle.fh, direct_io=True, keep_cache=True)

    async def _wait_for_kernel_users(self, ino: int) -> None:
        """Let readers the kernel serves itself (page cache, passthrough) finish before a
        writer or a reader of another version changes the kernel's view of `ino`."""
        state = self._open.get(ino)
        if state is None or not state.kernel_users():
            return
        state.writers_waiting += 1
        try:
            with trio.move_on_after(WRITER_WAIT_SECONDS):
                while state.kernel_users():
                    if state.kernel_users_gone is None:
                        state.kernel_users_gone = trio.Event()
                    await state.kernel_users_gone.wait()
            if state.kernel_users():
                log.info("%r: kernel readers still open after %.0f s", state.inode.name,
                         WRITER_WAIT_SECONDS)
        finally:
            state.writers_waiting -= 1
            self._forget_if_unused(state)

    def _forget_if_unused(self, state: OpenInode) -> None:
        """Drop an inode's open state once nothing holds it: no handle, and nobody waiting
        on it (a new state would not know they wait, and readers would not let them in)."""
        if (not state.handles and not state.writers_waiting
                and self._open.get(state.inode.ino) is state):
            del self._open[state.inode.ino]

    async def _open_blob(self, inode: Inode, blob: BlobInfo | None) -> int | None:
        if blob is None:
            return None
        try:
            return self.data.open_blob(blob.blob_id)
        except FileNotFoundError:
            if not await self.read_meta(self.meta.is_committed_blob, blob.blob_id):
                raise fail(errno.ENOENT) from None  # evicted or replaced just now
            await self._drop_damaged(inode, f"data file of blob {blob.blob_id:016x} is missing")
            raise fail(errno.ENOENT) from None

    def handle(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise fail(errno.EBADF)
        return handle

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        try:
            await self.flush(handle)
        finally:
            self._discard_staged(handle)
            self.space.unstage(handle.reserved)
            if handle.fd is not None:
                os.close(handle.fd)
            state = self._open[handle.ino]
            state.handles.discard(handle)
            if handle.backing and state.backing is not None:
                state.backing.users -= 1
                if not state.backing.users:
                    self.passthrough.unregister(state.backing.backing_id)
                    state.backing = None
            if state.kernel_users_gone is not None and not state.kernel_users():
                state.kernel_users_gone.set()
                state.kernel_users_gone = None
            self._forget_if_unused(state)
            if handle.blob is not None:
                await self.session.release(handle.blob.blob_id)

    def forget(self, ino: int) -> None:
        """The kernel dropped the inode, and with it any cached pages."""
        self._cached_version.pop(ino, None)
        self._read_directly.pop(ino, None)

    # -- retiring ------------------------------------------------------------------------

    def retire(self, removed: Removed, behind_kernel: bool = False) -> None:
        """The one owner of a file's names going (unlink, rename over, eviction, lost data):
        names removed `behind_kernel` (not by a request) are invalidated in the kernel; once
        the inode has none left, its open handles keep serving and its blob is doomed."""
        if behind_kernel:
            self.on_removed(removed)
        if not removed.gone:
            return
        inode = removed.inode
        state = self._open.get(inode.ino)
        if state is not None:
            state.inode = inode
            state.unlinked = True
        self._cached_version.pop(inode.ino, None)
        self._read_directly.pop(inode.ino, None)
        self.free_blob(inode.blob)

    def free_blob(self, blob_id: int) -> None:
        if not blob_id:
            return
        self.cache.drop_blob(blob_id)
        self.verifier.forget(blob_id)
        if self.session.shared:
            self.session.want_sweep()  # which deletes it once no host holds it
            return
        if blob_id in self._publishing:
            self._doomed_when_published.add(blob_id)
            return
        self._doomed.append(blob_id)
        self._reap_wanted.set()

    def _publishing_over(self, blob_id: int) -> None:
        self._publishing.discard(blob_id)
        if blob_id in self._doomed_when_published:
            self._doomed_when_published.discard(blob_id)
            self.free_blob(blob_id)

    async def run_reaper(self) -> None:
        """Background: delete the data files of doomed blobs in a worker thread."""
        while True:
            await self._reap_wanted.wait()
            self._reap_wanted = trio.Event()
            doomed, self._doomed = self._doomed, []
            try:
                await off_loop(self._reap, doomed)
            except Exception:
                self.stats.background_errors += 1
                log.exception("deleting %d data files failed; recovery retries them",
                              len(doomed))

    def reap_remaining(self) -> None:
        """At unmount: delete what the reaper had not reached yet."""
        doomed = self._doomed + sorted(self._doomed_when_published)
        self._doomed, self._doomed_when_published = [], set()
        self._reap(doomed)

    async def evicted(self, removed: list[Removed]) -> None:
        """Retire eviction's victims and delete their data files before eviction returns:
        the room it made must be on the volume, not only in the counters."""
        for victim in removed:
            self.retire(victim, behind_kernel=True)
        doomed, self._doomed = self._doomed, []
        if doomed:
            await off_loop(self._reap, doomed)

    def _reap(self, doomed: list[int]) -> None:
        reap_doomed(self.meta, self.data, doomed)

    # -- data ----------------------------------------------------------------------------

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        handle = self.handle(fh)
        self.space.touch(handle.ino)
        data: bytes | bytearray | memoryview
        if handle.staged is not None:
            data = handle.staged.read(offset, size)
        elif handle.blob is None:
            data = b""
        else:
            assert handle.fd is not None  # a handle's blob and its open file go together
            try:
                data = await self.cache.read(handle.fd, handle.blob, offset, size)
            except ChecksumError as error:
                await self._drop_damaged(self._open[handle.ino].inode, str(error),
                                         handle.blob)
                raise fail(errno.EIO) from None
        self.stats.bytes_read += len(data)
        return data

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.handle(fh)
        async with handle.lock:
            staged = await self._staged(handle)
            if handle.append:
                offset = staged.size
            chunk = memoryview(data)[: writable_length(offset, len(data))]
            written = await self._change(staged, staged.growth_bound(offset, len(chunk)),
                                         lambda: staged.write(offset, chunk))
            handle.changed_at = next(self._clock)
        self.stats.bytes_written += written
        await self._clear_privileges(handle)
        return written

    async def _clear_privileges(self, handle: Handle) -> None:
        """On a handle's first write, as Linux does (once: later writes find nothing)."""
        if handle.kill_privs is not None:
            writer, handle.kill_privs = handle.kill_privs, None
            await self.clear_privileges(handle.ino, writer)

    async def clear_privileges(self, ino: int, writer: Caller) -> None:
        """A write or truncate by `writer` clears setuid/setgid as Linux would."""
        bits = privileges_to_clear(await self.attributes(ino), writer)
        if bits:
            await off_loop(self.meta.set_attrs, ino, clear_mode=bits)
            self.on_attributes_changed(ino)

    async def truncate(self, handle: Handle, size: int) -> None:
        async with handle.lock:
            staged = await self._staged(handle, fresh=True)
            await self._change(staged, staged.truncate_growth_bound(size),
                               lambda: staged.truncate(size))
            handle.changed_at = next(self._clock)

    async def truncate_path(self, inode: Inode, size: int, caller: Caller) -> Inode:
        """truncate(2) without a handle: a write handle opened, resized and closed at once.
        A size that cannot be had changes nothing (no new version, no eviction)."""
        check_file_size(size)
        opened = await self.open(inode, os.O_WRONLY, caller)
        handle = self._handles[opened.fh]
        try:
            await self.truncate(handle, size)
        except BaseException:
            self._discard_staged(handle)
            raise
        finally:
            await self.release(opened.fh)
        return await self.attributes(inode.ino)

    async def _staged(self, handle: Handle, fresh: bool = False) -> StagedFile:
        """The handle's staged file, made on its first change. Of a passthrough writer,
        with what the kernel wrote into it; after a commit, a new one over the same data
        when the kernel wrote again or `fresh` (a change is coming)."""
        if not handle.writable:
            raise fail(errno.EBADF)
        staged = handle.staged
        if handle.backing and staged is not None:
            return await self._take_kernel_writes(handle, staged, fresh)
        if staged is not None and staged.committed:
            self._discard_staged(handle)  # its publication failed: retried there, or left
        if handle.staged is None:
            handle.staged = StagedFile(self.data, await self._new_blob_id(), handle.fd,
                                       handle.blob)
        return handle.staged

    async def _take_kernel_writes(self, handle: Handle, staged: StagedFile,
                                  fresh: bool) -> StagedFile:
        if staged.committed:
            if not (fresh or staged.kernel_wrote()):
                return staged
            handle.staged = StagedFile.again(staged, await self._new_blob_id())
            self._discard_staged_file(staged)
            self.space.stage(handle.staged.physical)
            return handle.staged
        before = staged.physical
        staged.take_kernel_writes()
        self.space.stage(staged.physical - before)
        return staged

    async def _new_blob_id(self) -> int:
        while not self._blob_ids:  # (another task may take the stock while this one waits)
            self._blob_ids = await off_loop(self.meta.allocate_blob_ids, BLOB_ID_BATCH)
        blob_id, self._blob_ids = self._blob_ids[0], self._blob_ids[1:]
        return blob_id

    async def _change(self, staged: StagedFile, growth_bound: int,
                      change: Callable[[], T]) -> T:
        """Make room for what `change` may add to the staged file (or fail before changing
        anything), run it, and account for what it really added."""
        before = staged.physical
        await self.space.reserve(growth_bound)
        try:
            return change()
        finally:
            self.space.stage(staged.physical - before)

    async def flush(self, handle: Handle) -> bool:
        """Commit what this handle wrote: one metadata transaction makes it visible whole.
        Can be retried after any failure: a committed blob is never committed again nor
        deleted. Returns whether anything was committed."""
        async with handle.lock:
            staged = handle.staged
            if staged is None:
                return False
            if handle.backing:
                staged = await self._staged(handle)
            if not staged.changed:  # every change it tried failed: no new version
                if not handle.backing:  # (the kernel may still write into a writer's file)
                    self._discard_staged(handle)
                return False
            if not staged.committed and not await self._commit(handle, staged):
                return False
            if not staged.published:  # failed right after the commit: try again, or say why
                await off_loop(staged.publish)
            self._publishing_over(staged.blob_id)
            self.verifier.written(staged.blob_id, staged.fd)
            staged.flushed()
            if not handle.backing:
                staged.close()
                handle.staged = None
            return True

    async def _commit(self, handle: Handle, staged: StagedFile) -> bool:
        # Marked and held before the commit: another writer's commit (on any host) may
        # replace it at once, and this handle goes on reading it.
        self._publishing.add(staged.blob_id)
        await self.session.hold(staged.blob_id)
        try:
            blob, inode, old_blob = await off_loop(
                self._finish_and_commit, handle.ino, staged, handle.backing)
        except BaseException as error:
            await self.session.release(staged.blob_id)
            self._publishing_over(staged.blob_id)
            if not isinstance(error, FsError) or error.errno != errno.ENOENT:
                raise
            self._discard_staged(handle)  # the file was removed meanwhile: its writes go too
            return False
        staged.mark_committed()
        if blob.pending:
            self.hasher.want(blob.blob_id)
        self.space.unstage(staged.physical)  # now counted in the metadata's used bytes
        self.free_blob(old_blob)
        # Later writes on this handle start from what it just committed.
        old_fd, handle.fd = handle.fd, self.data.open_blob(staged.blob_id)
        if old_fd is not None:
            os.close(old_fd)
        previous, handle.blob, handle.version = handle.blob, blob, inode.version
        if previous is not None:
            await self.session.release(previous.blob_id)
        self._open[handle.ino].inode = inode
        self.stats.commits += 1
        return True

    def _finish_and_commit(self, ino: int, staged: StagedFile,
                           hash_later: bool) -> tuple[BlobInfo, Inode, int]:
        """Hash (unless the kernel wrote it: then in the background, after the commit),
        commit and (in the same worker thread) publish."""
        blob = staged.finish(ino, hash_later)
        inode, old_blob = self.meta.commit_content(ino, blob)
        with contextlib.suppress(OSError):  # the flush tries again and reports the error
            staged.publish()
        return blob, inode, old_blob

    def _discard_staged(self, handle: Handle) -> None:
        staged = handle.staged
        if staged is not None:
            handle.staged = None
            self._discard_staged_file(staged)

    def _discard_staged_file(self, staged: StagedFile) -> None:
        if staged.committed:
            try:
                staged.publish()
            except OSError as error:  # readers find it in staging/; recovery publishes it
                self.stats.volume_errors += 1
                log.error("publishing blob %016x failed: %s", staged.blob_id, error)
            self._publishing_over(staged.blob_id)
        else:
            self.space.unstage(staged.physical)
        staged.discard()

    async def _drop_damaged(self, inode: Inode, reason: str,
                            blob: BlobInfo | None = None) -> None:
        """Never serve bad bytes: count, log and drop the file so readers see a miss."""
        self.stats.checksum_errors += 1
        log.error("dropping %r (ino %d): %s", inode.name, inode.ino, reason)
        try:
            current = (None if self._is_unlinked(inode.ino)
                       else await self.read_meta(self.meta.get, inode.ino))
        except FileNotFoundError:
            current = None
        if current is None or (blob is not None and current.blob != blob.blob_id):
            return  # already replaced or removed: only this snapshot was bad
        for removed in await off_loop(self.meta.drop_files, [inode.ino]):
            self.retire(removed, behind_kernel=True)

    def _is_unlinked(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and state.unlinked

