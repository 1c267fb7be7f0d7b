"""Writers: each write handle fills a private staged blob (kvfs/data/staged.py's StagedFile), in
room the space manager reserved first; its flush (close) commits it in one metadata change,
from the loop where finishing it is a few small syscalls (else off the loop), and leaves its
publishing to the publisher, which no close waits for: the volume helper process renames it
(kvfs/data/volume_helper.py), or a worker on a syncing store; without a helper, the loop at once."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from kvfs.caller import Caller
from kvfs.data.staged import StagedFile
from kvfs.data.store import DataStore, writable_length
from kvfs.data.verify import LateHasher, Verifier
from kvfs.data.volume_helper import HelperGone, VolumeHelper, move
from kvfs.files.retiring import Retirer
from kvfs.files.spares import SpareFiles
from kvfs.files.state import FileState, Handle, privileges_to_clear
from kvfs.meta import Inode, MetaStore
from kvfs.meta.calls import MetaCalls, off_loop
from kvfs.observe.stats import Stats
from kvfs.pool.sessions import Session
from kvfs.pool.space import Space
from kvfs.records import BlobInfo, FsError, fail

log = logging.getLogger(__name__)

BLOB_ID_BATCH = 256
T = TypeVar("T")


class Writer:
    """Write handles' staged files, their commits, and the publisher. Holds the open-file
    state, the retirer (to which it hands the blobs a commit replaced, and those it
    publishes), the space manager (room for each change), the spares and the blob-id stock
    (a staged file's name), the verifier and the late hasher (a committed blob's checks),
    and the volume helper that publishes."""

    def __init__(self, state: FileState, retirer: Retirer, meta: MetaStore, data: DataStore,
                 space: Space, session: Session, stats: Stats, verifier: Verifier,
                 hasher: LateHasher, spares: SpareFiles, helper: VolumeHelper | None,
                 take_blob_ids: Callable[[int], Awaitable[range]],
                 on_attributes_changed: Callable[[int], None],
                 on_committed: Callable[[int, int | None], Awaitable[None]]) -> None:
        """`helper`: makes spares and publishes (kvfs/data/volume_helper.py), if alive;
        `take_blob_ids`: that many fresh blob ids; `on_attributes_changed`: tell the kernel
        (setuid cleared); `on_committed`: tell the file's other kernel inodes of a commit."""
        self.state = state
        self.retirer = retirer
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.space = space
        self.session = session
        self.stats = stats
        self.verifier = verifier
        self.hasher = hasher
        self.spares = spares
        self.helper = helper
        self.publish_later = helper is not None  # closes leave every publishing to it
        self.on_attributes_changed = on_attributes_changed
        self.on_committed = on_committed
        self._take_blob_ids = take_blob_ids
        self._blob_ids: range = range(0)
        # Blobs a close committed and left to the publisher (the volume helper's, or on a
        # syncing store a worker's), each with what it sets when done.
        self._published_later: dict[int, trio.Event] = {}
        self._to_publish, self._publish_queue = trio.open_memory_channel[StagedFile](math.inf)

    def session_lost(self) -> None:
        """(the loop) This host was declared dead while it stalled, and its reaper took its
        staging directory (made again since): spares named there are gone."""
        self.spares.forget()

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.state.handle(fh)
        async with handle.lock:
            staged = await self.staged(handle)
            if handle.append:
                offset = staged.size
            chunk = memoryview(data)[: writable_length(offset, len(data))]
            written = await self._change(staged, staged.growth_bound(offset, len(chunk)),
                                         lambda: staged.write(offset, chunk))
            handle.changed_at = next(self.state.clock)
        self.stats.bytes_written += written
        await self.first_write_clears(handle)
        return written

    async def first_write_clears(self, handle: Handle) -> None:
        """On a handle's first write, as Linux does (once: later writes find nothing)."""
        if handle.kill_privs is not None:
            writer, handle.kill_privs = handle.kill_privs, None
            await self.clear_privileges(handle.ino, writer)

    async def cleared_by_chown(self, ino: int, caller: Caller) -> int:
        """The setuid/setgid bits a chown by `caller` clears (the kernel leaves it to kvfs:
        handle_killpriv_v2)."""
        return privileges_to_clear(await self.state.attributes(ino), caller, chown=True)

    async def clear_privileges(self, ino: int, writer: Caller) -> None:
        """A write or truncate by `writer` clears setuid/setgid as Linux would."""
        bits = privileges_to_clear(await self.state.attributes(ino), writer)
        if bits:
            await self.meta_call(self.meta.namespace.set_attrs, ino, clear_mode=bits)
            self.on_attributes_changed(ino)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) on the handle's staged file: what the volume does with it, and its
        errno when it refuses (a mode it lacks, a misaligned collapse)."""
        handle = self.state.handle(fh)
        if offset < 0 or length <= 0:
            raise fail(errno.EINVAL)
        async with handle.lock:
            staged = await self.staged(handle)
            await self._change(staged, staged.fallocate_growth_bound(mode, offset, length),
                               lambda: staged.fallocate(mode, offset, length))
            handle.changed_at = next(self.state.clock)

    async def truncate(self, handle: Handle, size: int) -> None:
        async with handle.lock:
            staged = await self.staged(handle, fresh=True)
            await self._change(staged, staged.truncate_growth_bound(size),
                               lambda: staged.truncate(size))
            handle.changed_at = next(self.state.clock)

    async def staged(self, handle: Handle, fresh: bool = False) -> StagedFile:
        """The handle's staged file, made on its first change. Of a passthrough writer,
        with what the kernel wrote into it; after a commit, a new one over the same data
        when the kernel wrote again or `fresh` (a change is coming)."""
        if not handle.writable:
            raise fail(errno.EBADF)
        staged = handle.staged
        if handle.backing and staged is not None:
            return await self._take_kernel_writes(handle, staged, fresh)
        if staged is not None and staged.committed:
            self.discard_staged(handle)  # its publication failed: retried there, or left
        if handle.staged is None:
            spare = self.spares.take()
            if spare is None:
                handle.staged = StagedFile(self.data, await self._new_blob_id(), handle.fd,
                                           handle.blob)
            else:
                blob_id, fd = spare
                handle.staged = StagedFile(self.data, blob_id, handle.fd, handle.blob, fd=fd)
        return handle.staged

    async def _take_kernel_writes(self, handle: Handle, staged: StagedFile,
                                  fresh: bool) -> StagedFile:
        if staged.committed:
            if not (fresh or staged.kernel_wrote()):
                return staged
            await self._published_by_publisher(staged)  # a second name from where it lies
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
            self._blob_ids = await self._take_blob_ids(BLOB_ID_BATCH)
        blob_id, self._blob_ids = self._blob_ids[0], self._blob_ids[1:]
        return blob_id

    async def copy_base(self, staged: StagedFile) -> None:
        """Copy the committed content a rewrite keeps into the staged file, off the loop, in
        room reserved first."""
        if not staged.has_base():
            return
        before, reserved = staged.physical, staged.base_allocated()
        await self.space.reserve(reserved)
        try:
            await off_loop(staged.materialize)
        finally:
            self.space.stage(staged.physical - before, reserved)

    async def _change(self, staged: StagedFile, growth_bound: int,
                      change: Callable[[], T]) -> T:
        """Make room for what `change` may add to the staged file (or fail before changing
        anything), run it, and account for what it really added."""
        before = staged.physical
        await self.space.reserve(growth_bound)
        try:
            return change()
        finally:
            self.space.stage(staged.physical - before, max(0, growth_bound))

    async def flush(self, handle: Handle, closing: bool = True) -> bool:
        """Commit what this handle wrote: one metadata transaction makes it visible whole.
        Can be retried after any failure: a committed blob is never committed again nor
        deleted. Returns whether anything was committed. `closing`: a close (FLUSH), after
        which the content is this writer's if another's commit had replaced it; not the
        release that follows the last one."""
        async with handle.lock:
            if closing and self._overtaken(handle):
                await self._stage_again(handle)
            staged = handle.staged
            if staged is None:
                return False
            if handle.backing:
                staged = await self.staged(handle)
            if not staged.changed:  # every change it tried failed: no new version
                if not handle.backing:  # (the kernel may still write into a writer's file)
                    self.discard_staged(handle)
                return False
            if not staged.committed and not await self._commit(handle, staged):
                return False
            if staged.blob_id not in self._published_later:
                if not staged.published:  # failed right after the commit: try again, say why
                    await off_loop(staged.publish)
                self.retirer.publishing_over(staged.blob_id)
            self.verifier.written(staged.blob_id, staged.fd)
            staged.flushed()
            if not handle.backing:
                staged.close()
                handle.staged = None
            return True

    def _overtaken(self, handle: Handle) -> bool:
        """Whether another writer committed over what this one committed at an earlier
        close (of a duplicate of its descriptor, such as the one Python's mmap holds): its
        close commits its content again, so that the last writer to close wins, whole."""
        state = self.state.inodes.get(handle.ino)
        return (handle.committed and state is not None and not state.unlinked
                and state.inode.version != handle.version)

    async def _stage_again(self, handle: Handle) -> None:
        """Stage the content this handle last committed again, under a new blob id."""
        staged = await self.staged(handle, fresh=True)
        if not handle.backing:
            await self.copy_base(staged)
            staged.changed = True

    async def _commit(self, handle: Handle, staged: StagedFile, again: bool = True) -> bool:
        # Marked and held by the commit itself: another writer's commit (on any host) may
        # replace it at once, and this handle goes on reading it.
        self.retirer.publishing(staged.blob_id)
        holder = self.session.hold_committing(staged.blob_id)
        try:
            later = staged.hashes_later(handle.backing)
            if staged.finishes_quickly(handle.backing):
                blob, inode, old_blob = await self._commit_from_loop(handle.ino, staged, later,
                                                                     holder)
            else:  # copying or hashing the content: all of it off the loop
                blob, inode, old_blob = await off_loop(self._finish_and_commit, handle.ino,
                                                       staged, later, holder)
        except BaseException as error:
            await self.session.release(staged.blob_id)
            self.retirer.publishing_over(staged.blob_id)
            if isinstance(error, FsError) and error.errno == errno.ESTALE:
                # A reaper claimed the session this file was staged under (this host was
                # declared dead while it stalled), and may be deleting the file: this host
                # registers anew, stages the file again there, and commits that.
                await self.session.catch_up()
                if again and await off_loop(staged.stage_in_current):
                    return await self._commit(handle, staged, again=False)
                raise fail(errno.EIO) from None
            if not isinstance(error, FsError) or error.errno != errno.ENOENT:
                raise
            self.discard_staged(handle)  # the file was removed meanwhile: its writes go too
            return False
        staged.mark_committed()
        if blob.pending:
            self.hasher.want(blob.blob_id, on_volume=handle.direct)
        # now counted in the metadata's used bytes, and given back from the claim
        self.space.unstage(staged.physical, self.space.given_back(blob.allocated))
        self.space.committed(blob.size)
        self.retirer.free_blob(old_blob)
        # Later writes on this handle start from what it just committed (the staged file's
        # own inode: no path lookup).
        old_fd, handle.fd = handle.fd, os.dup(staged.fd)
        if old_fd is not None:
            os.close(old_fd)
        previous, handle.blob, handle.version = handle.blob, blob, inode.version
        handle.committed = True
        if previous is not None:
            await self.session.release(previous.blob_id)
        self.state.inodes[handle.ino].inode = inode
        await self.on_committed(handle.ino, handle.nodeid)
        self.stats.commits += 1
        self.stats.bytes_committed += blob.size
        self.stats.clients.stored(inode.name, blob.size)
        return True

    async def _commit_from_loop(self, ino: int, staged: StagedFile, hash_later: bool,
                                holder: bytes | None) -> tuple[BlobInfo, Inode, int]:
        """`_finish_and_commit` of a file whose finish is a few small syscalls: the commit
        goes from the loop (inline on LMDB; on Redis in one round trip of the loop's own
        connection when the host's record cache has the inode). A store that syncs (a shared
        pool's volume, or `--fsync`) finishes in a worker. The publishing rename is left to
        the publisher (readers find the blob in staging/ until it is published) where the
        volume helper does it, or where the store syncs: there the volume's operations are
        round trips. (A worker's renames, beside the loop, would cost it more in GIL
        hand-offs than it saves.)"""
        if staged.syncs:
            blob = await off_loop(staged.finish, ino, hash_later)
        else:
            blob = staged.finish(ino, hash_later)
        inode, old_blob = await self.meta_call.change(
            self.meta.content.commit_content, ino, blob, holder,
            self.session.staging_session(staged.session), self.space.given_back(blob.allocated))
        if staged.syncs or (self.publish_later and self.helper is not None
                            and self.helper.alive):
            self._published_later[staged.blob_id] = trio.Event()
            self.stats.blobs_publishing = len(self._published_later)
            self._to_publish.send_nowait(staged)
        else:
            with contextlib.suppress(OSError):  # the flush tries again and reports the error
                staged.publish()
        return blob, inode, old_blob

    async def run_publisher(self) -> None:
        """Background: publish the blobs that closes left to it (`_commit_from_loop`), all
        those queued meanwhile at once. A failure is logged and counted: the blob stays
        readable in staging/, and the handle's release or the next mount's recovery publishes
        it."""
        async for staged in self._publish_queue:
            batch = [staged, *self._queued_for_publisher()]
            try:
                for blob_id, error in await self._publish(batch):
                    self.stats.volume_errors += 1
                    log.error("publishing blob %016x failed: %s", blob_id, error)
            except Exception:  # (a bug: the publisher goes on, the mount stays up)
                self.stats.background_errors += 1
                log.exception("publishing %d blobs failed; recovery publishes them", len(batch))
            for staged in batch:
                self.retirer.publishing_over(staged.blob_id)
                self._published_later.pop(staged.blob_id).set()
            self.stats.blobs_publishing = len(self._published_later)

    async def _publish(self, batch: list[StagedFile]) -> list[tuple[int, OSError]]:
        """Publish each blob of `batch`: by the volume helper, else in a worker; the
        failures, by blob id (`_published`)."""
        moved = None
        if self.helper is not None and self.helper.alive:
            with contextlib.suppress(HelperGone):
                moved = await self.helper.publish([staged.publishing_paths()
                                                   for staged in batch])
        if moved is None:
            moved = await off_loop(_publish_all, batch)
        return self._published(batch, moved)

    @staticmethod
    def _published(batch: list[StagedFile], moved: list[int]) -> list[tuple[int, OSError]]:
        """What publishing `batch` did, an errno per blob (0: published): the failures, by
        blob id."""
        failed = []
        for staged, error in zip(batch, moved, strict=True):
            if error:
                failed.append((staged.blob_id, OSError(error, os.strerror(error))))
            else:
                staged.published_elsewhere()
        return failed

    def publish_remaining(self) -> None:
        """At unmount: publish what the publisher had not taken yet (what it had, it finished:
        a worker call is never abandoned)."""
        queued = self._queued_for_publisher()
        for blob_id, error in self._published(queued, _publish_all(queued)):
            log.error("publishing blob %016x failed: %s; recovery publishes it", blob_id, error)

    def _queued_for_publisher(self) -> list[StagedFile]:
        """Take every blob queued for the publisher right now."""
        queued = []
        with contextlib.suppress(trio.WouldBlock):
            while True:
                queued.append(self._publish_queue.receive_nowait())
        return queued

    async def _published_by_publisher(self, staged: StagedFile) -> None:
        """Return once the publisher is done with `staged` (at once if it never had it)."""
        queued = self._published_later.get(staged.blob_id)
        if queued is not None:
            await queued.wait()

    def _finish_and_commit(self, ino: int, staged: StagedFile, hash_later: bool,
                           holder: bytes | None) -> tuple[BlobInfo, Inode, int]:
        """Hash (unless the kernel wrote it and it is large: then in the background, after
        the commit), commit (with `holder`'s hold) and publish."""
        blob = staged.finish(ino, hash_later)
        inode, old_blob = self.meta.content.commit_content(
            ino, blob, holder, self.session.staging_session(staged.session),
            self.space.given_back(blob.allocated))
        with contextlib.suppress(OSError):  # the flush tries again and reports the error
            staged.publish()
        return blob, inode, old_blob

    def discard_staged(self, handle: Handle) -> None:
        staged = handle.staged
        if staged is not None:
            handle.staged = None
            self._discard_staged_file(staged)

    def _discard_staged_file(self, staged: StagedFile) -> None:
        if staged.committed:
            if staged.blob_id not in self._published_later:  # (else the publisher's to do)
                try:
                    staged.publish()
                except OSError as error:  # readers find it in staging/; recovery publishes it
                    self.stats.volume_errors += 1
                    log.error("publishing blob %016x failed: %s", staged.blob_id, error)
                self.retirer.publishing_over(staged.blob_id)
        else:
            self.space.unstage(staged.physical)
        staged.discard()


def _publish_all(batch: list[StagedFile]) -> list[int]:
    """Publish each staged blob (in a worker), as the volume helper does."""
    return [move(*staged.publishing_paths()) for staged in batch]
