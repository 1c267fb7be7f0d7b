"""Spare staged files: unnamed files on the volume, made in a worker thread ahead of need,
where the volume is slow to create files.

A writer's staged file is created when it opens (kvfs/data.py). Allocating an inode can be
the volume's slowest small operation: a metadata round trip on a shared filesystem, and on
ext4 without a journal a scan past every recently freed inode (0.5-2 ms each on this
project's VMs, docs/benchmarks.md). There a writer takes a spare instead of creating a file
on the request loop. A spare is an O_TMPFILE: it has no name until its commit links it into
staging/, so a crash leaves nothing behind and a clean unmount only closes them.

Where creates are quick (ext4 with a journal, XFS: ~25 µs) spares cost more than they save:
the worker's calls hand the GIL to and from the loop for every file it makes, and the loop
links each spare into staging/ at its commit anyway. At sixteen writers of 4 KiB files on a
journaled ext4 the mount stored 22 % more without them (docs/benchmarks.md). So `--spares
auto` (the default) starts without them on one host and times the creates the loop makes:
when the quickest of CREATES_TIMED in a row took more than SLOW_CREATE_SECONDS, spares are
made, and when the quickest of a batch of spares took less than QUICK_CREATE_SECONDS the loop
creates again, but not within SPARES_HOLD_SECONDS of their start (a volume between the two
would switch them many times a second). (The quickest: a thread's wait for the GIL after a
system call only ever adds to one, and the loop is busiest when creates are timed.) A shared
pool's volume is a network filesystem: there spares are made from the start. On a volume
without O_TMPFILE there are none, whatever the mode.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from enum import StrEnum

import trio

from kvfs.callers_cpu import wake
from kvfs.data import DataStore
from kvfs.offloop import off_loop

log = logging.getLogger(__name__)

SPARES_KEPT = 64  # a burst of 16 vLLM threads' creates, four times over
SPARES_BATCH = 16  # made per worker call
RETRY_SECONDS = (1.0, 60.0)  # first and longest wait after the volume refused (no inodes)
NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL}  # the volume's answers to O_TMPFILE
SLOW_CREATE_SECONDS = 200e-6  # the loop's quickest create of CREATES_TIMED above: spares
QUICK_CREATE_SECONDS = 60e-6  # the quickest spare of a batch below: the loop creates again
CREATES_TIMED = 8
SPARES_HOLD_SECONDS = 60.0  # spares made (auto) stay at least this long


class SpareMode(StrEnum):
    AUTO = "auto"  # spares where creates are slow (see the module's docstring)
    ON = "on"
    OFF = "off"


class SpareFiles:
    def __init__(self, data: DataStore, mode: SpareMode,
                 hold_seconds: float = SPARES_HOLD_SECONDS,
                 quick_seconds: float = QUICK_CREATE_SECONDS) -> None:
        self.data = data
        self.mode = mode
        self.hold_seconds = hold_seconds
        self.quick_seconds = quick_seconds
        self._making_since = time.monotonic()
        self.making = mode is SpareMode.ON or (mode is SpareMode.AUTO and data.shared)
        self._fds: deque[int] = deque()
        self._wanted = trio.Event()
        self._create_seconds: list[float] = []  # the loop's latest creates

    def take(self) -> int | None:
        """An empty unnamed file open for reading and writing, or None (spares are not
        made here now, none are made yet, or the volume cannot make them): the caller then
        creates a named one itself and says how long it took (`created`)."""
        if self.making and len(self._fds) < SPARES_KEPT // 2:
            wake(self._wanted)
        return self._fds.popleft() if self._fds else None

    def created(self, seconds: float) -> None:
        """A writer created its staged file on the loop in `seconds` (auto: spares from
        when such creates are slow)."""
        if self.mode is not SpareMode.AUTO or self.making:
            return
        self._create_seconds.append(seconds)
        if len(self._create_seconds) < CREATES_TIMED:
            return
        quickest = min(self._create_seconds)
        self._create_seconds.clear()
        if quickest > SLOW_CREATE_SECONDS:
            log.info("staged files take %.0f µs or more to create on the volume: writers take "
                     "spares made ahead", quickest * 1e6)
            self.making = True
            self._making_since = time.monotonic()
            wake(self._wanted)

    async def run(self) -> None:
        """Keep SPARES_KEPT made while spares are wanted, refilling whenever they run low."""
        retry = RETRY_SECONDS[0]
        try:
            while True:
                while self.making and len(self._fds) < SPARES_KEPT:
                    try:
                        made, quickest = await off_loop(self._make, SPARES_BATCH)
                    except OSError as error:
                        if error.errno in NO_TMPFILE:
                            log.info("the volume makes no unnamed files (%s): writers create "
                                     "their staged files on the loop", error)
                            self.making = False
                            return
                        log.warning("making spare staged files: %s (again in %.0f s)", error,
                                    retry)
                        await trio.sleep(retry)
                        retry = min(2 * retry, RETRY_SECONDS[1])
                        continue
                    retry = RETRY_SECONDS[0]
                    self._fds.extend(made)
                    self._quick_again(quickest)
                self._wanted = trio.Event()
                await self._wanted.wait()
        finally:
            self.close()

    def _quick_again(self, quickest: float) -> None:
        """(auto) The quickest spare of a batch took `quickest` seconds: quick enough for the
        loop to create its files again?"""
        if (self.mode is SpareMode.AUTO and not self.data.shared
                and quickest < self.quick_seconds
                and time.monotonic() - self._making_since >= self.hold_seconds):
            log.info("staged files take %.0f µs to create on the volume: writers create "
                     "their own again", quickest * 1e6)
            self.making = False

    def _make(self, count: int) -> tuple[list[int], float]:
        """Up to `count` (fewer if the volume refuses one after the first), and the seconds
        the quickest took."""
        made: list[int] = []
        quickest = float("inf")
        try:
            for _ in range(count):
                started = time.perf_counter()
                made.append(self.data.create_unnamed())
                quickest = min(quickest, time.perf_counter() - started)
        except OSError:
            if not made:
                raise
        return made, quickest

    def close(self) -> None:
        """The mount ends: the spares go with their descriptors."""
        while self._fds:
            os.close(self._fds.popleft())
