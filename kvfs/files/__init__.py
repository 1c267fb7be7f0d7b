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

The kernel's inodes (kvfs/files/kernel_inodes.py, kvfs/files/policy.py): the kernel keeps one page
cache and at most one backing file per inode and maps every open of it onto them, so one
kernel inode holds either readers of one version or one writer. An open that cannot join the
opens on its kernel inode is answered ESTALE after the file got a fresh one, and the kernel
opens that instead. So every open's maps show what its reads show, and a committed blob is
never written in place: writers write their staged copy, by write or by map.

Passthrough (where the kernel grants it, kvfs/files/passthrough.py): a reader's open verifies the
whole blob, then hands it to the kernel, which serves every read and map from the blob itself
without the daemon; a writer alone writes its staged file the same way. Opens the daemon
serves (O_DIRECT under --odirect daemon, writers that clear setuid/setgid) are direct_io;
beside readers' backing file they name it too (the kernel requires it; it holds their version).

Without passthrough: the first read of a version bypasses the kernel page cache (direct_io):
the kernel then sends a whole chunk's requests at once, answered as the volume delivers,
without filling pages nobody may read again. A version opened again is read through the page
cache and kept there across opens (keep_cache) while the kernel inode's pages can be of that
version alone: committed blobs are immutable, so a chunk read by several instances is then
served from kernel memory. Shared maps of direct_io opens go through the same page cache.

Retiring: a file whose last name went (unlink, rename over it, eviction, lost data) keeps
serving its open handles; its blob is doomed in the same metadata transaction and its data
file deleted by the reaper, in a worker thread, off the request loop.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import replace
from typing import NoReturn

import trio

from kvfs.caller import Caller
from kvfs.data.store import ChecksumError, block_sums, check_blob_size, check_file_size
from kvfs.data.verify import VerifyMode
from kvfs.files.policy import shares_kernel_inode
from kvfs.files.state import (
    Backing,
    Handle,
    Opened,
    OpenInode,
    privileges_to_clear,
)
from kvfs.files.writing import WritingOps
from kvfs.meta import Inode
from kvfs.meta.calls import off_loop
from kvfs.observe.loads import OTHER
from kvfs.observe.models import model_of
from kvfs.records import BlobInfo, FsError, fail

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # an open refused (ESTALE) this recently by the same thread is its retry
RETRY_WAIT_SECONDS = 2.0  # how long a retry waits for its kernel inode before a refusal
REFUSALS_KEPT = 1024

__all__ = ["FileTable", "Handle", "Opened"]


