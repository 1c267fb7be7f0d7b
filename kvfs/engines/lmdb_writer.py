"""The LMDB writer: a process of its own that moves the embedded engine's changes into LMDB.

The embedded engine (kvfs/engines/lmdb_engine.py) answers a change once it is in memory and in
the change log; its committer thread then moves each group of changes into LMDB in one synced
transaction. That work is done here, in a child process, not in the daemon: py-lmdb releases
the GIL around every get and put, so a committer in the daemon's process and the request loop
handed the GIL to each other at every LMDB call of either, and each of the loop's reads got
many times slower while the committer ran. The committer thread sends a group here and waits
for the reply without the GIL; this process folds it, applies it and syncs on another CPU.

Protocol, over pipes (the daemon writes this process's stdin and reads its stdout):
    request  the group's last seq u64, its payloads' total bytes u32, then each change's
             payload (kvfs/engines/changelog.py's encoding) as u32 length + bytes, oldest first
    reply    status u8 (0: in LMDB and synced, through that seq; 1: LMDB refused the group,
             nothing of it applied), u32 length + the error's text
The process ends at the end of its input: the daemon closed it, or died. It holds
`writer.lock` in the LMDB directory while it lives, and an engine that opens the directory
takes that lock before it reads what LMDB holds: a writer left by a killed daemon finishes its
group and exits first, so that a change is never applied twice (counters are deltas).
"""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb

import kvfs
from kvfs.engines.lmdb_env import layer_of, open_environment, write_layer

_REQUEST = struct.Struct("<QI")
_LENGTH = struct.Struct("<I")
_REPLY = struct.Struct("<BI")
APPLIED, REFUSED = 0, 1
WRITER_LOCK = "writer.lock"
WRITER_WAIT_SECONDS = 60.0  # for a killed daemon's writer to finish its group and exit


def hold_writer_lock(path: Path) -> int:
    """Wait until no other process writes the LMDB environment at `path`, and keep it so
    until the returned descriptor is closed. RuntimeError if another keeps it past
    WRITER_WAIT_SECONDS (a writer stopped, not dead: its group is still to land)."""
    fd = os.open(path / WRITER_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    timeout = WRITER_WAIT_SECONDS
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"another process still writes LMDB after {timeout:.0f} s "
                                       f"({path / WRITER_LOCK} is locked: a previous daemon's "
                                       "LMDB writer)") from None
                time.sleep(0.02)
    except BaseException:
        os.close(fd)
        raise


class WriterError(Exception):
    """A group did not reach LMDB: LMDB refused it (a full map), or the process ended."""


class LmdbWriter:
    """The daemon's side: one writer process, started again if it ends."""

    def __init__(self, path: Path, map_size: int, families: tuple[str, ...]) -> None:
        self._command = [sys.executable, "-m", "kvfs.engines.lmdb_writer", str(path), str(map_size),
                         ",".join(families)]
        self._env = kvfs.child_environment()
        self._process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=self._env)

    @property
    def pid(self) -> int:
        return self._process.pid

    def write(self, last_seq: int, payloads: list[bytes]) -> None:
        """Have LMDB hold these changes, through `last_seq` (blocking; no GIL while it
        waits). WriterError if it does not: the caller tries again."""
        if self._process.poll() is not None:
            self._end()
            try:
                self._process = self._start()
            except OSError as error:
                raise WriterError(f"the LMDB writer process cannot start ({error})") from None
        body = b"".join(part for payload in payloads
                        for part in (_LENGTH.pack(len(payload)), payload))
        assert self._process.stdin is not None and self._process.stdout is not None
        try:
            _write_all(self._process.stdin.fileno(), _REQUEST.pack(last_seq, len(body)) + body)
            status, length = _REPLY.unpack(_read_exactly(self._process.stdout.fileno(),
                                                         _REPLY.size))
            message = _read_exactly(self._process.stdout.fileno(), length)
        except (OSError, EOFError) as error:
            self._process.kill()
            self._end()
            raise WriterError(f"the LMDB writer process ended ({error})") from None
        if status != APPLIED:
            raise WriterError(message.decode(errors="replace"))

    def close(self) -> None:
        """Its input ends: it exits once the group in hand (none, between writes) is done."""
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._end()

    def _end(self) -> None:
        """Reap the process and close its pipes."""
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, length: int) -> bytes:
    """`length` bytes; EOFError if the input ends first."""
    parts = []
    while length:
        part = os.read(fd, length)
        if not part:
            raise EOFError("end of input")
        parts.append(part)
        length -= len(part)
    return b"".join(parts)


def _payloads(body: bytes) -> list[bytes]:
    found, at = [], 0
    while at < len(body):
        (length,) = _LENGTH.unpack_from(body, at)
        found.append(body[at + _LENGTH.size: at + _LENGTH.size + length])
        at += _LENGTH.size + length
    return found


def serve(path: Path, map_size: int, families: tuple[str, ...]) -> None:
    """The child: apply each group it is sent, in one synced transaction, until its input
    ends."""
    hold_writer_lock(path)  # (until it exits)
    env, dbs = open_environment(path, families, map_size)
    try:
        while True:
            try:
                last_seq, length = _REQUEST.unpack(_read_exactly(0, _REQUEST.size))
                body = _read_exactly(0, length)
            except EOFError:
                return
            try:
                write_layer(env, dbs, layer_of(_payloads(body), last_seq))
                reply = _REPLY.pack(APPLIED, 0)
            except lmdb.Error as error:
                text = str(error).encode()
                reply = _REPLY.pack(REFUSED, len(text)) + text
            _write_all(1, reply)
    finally:
        env.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C: the daemon closes it)
    serve(Path(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3].split(",")))
