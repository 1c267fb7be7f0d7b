"""Fixtures that mount real kvfs instances in temporary directories and always clean up."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lmcache_engines import Engines
from local_redis import LocalRedis

from kvfs.cli.fsck import recount
from kvfs.data.volume import Volume
from kvfs.fuse.keeper import socket_path

REPO = Path(__file__).resolve().parent.parent

MOUNT_SCRIPT = REPO / "mount_kvfs.py"
KVFS_CLI = Path(sys.executable).parent / "kvfs"  # the `kvfs` command of this environment


def kvfs_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVFS_CLI), *args], capture_output=True, text=True,
                          timeout=timeout)


# Options every test mount gets besides its own: scripts/test.sh runs part of the suite again
# with "--passthrough off", so that the path kernels without passthrough take cannot rot.
MOUNT_OPTIONS = os.environ.get("KVFS_TEST_MOUNT_OPTIONS", "").split()


def run_mount(mountpoint: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(MOUNT_SCRIPT), str(mountpoint), "--data", str(data), *extra,
         *MOUNT_OPTIONS],
        capture_output=True, text=True, timeout=60,
    )


def is_mounted(mountpoint: Path) -> bool:
    return any(line.split()[4] == str(mountpoint)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def daemon_pid(data: Path, mountpoint: Path | None = None) -> int:
    """The daemon serving `data` (in a shared pool: the one at `mountpoint`)."""
    if mountpoint is None:
        return int((data / "kvfs.lock").read_text().strip())
    return Volume(data).daemon_pid(mountpoint.resolve())


def helper_pid(daemon: int) -> int:
    """The daemon's volume helper process (kvfs/data/volume_helper.py)."""
    children = Path(f"/proc/{daemon}/task/{daemon}/children").read_text().split()
    (pid,) = [int(child) for child in children
              if b"kvfs.data.volume_helper" in Path(f"/proc/{child}/cmdline").read_bytes()]
    return pid


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def drop_caches() -> None:
    """Empty the page cache: blobs must be read (and verified) from the volume again."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def stats(mountpoint: Path) -> dict:
    return json.loads((mountpoint / ".kvfs" / "stats").read_text())


def counters_and_recount(mountpoint: Path, data: Path) -> tuple[tuple, tuple]:
    """The live mount's usage counters and what a recount of its metadata says (read from
    the metadata the daemon serves, read-only): they must always be equal."""
    shown = stats(mountpoint)
    volume = Volume(data)
    meta = volume.open_metadata(volume.shared_url(), readonly=True)
    try:
        used, files, models = recount(meta)
    finally:
        meta.close()
    return (shown["used_bytes"], shown["files"], shown["models"]), (used, files, models)


def assert_counters_exact(mountpoint: Path, data: Path) -> None:
    shown, counted = counters_and_recount(mountpoint, data)
    assert shown == counted, f"counters {shown} != recount {counted}"


def blob_files(volume: KvfsMount | Path) -> list[Path]:
    """The published data files of a kvfs volume; of a live mount's, once its publisher has
    moved every blob committed so far (a close leaves that to it: kvfs/files/writing.py)."""
    if isinstance(volume, KvfsMount) and volume.pid:
        assert wait_for(lambda: not stats(volume.mountpoint)["blobs_publishing"], 10)
    data = volume.data if isinstance(volume, KvfsMount) else volume
    return sorted(p for p in (data / "blobs").glob("*/*") if p.is_file())


@contextlib.contextmanager
def blob_shards_broken(data: Path) -> Iterator[None]:
    """Every shard of blobs/ that holds no data file yet replaced by a file: publishing a
    blob into one fails with ENOTDIR. Restored on exit."""
    in_use = {blob.parent for blob in blob_files(data)}
    broken = [shard for shard in sorted((data / "blobs").iterdir()) if shard not in in_use]
    for shard in broken:
        shard.rmdir()
        shard.write_bytes(b"")
    try:
        yield
    finally:
        for shard in broken:
            shard.unlink()
            shard.mkdir()


def blob_bytes_on_disk(data: Path) -> int:
    """What the published data files take on the volume; a file deleted between the listing
    and its stat (a reaper at work) counts nothing."""
    taken = 0
    for path in blob_files(data):
        with contextlib.suppress(FileNotFoundError):
            taken += path.stat().st_blocks * 512
    return taken


def resident_bytes(path: Path) -> int:
    """Bytes of a file in the page cache (fincore, from util-linux)."""
    shown = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                            str(path)], capture_output=True, text=True, check=True).stdout
    return int(shown.strip())


def allocated(path: Path) -> int:
    """Bytes a file takes on its volume, as kvfs counts them (no preallocation past EOF)."""
    st = path.stat()
    return min(st.st_blocks * 512, -(-st.st_size // 4096) * 4096)


def missing(path: Path) -> bool:
    """Whether a lookup of `path` (not followed) finds nothing (ENOENT; any other error
    raises)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return True
    return False


