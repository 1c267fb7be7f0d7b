"""Which opens may share one of the kernel's inodes (kvfs/files/kernel_inodes.py).

The kernel holds one page cache and at most one passthrough backing file per inode, and maps
every open of it onto them: an open may join the opens already on a kernel inode only if
every byte it would map is what it reads and writes. Readers of one version share one;
a writer (whose bytes are its own staged copy) is alone on its kernel inode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class OpenOnKernelInode(Protocol):
    @property
    def writable(self) -> bool: ...

    @property
    def version(self) -> int: ...


def shares_kernel_inode(others: Iterable[OpenOnKernelInode], writable: bool,
                        version: int) -> bool:
    """Whether an open of `version` (`writable`: a writer) may join `others` on their
    kernel inode."""
    others = list(others)
    if not others:
        return True
    return not writable and all(not h.writable and h.version == version for h in others)
