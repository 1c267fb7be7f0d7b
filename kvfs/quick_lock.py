"""A lock for trio tasks that costs nothing while it is free (`QuickLock`): the open-file
table's per-handle locks (kvfs/files/state.py) and the loop's Redis connection
(kvfs/engines/redis_loop.py) take it. It imports nothing of kvfs, so that any module may use it.
"""

from __future__ import annotations

import trio


class QuickLock:
    """A lock for tasks whose acquire, when the lock is free, is no checkpoint and touches
    nothing of trio's. A request's handler that never suspends is answered by the task that
    read it (kvfs's pyfuse3 wakes another reader only for handlers that wait): a free
    per-handle lock must not make every flush a scheduler pass and a reader's wake-up.
    Waiters are woken in turn."""

    def __init__(self) -> None:
        self._held = False
        self._waiters = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if self._held:
            while self._held:  # (each release wakes one waiter, which may find it taken)
                await self._waiters.park()
        self._held = True

    async def __aexit__(self, *exc: object) -> None:
        self._held = False
        if self._waiters:
            self._waiters.unpark()
