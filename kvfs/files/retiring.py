"""Retiring files that lost their last name (unlink, rename over, eviction, damaged data):
their open handles keep serving, their blobs are doomed in the same metadata change, and the
reaper (kvfs/pool/reaper.py's rules, in a worker thread) deletes the data files."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from kvfs.data.cache import BlockCache
from kvfs.data.store import DataStore
from kvfs.data.verify import Verifier
from kvfs.files.kernel_inodes import KernelInodes
from kvfs.files.state import FileState
from kvfs.meta import Inode, MetaStore, Removed
from kvfs.meta.calls import MetaCalls, off_loop
from kvfs.observe.stats import Stats
from kvfs.pool.reaper import reap_doomed
from kvfs.pool.sessions import Session
from kvfs.records import BlobInfo

log = logging.getLogger(__name__)


class Retirer:
    """The one owner of files losing their last name, and of the deletion of blobs' data
    files: at once by the reaper, or once a flush has published them (`publishing`) or a
    passthrough writer no longer writes into them. Holds the open-file state (which files
    are open, which blobs kernel writers write into) and what retiring touches: the read
    cache, the verifier's marks, this host's session, the kernel's inodes."""

    def __init__(self, state: FileState, meta: MetaStore, data: DataStore, cache: BlockCache,
                 verifier: Verifier, session: Session, kernel: KernelInodes, stats: Stats,
                 on_removed: Callable[[Removed], None]) -> None:
        """`on_removed`: tell the kernel names vanished (eviction, lost data)."""
        self.state = state
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.cache = cache
        self.verifier = verifier
        self.session = session
        self.kernel = kernel
        self.stats = stats
        self.on_removed = on_removed
        self._doomed: list[int] = []  # blobs whose data files the reaper deletes
        # Committed blobs a flush is still moving into blobs/, and those of them replaced
        # meanwhile: deleted only once their publishing is over.
        self._publishing: set[int] = set()
        self._doomed_when_published: set[int] = set()
        # Committed blobs a passthrough writer still writes into (after a close of one of
        # its descriptors): deleted once it is done with them.
        self._doomed_when_closed: set[int] = set()
        self._reap_wanted = trio.Event()
        self._reaping = trio.Lock()  # held while a worker deletes doomed blobs' data files

    def retire(self, removed: Removed, behind_kernel: bool = False) -> None:
        """The one owner of a file's names going (unlink, rename over, eviction, lost data):
        names removed `behind_kernel` (not by a request) are invalidated in the kernel; once
        the inode has none left, its open handles keep serving and its blob is doomed."""
        if behind_kernel:
            self.on_removed(removed)
        if not removed.gone:
            return
        inode = removed.inode
        state = self.state.inodes.get(inode.ino)
        if state is not None:
            state.inode = inode
            state.unlinked = True
        for nodeid in self.kernel.all_of(inode.ino):
            self.state.forget_pages(nodeid)
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
        if self.state.kernel_writes_into(blob_id):  # its writer stages it again from its name
            self._doomed_when_closed.add(blob_id)
            return
        self._doomed.append(blob_id)
        self._reap_wanted.set()

    def writer_closed(self) -> None:
        """Doom what waited for a kernel writer that no longer writes into it."""
        if not self._doomed_when_closed:
            return
        for blob_id in [blob_id for blob_id in self._doomed_when_closed
                        if not self.state.kernel_writes_into(blob_id)]:
            self._doomed_when_closed.discard(blob_id)
            self.free_blob(blob_id)

    def publishing(self, blob_id: int) -> None:
        """A committed blob is on its way into blobs/: freed only once `publishing_over`."""
        self._publishing.add(blob_id)

    def publishing_over(self, blob_id: int) -> None:
        self._publishing.discard(blob_id)
        if blob_id in self._doomed_when_published:
            self._doomed_when_published.discard(blob_id)
            self.free_blob(blob_id)

    async def run_reaper(self) -> None:
        """Background: delete the data files of doomed blobs in a worker thread."""
        while True:
            await self._reap_wanted.wait()
            self._reap_wanted = trio.Event()
            await self._reap_doomed()

    async def deletions_done(self) -> bool:
        """Return once the data files of every blob doomed so far are deleted; whether any
        were still to delete. A writer short of volume room waits for them: on a local disk
        an unlink frees the room at once."""
        pending = bool(self._doomed) or self._reaping.locked()
        if pending:
            await self._reap_doomed()
        return pending

    async def _reap_doomed(self) -> None:
        async with self._reaping:  # after a deletion under way, the rest
            doomed, self._doomed = self._doomed, []
            if not doomed:
                return
            try:
                await off_loop(self._reap, doomed)
            except Exception:
                self.stats.background_errors += 1
                log.exception("deleting %d data files failed; recovery retries them",
                              len(doomed))

    def reap_remaining(self) -> None:
        """At unmount: delete what the reaper had not reached yet."""
        doomed = (self._doomed + sorted(self._doomed_when_published)
                  + sorted(self._doomed_when_closed))
        self._doomed, self._doomed_when_published, self._doomed_when_closed = [], set(), set()
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

    async def drop_damaged(self, inode: Inode, reason: str,
                           blob: BlobInfo | None = None) -> None:
        """Never serve bad bytes: count, log and drop the file so readers see a miss. Not
        a blob a write-only writer on this host still writes through the kernel after a
        close committed it (its duplicate descriptor or a forked copy wrote on): its next
        close commits what it holds (the caller still answers EIO)."""
        if blob is not None and self.state.kernel_writes_into(blob.blob_id):
            log.warning("%r (ino %d): blob %016x is being written again by its writer, not "
                        "dropped: %s", inode.name, inode.ino, blob.blob_id, reason)
            return
        self.stats.checksum_errors += 1
        log.error("dropping %r (ino %d): %s", inode.name, inode.ino, reason)
        try:
            current = (None if self.state.is_unlinked(inode.ino)
                       else await self.meta_call(self.meta.namespace.get, inode.ino))
        except FileNotFoundError:
            current = None
        if current is None or (blob is not None and current.blob != blob.blob_id):
            return  # already replaced or removed: only this snapshot was bad
        for removed in await self.meta_call(self.meta.content.drop_files, [inode.ino]):
            self.retire(removed, behind_kernel=True)
