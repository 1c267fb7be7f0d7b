"""Open files: snapshot readers, staged writers, commit on close, page-cache policy, and the
retirement of files that lost their last name. One object per part, each holding the parts
it calls, passed in by the composition root (kvfs/daemon.py); none holds one above it:

    __init__.py  FileTable: open, read, release; the operations the FUSE layer calls, which
                 it hands to the writer, the retirer or the state. Holds the four below.
    writing.py   Writer: staged writes, commit and publish on flush. Holds the state and
                 the retirer.
    content.py   Contents: what an open starts from: the inode and blob read, held,
                 opened, verified whole. Holds the retirer.
    retiring.py  Retirer: files that lost their last name; the reaper of their data files.
                 Holds the state.
    state.py     FileState: handles, what is open per inode, the attributes a writer sees.
    policy.py    serve_open: how an open is served, decided from facts the table gathers
                 (no I/O, no state); FileTable does the mechanics of each answer.

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
from kvfs.data.cache import BlockCache
from kvfs.data.store import ChecksumError, DataStore, check_file_size
from kvfs.data.verify import LateHasher, Verifier, VerifyMode
from kvfs.files.content import Contents
from kvfs.files.kernel_inodes import KernelInodes
from kvfs.files.passthrough import Passthrough
from kvfs.files.policy import OpenFacts, Serving, serve_open
from kvfs.files.prefetch import Prefetcher
from kvfs.files.retiring import Retirer
from kvfs.files.spares import SpareFiles
from kvfs.files.state import (
    Backing,
    FileState,
    Handle,
    Opened,
    OpenInode,
    privileges_to_clear,
)
from kvfs.files.writing import Writer
from kvfs.meta import Inode, MetaStore, Removed
from kvfs.meta.calls import MetaCalls
from kvfs.observe.loads import OTHER, LoadMeter
from kvfs.observe.models import model_of
from kvfs.observe.stats import Stats
from kvfs.pool.sessions import Session
from kvfs.pool.space import Space
from kvfs.records import BlobInfo, FsError, fail

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # an open refused (ESTALE) this recently by the same thread is its retry
RETRY_WAIT_SECONDS = 2.0  # how long a retry waits for its kernel inode before a refusal
REFUSALS_KEPT = 1024

__all__ = ["Contents", "FileState", "FileTable", "Handle", "Opened", "Retirer", "Writer"]


class FileTable:
    """The open files of a mount, as the FUSE layer sees them: opens (how each is served:
    `serve_open`; passthrough backing files), reads and releases, and the operations it hands
    on to the state, the writer and the retirer it holds. Holds too what opening and reading
    use: the contents (what an open starts from), the stores and read cache, the space
    manager (uses, kernel writers' room), this host's session (holds), passthrough, the
    kernel's inodes, the verifier (its mode), the prefetcher and the load meter."""

    def __init__(self, state: FileState, writer: Writer, retirer: Retirer,
                 content: Contents, *, meta: MetaStore, data: DataStore, cache: BlockCache,
                 space: Space, session: Session, stats: Stats, passthrough: Passthrough,
                 kernel: KernelInodes, verifier: Verifier, prefetcher: Prefetcher,
                 loads: LoadMeter) -> None:
        self.state = state
        self.writer = writer
        self.retirer = retirer
        self.content = content
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.cache = cache
        self.space = space
        self.session = session
        self.stats = stats
        self.passthrough = passthrough
        self.kernel = kernel  # which of the kernel's inodes each open is on
        self.verifier = verifier
        self.prefetcher = prefetcher
        self.loads = loads
        self._refused: dict[tuple[int, int], float] = {}  # (thread, ino) -> when (ESTALE)

    @property
    def hasher(self) -> LateHasher:
        return self.content.hasher

    @property
    def spares(self) -> SpareFiles:
        return self.writer.spares

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
        inode, blob = await self._content_for_open(ino, flags, caller, made)
        try:
            beside = await self._claim_kernel_inode(inode, nodeid, flags, blob, caller)
            fd = await self.content.open_blob(inode, blob)
            if self._passes_through(writable, flags, blob):
                assert blob is not None and fd is not None  # a blob: open_blob opened it
                await self.content.verify_whole(inode, blob, fd, bool(flags & os.O_DIRECT))
        except BaseException:
            if blob is not None:
                await self.session.release(blob.blob_id)
            raise
        handle = Handle(next(self.state.next_fh), inode.ino, writable,
                        bool(flags & os.O_APPEND), inode.version, blob, fd, caller,
                        bool(flags & os.O_DIRECT), nodeid=nodeid,
                        kill_privs=caller if writable and caller.uid else None)
        try:  # (others may have come meanwhile)
            handle.beside = beside or self._claim_again(inode, nodeid, flags, blob, caller)
        except BaseException:
            await self._close_handle(handle)
            raise
        if made is None:  # (a create's atime is its make's, and its close's commit sets it)
            self.space.note_use(inode.ino)
        if not writable and blob is not None:
            self.stats.bytes_opened += blob.size
            self.stats.clients.loaded(inode.name, blob.size)
            self.prefetcher.opened(blob.blob_id, bool(flags & os.O_DIRECT))
            handle.load_model = model_of(inode.name) or OTHER
            self.loads.opened(handle.load_model, blob.size)
        state = self.state.inodes.setdefault(inode.ino, OpenInode(inode))
        state.inode = inode
        state.handles.add(handle)
        self.state.handles[handle.fh] = handle
        try:
            return await self._answer_open(state, handle, flags)
        except BaseException:
            del self.state.handles[handle.fh]
            with trio.CancelScope(shield=True):
                await self._close_handle(handle)
            raise

    async def _content_for_open(self, ino: int, flags: int, caller: Caller, made: Inode | None
                                ) -> tuple[Inode, BlobInfo | None]:
        """The inode an open starts from, and its blob, held (released with the handle)."""
        writable = flags & os.O_ACCMODE != os.O_RDONLY
        sums = not self._sums_may_wait(writable, flags)
        held = False
        if made is not None:  # empty: its writer starts from nothing, whatever another
            inode, blob = made, None  # host writes meanwhile
        elif writable or flags & os.O_TRUNC:
            inode, blob = await self._content_to_change(ino, flags, caller, sums)
        elif self.session.shared:  # a reader's one worker call: its read records its hold
            inode, blob = await self.content.read_holding(ino, sums)
            held = True
        else:  # a reader's one metadata read (commits run in worker threads: read at open)
            inode, blob = await self.content.read(ino, sums)
        if inode.is_dir:
            raise fail(errno.EISDIR)  # (a directory has no blob: nothing held)
        return (inode, blob) if held else await self.content.hold(inode, blob, sums)

    def _facts(self, inode: Inode, nodeid: int | None, flags: int, blob: BlobInfo | None,
               handle: Handle | None = None, *, retrying: bool = False,
               waited: bool = False) -> OpenFacts:
        """What `serve_open` decides from, as things stand: an open of `inode` on kernel inode
        `nodeid`, before it joins the opens there, or once it has (`handle`)."""
        return OpenFacts(
            flags, blob is not None, inode.version if handle is None else handle.version,
            own=nodeid is None,
            others=() if nodeid is None else self.state.on_kernel_inode(inode.ino, nodeid,
                                                                        but=handle),
            retrying=retrying, waited=waited, joined=handle is not None,
            beside=handle is not None and handle.beside,
            passthrough=self.passthrough.available(), kernel_o_direct=self.passthrough.o_direct,
            clears_privileges=handle is not None and handle.kill_privs is not None
            and bool(privileges_to_clear(inode, handle.kill_privs)),
            cached_version=None if nodeid is None else self.state.cached_version.get(nodeid),
            read_directly=None if nodeid is None else self.state.read_directly.get(nodeid),
            inherited=nodeid is not None and self.kernel.inherited(nodeid))

    async def _claim_kernel_inode(self, inode: Inode, nodeid: int | None, flags: int,
                                  blob: BlobInfo | None, caller: Caller) -> bool:
        """Whether the open can be answered on kernel inode `nodeid`: with the opens on it
        (False), or beside them, served here (True: `Serving.WRITER_BESIDE`). Else ESTALE,
        after giving the file a fresh kernel inode unless its current one is free: the
        kernel then looks the name up again and opens that one (kvfs/files/kernel_inodes.py).
        A retry that finds its kernel inode taken again (two retries can meet on one lookup)
        waits a short while for it before it is refused (`Serving.WAIT`)."""
        retrying = self._retrying(caller, inode.ino)
        if serve_open(self._facts(inode, nodeid, flags, blob, retrying=retrying)
                      ) is Serving.WAIT:
            state = self.state.inodes[inode.ino]  # (opens it cannot join are there)
            with trio.move_on_after(RETRY_WAIT_SECONDS):
                while serve_open(self._facts(inode, nodeid, flags, blob, retrying=True)
                                 ) is Serving.WAIT:
                    await state.closed.wait()
        return self._claim_again(inode, nodeid, flags, blob, caller)

    def _claim_again(self, inode: Inode, nodeid: int | None, flags: int,
                     blob: BlobInfo | None, caller: Caller) -> bool:
        """`_claim_kernel_inode` without waiting: also at the moment the handle joins."""
        serving = serve_open(self._facts(inode, nodeid, flags, blob, waited=True,
                                         retrying=self._retrying(caller, inode.ino)))
        if serving is Serving.RENEW:
            assert nodeid is not None  # (kvfs's own opens are on no kernel inode)
            self._refuse(inode, nodeid, caller)
        return serving is Serving.WRITER_BESIDE

    def _retrying(self, caller: Caller, ino: int) -> bool:
        """Whether the calling thread's open of `ino` was refused (ESTALE) just now: this
        is the kernel's retry, and a second refusal would reach the caller."""
        refused = self._refused.get((caller.pid, ino))
        return refused is not None and time.monotonic() - refused < RETRY_SECONDS

    def _refuse(self, inode: Inode, nodeid: int, caller: Caller) -> NoReturn:
        state = self.state.inodes.get(inode.ino)
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
        """How the kernel is to do the I/O of a handle just opened (`serve_open`), after a
        truncating open's truncate. Its kernel inode holds readers of its version alone, or
        it alone, or it beside others (`Serving.WRITER_BESIDE`)."""
        if handle.writable and flags & os.O_TRUNC:
            await self.writer.truncate(handle, 0)
            await self.writer.first_write_clears(handle)  # truncation by open is a write
        serving = serve_open(self._facts(state.inode, handle.nodeid, flags, handle.blob,
                                         handle))
        if serving in (Serving.WRITER_BESIDE, Serving.DAEMON_WRITER):
            return self._served_writer(state, handle)
        if serving is Serving.PASSTHROUGH_WRITER:
            return await self._open_writer(state, handle)
        if serving in (Serving.OWN, Serving.DIRECT_WRITER):
            return Opened(handle.fh, direct_io=True, keep_cache=self._keeps_cache(handle))
        if serving in (Serving.PASSTHROUGH_READER, Serving.DAEMON_READER):
            if serving is Serving.PASSTHROUGH_READER:
                opened = self._open_for_passthrough(state, handle)
            else:
                self.stats.opens_daemon += 1
                opened = self._served(state, handle)
            blob = handle.blob
            if not handle.backing and blob is not None and blob.pending:
                # the daemon checks its reads
                handle.blob = await self.content.summed(state.inode, blob, handle.fd)
            return opened
        assert serving in (Serving.DIRECT_READER, Serving.PAGE_CACHE_READER), serving
        keep = self._keeps_cache(handle)
        self.stats.opens_daemon += 1
        if not keep and handle.fd is not None:
            self.data.will_read(handle.fd)  # the kernel's pages are not there: reads come here
        if serving is Serving.DIRECT_READER:
            assert handle.nodeid is not None  # (kvfs's own opens are `Serving.OWN`)
            self.state.read_directly[handle.nodeid] = handle.version
            return Opened(handle.fh, direct_io=True, keep_cache=keep)
        return Opened(handle.fh, direct_io=False, keep_cache=keep)

    def _keeps_cache(self, handle: Handle) -> bool:
        """Whether the kernel may keep the pages it holds of the handle's kernel inode: only
        if they can be of no other version than the one the handle reads (maps read those
        pages, also of direct_io opens). Writers' pages are their own, never kept."""
        if handle.nodeid is None:
            return True
        if handle.writable:
            self.state.forget_pages(handle.nodeid)
            return False
        keep = self.state.cached_version.get(handle.nodeid) == handle.version
        self.state.cached_version[handle.nodeid] = handle.version
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
        return await self.content.read(ino, sums)

    def _sums_may_wait(self, writable: bool, flags: int) -> bool:
        """Whether a blob the kernel wrote may be opened before its block sums are taken:
        by a reader the kernel serves, under `--verify once`. The sums would be read from the
        same volume the reader reads, so taking them first checks nothing for this reader;
        it only reads the blob twice (LMCache's local_disk retrieving right after a store ran
        at half speed). The daemon's own reads check each block, so they need the sums."""
        return (self.verifier.mode is VerifyMode.ONCE and self.passthrough.available()
                and not writable and self.passthrough.takes(flags))

    def _passes_through(self, writable: bool, flags: int, blob: BlobInfo | None) -> bool:
        """Readers of a committed blob, O_DIRECT ones too unless --odirect daemon."""
        return not writable and blob is not None and self.passthrough.takes(flags)

    def _open_for_passthrough(self, state: OpenInode, handle: Handle) -> Opened:
        """`Serving.PASSTHROUGH_READER`: readers of one version on one kernel inode share its
        backing file, registered by the first; served by the daemon (direct_io) if the
        kernel refuses it."""
        nodeid, blob = handle.nodeid, handle.blob
        assert nodeid is not None and blob is not None  # (`serve_open`)
        backing = state.backings.get(nodeid)
        if backing is None:
            backing_id = self.passthrough.register(handle.fd) if handle.fd else None
            if backing_id is not None:
                backing = state.backings[nodeid] = Backing(blob.blob_id, backing_id, 0)
        if backing is None:
            self.stats.opens_daemon += 1
            return self._served(state, handle)
        # (`shares_kernel_inode`: the backing file is this version's blob)
        assert backing.blob_id == blob.blob_id and not backing.writable
        backing.users += 1
        handle.backing = True
        self.stats.opens_passthrough += 1
        return Opened(handle.fh, direct_io=False, keep_cache=False,
                      backing_id=backing.backing_id)

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

    async def _open_writer(self, state: OpenInode, handle: Handle) -> Opened:
        """`Serving.PASSTHROUGH_WRITER`: a write-only writer, alone on its kernel inode (a
        maker like LMCache's `<key>.tmp`, a rewriter, an appender, O_DIRECT or not) writes
        through the kernel straight into its staged file, in room reserved up front; a
        rewrite's staged file starts as a copy of the committed content (copy_file_range:
        the volume's reflink where it has one). Served here (direct_io, each write accounted
        and hashed as it comes) where there is no room for the copy or the reservation, or
        the kernel refuses the backing file."""
        assert handle.nodeid is not None
        staged = await self.writer.staged(handle)
        try:
            await self.writer.copy_base(staged)
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
        handle.changed_at = next(self.state.clock)
        self.stats.write_opens_passthrough += 1
        return Opened(handle.fh, direct_io=False, keep_cache=False, backing_id=backing_id)

    def _served_writer(self, state: OpenInode, handle: Handle) -> Opened:
        self.stats.write_opens_daemon += 1
        return self._served(state, handle)

    async def release(self, fh: int) -> None:
        # (a handle an earlier daemon of the connection opened, which the kernel releases
        # after a takeover, is gone with that daemon: ENOTCONN, as its other calls get)
        handle = self.state.handle(fh)
        del self.state.handles[fh]
        try:
            if handle.writable:  # (a reader has nothing to commit)
                await self.writer.flush(handle, closing=False)
        finally:
            await self._close_handle(handle)

    async def abandon(self, fh: int) -> None:
        """Let go of an open whose reply the kernel never got: nothing it staged commits."""
        await self._close_handle(self.state.handles.pop(fh))

    async def _close_handle(self, handle: Handle) -> None:
        """Let go of what a handle holds (its flush is done, or it never opened)."""
        self.writer.discard_staged(handle)
        if handle.backing and handle.writable:
            self.retirer.writer_closed()
        self.space.kernel_writer_closed(handle.reserved)
        if handle.load_model is not None:
            self.loads.closed(handle.load_model)
        if handle.fd is not None:
            os.close(handle.fd)
        state = self.state.inodes.get(handle.ino)
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
            self.state.forget_if_unused(state)
        if handle.blob is not None:
            await self.session.release(handle.blob.blob_id)

    def forget(self, nodeid: int, lookups: int) -> None:
        """The kernel dropped its inode `nodeid`, and with it any cached pages."""
        self.state.forget_pages(nodeid)
        self.kernel.forget(nodeid, lookups)

    async def read(self, fh: int, offset: int, size: int) -> bytes | bytearray | memoryview:
        handle = self.state.handle(fh)
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
                await self.retirer.drop_damaged(self.state.inodes[handle.ino].inode,
                                                str(error), handle.blob)
                raise fail(errno.EIO) from None
        self.stats.bytes_read += len(data)
        return data

    async def truncate_path(self, inode: Inode, size: int, caller: Caller) -> Inode:
        """truncate(2) without a handle: a write handle opened, resized and closed at once.
        A size that cannot be had changes nothing (no new version, no eviction)."""
        check_file_size(size)
        opened = await self.open(inode.ino, os.O_WRONLY, caller)
        handle = self.state.handles[opened.fh]
        try:
            await self.writer.truncate(handle, size)
        except BaseException:
            self.writer.discard_staged(handle)
            raise
        finally:
            await self.release(opened.fh)
        return await self.state.attributes(inode.ino)

    # What the FUSE layer and the daemon call, done by the part that owns it.

    async def attributes(self, ino: int, cached: bool = False, nodeid: int | None = None
                         ) -> Inode:
        return await self.state.attributes(ino, cached, nodeid)

    def open_inodes(self) -> frozenset[int]:
        return self.state.open_inodes()

    def is_open(self, ino: int) -> bool:
        return self.state.is_open(ino)

    def has_writer(self, ino: int) -> bool:
        return self.state.has_writer(ino)

    def serves_older_version(self, ino: int) -> bool:
        return self.state.serves_older_version(ino)

    def handle(self, fh: int) -> Handle:
        return self.state.handle(fh)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        return await self.writer.write(fh, offset, data)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        await self.writer.fallocate(fh, mode, offset, length)

    async def truncate(self, handle: Handle, size: int) -> None:
        await self.writer.truncate(handle, size)

    async def flush(self, handle: Handle, closing: bool = True) -> bool:
        return await self.writer.flush(handle, closing)

    async def clear_privileges(self, ino: int, writer: Caller) -> None:
        await self.writer.clear_privileges(ino, writer)

    async def cleared_by_chown(self, ino: int, caller: Caller) -> int:
        return await self.writer.cleared_by_chown(ino, caller)

    async def run_publisher(self) -> None:
        await self.writer.run_publisher()

    def publish_remaining(self) -> None:
        self.writer.publish_remaining()

    def session_lost(self) -> None:
        self.writer.session_lost()

    def retire(self, removed: Removed, behind_kernel: bool = False) -> None:
        self.retirer.retire(removed, behind_kernel)

    async def evicted(self, removed: list[Removed]) -> None:
        await self.retirer.evicted(removed)

    async def deletions_done(self) -> bool:
        return await self.retirer.deletions_done()

    async def run_reaper(self) -> None:
        await self.retirer.run_reaper()

    def reap_remaining(self) -> None:
        self.retirer.reap_remaining()
