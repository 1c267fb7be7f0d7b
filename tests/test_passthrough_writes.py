"""Passthrough writes: the maker of a new file, alone on it, writes through the kernel straight
into its staged blob; the close commits it, and its block sums are taken right after (in the
background, or by the first open), or at the next mount if a crash came first.

Each test checks the bytes through the mount, after a remount with the page cache dropped (so
the checksums taken after close are verified against the volume), and the counters against a
recount. Pools under 4 GiB keep daemon-served writes (accounted write by write); the fixture
here has 8 GiB. Skipped where passthrough is not available (see test_passthrough.py).
"""

from __future__ import annotations

import errno
import mmap
import multiprocessing
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
from conftest import (
    KvfsMount,
    assert_counters_exact,
    assert_only_spares_staged,
    blob_files,
    blob_shards_broken,
    drop_caches,
    helper_pid,
    stats,
    wait_dead,
    wait_for,
)
from test_crash import fsck_clean
from test_passthrough import errno_of, read_all

from kvfs.engines.lmdb_engine import LmdbEngine
from kvfs.meta import DEFAULT_MAP_SIZE, FAMILIES
from kvfs.records import SUMS_PENDING

MiB = 1 << 20



@pytest.fixture
def roomy(make_mount) -> KvfsMount:
    return passthrough_mount(make_mount)


def passthrough_mount(make_mount, *options: str) -> KvfsMount:
    kvfs = make_mount("--capacity", "8G", *options)
    (kvfs.mountpoint / "probe").write_bytes(b"p")
    if stats(kvfs.mountpoint)["data_path"] != "passthrough":
        pytest.skip("the kernel did not grant FUSE passthrough")
    (kvfs.mountpoint / "probe").unlink()
    kvfs.remount()  # counters from zero
    return kvfs


def verified_after_remount(kvfs: KvfsMount, expected: dict[str, bytes]) -> None:
    """Every file reads back whole after a remount with cold caches, each checked against
    the sums taken after its close (--verify open checks every open of a file not in
    memory)."""
    kvfs.remount("--verify", "open")
    drop_caches()
    for name, payload in expected.items():
        assert (kvfs.mountpoint / name).read_bytes() == payload, name
    shown = stats(kvfs.mountpoint)
    assert shown["checksum_errors"] == 0
    assert shown["verified_bytes"] >= sum(map(len, expected.values()))
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_new_files_are_written_by_the_kernel(roomy: KvfsMount) -> None:
    root = roomy.mountpoint
    payloads = {"chunk": os.urandom(32 * MiB), "odd": os.urandom(3 * MiB + 17), "empty": b""}
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
        assert (root / name).stat().st_size == len(payload)
        assert (root / name).read_bytes() == payload
    shown = stats(root)
    assert shown["write_opens_passthrough"] == 3 and shown["write_opens_daemon"] == 0
    assert shown["bytes_written"] == 0, "no byte crossed the daemon"
    assert shown["bytes_committed"] == sum(map(len, payloads.values())), "all were stored"
    assert shown["commits"] == 2, "a file created and closed unwritten commits nothing"
    assert_counters_exact(root, roomy.data)
    verified_after_remount(roomy, payloads)


def getxattr_requests(root: Path) -> int:
    """GETXATTRs the kernel sent: those the loop answered and those of names outside user.*
    that the binding answered before it."""
    shown = stats(root)
    return shown["requests"].get("getxattr", {}).get("count", 0) + shown["foreign_xattrs_refused"]


