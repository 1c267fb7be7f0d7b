"""Operator tools: the stats file, kvfs stat, Prometheus metrics, prewarm, fstab mounting."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import (
    blob_files,
    daemon_pid,
    drop_caches,
    is_mounted,
    resident_bytes,
    stats,
    wait_dead,
    wait_for,
)

from kvfs.observe.stats import LATENCY_BOUNDS_US

MiB = 1 << 20
KVFS = Path(sys.executable).parent / "kvfs"
FS_NAME = "meta-llama-SEP-Llama-3.1-8B@1@0@-{:x}@bfloat16.data"
DISK_NAME = "Qwen-Qwen2.5-7B@1@0@{:x}@float16.pt"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_stats_file_counts_exactly(make_mount) -> None:
    kvfs = make_mount("--capacity", "16M")
    root = kvfs.mountpoint
    before = stats(root)
    assert before["files"] == 0 and before["used_bytes"] == 0
    (root / "lmcache").mkdir()
    for index in range(2):
        (root / "lmcache" / FS_NAME.format(index)).write_bytes(b"k" * MiB)
    (root / "lmcache" / DISK_NAME.format(7)).write_bytes(b"q" * (2 * MiB))
    (root / "lmcache" / (FS_NAME.format(9) + ".tmp")).write_bytes(b"t" * 100)
    for index in range(5):
        assert not (root / "lmcache" / f"missing-{index}.data").exists()
    assert (root / "lmcache" / FS_NAME.format(0)).read_bytes() == b"k" * MiB
    after = stats(root)
    assert after["files"] == 4
    assert after["used_bytes"] == 4 * MiB + 4096  # the room files take: 4 KiB blocks
    assert after["bytes_written"] - before["bytes_written"] == 4 * MiB + 100
    # What went in and out of the pool, whichever path moved the bytes:
    assert after["bytes_committed"] - before["bytes_committed"] == 4 * MiB + 100
    assert after["bytes_opened"] - before["bytes_opened"] == MiB
    if after["data_path"] == "passthrough":  # pages kvfs wrote and hashed: not read again
        assert (after["bytes_read"], after["verified_bytes"],
                after["verifications_skipped"]) == (0, 0, 1)
    else:
        assert after["bytes_read"] == MiB
    assert after["lookup_misses"] - before["lookup_misses"] >= 5
    assert after["models"] == {
        "meta-llama/Llama-3.1-8B": {"files": 2, "bytes": 2 * MiB},
        "Qwen-Qwen2.5-7B": {"files": 1, "bytes": 2 * MiB},
    }
    for index in range(16):  # 16 MiB more through a 16 MiB capacity: evictions
        (root / "lmcache" / FS_NAME.format(100 + index)).write_bytes(b"e" * MiB)
    final = stats(root)
    assert final["evictions"] >= 4
    assert final["used_bytes"] <= final["capacity_bytes"] == 16 * MiB
    model = final["models"]["meta-llama/Llama-3.1-8B"]
    visible = [name for name in os.listdir(root / "lmcache") if name.startswith("meta-llama")
               and name.endswith(".data")]
    assert model == {"files": len(visible), "bytes": len(visible) * MiB}


def test_stats_file_is_read_only(kvfs) -> None:
    control = kvfs.mountpoint / ".kvfs"
    stats_file = control / "stats"
    (kvfs.mountpoint / "plain").write_bytes(b"p")
    for attempt in (lambda: stats_file.write_text("x"), stats_file.unlink,
                    lambda: (control / "new").write_text("x"),
                    lambda: os.rename(stats_file, kvfs.mountpoint / "moved"),
                    lambda: os.rename(kvfs.mountpoint / "plain", control / "in"),
                    lambda: os.rmdir(control), lambda: os.mkdir(control / "d"),
                    lambda: os.symlink("stats", control / "s"),
                    lambda: os.link(stats_file, kvfs.mountpoint / "linked"),
                    lambda: os.link(kvfs.mountpoint / "plain", control / "linked"),
                    lambda: os.chmod(stats_file, 0o666), lambda: os.truncate(stats_file, 0),
                    lambda: os.setxattr(stats_file, "user.x", b"1")):
        with pytest.raises(OSError) as refused:
            attempt()
        assert refused.value.errno in (errno.EACCES, errno.EPERM)
    with pytest.raises(OSError) as refused:
        os.setxattr(stats_file, "trusted.x", b"1")
    assert refused.value.errno in (errno.ENOTSUP, errno.EPERM)
    with pytest.raises(OSError) as refused:
        os.getxattr(stats_file, "user.x")
    assert refused.value.errno == errno.ENODATA
    assert os.listxattr(stats_file) == []
    with pytest.raises(OSError) as refused:
        os.readlink(stats_file)
    assert refused.value.errno == errno.EINVAL
    with open(stats_file, "rb") as reader:
        assert json.loads(reader.read())["files"] == 1
    assert os.listdir(kvfs.mountpoint / ".kvfs") == ["stats"]
    assert ".kvfs" not in os.listdir(kvfs.mountpoint), "reached by name, not listed"
    assert stats(kvfs.mountpoint)["files"] == 1
    assert sorted(os.listdir(kvfs.mountpoint)) == ["plain"]


def test_kvfs_stat_json_table_and_errors(kvfs) -> None:
    (kvfs.mountpoint / FS_NAME.format(1)).write_bytes(b"x" * 1000)
    as_json = json.loads(subprocess.run([KVFS, "stat", "--json", str(kvfs.mountpoint)],
                                        check=True, capture_output=True, text=True).stdout)
    assert as_json["used_bytes"] == 4096
    assert as_json["models"]["meta-llama/Llama-3.1-8B"] == {"files": 1, "bytes": 4096}
    table = subprocess.run([KVFS, "stat", str(kvfs.mountpoint)], check=True,
                           capture_output=True, text=True).stdout
    assert "meta-llama/Llama-3.1-8B" in table and "capacity" in table
    failed = subprocess.run([KVFS, "stat", "/tmp"], capture_output=True, text=True)
    assert failed.returncode != 0 and len(failed.stderr.strip().splitlines()) == 1


def test_metrics_endpoint(make_mount) -> None:
    port = free_port()
    kvfs = make_mount("--capacity", "1G", "--metrics-port", str(port))
    (kvfs.mountpoint / FS_NAME.format(5)).write_bytes(b"m" * 4096)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    lines = body.decode().splitlines()
    assert "kvfs_used_bytes 4096.0" in lines
    assert "kvfs_capacity_bytes 1.073741824e+09" in lines
    assert 'kvfs_model_bytes{model="meta-llama/Llama-3.1-8B"} 4096.0' in lines
    # (committed, whichever path moved the bytes: a 1 GiB pool lets its first writer pass)
    assert 'kvfs_stored_bytes_total{client="lmcache"} 4096.0' in lines
    assert 'kvfs_stored_bytes_total{client="other"} 0.0' in lines
    # one create answered, in some bucket, and in every bucket from there on
    assert 'kvfs_request_seconds_count{request="create"} 1.0' in lines
    assert 'kvfs_request_seconds_bucket{le="+Inf",request="create"} 1.0' in lines
    buckets = [float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith('kvfs_request_seconds_bucket{') and 'request="create"' in line]
    assert len(buckets) == 18 and buckets == sorted(buckets) and buckets[-1] == 1.0


def test_requests_are_counted_by_kind(make_mount) -> None:
    """Each request the daemon answers is counted once under its kind, with its latency
    bucket."""
    kvfs = make_mount("--capacity", "1G")
    root = kvfs.mountpoint
    before = stats(root)["requests"]
    for index in range(5):
        fd = os.open(root / f"t{index}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, b"r" * 4096)
        os.close(fd)
        os.rename(root / f"t{index}", root / f"f{index}")

    def answered(kind: str) -> int:
        return stats(root)["requests"][kind]["count"] - before.get(kind, {"count": 0})["count"]

    assert (answered("create"), answered("rename")) == (5, 5)
    # (each read of .kvfs/stats is an open, a flush and a release too)
    assert answered("flush") >= 5 and wait_for(lambda: answered("release") >= 5)
    shown = stats(root)["requests"]["create"]
    assert shown["p50_us"] in LATENCY_BOUNDS_US and shown["p50_us"] <= shown["p99_us"]
    assert 0 < shown["seconds"] < 5 * shown["p99_us"] / 1e6 + 1e-9
    table = subprocess.run([KVFS, "stat", str(root)], check=True, capture_output=True,
                           text=True).stdout
    assert "requests answered by the daemon" in table and "rename" in table


@pytest.mark.parametrize("passthrough", ["auto", "off"])
def test_prewarm_serves_later_reads_from_memory(make_mount, passthrough: str) -> None:
    # --verify open: files not in memory are checked at open, so the prewarm's reads count
    kvfs = make_mount("--capacity", "1G", "--passthrough", passthrough, "--verify", "open")
    (kvfs.mountpoint / "chunks").mkdir()
    for index in range(3):
        (kvfs.mountpoint / "chunks" / f"c{index}.data").write_bytes(os.urandom(4 * MiB))
    kvfs.remount()  # a fresh daemon and kernel cache ...
    drop_caches()  # ... and blobs no longer in memory: they are verified again
    result = subprocess.run([KVFS, "prewarm", str(kvfs.mountpoint)], check=True,
                            capture_output=True, text=True)
    assert f"warmed 3 files, {12 * MiB} bytes" in result.stdout
    warmed = stats(kvfs.mountpoint)
    if warmed["data_path"] == "passthrough":  # verified once, then the kernel reads
        assert (warmed["verified_bytes"], warmed["bytes_read"]) == (12 * MiB, 0)
    else:  # once from the volume, once into the kernel page cache
        assert (warmed["verified_bytes"], warmed["bytes_read"]) == (0, 2 * 12 * MiB)
    # What the kernel evicted meanwhile (this VM hands idle memory back) is checked again.
    evicted = sum(blob.stat().st_size for blob in blob_files(kvfs)
                  if resident_bytes(blob) < blob.stat().st_size)
    for index in range(3):
        (kvfs.mountpoint / "chunks" / f"c{index}.data").read_bytes()
    later = stats(kvfs.mountpoint)
    checked_again = evicted if warmed["data_path"] == "passthrough" else 0
    assert (later["bytes_read"], later["verified_bytes"]) == (
        warmed["bytes_read"], warmed["verified_bytes"] + checked_again), \
        "reads came from the page cache"


@pytest.fixture
def mount_helper() -> Path:
    helper = Path("/sbin/mount.kvfs")
    created = not helper.exists()
    if created:
        helper.symlink_to(Path(sys.executable).parent / "mount.kvfs")
    yield helper
    if created:
        helper.unlink()


def test_fstab_form_mounts(tmp_path: Path, mount_helper: Path) -> None:
    if shutil.which("mount") is None:
        pytest.skip("no mount(8)")
    mountpoint, data = tmp_path / "mnt", tmp_path / "data"
    mountpoint.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{data} {mountpoint} kvfs capacity=64M,nofail 0 0\n")
    try:
        subprocess.run(["mount", "-T", str(fstab), str(mountpoint)], check=True, timeout=60)
        assert is_mounted(mountpoint)
        info = os.statvfs(mountpoint)
        assert info.f_blocks * info.f_frsize == 64 * MiB
        pid = daemon_pid(data)
        subprocess.run([KVFS, "umount", str(mountpoint)], check=True, timeout=60)
        assert wait_dead(pid) and not is_mounted(mountpoint)
    finally:
        if is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
