"""A host declared dead while it only stalled, and the reaper that claimed its session: the
two windows between the claim and the reaper's clean-up. A content commit checks that the
session whose staging directory holds the file is still its host's (the reaper's claim ends
it), so nothing committed lives where a reaper deletes; the host registers as a new session,
with a staging directory and mount record of its own, which the old session's reaper never
touches.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import pytest
import redis
from conftest import blob_files, drop_caches, stats, wait_for
from test_meta_engines import BLOCK, mkfile, new_blob
from test_shared import assert_pool_counters_exact, fsck

from kvfs.data.volume import Volume
from kvfs.engines.redis_engine import RedisEngine
from kvfs.meta import MetaStore, u64
from kvfs.records import FsError


def session_of(data: Path, pid: int) -> bytes:
    """The session whose mount record names daemon `pid`."""
    for record in (data / "mounts").iterdir():
        if int(record.read_text().split()[0]) == pid:
            return bytes.fromhex(record.name)
    raise AssertionError(f"no mount record of pid {pid}")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def test_a_commit_after_a_reapers_claim_lands_outside_the_reaped_directory(
        shared_pool, redis_server) -> None:
    first, second = shared_pool(2, "--capacity", "256M")
    data = first.data
    payload = os.urandom(256 << 10)
    fd = os.open(first.mountpoint / "late", os.O_WRONLY | os.O_CREAT, 0o644)
    meta = MetaStore(RedisEngine(redis_server.url))
    try:
        os.write(fd, payload)
        old = session_of(data, first.pid)
        old_directory = data / "staging" / old.hex()
        # The host stalls; a reaper claims its session and lists what no commit names there
        # (the writer's staged file among them), as another host does once the stall
        # outlasts the TTL.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            assert meta.pool.end_session(old)
            doomed = [path for path in old_directory.iterdir()
                      if not meta.content.is_committed_blob(int(path.name, 16))]
            assert any(path.stat().st_size == len(payload) for path in doomed)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        os.close(fd)  # the commit: after the reaper's look, before its deletions
        fd = -1
        for path in doomed:  # the reaper's deletions
            path.unlink(missing_ok=True)
        Volume(data).forget_mount(old)  # and its forgetting of the old mount record
    finally:
        if fd >= 0:
            os.close(fd)
        meta.close()
    assert wait_for(lambda: stats(first.mountpoint)["sessions_lost"] == 1, 10)
    new = session_of(data, first.pid)  # the host's own record stays: `kvfs umount` finds it
    assert new != old
    assert Volume(data).daemon_pid(first.mountpoint) == first.pid
    drop_caches()
    assert (first.mountpoint / "late").read_bytes() == payload
    assert wait_for(lambda: _read(second.mountpoint / "late") == payload, 10)
    (first.mountpoint / "after").write_bytes(b"stored under the new session")
    assert wait_for(lambda: _read(second.mountpoint / "after")
                    == b"stored under the new session", 10)
    for host in (first, second):
        assert stats(host.mountpoint)["handler_errors"] == 0
    assert_pool_counters_exact(first)
    for host in (first, second):
        host.unmount()
    checked = fsck(data, redis_server.url)
    assert checked.returncode == 0 and "is clean" in checked.stderr, checked.stderr


def test_a_stalled_host_rejoins_under_a_new_session(shared_pool) -> None:
    """Stalled past the TTL (SIGSTOP): the other host reaps it; it wakes, registers anew,
    and its writer that was open all along closes whole."""
    first, second = shared_pool(2, "--capacity", "256M")
    payload = os.urandom(1 << 20)
    old = session_of(first.data, first.pid)
    fd = os.open(first.mountpoint / "open-across", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, payload)
        os.kill(first.pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: stats(second.mountpoint)["sessions_reaped"] == 1, 30)
        finally:
            os.kill(first.pid, signal.SIGCONT)
    finally:
        os.close(fd)
    assert wait_for(lambda: stats(first.mountpoint)["sessions_lost"] == 1, 10)
    assert session_of(first.data, first.pid) != old
    assert wait_for(lambda: not (first.data / "staging" / old.hex()).exists(), 10)
    assert wait_for(lambda: _read(second.mountpoint / "open-across") == payload, 10)
    assert wait_for(lambda: stats(second.mountpoint)["hosts"] == 2, 10)
    assert_pool_counters_exact(first)


def test_a_file_closed_while_its_host_stalled_leaves_the_volume_once_removed(
        shared_pool) -> None:
    """A reader closed while its host stalled past the TTL (the close reaches the host as it
    rejoins): once the file is removed, its data leaves the volume; no hold the rejoin
    recorded under the new session stays behind."""
    first, second = shared_pool(2, "--capacity", "256M")
    (second.mountpoint / "read-across").write_bytes(os.urandom(1 << 20))
    fd = os.open(first.mountpoint / "read-across", os.O_RDONLY)
    os.read(fd, 4096)
    closing = threading.Thread(target=os.close, args=(fd,))
    os.kill(first.pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: stats(second.mountpoint)["sessions_reaped"] == 1, 30)
        closing.start()  # (in a thread: a close may wait for the stalled daemon)
    finally:
        os.kill(first.pid, signal.SIGCONT)
        closing.join(30)
    assert wait_for(lambda: stats(first.mountpoint)["sessions_lost"] == 1, 10)
    assert wait_for(lambda: stats(first.mountpoint)["blobs_held"] == 0, 10)
    files = len(blob_files(second))
    (second.mountpoint / "read-across").unlink()
    assert wait_for(lambda: len(blob_files(second)) == files - 1, 10)
    assert_pool_counters_exact(first)


def test_a_content_commit_refuses_the_staging_directory_of_a_claimed_session(
        redis_server) -> None:
    """The check itself, on the metadata store over the test's Redis: a content commit of a
    file staged under a session that a reaper claimed fails ESTALE, also where the session's
    mark of life was read from this host's memory; one under a live session commits."""
    meta = MetaStore(RedisEngine(redis_server.url))
    try:
        sessions = [u64(meta.engine.allocate(b"next_session", 1)) for _ in range(2)]
        for session in sessions:
            meta.pool.register_session(session, b"{}")
        claimed, live = sessions
        meta.session = live
        inode = mkfile(meta, b"chunk")
        assert meta.pool.end_session(claimed)  # the reaper's claim
        blob = new_blob(meta, inode.ino, 3 * BLOCK)
        with pytest.raises(FsError) as refused:
            meta.content.commit_content(inode.ino, blob, live, staged_in=claimed)
        assert refused.value.errno == errno.ESTALE
        assert meta.content.blob_info(blob.blob_id) is None
        meta.content.commit_content(inode.ino, blob, live, staged_in=live)
        assert meta.content.blob_info(blob.blob_id) is not None
    finally:
        meta.close()


