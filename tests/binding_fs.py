"""A minimal file system on kvfs's pyfuse3 (vendor/pyfuse3), run as its own process by
tests/test_binding.py: one directory holding `plain` (read through the daemon), `passed`
(backed by a file on the local disk: passthrough) and `alias` (looked up under a node id that
is not its inode number). It records the requests of interest in a log file, one per line.

    python tests/binding_fs.py MOUNTPOINT BACKING_FILE LOG
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import sys
from pathlib import Path

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE
PLAIN, PASSED, ALIAS = 2, 3, 4
ALIAS_NODEID = 1 << 40
NAMES = {b"plain": PLAIN, b"passed": PASSED, b"alias": ALIAS}
CONTENT = b"read through the daemon\n"
BACKING_OPEN = (1 << 30) | (16 << 16) | (229 << 8) | 1  # FUSE_DEV_IOC_BACKING_OPEN


class BindingFs(pyfuse3.Operations):
    enable_passthrough = True
    reply_thread = True
    user_xattrs_only = True

    def __init__(self, backing: str, log: Path) -> None:
        super().__init__()
        self.backing = backing
        self.log = log

    def note(self, line: str) -> None:
        with self.log.open("a") as out:
            out.write(line + "\n")

    def init(self) -> None:
        self.note(f"init passthrough={pyfuse3.passthrough_enabled()} "
                  f"replies_from_thread={pyfuse3.replies_from_thread()}")

    def _attributes(self, ino: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        if ino == ROOT:
            entry.st_mode = stat.S_IFDIR | 0o755
        else:
            entry.st_mode = stat.S_IFREG | 0o644
            entry.st_size = (os.stat(self.backing).st_size if ino == PASSED
                             else len(CONTENT))
        entry.entry_timeout = entry.attr_timeout = 0
        return entry

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent_inode != ROOT or name not in NAMES:
            raise pyfuse3.FUSEError(errno.ENOENT)
        entry = self._attributes(NAMES[name])
        if name == b"alias":
            entry.nodeid = ALIAS_NODEID
        return entry

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext
                      ) -> pyfuse3.EntryAttributes:
        if inode == ALIAS_NODEID:
            self.note("getattr alias")
            inode = ALIAS
        return self._attributes(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        raise pyfuse3.FUSEError(errno.ENOSYS)  # READDIR_WITHOUT_OPENDIR

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        self.note(f"readdir fh={fh} plus={token.plus}")
        for index, (name, ino) in enumerate(NAMES.items()):
            if index >= start_id and not pyfuse3.readdir_reply(
                    token, name, self._attributes(ino), index + 1):
                return

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        info = pyfuse3.FileInfo(fh=inode, keep_cache=inode != PASSED)
        if inode == PASSED:
            fd = os.open(self.backing, os.O_RDWR)
            try:
                request = bytearray(struct.pack("iIQ", fd, 0, 0))
                info.backing_id = fcntl.ioctl(pyfuse3.get_session_fd(), BACKING_OPEN, request)
            finally:
                os.close(fd)
        if flags & os.O_ACCMODE == os.O_RDONLY:
            info.noflush = True
        return info

    async def read(self, fh: int, off: int, size: int) -> bytes:
        self.note(f"read {fh}")
        return CONTENT[off:off + size]

    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        self.note(f"fallocate {fh} {mode} {offset} {length}")

    async def flush(self, fh: int) -> None:
        self.note(f"flush {fh}")

    async def release(self, fh: int) -> None:
        pass


def main() -> None:
    mountpoint, backing, log = sys.argv[1:4]
    pyfuse3.init(BindingFs(backing, Path(log)), mountpoint, {"fsname=bindingfs"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
