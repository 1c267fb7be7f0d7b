"""The trio loop's own Redis connection (kvfs/engines/redis_loop.py), against a real redis-server:
requests from many tasks share it (pipelined), and each gets its own reply, also across a
connection the server drops and a server that is down."""

from __future__ import annotations

import os

import redis
import trio
import trio.testing
from local_redis import LocalRedis

from kvfs.engines.redis_loop import LoopConnection, LoopConnectionError

TASKS = 64


async def echo_all(connection: LoopConnection, payloads: list[bytes]) -> list[object]:
    replies: list[object] = [None] * len(payloads)

    async def one(index: int) -> None:
        try:
            replies[index] = await connection.request(b"ECHO", payloads[index])
        except LoopConnectionError as error:
            replies[index] = error

    async with trio.open_nursery() as nursery:
        for index in range(len(payloads)):
            nursery.start_soon(one, index)
    return replies


def payloads(count: int) -> list[bytes]:
    # Sizes from a few bytes to 1 MiB: large ones take several sends and receives, so
    # replies of requests sent meanwhile arrive in pieces behind them.
    return [os.urandom(16) * (1 + (index * 7919) % (65536 if index % 8 else 1))
            for index in range(count)]


def test_requests_from_many_tasks_get_their_own_replies(redis_server: LocalRedis) -> None:
    connection = LoopConnection(redis_server.url)
    sent = payloads(TASKS)
    try:
        assert trio.run(echo_all, connection, sent) == sent
        assert trio.run(connection.request, b"SET", b"k", 5) == b"OK"
        assert trio.run(connection.request, b"INCRBY", b"k", 2) == 7
        error = trio.run(connection.request, b"INCRBY", b"k", b"x")  # (returned, not raised)
        assert isinstance(error, Exception) and "not an integer" in str(error)
    finally:
        connection.close()


def test_a_connection_the_server_drops_is_made_again(redis_server: LocalRedis) -> None:
    """Requests waiting on a connection the server closes are sent again on a new one (each
    once: nothing of them came back), and every task still gets its own reply."""
    connection = LoopConnection(redis_server.url)
    admin = redis.Redis.from_url(redis_server.url)
    sent = payloads(TASKS)

    async def dropped_midway() -> list[object]:
        await connection.request(b"PING")  # (connected: the next requests reuse it)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, admin.execute_command,
                               "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            return await echo_all(connection, sent)

    try:
        assert trio.run(dropped_midway) == sent
        redis_server.restart()
        assert trio.run(connection.request, b"PING") == b"PONG"  # (a restarted server)
    finally:
        admin.close()
        connection.close()


def test_a_server_that_is_down_fails_each_request(redis_server: LocalRedis) -> None:
    connection = LoopConnection(redis_server.url)
    try:
        assert trio.run(connection.request, b"PING") == b"PONG"
        redis_server.stop()
        for _ in range(2):
            replies = trio.run(echo_all, connection, payloads(8))
            assert all(isinstance(reply, LoopConnectionError) for reply in replies)
        redis_server.start()
        assert trio.run(connection.request, b"PING") == b"PONG"
    finally:
        connection.close()