def test_a_file_written_in_many_writes_asks_for_its_capabilities_once(
        roomy: KvfsMount) -> None:
    """The kernel asks the daemon for security.capability before a write() unless the inode
    is marked as having none (S_NOSEC): kvfs clears setuid/setgid itself (handle_killpriv_v2),
    so the mark sticks and a file written in 64 writes costs one GETXATTR, not 64."""
    root = roomy.mountpoint
    payload = os.urandom(4 * MiB)
    before = getxattr_requests(root)
    fd = os.open(root / "chunk", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for offset in range(0, len(payload), 64 * 1024):
            assert os.write(fd, payload[offset:offset + 64 * 1024]) == 64 * 1024
    finally:
        os.close(fd)
    assert getxattr_requests(root) - before == 1
    assert (root / "chunk").read_bytes() == payload
    assert stats(root)["write_opens_passthrough"] == 1


def test_lmcache_temp_and_rename_and_rewrite(roomy: KvfsMount) -> None:
    """The maker of `<key>.tmp` writes through the kernel, and so does a rewriter of the
    existing file that is alone on it."""
    root = roomy.mountpoint
    first, second = os.urandom(8 * MiB), os.urandom(5 * MiB)
    (root / "key.tmp").write_bytes(first)
    os.rename(root / "key.tmp", root / "key.data")
    with open(root / "key.data", "wb", buffering=0) as writer:  # O_TRUNC of an existing file
        writer.write(second)
    shown = stats(root)
    assert (shown["write_opens_passthrough"], shown["write_opens_daemon"]) == (2, 0)
    assert (root / "key.data").read_bytes() == second
    verified_after_remount(roomy, {"key.data": second})


def test_rewrites_and_appends_of_existing_files_are_written_by_the_kernel(
        roomy: KvfsMount) -> None:
    """A write-only writer of an existing file writes through the kernel into a copy of
    the committed content; other handles see it after its close. A read-write rewriter
    (which could map the file) is served by the daemon, and reads its own writes."""
    root = roomy.mountpoint
    base = os.urandom(3 * MiB + 5)
    (root / "f").write_bytes(base)
    rewriter = os.open(root / "f", os.O_WRONLY)
    try:
        os.pwrite(rewriter, b"R" * 100, MiB + 1)
    finally:
        os.close(rewriter)
    with open(root / "f", "ab", buffering=0) as appender:
        appender.write(b"A" * 7)
    expected = base[:MiB + 1] + b"R" * 100 + base[MiB + 101:] + b"A" * 7
    assert (root / "f").read_bytes() == expected
    shown = stats(root)
    assert (shown["write_opens_passthrough"], shown["write_opens_daemon"]) == (3, 0)
    assert shown["bytes_written"] == 0, "no byte crossed the daemon"
    with open(root / "f", "r+b", buffering=0) as both:
        both.seek(5)
        both.write(b"W" * 10)
        both.seek(0)
        assert both.read(20) == expected[:5] + b"W" * 10 + expected[15:20]
    expected = expected[:5] + b"W" * 10 + expected[15:]
    assert stats(root)["write_opens_daemon"] == 1
    verified_after_remount(roomy, {"f": expected})


def test_shared_writable_mmap_is_read_back_by_another_process(roomy: KvfsMount) -> None:
    root = roomy.mountpoint
    (root / "m").write_bytes(bytes(2 * MiB))
    with open(root / "m", "r+b") as file, mmap.mmap(file.fileno(), 2 * MiB) as mapped:
        mapped[MiB:MiB + 5] = b"hello"  # MAP_SHARED, PROT_WRITE
        mapped.flush()
    script = "import sys; d = open(sys.argv[1], 'rb').read(); print(len(d), d[1 << 20:][:5])"
    shown = subprocess.run([sys.executable, "-c", script, str(root / "m")],
                           capture_output=True, text=True, check=True).stdout
    assert shown.split() == [str(2 * MiB), "b'hello'"]
    verified_after_remount(roomy, {"m": bytes(MiB) + b"hello" + bytes(MiB - 5)})


def test_appends_and_truncates_through_a_kernel_writer(roomy: KvfsMount) -> None:
    root = roomy.mountpoint
    fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, b"a" * MiB)
        os.write(fd, b"b" * MiB)
        os.ftruncate(fd, MiB + 10)  # the daemon's truncate sees the kernel's writes
        os.write(fd, b"c" * 5)  # appended at the new end
    finally:
        os.close(fd)
    expected = b"a" * MiB + b"b" * 10 + b"c" * 5
    assert (root / "f").read_bytes() == expected
    assert stats(root)["write_opens_passthrough"] == 1
    verified_after_remount(roomy, {"f": expected})


