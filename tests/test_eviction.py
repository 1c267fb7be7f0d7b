"""One capacity for the whole mount: LRU eviction, pins, shrinking, small volumes."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_for

MiB = 1 << 20

# A writer process: writes files whose bytes are derived from their names, one write each.
WRITER = """
import random, sys
from pathlib import Path
directory, prefix, count, size = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for index in range(count):
    name = f"{prefix}-{index:04d}.data"
    (directory / name).write_bytes(random.Random(name).randbytes(size))
"""

# A reader process: keeps opening and reading one file until told to stop.
READER = """
import sys, time
from pathlib import Path
path, stop = Path(sys.argv[1]), Path(sys.argv[2])
reads = 0
while not stop.exists():
    path.read_bytes()
    reads += 1
    time.sleep(0.01)
print(reads)
"""


def content(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def write_named(directory: Path, name: str, size: int) -> None:
    (directory / name).write_bytes(content(name, size))


def intact(path: Path) -> bool:
    return path.read_bytes() == content(path.name, path.stat().st_size)


def used_bytes(mountpoint: Path) -> int:
    info = os.statvfs(mountpoint)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def capacity_bytes(mountpoint: Path) -> int:
    info = os.statvfs(mountpoint)
    return info.f_blocks * info.f_frsize


def blob_bytes(data: Path) -> int:
    return sum(path.stat().st_size for path in (data / "blobs").glob("*/*"))


def settle(mountpoint: Path) -> None:
    """Wait until background eviction is done: usage under the high watermark and no longer
    falling (it runs every 0.25 s and evicts down to the low watermark file by file, so usage
    under the high one alone can come in the middle of it)."""
    deadline = time.monotonic() + 10
    last = -1
    while time.monotonic() < deadline:
        used = used_bytes(mountpoint)
        if used <= 0.95 * capacity_bytes(mountpoint) and used == last:
            return
        last = used
        time.sleep(0.5)


class UsageSampler(threading.Thread):
    """Samples the mount's used bytes (as df sees them) until stopped."""

    def __init__(self, mountpoint: Path) -> None:
        super().__init__(daemon=True)
        self.mountpoint = mountpoint
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append(used_bytes(self.mountpoint))
            time.sleep(0.005)

    def stop(self) -> list[int]:
        self.done.set()
        self.join()
        return self.samples


def test_concurrent_writers_past_capacity_evict_lru_and_keep_hot_and_pinned(
        make_mount, tmp_path: Path) -> None:
    capacity = 64 * MiB
    kvfs = make_mount("--capacity", "64M")
    root = kvfs.mountpoint
    (root / "system").mkdir()
    os.setxattr(root / "system", "user.kvfs.pin", b"1")
    write_named(root / "system", "prompt.data", 8 * MiB)
    (root / "cache").mkdir()
    for index in range(4):
        write_named(root / "cache", f"old-{index}.data", 4 * MiB)
    write_named(root / "cache", "hot.data", 4 * MiB)
    stop = tmp_path / "stop-reader"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(root / "cache" / "hot.data"),
                               str(stop)], stdout=subprocess.PIPE, text=True)
    sampler = UsageSampler(root)
    sampler.start()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(root / "cache"), f"w{n}",
                                 "12", str(4 * MiB)]) for n in range(3)]
    try:
        codes = [writer.wait(timeout=300) for writer in writers]
    finally:
        stop.touch()
        reads = int(reader.communicate(timeout=30)[0])
        samples = sampler.stop()
    assert codes == [0, 0, 0], "every write must succeed"
    assert reads > 0
    assert max(samples) <= capacity, f"usage passed the capacity: {max(samples)}"
    settle(root)
    names = set(os.listdir(root / "cache"))
    assert not any(name.startswith("old-") for name in names), "oldest unread go first"
    assert "hot.data" in names
    assert intact(root / "system" / "prompt.data")
    survivors = [root / "cache" / name for name in names]
    assert len(survivors) >= 8
    assert all(intact(path) for path in survivors)
    meta_bytes = sum(path.stat().st_size for path in (kvfs.data / "meta").iterdir())
    assert blob_bytes(kvfs.data) <= capacity + meta_bytes
    assert used_bytes(root) == blob_bytes(kvfs.data)


