"""The open-file table's state: handles, what is open per inode, and the answers about it
that every layer above needs (kvfs/files/__init__.py describes the whole)."""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import TypeVar

import trio
from pyfuse3 import FileInfo

from kvfs.caller import Caller
from kvfs.data.cache import BlockCache
from kvfs.data.staged import StagedFile
from kvfs.data.store import DataStore, allocated_bytes
from kvfs.data.verify import LateHasher, Verifier, VerifyMode
from kvfs.data.volume_helper import VolumeHelper
from kvfs.engines.write_behind import WriteBehind
from kvfs.files.kernel_inodes import KernelInodes
from kvfs.files.passthrough import Passthrough
from kvfs.files.prefetch import Prefetcher
from kvfs.files.spares import SpareFiles
from kvfs.meta import Inode, MetaStore, Removed
from kvfs.meta.calls import MetaCalls
from kvfs.observe.loads import LoadMeter
from kvfs.observe.stats import Stats
from kvfs.pool.sessions import Session
from kvfs.pool.space import Space
from kvfs.quick_lock import QuickLock
from kvfs.records import BlobInfo, fail

log = logging.getLogger(__name__)

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
    opener: Caller  # who opened it
    direct: bool  # opened O_DIRECT: what the kernel writes for it bypasses the page cache
    nodeid: int | None = None  # its kernel inode (kvfs/files/kernel_inodes.py); None: kvfs's own
    staged: StagedFile | None = None
    backing: bool = False  # the kernel does its I/O on a blob file itself (passthrough)
    shares_backing: bool = False  # served here, naming its kernel inode's backing file
    reserved: int = 0  # room held for a passthrough writer, whose writes kvfs does not see
    kill_privs: Caller | None = None  # a writer without CAP_FSETID: writes clear setuid/gid
    lock: QuickLock = field(default_factory=QuickLock)  # one change or commit at a time
    changed_at: int = 0  # when this writer last changed its content (FileTable's clock)
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
    """The open-file table's state, owned by the trio loop (kvfs/meta/calls.py)."""

    def __init__(self, meta: MetaStore, data: DataStore, cache: BlockCache, stats: Stats,
                 space: Space, passthrough: Passthrough, session: Session,
                 verify: VerifyMode, prefetch_budget: int, helper: VolumeHelper | None,
                 spares: bool, kernel: KernelInodes,
                 on_attributes_changed: Callable[[int], None],
                 on_removed: Callable[[Removed], None]) -> None:
        self.meta = meta
        self.kernel = kernel  # which of the kernel's inodes each open is on
        self.meta_call = MetaCalls(meta.engine)
        self.data = data
        self.cache = cache
        self.passthrough = passthrough
        self.helper = helper  # makes spares and publishes (kvfs/data/volume_helper.py), if alive
        # Whether closes leave every publishing to the publisher (else only syncing stores')
        self.publish_later = helper is not None
        # Set where a shared engine answers changes ahead of Redis (write-behind): a small
        # file's close leaves its data's sync to that engine's queue, which syncs the files
        # of a batch together before sending it (one journal commit for many closes).
        self.write_behind: WriteBehind | None = None
        self.spares = SpareFiles(data, helper if spares else None, stats, self._take_blob_ids)
        self.verifier = Verifier(data, stats, verify)
        self.hasher = LateHasher(data, meta, self.verifier, stats)
        self.prefetcher = Prefetcher(meta, data, self.verifier, session, stats, prefetch_budget)
        self.loads = LoadMeter()
        self.stats = stats
        self.space = space
        self.session = session
        self.on_attributes_changed = on_attributes_changed  # tell the kernel (setuid cleared)
        self.on_removed = on_removed  # tell the kernel names vanished (eviction, lost data)
        self._handles: dict[int, Handle] = {}
        self._refused: dict[tuple[int, int], float] = {}  # (thread, ino) -> when (ESTALE)
        self._open: dict[int, OpenInode] = {}
        # per kernel inode (node id): the one version its page cache may hold, and the
        # version read once bypassing it
        self._cached_version: dict[int, int] = {}
        self._read_directly: dict[int, int] = {}
        self._next_fh = count(1)
        self._clock = count(1)  # orders writers' changes: the latest one's size is shown
        self._blob_ids: range = range(0)
        self._doomed: list[int] = []  # blobs whose data files the reaper deletes
        # Committed blobs a flush is still moving into blobs/, and those of them replaced
        # meanwhile: deleted only once their publishing is over.
        self._publishing: set[int] = set()
        self._doomed_when_published: set[int] = set()
        # Committed blobs a passthrough writer still writes into (after a close of one of
        # its descriptors): deleted once it is done with them.
        self._doomed_when_closed: set[int] = set()
        # Blobs a close committed and left to the publisher (the volume helper's, or on a
        # syncing store a worker's), each with what it sets when done.
        self._published_later: dict[int, trio.Event] = {}
        self._to_publish, self._publish_queue = trio.open_memory_channel[StagedFile](math.inf)
        self._reap_wanted = trio.Event()
        self._reaping = trio.Lock()  # held while a worker deletes doomed blobs' data files

    def session_lost(self) -> None:
        """(the loop) This host was declared dead while it stalled, and its reaper took its
        staging directory (made again since): spares named there are gone, and so is the
        write-behind journal."""
        self.spares.forget()
        if self.write_behind is not None:
            self.write_behind.rejournal()

    async def _take_blob_ids(self, count: int) -> range:
        return await self.meta_call(self.meta.content.allocate_blob_ids, count)

    async def attributes(self, ino: int, cached: bool = False, nodeid: int | None = None
                         ) -> Inode:
        """The committed inode (also of files unlinked while open), with the size of what
        its latest writer on this host wrote (on kernel inode `nodeid`, if given: the
        kernel keeps one size per inode, and a writer's fstat and SEEK_END must see its own
        writes, while readers on their kernel inode see the version they opened). `cached`:
        for the kernel's attribute cache (`Engine.snapshot`)."""
        state = self._open.get(ino)
        if state and state.unlinked:
            inode = state.inode
        elif cached:
            inode = await self.meta_call.cached(self.meta.namespace.get, ino, cached=True)
        else:
            inode = await self.meta_call(self.meta.namespace.get, ino)
        state = self._open.get(ino)  # (it may have changed meanwhile)
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
        return frozenset(self._open)

    def is_open(self, ino: int) -> bool:
        return ino in self._open

    def has_writer(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and any(handle.writable for handle in state.handles)

    def handle(self, fh: int) -> Handle:
        handle = self._handles.get(fh)
        if handle is None:
            raise fail(errno.EBADF)
        return handle

    def _forget_if_unused(self, state: OpenInode) -> None:
        """Drop an inode's open state once no handle holds it."""
        if not state.handles and self._open.get(state.inode.ino) is state:
            del self._open[state.inode.ino]

    def _is_unlinked(self, ino: int) -> bool:
        state = self._open.get(ino)
        return state is not None and state.unlinked
