"""Whether a file is all in the page cache (cachestat(2), Linux >= 6.5): a blob wholly in memory
is verified and handed to readers without a disk read."""

from __future__ import annotations

import ctypes
import os

PAGE = os.sysconf("SC_PAGE_SIZE")
CACHESTAT_SYSCALL = 451  # x86-64 and arm64


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)


def wholly_resident(fd: int, size: int) -> bool:
    """Whether every page of the file is in the page cache (False if unknown)."""
    result = _Cachestat()
    if _libc.syscall(CACHESTAT_SYSCALL, fd, ctypes.byref(_CachestatRange(0, size)),
                     ctypes.byref(result), 0) != 0:
        return False
    return result.nr_cache >= -(-size // PAGE)
