"""Kernel FUSE passthrough: an open file's reads go from the kernel straight to its blob file,
and the daemon never sees them.

It needs a kernel that grants passthrough at INIT (Linux >= 6.9) and CAP_SYS_ADMIN for the
ioctl that registers a backing file (kvfs's pyfuse3, vendor/pyfuse3, asks for it and hands
`FileInfo.backing_id` to the kernel). Without either every open falls back to reads the
daemon serves.

Kernel rules the callers keep: one backing file per kernel inode while it is open (every
passthrough open of it shares one registration, made at the first open and dropped at the
last release), and passthrough opens never mix with page-cache opens of the same kernel inode
(kvfs/files/policy.py).

Before a blob is handed to the kernel it is verified whole (kvfs/data/verify.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct

import pyfuse3

log = logging.getLogger(__name__)

_IOC_WRITE = 1
FUSE_DEV_IOC_MAGIC = 229


def _iow(number: int, size: int) -> int:
    return (_IOC_WRITE << 30) | (size << 16) | (FUSE_DEV_IOC_MAGIC << 8) | number


_BACKING_MAP = struct.Struct("iIQ")  # struct fuse_backing_map: fd, flags, padding
FUSE_DEV_IOC_BACKING_OPEN = _iow(1, _BACKING_MAP.size)
FUSE_DEV_IOC_BACKING_CLOSE = _iow(2, 4)


class Passthrough:
    """Whether passthrough can be used, and the registration of backing files."""

    def __init__(self, turned_off_by: str = "", o_direct: bool = True) -> None:
        """`turned_off_by`: the mount option that turns it off ("": none); `o_direct`:
        O_DIRECT opens pass through too (False: --odirect daemon)."""
        self.wanted = not turned_off_by
        self.o_direct = o_direct
        self.refused = f"turned off ({turned_off_by})" if turned_off_by else ""

    def available(self) -> bool:
        if self.refused:
            return False
        if not pyfuse3.passthrough_enabled():
            self.refused = "the kernel did not grant FUSE passthrough"
            log.warning("data path: kvfs serves reads itself: %s", self.refused)
            return False
        return True

    def takes(self, flags: int) -> bool:
        """Whether an open with these flags may pass through. The kernel does its I/O on the
        blob with the caller's flags, so O_DIRECT then has the volume's alignment rules, as
        on a plain directory; the daemon takes any alignment."""
        return self.available() and (self.o_direct or not flags & os.O_DIRECT)

    def mode(self) -> str:
        return "daemon" if self.refused else "passthrough"

    def register(self, fd: int) -> int | None:
        """A backing id for the file behind `fd`, or None when the kernel refuses (then
        passthrough is off for the mount if it refuses for good)."""
        request = bytearray(_BACKING_MAP.pack(fd, 0, 0))
        try:
            return fcntl.ioctl(pyfuse3.get_session_fd(), FUSE_DEV_IOC_BACKING_OPEN, request)
        except OSError as error:
            if error.errno in (errno.EPERM, errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL):
                self.refused = f"registering a backing file: {error.strerror}"
                log.warning("data path: kvfs serves reads itself: %s", self.refused)
            else:
                log.warning("registering a backing file failed: %s", error)
            return None

    def unregister(self, backing_id: int) -> None:
        try:
            fcntl.ioctl(pyfuse3.get_session_fd(), FUSE_DEV_IOC_BACKING_CLOSE,
                        bytearray(struct.pack("I", backing_id)))
        except OSError as error:
            log.warning("unregistering backing file %d failed: %s", backing_id, error)
