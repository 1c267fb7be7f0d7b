"""The FUSE layer: translates kernel requests into metadata-store and file-table calls.

Every handler is guarded: kvfs's own refusals (FsError) become FUSEError with their errno;
errors of the volume underneath are logged, counted and passed on (EIO for any errno a caller
could mistake for a namespace answer); anything unexpected is logged with its traceback and
answered with EIO, so no request can end the daemon.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyfuse3
import trio
from pyfuse3 import EntryAttributes, FileInfo, FUSEError, RequestContext, SetattrFields

from kvfs.caller import Caller
from kvfs.data.store import BLOCK_SIZE
from kvfs.files import FileTable
from kvfs.files.passthrough import Passthrough
from kvfs.fuse.control import ROUTES, ControlFiles, Route
from kvfs.fuse.notifier import KernelNotifier
from kvfs.meta import NAME_MAX, Inode, MetaStore
from kvfs.meta.calls import MetaCalls, off_loop
from kvfs.observe.stats import Stats
from kvfs.pool.space import Space
from kvfs.records import FsError, fail

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class KernelCaching:
    """How long the kernel may answer lookups and stats itself (seconds)."""

    entry: float  # names and attributes
    negative: float  # misses


# One host: everything that changes the namespace goes through this kernel, which updates its
# own caches, and the daemon pushes its own changes (evicted or dropped files, commits). So
# names, attributes and misses are cached for as long as they stay true, bounded only so that
# a file's atime (its last use, recorded by the daemon at opens and reads) shows within a
# minute. A lookup the kernel answers itself is no use recorded: opens and reads are.
ONE_HOST_CACHING = KernelCaching(entry=60.0, negative=30.0)
# A shared pool: other hosts change the namespace behind this kernel's back, and the engine
# pushes each of their changes here (`KernelNotifier.others_changed_name`), within
# milliseconds. So the kernel caches for seconds: a push lost in a dropped connection leaves a
# stale answer (a recompute, or an open that fails) for at most that long.
SHARED_CACHING = KernelCaching(entry=5.0, negative=5.0)
# ... and while the pushes do not arrive (the engine's subscription is down): misses are not
# cached and hits for 50 ms, so a chunk committed on one host is found on any other at once.
SHARED_UNWATCHED_CACHING = KernelCaching(entry=0.05, negative=0.0)
USER_XATTR = b"user."
EXECUTE_BITS = stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
STATFS_BLOCK = 4096  # LMCache's use_odirect checks sizes against statvfs().f_bsize
# glibc sizes a directory stream's buffer by st_blksize (32 KiB to 1 MiB), and the kernel
# allocates that much for each FUSE readdir: the files' 1 MiB block makes `du` of many small
# directories slower, a small one makes large listings many more requests; this size is as
# good as the best of both (docs/benchmarks.md).
DIRECTORY_BLKSIZE = 256 << 10
# ... except for directories of many subdirectories (vLLM's tree has 4,096 at its top): with
# 1 MiB their whole listing comes in the first READDIRPLUS, with attributes, and `du` or `find`
# looks none of them up (later replies carry none: READDIRPLUS_AUTO). 2,461 LOOKUPs fewer for
# `du` of 4,096 directories; flat directories of files keep 256 KiB.
WIDE_DIRECTORY_BLKSIZE = 1 << 20
WIDE_DIRECTORY_SUBDIRS = 512
READDIR_PAGE = 256  # at most this many entries are read from the metadata store at once
READDIR_SLACK = 8  # entries read beyond what filled the last reply (names differ in length)
VOLUME_ERRNOS = {errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ENOMEM}
CREATE_RACES = 16  # a create that finds the name taken, and gone when it opens it, tries again
LOGGED_BYTES = 255  # a longer argument is a write's data (a name is at most 255 bytes)


def logged_args(args: tuple) -> tuple:
    """A request's first arguments as its log record shows them: data by its length (a
    failed write must not put its megabytes into the log, on the volume that failed it)."""
    return tuple(f"<{len(arg)} bytes>" if isinstance(arg, bytes | bytearray | memoryview)
                 and len(arg) > LOGGED_BYTES else arg for arg in args[:3])


def fuse_error(ops: KvfsOperations, request: str, args: tuple, error: Exception) -> FUSEError:
    """What a handler's exception tells the kernel; volume errors and bugs are also counted
    and logged (no exception ever reaches pyfuse3: it would end the mount)."""
    if isinstance(error, FUSEError):
        return error
    if isinstance(error, FsError):
        return FUSEError(error.errno)
    if isinstance(error, OSError):
        ops.stats.volume_errors += 1
        log.warning("%s%r: volume error: %s", request, logged_args(args), error)
        return FUSEError(error.errno if error.errno in VOLUME_ERRNOS else errno.EIO)
    ops.stats.handler_errors += 1
    log.error("%s%r failed", request, logged_args(args), exc_info=error)
    return FUSEError(errno.EIO)


def guarded(method: Callable, route: Route | None) -> Callable:
    """`method`, its exceptions answered as errnos and its time recorded; requests that
    `route` gives to the control files answered by them instead."""
    request = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KvfsOperations, *args: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            if route is not None and (control := route(self.control, args)) is not None:
                return await control
            return await method(self, *args)
        except Exception as error:
            raise fuse_error(self, request, args, error) from None
        finally:
            self.stats.requests.record(request, time.perf_counter_ns() - started)

    return wrapper


def guard_handlers(cls: type) -> type:
    for name, member in list(vars(cls).items()):
        if inspect.iscoroutinefunction(member) and not name.startswith("_"):
            setattr(cls, name, guarded(member, ROUTES.get(name)))
    return cls


def permits(attributes: Inode, mode: int, ctx: RequestContext) -> bool:
    """Whether the caller may access a file with these attributes in `mode` (access(2)'s
    R_OK, W_OK, X_OK): root anything but executing a file without an execute bit; another
    user its class's bits."""
    if ctx.uid == 0:
        return not (mode & os.X_OK and not attributes.is_dir
                    and not attributes.mode & EXECUTE_BITS)
    if ctx.uid == attributes.uid:
        granted = attributes.mode >> 6
    elif caller(ctx).in_group(attributes.gid):
        granted = attributes.mode >> 3
    else:
        granted = attributes.mode
    return mode & granted & 0o7 == mode & 0o7


