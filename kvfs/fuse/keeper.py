"""The keeper: a small process that holds a mount's /dev/fuse descriptor, so that the
kernel's connection outlives the daemon serving it.

When the daemon dies (killed, crashed), the kernel keeps the requests engines make on the
mount, and they wait instead of failing with ENOTCONN. The next daemon started for the same
mountpoint (the same mount command: systemd's restart, a supervisor's, by hand) takes the
descriptor over from the keeper, replays the kernel's INIT and has the kernel resend what the
dead daemon had read and not answered (pyfuse3.resume). If no daemon comes within the
wait (`--takeover-wait`), the keeper lets go of the descriptor: the kernel then fails the waiting
requests (ENOTCONN), and the next mount clears the dead mount.

The keeper outlives its daemon only where the supervisor leaves it running: systemd's
KillMode=process (examples/kvfs.service), a container whose main process is not the daemon.

Each daemon keeps one connection to the keeper (SOCK_SEQPACKET: one message per send):
  daemon -> keeper: b"I" + the kernel's INIT request, once it came; b"B": unmounting, exit
  keeper -> a successor: b"T" + generation (2 bytes) + INIT request, with the descriptor
A connection that ends without b"B" is a daemon gone. The generation counts the daemons of
the connection, so that each hands out file handles and node ids of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import kvfs
from kvfs.fuse.mounts import find_mount

log = logging.getLogger(__name__)

TAKEOVER_SECONDS = 30.0  # how long engines' requests wait for the next daemon, by default
ANSWER_SECONDS = 5.0  # a keeper answers a successor at once, unless it is going away
GENERATION_SHIFT = 40  # file handles and node-id aliases of daemon N start at N << this
MESSAGE_MAX = 4096


def socket_path(mountpoint: Path) -> Path:
    digest = hashlib.sha256(str(mountpoint).encode()).hexdigest()[:24]
    return kvfs.runtime_directory() / f"keeper-{digest}.sock"


@dataclass
class Takeover:
    """What a successor gets from the keeper."""

    fuse_fd: int
    init_request: bytes
    generation: int
    link: KeeperLink


class KeeperLink:
    """A daemon's connection to its mount's keeper."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection

    def kernel_init(self, request: bytes) -> None:
        """The kernel's INIT request, for the keeper to hand to a successor."""
        self._send(b"I" + request)

    def leaving(self) -> None:
        """This daemon unmounts: the keeper has nothing left to keep (where the unmount
        came from outside, the keeper has seen the connection end and is gone already)."""
        with contextlib.suppress(OSError):
            self.connection.send(b"B")
        self.connection.close()

    def _send(self, message: bytes) -> None:
        try:
            self.connection.send(message)
        except OSError as error:  # the keeper is gone: the mount goes on without one
            log.warning("the keeper is gone (%s): a restart will not keep this mount", error)


def start_keeper(fuse_fd: int, mountpoint: Path, wait: float,
                 log_file: Path | None) -> KeeperLink | None:
    """Start the keeper of a mount just made, which waits `wait` seconds for a successor;
    None (logged) if it cannot start."""
    path = socket_path(mountpoint)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener.bind(str(path))
        listener.listen(4)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [sys.executable, "-m", "kvfs.fuse.keeper", "--fuse-fd", str(fuse_fd),
                   "--listener", str(listener.fileno()), "--daemon", str(theirs.fileno()),
                   "--socket", str(path), "--wait", str(wait),
                   *(["--log", str(log_file)] if log_file else [])]
        # (without a log file, the daemon runs in the foreground: the keeper logs to its
        # stderr, the journal's)
        subprocess.Popen(command, pass_fds=(fuse_fd, listener.fileno(), theirs.fileno()),
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL if log_file else None,
                         cwd="/", env=kvfs.child_environment())
    except OSError as error:
        log.warning("no keeper for %s (%s): a restart will not keep this mount", mountpoint,
                    error)
        return None
    listener.close()
    theirs.close()
    return KeeperLink(ours)


