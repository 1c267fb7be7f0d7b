"""The content an open starts from: the inode and its blob record read (with block sums, or
their taking left for later: kvfs/data/verify.py's LateHasher), the blob held by this host
(released with the handle), its data file opened, and verified whole before the kernel may
read it. A file whose data is bad is dropped, never served."""

from __future__ import annotations

import errno
import os
from dataclasses import replace

from kvfs.data.store import ChecksumError, DataStore, block_sums, check_blob_size
from kvfs.data.verify import LateHasher, Verifier
from kvfs.files.retiring import Retirer
from kvfs.meta import Inode, MetaStore
from kvfs.meta.calls import MetaCalls, off_loop
from kvfs.pool.sessions import Session
from kvfs.records import BlobInfo, fail


class Contents:
    """Reads, holds, opens and verifies what opens start from. Holds the metadata and data
    stores, this host's session (holds), the verifier and late hasher, and the retirer
    (which drops a damaged file)."""

    def __init__(self, meta: MetaStore, data: DataStore, session: Session, verifier: Verifier,
                 hasher: LateHasher, retirer: Retirer) -> None:
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.session = session
        self.verifier = verifier
        self.hasher = hasher
        self.retirer = retirer

    async def read(self, ino: int, sums: bool = True) -> tuple[Inode, BlobInfo | None]:
        """The inode and its blob record; with block sums if `sums`: those of a blob the
        kernel wrote are taken first if the background has not yet (EIO, the file dropped,
        if its data file is not what was committed)."""
        inode, blob = await self.meta_call(self.meta.content.get, ino)
        if sums and blob is not None and blob.pending:
            await self._take_sums(inode, blob)
            inode, blob = await self.meta_call(self.meta.content.get, ino)
        return inode, blob

    async def _take_sums(self, inode: Inode, blob: BlobInfo) -> None:
        """Take the block sums of a blob the kernel wrote, if the background has not yet
        (EIO, the file dropped, if its data file is not what was committed)."""
        try:
            await self.hasher.take_sums(blob.blob_id)
        except ChecksumError as error:
            await self.retirer.drop_damaged(inode, str(error), blob)
            raise fail(errno.EIO) from None

    async def summed(self, inode: Inode, blob: BlobInfo, fd: int | None) -> BlobInfo:
        """A held blob's record with its block sums, for an open that was to pass through
        without them and is served here after all. Its record may be gone (replaced
        meanwhile); its data file, held, is not: the sums are then taken from it here."""
        await self._take_sums(inode, blob)
        summed = await self.meta_call(self.meta.content.blob_info, blob.blob_id)
        if summed is not None:
            return summed
        assert fd is not None  # a blob: open_blob opened it
        return replace(blob, sums=await off_loop(block_sums, fd, blob.size), pending=False)

    async def hold(self, inode: Inode, blob: BlobInfo | None, sums: bool
                   ) -> tuple[Inode, BlobInfo | None]:
        """Hold the blob about to be opened (released with the handle). In a shared pool a
        hold that did not stand already is recorded in a change that reads the inode again
        (`read_holding`): a blob that another host replaced in between may already be on
        its way out, so whatever the inode names then is held instead."""
        if blob is None or self.session.hold_standing(blob.blob_id):
            return inode, blob
        return await self.read_holding(inode.ino, sums)

    async def read_holding(self, ino: int, sums: bool) -> tuple[Inode, BlobInfo | None]:
        """(Shared pool) `read`, read in the change that records this host's hold of the
        blob read (released with the handle)."""
        inode, blob = await self.session.read_holding(ino)
        if not (sums and blob is not None and blob.pending):
            return inode, blob
        try:
            again, again_blob = await self.read(ino, sums)
        except BaseException:
            await self.session.release(blob.blob_id)  # removed meanwhile, by another host
            raise
        if again_blob is not None and again_blob.blob_id == blob.blob_id:
            return again, again_blob
        await self.session.release(blob.blob_id)
        return await self.hold(again, again_blob, sums)

    async def verify_whole(self, inode: Inode, blob: BlobInfo, fd: int, direct: bool) -> None:
        """Check every block before the kernel may read the blob, unless the mount's verify
        mode says an earlier check still holds (EIO and the file dropped if one is bad). A
        blob whose sums are still pending (opened without them: FileTable's `_sums_may_wait`)
        has only its size checked, and its opening holds the sums back like a kernel writer's
        commit: they come once the kernel's I/O on such blobs is quiet."""
        try:
            if blob.pending:
                self.hasher.kernel_busy()
                check_blob_size(fd, blob)
            else:
                await self.verifier.verify(fd, blob, direct)
        except ChecksumError as error:
            os.close(fd)
            await self.retirer.drop_damaged(inode, str(error), blob)
            raise fail(errno.EIO) from None
        except BaseException:
            os.close(fd)
            raise

    async def open_blob(self, inode: Inode, blob: BlobInfo | None) -> int | None:
        """The blob's data file, opened (None: no blob). ENOENT if it is gone: evicted or
        replaced just now, or lost (then the file is dropped)."""
        if blob is None:
            return None
        try:
            return self.data.open_blob(blob.blob_id)
        except FileNotFoundError:
            if not await self.meta_call(self.meta.content.is_committed_blob, blob.blob_id):
                raise fail(errno.ENOENT) from None  # evicted or replaced just now
            await self.retirer.drop_damaged(
                inode, f"data file of blob {blob.blob_id:016x} is missing")
            raise fail(errno.ENOENT) from None