def test_writes_after_a_flush_are_committed_anew(roomy: KvfsMount) -> None:
    """close() of a duplicate commits; the kernel may write on through the other descriptor
    into the blob just committed: those writes become a new version at the next flush."""
    root = roomy.mountpoint
    fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"1" * (2 * MiB))
        os.close(os.dup(fd))  # flush: the first version is committed
        assert (root / "f").stat().st_size == 2 * MiB
        os.pwrite(fd, b"2" * 100, 5)  # same size: only the contents change
        os.write(fd, b"3" * MiB)
    finally:
        os.close(fd)
    expected = b"1" * 5 + b"2" * 100 + b"1" * (2 * MiB - 105) + b"3" * MiB
    assert (root / "f").read_bytes() == expected
    assert stats(root)["commits"] == 2
    verified_after_remount(roomy, {"f": expected})


def test_a_syncing_close_leaves_the_publishing_to_the_background(make_mount) -> None:
    """With --fsync (as on a shared pool, where a rename on the volume is a round trip) a
    kernel-written file's close commits it and leaves the move into blobs/ to a background
    publisher: readers find the blob in staging/ meanwhile, writes after a flush still
    become a new version, and a publishing that fails fails no close (counted, logged), while
    the release or the next mount's recovery publishes it."""
    kvfs = make_mount("--capacity", "8G", "--fsync")
    root = kvfs.mountpoint
    (root / "probe").write_bytes(b"p")
    if stats(root)["data_path"] != "passthrough":
        pytest.skip("the kernel did not grant FUSE passthrough")
    expected = {"probe": b"p"}
    for index in range(32):  # vLLM's tier: temporary name, one write, close, rename
        payload = os.urandom(4096)
        fd = os.open(root / f"b{index}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, payload)
        os.close(fd)
        os.replace(root / f"b{index}.tmp", root / f"b{index}")
        assert (root / f"b{index}").read_bytes() == payload
        expected[f"b{index}"] = payload
    fd = os.open(root / "f", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"1" * MiB)
        os.close(os.dup(fd))  # committed; its publishing may still be under way
        os.pwrite(fd, b"2" * 100, 5)
    finally:
        os.close(fd)
    expected["f"] = b"1" * 5 + b"2" * 100 + b"1" * (MiB - 105)
    assert (root / "f").read_bytes() == expected["f"]
    assert_only_spares_staged(kvfs.data, kvfs)
    assert len(blob_files(kvfs)) == len(expected)
    with blob_shards_broken(kvfs.data):
        for index in range(8):
            (root / f"late{index}").write_bytes(f"late {index}".encode())  # closes succeed
            expected[f"late{index}"] = f"late {index}".encode()
        assert wait_for(lambda: stats(root)["volume_errors"] >= 1)
        for name, payload in expected.items():
            assert (root / name).read_bytes() == payload, name
        assert_counters_exact(root, kvfs.data)
    kvfs.remount()  # recovery publishes what the publisher could not
    assert_only_spares_staged(kvfs.data, kvfs)
    for name, payload in expected.items():
        assert (root / name).read_bytes() == payload, name
    assert stats(root)["handler_errors"] == 0
    kvfs.unmount()
    fsck_clean(kvfs)


def read_in_another_process(path: Path) -> tuple[bytes, float, float]:
    """What another process reads of `path`, how long its open and read took, and when
    (time.monotonic(), one clock for every process) they ended."""
    result = subprocess.run(
        [sys.executable, "-c", "import sys, time; start = time.monotonic(); "
         "data = open(sys.argv[1], 'rb').read(); end = time.monotonic(); "
         "sys.stdout.write(f'{end - start} {end} {data.hex()}')", str(path)],
        capture_output=True, text=True, check=True, timeout=30)
    seconds, ended, data = result.stdout.split(" ")
    return bytes.fromhex(data), float(seconds), float(ended)


def test_opens_beside_a_kernel_writer_pass_through_at_once(roomy: KvfsMount) -> None:
    """The kernel writes into the maker's staged file. Another open of the file, in another
    process or the maker's own, is answered at once on a kernel inode of its own
    (kvfs/files/kernel_inodes.py): a reader passes through the committed version, a second
    writer writes its own copy; never EBUSY, never a wait."""
    root = roomy.mountpoint
    (root / "g").write_bytes(b"0")
    with open(root / "g", "wb", buffering=0) as maker:
        maker.write(b"x")
        started = time.monotonic()
        assert (root / "g").read_bytes() == b"0"  # this process: the committed file
        # The child's copy of the maker's descriptor closes at its exec: that close flushes
        # (commits) the maker's "x", as every close does.
        read, seconds, _ = read_in_another_process(root / "g")
        assert read == b"x" and seconds < 1
        with open(root / "g", "r+b", buffering=0) as second:
            second.write(b"yz")
        assert time.monotonic() - started < 5
        assert (root / "g").read_bytes() == b"yz"
    assert (root / "g").read_bytes() == b"x"  # the maker closed last: its version
    shown = stats(root)
    assert shown["opens_passthrough"] == 4 and shown["opens_daemon"] == 0
    assert shown["write_opens_passthrough"] == 2 and shown["write_opens_daemon"] == 1
    assert_counters_exact(root, roomy.data)


def test_two_writers_in_one_process_as_on_ext4(roomy: KvfsMount, tmp_path: Path) -> None:
    """open(O_WRONLY|O_CREAT|O_TRUNC) twice in one process: both open at once, each writes,
    and the file is whole after both close (kvfs: the last to close; ext4: shared bytes)."""
    for root in (roomy.mountpoint, tmp_path):
        started = time.monotonic()
        first = os.open(root / "h", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        second = os.open(root / "h", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        assert time.monotonic() - started < 1
        os.write(first, b"a" * 100)
        os.write(second, b"b" * 100)
        os.close(first)
        os.close(second)
        assert (root / "h").read_bytes() == b"b" * 100


def rewrite_head(path: str, seconds: float, results: multiprocessing.Queue) -> None:
    """Rewrite the first 4 KiB of `path` (open, pwrite, close) until `seconds` pass; puts
    each error met and, last, how many rewrites were made."""
    deadline = time.monotonic() + seconds
    made = 0
    while time.monotonic() < deadline:
        try:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes([made % 251]) * 4096, 0)
            finally:
                os.close(fd)
            made += 1
        except OSError as error:
            results.put(f"{error.strerror} ({error.filename or 'write/close'})")
    results.put(made)


def test_rewriters_racing_for_one_file_never_see_eio(kvfs: KvfsMount) -> None:
    """Eight processes rewrite the head of one 1 MiB file at once. A rewriter's open that
    may go to passthrough awaits (its copy of the rest, its room); an open answered meanwhile
    is served by the daemon without a backing file, and the kernel fails such an open (EIO)
    once the inode has one: the first must then be served too. (The kernel's side of the
    race is narrow: this catches the old bug only in some runs; the shared-pool churn test
    is the other net.)"""
    path = kvfs.mountpoint / "f"
    tail = os.urandom(MiB - 4096)
    path.write_bytes(bytes(4096) + tail)
    if stats(kvfs.mountpoint)["data_path"] != "passthrough":
        pytest.skip("the kernel did not grant FUSE passthrough")
    results: multiprocessing.Queue = multiprocessing.Queue()
    writers = [multiprocessing.Process(target=rewrite_head, args=(str(path), 6.0, results))
               for _ in range(8)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    reported = [results.get(timeout=10) for _ in writers]
    errors = [item for item in reported if isinstance(item, str)]
    assert errors == []
    assert all(made > 10 for made in reported)
    head = path.read_bytes()
    assert len(set(head[:4096])) == 1 and head[4096:] == tail
    shown = stats(kvfs.mountpoint)
    assert shown["write_opens_passthrough"] > 0 and shown["write_opens_daemon"] > 0
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_small_pools_and_writers_beside_readers_keep_daemon_writes(make_mount,
                                                             roomy: KvfsMount) -> None:
    root = roomy.mountpoint
    (root / "f").write_bytes(b"A" * MiB)
    with open(root / "f", "rb", buffering=0), open(root / "f", "r+b", buffering=0) as writer:
        writer.seek(10)  # beside a reader: served here
        writer.write(b"B")
    assert stats(root)["write_opens_daemon"] == 1
    small = make_mount("--capacity", "1G")  # kernel writers' share: 64 MiB, one at first
    with open(small.mountpoint / "g", "wb") as first, open(small.mountpoint / "h", "wb") as second:
        first.write(b"C" * MiB)
        second.write(b"D" * MiB)
    assert stats(small.mountpoint)["write_opens_passthrough"] == 1
    assert stats(small.mountpoint)["write_opens_daemon"] == 1
    assert (small.mountpoint / "h").read_bytes() == b"D" * MiB
    assert (root / "f").read_bytes() == b"A" * 10 + b"B" + b"A" * (MiB - 11)


def test_many_open_writers_evict_nothing_for_room_they_do_not_use(roomy: KvfsMount) -> None:
    """A kernel writer reserves room it may never use; 64 writers held open at once (at 256
    MiB each, twice an 8 GiB pool) must not evict the pool's files for it. Once
    files have been committed, writers reserve twice the largest recent size and all of a
    second round of 64 pass through."""
    root = roomy.mountpoint
    kept = {f"kept-{index}": os.urandom(MiB) for index in range(8)}
    for name, payload in kept.items():
        (root / name).write_bytes(payload)
    roomy.remount()  # a fresh daemon knows no sizes: its first writers reserve 64 MiB each
    for round_ in range(2):
        before = stats(root)["write_opens_passthrough"]
        writers = [os.open(root / f"w{round_}-{index}", os.O_WRONLY | os.O_CREAT, 0o644)
                   for index in range(64)]
        for fd in writers:
            os.write(fd, b"x" * 4096)
        time.sleep(1.5)  # several ticks of the background trim while all are open
        for fd in writers:
            os.close(fd)
        passed_through = stats(root)["write_opens_passthrough"] - before
        # the pool's share for kernel writers, 512 MiB, holds eight of the first ones
        assert passed_through == (64 if round_ else 8), passed_through
    shown = stats(root)
    assert shown["evictions"] == 0
    assert all((root / name).read_bytes() == payload for name, payload in kept.items())
    assert all((root / f"w{round_}-{index}").read_bytes() == b"x" * 4096
               for round_ in range(2) for index in range(64))
    assert_counters_exact(root, roomy.data)


def test_crash_during_a_kernel_write_loses_only_that_write(roomy: KvfsMount) -> None:
    root = roomy.mountpoint
    kept = os.urandom(3 * MiB)
    (root / "kept").write_bytes(kept)
    (root / "f").write_bytes(b"old")
    writer = subprocess.Popen(
        ["python3", "-c",
         "import os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644); "
         "os.write(fd, os.urandom(8 << 20)); print('written', flush=True); time.sleep(60)",
         str(root / "new")], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "written"
        assert stats(root)["write_opens_passthrough"] == 3
        roomy.kill9()
    finally:
        writer.kill()
        writer.wait()
    roomy.mount()
    assert_only_spares_staged(roomy.data, roomy)  # the staged write was discarded
    drop_caches()
    assert (root / "f").read_bytes() == b"old"
    assert (root / "new").read_bytes() == b"", "created, never committed: empty"
    assert (root / "kept").read_bytes() == kept
    assert_counters_exact(root, roomy.data)


def test_a_file_being_written_by_the_kernel_is_not_evicted(make_mount) -> None:
    kvfs = make_mount("--capacity", "4G")
    root = kvfs.mountpoint
    with open(root / "held", "wb", buffering=0) as writer:
        writer.write(b"h" * MiB)
        block = os.urandom(64 * MiB)
        for index in range(18):  # 4.5 GiB through a 4 GiB pool
            with open(root / f"big{index}", "wb", buffering=0) as big:
                for _ in range(4):
                    big.write(block)
        writer.write(b"i" * MiB)
    assert stats(root)["evictions"] >= 1
    assert (root / "held").read_bytes() == b"h" * MiB + b"i" * MiB
    assert_counters_exact(root, kvfs.data)
    assert stats(root)["used_bytes"] <= 4 << 30


def test_sums_are_taken_after_close_and_guard_the_data(roomy: KvfsMount) -> None:
    """A kernel writer's close commits at once; the block sums are taken in the background
    (or by the first open), and damage after that is found as with any blob."""
    root = roomy.mountpoint
    payloads = {f"c{index}": os.urandom(4 * MiB + index) for index in range(3)}
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
    assert wait_for(lambda: stats(root)["hashed_after_close"] == 3)
    victim = max(blob_files(roomy), key=lambda p: p.stat().st_size)
    roomy.unmount()
    with open(victim, "r+b") as blob:
        blob.seek(MiB + 3)
        blob.write(b"\x00" if blob.read(1) != b"\x00" else b"\x01")
    roomy.mount()
    drop_caches()
    assert errno_of((root / "c2").read_bytes) == errno.EIO
    for name in ("c0", "c1"):
        assert (root / name).read_bytes() == payloads[name]
    assert_counters_exact(root, roomy.data)


def test_sums_wait_while_kernel_writers_keep_committing(roomy: KvfsMount) -> None:
    """Reading back what O_DIRECT writers wrote would take the volume from them: the late
    sums wait until commits pause (kvfs/data/verify.py, HASH_QUIET_SECONDS = 0.5 s; here they
    come every 20 ms), then all are taken. Readers the kernel serves open such blobs
    without their sums (buffered and O_DIRECT): the sums would come from the same volume."""
    root = roomy.mountpoint
    payloads = {f"b{index:02d}": os.urandom(MiB) for index in range(40)}
    for name, payload in payloads.items():
        write_direct(root / name, payload)
        time.sleep(0.02)
    assert stats(root)["hashed_after_close"] == 0, "no sums taken during the burst"
    assert (root / "b07").read_bytes() == payloads["b07"]
    read_all(root, {"b08": payloads["b08"]}, os.O_DIRECT)
    shown = stats(root)
    assert shown["hashed_after_close"] == 0 and shown["opens_passthrough"] == 2, shown
    assert wait_for(lambda: stats(root)["hashed_after_close"] == len(payloads))
    assert_counters_exact(root, roomy.data)
    verified_after_remount(roomy, payloads)


def test_a_blob_without_sums_of_the_wrong_size_is_eio_at_open(roomy: KvfsMount) -> None:
    """An open before the sums are taken still checks what it can: the data file's size
    (here cut short behind kvfs, before or after the sums: EIO either way)."""
    root = roomy.mountpoint
    write_direct(root / "victim", os.urandom(2 * MiB))
    # The kernel sends the writer's RELEASE after close() returns. Until kvfs has it, a
    # change of the data file is the writer's (through a mapping, say), committed then.
    assert wait_for(lambda: stats(root)["blobs_held"] == 0)
    [data_file] = blob_files(roomy)
    os.truncate(data_file, MiB)
    assert errno_of((root / "victim").read_bytes) == errno.EIO
    assert wait_for(lambda: not (root / "victim").exists())
    assert stats(root)["checksum_errors"] == 1
    assert_counters_exact(root, roomy.data)


def write_direct(path: Path, payload: bytes) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        with mmap.mmap(-1, len(payload)) as buffer:  # page-aligned, as O_DIRECT wants
            buffer.write(payload)
            assert os.write(fd, buffer) == len(payload)
    finally:
        os.close(fd)


def mark_pending(data: Path, blob_ids: list[int], rebooted: bool) -> None:
    """What a crash between a kernel writer's close and the taking of its sums leaves:
    the blob records flagged pending, without sums, listed in `pending` (kvfs/meta/);
    `rebooted`: the boot recorded by the last mount is another one."""
    env = lmdb.open(str(data / "meta"), max_dbs=16)
    blobs, pending = env.open_db(b"blob"), env.open_db(b"pending")
    with env.begin(write=True) as txn:
        if rebooted:
            txn.put(b"boot", b"an earlier boot", db=env.open_db(b"settings", txn=txn))
        for blob_id in blob_ids:
            key = struct.pack(">Q", blob_id)
            record = bytearray(txn.get(key, db=blobs)[:32])  # ino, size, allocated, bs, flags
            struct.pack_into("<I", record, 28, SUMS_PENDING)
            txn.put(key, bytes(record), db=blobs)
            txn.put(key, b"", db=pending)
    env.close()


@pytest.mark.parametrize("rebooted", [False, True], ids=["same-boot", "after-reboot"])
def test_sums_still_pending_at_a_crash(roomy: KvfsMount, rebooted: bool) -> None:
    """Same boot: the page cache still holds what the kernel wrote, and the sums are taken
    at the next mount. After a reboot those bytes may never have reached the volume: the
    files are dropped (a miss to recompute), everything else is kept."""
    root = roomy.mountpoint
    payloads = {f"c{index}": os.urandom(2 * MiB + index) for index in range(4)}
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
    inos = {name: (root / name).stat().st_ino for name in payloads}
    # All four have their sums before the crash; the test then takes two of them back.
    assert wait_for(lambda: stats(root)["hashed_after_close"] == len(payloads)), stats(root)
    roomy.kill9()
    # What the killed daemon's change log holds goes into LMDB first, as the next mount
    # would do it: the crash state is then made by editing LMDB itself.
    LmdbEngine(roomy.data / "meta", FAMILIES, DEFAULT_MAP_SIZE).close()
    owners = {}
    env = lmdb.open(str(roomy.data / "meta"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        for key, record in txn.cursor(db=env.open_db(b"blob", txn=txn)):
            owners[struct.unpack(">Q", key)[0]] = struct.unpack_from("<Q", record)[0]
    env.close()
    pending = [blob for blob, ino in owners.items() if ino in (inos["c1"], inos["c3"])]
    mark_pending(roomy.data, pending, rebooted)
    roomy.mount()
    for name, payload in payloads.items():
        if rebooted and name in ("c1", "c3"):
            assert not (root / name).exists()
        else:
            assert (root / name).read_bytes() == payload
    assert stats(root)["hashed_after_close"] == (0 if rebooted else 2)
    verified_after_remount(roomy, {name: payload for name, payload in payloads.items()
                                   if not (rebooted and name in ("c1", "c3"))})


WRITERS_SCRIPT = """
import os, sys
root = sys.argv[1]
fds = [os.open(os.path.join(root, f"w{i}"), os.O_WRONLY | os.O_CREAT, 0o644) for i in range(16)]
for i, fd in enumerate(fds):
    os.write(fd, bytes([i]) * (64 << 10))
for fd in fds[:8]:
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def spare_names(data: Path) -> set[str]:
    return {path.name for path in (data / "staging").iterdir() if not path.stat().st_size}


def test_without_spares_each_writer_creates_its_staged_file(make_mount) -> None:
    """`--spares off`: nothing is made ahead; each writer's open creates its staged file,
    named in staging/ while it is open and gone from there once committed; a crash with
    writers open leaves nothing after recovery."""
    kvfs = passthrough_mount(make_mount, "--spares", "off")

    def while_open() -> None:
        assert stats(kvfs.mountpoint)["spare_staged_files"] == 0
        blob_files(kvfs)  # (the closed ones' are published)
        assert len(list((kvfs.data / "staging").iterdir())) == 8, "the open writers' files"

    crash_with_writers_open(kvfs, while_open)


def test_writers_stage_in_spares_the_helper_made_and_a_crash_leaves_nothing(make_mount
                                                                           ) -> None:
    """By default the volume helper process makes staged files ahead (`staging/<blob id>`,
    empty, as many as the stats say): a writer's open takes one and creates nothing on the
    volume. The helper dies with its daemon; after a crash with writers open, recovery
    deletes the spares and the uncommitted writes, the committed files are whole, and the
    new mount makes new spares."""
    roomy = passthrough_mount(make_mount)
    root = roomy.mountpoint
    assert wait_for(lambda: stats(root)["spare_staged_files"] >= 32)
    assert_only_spares_staged(roomy.data, roomy)
    assert stats(root)["used_bytes"] == 0, "spares take no room"
    made_ahead = spare_names(roomy.data)
    helper = helper_pid(roomy.pid)

    def while_open() -> None:
        shown = stats(root)  # (the first eight fill the kernel writers' share of the pool)
        assert (shown["write_opens_passthrough"], shown["write_opens_daemon"]) == (8, 8)
        blob_files(roomy)  # (the closed ones' are published)
        written = {path.name for path in (roomy.data / "staging").iterdir()
                   if path.stat().st_size}
        assert len(written) == 8 and written <= made_ahead, "the open writers took spares"

    crash_with_writers_open(roomy, while_open, helper)
    roomy.mount()
    assert wait_for(lambda: stats(root)["spare_staged_files"] >= 32)
    assert not spare_names(roomy.data) & made_ahead, "the old spares were deleted"


def test_stores_go_on_when_the_volume_helper_dies(make_mount) -> None:
    """If the volume helper process ends, writers create their own staged files and the
    loop publishes: stores go on, whole, counters exact, and a remount has a helper again."""
    kvfs = passthrough_mount(make_mount)
    root = kvfs.mountpoint
    assert wait_for(lambda: stats(root)["spare_staged_files"] >= 32)
    expected = {}
    for index in range(8):
        expected[f"before{index}"] = os.urandom(4096)
        (root / f"before{index}").write_bytes(expected[f"before{index}"])
    os.kill(helper_pid(kvfs.pid), signal.SIGKILL)
    for index in range(200):  # through the spares left, then without
        expected[f"after{index}"] = os.urandom(4096)
        (root / f"after{index}").write_bytes(expected[f"after{index}"])
    for name, payload in expected.items():
        assert (root / name).read_bytes() == payload, name
    shown = stats(root)
    assert (shown["commits"], shown["spare_staged_files"], shown["handler_errors"],
            shown["volume_errors"]) == (len(expected), 0, 0, 0)
    assert len(blob_files(kvfs)) == len(expected), "every blob published"
    assert_only_spares_staged(kvfs.data, kvfs)
    assert_counters_exact(root, kvfs.data)
    assert "the volume helper process is gone" in (kvfs.data / "kvfs.log").read_text()
    kvfs.remount()
    assert wait_for(lambda: stats(root)["spare_staged_files"] >= 32)
    assert helper_pid(kvfs.pid)
    kvfs.unmount()
    assert_only_spares_staged(kvfs.data)
    fsck_clean(kvfs)


def crash_with_writers_open(kvfs: KvfsMount, while_open: Callable[[], None],
                            helper: int | None = None) -> None:
    """WRITERS_SCRIPT's sixteen writers, eight of them closed; `while_open` looks at the
    mount then; the daemon is killed (-9) with eight writers open (and its `helper` process
    dies with it). After a new mount: nothing staged but its spares, the closed files whole,
    the open ones empty, counters exact, fsck clean."""
    root = kvfs.mountpoint
    writers = subprocess.Popen([sys.executable, "-c", WRITERS_SCRIPT, str(root)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writers.stdout is not None and writers.stdout.readline().strip() == "ready"
        while_open()
        for i in range(8):
            assert (root / f"w{i}").read_bytes() == bytes([i]) * (64 << 10)
        kvfs.kill9()
        assert helper is None or wait_dead(helper), "the volume helper outlived its daemon"
    finally:
        writers.kill()
        writers.wait()
    kvfs.mount()
    assert_only_spares_staged(kvfs.data, kvfs)
    for i in range(16):
        expected = bytes([i]) * (64 << 10) if i < 8 else b""
        assert (root / f"w{i}").read_bytes() == expected, i
    assert_counters_exact(root, kvfs.data)
    kvfs.unmount()
    fsck_clean(kvfs)