def take_over(mountpoint: Path) -> Takeover | None:
    """The descriptor of `mountpoint`'s connection from its keeper, where one keeps it
    (its daemon is gone); None where no keeper answers, or the connection is no longer
    mounted there (detached: `umount -l`)."""
    entry = find_mount(mountpoint)
    if entry is None or entry.fstype != "fuse.kvfs":
        return None
    path = socket_path(mountpoint)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.settimeout(ANSWER_SECONDS)
    try:
        connection.connect(str(path))
        message, fds, _, _ = socket.recv_fds(connection, MESSAGE_MAX, 1)
    except (FileNotFoundError, ConnectionRefusedError):
        connection.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a keeper's leftover (it was killed)
        return None
    except OSError:
        connection.close()
        return None
    if not message.startswith(b"T") or len(fds) != 1:
        connection.close()
        for fd in fds:
            os.close(fd)
        return None  # refused: a daemon serves the mount, or it has not started yet
    connection.settimeout(None)
    return Takeover(fds[0], message[3:], int.from_bytes(message[1:3], "little"),
                    KeeperLink(connection))


# -- the keeper process ------------------------------------------------------------------------


def ended(fuse_fd: int) -> bool:
    """Whether the connection is gone (unmounted, aborted): nothing left to hand over."""
    poller = select.poll()
    poller.register(fuse_fd, 0)
    return bool(poller.poll(0))


def keep(fuse_fd: int, listener: socket.socket, daemon: socket.socket, path: Path,
         wait: float) -> None:
    """Hold `fuse_fd` until the connection ends (an unmount), the daemon unmounts, or no
    daemon took over within `wait` seconds of the last one's end."""
    init_request = b""
    generation = 0
    deadline: float | None = None
    current: socket.socket | None = daemon
    poller = select.poll()
    poller.register(fuse_fd, 0)  # POLLERR alone: the connection is gone
    poller.register(listener, select.POLLIN)
    poller.register(daemon, select.POLLIN)
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        for fd, events in poller.poll(None if left is None else int(left * 1000) + 1):
            if fd == fuse_fd:
                log.info("keeper: the connection of %s ended", path)
                return
            if fd == listener.fileno():
                successor, _ = listener.accept()
                if current is not None or not init_request or ended(fuse_fd):
                    successor.close()  # a daemon serves (or has not finished starting)
                    continue
                generation += 1
                socket.send_fds(successor, [b"T" + generation.to_bytes(2, "little")
                                            + init_request], [fuse_fd])
                current, deadline = successor, None
                poller.register(successor, select.POLLIN)
                log.warning("keeper: daemon %d took the mount over", generation)
            elif current is not None and fd == current.fileno():
                message = current.recv(MESSAGE_MAX) if events & select.POLLIN else b""
                if message.startswith(b"I"):
                    init_request = message[1:]
                    continue
                poller.unregister(current)
                current.close()
                current = None
                if message == b"B":
                    return
                deadline = time.monotonic() + wait
                log.warning("keeper: the daemon is gone; requests wait %.0f s for the next",
                            wait)
        if deadline is not None and time.monotonic() >= deadline:
            log.error("keeper: no daemon took the mount over in %.0f s: letting it go "
                      "(waiting requests fail with ENOTCONN)", wait)
            return


def main() -> int:
    parser = argparse.ArgumentParser(description="kvfs's keeper of a mount's /dev/fuse")
    parser.add_argument("--fuse-fd", type=int, required=True)
    parser.add_argument("--listener", type=int, required=True)
    parser.add_argument("--daemon", type=int, required=True)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--wait", type=float, default=TAKEOVER_SECONDS)
    parser.add_argument("--log", type=Path)
    args = parser.parse_args()
    logging.basicConfig(filename=args.log, level=logging.INFO, format=(
        "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"))
    listener = socket.socket(fileno=args.listener)
    try:
        keep(args.fuse_fd, listener, socket.socket(fileno=args.daemon), args.socket, args.wait)
    finally:
        with contextlib.suppress(FileNotFoundError):
            args.socket.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
