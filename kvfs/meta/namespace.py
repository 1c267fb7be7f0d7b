"""The namespace: lookup and listing of directories, creating, linking, removing and renaming
entries, symlink targets, attributes and xattrs."""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Callable, Iterator
from itertools import islice

from kvfs.engines.interface import ChangesPending, Txn
from kvfs.meta.core import MetaCore
from kvfs.meta.schema import (
    LINK_MAX,
    NAME_MAX,
    PATH_MAX,
    PIN_XATTR,
    READDIR_BATCH,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    XATTR_VALUE_MAX,
    Inode,
    Removed,
    check_name,
    from_u64,
    has_links,
    listed,
    u64,
)
from kvfs.records import fail


class Namespace:
    """Directories, names, attributes and xattrs of the store."""

    def __init__(self, core: MetaCore) -> None:
        self.core = core
        self.engine = core.engine

    # -- reads ---------------------------------------------------------------------------

    def get(self, ino: int, cached: bool = False) -> Inode:
        """`cached`: for the kernel's attribute cache (`Engine.snapshot`)."""
        with self.engine.snapshot(cached) as txn:
            return self.core.get(txn, ino)

    def lookup(self, parent: int, name: bytes, cached: bool = False) -> Inode | None:
        """`cached`: for the kernel's name cache (`Engine.snapshot`)."""
        if len(name) > NAME_MAX:
            raise fail(errno.ENAMETOOLONG)
        with self.engine.snapshot(cached) as txn:
            return self._child(txn, parent, name)

    def watch_others(self, name_changed: Callable[[int, bytes], None],
                     inode_changed: Callable[[int], None]) -> None:
        """Be told, from the engine's thread, of every name (parent, name) and inode that
        other hosts change from now on (a shared pool; on one host there are none)."""
        def changed(family: str, key: bytes) -> None:
            if family == "dentry":
                name_changed(from_u64(key[:8]), bytes(key[8:]))
            else:
                inode_changed(from_u64(key))
        self.engine.watch(changed)

    def names(self, ino: int) -> list[tuple[int, bytes]]:
        with self.engine.snapshot() as txn:
            return self.core.names(txn, self.core.get(txn, ino))

    def readlink(self, ino: int) -> bytes:
        with self.engine.snapshot() as txn:
            self.core.get(txn, ino)
            target = txn.get("symlink", u64(ino))
        if target is None:
            raise fail(errno.EINVAL)
        return bytes(target)

    def readdir(self, parent: int, after: int) -> Iterator[tuple[bytes, Inode, int]]:
        """Entries of `parent` with a cookie > after, in cookie order: (name, inode, cookie)."""
        unpack = Inode.unpack
        with self.engine.snapshot() as txn:
            entries = self.core.entries(txn, parent, after)
            while batch := [(listed(value), key) for key, value in islice(entries, READDIR_BATCH)]:
                children = txn.get_many("inode", [u64(ino) for (ino, _, _), _ in batch])
                for ((ino, _, name), key), child in zip(batch, children, strict=True):
                    if child is not None:
                        yield name, unpack(ino, child), from_u64(key[8:])

    def readdir_page(self, parent: int, after: int, limit: int
                     ) -> list[tuple[bytes, Inode, int]]:
        return list(islice(self.readdir(parent, after), limit))

    def readdir_types_page(self, parent: int, after: int, limit: int
                           ) -> list[tuple[bytes, int, int, int]]:
        """Like `readdir_page`, for a listing without attributes: (name, inode number, file
        type as mode bits, cookie), from the listing records alone (no inode is read)."""
        page = []
        with self.engine.snapshot() as txn:
            for key, value in islice(self.core.entries(txn, parent, after), limit):
                ino, file_type, name = listed(value)
                page.append((name, ino, file_type, from_u64(key[8:])))
        return page

    def inodes(self) -> Iterator[Inode]:
        with self.engine.snapshot() as txn:
            for key, raw in txn.scan("inode"):
                yield Inode.unpack(from_u64(key), raw)

    def entries(self) -> Iterator[tuple[int, bytes, int]]:
        """Every (parent, name, child) directory entry."""
        with self.engine.snapshot() as txn:
            for key, child in txn.scan("dentry"):
                yield from_u64(key[:8]), bytes(key[8:]), from_u64(child)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        with self.engine.snapshot() as txn:
            self.core.get(txn, ino)
            value = txn.get("xattr", u64(ino) + name)
        if value is None:
            raise fail(errno.ENODATA)
        return bytes(value)

    def listxattr(self, ino: int) -> list[bytes]:
        with self.engine.snapshot() as txn:
            self.core.get(txn, ino)
            return self.core.suffixes(txn, "xattr", u64(ino))

    # -- namespace changes ---------------------------------------------------------------

    def _dir(self, txn: Txn, ino: int) -> Inode:
        inode = self.core.get(txn, ino)
        if not inode.is_dir:
            raise fail(errno.ENOTDIR)
        return inode

    def _child(self, txn: Txn, parent: int, name: bytes) -> Inode | None:
        entry, raw = txn.get_through("dentry", u64(parent) + name, "inode")
        if entry is None:
            return None
        if raw is None:
            raise fail(errno.ENOENT)
        return Inode.unpack(from_u64(entry[:8]), raw)

    def _has_children(self, txn: Txn, ino: int) -> bool:
        first = next(txn.scan("dirlist", u64(ino)), None)
        return first is not None and first[0][:8] == u64(ino)

    def _check_room(self) -> None:
        """Refuse growth of the namespace near a full engine, so that removing files always
        remains possible. Removals answered but not yet in the engine may free room: while
        there are such changes the caller waits for them (ChangesPending) and asks again."""
        if not self.engine.has_room():
            if not self.engine.sync(timeout=0):
                raise ChangesPending
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
        ino, cookie = self.core.fresh_ids(2)  # the inode number and the entry's cookie

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
            self.core.put(txn, inode)
            if target:
                txn.put("symlink", u64(ino), target)
            self.core.index_use(txn, inode, None, now)
            self.core.count_model(txn, inode, name, 1, 0)
            self.core.link(txn, parent, name, inode, cookie)
            self.core.put(txn, parent_inode._replace(nlink=parent_inode.nlink + is_dir,
                                                 mtime_ns=now, ctime_ns=now))
            if is_dir:
                txn.known_empty("dentry", u64(ino))
            else:
                txn.add("counters", b"files", 1)
            return inode
        return self.core.change(change)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        """A further name for a non-directory (a hard link)."""
        check_name(new_name)
        self._check_room()
        now = time.time_ns()
        (cookie,) = self.core.fresh_ids(1)

        def change(txn: Txn) -> Inode:
            inode = self.core.get(txn, ino)
            if inode.is_dir:
                raise fail(errno.EPERM)
            if inode.nlink >= LINK_MAX:
                raise fail(errno.EMLINK)
            parent_inode = self._dir(txn, new_parent)
            if self._child(txn, new_parent, new_name) is not None:
                raise fail(errno.EEXIST)
            linked = inode._replace(nlink=inode.nlink + 1, ctime_ns=now)
            if not has_links(inode):  # its only name joins `links`, beside the new one
                txn.put("links", u64(ino) + u64(inode.parent) + inode.name, b"")
            self.core.link(txn, new_parent, new_name, linked, cookie)
            inode = linked
            self.core.put(txn, inode)
            self.core.put(txn, parent_inode._replace(mtime_ns=now, ctime_ns=now))
            return inode
        return self.core.change(change)

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
                self.core.unlink(txn, parent, name, inode)
                self.core.drop_inode(txn, inode)
                after = inode._replace(nlink=0)
            else:
                after = self._drop_name(txn, inode, parent, name, now)
            self.core.put(txn, parent_inode._replace(nlink=parent_inode.nlink - inode.is_dir,
                                                 mtime_ns=now, ctime_ns=now))
            return Removed(after, [(parent, name)])
        return self.core.change(change)

    def _drop_name(self, txn: Txn, inode: Inode, parent: int, name: bytes,
                   now: int) -> Inode:
        """Remove one name of a non-directory; the inode goes with its last name."""
        self.core.unlink(txn, parent, name, inode)
        if inode.nlink <= 1:
            self.core.drop_inode(txn, inode)
            return inode._replace(nlink=0)
        updated = inode._replace(nlink=inode.nlink - 1, ctime_ns=now)
        remaining = self.core.names(txn, inode)  # (what `links` holds, less the name just gone)
        if not has_links(updated):  # its last name leaves `links`: the primary holds it
            for other_parent, other_name in remaining:
                txn.discard("links", u64(inode.ino) + u64(other_parent) + other_name)
        if (parent, name) == (inode.parent, inode.name):  # another name becomes the primary
            new_parent, new_name = remaining[0]
            self.core.count_model(txn, inode, name, -1, -inode.allocated)
            self.core.count_model(txn, inode, new_name, 1, inode.allocated)
            updated = updated._replace(parent=new_parent, name=new_name)
        self.core.put(txn, updated)
        return updated

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
        reserved = self.core.fresh_ids(2)  # new entries: one, or two for an exchange

        def change(txn: Txn) -> tuple[Inode, Removed | None]:
            cookies = iter(reserved)
            self._dir(txn, old_parent)
            if new_parent != old_parent:
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
                return self.core.get(txn, moved.ino), None
            replaced = None
            if target is not None:
                if flags & RENAME_NOREPLACE:  # (also onto another name of the same file)
                    raise fail(errno.EEXIST)
                if target.ino == moved.ino:  # two names of one file: POSIX says do nothing
                    return moved, None
                self._check_replaceable(txn, moved, target)
                if target.is_dir:
                    self.core.unlink(txn, new_parent, new_name, target)
                    self.core.drop_inode(txn, target)
                    self.core.adjust_parent(txn, new_parent, -1, now)
                    replaced = Removed(target._replace(nlink=0), [(new_parent, new_name)])
                else:
                    replaced = Removed(self._drop_name(txn, target, new_parent, new_name, now),
                                       [(new_parent, new_name)])
                moved = self.core.get(txn, moved.ino)  # unchanged unless it was the target
            moved = self._move_name(txn, moved, (old_parent, old_name),
                                    (new_parent, new_name), now, next(cookies))
            if new_parent == old_parent:  # (a store's rename: one read and write of it)
                self.core.adjust_parent(txn, old_parent, 0, now)
            else:
                self.core.adjust_parent(txn, old_parent, -moved.is_dir, now)
                self.core.adjust_parent(txn, new_parent, moved.is_dir, now)
            return moved, replaced
        return self.core.change(change)

    def _move_name(self, txn: Txn, inode: Inode, old: tuple[int, bytes],
                   new: tuple[int, bytes], now: int, cookie: int) -> Inode:
        """Re-point one name of `inode` (stored) and return its updated record."""
        self.core.unlink(txn, *old, inode)
        self.core.link(txn, *new, inode, cookie)
        return self._renamed(txn, inode, old, new, now)

    def _renamed(self, txn: Txn, inode: Inode, old: tuple[int, bytes],
                 new: tuple[int, bytes], now: int) -> Inode:
        """Store an inode whose name `old` is now `new`: its primary name and model follow."""
        updated = inode._replace(ctime_ns=now)
        if old == (inode.parent, inode.name):
            self.core.count_model(txn, inode, old[1], -1, -inode.allocated)
            self.core.count_model(txn, inode, new[1], 1, inode.allocated)
            updated = updated._replace(parent=new[0], name=new[1])
        self.core.put(txn, updated)
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
        self.core.unlink(txn, first_parent, first_name, first_inode)
        self.core.unlink(txn, second_parent, second_name, second_inode)
        self.core.link(txn, first_parent, first_name, second_inode, next(cookies))
        self.core.link(txn, second_parent, second_name, first_inode, next(cookies))
        self._renamed(txn, first_inode, (first_parent, first_name),
                      (second_parent, second_name), now)
        self._renamed(txn, second_inode, (second_parent, second_name),
                      (first_parent, first_name), now)
        if first_parent != second_parent and first_inode.is_dir != second_inode.is_dir:
            shift = first_inode.is_dir - second_inode.is_dir
            self.core.adjust_parent(txn, first_parent, -shift, now)
            self.core.adjust_parent(txn, second_parent, shift, now)
        else:
            for parent in {first_parent, second_parent}:
                self.core.adjust_parent(txn, parent, 0, now)

    def _is_ancestor(self, txn: Txn, ancestor: int, ino: int) -> bool:
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT_INO:
                return False
            ino = self.core.get(txn, ino).parent

    def set_attrs(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                  gid: int | None = None, atime_ns: int | None = None,
                  mtime_ns: int | None = None, clear_mode: int = 0) -> Inode:
        """Change attributes; `clear_mode` bits are cleared from the stored mode (setuid and
        setgid on writes and chowns), inside the same transaction."""
        def change(txn: Txn) -> Inode:
            inode = self.core.get(txn, ino)
            if clear_mode and not inode.mode & clear_mode and all(
                    value is None for value in (mode, uid, gid, atime_ns, mtime_ns)):
                return inode  # a write that finds nothing to clear changes no attribute
            ctime_ns = time.time_ns()
            new_mode = inode.mode
            if mode is not None:
                new_mode = stat.S_IFMT(inode.mode) | stat.S_IMODE(mode)
            if clear_mode:
                new_mode &= ~clear_mode
            updated = inode._replace(
                ctime_ns=ctime_ns, mode=new_mode,
                uid=inode.uid if uid is None else uid,
                gid=inode.gid if gid is None else gid,
                atime_ns=inode.atime_ns if atime_ns is None else atime_ns,
                mtime_ns=inode.mtime_ns if mtime_ns is None else mtime_ns)
            self.core.put(txn, updated)
            if updated.atime_ns != inode.atime_ns:
                self.core.index_use(txn, inode, inode.atime_ns, updated.atime_ns)
            return updated
        return self.core.change(change)

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if len(value) > XATTR_VALUE_MAX:
            raise fail(errno.E2BIG)
        if not name or len(name) > NAME_MAX:
            raise fail(errno.ERANGE)
        self._check_room()
        def change(txn: Txn) -> None:
            inode = self.core.get(txn, ino)
            txn.put("xattr", u64(ino) + name, value)
            if name == PIN_XATTR:
                txn.put("pins", u64(ino), b"")
            self.core.put(txn, inode._replace(ctime_ns=time.time_ns()))
        self.core.change(change)

    def removexattr(self, ino: int, name: bytes) -> None:
        def change(txn: Txn) -> None:
            inode = self.core.get(txn, ino)
            if not txn.delete("xattr", u64(ino) + name):
                raise fail(errno.ENODATA)
            if name == PIN_XATTR:
                txn.delete("pins", u64(ino))
            self.core.put(txn, inode._replace(ctime_ns=time.time_ns()))
        self.core.change(change)
