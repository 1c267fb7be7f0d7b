"""Open files: snapshot readers, staged writers, commit on close, page-cache policy, and the
retirement of files that lost their last name. In layers, each calling only those below it:

    state.py     handles, what is open per inode, the attributes a writer sees (FileState)
    retiring.py  files that lost their last name; the reaper of their data files
    writing.py   staged writes, commit and publish on flush
    __init__.py  FileTable: open (page-cache policy, passthrough backing files), read, release

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

import errno
import logging
import os
from dataclasses import replace

import trio

from kvfs.callers_cpu import on_loop, wake
from kvfs.data import ChecksumError, block_sums, check_blob_size, check_file_size
from kvfs.files.state import (
    WRITER_WAIT_SECONDS,
    Backing,
    Caller,
    Handle,
    Opened,
    OpenInode,
    privileges_to_clear,
)
from kvfs.files.writing import WritingOps
from kvfs.loads import OTHER
from kvfs.meta import Inode
from kvfs.models import model_of
from kvfs.offloop import off_loop
from kvfs.records import BlobInfo, FsError, fail
from kvfs.verify import VerifyMode

log = logging.getLogger(__name__)

__all__ = ["Caller", "FileTable", "Handle", "Opened"]


class FileTable(WritingOps):
    async def open(self, ino: int, flags: int, caller: Caller, made: Inode | None = None
                   ) -> Opened:
        """Open inode `ino`; `made`: the inode this request just made (a CREATE), empty."""
        self._opening[ino] += 1  # seen by writers deciding whether they are alone
        try:
            opened = await self._open_file(ino, flags, caller, made)
            if flags & os.O_ACCMODE != os.O_RDONLY:
                return opened
            return replace(opened, read_only=True)
        finally:
            self._opening[ino] -= 1
            if not self._opening[ino]:
                del self._opening[ino]

    async def _open_file(self, ino: int, flags: int, caller: Caller, made: Inode | None
                         ) -> Opened:
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        sums = not self._sums_may_wait(writable, flags)
        held = False
        if made is not None:  # empty: its writer starts from nothing, whatever another
            inode, blob = made, None  # host writes meanwhile
        elif writable or flags & os.O_TRUNC:
            inode, blob = await self._content_to_change(ino, flags, caller, sums)
        elif self.session.shared:  # a reader's one worker call: its read records its hold
            inode, blob = await self._read_holding(ino, sums)
            held = True
        else:  # a reader's one metadata read (commits run in worker threads: read at open)
            inode, blob = await self._content(ino, sums)
        if inode.is_dir:
            raise fail(errno.EISDIR)  # (a directory has no blob: nothing held)
        # Another process's kernel users (page cache, passthrough) get a short while to close
        # first, so that two instances storing one chunk at once do not mix; after it, and at
        # once within one process, the open is served beside them, as on a local disk.
        others = not self._opened_by_process(ino, caller)
        if not writable and others and self._backing_conflict(inode.ino, writable, flags, blob):
            if held and blob is not None:
                await self.session.release(blob.blob_id)
            held = False
            await self._wait_for_kernel_users(inode.ino)
            inode, blob = await self._content(inode.ino, sums)
        if not held:
            inode, blob = await self._hold(inode, blob, sums)
        try:
            fd = await self._open_blob(inode, blob)
            if self._passes_through(writable, flags, blob):
                assert blob is not None and fd is not None  # a blob: _open_blob opened it
                await self._verify_whole(inode, blob, fd, bool(flags & os.O_DIRECT))
        except BaseException:
            if blob is not None:
                await self.session.release(blob.blob_id)
            raise
        handle = Handle(next(self._next_fh), inode.ino, writable, bool(flags & os.O_APPEND),
                        inode.version, blob, fd, caller, bool(flags & os.O_DIRECT),
                        kill_privs=caller if writable and caller.uid else None)
        if made is None:  # (a create's atime is its make's, and its close's commit sets it)
            self.space.note_use(inode.ino)
        if not writable and blob is not None:
            self.stats.bytes_opened += blob.size
            self.prefetcher.opened(blob.blob_id, bool(flags & os.O_DIRECT))
            handle.load_model = model_of(inode.name) or OTHER
            self.loads.opened(handle.load_model, blob.size)
        state = self._open.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        contended = bool(state.writers_waiting) or any(
            h.version != inode.version or h.writable for h in state.handles)
        state.handles.add(handle)
        self._handles[handle.fh] = handle
        try:
            return await self._answer_open(state, handle, flags, contended)
        except BaseException:
            del self._handles[handle.fh]
            await on_loop()
            with trio.CancelScope(shield=True):
                await self._close_handle(handle)
            raise

    async def _answer_open(self, state: OpenInode, handle: Handle, flags: int,
                           contended: bool) -> Opened:
        """How the kernel is to do the I/O of a handle just opened (and a truncating open's
        truncate)."""
        inode, writable, blob, fd = state.inode, handle.writable, handle.blob, handle.fd
        if writable and flags & os.O_TRUNC:
            await self.truncate(handle, 0)
            await self._clear_privileges(handle)  # truncation by open is a write: it clears them
        if self.passthrough.available():
            if writable:
                return await self._open_writer(state, handle, flags)
            opened = self._open_for_passthrough(state, handle,
                                                self._passes_through(writable, flags, blob))
            if not handle.backing and blob is not None and blob.pending:
                handle.blob = await self._summed(inode, blob, fd)  # the daemon checks its reads
            return opened
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

    async def _content_to_change(self, ino: int, flags: int, caller: Caller, sums: bool
                                 ) -> tuple[Inode, BlobInfo | None]:
        """The content a writer (or a truncating open) starts from: read once other
        processes' kernel users had their while to close (`open`)."""
        inode = await self.meta_call(self.meta.get, ino)
        if inode.is_dir:
            raise fail(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if flags & os.O_TRUNC and not writable:  # O_RDONLY|O_TRUNC truncates, as on Linux
            await self.truncate_path(inode, 0, caller)
        if writable and not self._opened_by_process(ino, caller):
            await self._wait_for_kernel_users(ino)
        # Read again, with its blob record in one snapshot: commits run in worker threads,
        # so it may have changed since.
        return await self._content(ino, sums)

    async def _content(self, ino: int, sums: bool = True) -> tuple[Inode, BlobInfo | None]:
        """The inode and its blob record; with block sums if `sums`: those of a blob the
        kernel wrote are taken first if the background has not yet (EIO, the file dropped,
        if its data file is not what was committed)."""
        inode, blob = await self.meta_call(self.meta.content, ino)
        if sums and blob is not None and blob.pending:
            await self._take_sums(inode, blob)
            inode, blob = await self.meta_call(self.meta.content, ino)
        return inode, blob

    def _sums_may_wait(self, writable: bool, flags: int) -> bool:
        """Whether a blob the kernel wrote may be opened before its block sums are taken:
        by a reader the kernel serves, under `--verify once`. The sums would be read from the
        same volume the reader reads, so taking them first checks nothing for this reader;
        it only reads the blob twice (LMCache's local_disk retrieving right after a store ran
        at half speed). The daemon's own reads check each block, so they need the sums."""
        return (self.verifier.mode is VerifyMode.ONCE and self.passthrough.available()
                and not writable and self.passthrough.takes(flags))

    async def _take_sums(self, inode: Inode, blob: BlobInfo) -> None:
        """Take the block sums of a blob the kernel wrote, if the background has not yet
        (EIO, the file dropped, if its data file is not what was committed)."""
        try:
            await self.hasher.take_sums(blob.blob_id)
        except ChecksumError as error:
            await self._drop_damaged(inode, str(error), blob)
            raise fail(errno.EIO) from None

    async def _summed(self, inode: Inode, blob: BlobInfo, fd: int | None) -> BlobInfo:
        """A held blob's record with its block sums, for an open that was to pass through
        without them and is served here after all. Its record may be gone (replaced
        meanwhile); its data file, held, is not: the sums are then taken from it here."""
        await self._take_sums(inode, blob)
        summed = await self.meta_call(self.meta.blob_info, blob.blob_id)
        if summed is not None:
            return summed
        assert fd is not None  # a blob: _open_blob opened it
        return replace(blob, sums=await off_loop(block_sums, fd, blob.size), pending=False)

    async def _hold(self, inode: Inode, blob: BlobInfo | None, sums: bool
                    ) -> tuple[Inode, BlobInfo | None]:
        """Hold the blob about to be opened (released with the handle). In a shared pool a
        hold that did not stand already is recorded in a change that reads the inode again
        (`_read_holding`): a blob that another host replaced in between may already be on
        its way out, so whatever the inode names then is held instead."""
        if blob is None or self.session.hold_standing(blob.blob_id):
            return inode, blob
        return await self._read_holding(inode.ino, sums)

    async def _read_holding(self, ino: int, sums: bool) -> tuple[Inode, BlobInfo | None]:
        """(Shared pool) `_content`, read in the change that records this host's hold of the
        blob read (released with the handle)."""
        inode, blob = await self.session.read_holding(ino)
        if not (sums and blob is not None and blob.pending):
            return inode, blob
        try:
            again, again_blob = await self._content(ino, sums)
        except BaseException:
            await self.session.release(blob.blob_id)  # removed meanwhile, by another host
            raise
        if again_blob is not None and again_blob.blob_id == blob.blob_id:
            return again, again_blob
        await self.session.release(blob.blob_id)
        return await self._hold(again, again_blob, sums)

    def _passes_through(self, writable: bool, flags: int, blob: BlobInfo | None) -> bool:
        """Readers of a committed blob, O_DIRECT ones too unless --odirect daemon."""
        return not writable and blob is not None and self.passthrough.takes(flags)

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

    async def _verify_whole(self, inode: Inode, blob: BlobInfo, fd: int, direct: bool) -> None:
        """Check every block before the kernel may read the blob, unless the mount's verify
        mode says an earlier check still holds (EIO and the file dropped if one is bad). A
        blob whose sums are still pending (`_sums_may_wait`) has only its size checked, and
        its opening holds the sums back like a kernel writer's commit: they come once the
        kernel's I/O on such blobs is quiet."""
        try:
            if blob.pending:
                self.hasher.kernel_busy()
                check_blob_size(fd, blob)
            else:
                await self.verifier.verify(fd, blob, direct)
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
            if (backing is not None and backing.blob_id == handle.blob.blob_id
                    and not backing.writable):  # (a writer's file: it may write on)
                backing.users += 1
                handle.backing = True
                self.stats.opens_passthrough += 1
                return Opened(handle.fh, direct_io=False, keep_cache=False,
                              backing_id=backing.backing_id)
        self.stats.opens_daemon += 1
        return self._served(state, handle)

    def _served(self, state: OpenInode, handle: Handle) -> Opened:
        """An open the daemon serves (direct_io). Beside a backing file of the inode it names
        that file too: the kernel accepts only passthrough opens of an inode that has one,
        and direct_io still sends this open's reads and writes here."""
        if state.backing is None:
            return Opened(handle.fh, direct_io=True, keep_cache=True)
        state.backing.users += 1
        handle.shares_backing = True
        return Opened(handle.fh, direct_io=True, keep_cache=False,
                      backing_id=state.backing.backing_id)

    async def _open_writer(self, state: OpenInode, handle: Handle, flags: int) -> Opened:
        """A writer alone on its file (a maker like LMCache's `<key>.tmp`, a rewriter, an
        appender; O_DIRECT or not) writes through the kernel straight into its staged file,
        in room reserved up front; a rewrite's staged file starts as a copy of the committed
        content (copy_file_range: the volume's reflink where it has one). Writers beside
        other opens of the file are served here, direct_io, each write accounted and hashed
        as it comes: the kernel takes no other open of an inode beside a writer's backing
        file, so a reader arriving meanwhile waits for it or is served here too."""
        inode = state.inode
        if (not self._alone(state) or not self.passthrough.takes(flags)
                or handle.kill_privs and privileges_to_clear(inode, handle.kill_privs)):
            return self._served_writer(state, handle)  # (a write clears setuid/gid: seen here)
        staged = await self._staged(handle)
        try:
            await self._copy_base(staged)
        except FsError:  # no room for a copy now: served here, copied when a write needs it
            return self._served_writer(state, handle)
        handle.reserved = await self.space.reserve_for_kernel_writer()
        # Opens that came meanwhile were answered without a backing file, and the kernel
        # fails (EIO) any such open of an inode that has one: with company, served here.
        alone = self._alone(state)
        backing_id = self.passthrough.register(staged.fd) if handle.reserved and alone else None
        if backing_id is None:
            self.space.kernel_writer_closed(handle.reserved)
            handle.reserved = 0
            return self._served_writer(state, handle)
        state.backing = Backing(staged.blob_id, backing_id, writable=True)
        handle.backing = True
        handle.changed_at = next(self._clock)
        self.stats.write_opens_passthrough += 1
        return Opened(handle.fh, direct_io=False, keep_cache=False, backing_id=backing_id)

    def _alone(self, state: OpenInode) -> bool:
        """Whether the handle being opened is the inode's only one, opened or opening."""
        return (len(state.handles) == 1 and not state.writers_waiting
                and self._opening[state.inode.ino] == 1)

    def _served_writer(self, state: OpenInode, handle: Handle) -> Opened:
        self.stats.write_opens_daemon += 1
        return self._served(state, handle)

    def _opened_by_process(self, ino: int, caller: Caller) -> bool:
        """Whether the caller's process (any of its threads) has `ino` open already."""
        state = self._open.get(ino)
        if state is None or not state.handles:
            return False
        process = caller.process()
        return any(handle.opener.process() == process for handle in state.handles)

    async def _wait_for_kernel_users(self, ino: int) -> None:
        """Let readers the kernel serves itself (page cache, passthrough) finish before a
        writer or a reader of another version changes the kernel's view of `ino`."""
        if not self._kernel_users(ino):
            return
        await on_loop()
        state = self._open.get(ino)
        if state is None or not state.kernel_users():  # (gone meanwhile)
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

    def _kernel_users(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and state.kernel_users()

    async def _open_blob(self, inode: Inode, blob: BlobInfo | None) -> int | None:
        if blob is None:
            return None
        try:
            return self.data.open_blob(blob.blob_id)
        except FileNotFoundError:
            if not await self.meta_call(self.meta.is_committed_blob, blob.blob_id):
                raise fail(errno.ENOENT) from None  # evicted or replaced just now
            await self._drop_damaged(inode, f"data file of blob {blob.blob_id:016x} is missing")
            raise fail(errno.ENOENT) from None

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        try:
            if handle.writable:  # (a reader has nothing to commit)
                await self.flush(handle)
        finally:
            await self._close_handle(handle)

    async def _close_handle(self, handle: Handle) -> None:
        """Let go of what a handle holds (its flush is done, or it never opened)."""
        self._discard_staged(handle)
        self.space.kernel_writer_closed(handle.reserved)
        if handle.load_model is not None:
            self.loads.closed(handle.load_model)
        if handle.fd is not None:
            os.close(handle.fd)
        state = self._open[handle.ino]
        state.handles.discard(handle)
        if (handle.backing or handle.shares_backing) and state.backing is not None:
            state.backing.users -= 1
            if not state.backing.users:
                self.passthrough.unregister(state.backing.backing_id)
                state.backing = None
        if state.kernel_users_gone is not None and not state.kernel_users():
            wake(state.kernel_users_gone)
            state.kernel_users_gone = None
        self._forget_if_unused(state)
        if handle.blob is not None:
            await self.session.release(handle.blob.blob_id)

    def forget(self, ino: int) -> None:
        """The kernel dropped the inode, and with it any cached pages."""
        self._cached_version.pop(ino, None)
        self._read_directly.pop(ino, None)

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        handle = self.handle(fh)
        self.space.note_use(handle.ino)
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

    async def truncate_path(self, inode: Inode, size: int, caller: Caller) -> Inode:
        """truncate(2) without a handle: a write handle opened, resized and closed at once.
        A size that cannot be had changes nothing (no new version, no eviction)."""
        check_file_size(size)
        opened = await self.open(inode.ino, os.O_WRONLY, caller)
        handle = self._handles[opened.fh]
        try:
            await self.truncate(handle, size)
        except BaseException:
            self._discard_staged(handle)
            raise
        finally:
            await self.release(opened.fh)
        return await self.attributes(inode.ino)
