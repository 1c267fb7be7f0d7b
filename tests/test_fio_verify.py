"""Data integrity under fio: every block fio writes through kvfs reads back exactly.

Several fio jobs write at once (sequential and random, blocks of 4 KiB to 1 MiB, tens of MiB
each) with crc32c verify headers in every block, then verify:
1. in the same job, right after writing (the write handle reads its own staged data);
2. after every file was closed (committed): a verify-only pass reading the blobs from the
   volume, the first read of each version (direct_io, checksummed);
3. a second verify-only pass, served from the kernel page cache kept across opens.
Each variant (buffered or O_DIRECT, psync or sync) must exit 0 with no verify error, leave the
files at their full size, nothing staged and no space unaccounted for.

Skipped, with a message, when fio is not installed (scripts/setup.sh installs it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import KvfsMount, assert_only_spares_staged

MiB = 1 << 20
JOB_SIZE = 24 * MiB
NUMJOBS = 3
FIO = shutil.which("fio")


def job_file(directory: Path, engine: str, direct: int) -> str:
    return f"""
[global]
directory={directory}
ioengine={engine}
direct={direct}
size={JOB_SIZE}
numjobs={NUMJOBS}
fallocate=none
bssplit=4k/30:16k/15:64k/15:256k/20:1m/20
verify=crc32c
verify_fatal=1
verify_backlog=0
verify_state_save=0
do_verify=1
randrepeat=1
filename_format=$jobname.$jobnum
group_reporting=0

[seq]
rw=write

[rand]
rw=randwrite
"""


def run_fio(job: Path, *extra: str, timeout: float = 120) -> list[dict]:
    """Run fio; returns its per-job reports after checking it succeeded without errors."""
    assert FIO is not None
    result = subprocess.run([FIO, "--output-format=json", *extra, str(job)], cwd=job.parent,
                            capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"fio exited {result.returncode}:\n{output[-4000:]}"
    complaints = [line for line in result.stderr.splitlines()
                  if any(word in line.lower() for word in ("verify", "crc32c", "bad", "error"))]
    assert not complaints, "\n".join(complaints[:20])
    report = json.loads(result.stdout[result.stdout.index("{"):])
    jobs = report["jobs"]
    assert len(jobs) == 2 * NUMJOBS, [j["jobname"] for j in jobs]
    for entry in jobs:
        assert entry["error"] == 0, f"job {entry['jobname']}: error {entry['error']}"
    return jobs


def verified_bytes(jobs: list[dict]) -> int:
    return sum(entry["read"]["io_bytes"] for entry in jobs)


@pytest.mark.skipif(FIO is None, reason="fio is not installed (scripts/setup.sh installs it)")
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("engine", "direct"), [("psync", 0), ("psync", 1), ("sync", 0)])
def test_fio_writes_verify_exactly(make_mount: Callable[..., KvfsMount], tmp_path: Path,
                                   engine: str, direct: int) -> None:
    volume = make_mount("--capacity", "2G")
    job = tmp_path / "verify.fio"
    job.write_text(job_file(volume.mountpoint, engine, direct))
    total = 2 * NUMJOBS * JOB_SIZE

    # 1. Write, then verify within the same job.
    jobs = run_fio(job)
    assert sum(entry["write"]["io_bytes"] for entry in jobs) == total
    assert verified_bytes(jobs) == total

    # Every file is committed at its full size.
    files = sorted(p.name for p in volume.mountpoint.iterdir())
    expected = sorted(f"{name}.{n}" for name in ("seq", "rand") for n in range(NUMJOBS))
    assert files == expected
    for name in files:
        assert (volume.mountpoint / name).stat().st_size == JOB_SIZE
    assert_only_spares_staged(volume.data, volume)
    st = os.statvfs(volume.mountpoint)
    assert (st.f_blocks - st.f_bfree) * st.f_frsize == total

    # 2. and 3. Verify the committed files: once from the volume, once from the page cache.
    for _ in range(2):
        jobs = run_fio(job, "--verify_only")
        assert verified_bytes(jobs) == total
    assert_no_errors_counted(volume)

    # The same after a remount: nothing but the volume holds the data now.
    volume.remount()
    jobs = run_fio(job, "--verify_only")
    assert verified_bytes(jobs) == total
    assert_no_errors_counted(volume)


def assert_no_errors_counted(volume: KvfsMount) -> None:
    stats = json.loads((volume.mountpoint / ".kvfs" / "stats").read_text())
    assert stats["checksum_errors"] == 0
    assert stats["handler_errors"] == 0
