"""The volume helper: a process of its own that makes, off the daemon's GIL, the changes to the
volume's namespace that every store would otherwise make on the request loop.

A store's open created its staged file (`staging/<blob id>`) and its close renamed the
committed blob into blobs/: each a system call on the loop (a metadata round trip on a shared
filesystem), and with many small writers the loop is the bottleneck while CPUs idle. A worker
thread cannot take them over: it hands the GIL to and from the loop at each call, which costs
more than the call. This process has an interpreter of
its own: it creates staged files ahead of need and passes their descriptors back
(kvfs/files/spares.py), and renames the blobs the publisher hands it
(`FileTable.run_publisher`), a batch per message.

Protocol: a SOCK_SEQPACKET socket pair, one message per request and per reply, in order.
    request  op u8, then NUL-separated paths: MAKE the files to create (empty, O_EXCL);
             PUBLISH (from, to) pairs to rename
    reply    op u8, count u32, errno u32. MAKE: the files made, their descriptors attached in
             order, and the errno that stopped it short of all (0: none did). PUBLISH: the
             pairs, each then as its errno u32 (0: renamed)
The process ends at the end of its input: the daemon closed its socket, or died.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from typing import NoReturn

import kvfs

log = logging.getLogger(__name__)

MAKE, PUBLISH = 1, 2
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_REPLY = struct.Struct("<BII")
_MOVED = struct.Struct("<I")
MESSAGE_MAX = 64 << 10  # bytes of paths per request (a path is at most 4 KiB): a publisher's
# batch goes in several
RECEIVE_MAX = MESSAGE_MAX + 4096  # the helper's receive buffer: any request whole
PAIRS_MAX = 512  # per PUBLISH request
REPLY_MAX = _REPLY.size + PAIRS_MAX * _MOVED.size  # the daemon's receive buffer


class HelperGone(Exception):
    """The helper process ended: the caller does the work itself."""


class VolumeHelper:
    """The daemon's side: one helper process, asked from the loop's background tasks one
    request at a time. Once it has ended, every request raises HelperGone. (It imports trio
    where it uses it: the helper process, which runs this module, stays small.)"""

    def __init__(self) -> None:
        import trio

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "kvfs.data.volume_helper", str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=kvfs.child_environment())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._socket = ours
        self._turn = trio.Lock()  # (replies come in order: one request in flight)
        self.alive = True

    async def make(self, paths: list[str]) -> tuple[list[int], int]:
        """Create each of `paths` (empty, exclusively), in order, until one fails: the
        descriptors of those made (open for reading and writing) and the failure's errno
        (0: none failed)."""
        reply, fds = await self._ask(MAKE, [os.fsencode(path) for path in paths], len(paths))
        _, made, error = _REPLY.unpack_from(reply)
        if made != len(fds):  # (descriptors lost on the way: this process's limit of them)
            for fd in fds:
                os.close(fd)
            return [], error or errno.EMFILE
        return fds, error

    async def publish(self, pairs: list[tuple[str, str]]) -> list[int]:
        """Rename each (from, to) pair: per pair, the errno of its failure (0: none)."""
        moved: list[int] = []
        while len(moved) < len(pairs):
            parts: list[bytes] = []
            size = 0
            for source, target in pairs[len(moved):len(moved) + PAIRS_MAX]:
                if parts and size > MESSAGE_MAX - 2 * 4096:
                    break
                parts += (os.fsencode(source), os.fsencode(target))
                size += len(parts[-2]) + len(parts[-1]) + 2
            reply, _ = await self._ask(PUBLISH, parts, 0)
            _, count, _ = _REPLY.unpack_from(reply)
            moved += (error for error, in
                      _MOVED.iter_unpack(reply[_REPLY.size:_REPLY.size + count * _MOVED.size]))
        return moved

    async def _ask(self, op: int, parts: list[bytes], descriptors: int
                   ) -> tuple[bytes, list[int]]:
        """One request and its reply (with up to `descriptors` descriptors). Shielded: a
        reply left unread would answer the next request."""
        import trio
        if not self.alive:
            raise HelperGone
        with trio.CancelScope(shield=True):
            async with self._turn:
                try:
                    await self._send(bytes([op]) + b"\0".join(parts))
                    while True:
                        await trio.lowlevel.wait_readable(self._socket)
                        try:
                            reply, fds, _, _ = socket.recv_fds(self._socket, REPLY_MAX,
                                                               max(descriptors, 1))
                            break
                        except BlockingIOError:
                            continue
                except OSError as error:
                    self._gone(str(error))
        if not reply:
            self._gone("it ended")
        return reply, fds

    async def _send(self, message: bytes) -> None:
        import trio
        while True:
            try:
                self._socket.send(message)
                return
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._socket)

    def _gone(self, why: str) -> NoReturn:
        if self.alive:
            log.error("the volume helper process is gone (%s): the loop creates staged files "
                      "and publishes blobs from now on", why)
        self.alive = False
        raise HelperGone

    def close(self) -> None:
        """Its input ends: it exits (it has nothing in hand between requests)."""
        self.alive = False
        self._socket.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def serve(connection: socket.socket) -> None:
    """The child: answer each request until the daemon closes the socket."""
    while True:
        try:
            request = connection.recv(RECEIVE_MAX)
        except ConnectionResetError:
            return
        if not request:
            return
        op, paths = request[0], request[1:].split(b"\0")
        if op == MAKE:
            _make(connection, paths)
        elif op == PUBLISH:
            _publish(connection, paths)


def _make(connection: socket.socket, paths: list[bytes]) -> None:
    fds: list[int] = []
    error = 0
    for path in paths:
        try:
            fds.append(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except OSError as failure:
            error = failure.errno or 0
            break
    reply = _REPLY.pack(MAKE, len(fds), error)
    try:
        if fds:
            socket.send_fds(connection, [reply], fds)
        else:
            connection.send(reply)
    finally:
        for fd in fds:
            os.close(fd)


def _publish(connection: socket.socket, paths: list[bytes]) -> None:
    moved = [_MOVED.pack(move(source, target))
             for source, target in zip(paths[::2], paths[1::2], strict=True)]
    connection.send(_REPLY.pack(PUBLISH, len(moved), 0) + b"".join(moved))


def move(source: str | bytes, target: str | bytes) -> int:
    """Rename `source` to `target` (a blob's publishing, here or in the daemon's fallback):
    0, or the errno of the failure. No `source` but a `target` is a blob published already
    (by the host that reaped this host's session while it stalled, declared dead)."""
    try:
        os.rename(source, target)
    except FileNotFoundError:
        return 0 if os.path.exists(target) else errno.ENOENT
    except OSError as failure:
        return failure.errno or errno.EIO
    return 0


def die_with(daemon: int) -> None:
    """Be killed when the daemon dies: a helper left making files after a crash could add
    staged files behind the next mount's recovery."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != daemon:  # it died before that
        sys.exit(1)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C: the daemon closes it)
    die_with(int(sys.argv[2]))
    serve(socket.socket(fileno=int(sys.argv[1])))
