"""Hostile requests and a failing volume: nothing else is lost, the counters stay exact, and the
mount keeps serving.

After every hostile or failing operation these tests check the invariant, not the symptom:
every other file is unchanged (bytes and names), the usage counters equal a recount of the
metadata, and (unmounted) `kvfs fsck` finds the volume clean.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import (
    KvfsMount,
    assert_counters_exact,
    assert_only_spares_staged,
    blob_files,
    blob_shards_broken,
    helper_pid,
    stats,
    wait_for,
)

MiB = 1 << 20
KVFS = Path(sys.executable).parent / "kvfs"


def errno_of(call: Callable, *args: object) -> int:
    with pytest.raises(OSError) as caught:
        call(*args)
    return caught.value.errno


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> digest of every regular file under root (.kvfs is not listed)."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file() and not path.is_symlink()}


def fsck_clean(data: Path) -> None:
    result = subprocess.run([KVFS, "fsck", "--data", str(data)], capture_output=True, text=True)
    assert result.returncode == 0 and "clean" in result.stderr, result.stderr


def fill_pool(root: Path) -> None:
    """The issue's layout: a directory of odd and big files and one of small ones."""
    (root / "a").mkdir()
    (root / "a" / "odd").write_bytes(os.urandom(5 * MiB))
    (root / "a" / "big").write_bytes(os.urandom(64 * MiB))
    (root / "a" / "small").write_bytes(b"s" * 100)
    (root / "many").mkdir()
    for index in range(3):
        (root / "many" / f"f{index}").write_bytes(bytes([index]) * 1000)


