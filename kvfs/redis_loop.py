"""One connection to Redis for the trio loop itself: a change whose reads all came from the
host's record cache commits from the loop (`RedisEngine.change_on_loop`), so that its one
round trip costs no hand-off to a worker thread and back (two thread wake-ups, ~0.35 ms of a
Redis store's ~1 ms per change on a small VM, against ~0.13 ms for the round trip itself).

redis-py's clients are for threads (`redis.Redis`) or asyncio (`redis.asyncio`), not trio;
this sends the protocol's command arrays itself and parses replies with hiredis, the C
parser redis-py uses too. Requests are one at a time (a trio lock): a commit is one short
script, and a loop that serves one request at a time cannot send them faster.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

import hiredis
import trio

CONNECT_TIMEOUT = 1.0  # seconds (also the threads' redis-py client's)
REQUEST_TIMEOUT = 2.0


class LoopConnectionError(Exception):
    """Redis could not be reached or did not answer in time: whether a request sent was
    applied is not known."""


def command(*args: bytes | str | int) -> bytes:
    """A command as the protocol's array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


class LoopConnection:
    """Requests to the Redis server of a redis://[user:password@]host:port/db address, from
    trio tasks; connects at the first request and again after a failure."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self.host = parsed.hostname or "localhost"
        self.port = parsed.port or 6379
        self.db = int(parsed.path.lstrip("/") or 0)
        self.username = unquote(parsed.username) if parsed.username else None
        self.password = unquote(parsed.password) if parsed.password else None
        self._stream: trio.SocketStream | None = None
        self._reader = hiredis.Reader()
        self._lock = trio.Lock()

    async def script(self, sha: str, source: str, keys: list[bytes],
                     args: list[bytes | int]) -> object:
        """Run a script by its digest, sending its source once if the server lacks it."""
        reply = await self.request(b"EVALSHA", sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            reply = await self.request(b"EVAL", source, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError):
            raise reply
        return reply

    async def request(self, *args: bytes | str | int) -> object:
        """One command's reply (an error reply is returned, not raised)."""
        async with self._lock:
            try:
                with trio.fail_after(CONNECT_TIMEOUT + REQUEST_TIMEOUT):
                    return await self._exchange(command(*args))
            except (OSError, trio.TooSlowError, trio.BrokenResourceError,
                    LoopConnectionError) as error:
                await self._close()
                raise LoopConnectionError(f"{self.host}:{self.port}: {error!r}") from None

    def close(self) -> None:
        """Close the connection from any thread (the engine closing, after the loop)."""
        if self._stream is not None:
            os.close(self._stream.socket.detach())  # (trio's close needs a running loop)
            self._stream = None

    async def _exchange(self, request: bytes) -> object:
        reused = self._stream is not None
        stream = await self._connected()
        try:
            await stream.send_all(request)
            return await self._reply(stream)
        except (OSError, trio.BrokenResourceError, LoopConnectionError):
            if not reused:
                raise
        # A connection kept since an earlier request was closed by the server (a restart):
        # nothing of this request came back; send it once more on a new connection. (Had the
        # server run a commit before closing, its checks refuse the second copy.)
        await self._close()
        stream = await self._connected()
        await stream.send_all(request)
        return await self._reply(stream)

    async def _connected(self) -> trio.SocketStream:
        if self._stream is None:
            stream = await trio.open_tcp_stream(self.host, self.port)
            self._stream, self._reader = stream, hiredis.Reader()
            hello = []
            if self.password is not None:
                hello.append(command(b"AUTH", *filter(None, [self.username, self.password])))
            if self.db:
                hello.append(command(b"SELECT", self.db))
            for request in hello:
                await stream.send_all(request)
                reply = await self._reply(stream)
                if isinstance(reply, hiredis.ReplyError):
                    raise LoopConnectionError(str(reply))
        return self._stream

    async def _reply(self, stream: trio.SocketStream) -> object:
        while (reply := self._reader.gets()) is False:
            data = await stream.receive_some(65536)
            if not data:
                raise LoopConnectionError("connection closed by the server")
            self._reader.feed(data)
        return reply

    async def _close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await trio.aclose_forcefully(stream)
