"""How an open is served: which opens may share one of the kernel's inodes
(kvfs/files/kernel_inodes.py), and by which data path each open's I/O goes. Pure functions of
what the caller tells them: no I/O, no state.

The kernel holds one page cache and at most one passthrough backing file per inode, and maps
every open of it onto them: an open may join the opens already on a kernel inode only if
every byte it would map is what it reads and writes. Readers of one version share one;
a writer (whose bytes are its own staged copy) is alone on its kernel inode.

The kernel does not mix passthrough opens of an inode with page-cache ones, and accepts no
other kind of open beside a backing file: a reader passes through only while no open on its
kernel inode is served by the daemon (those name the backing file while it is there).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class OpenOnKernelInode(Protocol):
    @property
    def writable(self) -> bool: ...

    @property
    def version(self) -> int: ...

    @property
    def backing(self) -> bool: ...  # the kernel does its I/O itself (passthrough)


def shares_kernel_inode(others: Iterable[OpenOnKernelInode], writable: bool,
                        version: int) -> bool:
    """Whether an open of `version` (`writable`: a writer) may join `others` on their
    kernel inode."""
    others = list(others)
    if not others:
        return True
    return not writable and all(not h.writable and h.version == version for h in others)


class Serving(Enum):
    """How an open is served (`serve_open`); `FileTable` does the mechanics of each."""

    WAIT = "wait"  # a retry that cannot join: wait for closes on its kernel inode, ask again
    RENEW = "renew"  # refused: the file gets a fresh kernel inode, the open ESTALE
    WRITER_BESIDE = "writer beside"  # a write-only retry, daemon-served beside the others
    OWN = "own"  # kvfs's own open, on no kernel inode: daemon-served, direct_io
    PASSTHROUGH_READER = "passthrough reader"  # the kernel reads the blob (its backing file)
    DAEMON_READER = "daemon reader"  # passthrough mount, this reader daemon-served, direct_io
    DIRECT_READER = "direct reader"  # no passthrough: its version's first read, direct_io
    PAGE_CACHE_READER = "page-cache reader"  # no passthrough: through the page cache
    PASSTHROUGH_WRITER = "passthrough writer"  # the kernel writes the staged file itself
    DAEMON_WRITER = "daemon writer"  # passthrough mount, this writer daemon-served
    DIRECT_WRITER = "direct writer"  # no passthrough: daemon-served, direct_io


@dataclass(frozen=True, slots=True)
class OpenFacts:
    """What `serve_open` decides from: the open, and the state of its kernel inode."""

    flags: int  # the open's flags
    blob: bool  # it opens a committed blob (else an empty file)
    version: int  # the version it reads, or its writes are based on
    own: bool = False  # kvfs's own open, which the kernel does not see: no kernel inode
    others: Sequence[OpenOnKernelInode] = ()  # the other opens on its kernel inode
    retrying: bool = False  # its thread's open of the file was refused (ESTALE) just now
    waited: bool = False  # a retry that waited already, or one joining now: no more waiting
    joined: bool = False  # its claim on its kernel inode is made: not asked again
    beside: bool = False  # it joined as a write-only retry beside opens it cannot join
    passthrough: bool = False  # the kernel grants passthrough on the mount
    kernel_o_direct: bool = True  # O_DIRECT opens may pass through (not --odirect daemon)
    clears_privileges: bool = False  # a writer whose writes clear setuid/setgid
    cached_version: int | None = None  # the one version its kernel inode's pages may hold
    read_directly: int | None = None  # the version read once there bypassing them
    inherited: bool = False  # its kernel inode may hold an earlier daemon's state


def serve_open(facts: OpenFacts) -> Serving:
    """How the open `facts` describe is served.

    Its kernel inode first, unless `joined`: an open on one an earlier daemon of the
    connection may have left state on (`inherited`: a page cache, a backing file) is
    `RENEW`ed; one that cannot join the others there
    (`shares_kernel_inode`) is a write-only retry served `WRITER_BESIDE` (it can neither
    read nor map), any other retry `WAIT`s (until it can join, or no longer, then asked
    again with `waited`), the rest `RENEW`.

    Then its data path. With passthrough: readers of a blob pass through while no open on
    their kernel inode is daemon-served, and O_DIRECT ones only where the kernel takes
    O_DIRECT; a write-only writer passes through unless its writes clear setuid/setgid
    (seen here) or it is O_DIRECT under --odirect daemon; read-write writers are
    daemon-served (a shared map outlives the close that commits: through the kernel, its
    later stores would land in the committed blob). Without passthrough: a reader's first
    open of a version on its kernel inode bypasses the page cache (its pages would be read
    once), later ones read through it; writers are direct_io."""
    access = facts.flags & os.O_ACCMODE
    writable = access != os.O_RDONLY
    if facts.inherited and not facts.own and not facts.joined:
        return Serving.RENEW
    if (not facts.own and not facts.joined
            and not shares_kernel_inode(facts.others, writable, facts.version)):
        if access == os.O_WRONLY:
            return Serving.WRITER_BESIDE if facts.retrying else Serving.RENEW
        return Serving.WAIT if facts.retrying and not facts.waited else Serving.RENEW
    if facts.beside:
        return Serving.WRITER_BESIDE
    if facts.own:
        return Serving.OWN
    if facts.passthrough:
        takes = facts.kernel_o_direct or not facts.flags & os.O_DIRECT
        if writable:
            if access == os.O_RDWR or not takes or facts.clears_privileges:
                return Serving.DAEMON_WRITER
            return Serving.PASSTHROUGH_WRITER
        if facts.blob and takes and all(other.backing for other in facts.others):
            return Serving.PASSTHROUGH_READER
        return Serving.DAEMON_READER
    if writable:
        return Serving.DIRECT_WRITER
    if facts.version not in (facts.cached_version, facts.read_directly):
        return Serving.DIRECT_READER
    return Serving.PAGE_CACHE_READER
