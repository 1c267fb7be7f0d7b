"""The metadata store: namespace, attributes, xattrs and blob records, over a metadata engine.

The namespace logic is written once here, over the transactions of an engine
(kvfs/engine.py): ordered families of byte keys. The embedded engine is LMDB in `DATA/meta/`.
All integers in keys are 8-byte big-endian so that byte order is numeric order.

Key schema (one family each):

    inode    ino                      -> Inode record (struct _INODE, then its primary name)
    dentry   parent ino + name        -> child ino + cookie     (lookup by name)
    dirlist  parent ino + cookie      -> child ino + name       (readdir in stable cookie order)
    links    ino + parent ino + name  -> b""   (every name of an inode: hard links)
    symlink  ino                      -> target
    xattr    ino + attribute name     -> value
    blob     blob id                  -> owner ino, size, allocated, block size, xxh3 per block
    doomed   blob id                  -> b""   (data files to delete; crash-safe unlink)
    pending  blob id                  -> session (blobs whose block sums are still to be taken)
    recency  atime ns + ino           -> b""   (files by last use: eviction order)
    pins     ino                      -> b""   (files and directories with user.kvfs.pin)
    held     blob id + session        -> b""   (blobs open on a host of a shared pool)
    holding  session + blob id        -> b""   (the same, by session)
    sessions session                  -> host name, pid, boot id, mountpoint (shared pool)
    models   model name + \0files|\0bytes -> counter (LMCache files and bytes per model)
    counters name                     -> counter (next_ino, next_blob, used_bytes, files)
    settings name                     -> bytes (format, capacity, boot: boot id of the last mount)

Counters are only ever added to inside a change (never read there), so that a shared engine
adds them without making changes that touch them conflict; id stocks are taken outside
changes (`Engine.allocate`).

Every directory entry has a cookie, unique for the volume's life (taken from the inode
counter), so that readdir resumes after the last cookie it returned and a listing stays
complete and stable while entries come and go, also with several names of one inode in one
directory. An inode's primary name (`Inode.parent`, `Inode.name`) is one of its entries: the
only one of a directory, the first of a file; per-model usage follows it.

An inode's file content is one immutable blob: a write handle fills a new blob and its close
commits it by pointing the inode at it in one transaction. `used_bytes` counts the bytes blobs
occupy on the volume (holes take none), each blob once however many names its inode has.
A file's atime is its last use (lookup, open, read; flushed in batches), and `recency` indexes
files by it so that eviction walks them oldest first without a scan.

Every change is one transaction of the engine (group-committed: kvfs/engine.py); a caller
returns once its change is durable. Inode numbers and cookies come from a stock taken from
`next_ino` in committed batches (ID_BATCH), so that the counter is written once per batch,
not by every create, and no id is ever given twice.

Errors are raised as `FsError` (an OSError) with a precise errno; the FUSE layer passes them
through.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import islice, takewhile
from typing import TypeVar

from kvfs.engine import Engine, Txn
from kvfs.models import model_of
from kvfs.records import BLOB_RECORD, BlobInfo, FsError, fail

ROOT_INO = 1
NAME_MAX = 255
PATH_MAX = 4096
XATTR_VALUE_MAX = 64 * 1024
PIN_XATTR = b"user.kvfs.pin"
FORMAT = b"kvfs-3"
V1_FORMAT = b"kvfs-1"  # before hard links and holes: migrated in place at open
V2_FORMAT = b"kvfs-2"  # per-model usage as one packed record: migrated in place at open
DEFAULT_MAP_SIZE = 64 << 30  # virtual only: the file grows with use
LINK_MAX = 65000  # as ext4

ID_BATCH = 1024  # inode numbers and cookies taken from `next_ino` at once
TOUCH_BATCH = 256  # recorded uses per transaction
READDIR_BATCH = 128  # entries whose inodes are read at once
T = TypeVar("T")

_U64 = struct.Struct(">Q")
_INODE = struct.Struct("<IIIIQQQqqqQQQ")
MODEL_FILES = b"\0files"
MODEL_BYTES = b"\0bytes"

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
FAMILIES = ("inode", "dentry", "dirlist", "links", "symlink", "xattr", "blob", "doomed", "pending",
            "held", "holding", "sessions", "recency", "pins", "models", "counters", "settings")


def u64(value: int) -> bytes:
    return _U64.pack(value)


def from_u64(raw: bytes) -> int:
    return _U64.unpack(raw[:8])[0]


@dataclass(frozen=True, slots=True)
class Inode:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int
    size: int
    allocated: int  # bytes the content takes on the volume (holes take none)
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    parent: int  # primary name: the directory's only entry, a file's first
    blob: int  # 0: no data (empty file, directory, special file)
    version: int  # bumped by every content commit: tells page-cache users what changed
    name: bytes

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_regular(self) -> bool:
        return stat.S_ISREG(self.mode)

    def pack(self) -> bytes:
        return (
            _INODE.pack(
                self.mode, self.nlink, self.uid, self.gid, self.rdev, self.size, self.allocated,
                self.atime_ns, self.mtime_ns, self.ctime_ns, self.parent, self.blob,
                self.version,
            )
            + self.name
        )

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> Inode:
        return cls(ino, *_INODE.unpack_from(raw), name=bytes(raw[_INODE.size:]))


@dataclass(frozen=True, slots=True)
class Removed:
    """An inode that lost names: `gone` when it lost its last one (its record is deleted)."""

    inode: Inode
    names: list[tuple[int, bytes]] = field(default_factory=list)  # the names it lost

    @property
    def gone(self) -> bool:
        return self.inode.nlink == 0


@dataclass(frozen=True, slots=True)
class Usage:
    capacity: int
    used: int
    files: int


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise fail(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise fail(errno.EINVAL)


class MetaStore:
    """Namespace and attributes of one kvfs volume, kept in LMDB."""

    def __init__(self, engine: Engine, readonly: bool = False) -> None:
        self.engine = engine
        self.session = b""  # this mount's session in a shared pool (kvfs/sessions.py)
        self._ids: range = range(0)  # inode numbers and cookies in stock
        self._ids_lock = threading.Lock()
        if not readonly:
            try:
                self._change(self._open_format)
            except BaseException:
                self.engine.close()
                raise

    def _open_format(self, txn: Txn) -> None:
        stored = txn.get("settings", b"format")
        if stored is None:
            self._format(txn)
        elif stored == V1_FORMAT:
            self._migrate_from_v1(txn)
        elif stored == V2_FORMAT:
            self._migrate_from_v2(txn)
        elif stored != FORMAT:
            raise RuntimeError(f"unsupported metadata format {stored!r}")

    def close(self) -> None:
        self.engine.close()

    def _format(self, txn: Txn) -> None:
        now = time.time_ns()
        # The root belongs to whoever formats the volume: root, or the user who mounts it.
        root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(), 0, 0, 0, now,
                     now, now, ROOT_INO, 0, 0, b"")
        txn.put("inode", u64(ROOT_INO), root.pack())
        txn.put("settings", b"format", FORMAT)
        txn.add("counters", b"next_ino", ROOT_INO + 1)
        txn.add("counters", b"next_blob", 1)

    def _migrate_from_v1(self, txn: Txn) -> None:
        """kvfs-1 records: no rdev, allocation or cookies; one name per inode. A file's
        allocation is taken as its size in whole 4 KiB blocks."""
        old_inode, old_blob = struct.Struct("<IIIIQqqqQQQ"), struct.Struct("<QQI")
        allocated: dict[int, int] = {}
        for key, raw in list(txn.scan("blob")):
            ino, size, block_size = old_blob.unpack_from(raw)
            allocated[ino] = -(-size // 4096) * 4096
            txn.put("blob", key, BLOB_RECORD.pack(ino, size, allocated[ino], block_size, 0)
                    + raw[old_blob.size:])
        for key, raw in list(txn.scan("inode")):
            mode, nlink, uid, gid, size, *times, parent, blob, version = \
                old_inode.unpack_from(raw)
            ino = from_u64(key)
            inode = Inode(ino, mode, nlink, uid, gid, 0, size, allocated.get(ino, 0), *times,
                          parent, blob, version, bytes(raw[old_inode.size:]))
            self._put(txn, inode)
        txn.add("counters", b"used_bytes",
                sum(allocated.values()) - txn.count("counters", b"used_bytes"))
        txn.clear("models")
        for inode in [Inode.unpack(from_u64(k), v) for k, v in txn.scan("inode")]:
            self._count_model(txn, inode, inode.name, 1, inode.allocated)
        for key, child in list(txn.scan("dentry")):
            txn.put("dentry", key, child + child)  # the cookie is the child ino
            txn.put("links", child + key, b"")
        for key, name in list(txn.scan("dirlist")):
            txn.put("dirlist", key, key[8:] + name)
        txn.put("settings", b"format", FORMAT)

    def _migrate_from_v2(self, txn: Txn) -> None:
        """kvfs-2 kept a model's files and bytes in one packed record (embedded engine only:
        these reads inside a change are fine there)."""
        packed = struct.Struct("<qq")
        for key, raw in list(txn.scan("models")):
            files, allocated = packed.unpack(raw)
            txn.delete("models", key)
            txn.add("models", key + MODEL_FILES, files)
            txn.add("models", key + MODEL_BYTES, allocated)
        txn.put("settings", b"format", FORMAT)

    # -- small helpers -------------------------------------------------------------------

    def _change(self, change: Callable[[Txn], T]) -> T:
        """Run `change` in one transaction of the engine; returns once it is durable."""
        return self.engine.change(change)

    def _fresh_ids(self, count: int) -> range:
        """Inode numbers or cookies for one change, taken (in the caller's thread, before the
        change, which may run more than once) from a stock that is itself taken from
        `next_ino` in batches: ids are never reused, whatever happens to the changes."""
        with self._ids_lock:
            if len(self._ids) < count:
                end = self.engine.allocate(b"next_ino", ID_BATCH)
                self._ids = range(end - ID_BATCH, end)
            taken, self._ids = self._ids[:count], self._ids[count:]
        return taken

    def _get(self, txn: Txn, ino: int) -> Inode:
        raw = txn.get("inode", u64(ino))
        if raw is None:
            raise fail(errno.ENOENT)
        return Inode.unpack(ino, raw)

    def _put(self, txn: Txn, inode: Inode) -> None:
        txn.put("inode", u64(inode.ino), inode.pack())

    def _index_use(self, txn: Txn, inode: Inode, old_atime: int | None,
                   new_atime: int | None) -> None:
        """Keep a file's place in the recency index in step with its atime."""
        if inode.is_dir:
            return
        if old_atime is not None:
            txn.delete("recency", u64(old_atime) + u64(inode.ino))
        if new_atime is not None:
            txn.put("recency", u64(new_atime) + u64(inode.ino), b"")

    def _count_model(self, txn: Txn, inode: Inode, name: bytes, files: int,
                     allocated: int) -> None:
        """Per-model usage: a file counts for the model its primary name says (if any)."""
        model = None if inode.is_dir else model_of(name)
        if model is None:
            return
        if files:
            txn.add("models", model.encode() + MODEL_FILES, files)
        if allocated:
            txn.add("models", model.encode() + MODEL_BYTES, allocated)

    def _dir(self, txn: Txn, ino: int) -> Inode:
        inode = self._get(txn, ino)
        if not inode.is_dir:
            raise fail(errno.ENOTDIR)
        return inode

    def _child(self, txn: Txn, parent: int, name: bytes) -> Inode | None:
        raw = txn.get("dentry", u64(parent) + name)
        return None if raw is None else self._get(txn, from_u64(raw))

    def _link(self, txn: Txn, parent: int, name: bytes, ino: int, cookie_id: int) -> None:
        cookie = u64(cookie_id)
        txn.put("dentry", u64(parent) + name, u64(ino) + cookie)
        txn.put("dirlist", u64(parent) + cookie, u64(ino) + name)
        txn.put("links", u64(ino) + u64(parent) + name, b"")

    def _unlink(self, txn: Txn, parent: int, name: bytes, ino: int) -> None:
        raw = txn.pop("dentry", u64(parent) + name)
        if raw is not None:
            txn.delete("dirlist", u64(parent) + raw[8:16])
        txn.delete("links", u64(ino) + u64(parent) + name)

    def _suffixes(self, txn: Txn, family: str, prefix: bytes) -> list[bytes]:
        """The rest of every key of `family` that starts with `prefix`."""
        found = []
        for key, _ in txn.scan(family, prefix):
            if key[: len(prefix)] != prefix:
                break
            found.append(bytes(key[len(prefix):]))
        return found

    def _names(self, txn: Txn, ino: int) -> list[tuple[int, bytes]]:
        return [(from_u64(rest), rest[8:]) for rest in self._suffixes(txn, "links", u64(ino))]

    def _has_children(self, txn: Txn, ino: int) -> bool:
        first = next(txn.scan("dirlist", u64(ino)), None)
        return first is not None and first[0][:8] == u64(ino)

    def _drop_name(self, txn: Txn, inode: Inode, parent: int, name: bytes,
                   now: int) -> Inode:
        """Remove one name of a non-directory; the inode goes with its last name."""
        self._unlink(txn, parent, name, inode.ino)
        if inode.nlink <= 1:
            self._drop_inode(txn, inode)
            return replace(inode, nlink=0)
        updated = replace(inode, nlink=inode.nlink - 1, ctime_ns=now)
        if (parent, name) == (inode.parent, inode.name):  # another name becomes the primary
            new_parent, new_name = self._names(txn, inode.ino)[0]
            self._count_model(txn, inode, name, -1, -inode.allocated)
            self._count_model(txn, inode, new_name, 1, inode.allocated)
            updated = replace(updated, parent=new_parent, name=new_name)
        self._put(txn, updated)
        return updated

    def _drop_inode(self, txn: Txn, inode: Inode) -> None:
        """Remove an unlinked inode's record, its xattrs, and doom its blob."""
        key = u64(inode.ino)
        for family in ("inode", "pins", "symlink"):
            txn.delete(family, key)
        self._index_use(txn, inode, inode.atime_ns, None)
        for name in self._suffixes(txn, "xattr", key):
            txn.delete("xattr", key + name)
        if not inode.is_dir:
            txn.add("counters", b"files", -1)
        self._count_model(txn, inode, inode.name, -1, -inode.allocated)
        self._release_blob(txn, inode.blob)

    def _release_blob(self, txn: Txn, blob_id: int) -> None:
        if not blob_id:
            return
        raw = txn.pop("blob", u64(blob_id))
        if raw is not None:
            txn.add("counters", b"used_bytes", -BlobInfo.unpack(blob_id, raw).allocated)
        txn.delete("pending", u64(blob_id))
        txn.put("doomed", u64(blob_id), b"")

    # -- reads ---------------------------------------------------------------------------

    def get(self, ino: int) -> Inode:
        with self.engine.snapshot() as txn:
            return self._get(txn, ino)

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        if len(name) > NAME_MAX:
            raise fail(errno.ENAMETOOLONG)
        with self.engine.snapshot() as txn:
            return self._child(txn, parent, name)

    def names(self, ino: int) -> list[tuple[int, bytes]]:
        with self.engine.snapshot() as txn:
            return self._names(txn, ino)

    def readlink(self, ino: int) -> bytes:
        with self.engine.snapshot() as txn:
            self._get(txn, ino)
            target = txn.get("symlink", u64(ino))
        if target is None:
            raise fail(errno.EINVAL)
        return bytes(target)

    def content(self, ino: int) -> tuple[Inode, BlobInfo | None]:
        """An inode and the record of its blob, as of one moment (a shared engine's reads
        are not one snapshot: a blob replaced between the two reads means read again)."""
        while True:
            with self.engine.snapshot() as txn:
                inode = self._get(txn, ino)
                raw = txn.get("blob", u64(inode.blob)) if inode.blob else None
                if inode.blob and raw is None and self._get(txn, ino).blob != inode.blob:
                    continue
            if inode.blob and raw is None:
                raise fail(errno.EIO)
            return inode, BlobInfo.unpack(inode.blob, raw) if raw is not None else None

    def readdir(self, parent: int, after: int) -> Iterator[tuple[bytes, Inode, int]]:
        """Entries of `parent` with a cookie > after, in cookie order: (name, inode, cookie)."""
        prefix = u64(parent)
        with self.engine.snapshot() as txn:
            entries = takewhile(lambda entry: entry[0][:8] == prefix,
                                txn.scan("dirlist", prefix + u64(after + 1)))
            while batch := list(islice(entries, READDIR_BATCH)):
                children = txn.get_many("inode", [bytes(value[:8]) for _, value in batch])
                for (key, value), child in zip(batch, children, strict=True):
                    if child is not None:
                        yield (bytes(value[8:]), Inode.unpack(from_u64(value), child),
                               from_u64(key[8:]))

    def usage(self) -> Usage:
        with self.engine.snapshot() as txn:
            return Usage(self._capacity(txn), txn.count("counters", b"used_bytes"),
                         txn.count("counters", b"files"))

    def _capacity(self, txn: Txn) -> int:
        raw = txn.get("settings", b"capacity")
        return from_u64(raw) if raw else 0

    def capacity(self) -> int:
        with self.engine.snapshot() as txn:
            return self._capacity(txn)

    def set_capacity(self, capacity: int) -> None:
        def change(txn: Txn) -> None:
            txn.put("settings", b"capacity", u64(capacity))
        self._change(change)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.engine.snapshot() as txn:
            self._get(txn, ino)
            value = txn.get("xattr", u64(ino) + name)
        if value is None:
            raise fail(errno.ENODATA)
        return bytes(value)

    def listxattr(self, ino: int) -> list[bytes]:
        with self.engine.snapshot() as txn:
            self._get(txn, ino)
            return self._suffixes(txn, "xattr", u64(ino))

    def inodes(self) -> Iterator[Inode]:
        with self.engine.snapshot() as txn:
            for key, raw in txn.scan("inode"):
                yield Inode.unpack(from_u64(key), raw)

    def blobs(self) -> Iterator[BlobInfo]:
        with self.engine.snapshot() as txn:
            for key, raw in txn.scan("blob"):
                yield BlobInfo.unpack(from_u64(key), raw)

    def doomed(self) -> list[int]:
        with self.engine.snapshot() as txn:
            return [from_u64(key) for key, _ in txn.scan("doomed")]

    def entries(self) -> Iterator[tuple[int, bytes, int]]:
        """Every (parent, name, child) directory entry."""
        with self.engine.snapshot() as txn:
            for key, child in txn.scan("dentry"):
                yield from_u64(key[:8]), bytes(key[8:]), from_u64(child)

    def blob_info(self, blob_id: int) -> BlobInfo | None:
        with self.engine.snapshot() as txn:
            raw = txn.get("blob", u64(blob_id))
            return None if raw is None else BlobInfo.unpack(blob_id, raw)

    def pending(self, session: bytes = b"") -> list[tuple[int, int]]:
        """(blob id, owner ino) of blobs whose sums `session` was still to take."""
        with self.engine.snapshot() as txn:
            found = []
            for key, writer in txn.scan("pending"):
                raw = txn.get("blob", key)
                if raw is not None and writer == session:
                    found.append((from_u64(key), BlobInfo.unpack(from_u64(key), raw).ino))
            return found

    def settle(self, blob_id: int, sums: array) -> BlobInfo | None:
        """Record the block sums of a pending blob; None if it is gone (replaced, removed)."""
        def change(txn: Txn) -> BlobInfo | None:
            raw = txn.get("blob", u64(blob_id))
            if raw is None:
                return None
            settled = replace(BlobInfo.unpack(blob_id, raw), sums=sums, pending=False)
            txn.put("blob", u64(blob_id), settled.pack())
            txn.delete("pending", u64(blob_id))
            return settled
        return self._change(change)

    def swap_boot(self, boot: bytes) -> bytes | None:
        """Record the boot this mount runs in; returns the one recorded before."""
        def change(txn: Txn) -> bytes | None:
            before = txn.get("settings", b"boot")
            txn.put("settings", b"boot", boot)
            return None if before is None else bytes(before)
        return self._change(change)

    def is_committed_blob(self, blob_id: int) -> bool:
        with self.engine.snapshot() as txn:
            return txn.get("blob", u64(blob_id)) is not None

    # -- namespace changes ---------------------------------------------------------------

    def _check_room(self) -> None:
        """Refuse growth of the namespace near a full engine, so that removing files always
        remains possible."""
        if not self.engine.has_room():
            raise fail(errno.ENOSPC)

    def make(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
             target: bytes | None = None) -> Inode:
        """Create an inode of any type (by `mode`) named `name` in `parent`; a symlink's
        `target` is its content."""
        check_name(name)
        self._check_room()
        if stat.S_ISLNK(mode) and (not target or len(target) >= PATH_MAX or b"\0" in target):
            raise fail(errno.ENAMETOOLONG if target and len(target) >= PATH_MAX
                       else errno.EINVAL)
        if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            rdev = 0
        now = time.time_ns()
        ino, cookie = self._fresh_ids(2)  # the inode number and the entry's cookie

        def change(txn: Txn) -> Inode:
            parent_inode = self._dir(txn, parent)
            if self._child(txn, parent, name) is not None:
                raise fail(errno.EEXIST)
            is_dir = stat.S_ISDIR(mode)
            owner_gid, full_mode = gid, mode
            if parent_inode.mode & stat.S_ISGID:  # BSD group semantics of setgid directories
                owner_gid = parent_inode.gid
                full_mode |= stat.S_ISGID if is_dir else 0
            size = len(target) if target else 0
            inode = Inode(ino, full_mode, 2 if is_dir else 1, uid, owner_gid, rdev, size, 0, now,
                          now, now, parent, 0, 0, name)
            self._put(txn, inode)
            if target:
                txn.put("symlink", u64(ino), target)
            self._index_use(txn, inode, None, now)
            self._count_model(txn, inode, name, 1, 0)
            self._link(txn, parent, name, ino, cookie)
            self._put(txn, replace(parent_inode, nlink=parent_inode.nlink + is_dir,
                                   mtime_ns=now, ctime_ns=now))
            if not is_dir:
                txn.add("counters", b"files", 1)
            return inode
        return self._change(change)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A further name for a non-directory (a hard link)."""
        check_name(new_name)
        self._check_room()
        now = time.time_ns()
        (cookie,) = self._fresh_ids(1)

        def change(txn: Txn) -> Inode:
            inode = self._get(txn, ino)
            if inode.is_dir:
                raise fail(errno.EPERM)
            if inode.nlink >= LINK_MAX:
                raise fail(errno.EMLINK)
            parent_inode = self._dir(txn, new_parent)
            if self._child(txn, new_parent, new_name) is not None:
                raise fail(errno.EEXIST)
            self._link(txn, new_parent, new_name, ino, cookie)
            inode = replace(inode, nlink=inode.nlink + 1, ctime_ns=now)
            self._put(txn, inode)
            self._put(txn, replace(parent_inode, mtime_ns=now, ctime_ns=now))
            return inode
        return self._change(change)

    def remove(self, parent: int, name: bytes, is_dir: bool) -> Removed:
        """unlink (is_dir False) or rmdir (True) of one name."""
        check_name(name)
        now = time.time_ns()
        def change(txn: Txn) -> Removed:
            parent_inode = self._dir(txn, parent)
            inode = self._child(txn, parent, name)
            if inode is None:
                raise fail(errno.ENOENT)
            if is_dir and not inode.is_dir:
                raise fail(errno.ENOTDIR)
            if not is_dir and inode.is_dir:
                raise fail(errno.EISDIR)
            if is_dir:
                if self._has_children(txn, inode.ino):
                    raise fail(errno.ENOTEMPTY)
                self._unlink(txn, parent, name, inode.ino)
                self._drop_inode(txn, inode)
                after = replace(inode, nlink=0)
            else:
                after = self._drop_name(txn, inode, parent, name, now)
            self._put(txn, replace(parent_inode, nlink=parent_inode.nlink - inode.is_dir,
                                   mtime_ns=now, ctime_ns=now))
            return Removed(after, [(parent, name)])
        return self._change(change)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> tuple[Inode, Removed | None]:
        """Move an entry, atomically replacing a compatible target; returns the moved inode
        and what happened to the replaced one (if any)."""
        check_name(old_name)
        check_name(new_name)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
                RENAME_NOREPLACE | RENAME_EXCHANGE):
            raise fail(errno.EINVAL)
        now = time.time_ns()
        reserved = self._fresh_ids(2)  # new entries: one, or two for an exchange

        def change(txn: Txn) -> tuple[Inode, Removed | None]:
            cookies = iter(reserved)
            self._dir(txn, old_parent)
            self._dir(txn, new_parent)
            moved = self._child(txn, old_parent, old_name)
            if moved is None:
                raise fail(errno.ENOENT)
            target = self._child(txn, new_parent, new_name)
            if moved.is_dir and self._is_ancestor(txn, moved.ino, new_parent):
                raise fail(errno.EINVAL)
            if flags & RENAME_EXCHANGE:
                if target is None:
                    raise fail(errno.ENOENT)
                if target.is_dir and self._is_ancestor(txn, target.ino, old_parent):
                    raise fail(errno.EINVAL)
                self._exchange(txn, (old_parent, old_name, moved),
                               (new_parent, new_name, target), now, cookies)
                return self._get(txn, moved.ino), None
            replaced = None
            if target is not None:
                if target.ino == moved.ino:  # two names of one file: POSIX says do nothing
                    return moved, None
                if flags & RENAME_NOREPLACE:
                    raise fail(errno.EEXIST)
                self._check_replaceable(txn, moved, target)
                if target.is_dir:
                    self._unlink(txn, new_parent, new_name, target.ino)
                    self._drop_inode(txn, target)
                    self._adjust_parent(txn, new_parent, -1, now)
                    replaced = Removed(replace(target, nlink=0), [(new_parent, new_name)])
                else:
                    replaced = Removed(self._drop_name(txn, target, new_parent, new_name, now),
                                       [(new_parent, new_name)])
                moved = self._get(txn, moved.ino)  # unchanged unless it was the target
            moved = self._move_name(txn, moved, (old_parent, old_name),
                                    (new_parent, new_name), now, next(cookies))
            self._adjust_parent(txn, old_parent, -moved.is_dir, now)
            self._adjust_parent(txn, new_parent, moved.is_dir, now)
            return moved, replaced
        return self._change(change)

    def _move_name(self, txn: Txn, inode: Inode, old: tuple[int, bytes],
                   new: tuple[int, bytes], now: int, cookie: int) -> Inode:
        """Re-point one name of `inode` (stored) and return its updated record."""
        self._unlink(txn, *old, inode.ino)
        self._link(txn, *new, inode.ino, cookie)
        return self._renamed(txn, inode, old, new, now)

    def _renamed(self, txn: Txn, inode: Inode, old: tuple[int, bytes],
                 new: tuple[int, bytes], now: int) -> Inode:
        """Store an inode whose name `old` is now `new`: its primary name and model follow."""
        updated = replace(inode, ctime_ns=now)
        if old == (inode.parent, inode.name):
            self._count_model(txn, inode, old[1], -1, -inode.allocated)
            self._count_model(txn, inode, new[1], 1, inode.allocated)
            updated = replace(updated, parent=new[0], name=new[1])
        self._put(txn, updated)
        return updated

    def _check_replaceable(self, txn: Txn, moved: Inode, target: Inode) -> None:
        if moved.is_dir and not target.is_dir:
            raise fail(errno.ENOTDIR)
        if not moved.is_dir and target.is_dir:
            raise fail(errno.EISDIR)
        if target.is_dir and self._has_children(txn, target.ino):
            raise fail(errno.ENOTEMPTY)

    def _exchange(self, txn: Txn, first: tuple[int, bytes, Inode],
                  second: tuple[int, bytes, Inode], now: int, cookies: Iterator[int]) -> None:
        (first_parent, first_name, first_inode) = first
        (second_parent, second_name, second_inode) = second
        if first_inode.ino == second_inode.ino:
            return
        self._unlink(txn, first_parent, first_name, first_inode.ino)
        self._unlink(txn, second_parent, second_name, second_inode.ino)
        self._link(txn, first_parent, first_name, second_inode.ino, next(cookies))
        self._link(txn, second_parent, second_name, first_inode.ino, next(cookies))
        self._renamed(txn, first_inode, (first_parent, first_name),
                      (second_parent, second_name), now)
        self._renamed(txn, second_inode, (second_parent, second_name),
                      (first_parent, first_name), now)
        if first_parent != second_parent and first_inode.is_dir != second_inode.is_dir:
            shift = first_inode.is_dir - second_inode.is_dir
            self._adjust_parent(txn, first_parent, -shift, now)
            self._adjust_parent(txn, second_parent, shift, now)
        else:
            for parent in {first_parent, second_parent}:
                self._adjust_parent(txn, parent, 0, now)

    def _adjust_parent(self, txn: Txn, ino: int, nlink_delta: int, now: int) -> None:
        inode = self._get(txn, ino)
        self._put(txn, replace(inode, nlink=inode.nlink + nlink_delta, mtime_ns=now, ctime_ns=now))

    def _is_ancestor(self, txn: Txn, ancestor: int, ino: int) -> bool:
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT_INO:
                return False
            ino = self._get(txn, ino).parent

    def set_attrs(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, atime_ns: int | None = None,
                  mtime_ns: int | None = None, clear_mode: int = 0) -> Inode:
        """Change attributes; `clear_mode` bits are cleared from the stored mode (setuid and
        setgid on writes), inside the same transaction."""
        def change(txn: Txn) -> Inode:
            inode = self._get(txn, ino)
            if clear_mode and not inode.mode & clear_mode and mode is None:
                return inode  # a write that finds nothing to clear changes no attribute
            changes: dict[str, int] = {"ctime_ns": time.time_ns()}
            if mode is not None:
                changes["mode"] = stat.S_IFMT(inode.mode) | stat.S_IMODE(mode)
            if clear_mode:
                changes["mode"] = changes.get("mode", inode.mode) & ~clear_mode
            for name, value in (("uid", uid), ("gid", gid), ("atime_ns", atime_ns),
                                ("mtime_ns", mtime_ns)):
                if value is not None:
                    changes[name] = value
            updated = replace(inode, **changes)
            self._put(txn, updated)
            if updated.atime_ns != inode.atime_ns:
                self._index_use(txn, inode, inode.atime_ns, updated.atime_ns)
            return updated
        return self._change(change)

    def allocate_blob_ids(self, count: int) -> range:
        """Take `count` blob ids in one transaction (writers take them in batches)."""
        end = self.engine.allocate(b"next_blob", count)
        return range(end - count, end)

    def commit_content(self, ino: int, blob: BlobInfo | None) -> tuple[Inode, int]:
        """Point `ino` at a new blob (None: empty); returns the new inode and the replaced blob.

        Raises ENOENT when the inode was removed meanwhile: the caller discards the blob."""
        now = time.time_ns()
        def change(txn: Txn) -> tuple[Inode, int]:
            inode = self._get(txn, ino)
            old_blob = inode.blob
            self._release_blob(txn, old_blob)
            size = allocated = 0
            if blob is not None:
                txn.put("blob", u64(blob.blob_id), blob.pack())
                if blob.pending:
                    txn.put("pending", u64(blob.blob_id), self.session)
                txn.add("counters", b"used_bytes", blob.allocated)
                size, allocated = blob.size, blob.allocated
            updated = replace(inode, size=size, allocated=allocated,
                              blob=blob.blob_id if blob else 0, version=inode.version + 1,
                              atime_ns=now, mtime_ns=now, ctime_ns=now)
            self._put(txn, updated)
            self._index_use(txn, inode, inode.atime_ns, now)
            self._count_model(txn, inode, inode.name, 0, allocated - inode.allocated)
            return updated, old_blob
        return self._change(change)

    def drop_files(self, inos: Iterable[int], spare_held: bool = False) -> list[Removed]:
        """Remove files with every name they have (eviction, lost data), in one transaction;
        inodes already gone are skipped, and with `spare_held` (eviction) so are files whose
        blob a host holds open."""
        now = time.time_ns()
        def change(txn: Txn) -> list[Removed]:
            dropped = []
            for ino in inos:
                try:
                    inode = self._get(txn, ino)
                except FsError:
                    continue
                if spare_held and inode.blob and self._holders(txn, inode.blob):
                    continue
                names = self._names(txn, ino)
                for parent, name in names:
                    self._unlink(txn, parent, name, ino)
                    self._adjust_parent(txn, parent, 0, now)
                self._drop_inode(txn, inode)
                dropped.append(Removed(replace(inode, nlink=0), names))
            return dropped
        return self._change(change)

    def remove_entry(self, parent: int, name: bytes, ino: int) -> None:
        """fsck: delete a directory entry whose inode is missing."""
        def change(txn: Txn) -> None:
            self._unlink(txn, parent, name, ino)
        self._change(change)

    def set_nlink(self, ino: int, nlink: int) -> None:
        """fsck: set a file's link count to the number of its names."""
        def change(txn: Txn) -> None:
            self._put(txn, replace(self._get(txn, ino), nlink=nlink))
        self._change(change)

    def forget_blob(self, blob_id: int) -> None:
        """fsck: delete a blob record no inode points at (its data file goes with it)."""
        def change(txn: Txn) -> None:
            txn.delete("blob", u64(blob_id))
            txn.put("doomed", u64(blob_id), b"")
        self._change(change)

    def set_usage(self, used: int, files: int, models: dict[str, dict[str, int]]) -> None:
        """fsck: reset the usage counters to what was counted (by adding the difference)."""
        now = self.usage()
        def change(txn: Txn) -> None:
            txn.add("counters", b"used_bytes", used - now.used)
            txn.add("counters", b"files", files - now.files)
            txn.clear("models")
            for model, counts in models.items():
                txn.add("models", model.encode() + MODEL_FILES, counts["files"])
                txn.add("models", model.encode() + MODEL_BYTES, counts["bytes"])
        self._change(change)

    def reaped(self, blob_ids: list[int]) -> None:
        """Doomed blobs whose files are gone: their records go."""
        if not blob_ids:
            return

        def change(txn: Txn) -> None:
            for blob_id in blob_ids:
                txn.delete("doomed", u64(blob_id))
        self._change(change)

    # -- hosts of a shared pool (kvfs/sessions.py) ----------------------------------------

    def register_session(self, session: bytes, record: bytes) -> None:
        self._change(lambda txn: txn.put("sessions", session, record))

    def sessions(self) -> dict[bytes, bytes]:
        with self.engine.snapshot() as txn:
            return {bytes(key): bytes(value) for key, value in txn.scan("sessions")}

    def end_session(self, session: bytes) -> bool:
        """Remove a session and its holds; False if it was gone (another host claimed it)."""
        def change(txn: Txn) -> bool:
            if not txn.delete("sessions", session):
                return False
            for blob in self._suffixes(txn, "holding", session):
                txn.discard("holding", session + blob)
                txn.discard("held", blob + session)
            return True
        return self._change(change)

    def hold(self, blob_id: int, session: bytes) -> None:
        def change(txn: Txn) -> None:
            txn.put("held", u64(blob_id) + session, b"")
            txn.put("holding", session + u64(blob_id), b"")
        self._change(change)

    def release(self, blob_id: int, session: bytes) -> None:
        def change(txn: Txn) -> None:
            txn.discard("held", u64(blob_id) + session)
            txn.discard("holding", session + u64(blob_id))
        self._change(change)

    def _holders(self, txn: Txn, blob_id: int) -> list[bytes]:
        return self._suffixes(txn, "held", u64(blob_id)) if blob_id else []

    def holders(self, blob_id: int) -> list[bytes]:
        """Sessions that hold `blob_id` open."""
        with self.engine.snapshot() as txn:
            return self._holders(txn, blob_id)

    # -- recency and xattrs ----------------------------------------------------------------

    def touch(self, uses: dict[int, int]) -> None:
        """Record the last use (ns) of files, TOUCH_BATCH per transaction (each reads its
        inodes at once); gone inodes are skipped."""
        pending = list(uses.items())
        for first in range(0, len(pending), TOUCH_BATCH):
            batch = pending[first:first + TOUCH_BATCH]

            def change(txn: Txn, batch: list[tuple[int, int]] = batch) -> None:
                raws = txn.get_many("inode", [u64(ino) for ino, _ in batch])
                for (ino, used_ns), raw in zip(batch, raws, strict=True):
                    if raw is None:
                        continue
                    inode = Inode.unpack(ino, raw)
                    if used_ns > inode.atime_ns:
                        self._put(txn, replace(inode, atime_ns=used_ns))
                        self._index_use(txn, inode, inode.atime_ns, used_ns)
            self._change(change)

    def least_recent(self, limit: int, after: bytes = b"") -> list[tuple[bytes, Inode]]:
        """Up to `limit` files, least recently used first, each with its position; pass the
        last position as `after` to continue."""
        found = []
        with self.engine.snapshot() as txn:
            for key, _ in txn.scan("recency", after + b"\0" if after else b""):
                raw = txn.get("inode", key[8:])
                if raw is not None:
                    found.append((bytes(key), Inode.unpack(from_u64(key[8:]), raw)))
                if len(found) >= limit:
                    break
        return found

    def models(self) -> dict[str, dict[str, int]]:
        """Per-model usage (models that have files or bytes)."""
        with self.engine.snapshot() as txn:
            counts = txn.counts("models")
        usage: dict[str, dict[str, int]] = {}
        for key, value in counts.items():
            model, _, kind = key.rpartition(b"\0")
            usage.setdefault(model.decode(), {"files": 0, "bytes": 0})[kind.decode()] = value
        return {model: used for model, used in usage.items() if used["files"] or used["bytes"]}

    def pinned(self) -> set[int]:
        with self.engine.snapshot() as txn:
            return {from_u64(key) for key, _ in txn.scan("pins")}

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if len(value) > XATTR_VALUE_MAX:
            raise fail(errno.E2BIG)
        if not name or len(name) > NAME_MAX:
            raise fail(errno.ERANGE)
        self._check_room()
        def change(txn: Txn) -> None:
            inode = self._get(txn, ino)
            txn.put("xattr", u64(ino) + name, value)
            if name == PIN_XATTR:
                txn.put("pins", u64(ino), b"")
            self._put(txn, replace(inode, ctime_ns=time.time_ns()))
        self._change(change)

    def removexattr(self, ino: int, name: bytes) -> None:
        def change(txn: Txn) -> None:
            inode = self._get(txn, ino)
            if not txn.delete("xattr", u64(ino) + name):
                raise fail(errno.ENODATA)
            if name == PIN_XATTR:
                txn.delete("pins", u64(ino))
            self._put(txn, replace(inode, ctime_ns=time.time_ns()))
        self._change(change)


def recount(meta: MetaStore) -> tuple[int, int, dict[str, dict[str, int]]]:
    """What the usage counters should say, counted from the records: used bytes, files and
    per-model usage (fsck and tests compare them with the counters)."""
    used = sum(blob.allocated for blob in meta.blobs())
    files = 0
    models: dict[str, dict[str, int]] = {}
    for inode in meta.inodes():
        if inode.is_dir:
            continue
        files += 1
        model = model_of(inode.name)
        if model is not None:
            counts = models.setdefault(model, {"files": 0, "bytes": 0})
            counts["files"] += 1
            counts["bytes"] += inode.allocated
    return used, files, models
