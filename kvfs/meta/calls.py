"""Where code runs: the daemon's one rule.

The trio loop (one thread) owns all in-memory state: the open-file table, space accounting,
caches, holds, stats. It never waits on anything slow. Blocking work runs in a worker thread
through `off_loop` and returns values; the awaiting task applies them to the loop's state
when it resumes:
- every round trip to a shared engine (Redis), reads and changes,
- volume I/O larger than a single small syscall, and hashing.

Worker threads read and write only what they are handed and what the engines and the volume
hold; the committer thread (kvfs/engines/lmdb_engine.py) only moves answered changes into LMDB.
Metadata reads and changes of the embedded engine are memory-mapped lookups and one append to its
change log, microseconds: they run on the loop (`MetaCalls`), while on a shared engine they
are round trips and go to a worker.

A shared engine's calls have a deadline (`Deadlined.deadline`, the mount's --deadline): the
engine bounds each round trip by half of it, and a call still waiting for a worker thread
after the other half fails with EIO instead of starting (counted in the engine's `timeouts`):
no request waits on a busy or stalled engine for longer.
"""

from __future__ import annotations

import errno
import functools
import time
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar, runtime_checkable

import trio

from kvfs.engines.interface import ChangesPending, Engine, LoopChanges, RoundTripNeeded
from kvfs.observe.latency import METADATA_CALLS
from kvfs.records import fail

T = TypeVar("T")
P = ParamSpec("P")

# Requests that may wait in worker threads at once: enough for a full FUSE queue of
# writers (max_background, 16 vLLM threads) to share one group commit.
WORKERS = trio.CapacityLimiter(64)
PENDING_WAIT_SECONDS = 1.0  # for the embedded engine's committer to apply what it holds


async def off_loop(function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run blocking `function` in a worker thread; the loop serves other requests meanwhile.
    Not abandoned on cancellation: a change, once started, finishes and is applied."""
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs),
                                         limiter=WORKERS)


@runtime_checkable
class Deadlined(Protocol):
    """An engine whose calls have a deadline, and count those that miss it."""

    deadline: float
    timeouts: int


class MetaCalls:
    """Metadata reads and changes on the loop's behalf: inline where they cannot block (the
    embedded engine), in a worker where each is a network round trip (a shared engine). An
    inline change that needs the engine's pending changes applied first (ChangesPending)
    waits for them in a worker, then runs once more."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.blocking = engine.shared
        self.loop_changes = engine if isinstance(engine, LoopChanges) else None
        self.deadlined = engine if isinstance(engine, Deadlined) else None

    async def cached(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A read whose answer the kernel caches (a `cached` snapshot): on a shared engine
        tried on the loop first, from the engine's memory, and in a worker only if it needs a
        round trip (a worker costs two thread handoffs)."""
        if self.blocking:
            try:
                with self.engine.from_memory():
                    return function(*args, **kwargs)
            except RoundTripNeeded:
                pass
        return await self(function, *args, **kwargs)

    async def change(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A metadata change with no other effects (it may run twice): on a shared engine
        committed from the loop where its reads come from the engine's memory (a store's
        create and rename in a directory whose names this host knows), else as a call."""
        started = time.perf_counter_ns()
        try:
            return await self._change(function, *args, **kwargs)
        finally:
            METADATA_CALLS.record(_name(function), time.perf_counter_ns() - started)

    async def _change(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self.loop_changes is not None:
            try:
                return await self.loop_changes.change_on_loop(
                    functools.partial(function, *args, **kwargs))
            except RoundTripNeeded:
                pass
        elif not self.blocking:  # (inline here: one coroutine less per change of a store)
            try:
                return function(*args, **kwargs)
            except ChangesPending:
                return await self._after_pending(function, *args, **kwargs)
        return await self._call(function, *args, **kwargs)

    async def __call__(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        started = time.perf_counter_ns()
        try:
            return await self._call(function, *args, **kwargs)
        finally:
            METADATA_CALLS.record(_name(function), time.perf_counter_ns() - started)

    async def _call(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        if self.blocking:
            if self.deadlined is None:
                return await off_loop(function, *args, **kwargs)
            start_by = time.monotonic() + self.deadlined.deadline / 2
            return await off_loop(self._in_time, start_by, functools.partial(
                function, *args, **kwargs))
        try:
            return function(*args, **kwargs)
        except ChangesPending:
            return await self._after_pending(function, *args, **kwargs)

    def _in_time(self, start_by: float, call: Callable[[], T]) -> T:
        """(Worker) `call`, unless it waited for this worker past `start_by`: then EIO."""
        if time.monotonic() > start_by:
            assert self.deadlined is not None
            self.deadlined.timeouts += 1
            raise fail(errno.EIO)
        return call()

    async def _after_pending(self, function: Callable[P, T], *args: P.args,
                             **kwargs: P.kwargs) -> T:
        """`function` once more, after the engine applied what it held (ChangesPending)."""
        await off_loop(self.engine.sync, PENDING_WAIT_SECONDS)
        try:
            return function(*args, **kwargs)
        except ChangesPending:
            raise fail(errno.ENOSPC) from None  # the engine is not applying them: full


def _name(function: Callable) -> str:
    """A metadata call's label: the called method's name (a few dozen, never a file's)."""
    return getattr(function, "__name__", "other")
