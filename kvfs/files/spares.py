"""Spare staged files: writers' `staging/<blob id>` files, made ahead of need by the volume
helper process (kvfs/data/volume_helper.py), so that a writer's open creates nothing on the volume.

Creating a file is among the volume's slowest small operations (on the request loop, the
GIL's return included; a metadata round trip on a shared filesystem). The helper creates
SPARES_BATCH at a time, each named for a blob id taken ahead, and sends their descriptors
back in one message; up to SPARES_KEPT wait here. A spare is an empty staged file like any
other: the commit of the writer that takes it names its blob; unused ones are deleted at
unmount, and after a crash the next mount's recovery deletes them as it deletes every staged
file no commit names.

Where the helper makes none (it ended; the volume refuses: no inodes, no room), a writer
creates its own staged file on the loop. `--spares off`: none are made.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from enum import StrEnum

import trio

from kvfs.data.store import DataStore
from kvfs.data.volume_helper import HelperGone, VolumeHelper
from kvfs.observe.stats import Stats

log = logging.getLogger(__name__)

SPARES_KEPT = 128  # a burst of 16 vLLM threads' creates, eight times over
SPARES_BATCH = 64  # made per request to the helper: half the stock, refilled at once
RETRY_SECONDS = (1.0, 60.0)  # first and longest wait after the volume refused


class SpareMode(StrEnum):
    ON = "on"
    OFF = "off"


class SpareFiles:
    def __init__(self, data: DataStore, helper: VolumeHelper | None, stats: Stats,
                 take_blob_ids: Callable[[int], Awaitable[range]]) -> None:
        """`helper`: the process that makes them (None: none are made); `take_blob_ids`:
        that many fresh blob ids, to name them."""
        self.data = data
        self.helper = helper
        self.stats = stats
        self._take_blob_ids = take_blob_ids
        self._spares: deque[tuple[int, int]] = deque()  # (blob id, descriptor)
        self._wanted = trio.Event()
        self._generation = 0  # spares made before `forget` are not taken

    def take(self) -> tuple[int, int] | None:
        """A spare: its blob id and a descriptor of its empty staged file, open for reading
        and writing; None if there is none (the caller creates its own)."""
        if self.helper is not None and len(self._spares) <= SPARES_KEPT // 2:
            self._wanted.set()
        if not self._spares:
            return None
        self.stats.spare_staged_files -= 1
        return self._spares.popleft()

    async def run(self) -> None:
        """Keep SPARES_KEPT made, refilling whenever half are taken, a whole batch at a
        time (topping up what writers took meanwhile made a blob id allocation, a round
        trip on a shared pool, every few stores)."""
        if self.helper is None:
            return
        retry = RETRY_SECONDS[0]
        try:
            while True:
                while len(self._spares) <= SPARES_KEPT - SPARES_BATCH:
                    try:
                        await self._make(SPARES_BATCH)
                        retry = RETRY_SECONDS[0]
                    except HelperGone:
                        return
                    except Exception as error:  # (a shared engine out of reach; no room)
                        self.stats.background_errors += 1
                        log.warning("making spare staged files: %s (again in %.0f s)", error,
                                    retry)
                        await trio.sleep(retry)
                        retry = min(2 * retry, RETRY_SECONDS[1])
                self._wanted = trio.Event()
                await self._wanted.wait()
        finally:
            self.close()

    async def _make(self, count: int) -> None:
        assert self.helper is not None
        generation = self._generation
        blob_ids = await self._take_blob_ids(count)
        fds: list[int] = []
        try:
            fds, error = await self.helper.make(
                [self.data.staging_path(blob_id) for blob_id in blob_ids])
        finally:  # files made whose descriptors never came (the helper died, or they were lost)
            for blob_id in blob_ids[len(fds):]:
                self.data.discard_staging(blob_id)
        made = list(zip(blob_ids, fds, strict=False))
        if generation != self._generation:  # made for a staging directory since reaped
            _discard(self.data, made)
        else:
            self._spares.extend(made)
            self.stats.spare_staged_files += len(made)
        if error:
            raise OSError(error, os.strerror(error))

    def forget(self) -> None:
        """This host was declared dead and another reaped its staging directory: the spares'
        names are gone, and a commit could not publish one."""
        self._generation += 1
        self.close()

    def close(self) -> None:
        """The mount ends: unused spares go, files and all."""
        spares, self._spares = list(self._spares), deque()
        self.stats.spare_staged_files = 0
        _discard(self.data, spares)


def _discard(data: DataStore, spares: list[tuple[int, int]]) -> None:
    for blob_id, fd in spares:
        os.close(fd)
        data.discard_staging(blob_id)
