"""The store's format: formatting a new volume, and migrating older formats in place at
open (kvfs-1: before hard links and holes; kvfs-2: per-model usage as one packed record;
kvfs-3: listing entries without their file type; kvfs-4: every name in `links`)."""

from __future__ import annotations

import os
import stat
import struct
import time

from kvfs.engines.interface import Txn
from kvfs.meta.core import MetaCore
from kvfs.meta.schema import (
    FORMAT,
    MODEL_BYTES,
    MODEL_FILES,
    ROOT_INO,
    V1_FORMAT,
    V2_FORMAT,
    V3_FORMAT,
    V4_FORMAT,
    Inode,
    from_u64,
    has_links,
    listing_entry,
    mode_of,
    u64,
)
from kvfs.records import BLOB_RECORD


class Formats:
    """Opening a store: its format, made or brought up to date."""

    def __init__(self, core: MetaCore) -> None:
        self.core = core

    def open(self, txn: Txn) -> None:
        """Format a new store, or bring an older format up to date (in the change `txn`)."""
        stored = txn.get("settings", b"format")
        if stored is None:
            self._format(txn)
        elif stored in (V1_FORMAT, V2_FORMAT, V3_FORMAT, V4_FORMAT):
            if stored == V1_FORMAT:
                self._migrate_from_v1(txn)
            elif stored == V2_FORMAT:
                self._migrate_from_v2(txn)
            if stored != V4_FORMAT:
                self._migrate_from_v3(txn)
            self._migrate_from_v4(txn)
            txn.put("settings", b"format", FORMAT)
        elif stored != FORMAT:
            raise RuntimeError(f"unsupported metadata format {stored!r}")

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
            (mode, nlink, uid, gid, size, atime_ns, mtime_ns, ctime_ns, parent, blob,
             version) = old_inode.unpack_from(raw)
            ino = from_u64(key)
            inode = Inode(ino, mode, nlink, uid, gid, 0, size, allocated.get(ino, 0), atime_ns,
                          mtime_ns, ctime_ns, parent, blob, version, bytes(raw[old_inode.size:]))
            self.core.put(txn, inode)
        txn.add("counters", b"used_bytes",
                sum(allocated.values()) - txn.count("counters", b"used_bytes"))
        txn.clear("models")
        for inode in [Inode.unpack(from_u64(k), v) for k, v in txn.scan("inode")]:
            self.core.count_model(txn, inode, inode.name, 1, inode.allocated)
        for key, child in list(txn.scan("dentry")):
            txn.put("dentry", key, child + child)  # the cookie is the child ino
            txn.put("links", child + key, b"")
        for key, name in list(txn.scan("dirlist")):
            txn.put("dirlist", key, key[8:] + name)  # kvfs-3's entry: child ino + name

    def _migrate_from_v2(self, txn: Txn) -> None:
        """kvfs-2 kept a model's files and bytes in one packed record (embedded engine only:
        these reads inside a change are fine there)."""
        packed = struct.Struct("<qq")
        for key, raw in list(txn.scan("models")):
            files, allocated = packed.unpack(raw)
            txn.delete("models", key)
            txn.add("models", key + MODEL_FILES, files)
            txn.add("models", key + MODEL_BYTES, allocated)

    def _migrate_from_v3(self, txn: Txn) -> None:
        """kvfs-3 listing entries held the child's inode number and name: its type joins
        them (entries of inodes gone are dropped). Directory by directory: a shared engine
        keeps each one's entries apart."""
        directories = [from_u64(key) for key, raw in txn.scan("inode")
                       if stat.S_ISDIR(mode_of(raw))]
        for directory in directories:
            entries = list(self.core.entries(txn, directory))
            children = txn.get_many("inode", [bytes(value[:8]) for _, value in entries])
            for (key, value), raw in zip(entries, children, strict=True):
                if raw is None:
                    txn.delete("dirlist", key)
                else:
                    txn.put("dirlist", key, listing_entry(from_u64(value), mode_of(raw),
                                                          bytes(value[8:])))

    def _migrate_from_v4(self, txn: Txn) -> None:
        """kvfs-4 kept every name in `links`; a file with one name, and a directory, now
        keep theirs in the inode record alone (their one `links` record, which is their
        primary name, goes: blind removals, no scan of `links`)."""
        for key, raw in txn.scan("inode"):
            inode = Inode.unpack(from_u64(key), raw)
            if not has_links(inode) and inode.ino != ROOT_INO:
                txn.discard("links", u64(inode.ino) + u64(inode.parent) + inode.name)