class FileTable(WritingOps):
    async def open(self, ino: int, flags: int, caller: Caller, made: Inode | None = None,
                   nodeid: int | None = None) -> Opened:
        """Open inode `ino` on the kernel inode `nodeid` (None: an open of kvfs's own, which
        the kernel does not see); `made`: the inode this request just made (a CREATE)."""
        opened = await self._open_file(ino, flags, caller, made, nodeid)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            return opened
        return replace(opened, read_only=True)

    async def _open_file(self, ino: int, flags: int, caller: Caller, made: Inode | None,
                         nodeid: int | None) -> Opened:
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
        if not held:
            inode, blob = await self._hold(inode, blob, sums)
        try:
            beside = await self._claim_kernel_inode(inode, nodeid, flags, caller)
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
                        nodeid=nodeid, kill_privs=caller if writable and caller.uid else None)
        try:  # (others may have come meanwhile)
            handle.beside = beside or self._claim_again(inode, nodeid, flags, caller)
        except BaseException:
            await self._close_handle(handle)
            raise
        if made is None:  # (a create's atime is its make's, and its close's commit sets it)
            self.space.note_use(inode.ino)
        if not writable and blob is not None:
            self.stats.bytes_opened += blob.size
            self.prefetcher.opened(blob.blob_id, bool(flags & os.O_DIRECT))
            handle.load_model = model_of(inode.name) or OTHER
            self.loads.opened(handle.load_model, blob.size)
        state = self._open.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        state.handles.add(handle)
        self._handles[handle.fh] = handle
        try:
            return await self._answer_open(state, handle, flags)
        except BaseException:
            del self._handles[handle.fh]
            with trio.CancelScope(shield=True):
                await self._close_handle(handle)
            raise

    async def _claim_kernel_inode(self, inode: Inode, nodeid: int | None, flags: int,
                                  caller: Caller) -> bool:
        """Whether the open can be answered on kernel inode `nodeid`: with the opens on it
        (`shares_kernel_inode`: False), or beside them, served here (True: a write-only
        open, which can neither read nor map, retried after a refusal). Else ESTALE, after
        giving the file a fresh kernel inode unless its current one is free: the kernel then
        looks the name up again and opens that one (kvfs/files/kernel_inodes.py). A retry that
        finds its kernel inode taken again (two retries can meet on one lookup) waits a
        short while for it before it is refused."""
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if (nodeid is not None and not self._fits(inode, nodeid, writable)
                and flags & os.O_ACCMODE != os.O_WRONLY and self._retrying(caller, inode.ino)):
            state = self._open[inode.ino]
            with trio.move_on_after(RETRY_WAIT_SECONDS):
                while not self._fits(inode, nodeid, writable):
                    await state.closed.wait()
        return self._claim_again(inode, nodeid, flags, caller)

    def _claim_again(self, inode: Inode, nodeid: int | None, flags: int, caller: Caller
                     ) -> bool:
        """`_claim_kernel_inode` without waiting: also at the moment the handle joins."""
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if nodeid is None or self._fits(inode, nodeid, writable):
            return False
        if flags & os.O_ACCMODE == os.O_WRONLY and self._retrying(caller, inode.ino):
            return True
        self._refuse(inode, nodeid, caller)

    def _fits(self, inode: Inode, nodeid: int, writable: bool) -> bool:
        state = self._open.get(inode.ino)
        on_it = [] if state is None else [h for h in state.handles if h.nodeid == nodeid]
        return shares_kernel_inode(on_it, writable, inode.version)

    def _retrying(self, caller: Caller, ino: int) -> bool:
        """Whether the calling thread's open of `ino` was refused (ESTALE) just now: this
        is the kernel's retry, and a second refusal would reach the caller."""
        refused = self._refused.get((caller.pid, ino))
        return refused is not None and time.monotonic() - refused < RETRY_SECONDS

    def _refuse(self, inode: Inode, nodeid: int, caller: Caller) -> NoReturn:
        state = self._open.get(inode.ino)
        current = self.kernel.nodeid(inode.ino)
        if current == nodeid or state is not None and any(
                h.nodeid == current for h in state.handles):
            self.kernel.renew(inode.ino)
        now = time.monotonic()
        if len(self._refused) > REFUSALS_KEPT:
            self._refused = {key: when for key, when in self._refused.items()
                             if now - when < RETRY_SECONDS}
        self._refused[caller.pid, inode.ino] = now
        self.stats.opens_renewed += 1
        raise fail(errno.ESTALE)

    async def _answer_open(self, state: OpenInode, handle: Handle, flags: int) -> Opened:
        """How the kernel is to do the I/O of a handle just opened (and a truncating open's
        truncate). Its kernel inode holds readers of its version alone, or it alone."""
        inode, writable, blob, fd = state.inode, handle.writable, handle.blob, handle.fd
        if writable and flags & os.O_TRUNC:
            await self.truncate(handle, 0)
            await self._clear_privileges(handle)  # truncation by open is a write: it clears them
        if handle.beside:
            self.stats.write_opens_daemon += 1
            return self._served(state, handle)
        if self.passthrough.available() and handle.nodeid is not None:
            if writable:
                return await self._open_writer(state, handle, flags)
            opened = self._open_for_passthrough(state, handle,
                                                self._passes_through(writable, flags, blob))
            if not handle.backing and blob is not None and blob.pending:
                handle.blob = await self._summed(inode, blob, fd)  # the daemon checks its reads
            return opened
        keep = self._keeps_cache(handle)
        if writable or handle.nodeid is None:
            return Opened(handle.fh, direct_io=True, keep_cache=keep)
        self.stats.opens_daemon += 1
        if not keep and fd is not None:
            self.data.will_read(fd)  # the kernel's pages are not there: reads will come here
        if self._read_directly.get(handle.nodeid) != inode.version and not keep:
            self._read_directly[handle.nodeid] = inode.version
            return Opened(handle.fh, direct_io=True, keep_cache=keep)
        return Opened(handle.fh, direct_io=False, keep_cache=keep)

    def _keeps_cache(self, handle: Handle) -> bool:
        """Whether the kernel may keep the pages it holds of the handle's kernel inode: only
        if they can be of no other version than the one the handle reads (maps read those
        pages, also of direct_io opens). Writers' pages are their own, never kept."""
        if handle.nodeid is None:
            return True
        if handle.writable:
            self._cached_version.pop(handle.nodeid, None)
            self._read_directly.pop(handle.nodeid, None)
            return False
        keep = self._cached_version.get(handle.nodeid) == handle.version
        self._cached_version[handle.nodeid] = handle.version
        return keep

    async def _content_to_change(self, ino: int, flags: int, caller: Caller, sums: bool
                                 ) -> tuple[Inode, BlobInfo | None]:
        """The content a writer (or a truncating open) starts from."""
        inode = await self.meta_call(self.meta.namespace.get, ino)
        if inode.is_dir:
            raise fail(errno.EISDIR)
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        if flags & os.O_TRUNC and not writable:  # O_RDONLY|O_TRUNC truncates, as on Linux
            await self.truncate_path(inode, 0, caller)
        # Read again, with its blob record in one snapshot: commits run in worker threads,
        # so it may have changed since.
        return await self._content(ino, sums)

    async def _content(self, ino: int, sums: bool = True) -> tuple[Inode, BlobInfo | None]:
        """The inode and its blob record; with block sums if `sums`: those of a blob the
        kernel wrote are taken first if the background has not yet (EIO, the file dropped,
        if its data file is not what was committed)."""
        inode, blob = await self.meta_call(self.meta.content.get, ino)
        if sums and blob is not None and blob.pending:
            await self._take_sums(inode, blob)
            inode, blob = await self.meta_call(self.meta.content.get, ino)
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
        summed = await self.meta_call(self.meta.content.blob_info, blob.blob_id)
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
        """With passthrough on the mount: readers of one version on one kernel inode share
        its backing file; the rest (O_DIRECT readers under --odirect daemon, readers beside
        those) are served by the daemon, always direct_io, since the kernel does not mix
        page-cache and passthrough opens of an inode."""
        nodeid = handle.nodeid
        assert nodeid is not None  # (kvfs's own opens are served: `_answer_open`)
        others_served_here = any(not h.backing for h in state.handles
                                 if h is not handle and h.nodeid == nodeid)
        if wanted and handle.blob is not None and not others_served_here:
            backing = state.backings.get(nodeid)
            if backing is None:
                backing_id = self.passthrough.register(handle.fd) if handle.fd else None
                if backing_id is not None:
                    backing = state.backings[nodeid] = Backing(handle.blob.blob_id,
                                                               backing_id, 0)
            if backing is not None:
                # (`shares_kernel_inode`: the backing file is this version's blob)
                assert backing.blob_id == handle.blob.blob_id and not backing.writable
                backing.users += 1
                handle.backing = True
                self.stats.opens_passthrough += 1
                return Opened(handle.fh, direct_io=False, keep_cache=False,
                              backing_id=backing.backing_id)
        self.stats.opens_daemon += 1
        return self._served(state, handle)

    def _served(self, state: OpenInode, handle: Handle) -> Opened:
        """An open the daemon serves (direct_io). Beside a backing file of its kernel inode
        it names that file too: the kernel accepts only passthrough opens of an inode that
        has one (its maps then map that file, which holds the same version), and direct_io
        still sends this open's reads here."""
        assert handle.nodeid is not None
        backing = state.backings.get(handle.nodeid)
        if backing is None:
            return Opened(handle.fh, direct_io=True, keep_cache=self._keeps_cache(handle))
        backing.users += 1
        handle.shares_backing = True
        return Opened(handle.fh, direct_io=True, keep_cache=False,
                      backing_id=backing.backing_id)

    async def _open_writer(self, state: OpenInode, handle: Handle, flags: int) -> Opened:
        """A write-only writer, alone on its kernel inode (`shares_kernel_inode`): a maker
        like LMCache's `<key>.tmp`, a rewriter, an appender, O_DIRECT or not, writes through
        the kernel straight into its staged file, in room reserved up front; a rewrite's
        staged file starts as a copy of the committed content (copy_file_range: the
        volume's reflink where it has one). The rest are served here, direct_io, each write
        accounted and hashed as it comes: read-write opens (the only ones that can map the
        file for writing, and a map outlives the close that commits: through the kernel,
        its later stores would land in the committed blob; here they make a new version),
        writers whose writes must clear setuid/setgid, O_DIRECT under --odirect daemon."""
        inode = state.inode
        assert handle.nodeid is not None
        if (flags & os.O_ACCMODE == os.O_RDWR or not self.passthrough.takes(flags)
                or handle.kill_privs and privileges_to_clear(inode, handle.kill_privs)):
            return self._served_writer(state, handle)  # (a write clears setuid/gid: seen here)
        staged = await self._staged(handle)
        try:
            await self._copy_base(staged)
        except FsError:  # no room for a copy now: served here, copied when a write needs it
            return self._served_writer(state, handle)
        handle.reserved = await self.space.reserve_for_kernel_writer()
        # A write-only retry may have joined meanwhile without a backing file to name (kvfs
        # served it), and the kernel fails any such open of an inode that has one: then
        # this writer is served here too.
        alone = not any(other is not handle and other.nodeid == handle.nodeid
                        for other in state.handles)
        backing_id = (self.passthrough.register(staged.fd) if handle.reserved and alone
                      else None)
        if backing_id is None:
            self.space.kernel_writer_closed(handle.reserved)
            handle.reserved = 0
            return self._served_writer(state, handle)
        state.backings[handle.nodeid] = Backing(staged.blob_id, backing_id, writable=True)
        handle.backing = True
        handle.changed_at = next(self._clock)
        self.stats.write_opens_passthrough += 1
        return Opened(handle.fh, direct_io=False, keep_cache=False, backing_id=backing_id)

    def _served_writer(self, state: OpenInode, handle: Handle) -> Opened:
        self.stats.write_opens_daemon += 1
        return self._served(state, handle)

    async def _open_blob(self, inode: Inode, blob: BlobInfo | None) -> int | None:
        if blob is None:
            return None
        try:
            return self.data.open_blob(blob.blob_id)
        except FileNotFoundError:
            if not await self.meta_call(self.meta.content.is_committed_blob, blob.blob_id):
                raise fail(errno.ENOENT) from None  # evicted or replaced just now
            await self._drop_damaged(inode, f"data file of blob {blob.blob_id:016x} is missing")
            raise fail(errno.ENOENT) from None

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh)
        try:
            if handle.writable:  # (a reader has nothing to commit)
                await self.flush(handle, closing=False)
        finally:
            await self._close_handle(handle)

    async def _close_handle(self, handle: Handle) -> None:
        """Let go of what a handle holds (its flush is done, or it never opened)."""
        self._discard_staged(handle)
        if handle.backing and handle.writable:
            self._writer_closed()
        self.space.kernel_writer_closed(handle.reserved)
        if handle.load_model is not None:
            self.loads.closed(handle.load_model)
        if handle.fd is not None:
            os.close(handle.fd)
        state = self._open.get(handle.ino)
        if state is not None and handle in state.handles:
            state.handles.discard(handle)
            state.closed.set()
            state.closed = trio.Event()
            nodeid = handle.nodeid
            backing = state.backings.get(nodeid) if nodeid is not None else None
            if (handle.backing or handle.shares_backing) and backing is not None:
                backing.users -= 1
                if not backing.users:
                    self.passthrough.unregister(backing.backing_id)
                    del state.backings[nodeid]  # type: ignore[arg-type]  # (a backing: not None)
            self._forget_if_unused(state)
        if handle.blob is not None:
            await self.session.release(handle.blob.blob_id)

    def forget(self, nodeid: int, lookups: int) -> None:
        """The kernel dropped its inode `nodeid`, and with it any cached pages."""
        self._cached_version.pop(nodeid, None)
        self._read_directly.pop(nodeid, None)
        self.kernel.forget(nodeid, lookups)

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
