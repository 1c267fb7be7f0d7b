"""File content: blob records and their ids, committing a file's new content, block sums still
to take (pending, record_sums), data files to delete (doomed, reaped), and dropping whole files
(eviction, lost data)."""

from __future__ import annotations

import errno
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import replace

from kvfs.engines.interface import CLAIM_PREFIX, Txn
from kvfs.meta.core import MetaCore
from kvfs.meta.schema import LIVE_SESSION, Inode, Removed, from_u64, u64
from kvfs.records import BlobInfo, FsError, fail


class Content:
    """Blobs: which one holds a file's content, what becomes of those replaced, and files
    dropped whole."""

    def __init__(self, core: MetaCore) -> None:
        self.core = core
        self.engine = core.engine

    def get(self, ino: int) -> tuple[Inode, BlobInfo | None]:
        """An inode and the record of its blob, as of one moment (a shared engine's reads
        are not one snapshot: a blob replaced between the two reads means read again)."""
        while True:
            with self.engine.snapshot() as txn:
                inode = self.core.get(txn, ino)
                raw = txn.get("blob", u64(inode.blob)) if inode.blob else None
                if inode.blob and raw is None and self.core.get(txn, ino).blob != inode.blob:
                    continue
            if inode.blob and raw is None:
                raise fail(errno.EIO)
            return inode, BlobInfo.unpack(inode.blob, raw) if raw is not None else None

    def get_held(self, ino: int, session: bytes) -> tuple[Inode, BlobInfo | None]:
        """`get`, read in the change that records `session`'s hold of the inode's blob (a
        shared pool's open: the read and the hold in one round trip of the loop's)."""
        def change(txn: Txn) -> tuple[Inode, BlobInfo | None]:
            inode = self.core.get(txn, ino)
            raw = txn.get("blob", u64(inode.blob)) if inode.blob else None
            if inode.blob and raw is None:
                raise fail(errno.EIO)
            if inode.blob:
                self.core.record_hold(txn, inode.blob, session)
            return inode, BlobInfo.unpack(inode.blob, raw) if raw is not None else None
        return self.core.change(change)

    def blobs(self) -> Iterator[BlobInfo]:
        with self.engine.snapshot() as txn:
            for key, raw in txn.scan("blob"):
                yield BlobInfo.unpack(from_u64(key), raw)

    def blob_info(self, blob_id: int) -> BlobInfo | None:
        with self.engine.snapshot() as txn:
            raw = txn.get("blob", u64(blob_id))
            return None if raw is None else BlobInfo.unpack(blob_id, raw)

    def is_committed_blob(self, blob_id: int) -> bool:
        with self.engine.snapshot() as txn:
            return txn.get("blob", u64(blob_id)) is not None

    def allocate_blob_ids(self, count: int) -> range:
        """Take `count` blob ids in one transaction (writers take them in batches)."""
        end = self.engine.allocate(b"next_blob", count)
        return range(end - count, end)

    def commit_content(self, ino: int, blob: BlobInfo | None, holder: bytes | None = None,
                       staged_in: bytes | None = None, claimed: int = 0) -> tuple[Inode, int]:
        """Point `ino` at a new blob (None: empty); returns the new inode and the replaced blob.
        `holder`: the session that holds the new blob open, recorded in the same change (the
        committing host of a shared pool: one round trip, not two). `staged_in`: the session
        whose staging directory holds the blob's file, which must still be its own.
        `claimed`: the room this mount's claim held for the staged file, given back in the
        same change (its bytes are counted as committed now).

        Raises ENOENT when the inode was removed meanwhile: the caller discards the blob;
        ESTALE when a reaper claimed `staged_in` (its host was declared dead): the reaper
        may be deleting the file, so the caller stages it again and commits that."""
        now = time.time_ns()
        def change(txn: Txn) -> tuple[Inode, int]:
            if staged_in is not None and txn.get("settings", LIVE_SESSION + staged_in) is None:
                raise fail(errno.ESTALE)
            inode = self.core.get(txn, ino)
            old_blob = inode.blob
            self.core.release_blob(txn, old_blob)
            size = allocated = 0
            if blob is not None:
                txn.put("blob", u64(blob.blob_id), blob.pack())
                if holder is not None:
                    self.core.record_hold(txn, blob.blob_id, holder)
                if blob.pending:
                    txn.put("pending", u64(blob.blob_id), self.core.session)
                txn.add("counters", b"used_bytes", blob.allocated)
                size, allocated = blob.size, blob.allocated
            if claimed:
                txn.add("counters", CLAIM_PREFIX + self.core.session, -claimed)
            updated = inode._replace(size=size, allocated=allocated,
                                     blob=blob.blob_id if blob else 0,
                                     version=inode.version + 1,
                                     atime_ns=now, mtime_ns=now, ctime_ns=now)
            self.core.put(txn, updated)
            self.core.index_use(txn, inode, inode.atime_ns, now)
            self.core.count_model(txn, inode, inode.name, 0, allocated - inode.allocated)
            return updated, old_blob
        return self.core.change(change)

    def pending(self, session: bytes = b"") -> list[tuple[int, int]]:
        """(blob id, owner ino) of blobs whose sums `session` was still to take."""
        with self.engine.snapshot() as txn:
            found = []
            for key, writer in txn.scan("pending"):
                raw = txn.get("blob", key)
                if raw is not None and writer == session:
                    found.append((from_u64(key), BlobInfo.unpack(from_u64(key), raw).ino))
            return found

    def record_sums(self, blob_id: int, sums: array) -> BlobInfo | None:
        """Record the block sums of a pending blob; None if it is gone (replaced, removed)."""
        def change(txn: Txn) -> BlobInfo | None:
            raw = txn.get("blob", u64(blob_id))
            if raw is None:
                return None
            settled = replace(BlobInfo.unpack(blob_id, raw), sums=sums, pending=False)
            txn.put("blob", u64(blob_id), settled.pack())
            txn.delete("pending", u64(blob_id))
            return settled
        return self.core.change(change)

    def doomed(self) -> list[int]:
        with self.engine.snapshot() as txn:
            return [from_u64(key) for key, _ in txn.scan("doomed")]

    def reaped(self, blob_ids: list[int]) -> None:
        """Doomed blobs whose files are gone: their records go."""
        if not blob_ids:
            return

        def change(txn: Txn) -> None:
            for blob_id in blob_ids:
                txn.delete("doomed", u64(blob_id))
        self.core.change(change)

    def drop_files(self, inos: Iterable[int], spare_held: bool = False) -> list[Removed]:
        """Remove files with every name they have (eviction, lost data), in one transaction;
        inodes already gone are skipped, and with `spare_held` (eviction) so are files whose
        blob a host holds open."""
        now = time.time_ns()
        def change(txn: Txn) -> list[Removed]:
            dropped = []
            for ino in inos:
                try:
                    inode = self.core.get(txn, ino)
                except FsError:
                    continue
                if spare_held and inode.blob and self.core.holders(txn, inode.blob):
                    continue
                names = self.core.names(txn, inode)
                for parent, name in names:
                    self.core.unlink(txn, parent, name, inode)
                    self.core.adjust_parent(txn, parent, 0, now)
                self.core.drop_inode(txn, inode)
                dropped.append(Removed(inode._replace(nlink=0), names))
            return dropped
        return self.core.change(change)