def wait_for(condition: Callable[[], bool], timeout: float = 20) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def assert_only_spares_staged(data: Path, *live: KvfsMount) -> None:
    """staging/ (every host's) holds nothing but the spares of the live mounts `live`
    (kvfs/files/spares.py): empty files, as many as their stats count; after unmount,
    nothing. Waited for: a mount counts a batch of spares once its volume helper has made
    it."""
    def leftover() -> list[str]:
        sizes = []
        for path in (data / "staging").rglob("*"):
            with contextlib.suppress(FileNotFoundError):  # (taken and published meanwhile)
                if path.is_file():
                    sizes.append((path, path.stat().st_size))
        written = [str(path) for path, size in sizes if size]
        empty = len(sizes) - len(written)
        spares = sum(stats(mount.mountpoint)["spare_staged_files"] for mount in live)
        return written + ([f"{empty} empty staged files, {spares} spares"]
                          if empty != spares else [])

    assert wait_for(lambda: not leftover(), 10), leftover()


def keeper_pid(mountpoint: Path) -> int:
    wanted = str(socket_path(mountpoint.resolve()))
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and wanted in (proc / "cmdline").read_text():
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no keeper of {mountpoint}")


def wait_dead(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


@dataclass
class KvfsMount:
    """One kvfs daemon serving `data` at `mountpoint`."""

    mountpoint: Path
    data: Path
    options: list[str] = field(default_factory=list)
    pid: int = 0

    def mount(self, *extra: str) -> None:
        result = run_mount(self.mountpoint, self.data, *self.options, *extra)
        assert result.returncode == 0, result.stderr
        self.pid = daemon_pid(self.data, self.mountpoint)

    def unmount(self) -> None:
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
        if self.pid:
            assert wait_dead(self.pid), f"kvfs daemon {self.pid} did not exit after unmount"
            self.pid = 0

    def remount(self, *extra: str) -> None:
        self.unmount()
        self.mount(*extra)

    def kill9(self) -> None:
        """Crash the daemon and its keeper (kvfs/fuse/keeper.py: alone, the daemon's death
        makes requests wait for a successor), then clear the dead mount as an operator
        would."""
        keeper = keeper_pid(self.mountpoint)
        os.kill(keeper, signal.SIGKILL)
        os.kill(self.pid, signal.SIGKILL)
        assert wait_dead(self.pid) and wait_dead(keeper)
        self.pid = 0
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)

    def cleanup(self) -> None:
        if self.pid and pid_alive(self.pid):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)
            if not wait_dead(self.pid, 10):
                os.kill(self.pid, signal.SIGKILL)
                wait_dead(self.pid)
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False)


@pytest.fixture(scope="session", autouse=True)
def runtime_directory() -> Iterator[Path]:
    """A kvfs runtime directory (change logs, lock tables, keepers' sockets) of this run's
    own, for every process the tests start; removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="kvfs-run-"))
    os.environ["KVFS_RUNTIME_DIR"] = str(path)
    yield path
    del os.environ["KVFS_RUNTIME_DIR"]
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp dirs are root-only). Request it
    before make_mount, so that the mount inside is gone before the directory is removed."""
    path = Path(tempfile.mkdtemp(prefix="kvfs-perm-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator:
    """Factory: make_mount(*options) mounts a fresh kvfs (its mountpoint in `where`, default
    the test's tmp_path); all are unmounted at teardown."""
    mounts: list[KvfsMount] = []

    def factory(*options: str, data: Path | None = None, mount: bool = True,
                where: Path | None = None) -> KvfsMount:
        index = len(mounts)
        mountpoint = (where or tmp_path) / f"mnt{index}"
        mountpoint.mkdir()
        kvfs = KvfsMount(mountpoint, data or tmp_path / f"data{index}", list(options))
        mounts.append(kvfs)
        if mount:
            kvfs.mount()
        return kvfs

    yield factory
    for kvfs in mounts:
        kvfs.cleanup()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedis]:
    """A redis-server of the test's own (AOF on, a free port), stopped at teardown."""
    server = LocalRedis(tmp_path / "redis").start()
    yield server
    server.stop()


SESSION_TTL = "1"  # seconds: dead hosts are cleaned up after within a few


@pytest.fixture
def shared_pool(redis_server: LocalRedis, make_mount, tmp_path: Path) -> Callable[..., list]:
    """Factory: shared_pool(hosts, *options) mounts `hosts` kvfs daemons ("hosts") over one
    data directory and the test's Redis; all are unmounted at teardown (before Redis stops:
    this fixture asks for redis_server first)."""
    def factory(hosts: int, *options: str) -> list[KvfsMount]:
        return [make_mount("--meta", redis_server.url, "--session-ttl", SESSION_TTL, *options,
                           data=tmp_path / "pool") for _ in range(hosts)]
    return factory


@pytest.fixture
def engines() -> Iterator[Engines]:
    started = Engines()
    yield started
    started.cleanup()


@pytest.fixture
def kvfs(make_mount) -> KvfsMount:
    """A freshly mounted kvfs on an empty data directory (1 GiB capacity)."""
    return make_mount("--capacity", "1G")
