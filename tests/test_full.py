"""A full volume and a full metadata map: ENOSPC cleanly, nothing corrupted, and recovery."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvfs.fuse.operations import fuse_error
from kvfs.observe.stats import Stats

MiB = 1 << 20
KVFS = Path(sys.executable).parent / "kvfs"


@pytest.fixture
def tiny_volume(tmp_path: Path) -> Iterator[Path]:
    volume = tmp_path / "tiny"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(volume)], check=True)
    yield volume
    subprocess.run(["umount", "-l", str(volume)], check=False)


def fsck_is_clean(data: Path) -> bool:
    return subprocess.run([KVFS, "fsck", "--data", str(data)], capture_output=True).returncode == 0


def test_full_volume_gives_enospc_and_recovers(tiny_volume: Path, make_mount) -> None:
    """Pinned files cannot be evicted: once they fill the volume, writes get ENOSPC; the mount
    stays healthy, what was written is intact, and room appears when files go."""
    kvfs = make_mount("--capacity", "1G", data=tiny_volume / "kvfs")
    root = kvfs.mountpoint
    (root / "pinned").mkdir()
    os.setxattr(root / "pinned", "user.kvfs.pin", b"1")
    written = []
    with pytest.raises(OSError) as full:
        for index in range(40):
            path = root / "pinned" / f"f{index}"
            path.write_bytes(bytes([index]) * MiB)
            written.append(path)
    assert full.value.errno == errno.ENOSPC
    assert all(path.read_bytes() == bytes([int(path.name[1:])]) * MiB for path in written)
    for path in written[:4]:
        path.unlink()
    (root / "after").write_bytes(b"a" * MiB)  # room again
    assert (root / "after").read_bytes() == b"a" * MiB
    kvfs.unmount()
    assert fsck_is_clean(kvfs.data)


def test_full_metadata_map_gives_enospc_and_recovers(make_mount) -> None:
    kvfs = make_mount("--capacity", "64M", "--meta-size", "4M")
    root = kvfs.mountpoint
    created = []
    with pytest.raises(OSError) as full:
        for index in range(100_000):
            path = root / f"{index:06d}-{'x' * 200}"
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            created.append(path)
    assert full.value.errno == errno.ENOSPC
    assert len(created) > 100
    # Creates answered faster than the committer moves them into LMDB count against the map
    # too: every answered change landed (none was refused by a full map, to be kept in memory).
    assert "moving changes into LMDB failed" not in (kvfs.data / "kvfs.log").read_text()
    assert sorted(os.listdir(root)) == sorted(path.name for path in created)
    for path in created[: len(created) // 2]:
        path.unlink()
    (root / "again").write_bytes(b"room")  # freed pages are reused
    assert (root / "again").read_bytes() == b"room"
    kvfs.remount()
    assert len(os.listdir(root)) == len(created) - len(created) // 2 + 1
    kvfs.unmount()
    assert fsck_is_clean(kvfs.data)


def test_a_write_the_volume_refuses_is_logged_by_its_size(caplog) -> None:
    """A daemon-served write that the full volume refuses is logged and answered ENOSPC;
    the log record names the data by its length: a record per failed write holding its
    megabytes would fill the log (on that same volume) and the disk behind it."""
    ops = SimpleNamespace(stats=Stats())
    with caplog.at_level(logging.WARNING):
        answer = fuse_error(ops, "write", (7, 0, b"x" * MiB),  # type: ignore[arg-type]
                            OSError(errno.ENOSPC, "No space left on device"))
    assert answer.errno == errno.ENOSPC
    assert ops.stats.volume_errors == 1
    [record] = caplog.records
    assert "write(7, 0, '<1048576 bytes>')" in record.getMessage()
    assert len(record.getMessage()) < 200
