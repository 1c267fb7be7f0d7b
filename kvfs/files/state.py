"""The open-file table's state: handles, what is open per inode, and the answers about it
that the writer, the retirer and the table need (kvfs/files/__init__.py describes the whole)."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from itertools import count

import trio
from pyfuse3 import FileInfo

from kvfs.caller import Caller
from kvfs.data.staged import StagedFile
from kvfs.data.store import allocated_bytes
from kvfs.meta import Inode, MetaStore
from kvfs.meta.calls import MetaCalls
from kvfs.quick_lock import QuickLock
from kvfs.records import BlobInfo, fail


@dataclass(eq=False)
class Handle:
    fh: int
    ino: int
    writable: bool
    append: bool
    version: int  # committed version this handle reads (readers) or is based on (writers)
    blob: BlobInfo | None
    fd: int | None  # the blob's file, held open so unlink/replace cannot take it away
    opener: Caller  # who opened it
    direct: bool  # opened O_DIRECT: what the kernel writes for it bypasses the page cache
    nodeid: int | None = None  # its kernel inode (kvfs/files/kernel_inodes.py); None: kvfs's own
    staged: StagedFile | None = None
    backing: bool = False  # the kernel does its I/O on a blob file itself (passthrough)
    shares_backing: bool = False  # served here, naming its kernel inode's backing file
    reserved: int = 0  # room held for a passthrough writer, whose writes kvfs does not see
    kill_privs: Caller | None = None  # a writer without CAP_FSETID: writes clear setuid/gid
    lock: QuickLock = field(default_factory=QuickLock)  # one change or commit at a time
    changed_at: int = 0  # when this writer last changed its content (FileState.clock)
    committed: bool = False  # a close of this writer committed its content
    beside: bool = False  # a write-only retry served beside opens it cannot share with
    load_model: str | None = None  # a reader of committed content: whose load it is

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
    """The one backing file the kernel has for one of its inodes while passthrough handles
    use it: a committed blob that readers share, or the staged file of one writer."""

    blob_id: int
    backing_id: int
    users: int = 1
    writable: bool = False


@dataclass(eq=False)
class OpenInode:
    inode: Inode
    handles: set[Handle] = field(default_factory=set)
    backings: dict[int, Backing] = field(default_factory=dict)  # per kernel inode (node id)
    unlinked: bool = False
    closed: trio.Event = field(default_factory=trio.Event)  # set when a handle closes


@dataclass(frozen=True, slots=True)
class Opened:
    fh: int
    direct_io: bool
    keep_cache: bool
    backing_id: int = 0
    read_only: bool = False

    def file_info(self) -> FileInfo:
        info = FileInfo(fh=self.fh, direct_io=self.direct_io, keep_cache=self.keep_cache)
        info.backing_id = self.backing_id
        info.noflush = self.read_only  # its close has nothing to commit: no FLUSH round trip
        return info


def privileges_to_clear(inode: Inode, caller: Caller, chown: bool = False) -> int:
    """What a write or truncate by `caller` clears, as Linux: nothing for root; setuid;
    setgid when group execute is set or the caller is not in the file's group. A chown (of
    anything but a directory) clears them for root too, setgid by the same rule."""
    if caller.uid == 0 and not chown or stat.S_ISDIR(inode.mode):
        return 0
    bits = inode.mode & stat.S_ISUID
    if inode.mode & stat.S_ISGID and (inode.mode & stat.S_IXGRP or caller.uid != 0
                                      and not caller.in_group(inode.gid)):
        bits |= stat.S_ISGID
    return bits


class FileState:
    """What is open, owned by the trio loop (kvfs/meta/calls.py): the handles by file handle,
    the open state of each inode, per kernel inode the one version its page cache may hold,
    and the attributes each kernel inode is shown (a writer's own size)."""

    def __init__(self, meta: MetaStore, numbers_from: int = 0) -> None:
        """`numbers_from`: where this daemon's file handles start, apart from those of a
        daemon that served the connection before (kvfs/fuse/keeper.py)."""
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self.handles: dict[int, Handle] = {}
        self.inodes: dict[int, OpenInode] = {}  # by inode number, while a handle holds one
        # per kernel inode (node id): the one version its page cache may hold, and the
        # version read once bypassing it
        self.cached_version: dict[int, int] = {}
        self.read_directly: dict[int, int] = {}
        self.next_fh = count(1 + numbers_from)
        self._first_fh = 1 + numbers_from
        self.clock = count(1)  # orders writers' changes: the latest one's size is shown

    async def attributes(self, ino: int, cached: bool = False, nodeid: int | None = None
                         ) -> Inode:
        """The committed inode (also of files unlinked while open), with the size of what
        its latest writer on this host wrote (on kernel inode `nodeid`, if given: the
        kernel keeps one size per inode, and a writer's fstat and SEEK_END must see its own
        writes, while readers on their kernel inode see the version they opened). `cached`:
        for the kernel's attribute cache (`Engine.snapshot`)."""
        state = self.inodes.get(ino)
        if state and state.unlinked:
            inode = state.inode
        elif cached:
            inode = await self.meta_call.cached(self.meta.namespace.get, ino, cached=True)
        else:
            inode = await self.meta_call(self.meta.namespace.get, ino)
        state = self.inodes.get(ino)  # (it may have changed meanwhile)
        if state is None:
            return inode
        readers = [handle for handle in state.handles if handle.nodeid == nodeid]
        if (nodeid is not None and readers and not any(h.writable for h in readers)
                and readers[0].version != inode.version):
            # A kernel inode of readers of an older version (kvfs/files/policy.py): its size
            # is theirs, so that their maps reach as far as their reads.
            blob = readers[0].blob
            return inode._replace(size=blob.size if blob else 0,
                                  allocated=blob.allocated if blob else 0)
        sizes = [(handle.changed_at, own) for handle in state.handles
                 if handle.writable and (nodeid is None or handle.nodeid == nodeid)
                 and (own := handle.own_size()) is not None]
        if not sizes:
            return inode
        size, allocated = max(sizes)[1]
        return inode._replace(size=size, allocated=allocated)

    def open_inodes(self) -> frozenset[int]:
        return frozenset(self.inodes)

    def is_open(self, ino: int) -> bool:
        return ino in self.inodes

    def serves_older_version(self, ino: int) -> bool:
        """Whether readers of a version before the current one have `ino` open: their
        kernel inode's size is theirs (`attributes`) until they close."""
        state = self.inodes.get(ino)
        return state is not None and any(handle.version != state.inode.version
                                         for handle in state.handles)

    def has_writer(self, ino: int) -> bool:
        state = self.inodes.get(ino)
        return state is not None and any(handle.writable for handle in state.handles)

    def handle(self, fh: int) -> Handle:
        """The open handle `fh`; one an earlier daemon of the connection opened is gone with
        it (ENOTCONN, as on a mount whose daemon died)."""
        handle = self.handles.get(fh)
        if handle is None:
            raise fail(errno.ENOTCONN if fh < self._first_fh else errno.EBADF)
        return handle

    def on_kernel_inode(self, ino: int, nodeid: int, but: Handle | None = None
                        ) -> list[Handle]:
        """The handles of `ino` open on kernel inode `nodeid`, other than `but`."""
        state = self.inodes.get(ino)
        if state is None:
            return []
        return [h for h in state.handles if h.nodeid == nodeid and h is not but]

    def forget_if_unused(self, state: OpenInode) -> None:
        """Drop an inode's open state once no handle holds it."""
        if not state.handles and self.inodes.get(state.inode.ino) is state:
            del self.inodes[state.inode.ino]

    def forget_pages(self, nodeid: int) -> None:
        """What the page cache of kernel inode `nodeid` held no longer counts: gone, or of a
        file retired or written."""
        self.cached_version.pop(nodeid, None)
        self.read_directly.pop(nodeid, None)

    def is_unlinked(self, ino: int) -> bool:
        state = self.inodes.get(ino)
        return state is not None and state.unlinked

    def kernel_writes_into(self, blob_id: int) -> bool:
        """Whether a passthrough writer's kernel writes into blob `blob_id` (its staged file,
        also once a close committed it)."""
        return any(handle.backing and handle.staged is not None
                   and handle.staged.blob_id == blob_id for handle in self.handles.values())
