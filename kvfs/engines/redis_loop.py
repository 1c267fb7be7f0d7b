"""One connection to Redis for the trio loop itself: a change whose reads all came from the
host's record cache commits from the loop (`RedisEngine.change_on_loop`), so that its one
round trip costs no hand-off to a worker thread and back (two thread wake-ups, each longer
than the round trip itself on a small VM).

redis-py's clients are for threads (`redis.Redis`) or asyncio (`redis.asyncio`), not trio;
this sends the protocol's command arrays itself (packed by hiredis, the C parser redis-py
uses too, which also parses the replies). The socket is used directly, non-blocking: a
request is one send() and, once the reply is due, one wait for the socket to be readable,
so a round trip costs the loop one scheduler pass (trio's streams take a lock and a
checkpoint in each send and receive).

Requests share the connection without waiting for each other (pipelining): each is sent at
once, and Redis answers in the order it received them, so the replies are read in that
order, each by the task that sent its request.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Callable
from urllib.parse import unquote, urlparse

import hiredis
import trio

from kvfs.quick_lock import QuickLock

DEFAULT_DEADLINE = 3.0  # seconds for a request, connecting included
# Replies of a server that did not run the request and cannot now: a replica (after a
# failover), a master without the replicas it needs, one loading its data.
NOT_SERVING = ("READONLY", "NOREPLICAS", "MASTERDOWN", "LOADING")
RECEIVE_BYTES = 65536


class LoopConnectionError(Exception):
    """Redis could not be reached or did not answer in time: whether a request sent was
    applied is not known."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out  # (else refused or closed: Redis is down, not slow)