def test_pins_alone_filling_capacity_give_enospc_until_unpinned(make_mount) -> None:
    kvfs = make_mount("--capacity", "16M")
    root = kvfs.mountpoint
    (root / "pinned").mkdir()
    os.setxattr(root / "pinned", "user.kvfs.pin", b"1")
    for index in range(3):
        write_named(root / "pinned", f"p{index}.data", 4 * MiB)
    fd = os.open(root / "new.data", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as full:
            for _ in range(8):
                os.write(fd, b"x" * MiB)
        assert full.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert sorted(os.listdir(root / "pinned")) == ["p0.data", "p1.data", "p2.data"]
    subprocess.run([Path(sys.executable).parent / "kvfs", "unpin", str(root / "pinned")],
                   check=True)
    write_named(root, "after.data", 8 * MiB)  # room is made by evicting the unpinned files
    assert intact(root / "after.data")
    assert used_bytes(root) <= 16 * MiB


def test_capacity_shrink_at_remount_keeps_recent_and_pinned(make_mount) -> None:
    kvfs = make_mount("--capacity", "64M")
    root = kvfs.mountpoint
    write_named(root, "pinned.data", 4 * MiB)
    os.setxattr(root / "pinned.data", "user.kvfs.pin", b"1")
    for index in range(10):
        write_named(root, f"f{index}.data", 4 * MiB)
    (root / "f0.data").read_bytes()  # f0 becomes the most recently used
    time.sleep(1.5)  # let the daemon flush recorded uses
    kvfs.remount("--capacity", "20M")
    assert capacity_bytes(root) == 20 * MiB
    assert used_bytes(root) <= 20 * MiB
    names = set(os.listdir(root))
    assert {"pinned.data", "f0.data", "f9.data"} <= names
    assert "f1.data" not in names
    assert all(intact(root / name) for name in names)
    kvfs.options = []
    kvfs.remount()
    assert capacity_bytes(root) == 20 * MiB, "the capacity is kept across mounts"


@pytest.fixture
def small_volume(tmp_path: Path):
    volume = tmp_path / "small-volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(volume)], check=True)
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=False)


def test_volume_smaller_than_capacity(make_mount, small_volume: Path) -> None:
    kvfs = make_mount("--capacity", "1G", data=small_volume / "kvfs")
    root = kvfs.mountpoint
    assert capacity_bytes(root) < 48 * MiB
    for index in range(20):  # 80 MiB through a 48 MiB volume
        write_named(root, f"f{index:02d}.data", 4 * MiB)
        # The capacity is what the volume holds: its metadata and change log growing take
        # room from it between two statfs, and the background trim (every 0.25 s) evicts
        # back under it.
        assert wait_for(lambda: used_bytes(root) <= capacity_bytes(root), 2)
    settle(root)
    names = sorted(os.listdir(root))
    assert "f19.data" in names and "f00.data" not in names
    assert all(intact(root / name) for name in names)


def test_a_listing_the_kernel_keeps_loses_what_eviction_removes(make_mount) -> None:
    """The kernel caches directory listings (kvfs reads directories without OPENDIR); files
    the daemon evicts on its own must leave the listing at once, as their names do."""
    kvfs = make_mount("--capacity", "32M")
    root = kvfs.mountpoint
    (root / "old").mkdir()
    (root / "new").mkdir()
    for index in range(4):
        write_named(root / "old", f"o{index}.data", 4 * MiB)
    held = os.open(root / "old", os.O_RDONLY | os.O_DIRECTORY)  # keeps its cached listing
    try:
        listed = sorted(os.listdir(root / "old"))
        # ... but not its entries (dentries and inodes dropped, page cache kept): invalidating
        # a name alone cannot reach the listing then.
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        for index in range(6):  # into another directory: the kernel sees nothing change "old"
            write_named(root / "new", f"n{index}.data", 4 * MiB)
        settle(root)
        remaining = sorted(os.listdir(root / "old"))
    finally:
        os.close(held)
    assert len(remaining) < len(listed), "eviction took files of the old directory"
    assert remaining == sorted(name for name in listed if (root / "old" / name).exists())
    assert all(intact(root / "old" / name) for name in remaining)