def test_a_write_that_waited_through_its_hosts_stall_claims_under_the_new_session(
        shared_pool, redis_server) -> None:
    """A write queued while its host stalled past the TTL is served as the host wakes,
    maybe before it learns that it was reaped: its claim on the pool's room must not land
    under the ended session (nothing would end it again), but under the new one, and every
    claim ends once the hosts are idle."""
    first, second = shared_pool(2, "--capacity", "256M")
    payload = os.urandom(4 << 20)
    fd = os.open(first.mountpoint / "queued", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.kill(first.pid, signal.SIGSTOP)
        try:
            assert wait_for(lambda: stats(second.mountpoint)["sessions_reaped"] == 1, 30)
            writer = threading.Thread(target=os.write, args=(fd, payload))
            writer.start()
        finally:
            os.kill(first.pid, signal.SIGCONT)
        writer.join(30)
        assert not writer.is_alive()
    finally:
        os.close(fd)
    assert wait_for(lambda: stats(first.mountpoint)["sessions_lost"] == 1, 10)
    assert wait_for(lambda: _read(second.mountpoint / "queued") == payload, 10)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert wait_for(lambda: not [key for key in client.hkeys(b"{kvfs}:counters")
                                     if key.startswith(b"claim:")], 10)
    finally:
        client.close()
    assert stats(first.mountpoint)["claimed_bytes"] == 0
    assert_pool_counters_exact(first)
