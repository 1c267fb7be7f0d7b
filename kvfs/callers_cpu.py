"""Requests answered on the caller's CPU: with FUSE over io_uring, a request's handler runs
on the libfuse queue thread that took it (one per CPU, the caller's), not on the loop.

Over /dev/fuse every request crosses to the loop's thread and its answer back to the
caller: two wake-ups of an idle CPU, most of a small request's time on a VM. Over io_uring
the kernel queues a request on its caller's CPU, where a thread of libfuse's waits for it.
kvfs's pyfuse3 patch gives that thread the request's handler coroutine (`handle_now`), and
this module runs it there when it can:

- **One at a time, as on the loop.** The loop holds the patch's request mutex
  (`RequestLock`) all the time it runs, and lets go only while it waits for I/O (a trio
  instrument around the wait) and while it replies to an io_uring queue (whose thread may
  be waiting for the mutex). Each io_uring request's callback holds it, taken before the
  GIL: a handler sees the loop's state as a task of the loop would, between two of the
  loop's steps, so handlers keep trio's rule (nothing else runs between two awaits that do
  not suspend) whichever thread runs them. (Before the GIL: a queue thread waiting for its
  turn then does not take the GIL from the one serving at each of its system calls.)
- **A handler that must wait goes to the loop.** Where a handler is about to suspend (a
  worker thread's call, a lock another holds, a trio wait), `await on_loop()` first; off the
  loop that parks the coroutine as it is and the loop resumes it, in a task of its own
  (`_resumed`), from that point: the handler continues as if it had waited there.
- **Wake-ups from a queue thread go through the loop** (`wake`): trio's events and parking
  lots belong to the loop's thread.

Only the embedded engine (its reads and changes never wait); a shared pool's handlers make
round trips and stay on the loop.
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

import pyfuse3
import trio

log = logging.getLogger(__name__)

_MOVE_TO_LOOP = object()  # what a handler yields to its queue thread: resume me on the loop


class RequestLock(trio.abc.Instrument):
    """The patched pyfuse3's request mutex: held by the loop except while it waits for I/O
    (and while it replies to an io_uring queue), and around each io_uring request's callback
    by the queue thread that runs it, taken before the GIL (see the module's docstring).
    Installed with `start` on the loop."""

    def __init__(self) -> None:
        self._loop_thread: int | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """On the loop: take the mutex, and hand it over whenever the loop waits for I/O;
        queue threads take it from now on."""
        pyfuse3.request_lock_take()  # type: ignore[attr-defined]  # (the patch's functions)
        self._loop_thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        self._nursery = nursery
        pyfuse3.serialize_requests(True)  # type: ignore[attr-defined]
        trio.lowlevel.add_instrument(self)

    def stop(self) -> None:
        """On the loop, at the end: requests that still come go to pyfuse3's own hand-off
        to the loop (which drops them once it has ended)."""
        trio.lowlevel.remove_instrument(self)
        pyfuse3.serialize_requests(False)  # type: ignore[attr-defined]
        self._loop_thread = None
        pyfuse3.request_lock_give()  # type: ignore[attr-defined]

    def before_io_wait(self, timeout: float) -> None:
        pyfuse3.request_lock_give()  # type: ignore[attr-defined]

    def after_io_wait(self, timeout: float) -> None:
        pyfuse3.request_lock_take()  # type: ignore[attr-defined]

    def off_loop_thread(self) -> bool:
        return self._loop_thread is not None and threading.get_ident() != self._loop_thread

    def run_here(self, handler: Coroutine[Any, Any, Any], answered: Callable[[], None]
                 ) -> bool:
        """On a queue thread, holding the mutex: run `handler` until it answers (then
        `answered()`) or must wait; then the loop resumes it. False: not started (pyfuse3
        hands the handler to the loop itself)."""
        if self._loop_thread is None:
            return False
        try:
            asked = handler.send(None)
        except StopIteration:
            answered()
            return True
        except BaseException:  # (pyfuse3's handlers answer every error themselves)
            log.exception("a request's handler failed on its queue thread")
            return True
        if asked is _MOVE_TO_LOOP:
            self.to_loop(handler)
        else:  # (trio raises off its thread before it yields anything: a bug)
            log.error("a handler waited on a queue thread for %r; its request is lost", asked)
            handler.close()
        return True

    def to_loop(self, handler: Coroutine[Any, Any, Any]) -> bool:
        """`handler`, not started or parked at `on_loop`, runs on in a task of the loop."""
        if self._loop_thread is None:
            return False
        self.call_soon(self._start_resumed, handler)
        return True

    def call_soon(self, function: Callable[..., object], *args: object) -> None:
        assert self._token is not None
        self._token.run_sync_soon(function, *args)

    def _start_resumed(self, handler: Coroutine[Any, Any, Any]) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(_resumed, handler)


REQUEST_LOCK = RequestLock()  # the daemon's (one trio loop per process)


async def on_loop() -> None:
    """Before a handler suspends or touches trio: off the loop's thread, continue on it."""
    if REQUEST_LOCK.off_loop_thread():
        await _move_to_loop()


def call_on_loop(function: Callable[..., object], *args: object) -> None:
    """`function(*args)` now on the loop, or soon from a queue thread (trio's events and
    parking lots belong to the loop's thread)."""
    if REQUEST_LOCK.off_loop_thread():
        REQUEST_LOCK.call_soon(function, *args)
    else:
        function(*args)


def wake(event: trio.Event) -> None:
    """`event.set()` from a handler, wherever it runs."""
    call_on_loop(event.set)


@types.coroutine
def _move_to_loop() -> Generator[object, None, None]:
    yield _MOVE_TO_LOOP


async def _resumed(handler: Coroutine[Any, Any, Any]) -> None:
    await _driven(handler)


@types.coroutine
def _driven(handler: Coroutine[Any, Any, Any]) -> Generator[Any, Any, None]:
    """Drive a handler parked at `on_loop` from the loop's task: what it yields from now on
    are trio's own waits, passed to the task's runner, and their results back."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            asked = handler.send(value) if error is None else handler.throw(error)
        except StopIteration:
            return
        if asked is _MOVE_TO_LOOP:  # (on the loop already)
            value, error = None, None
            continue
        try:
            value, error = (yield asked), None
        except BaseException as raised:  # (a cancellation: the handler sees it)
            value, error = None, raised
