"""The read-only control directory `MOUNTPOINT/.kvfs/`: live state for tools and operators.

`.kvfs` is not listed in the root, only reached by name.
Requests reach the control files through one table, `ROUTES`: kvfs/fuse/operations.py wraps
each handler it names, once, when the class is made. A request is routed by its inode or its
handle to the method of `ControlFiles` of the same name, and one that would make, remove or
rename a name under `.kvfs` (or `.kvfs` itself) is refused with EPERM. What stays in the
handlers is where `.kvfs` shows in the namespace: lookups, attributes and listings.
`.kvfs/stats` is one JSON object (see `snapshot`), generated when the file is opened, so that
every reader sees one consistent state. The names use reserved inode numbers far above any
the metadata store hands out, and nothing under `.kvfs` can be written, created or removed.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pyfuse3 import FileInfo

from kvfs.data.verify import VerifyMode
from kvfs.engines.interface import LoopChanges
from kvfs.files.passthrough import Passthrough
from kvfs.meta import ROOT_INO, Inode, MetaStore, Usage
from kvfs.meta.calls import off_loop
from kvfs.observe.loads import LoadMeter
from kvfs.observe.stats import Stats
from kvfs.pool.space import Space
from kvfs.records import FsError, fail

CONTROL_DIR = b".kvfs"
CONTROL_DIR_INO = (1 << 63) - 2
STATS_NAME = b"stats"
STATS_INO = (1 << 63) - 1
CONTROL_INOS = frozenset({CONTROL_DIR_INO, STATS_INO})  # never given other node ids
FIRST_HANDLE = 1 << 62  # control handles live apart from file handles
USER_XATTR = b"user."


# The pool's figures each mount last read (by id of its store), shown while its engine is
# out of reach.
_last_pool_view: dict[int, tuple[int, int, int, dict[str, dict[str, int]], int, int]] = {}


async def snapshot(meta: MetaStore, space: Space, stats: Stats,
                   passthrough: Passthrough, verify: VerifyMode, loads: LoadMeter) -> dict:
    """The mount's state, taken on the loop (the metadata read in a worker)."""
    def read() -> tuple[Usage, int, dict[str, dict[str, int]]]:
        hosts = len(meta.pool.sessions()) if meta.engine.shared else 1
        return meta.recency.usage(), hosts, meta.recency.models()

    try:
        usage, hosts, models = await off_loop(read)
        files, claimed = usage.files, usage.claimed
        capacity, used = await space.shown()
        _last_pool_view[id(meta)] = files, claimed, hosts, models, capacity, used
        reachable = True
    except FsError:  # (a shared engine out of reach: the counters still show, with the last view)
        files, claimed, hosts, models, capacity, used = _last_pool_view.get(
            id(meta), (0, 0, 0, {}, 0, 0))
        reachable = False
    return {
        "data_path": passthrough.mode(),
        # (without passthrough the daemon checks every block it serves, whatever the option)
        "verify": str(verify if passthrough.mode() == "passthrough" else VerifyMode.ALWAYS),
        "capacity_bytes": capacity,
        "used_bytes": used,
        "files": files,
        "claimed_bytes": claimed,
        **stats.as_dict(),
        "metadata_conflicts": meta.engine.conflicts,
        # (shared engine) round trips that failed: no answer within the deadline, or refused
        "metadata_reachable": reachable,
        # (shared engine) it no longer holds this mount's pool: nothing more is served
        "pool_lost": getattr(meta.engine, "pool_lost", False),
        "metadata_timeouts": getattr(meta.engine, "timeouts", 0),
        "metadata_unreachable": getattr(meta.engine, "unreachable", 0),
        "metadata_loop_commits": (meta.engine.loop_commits
                                  if isinstance(meta.engine, LoopChanges) else 0),
        # (shared engine) the loop's own Redis connection dropped, by cause
        "metadata_loop_drops": (meta.engine.loop_drops
                                if isinstance(meta.engine, LoopChanges) else {}),
        "hosts": hosts,
        "models": models,
        "loads": loads.as_dict(),
    }


