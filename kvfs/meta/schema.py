"""The metadata store's key schema and records: what it keeps, written down in one place.

The store (kvfs/meta/) keeps the namespace, attributes, xattrs and blob records of a volume in
the ordered families of byte keys of a metadata engine (kvfs/engines/interface.py), and its logic is
written once over the engine's transactions (`Txn`), whichever engine holds them: LMDB,
embedded in `DATA/meta/` (kvfs/engines/lmdb_engine.py), or Redis, for a pool that several hosts
share (kvfs/engines/redis_engine.py). All integers in keys are 8-byte big-endian so that byte
order is numeric order.

Key schema (one family each):

    inode    ino                      -> Inode record (struct _INODE, then its primary name)
    dentry   parent ino + name        -> child ino + cookie     (lookup by name)
    dirlist  parent ino + cookie      -> child ino + type + name (readdir in stable cookie order;
                                       type: one byte, S_IFMT(mode) >> 12, so that a listing
                                       without attributes reads no inode)
    links    ino + parent ino + name  -> b""   (every name of a file that has more than one:
                                       hard links; a single name is the inode's primary)
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
    counters name                     -> counter (next_ino, next_blob, used_bytes, files;
                                         claim:<session>: room a host holds for its writers)
    settings name                     -> bytes (format, capacity, boot: boot id of the last mount)

Counters are only ever added to inside a change (never read there), so that a shared engine
adds them without making changes that touch them conflict; id stocks are taken outside
changes (`Engine.allocate`). So are claims on the pool's room (`Engine.claim`: checked
against the capacity and granted in one step); a content commit gives back, in its change,
the claim its staged bytes held, and a session's claim ends with its record.

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

Every change is one transaction of the engine (group-committed by the embedded engine,
optimistic on the shared one); a caller returns once its change is durable. Inode numbers and
cookies come from a stock taken from `next_ino` in committed batches (ID_BATCH), so that the
counter is written once per batch, not by every create, and no id is ever given twice.

Errors are raised as `FsError` (an OSError) with a precise errno; the FUSE layer passes them
through.
"""

from __future__ import annotations

import errno
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvfs.records import fail

ROOT_INO = 1
NAME_MAX = 255
PATH_MAX = 4096
XATTR_VALUE_MAX = 64 * 1024
PIN_XATTR = b"user.kvfs.pin"
# `settings` key prefix of a shared pool's session whose staging directory is its own: set
# when it registers, removed by the claim of whoever reaps it; content commits check it.
LIVE_SESSION = b"live:"
FORMAT = b"kvfs-5"
V1_FORMAT = b"kvfs-1"  # before hard links and holes: migrated in place at open
V2_FORMAT = b"kvfs-2"  # per-model usage as one packed record: migrated in place at open
V3_FORMAT = b"kvfs-3"  # listing entries without their file type: migrated in place at open
V4_FORMAT = b"kvfs-4"  # every name in `links`, also a file's only one: migrated in place at open
DEFAULT_MAP_SIZE = 64 << 30  # virtual only: the file grows with use
LINK_MAX = 65000  # as ext4

ID_BATCH = 1024  # inode numbers and cookies taken from `next_ino` at once
TOUCH_BATCH = 256  # recorded uses per transaction
READDIR_BATCH = 128  # entries whose inodes are read at once

_U64 = struct.Struct(">Q")
_INODE = struct.Struct("<IIIIQQQqqqQQQ")
_MODE = struct.Struct("<I")  # the first field of an inode record
_TYPE_SHIFT = 12  # S_IFMT bits, shifted into a byte
MODEL_FILES = b"\0files"
MODEL_BYTES = b"\0bytes"

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
FAMILIES = ("inode", "dentry", "dirlist", "links", "symlink", "xattr", "blob", "doomed", "pending",
            "held", "holding", "sessions", "recency", "pins", "models", "counters", "settings")


u64: Callable[[int], bytes] = _U64.pack  # (bound, no Python frame: a store packs ~40 keys)


def from_u64(raw: bytes) -> int:
    return _U64.unpack(raw[:8])[0]


def has_links(inode: Inode) -> bool:
    """Whether `links` holds the inode's names: a file's, when it has more than one (a
    store's create and rename then write no `links` record)."""
    return inode.nlink > 1 and not stat.S_ISDIR(inode.mode)


def dentry_parts(key: bytes) -> tuple[int, bytes]:
    """(parent ino, name) of a `dentry` key."""
    return from_u64(key), bytes(key[8:])


def mode_of(raw: bytes) -> int:
    """The mode of a packed inode record."""
    return _MODE.unpack_from(raw)[0]


def listing_entry(ino: int, mode: int, name: bytes) -> bytes:
    """A `dirlist` value: the child's inode number, its file type and its name."""
    return u64(ino) + bytes((stat.S_IFMT(mode) >> _TYPE_SHIFT,)) + name


def listed(value: bytes) -> tuple[int, int, bytes]:
    """(inode number, file type as S_IFMT mode bits, name) of a `dirlist` value."""
    return from_u64(value), value[8] << _TYPE_SHIFT, bytes(value[9:])


class Inode(NamedTuple):
    """An inode record (immutable: `_replace` makes a changed copy). A tuple, not a frozen
    dataclass: every lookup, stat and listed entry builds one, and a tuple builds faster."""

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
        # The record holds the fields from mode to version in order (tuple.__new__: a
        # listing makes one per entry, and the generated __new__ costs several times more).
        return tuple.__new__(cls, (ino, *_INODE.unpack_from(raw), bytes(raw[_INODE.size:])))


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
    used: int  # bytes committed blobs take
    files: int
    claimed: int  # room hosts hold for what their writers stage (kvfs/pool/space.py)
    claimed_here: int  # ... of which this mount's claim


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise fail(errno.ENAMETOOLONG)
    if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
        raise fail(errno.EINVAL)
