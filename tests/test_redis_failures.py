"""A shared pool's metadata server fails: it is killed and restarted from its append-only
file, or it comes back empty. Each test checks what the mounts serve meanwhile (never a wrong
byte), that nothing Redis acknowledged is lost, and that no capacity leaks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import redis
from conftest import blob_files, run_mount, stats, wait_for
from local_redis import LocalRedis, free_port
from test_shared import assert_pool_counters_exact, fsck, staged_files

MiB = 1 << 20


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def kill9_and_restart(server) -> None:
    """Crash the Redis server (no shutdown, no final write of its files) and start it again
    on the same port and files."""
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()
    server.process = None
    server.start()


def test_a_crashed_redis_with_aof_always_loses_nothing_it_acknowledged(shared_pool,
                                                                       redis_server) -> None:
    """With `appendfsync always` every change is on Redis's disk before it answers, so a
    kill -9 of Redis loses none: every close, rename and unlink a client saw succeed is
    there after the restart, on every host."""
    redis.Redis.from_url(redis_server.url).config_set("appendfsync", "always")
    first, second = shared_pool(2, "--capacity", "256M")
    written: dict[str, bytes] = {}
    for index in range(24):
        host = (first, second)[index % 2]
        content = os.urandom((index % 4) * MiB + 4096 * index)
        temporary = host.mountpoint / f"chunk{index}.tmp"
        temporary.write_bytes(content)
        temporary.rename(host.mountpoint / f"chunk{index}")
        written[f"chunk{index}"] = content
    for index in range(0, 24, 3):
        (second.mountpoint / f"chunk{index}").unlink()
        del written[f"chunk{index}"]
    kill9_and_restart(redis_server)
    for host in (first, second):
        assert wait_for(lambda h=host: sorted(os.listdir(h.mountpoint)) == sorted(written), 30)
        for name, content in written.items():
            assert wait_for(lambda h=host, n=name, c=content: _read(h.mountpoint / n) == c, 20)
    (first.mountpoint / "after").write_bytes(b"after the crash")
    assert wait_for(lambda: _read(second.mountpoint / "after") == b"after the crash", 20)
    for host in (first, second):
        assert stats(host.mountpoint)["handler_errors"] == 0
        assert stats(host.mountpoint)["pool_lost"] is False
    assert_pool_counters_exact(first)


def test_a_redis_that_comes_back_empty_serves_nothing_and_fsck_reclaims(
        shared_pool, redis_server, tmp_path: Path) -> None:
    """Redis restarted without its files (a lost disk, a new instance): every mount finds
    its pool gone (the pool's identity, in Redis and in DATA/pool-id), serves nothing from the
    empty Redis and writes nothing there; a new mount is refused with the fsck to run; fsck
    --repair makes a new pool there and reclaims every old data file: no capacity leaks."""
    first, second = shared_pool(2, "--capacity", "256M")
    data = first.data
    contents = {f"chunk{index}": os.urandom(MiB + index) for index in range(6)}
    for index, (name, content) in enumerate(contents.items()):
        ((first, second)[index % 2].mountpoint / name).write_bytes(content)
    old_pool = (data / "pool-id").read_bytes()
    assert old_pool.strip() and blob_files(data)
    redis_server.stop()
    shutil.rmtree(redis_server.directory)
    redis_server.start()
    for host in (first, second):
        assert wait_for(lambda h=host: stats(h.mountpoint)["pool_lost"] is True, 20)
    for host in (first, second):
        for name, content in contents.items():  # a miss or an error, never a wrong byte
            assert _read(host.mountpoint / name) in (None, content)
        try:
            (host.mountpoint / "new").write_bytes(b"into an emptied pool")
            made = True
        except OSError:
            made = False
        assert not made
    # Nothing of the old pool reached the empty Redis, nor was the volume touched.
    assert redis.Redis.from_url(redis_server.url).get(b"{kvfs}:settings:format") is None
    assert len(blob_files(data)) == len(contents)
    for host in (first, second):
        host.unmount()
    refused = run_mount(first.mountpoint, data, *first.options)
    assert refused.returncode != 0 and "kvfs fsck" in refused.stderr, refused.stderr
    checked = fsck(data, redis_server.url)
    assert checked.returncode != 0 and "--repair" in checked.stderr, checked.stderr
    repaired = fsck(data, redis_server.url, repair=True)
    assert repaired.returncode == 0, repaired.stderr
    assert blob_files(data) == [] and staged_files(data) == []
    assert (data / "pool-id").read_bytes() != old_pool  # a new pool
    assert fsck(data, redis_server.url).returncode == 0
    first.mount()
    shown = stats(first.mountpoint)
    assert (shown["files"], shown["used_bytes"], shown["pool_lost"]) == (0, 0, False)
    (first.mountpoint / "fresh").write_bytes(b"a new pool")
    assert (first.mountpoint / "fresh").read_bytes() == b"a new pool"
    assert_pool_counters_exact(first)


def test_a_mount_refuses_a_redis_that_holds_another_pool(shared_pool, redis_server,
                                                         make_mount, tmp_path: Path) -> None:
    """Two volumes, one Redis database: the second volume's mount is refused, and the first
    pool's metadata is untouched."""
    [first] = shared_pool(1, "--capacity", "64M")
    (first.mountpoint / "kept").write_bytes(b"kept")
    other = tmp_path / "other-volume"
    other.mkdir()
    (other / "shared-metadata").write_text(f"{redis_server.url}\n")
    (other / "pool-id").write_bytes(b"0123456789abcdef\n")
    mountpoint = tmp_path / "other-mnt"
    mountpoint.mkdir()
    refused = run_mount(mountpoint, other, "--meta", redis_server.url)
    assert refused.returncode != 0 and "another pool" in refused.stderr, refused.stderr
    assert (first.mountpoint / "kept").read_bytes() == b"kept"
    assert stats(first.mountpoint)["pool_lost"] is False


class LocalSentinel:
    """A Redis Sentinel of the test's own, watching one master (quorum 1: it alone decides
    the failover), with a short down-after so that a failover takes seconds."""

    def __init__(self, directory: Path, master_port: int, name: str = "kvfs") -> None:
        self.directory = directory
        self.master_port = master_port
        self.name = name
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> LocalSentinel:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"logfile {self.directory / 'sentinel.log'}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.name} 1000\n"
            f"sentinel failover-timeout {self.name} 5000\n")
        self.process = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        assert wait_for(lambda: _answers(client), 10), "redis sentinel did not start"
        return self

    def replicas_known(self) -> bool:
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        return bool(client.sentinel_slaves(self.name))

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _link_up(replica: LocalRedis) -> bool:
    info = redis.Redis.from_url(replica.url).info("replication")
    return info.get("master_link_status") == "up"