class LoopConnection:
    """Requests to the Redis server of a redis://[user:password@]host:port/db address, from
    trio tasks; connects at the first request and again after a failure. With `locate`
    (Sentinel), the server is the one `locate` names at each connect (a blocking call: run in
    a worker thread), in database `db`."""

    def __init__(self, url: str, deadline: float = DEFAULT_DEADLINE,
                 locate: Callable[[], tuple[str, int]] | None = None, db: int = 0) -> None:
        parsed = urlparse(url)
        self.deadline = deadline
        self.locate = locate
        if locate is None:
            self.host = parsed.hostname or "localhost"
            self.port = parsed.port or 6379
            self.db = int(parsed.path.lstrip("/") or 0)
        else:
            self.host, self.port, self.db = "", 0, db
        self.username = unquote(parsed.username) if parsed.username else None
        self.password = unquote(parsed.password) if parsed.password else None
        self._pipe: _Pipe | None = None
        self._connecting = trio.Lock()
        # connections dropped, by cause: "deadline" (a request past it, or cancelled: what
        # the connection holds is unknown), "failover" (the server became a replica),
        # "broken" (refused, reset or closed by the server)
        self.drops: Counter[str] = Counter()

    async def script(self, sha: str, source: str, keys: list[bytes],
                     args: list[bytes | int]) -> object:
        """Run a script by its digest, sending its source once if the server lacks it."""
        reply = await self.request(b"EVALSHA", sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            reply = await self.request(b"EVAL", source, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith(NOT_SERVING):
            if str(reply).startswith("READONLY") and self._pipe is not None:
                self._drop(self._pipe, "failover")  # a master that became a replica: anew
            raise LoopConnectionError(f"{self.host}:{self.port}: {reply}")
        if isinstance(reply, hiredis.ReplyError):
            raise reply
        return reply

    async def request(self, *args: bytes | str | int) -> object:
        """One command's reply (an error reply is returned, not raised)."""
        try:
            with trio.fail_after(self.deadline):
                return await self._exchange(_packed(args))
        except trio.TooSlowError:
            raise LoopConnectionError(f"{self.host}:{self.port}: no answer within "
                                      f"{self.deadline} s", timed_out=True) from None
        except (OSError, LoopConnectionError) as error:
            raise LoopConnectionError(f"{self.host}:{self.port}: {error!r}") from None

    def close(self) -> None:
        """Close the connection (from any thread: the engine closing, after the loop)."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            pipe.sock.close()

    async def _exchange(self, request: bytes) -> object:
        reused = self._pipe is not None
        pipe = await self._connected()
        try:
            return await pipe.send_and_receive(request)
        except (OSError, LoopConnectionError):
            self._drop(pipe, "broken")
            if not reused:
                raise
        except BaseException:  # (a timeout, mid-request: what the connection holds is unknown)
            self._drop(pipe, "deadline")
            raise
        # A connection kept since an earlier request was closed by the server (a restart):
        # nothing of this request came back; send it once more on a new connection. (Had the
        # server run a commit before closing, its checks refuse the second copy.)
        pipe = await self._connected()
        try:
            return await pipe.send_and_receive(request)
        except (OSError, LoopConnectionError):
            self._drop(pipe, "broken")
            raise
        except BaseException:
            self._drop(pipe, "deadline")
            raise

    def _drop(self, pipe: _Pipe, cause: str) -> None:
        """A connection failed: closed, and the requests waiting on it find out."""
        if self._pipe is pipe:
            self._pipe = None
            self.drops[cause] += 1
        pipe.close()

    async def _connected(self) -> _Pipe:
        if self._pipe is not None:  # (no lock: taking one is a scheduler pass)
            return self._pipe
        async with self._connecting:
            if self._pipe is None:
                if self.locate is not None:
                    try:
                        self.host, self.port = await trio.to_thread.run_sync(
                            self.locate, abandon_on_cancel=True)
                    except Exception as error:  # (no sentinel answers, or knows no master)
                        raise LoopConnectionError(f"no master: {error!r}") from None
                stream = await trio.open_tcp_stream(self.host, self.port)  # (TCP_NODELAY)
                pipe = _Pipe(socket.socket(fileno=stream.socket.detach()))
                try:
                    for hello in self._hello():
                        reply = await pipe.send_and_receive(hello)
                        if isinstance(reply, hiredis.ReplyError):
                            raise LoopConnectionError(str(reply))
                except BaseException:
                    pipe.close()
                    raise
                self._pipe = pipe
            return self._pipe

    def _hello(self) -> list[bytes]:
        hello = []
        if self.password is not None:
            hello.append(_packed((b"AUTH", *filter(None, [self.username, self.password]))))
        if self.db:
            hello.append(_packed((b"SELECT", self.db)))
        return hello


class _Pipe:
    """One connection: requests go out whole, one after another, and their replies are read
    in the same order, each by the task that sent its request (request n, counted from 0,
    reads once n replies have been read; the others park)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._reader = hiredis.Reader()
        self._sending = QuickLock()  # (a large request goes out in several sends)
        self._sent = 0
        self._answered = 0
        self._turns = trio.lowlevel.ParkingLot()
        self._broken = False

    async def send_and_receive(self, request: bytes) -> object:
        async with self._sending:
            turn = self._sent
            self._sent += 1
            await _send_all(self.sock, request)
        while self._answered != turn:
            if self._broken:
                raise LoopConnectionError("the connection broke before the reply")
            await self._turns.park()
        try:
            return await self._receive()
        finally:
            self._answered += 1
            self._turns.unpark_all()

    async def _receive(self) -> object:
        while (reply := self._reader.gets()) is False:
            try:
                data = self.sock.recv(RECEIVE_BYTES)
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self.sock)
                except trio.ClosedResourceError:  # (`close` by another task)
                    raise LoopConnectionError("the connection was closed") from None
                continue
            if not data:
                raise LoopConnectionError("connection closed by the server")
            self._reader.feed(data)
        return reply

    def close(self) -> None:
        """(On the loop.) A task waiting to read is woken first: the socket's descriptor
        number may be the next connection's at once."""
        self._broken = True
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()
        self._turns.unpark_all()


def _packed(args: tuple[bytes | str | int, ...]) -> bytes:
    """A command as the protocol's array of bulk strings."""
    return hiredis.pack_command(args)  # type: ignore[arg-type]  # (its stub: a 1-tuple)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            try:
                await trio.lowlevel.wait_writable(sock)
            except trio.ClosedResourceError:  # (`_Pipe.close` by another task)
                raise LoopConnectionError("the connection was closed") from None