def test_hostile_truncates_evict_nothing_and_keep_counters(make_mount) -> None:
    kvfs = make_mount()  # default capacity: the volume's free space
    root = kvfs.mountpoint
    fill_pool(root)
    before = snapshot(root)
    small = root / "a" / "small"
    stamp = os.stat(small)
    for _ in range(4):
        assert errno_of(os.truncate, small, 1 << 62) == errno.EFBIG
        assert errno_of(os.truncate, root / "a" / "big", (1 << 44) + 1) == errno.EFBIG
        fd = os.open(small, os.O_WRONLY)
        assert errno_of(os.pwrite, fd, b"x", 1 << 62) == errno.EFBIG
        assert errno_of(os.ftruncate, fd, 1 << 62) == errno.EFBIG
        os.close(fd)
    after = os.stat(small)
    assert (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (
        stamp.st_mtime_ns, stamp.st_ctime_ns, stamp.st_size), "a failed truncate changed it"
    assert snapshot(root) == before
    assert stats(root)["evictions"] == 0
    assert_counters_exact(root, kvfs.data)
    kvfs.unmount()
    fsck_clean(kvfs.data)


def test_sparse_files_take_no_room(make_mount) -> None:
    kvfs = make_mount("--capacity", "64M")
    root = kvfs.mountpoint
    keep = os.urandom(8 * MiB)
    (root / "keep").write_bytes(keep)
    sparse = root / "sparse"
    sparse.write_bytes(b"head")
    os.truncate(sparse, 1 << 40)  # 1 TiB through a 64 MiB pool: a hole
    fd = os.open(sparse, os.O_WRONLY)
    os.pwrite(fd, b"tail", (1 << 36) + 5)  # 64 GiB in: another hole before it
    os.close(fd)
    st = os.stat(sparse)
    assert st.st_size == 1 << 40
    assert st.st_blocks * 512 <= 64 * 1024
    with open(sparse, "rb") as reader:
        assert reader.read(4) == b"head"
        reader.seek((1 << 36) + 1)
        assert reader.read(8) == b"\0\0\0\0tail"
        reader.seek((1 << 40) - 3)
        assert reader.read() == b"\0\0\0"
    assert int(subprocess.run(["du", "-k", str(sparse)], capture_output=True, text=True,
                              check=True).stdout.split()[0]) <= 64
    assert stats(root)["evictions"] == 0
    assert (root / "keep").read_bytes() == keep
    assert_counters_exact(root, kvfs.data)
    kvfs.remount()
    assert os.stat(sparse).st_size == 1 << 40
    kvfs.unmount()
    fsck_clean(kvfs.data)


def test_a_change_that_cannot_fit_evicts_nothing(make_mount) -> None:
    """Rewriting part of a pinned 40 MiB file needs a 40 MiB copy; with 64 MiB capacity and
    only 12 MiB evictable it cannot fit: ENOSPC at once, and the evictable files survive."""
    kvfs = make_mount("--capacity", "64M")
    root = kvfs.mountpoint
    (root / "pinned").mkdir()
    os.setxattr(root / "pinned", "user.kvfs.pin", b"1")
    (root / "pinned" / "big").write_bytes(os.urandom(40 * MiB))
    for index in range(3):
        (root / f"evictable{index}").write_bytes(os.urandom(4 * MiB))
    before = snapshot(root)
    assert errno_of(os.truncate, root / "pinned" / "big", 40 * MiB + 1) == errno.ENOSPC
    fd = os.open(root / "pinned" / "big", os.O_RDWR)
    assert errno_of(os.pwrite, fd, b"x", 5) == errno.ENOSPC
    os.close(fd)
    assert snapshot(root) == before
    assert stats(root)["evictions"] == 0
    assert_counters_exact(root, kvfs.data)
    # A change that fits still evicts what it needs, least recently used first.
    (root / "newer").write_bytes(os.urandom(16 * MiB))
    assert stats(root)["evictions"] >= 1
    assert snapshot(root)["pinned/big"] == before["pinned/big"]
    assert_counters_exact(root, kvfs.data)
    kvfs.unmount()
    fsck_clean(kvfs.data)


def test_hostile_names_xattrs_and_renames_lose_nothing(kvfs: KvfsMount) -> None:
    root = kvfs.mountpoint
    fill_pool(root)
    before = snapshot(root)
    assert errno_of(os.setxattr, root / "a" / "odd", "user.big", b"v" * (1 << 20)) in (
        errno.E2BIG, errno.ENOSPC)
    assert errno_of(os.rename, root / "a", root / "a" / "inside") == errno.EINVAL
    assert errno_of(os.rename, root / "many", root / "a" / "odd") == errno.ENOTDIR
    assert errno_of(os.rename, root / "a" / "odd", root / "many") == errno.EISDIR
    assert errno_of(os.rmdir, root / "many") == errno.ENOTEMPTY
    assert errno_of(os.link, root / "a", root / "alias") == errno.EPERM
    assert errno_of(os.symlink, "x" * 5000, root / "long") == errno.ENAMETOOLONG
    assert errno_of(open, root / ("n" * 256), "wb") == errno.ENAMETOOLONG
    for _ in range(20):  # a rename loop through hard links and back
        os.link(root / "a" / "odd", root / "odd-link")
        os.rename(root / "odd-link", root / "a" / "odd")  # same inode: nothing happens
        os.unlink(root / "odd-link")
    assert snapshot(root) == before
    assert_counters_exact(root, kvfs.data)


def test_unreadable_blob_fails_that_file_only(kvfs: KvfsMount) -> None:
    """A volume error under one file (EIO-like: its data file turned into a directory) fails
    reads of that file, is counted, and leaves the daemon and every other file alone; the
    readahead that met it wakes whoever waited."""
    root = kvfs.mountpoint
    fill_pool(root)
    victim_blob = max(blob_files(kvfs), key=lambda p: p.stat().st_size)  # a/big
    kvfs.remount()  # nothing cached
    victim_blob.unlink()
    victim_blob.mkdir()
    for _ in range(3):
        assert errno_of((root / "a" / "big").read_bytes) in (errno.EIO, errno.ENOENT)
    assert (root / "a" / "odd").stat().st_size == 5 * MiB
    assert len((root / "a" / "odd").read_bytes()) == 5 * MiB
    assert (root / "many" / "f1").read_bytes() == b"\1" * 1000
    shown = stats(root)
    assert shown["volume_errors"] + shown["readahead_errors"] + shown["checksum_errors"] >= 1
    assert shown["handler_errors"] == 0
    assert_counters_exact(root, kvfs.data)
    victim_blob.rmdir()


def test_blob_changed_behind_kvfs_during_readahead(kvfs: KvfsMount) -> None:
    """A data file deleted while a reader has it open keeps serving that reader; one cut
    short under an open reader (past what readahead, 32 MiB ahead, has verified) is a
    checksum error for that file only (daemon-served reads: --verify always)."""
    kvfs.options += ["--verify", "always"]
    root = kvfs.mountpoint
    payloads = {name: os.urandom(64 * MiB) for name in ("deleted", "shortened", "bystander")}
    for name, payload in payloads.items():
        (root / name).write_bytes(payload)
    kvfs.remount()
    blobs = {name: blob for name, blob in zip(payloads, blob_files(kvfs), strict=True)}
    with open(root / "deleted", "rb") as reader:
        head = reader.read(1 << 20)
        blobs["deleted"].unlink()
        assert head + reader.read() == payloads["deleted"]
    with open(root / "shortened", "rb") as reader:
        reader.read(1 << 20)
        os.truncate(blobs["shortened"], 40 * MiB)
        assert errno_of(reader.read) == errno.EIO
    assert (root / "bystander").read_bytes() == payloads["bystander"]
    assert stats(root)["handler_errors"] == 0
    assert_counters_exact(root, kvfs.data)


def test_failed_publish_keeps_the_committed_blob(kvfs: KvfsMount) -> None:
    """If moving a committed blob into blobs/ fails, the data stays readable (from staging/)
    and the next mount's recovery publishes it. The volume helper's publisher moves it after
    the close, which has succeeded: the failure is logged and counted. Without a helper (it
    died) the close moves it itself and reports EIO, and a retried flush neither recommits
    nor deletes it."""
    root = kvfs.mountpoint
    # (Stores take the spares' blob ids, one after another: "new" then lands in another shard
    # than the bystander's. Before the spares, a store takes the first of 256 ids, and the
    # first spare's id is 256 later: the same shard.)
    assert wait_for(lambda: stats(root)["spare_staged_files"] > 0)
    (root / "bystander").write_bytes(b"b" * MiB)
    blob_files(kvfs)  # (published: its shard is not broken below)
    payloads = {"new": os.urandom(3 * MiB), "alone": os.urandom(MiB)}
    with blob_shards_broken(kvfs.data):
        (root / "new").write_bytes(payloads["new"])  # the publisher's failure, not the close's
        # (the release, coming after the publisher's failure, tries again and fails too)
        assert wait_for(lambda: stats(root)["volume_errors"] >= 1)
        os.kill(helper_pid(kvfs.pid), signal.SIGKILL)
        (root / "probe").write_bytes(b"p")  # (its publishing finds the helper gone)
        assert wait_for(lambda: "the volume helper process is gone"
                        in (kvfs.data / "kvfs.log").read_text())
        fd = os.open(root / "alone", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, payloads["alone"])
        assert errno_of(os.close, os.dup(fd)) == errno.EIO  # flush: committed, not published
        assert errno_of(os.close, fd) == errno.EIO  # the retried flush fails the same way
        for name, payload in payloads.items():
            assert (root / name).read_bytes() == payload
        assert (root / "bystander").read_bytes() == b"b" * MiB
        assert_counters_exact(root, kvfs.data)
        assert stats(root)["volume_errors"] >= 3
    kvfs.remount()  # recovery publishes them
    for name, payload in payloads.items():
        assert (root / name).read_bytes() == payload
    assert_only_spares_staged(kvfs.data, kvfs)
    kvfs.unmount()
    fsck_clean(kvfs.data)


def test_hard_links_count_once_and_evict_together(make_mount) -> None:
    kvfs = make_mount("--capacity", "32M")
    root = kvfs.mountpoint
    (root / "d").mkdir()
    (root / "old").write_bytes(os.urandom(8 * MiB))
    os.link(root / "old", root / "d" / "alias")
    assert stats(root)["used_bytes"] == 8 * MiB
    for index in range(4):  # 32 MiB more: the oldest file goes, with both its names
        (root / f"new{index}").write_bytes(os.urandom(8 * MiB))
    assert not (root / "old").exists() and not (root / "d" / "alias").exists()
    assert os.listdir(root / "d") == []
    assert_counters_exact(root, kvfs.data)
    kvfs.unmount()
    fsck_clean(kvfs.data)