def caller(ctx: RequestContext) -> Caller:
    return Caller(ctx.uid, ctx.gid, ctx.pid)


def entry_attributes(inode: Inode, timeout: float) -> EntryAttributes:
    entry = EntryAttributes()
    entry.st_ino = inode.ino
    entry.st_mode = inode.mode
    entry.st_nlink = inode.nlink
    entry.st_uid = inode.uid
    entry.st_gid = inode.gid
    entry.st_rdev = inode.rdev
    entry.st_size = inode.size
    entry.st_blksize = directory_blksize(inode) if stat.S_ISDIR(inode.mode) else BLOCK_SIZE
    entry.st_blocks = inode.allocated // 512
    entry.st_atime_ns = inode.atime_ns
    entry.st_mtime_ns = inode.mtime_ns
    entry.st_ctime_ns = inode.ctime_ns
    entry.entry_timeout = timeout
    entry.attr_timeout = timeout
    return entry


def directory_blksize(directory: Inode) -> int:
    subdirectories = directory.nlink - 2
    return (WIDE_DIRECTORY_BLKSIZE if subdirectories > WIDE_DIRECTORY_SUBDIRS
            else DIRECTORY_BLKSIZE)


def typed_entry(ino: int, mode: int) -> EntryAttributes:
    """An entry of a plain READDIR: its inode number and type are all the kernel takes."""
    entry = EntryAttributes()
    entry.st_ino = ino
    entry.st_mode = mode
    return entry


def negative_entry(timeout: float) -> EntryAttributes:
    """A cacheable 'no such name': the kernel answers repeated misses itself."""
    entry = EntryAttributes()
    entry.st_ino = 0
    entry.entry_timeout = timeout
    return entry


