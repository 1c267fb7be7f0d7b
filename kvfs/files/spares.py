"""Spare staged files: unnamed files on the volume, made in a worker thread ahead of need.

A new writer takes one instead of creating a file on the request loop. Allocating an inode
is the volume's slowest small operation: a metadata round trip on a shared filesystem, and
on ext4 without a journal a scan past every recently freed inode (0.5-2 ms each on this
project's VMs, measured in docs/benchmarks.md). A spare is an O_TMPFILE: it has no name
until its commit links it into staging/ (kvfs/data.py), so a crash leaves nothing behind and
a clean unmount only closes them. On a volume without O_TMPFILE there are no spares and
writers create their staged files themselves, as before.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import deque

import trio

from kvfs.data import DataStore
from kvfs.offloop import off_loop

log = logging.getLogger(__name__)

SPARES_KEPT = 64  # a burst of 16 vLLM threads' creates, four times over
SPARES_BATCH = 16  # made per worker call
RETRY_SECONDS = (1.0, 60.0)  # first and longest wait after the volume refused (no inodes)
NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL}  # the volume's answers to O_TMPFILE


class SpareFiles:
    def __init__(self, data: DataStore) -> None:
        self.data = data
        self._fds: deque[int] = deque()
        self._wanted = trio.Event()

    def take(self) -> int | None:
        """An empty unnamed file open for reading and writing, or None (none made yet, or
        the volume cannot make them): the caller creates a named one itself."""
        if len(self._fds) < SPARES_KEPT // 2:
            self._wanted.set()
        return self._fds.popleft() if self._fds else None

    async def run(self) -> None:
        """Keep SPARES_KEPT made, refilling whenever they run low."""
        retry = RETRY_SECONDS[0]
        try:
            while True:
                while len(self._fds) < SPARES_KEPT:
                    try:
                        made = await off_loop(self._make, SPARES_BATCH)
                    except OSError as error:
                        if error.errno in NO_TMPFILE:
                            log.info("the volume makes no unnamed files (%s): writers create "
                                     "their staged files on the loop", error)
                            return
                        log.warning("making spare staged files: %s (again in %.0f s)", error,
                                    retry)
                        await trio.sleep(retry)
                        retry = min(2 * retry, RETRY_SECONDS[1])
                        continue
                    retry = RETRY_SECONDS[0]
                    self._fds.extend(made)
                self._wanted = trio.Event()
                await self._wanted.wait()
        finally:
            self.close()

    def _make(self, count: int) -> list[int]:
        """Up to `count` (fewer if the volume refuses one after the first)."""
        made: list[int] = []
        try:
            for _ in range(count):
                made.append(self.data.create_unnamed())
        except OSError:
            if not made:
                raise
        return made

    def close(self) -> None:
        """The mount ends: the spares go with their descriptors."""
        while self._fds:
            os.close(self._fds.popleft())
