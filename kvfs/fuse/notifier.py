"""Cache invalidations pushed to the kernel: names removed behind its back (eviction, lost data,
other hosts), attributes changed, listings changed. Sent from a thread of their own, to every
kernel inode a file has (kvfs/files/kernel_inodes.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

import pyfuse3
import trio

from kvfs.files.kernel_inodes import KernelInodes
from kvfs.meta import Removed

log = logging.getLogger(__name__)

CHANGED_NAMES_KEPT = 4096  # other hosts' recent name changes remembered for racing lookups
CHANGED_NAME_SECONDS = 10.0  # ... for this long (longer than any lookup takes)
# A reply that waits for its notification waits no longer than this (the kernel may hold the
# notification on an inode whose own request waits in the loop).
NOTIFY_WAIT = 1.0


class KernelNotifier:
    """Pushes cache invalidations to the kernel from a thread of its own.

    A notification can wait on kernel locks held by requests that only our (single) event loop
    can answer, so it must never be sent from the loop itself."""

    def __init__(self, kernel: KernelInodes) -> None:
        self.kernel = kernel  # every kernel inode of a file is told
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._changed_names: dict[tuple[int, bytes], float] = {}  # -> when it was told
        # Inodes with an invalidation queued -> whether attributes alone: a burst of changes
        # in one directory (another host storing 2,000 files) sends one, not one per change.
        self._queued_inodes: dict[int, bool] = {}
        self._queued_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvfs-notify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (notification := self._queue.get()) is not None:
            try:
                notification()
            except OSError as error:  # the kernel may not know the inode or entry: fine
                log.debug("kernel notification failed: %s", error)

    def attributes_changed(self, ino: int) -> None:
        self._invalidate_inode(ino, attr_only=True)

    async def committed(self, ino: int, seen_by: int | None) -> None:
        """A commit through kernel inode `seen_by` changed `ino`'s size: the file's other
        kernel inodes (a reader's, or a hard link's name looked up beside one) still hold
        the old one, and are told before the close that committed returns."""
        others = [nodeid for nodeid in self.kernel.all_of(ino) if nodeid != seen_by]
        if others:
            with trio.move_on_after(NOTIFY_WAIT):
                await trio.to_thread.run_sync(_invalidate, others, True,
                                              abandon_on_cancel=True)

    def _invalidate_inode(self, ino: int, attr_only: bool) -> None:
        with self._queued_lock:
            queued = self._queued_inodes.get(ino)
            self._queued_inodes[ino] = attr_only and queued is not False
        if queued is None:
            self._queue.put(functools.partial(self._send_inode_invalidation, ino))

    def _send_inode_invalidation(self, ino: int) -> None:
        with self._queued_lock:
            attr_only = self._queued_inodes.pop(ino)
        _invalidate(self.kernel.all_of(ino), attr_only)

    def names_removed(self, removed: Removed) -> None:
        for parent, name in removed.names:
            self._queue.put(functools.partial(self._send_entry_removal, parent, name,
                                              removed.inode.ino))
            self._listing_changed(parent)

    def _send_entry_removal(self, parent: int, name: bytes, ino: int) -> None:
        """Tell the kernel the name is gone (and its inode, if that was its last name): the
        kernel takes it only with the node id its entry holds, which may be any of the
        file's (kvfs/files/kernel_inodes.py); else the entry is merely dropped."""
        for nodeid in self.kernel.all_of(ino):
            try:
                pyfuse3.invalidate_entry(parent, name, nodeid)
                return
            except OSError:
                continue
        pyfuse3.invalidate_entry(parent, name)

    def _listing_changed(self, directory: int) -> None:
        """Drop the kernel's cached listing of `directory` (invalidating an entry drops it
        only where the kernel still has that entry)."""
        self._invalidate_inode(directory, attr_only=False)

    def others_changed_name(self, parent: int, name: bytes) -> None:
        """Another host added, removed or replaced a name (from the engine's thread)."""
        now = time.monotonic()
        if len(self._changed_names) >= CHANGED_NAMES_KEPT:
            self._changed_names = {place: told for place, told in self._changed_names.items()
                                   if told > now - CHANGED_NAME_SECONDS}
        self._changed_names[parent, name] = now
        self._queue.put(functools.partial(pyfuse3.invalidate_entry, parent, name))
        self._listing_changed(parent)

    def changed_since(self, parent: int, name: bytes, moment: float) -> bool:
        """Whether another host changed the name since `moment`: a lookup that began before
        may answer what its invalidation already missed, and must not be cached."""
        return self._changed_names.get((parent, name), 0.0) >= moment

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def _invalidate(nodeids: list[int], attr_only: bool) -> None:
    for nodeid in nodeids:
        with contextlib.suppress(OSError):  # (a kernel inode the kernel dropped)
            pyfuse3.invalidate_inode(nodeid, attr_only=attr_only)
