"""What the concerns of the metadata store share: the engine, this mount's session, the stock
of inode ids, and the helpers over `Txn` that several of them use (inode records, directory
entries, dropping an inode and releasing its blob, usage and recency bookkeeping)."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterator
from itertools import takewhile
from typing import TypeVar

from kvfs.engines.interface import Engine, Txn
from kvfs.meta.schema import (
    ID_BATCH,
    MODEL_BYTES,
    MODEL_FILES,
    Inode,
    from_u64,
    has_links,
    listing_entry,
    u64,
)
from kvfs.observe.models import model_of
from kvfs.records import BlobInfo, fail

T = TypeVar("T")


class MetaCore:
    """The state of a store and the helpers over `Txn` that its concerns share: each concern
    of `MetaStore` holds the one core of its store."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session = b""  # this mount's session in a shared pool (kvfs/pool/sessions.py)
        self._ids: range = range(0)  # inode numbers and cookies in stock
        self._ids_lock = threading.Lock()

    def change(self, change: Callable[[Txn], T]) -> T:
        """Run `change` in one transaction of the engine; returns once it is durable."""
        return self.engine.change(change)

    def fresh_ids(self, count: int) -> range:
        """Inode numbers or cookies for one change, taken (in the caller's thread, before the
        change, which may run more than once) from a stock that is itself taken from
        `next_ino` in batches: ids are never reused, whatever happens to the changes."""
        while True:
            with self._ids_lock:  # (held for no round trip: the loop may take ids too)
                if len(self._ids) >= count:
                    taken, self._ids = self._ids[:count], self._ids[count:]
                    return taken
            end = self.engine.allocate(b"next_ino", ID_BATCH)
            with self._ids_lock:  # (what is left of a batch another thread took goes unused)
                self._ids = range(end - ID_BATCH, end)

    def next_id(self) -> int:
        """The next inode number or cookie `next_ino` hands out: all below it were issued."""
        return self.engine.allocate(b"next_ino", 0)

    def get(self, txn: Txn, ino: int) -> Inode:
        raw = txn.get("inode", u64(ino))
        if raw is None:
            raise fail(errno.ENOENT)
        return Inode.unpack(ino, raw)

    def put(self, txn: Txn, inode: Inode) -> None:
        txn.put("inode", u64(inode.ino), inode.pack())

    def index_use(self, txn: Txn, inode: Inode, old_atime: int | None,
                   new_atime: int | None) -> None:
        """Keep a file's place in the recency index in step with its atime."""
        if inode.is_dir:
            return
        if old_atime is not None:  # (its key follows from the inode read: no read of it)
            txn.discard("recency", u64(old_atime) + u64(inode.ino))
        if new_atime is not None:
            txn.put("recency", u64(new_atime) + u64(inode.ino), b"")

    def count_model(self, txn: Txn, inode: Inode, name: bytes, files: int,
                     allocated: int) -> None:
        """Per-model usage: a file counts for the model its primary name says (if any)."""
        model = None if inode.is_dir else model_of(name)
        if model is None:
            return
        if files:
            txn.add("models", model.encode() + MODEL_FILES, files)
        if allocated:
            txn.add("models", model.encode() + MODEL_BYTES, allocated)

    def link(self, txn: Txn, parent: int, name: bytes, inode: Inode, cookie_id: int) -> None:
        """The entry `name` in `parent` for `inode` as the change leaves it (its nlink counts
        this name)."""
        cookie = u64(cookie_id)
        txn.put("dentry", u64(parent) + name, u64(inode.ino) + cookie)
        txn.put("dirlist", u64(parent) + cookie, listing_entry(inode.ino, inode.mode, name))
        if has_links(inode):
            txn.put("links", u64(inode.ino) + u64(parent) + name, b"")

    def entries(self, txn: Txn, parent: int, after: int = -1) -> Iterator[tuple[bytes, bytes]]:
        """`dirlist` records of `parent` with a cookie > after, in cookie order."""
        prefix = u64(parent)
        return takewhile(lambda entry: entry[0][:8] == prefix,
                         txn.scan("dirlist", prefix + u64(after + 1)))

    def unlink(self, txn: Txn, parent: int, name: bytes, inode: Inode | int) -> None:
        """Remove the entry `name` in `parent` of `inode` (as it was before the change; an
        inode number: its record is gone, and so goes any link record of the name)."""
        # The entry is read (a shared engine checks it at commit); its listing and link
        # records follow from it, so they are removed unread: no round trip for them.
        raw = txn.pop("dentry", u64(parent) + name)
        if raw is not None:
            txn.discard("dirlist", u64(parent) + raw[8:16])
        if isinstance(inode, int) or has_links(inode):
            ino = inode if isinstance(inode, int) else inode.ino
            txn.discard("links", u64(ino) + u64(parent) + name)

    def suffixes(self, txn: Txn, family: str, prefix: bytes) -> list[bytes]:
        """The rest of every key of `family` that starts with `prefix`."""
        found = []
        for key, _ in txn.scan(family, prefix):
            if key[: len(prefix)] != prefix:
                break
            found.append(bytes(key[len(prefix):]))
        return found

    def names(self, txn: Txn, inode: Inode) -> list[tuple[int, bytes]]:
        """Every (parent, name) of `inode`."""
        if not has_links(inode):
            return [(inode.parent, inode.name)]
        return [(from_u64(rest), rest[8:])
                for rest in self.suffixes(txn, "links", u64(inode.ino))]

    def adjust_parent(self, txn: Txn, ino: int, nlink_delta: int, now: int) -> None:
        inode = self.get(txn, ino)
        self.put(txn, inode._replace(nlink=inode.nlink + nlink_delta, mtime_ns=now, ctime_ns=now))

    def drop_inode(self, txn: Txn, inode: Inode) -> None:
        """Remove an unlinked inode's record, its xattrs, and doom its blob."""
        key = u64(inode.ino)
        for family in ("inode", "pins", "symlink"):
            txn.delete(family, key)
        self.index_use(txn, inode, inode.atime_ns, None)
        for name in self.suffixes(txn, "xattr", key):
            txn.delete("xattr", key + name)
        if not inode.is_dir:
            txn.add("counters", b"files", -1)
        self.count_model(txn, inode, inode.name, -1, -inode.allocated)
        self.release_blob(txn, inode.blob)

    def release_blob(self, txn: Txn, blob_id: int) -> None:
        if not blob_id:
            return
        raw = txn.pop("blob", u64(blob_id))
        if raw is not None:
            txn.add("counters", b"used_bytes", -BlobInfo.unpack(blob_id, raw).allocated)
        txn.delete("pending", u64(blob_id))
        txn.put("doomed", u64(blob_id), b"")

    def record_hold(self, txn: Txn, blob_id: int, session: bytes) -> None:
        txn.put("held", u64(blob_id) + session, b"")
        txn.put("holding", session + u64(blob_id), b"")

    def holders(self, txn: Txn, blob_id: int) -> list[bytes]:
        return self.suffixes(txn, "held", u64(blob_id)) if blob_id else []
