"""FUSE over io_uring: requests answered on the caller's CPU (those that must wait finish on
the loop), and the mount behaving exactly as over /dev/fuse.

The kernel offers io_uring to FUSE only where the fuse module's `enable_uring` is on; these
tests turn it on for their own mounts and put it back after.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyfuse3
import pytest
from conftest import KvfsMount, assert_counters_exact, drop_caches, stats

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
SHELL_SECONDS = 30  # a request that never comes back fails the test instead of hanging it


@pytest.fixture
def uring(make_mount) -> Iterator[KvfsMount]:
    """A kvfs mount whose requests come over io_uring."""
    if not getattr(pyfuse3, "IO_URING", False):
        pytest.skip("pyfuse3 without kvfs's io_uring patch (scripts/build_passthrough.sh)")
    if not ENABLE_URING.exists():
        pytest.skip("this kernel's FUSE has no io_uring (CONFIG_FUSE_IO_URING)")
    before = ENABLE_URING.read_text().strip()
    ENABLE_URING.write_text("Y")
    try:
        mount = make_mount("--capacity", "1G", "--io-uring", "on")
        assert "requests: FUSE over io_uring asked for" in (mount.data / "kvfs.log").read_text()
        yield mount
    finally:
        ENABLE_URING.write_text(before)


def shell(command: str, cwd: Path) -> str:
    return subprocess.run(["bash", "-ec", command], cwd=cwd, capture_output=True, text=True,
                          check=True, timeout=SHELL_SECONDS).stdout


def stat_on(cpu: int, paths: list[Path]) -> list[tuple[int, int, int] | int]:
    """(ino, mode, size) of each path, or its errno, stat()ed from a process on `cpu`."""
    code = ("import os, sys\n"
            f"os.sched_setaffinity(0, {{{cpu}}})\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n"
            "        s = os.stat(path)\n"
            "        print(s.st_ino, s.st_mode, s.st_size)\n"
            "    except OSError as error:\n"
            "        print(error.errno)\n")
    out = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True,
                         text=True, check=True, timeout=SHELL_SECONDS).stdout
    return [tuple(map(int, line.split())) if " " in line else int(line)
            for line in out.splitlines()]


def test_lookups_and_getattrs_are_answered_on_the_callers_cpu(uring: KvfsMount) -> None:
    root = uring.mountpoint
    shell("mkdir -p a/b && printf hello > a/b/one && head -c 70000 /dev/zero > a/two", root)
    paths = [root / "a", root / "a/b", root / "a/b/one", root / "a/two", root / "a/missing"]
    expected = [(os.stat(p).st_ino, os.stat(p).st_mode, os.stat(p).st_size)
                for p in paths[:-1]] + [errno.ENOENT]
    def off_the_loop() -> int:
        # (a/missing: a miss in a directory made since the mount, which the patched pyfuse3
        # answers itself, here on the queue thread too)
        counters = stats(root)
        return counters["answered_on_caller_cpu"] + counters["missing_names_answered"]

    for cpu in sorted(os.sched_getaffinity(0)):
        drop_caches()  # the kernel asks again
        before = off_the_loop()
        assert stat_on(cpu, paths) == expected
        # Each stat looks up at least its last name; none went to the loop.
        assert off_the_loop() - before >= len(paths)


def test_every_request_works_over_io_uring_as_on_a_plain_directory(uring: KvfsMount,
                                                                     tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    script = ("mkdir -p d/e && head -c 300000 /dev/urandom > d/blob && cp d/blob d/e/copy && "
              "printf abc > d/small && mv d/small d/e/moved && ln -s e/moved d/link && "
              "truncate -s 1000 d/e/copy && printf more >> d/e/moved && rm d/blob && "
              "touch d/x d/y && mkdir d/gone && rmdir d/gone")
    listing = ("find d -printf '%p %y\\n' | sort && find d -type f -printf '%p %s\\n' | sort && "
               "cat d/e/moved && readlink d/link && md5sum d/e/copy | cut -c1-32")
    shell("head -c 300000 /dev/urandom > seed", tmp_path)  # the same random bytes both sides
    for root in (plain, uring.mountpoint):
        shell(script.replace("/dev/urandom", str(tmp_path / "seed")), root)
        os.setxattr(root / "d/x", "user.k", b"v")
    drop_caches()
    assert shell(listing, uring.mountpoint) == shell(listing, plain)
    tools = "ls -l d | wc -l && du --apparent-size -b d/e/* | sort"  # (directories' sizes differ)
    assert shell(tools, uring.mountpoint) == shell(tools, plain)
    assert os.getxattr(uring.mountpoint / "d/x", "user.k") == b"v"
    assert stats(uring.mountpoint)["handler_errors"] == 0
    assert_counters_exact(uring.mountpoint, uring.data)


STORE_CODE = """
import hashlib, os, sys, threading
directory, cpu = sys.argv[1], sys.argv[5]
count, size, threads = map(int, sys.argv[2:5])
if cpu != "any":
    os.sched_setaffinity(0, {int(cpu)})