@guard_handlers
class KvfsOperations(pyfuse3.Operations):
    def __init__(self, meta: MetaStore, files: FileTable, space: Space, stats: Stats,
                 notifier: KernelNotifier, passthrough: Passthrough, numbers_from: int = 0,
                 on_kernel_init: Callable[[bytes], None] | None = None) -> None:
        super().__init__()
        self.meta = meta
        self.meta_call = MetaCalls(meta.engine)
        self._readdir_fits = READDIR_PAGE  # entries that fill a readdir reply, about
        self.files = files
        self.kernel = files.kernel
        self.space = space
        self.stats = stats
        self.notifier = notifier
        self.passthrough = passthrough
        # What kvfs's pyfuse3 (vendor/pyfuse3/README.md) reads at INIT:
        self.enable_passthrough = passthrough.wanted
        # replies over /dev/fuse written by a thread of the binding's own: the loop goes on
        # to the next request while the kernel wakes the last one's caller
        self.reply_thread = True
        # kvfs clears setuid/setgid itself (writes, truncates, chowns): the kernel then stops
        # asking for security.capability (a GETXATTR) before every write() (patched pyfuse3)
        self.handle_killpriv_v2 = True
        # shared maps of opens the daemon serves (direct_io) go through the page cache of
        # their own kernel inode (kvfs/files/kernel_inodes.py) rather than failing (patched pyfuse3)
        self.direct_io_allow_mmap = True
        # kvfs keeps user.* attributes alone (`getxattr` below): the patched pyfuse3 answers
        # ENODATA for every other name itself, without a task on the loop. The kernel asks
        # for security.capability at each new file's first write (one of a store's requests)
        # and `ls -l` for two names per entry.
        self.user_xattrs_only = True
        self.control = ControlFiles(meta, space, stats, passthrough, files.verifier.mode,
                                    files.loads, numbers_from)
        self.on_kernel_init = on_kernel_init  # given the kernel's INIT request (the keeper)

    @property
    def caching(self) -> KernelCaching:
        if not self.meta.engine.shared:
            return ONE_HOST_CACHING
        return SHARED_CACHING if self.meta.engine.watching() else SHARED_UNWATCHED_CACHING

    def init(self) -> None:
        """The kernel's INIT is answered: say which paths requests and data take."""
        request = pyfuse3.init_request()
        if self.on_kernel_init is not None and request:
            self.on_kernel_init(request)
        if pyfuse3.replies_from_thread():
            log.info("requests: /dev/fuse, replies written by a thread of their own")
        else:
            log.info("requests: /dev/fuse")
        if self.passthrough.available():
            log.info("data path: kernel passthrough, --verify %s", self.files.verifier.mode)
        else:
            log.info("data path: kvfs serves every read (%s)", self.passthrough.refused)

    async def _attributes(self, ino: int, nodeid: int | None = None) -> Inode:
        if self.control.owns(ino):
            return self.control.attributes(ino)
        return await self.files.attributes(ino, cached=True, nodeid=nodeid)

    def _entry(self, inode: Inode) -> EntryAttributes:
        """Attributes of a file being written are not cached: its size and times change at
        the close that commits, and a stat right after that close must see them. Nor are
        those of a file that readers of an older version hold (their kernel inode has their
        size until they close) or of the control files (`.kvfs/stats` grows and shrinks as
        counters change). The entry names the file's current kernel inode
        (kvfs/files/kernel_inodes.py)."""
        uncached = (self.files.has_writer(inode.ino) or self.control.owns(inode.ino)
                    or self.files.serves_older_version(inode.ino))
        entry = entry_attributes(inode, 0.0 if uncached else self.caching.entry)
        nodeid = self.kernel.nodeid(inode.ino)
        if nodeid != inode.ino:
            entry.nodeid = nodeid
        return entry

    def _told(self, entry: EntryAttributes) -> EntryAttributes:
        """An entry on its way to the kernel, which counts it as a lookup of its node id."""
        if entry.st_ino:
            self.kernel.looked_up(entry.nodeid)
        return entry

    # -- namespace -----------------------------------------------------------------------

    async def lookup(self, parent_inode: int, name: bytes, ctx: RequestContext
                     ) -> EntryAttributes:
        if name == b".":
            return self._entry(await self._attributes(parent_inode))
        if name == b"..":
            parent = await self._attributes(parent_inode)
            return self._entry(await self._attributes(parent.parent))
        control = self.control.lookup(parent_inode, name)
        if control is not None:
            return self._entry(control)
        started = time.monotonic()
        inode = await self.meta_call.cached(self.meta.namespace.lookup, parent_inode, name,
                                                cached=True)
        racing = self.notifier.changed_since(parent_inode, name, started)
        return self._told(self._looked_up(inode, racing, ctx))

    def _looked_up(self, inode: Inode | None, racing: bool, ctx: RequestContext
                   ) -> EntryAttributes:
        if inode is None:
            self.stats.lookup_misses += 1
            return negative_entry(0.0 if racing else self.caching.negative)
        self.stats.lookup_hits += 1
        if self.files.has_writer(inode.ino):
            # An open that follows may not share the writer's kernel inode: each such
            # lookup names a fresh one (kvfs/files/kernel_inodes.py), so that racing opens (and
            # the kernel's retries of refused ones) do not meet on one.
            self.kernel.renew(inode.ino)
        elif stat.S_ISREG(inode.mode):
            self.kernel.leave_inherited(inode.ino)
        self.space.note_use(inode.ino)
        self.files.prefetcher.looked_up(inode, caller(ctx))
        entry = self._entry(inode)  # it has a name: not a file unlinked while open
        if racing:
            entry.entry_timeout = entry.attr_timeout = 0.0
        return entry

    async def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        return self._entry(await self._attributes(self.kernel.ino(inode), nodeid=inode))

    async def access(self, inode: int, mode: int, ctx: RequestContext) -> bool:
        """access(2) and chdir, asked where the kernel leaves permissions to kvfs (a mount
        root alone reaches, see `Daemon.mount`): root may do anything but execute a file
        without an execute bit; another user (not let in there) gets its class's bits."""
        return permits(await self._attributes(self.kernel.ino(inode)), mode, ctx)

    async def setattr(self, inode: int, attr: EntryAttributes, fields: SetattrFields,
                      fh: int | None, ctx: RequestContext) -> EntryAttributes:
        nodeid, inode = inode, self.kernel.ino(inode)
        if fields.update_size:
            handle = self.files.handle(fh) if fh is not None else None
            if handle is not None and handle.writable:
                await self.files.truncate(handle, attr.st_size)
            else:
                await self.files.truncate_path(await self.meta_call(self.meta.namespace.get, inode),
                                                                    attr.st_size, caller(ctx))
                self.notifier.attributes_changed(inode)
        changed: dict[str, int | None] = {
            "mode": attr.st_mode if fields.update_mode else None,
            "uid": attr.st_uid if fields.update_uid else None,
            "gid": attr.st_gid if fields.update_gid else None,
            "atime_ns": attr.st_atime_ns if fields.update_atime else None,
            "mtime_ns": attr.st_mtime_ns if fields.update_mtime else None,
        }
        if not fields.update_size or any(value is not None for value in changed.values()):
            # Every attribute change is a ctime change, also one that changes nothing
            # (chown(f, -1, -1) arrives with no field set).
            chown = fields.update_uid or fields.update_gid or not any(
                (fields.update_mode, fields.update_size, fields.update_atime,
                 fields.update_mtime))
            cleared = await self.files.cleared_by_chown(inode, caller(ctx)) if chown else 0
            await self.meta_call(self.meta.namespace.set_attrs, inode, mode=changed["mode"],
                                 uid=changed["uid"], gid=changed["gid"],
                                 atime_ns=changed["atime_ns"], mtime_ns=changed["mtime_ns"],
                                 clear_mode=cleared)
        if fields.update_size:  # the kernel's FUSE code clears setgid by an older rule
            await self.files.clear_privileges(inode, caller(ctx))
        return self._entry(await self.files.attributes(inode, nodeid=nodeid))

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        """Regular files, fifos, sockets and device nodes: the kernel does their I/O."""
        inode = await self.meta_call.change(self.meta.namespace.make, parent_inode, name, mode,
                                            ctx.uid, ctx.gid, rdev=rdev)
        return entry_attributes(inode, self.caching.entry)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: RequestContext
                    ) -> EntryAttributes:
        inode = await self.meta_call.change(self.meta.namespace.make, parent_inode, name,
                                            stat.S_IFDIR | stat.S_IMODE(mode), ctx.uid, ctx.gid)
        return entry_attributes(inode, self.caching.entry)

    async def unlink(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        self.files.retire(await self.meta_call.change(self.meta.namespace.remove, parent_inode,
                                                      name, is_dir=False))

    async def rmdir(self, parent_inode: int, name: bytes, ctx: RequestContext) -> None:
        await self.meta_call.change(self.meta.namespace.remove, parent_inode, name, is_dir=True)

    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: RequestContext) -> None:
        _, replaced = await self.meta_call.change(self.meta.namespace.rename, parent_inode_old,
                                                  name_old, parent_inode_new, name_new, flags)
        if replaced is not None:
            self.files.retire(replaced)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: RequestContext) -> EntryAttributes:
        inode = await self.meta_call.change(self.meta.namespace.make, parent_inode, name,
                                            stat.S_IFLNK | 0o777, ctx.uid, ctx.gid, target=target)
        return entry_attributes(inode, self.caching.entry)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: RequestContext) -> EntryAttributes:
        inode = self.kernel.ino(inode)
        linked = await self.meta_call(self.meta.namespace.link, inode, new_parent_inode, new_name)
        return self._told(self._entry(linked))

    async def readlink(self, inode: int, ctx: RequestContext) -> bytes:
        return await self.meta_call(self.meta.namespace.readlink, inode)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for nodeid, lookups in inode_list:
            self.files.forget(nodeid, lookups)

    # -- directories ---------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        if pyfuse3.READDIR_WITHOUT_OPENDIR:
            # The kernel then reads directories without OPENDIR and RELEASEDIR (two requests
            # fewer per listing) and caches their listings, dropped at every change of the
            # directory that it makes or is told of (KernelNotifier).
            raise FUSEError(errno.ENOSYS)
        if not (await self._attributes(inode)).is_dir:
            raise FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # A READDIR's entries (not READDIRPLUS's) carry their inode number and type alone:
        # those are read without unpacking the inodes.
        plus = token.plus
        after = start_id
        while True:  # in pages: a huge directory is never read whole
            wanted = self._readdir_fits
            if plus:
                page = await self.meta_call(self.meta.namespace.readdir_page, fh, after, wanted)
                entries = [(name, self._entry(inode), cookie) for name, inode, cookie in page]
            else:
                typed = await self.meta_call(self.meta.namespace.readdir_types_page, fh, after,
                                             wanted)
                entries = [(name, typed_entry(ino, mode), cookie)
                           for name, ino, mode, cookie in typed]
            for sent, (name, attributes, cookie) in enumerate(entries):
                if not pyfuse3.readdir_reply(token, name, attributes, cookie):
                    # The kernel's buffer is full: the next page is read to its size.
                    self._readdir_fits = sent + READDIR_SLACK
                    return
                if plus:
                    self._told(attributes)
                after = cookie
            if len(entries) < wanted:
                break
            self._readdir_fits = min(2 * wanted, READDIR_PAGE)
        for name, inode in self.control.entries(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(inode), inode.ino):
                return

    async def releasedir(self, fh: int) -> None:
        pass

    async def statfs(self, ctx: RequestContext) -> pyfuse3.StatvfsData:
        capacity, used = await self.space.shown()
        result = pyfuse3.StatvfsData()
        result.f_bsize = result.f_frsize = STATFS_BLOCK
        result.f_blocks = capacity // STATFS_BLOCK
        result.f_bfree = result.f_bavail = max(0, capacity - used) // STATFS_BLOCK
        result.f_ffree = result.f_favail = 1 << 32
        result.f_files = (await self.meta_call(self.meta.recency.usage)).files + result.f_ffree
        result.f_namemax = NAME_MAX
        return result

    # -- files ---------------------------------------------------------------------------

    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        for _ in range(CREATE_RACES):
            try:
                inode = await self.meta_call.change(self.meta.namespace.make, parent_inode,
                                                    name, stat.S_IFREG | stat.S_IMODE(mode),
                                                    ctx.uid, ctx.gid)
            except FsError as error:
                if error.errno != errno.EEXIST or flags & os.O_EXCL:
                    raise
                # The kernel thought the name free (a miss it cached before another host, or
                # another process, made it): without O_EXCL the open opens what is there,
                # and makes the name again where it went meanwhile (renamed away, removed),
                # as ext4 would: an O_CREAT open never fails for want of the name.
                existing = await self._open_existing(parent_inode, name, flags, ctx)
                if existing is None:
                    continue
                return existing
            opened = await self.files.open(inode.ino, flags & ~os.O_TRUNC, caller(ctx),
                                           made=inode, nodeid=inode.ino)
            return opened.file_info(), entry_attributes(inode, self.caching.entry)
        log.warning("create of %r lost %d races with other makers and removers of the name",
                    name, CREATE_RACES)
        raise fail(errno.EAGAIN)

    async def _open_existing(self, parent_inode: int, name: bytes, flags: int,
                             ctx: RequestContext) -> tuple[FileInfo, EntryAttributes] | None:
        """Open what `name` names; None where nothing does any more (the open, which the
        kernel never learns of then, is let go)."""
        inode = await self.meta_call(self.meta.namespace.lookup, parent_inode, name)
        if inode is None:
            return None
        if inode.is_dir:
            raise fail(errno.EISDIR)
        if not stat.S_ISREG(inode.mode):
            raise fail(errno.EEXIST)
        wanted = {os.O_RDONLY: os.R_OK, os.O_WRONLY: os.W_OK}.get(
            flags & os.O_ACCMODE, os.R_OK | os.W_OK)
        if not permits(inode, wanted, ctx):
            raise fail(errno.EACCES)
        if self.files.has_writer(inode.ino):
            self.kernel.renew(inode.ino)  # (as a lookup does: `_looked_up`)
        else:
            self.kernel.leave_inherited(inode.ino)
        nodeid = self.kernel.nodeid(inode.ino)
        try:
            opened = await self.files.open(inode.ino, flags, caller(ctx), nodeid=nodeid)
        except FsError as error:
            if error.errno == errno.ENOENT:
                return None
            raise
        try:
            attributes = await self.files.attributes(inode.ino, nodeid=nodeid)
        except BaseException as error:
            with trio.CancelScope(shield=True):  # (else the open holds its blob for good)
                await self.files.abandon(opened.fh)
            if isinstance(error, FsError) and error.errno == errno.ENOENT:
                return None
            raise
        return opened.file_info(), self._told(self._entry(attributes))

    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        opened = await self.files.open(self.kernel.ino(inode), flags, caller(ctx),
                                       nodeid=inode)
        return opened.file_info()

    # pyfuse3 sends any buffer (it takes the reply with the buffer protocol); its stub says
    # bytes, and copying every read into bytes would cost a copy per request.
    async def read(  # type: ignore[override]
            self, fh: int, off: int, size: int) -> bytes | bytearray | memoryview:
        return await self.files.read(fh, off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.files.write(fh, off, buf)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        """(kvfs's pyfuse3 patch registers it; stock pyfuse3 answers EOPNOTSUPP)"""
        await self.files.fallocate(fh, mode, offset, length)

    async def flush(self, fh: int) -> None:
        # The commit changes what the kernel may hold of the file's size, times and blocks,
        # and it holds none of them past a write: each write (passthrough, or sent here)
        # marks them stale in its cache, and while a writer is open kvfs tells them only
        # uncached (`_entry`). No invalidation, then: on the loop it released the GIL for a
        # write to /dev/fuse on every store.
        await self.files.flush(self.files.handle(fh))

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.files.handle(fh)
        if handle.staged is not None:
            await off_loop(os.fdatasync, handle.staged.fd)

    async def release(self, fh: int) -> None:
        await self.files.release(fh)

    # -- extended attributes -------------------------------------------------------------

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: RequestContext
                       ) -> None:
        if not name.startswith(USER_XATTR):
            raise FUSEError(errno.ENOTSUP)
        inode = self.kernel.ino(inode)
        await self.meta_call(self.meta.namespace.setxattr, inode, name, value)

    async def getxattr(self, inode: int, name: bytes, ctx: RequestContext) -> bytes:
        inode = self.kernel.ino(inode)
        if not name.startswith(USER_XATTR):
            raise FUSEError(errno.ENODATA)
        return await self.meta_call(self.meta.namespace.getxattr, inode, name)

    async def listxattr(self, inode: int, ctx: RequestContext) -> list[bytes]:
        inode = self.kernel.ino(inode)
        return await self.meta_call(self.meta.namespace.listxattr, inode)

    async def removexattr(self, inode: int, name: bytes, ctx: RequestContext) -> None:
        if not name.startswith(USER_XATTR):
            raise FUSEError(errno.ENOTSUP)
        inode = self.kernel.ino(inode)
        await self.meta_call(self.meta.namespace.removexattr, inode, name)