class ControlFiles:
    def __init__(self, meta: MetaStore, space: Space, stats: Stats,
                 passthrough: Passthrough, verify: VerifyMode, loads: LoadMeter,
                 numbers_from: int = 0) -> None:
        self.meta = meta
        self.space = space
        self.stats = stats
        self.passthrough = passthrough
        self.verify = verify
        self.loads = loads
        self.started_ns = time.time_ns()
        self._contents: dict[int, bytes] = {}
        self._next_fh = itertools.count(FIRST_HANDLE + numbers_from)
        self._files: dict[int, Callable[[], Awaitable[bytes]]] = {STATS_INO: self._stats_json}

    async def _stats_json(self) -> bytes:
        state = await snapshot(self.meta, self.space, self.stats, self.passthrough,
                               self.verify, self.loads)
        return json.dumps(state, indent=2).encode() + b"\n"

    def owns(self, ino: int) -> bool:
        return ino in CONTROL_INOS

    def owns_handle(self, fh: int) -> bool:
        return fh in self._contents

    def is_reserved(self, parent: int, name: bytes) -> bool:
        """Names that cannot be created, removed or renamed: .kvfs and everything in it."""
        return parent == CONTROL_DIR_INO or (parent == ROOT_INO and name == CONTROL_DIR)

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        if parent == ROOT_INO and name == CONTROL_DIR:
            return self.attributes(CONTROL_DIR_INO)
        if parent == CONTROL_DIR_INO:
            if name == STATS_NAME:
                return self.attributes(STATS_INO)
            raise fail(errno.ENOENT)
        return None

    def attributes(self, ino: int) -> Inode:
        is_dir = ino == CONTROL_DIR_INO
        mode = stat.S_IFDIR | 0o555 if is_dir else stat.S_IFREG | 0o444
        now = time.time_ns()
        return Inode(ino, mode, 2 if is_dir else 1, 0, 0, 0, 0, 0, now, now, self.started_ns,
                     ROOT_INO if is_dir else CONTROL_DIR_INO, 0, 0,
                     CONTROL_DIR if is_dir else STATS_NAME)

    def entries(self, directory: int, after: int) -> list[tuple[bytes, Inode]]:
        """What readdir of `.kvfs` lists. The root does not list `.kvfs`: it is reached by
        name only, so that find, du and scripts over the cache see only cache files."""
        if directory == CONTROL_DIR_INO and after < STATS_INO:
            return [(STATS_NAME, self.attributes(STATS_INO))]
        return []

    # -- requests routed here (ROUTES), with the arguments of the FUSE handlers --------------

    async def open(self, ino: int, flags: int, ctx: object) -> FileInfo:
        if ino == CONTROL_DIR_INO:
            raise fail(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise fail(errno.EACCES)
        fh = next(self._next_fh)
        self._contents[fh] = await self._files[ino]()
        return FileInfo(fh=fh, direct_io=True)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        return self._contents[fh][offset: offset + size]

    async def release(self, fh: int) -> None:
        del self._contents[fh]

    async def flush(self, fh: int) -> None:
        pass

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        raise fail(errno.EBADF)

    async def setattr(self, ino: int, *_: object) -> None:
        raise fail(errno.EPERM)

    async def link(self, ino: int, *_: object) -> None:
        raise fail(errno.EPERM)

    async def readlink(self, ino: int, ctx: object) -> bytes:
        raise fail(errno.EINVAL)

    async def getxattr(self, ino: int, name: bytes, ctx: object) -> bytes:
        raise fail(errno.ENODATA)

    async def listxattr(self, ino: int, ctx: object) -> list[bytes]:
        return []

    async def setxattr(self, ino: int, name: bytes, *_: object) -> None:
        raise fail(errno.EPERM if name.startswith(USER_XATTR) else errno.ENOTSUP)

    async def removexattr(self, ino: int, name: bytes, ctx: object) -> None:
        raise fail(errno.EPERM if name.startswith(USER_XATTR) else errno.ENOTSUP)


# A route: given the control files and a request's arguments, the control files' answer to
# await, or None where the request is not theirs.
Route = Callable[[ControlFiles, tuple], Coroutine[Any, Any, Any] | None]


def by_inode(request: str) -> Route:
    def route(control: ControlFiles, args: tuple) -> Coroutine[Any, Any, Any] | None:
        return getattr(control, request)(*args) if args[0] in CONTROL_INOS else None
    return route


def by_handle(request: str) -> Route:
    def route(control: ControlFiles, args: tuple) -> Coroutine[Any, Any, Any] | None:
        return getattr(control, request)(*args) if control.owns_handle(args[0]) else None
    return route


async def _refused() -> None:
    raise fail(errno.EPERM)


def by_names(*positions: int) -> Route:
    """Refuse a request whose (parent, name) arguments at `positions` are reserved."""
    def route(control: ControlFiles, args: tuple) -> Coroutine[Any, Any, Any] | None:
        if any(control.is_reserved(args[at], args[at + 1]) for at in positions):
            return _refused()
        return None
    return route


def either(*routes: Route) -> Route:
    def route(control: ControlFiles, args: tuple) -> Coroutine[Any, Any, Any] | None:
        for each in routes:
            if (answer := each(control, args)) is not None:
                return answer
        return None
    return route


ROUTES: dict[str, Route] = {
    **{request: by_inode(request) for request in (
        "open", "setattr", "readlink", "getxattr", "listxattr", "setxattr", "removexattr")},
    **{request: by_handle(request) for request in (
        "read", "flush", "fsync", "fallocate", "release")},
    **{request: by_names(0) for request in ("mknod", "mkdir", "unlink", "rmdir", "symlink",
                                             "create")},
    "rename": by_names(0, 2),
    "link": either(by_names(1), by_inode("link")),
}