def store(worker):
    for number in range(worker, count, threads):
        dest = os.path.join(directory, f"{number:08d}.bin")
        if os.path.exists(dest):
            continue
        payload = hashlib.sha256(str(number).encode()).digest() * (size // 32)
        fd = os.open(f"{dest}.{worker}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        os.replace(f"{dest}.{worker}.tmp", dest)
workers = [threading.Thread(target=store, args=(i,)) for i in range(threads)]
for worker in workers:
    worker.start()
for worker in workers:
    worker.join()
"""


def store_files(directory: Path, count: int, size: int, threads: int = 1,
                cpu: int | None = None) -> None:
    """vLLM's tier's store of `count` files of `size` bytes (exists, O_EXCL temporary, write,
    close, rename) from `threads` threads of one process, on `cpu` if given."""
    subprocess.run([sys.executable, "-c", STORE_CODE, str(directory), str(count), str(size),
                    str(threads), "any" if cpu is None else str(cpu)],
                   check=True, timeout=SHELL_SECONDS)


def assert_stored(directory: Path, count: int, size: int) -> None:
    names = sorted(p.name for p in directory.iterdir())
    assert names == [f"{number:08d}.bin" for number in range(count)]  # (no temporary left)
    for number in range(count):
        payload = hashlib.sha256(str(number).encode()).digest() * (size // 32)
        assert (directory / f"{number:08d}.bin").read_bytes() == payload


def test_stores_are_answered_on_the_callers_cpu(uring: KvfsMount) -> None:
    """A store's create, flush, release and rename run on the queue thread of the caller's
    CPU: none of them has to wait for anything."""
    stores = 50
    for cpu in sorted(os.sched_getaffinity(0)):
        directory = uring.mountpoint / f"cpu{cpu}"
        directory.mkdir()
        before = stats(uring.mountpoint)["answered_on_caller_cpu"]
        store_files(directory, stores, 4096, cpu=cpu)
        # (and counted once each: a few lookups or getattrs of the directory may come too)
        answered = stats(uring.mountpoint)["answered_on_caller_cpu"] - before
        assert 4 * stores <= answered < 5 * stores
        drop_caches()
        assert_stored(directory, stores, 4096)
    assert stats(uring.mountpoint)["handler_errors"] == 0
    assert_counters_exact(uring.mountpoint, uring.data)


def test_handlers_that_wait_finish_on_the_loop_beside_queue_threads(make_mount) -> None:
    """With --fsync every close waits for a worker thread's sync: its handler moves from
    the queue thread to the loop, which answers it while sixteen writers on every CPU keep
    the queue threads busy (and waiting for the loop's lock). Nothing hangs, nothing is
    lost, the counters are exact."""
    if not getattr(pyfuse3, "IO_URING", False) or not ENABLE_URING.exists():
        pytest.skip("no FUSE over io_uring here (see the `uring` fixture)")
    before = ENABLE_URING.read_text().strip()
    ENABLE_URING.write_text("Y")
    try:
        mount = make_mount("--capacity", "1G", "--io-uring", "on", "--fsync")
        directory = mount.mountpoint / "d"
        directory.mkdir()
        store_files(directory, 640, 65536, threads=16)
        drop_caches()
        assert_stored(directory, 640, 65536)
        counters = stats(mount.mountpoint)
        assert counters["handler_errors"] == 0
        assert counters["commits"] == 640
        assert_counters_exact(mount.mountpoint, mount.data)
    finally:
        ENABLE_URING.write_text(before)
