"""Kernel FUSE passthrough reads, and every way an open falls back to reads the daemon serves.

With passthrough the daemon verifies a blob whole before the kernel reads it by itself (when,
is the --verify mode's rule), buffered and O_DIRECT readers alike: `bytes_read` (bytes the
daemon served) stays 0 and `opens_passthrough` counts the opens. Fallbacks: passthrough turned
off, a daemon without CAP_SYS_ADMIN (run as another user), readers while a writer is open;
writers wait for passthrough readers (the kernel keeps one backing file per inode and accepts
no other open beside it).

Skipped where set-up could not build the passthrough pyfuse3 (it says so) or the kernel has no
FUSE passthrough.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    KvfsMount,
    assert_counters_exact,
    blob_files,
    drop_caches,
    resident_bytes,
    stats,
    wait_for,
)

MiB = 1 << 20
NOBODY = 65534



def errno_of(call, *args) -> int:
    with pytest.raises(OSError) as caught:
        call(*args)
    return caught.value.errno


@pytest.fixture
def passthrough(make_mount) -> KvfsMount:
    # The tests here count checks and opens exactly: no prefetch (tests/test_prefetch.py).
    kvfs = make_mount("--capacity", "1G", "--prefetch", "0")
    if stats(kvfs.mountpoint)["data_path"] != "passthrough":
        # The data path is decided at the kernel's INIT: look once a file was opened.
        (kvfs.mountpoint / "probe").write_bytes(b"p")
        (kvfs.mountpoint / "probe").read_bytes()
        (kvfs.mountpoint / "probe").unlink()
    if stats(kvfs.mountpoint)["data_path"] != "passthrough":
        pytest.skip("the kernel did not grant FUSE passthrough")
    return kvfs


def write_chunks(root: Path) -> dict[str, bytes]:
    payloads = {f"c{index}": os.urandom(32 * MiB + index) for index in range(3)}
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
    return payloads


def read_all(root: Path, payloads: dict[str, bytes], flags: int = 0) -> None:
    """Read every file whole, checking its bytes (O_DIRECT: into a page-aligned buffer)."""
    for name, payload in payloads.items():
        fd = os.open(root / name, os.O_RDONLY | flags)
        try:
            buffer = mmap.mmap(-1, len(payload) + 4096)
            assert os.readv(fd, [buffer]) == len(payload)
            assert buffer[:len(payload)] == payload
        finally:
            os.close(fd)


@pytest.mark.parametrize("flags", [0, os.O_DIRECT], ids=["buffered", "o_direct"])
def test_reads_bypass_the_daemon_and_files_are_verified_once_per_host(
        passthrough: KvfsMount, flags: int) -> None:
    """--verify once (the default): a file this host wrote and hashed is not read again
    before the kernel reads it, also after a clean remount; after a crash each is checked
    once, then trusted even when no longer in memory."""
    root = passthrough.mountpoint
    payloads = write_chunks(root)
    total = sum(map(len, payloads.values()))
    passthrough.remount()
    drop_caches()
    for _ in range(2):
        read_all(root, payloads, flags)
    shown = stats(root)
    assert (shown["data_path"], shown["verify"]) == ("passthrough", "once")
    assert shown["bytes_read"] == 0, "the daemon served no byte"
    assert shown["bytes_opened"] == 2 * total, "all were loaded"
    assert shown["opens_passthrough"] == 6 and shown["opens_daemon"] == 0
    assert shown["verified_bytes"] == 0 and shown["verifications_skipped"] == 6
    passthrough.kill9()  # the marks of what was checked do not outlive a crash
    passthrough.mount()
    drop_caches()
    for _ in range(2):
        read_all(root, payloads, flags)
        drop_caches()
    shown = stats(root)
    assert shown["verified_bytes"] == total, "checked once each after the crash"
    assert shown["verifications_skipped"] == 3
    assert_counters_exact(root, passthrough.data)


@pytest.mark.parametrize("flags", [0, os.O_DIRECT], ids=["buffered", "o_direct"])
def test_verify_open_checks_every_open_of_a_file_not_wholly_in_memory(
        make_mount, flags: int) -> None:
    """--verify open: a buffered open skips the check only while the checked pages are all
    in memory; an O_DIRECT reader reads the device, so each of its opens checks first (with
    O_DIRECT reads, leaving the page cache alone).

    What is in memory is measured before each open, not assumed: this VM's kernel pages
    out cold-looking memory on its own (DAMON's `pageout` scheme), a few pages of a chunk
    read a moment ago included, and such a chunk must be checked again."""
    kvfs = make_mount("--capacity", "1G", "--verify", "open", "--prefetch", "0")  # (as above)
    root = kvfs.mountpoint
    payloads = write_chunks(root)
    kvfs.remount()
    drop_caches()
    data_files = {len(payload): path for path in blob_files(kvfs)
                  for payload in payloads.values() if path.stat().st_size == len(payload)}
    checked_opens = checked_bytes = 0
    for _ in range(3):
        for name, payload in payloads.items():
            if flags or not wholly_in_memory(data_files[len(payload)]):
                checked_opens += 1
                checked_bytes += len(payload)
            read_all(root, {name: payload}, flags)
    shown = stats(root)
    if shown["data_path"] != "passthrough":
        pytest.skip("the kernel did not grant FUSE passthrough")
    assert shown["verify"] == "open" and shown["bytes_read"] == 0
    assert shown["opens_passthrough"] == 9 and shown["opens_daemon"] == 0
    assert shown["verified_bytes"] == checked_bytes
    assert shown["verifications_skipped"] == 9 - checked_opens
    # Every O_DIRECT open; the first buffered round, and then only a chunk paged out.
    assert (checked_opens == 9) if flags else (3 <= checked_opens < 9)
    if flags:
        assert all(resident_bytes(path) == 0 for path in blob_files(kvfs))
    else:
        drop_caches()  # evicted from memory: the next open verifies again
        read_all(root, {"c0": payloads["c0"]})
        assert stats(root)["verified_bytes"] == checked_bytes + len(payloads["c0"])
    assert_counters_exact(root, kvfs.data)


def wholly_in_memory(path: Path) -> bool:
    return resident_bytes(path) >= -(-path.stat().st_size // 4096) * 4096


def test_many_readers_of_one_chunk_share_one_backing_file(passthrough: KvfsMount) -> None:
    root = passthrough.mountpoint
    payload = os.urandom(32 * MiB)
    (root / "chunk").write_bytes(payload)
    # A kernel writer's sums are taken after its close: they are in the metadata first.
    assert wait_for(lambda: stats(root)["hashed_after_close"]
                    == stats(root)["write_opens_passthrough"])
    passthrough.kill9()  # unchecked on this host since (marks do not outlive a crash)
    passthrough.mount()
    drop_caches()
    results: list[bool] = []

    def reader() -> None:
        for _ in range(5):
            results.append((root / "chunk").read_bytes() == payload)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [True] * 40
    shown = stats(root)
    assert shown["opens_passthrough"] == 40 and shown["bytes_read"] == 0
    assert shown["verified_bytes"] == len(payload), "concurrent opens verified it once"


def test_damage_found_at_open_is_eio_and_drops_the_file(passthrough: KvfsMount) -> None:
    root = passthrough.mountpoint
    (root / "victim").write_bytes(os.urandom(5 * MiB))
    (root / "bystander").write_bytes(b"b" * MiB)
    victim_blob = max(blob_files(passthrough), key=lambda p: p.stat().st_size)
    passthrough.remount()
    with open(victim_blob, "r+b") as blob:
        blob.seek(4 * MiB + 7)
        blob.write(b"\xff")
    drop_caches()
    assert errno_of((root / "victim").read_bytes) == errno.EIO
    assert wait_for(lambda: not (root / "victim").exists())
    assert stats(root)["checksum_errors"] == 1
    assert (root / "bystander").read_bytes() == b"b" * MiB
    assert_counters_exact(root, passthrough.data)


def test_a_reader_while_a_writer_is_open_passes_through_on_a_kernel_inode_of_its_own(
        passthrough: KvfsMount) -> None:
    """Close-to-open isolation with passthrough on: a reader opened beside a writer is
    moved to a fresh kernel inode and passes through the committed blob there; once the
    writer closes, new readers read its version."""
    root = passthrough.mountpoint
    (root / "f").write_bytes(b"A" * MiB)
    with open(root / "f", "r+b", buffering=0) as writer:
        writer.write(b"B" * MiB)
        assert (root / "f").read_bytes() == b"A" * MiB
        assert stats(root)["opens_passthrough"] == 1
        assert stats(root)["opens_renewed"] == 1
    assert (root / "f").read_bytes() == b"B" * MiB
    assert stats(root)["opens_passthrough"] == 2
    assert stats(root)["opens_daemon"] == 0


WRITE_IN_ANOTHER_PROCESS = """
import sys, time
start = time.monotonic()
with open(sys.argv[1], "r+b", buffering=0) as writer:
    writer.write(sys.argv[2].encode() * int(sys.argv[3]))
print(time.monotonic() - start)
"""


def write_in_another_process(path: Path, letter: str, count: int) -> float:
    """Write `count` times `letter` at the start of `path` from another process; returns
    how long its open, write and close took."""
    result = subprocess.run([sys.executable, "-c", WRITE_IN_ANOTHER_PROCESS, str(path),
                             letter, str(count)], capture_output=True, text=True, check=True,
                            timeout=30)
    return float(result.stdout)


def test_a_writer_beside_passthrough_readers_opens_at_once(passthrough: KvfsMount) -> None:
    """A writer of a file that passthrough readers hold (in another process or its own)
    opens at once on a kernel inode of its own (kvfs/files/kernel_inodes.py), and the readers keep
    the version they opened, whole."""
    root = passthrough.mountpoint
    (root / "f").write_bytes(b"B" * MiB)
    with open(root / "f", "rb", buffering=0) as holder:
        assert write_in_another_process(root / "f", "C", MiB) < 1
        assert holder.read() == b"B" * MiB  # its version, whole
        started = time.monotonic()
        with open(root / "f", "r+b", buffering=0) as writer:  # this process: at once too
            writer.write(b"D")
        assert time.monotonic() - started < 1
    assert (root / "f").read_bytes() == b"D" + b"C" * (MiB - 1)
    assert_counters_exact(root, passthrough.data)


def test_a_file_open_for_passthrough_is_not_evicted(make_mount) -> None:
    kvfs = make_mount("--capacity", "64M")
    root = kvfs.mountpoint
    held = os.urandom(16 * MiB)
    (root / "held").write_bytes(held)
    with open(root / "held", "rb", buffering=0) as reader:
        first = reader.read(MiB)
        for index in range(8):  # 128 MiB through a 64 MiB pool
            (root / f"new{index}").write_bytes(os.urandom(16 * MiB))
        assert stats(root)["evictions"] >= 4
        assert first + reader.read() == held
    assert (root / "held").read_bytes() == held
    assert_counters_exact(root, kvfs.data)


def test_passthrough_turned_off_serves_every_read(make_mount) -> None:
    kvfs = make_mount("--capacity", "1G", "--passthrough", "off")
    root = kvfs.mountpoint
    payload = os.urandom(8 * MiB)
    (root / "f").write_bytes(payload)
    assert (root / "f").read_bytes() == payload
    shown = stats(root)
    assert shown["data_path"] == "daemon"
    assert (shown["opens_passthrough"], shown["opens_daemon"]) == (0, 1)
    assert shown["bytes_read"] == len(payload)
    kvfs.remount("--verify", "always")  # the same daemon-served path
    assert (root / "f").read_bytes() == payload
    assert stats(root)["data_path"] == "daemon"


@pytest.fixture
def fuse_for_everyone() -> Iterator[Path]:
    """/dev/fuse usable by other users (as Debian ships it), and a directory they reach."""
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    place = Path(tempfile.mkdtemp(prefix="kvfs-nonroot-", dir="/var/tmp"))
    place.chmod(0o755)
    try:
        yield place
    finally:
        os.chmod("/dev/fuse", mode)
        subprocess.run(["fusermount3", "-u", "-z", str(place / "mnt")], check=False)
        shutil.rmtree(place, ignore_errors=True)


def test_a_daemon_without_cap_sys_admin_falls_back(fuse_for_everyone: Path) -> None:
    """Registering a backing file needs CAP_SYS_ADMIN: a daemon run by another user mounts
    through fusermount3 and serves every read itself."""
    mountpoint, data = fuse_for_everyone / "mnt", fuse_for_everyone / "data"
    for path in (mountpoint, data):
        path.mkdir()
        os.chown(path, NOBODY, NOBODY)
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    mounted = subprocess.run([*as_nobody, sys.executable, str(Path(__file__).parent.parent /
                                                            "mount_kvfs.py"),
                              str(mountpoint), "--data", str(data), "--capacity", "64M"],
                             capture_output=True, text=True, timeout=60)
    assert mounted.returncode == 0, mounted.stderr
    pid = int((data / "kvfs.lock").read_text())
    try:
        script = ("import sys, pathlib; p = pathlib.Path(sys.argv[1]); "
                  "p.write_bytes(bytes(range(256)) * 12288); "
                  "assert p.read_bytes() == bytes(range(256)) * 12288")  # 3 MiB
        done = subprocess.run([*as_nobody, "/usr/bin/python3", "-c", script,
                               str(mountpoint / "f")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        shown = subprocess.run([*as_nobody, "cat", str(mountpoint / ".kvfs" / "stats")],
                               capture_output=True, text=True, check=True).stdout
        assert '"data_path": "daemon"' in shown
        assert f'"bytes_read": {3 * MiB}' in shown
        log = (data / "kvfs.log").read_text()
        assert "kvfs serves" in log and "Traceback" not in log
    finally:
        subprocess.run([*as_nobody, "fusermount3", "-u", str(mountpoint)], check=False)
        assert wait_for(lambda: not Path(f"/proc/{pid}").exists(), 20)


def test_a_reader_writer_and_late_reader_of_one_file_at_once(passthrough: KvfsMount) -> None:
    """A passthrough reader holds the file, a writer opens and writes, a late reader opens
    while the writer is open: none waits for another, and each sees a whole version."""
    root = passthrough.mountpoint
    (root / "f").write_bytes(b"A" * MiB)
    first = open(root / "f", "rb", buffering=0)
    outcomes: dict[str, object] = {}

    def write() -> None:
        with open(root / "f", "r+b", buffering=0) as writer:
            writer.write(b"B" * MiB)
            time.sleep(0.3)  # open while the late reader opens
        outcomes["writer"] = "done"

    def read_late() -> None:
        outcomes["reader"] = (root / "f").read_bytes()

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.2)  # the writer is open beside `first`
    late = threading.Thread(target=read_late)
    late.start()
    time.sleep(0.3)
    first.close()
    writer.join(10)
    late.join(10)
    assert outcomes["writer"] == "done"
    assert outcomes["reader"] in (b"A" * MiB, b"B" * MiB)  # a whole version, no EBUSY
    assert (root / "f").read_bytes() == b"B" * MiB
    assert_counters_exact(root, passthrough.data)