class Writer(threading.Thread):
    """Stores files through a mount in a loop, each name's content a function of its name,
    and notes what each store answered (0, or the errno)."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.outcomes: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        number = 0
        while not self.stop.is_set():
            name = f"during{number}"
            temporary = self.root / f"{name}.tmp"
            try:  # (the engines' pattern: a temporary name, renamed once whole)
                temporary.write_bytes(content_of(name))
                temporary.rename(self.root / name)
                self.outcomes[name] = 0
            except OSError as error:
                self.outcomes[name] = error.errno or -1
                time.sleep(0.05)
            number += 1


def content_of(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest() * 4096  # 128 KiB


def test_a_sentinel_failover_fails_writes_cleanly_and_loses_nothing_replicated(
        make_mount, tmp_path: Path) -> None:
    """--meta redis+sentinel://…: the master is killed while a host stores files; stores
    in flight fail EIO or complete; once the Sentinel has promoted the replica both hosts
    serve and store again. Every file stored before the replica had it is there; a store
    answered after the last replication may be lost (a miss), never a wrong byte."""
    master = LocalRedis(tmp_path / "master").start()
    replica = LocalRedis(tmp_path / "replica",
                         extra=("--replicaof", "127.0.0.1", str(master.port))).start()
    sentinel = LocalSentinel(tmp_path / "sentinel", master.port).start()
    hosts: list = []
    try:
        assert wait_for(lambda: _link_up(replica), 20)
        assert wait_for(sentinel.replicas_known, 30)
        url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{sentinel.name}"
        hosts = [make_mount("--meta", url, "--session-ttl", "1", "--deadline", "2",
                            "--capacity", "256M", data=tmp_path / "pool") for _ in range(2)]
        for index in range(8):
            name = f"before{index}"
            (hosts[index % 2].mountpoint / name).write_bytes(content_of(name))
        replicated = redis.Redis.from_url(master.url).execute_command("WAIT", 1, 5000)
        assert replicated == 1
        writer = Writer(hosts[0].mountpoint)
        writer.start()
        time.sleep(0.5)
        assert master.process is not None
        master.process.kill()
        master.process.wait()
        killed = time.monotonic()
        master.process = None
        probes = iter(range(1_000_000))

        def stores_again() -> bool:
            name = f"probe{next(probes)}"
            try:
                (hosts[1].mountpoint / name).write_bytes(content_of(name))
                return True
            except OSError:
                return False

        assert wait_for(stores_again, 60)
        recovered = time.monotonic() - killed
        time.sleep(1)
        writer.stop.set()
        writer.join(30)
        outcomes = writer.outcomes
        failed = [code for code in outcomes.values() if code]
        assert set(failed) <= {errno.EIO}, failed
        for host in hosts:
            names = set(os.listdir(host.mountpoint))
            for index in range(8):
                assert f"before{index}" in names
            for name in names:  # whatever is there is what was stored under that name
                if name.endswith(".tmp"):  # (a store that failed: empty, or written whole)
                    assert _read(host.mountpoint / name) in (b"", content_of(name[:-4]))
                else:
                    assert _read(host.mountpoint / name) == content_of(name), name
        lost = [name for name, code in outcomes.items() if code == 0 and name not in names]
        print(f"failover: {len(outcomes)} stores, {len(failed)} EIO, {len(lost)} answered "
              f"but lost, stores again after {recovered:.1f} s")
        assert stats(hosts[0].mountpoint)["handler_errors"] == 0
        assert stats(hosts[0].mountpoint)["pool_lost"] is False
        assert_pool_counters_exact(hosts[0])
    finally:
        for host in hosts:
            host.unmount()
        sentinel.stop()
        replica.stop()
        master.stop()
