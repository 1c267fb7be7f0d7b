"""The kernel's inodes of kvfs's files: one per file, and a fresh one where an open could not
share the kernel state the file's current one holds.

The kernel keeps one page cache and at most one passthrough backing file per inode, and maps
every open of an inode onto them. kvfs serves several versions of a file at once (readers
keep the version they opened, each writer writes its own staged copy), so an open whose bytes
differ from what the kernel holds for the inode (a writer beside readers, a reader beside a
writer) cannot be answered on that inode without its maps reaching someone else's bytes. Such
an open is answered ESTALE after the file was given a fresh kernel inode (a new node id for
the same inode number): the VFS then looks the name up again, finds the new node id, and
opens it there. Opens already under way keep theirs.

Node ids other than the inode number itself (aliases) are counted like libfuse counts
lookups: each entry reply adds one, each FORGET takes the kernel's count away; an alias the
kernel has forgotten and that is no longer the file's current one is dropped.
"""

from __future__ import annotations

import errno
from itertools import count

from kvfs.records import fail

# Above every inode number the metadata hands out and below the control files'
# (kvfs/fuse/control.py)
FIRST_ALIAS = 1 << 61
LAST_ALIAS = 1 << 62


class KernelInodes:
    """Which node id the kernel is told for each inode, and which inode a node id names."""

    def __init__(self, numbers_from: int = 0, inherited_below: int = 0) -> None:
        """A daemon that took the connection over from an earlier one (kvfs/fuse/keeper.py)
        hands out aliases from FIRST_ALIAS + `numbers_from`, apart from the earlier ones',
        and knows that kernel inodes of numbers below `inherited_below` may hold an earlier
        daemon's state."""
        self._inherited_below = inherited_below
        self._current: dict[int, int] = {}  # inode number -> its current alias
        self._alias_of: dict[int, int] = {}  # alias -> inode number
        self._lookups: dict[int, int] = {}  # alias -> lookups the kernel holds
        self._aliases: dict[int, set[int]] = {}  # inode number -> its aliases
        self._next = count(FIRST_ALIAS + numbers_from)

    def ino(self, nodeid: int) -> int:
        """The inode a node id the kernel sent names. An alias an earlier daemon of the
        connection gave is ESTALE: the kernel then looks the name up again."""
        ino = self._alias_of.get(nodeid)
        if ino is not None:
            return ino
        if FIRST_ALIAS <= nodeid < LAST_ALIAS:
            raise fail(errno.ESTALE)
        return nodeid

    def inherited(self, nodeid: int) -> bool:
        """Whether kernel inode `nodeid` may hold an earlier daemon's page cache or backing
        file, which this daemon cannot know: an open there gets a fresh kernel inode."""
        return nodeid < self._inherited_below

    def leave_inherited(self, ino: int) -> None:
        """(A lookup of a regular file) Name a fresh kernel inode if the file's own may hold
        an earlier daemon's state: an open there would be refused, and the kernel retries a
        refused open once only, so after a refusal of an alias the earlier daemon gave, the
        retry must find a kernel inode it can open."""
        if ino not in self._current and self.inherited(ino):
            self.renew(ino)

    def nodeid(self, ino: int) -> int:
        """The node id to tell the kernel for `ino` now."""
        return self._current.get(ino, ino)

    def renew(self, ino: int) -> int:
        """Give `ino` a fresh kernel inode: later lookups answer a new node id."""
        alias = next(self._next)
        old = self._current.get(ino)
        self._current[ino] = alias
        self._alias_of[alias] = ino
        self._lookups[alias] = 0
        self._aliases.setdefault(ino, set()).add(alias)
        if old is not None:
            self._drop_if_forgotten(old)
        return alias

    def looked_up(self, nodeid: int) -> None:
        """An entry naming `nodeid` went to the kernel."""
        if nodeid in self._lookups:
            self._lookups[nodeid] += 1

    def forget(self, nodeid: int, lookups: int) -> None:
        if nodeid in self._lookups:
            self._lookups[nodeid] = max(0, self._lookups[nodeid] - lookups)
            self._drop_if_forgotten(nodeid)

    def _drop_if_forgotten(self, alias: int) -> None:
        ino = self._alias_of[alias]
        if self._lookups[alias] or self._current.get(ino) == alias:
            return
        del self._lookups[alias], self._alias_of[alias]
        aliases = self._aliases[ino]
        aliases.discard(alias)
        if not aliases:
            del self._aliases[ino]

    def all_of(self, ino: int) -> list[int]:
        """Every node id the kernel may still hold for `ino` (for invalidations)."""
        return [ino, *tuple(self._aliases.get(ino, ()))]
