"""Prefetch from lookups (kvfs/files/prefetch.py): an engine's burst of lookups of stored chunks
starts reading and verifying them before it opens them; listings and single stats do not;
an open joins a prefetch in flight; nothing unverified reaches a reader; the budget holds.
"""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import KvfsMount, blob_files, drop_caches, resident_bytes, stats, wait_for

MiB = 1 << 20
CHUNK = 8 * MiB
KVFS = Path(sys.executable).parent / "kvfs"


def chunk_name(number: int) -> str:
    """An LMCache `fs` chunk of a Llama-3.1-8B prompt."""
    return f"meta-llama-SEP-Llama-3.1-8B@1@0@{number:016x}@bfloat16.data"


def store_prompt(volume: KvfsMount, chunks: int, size: int = CHUNK) -> list[Path]:
    """Chunks stored, then the mount made cold: remounted, page cache dropped."""
    directory = volume.mountpoint / "prompt"
    directory.mkdir()
    paths = [directory / chunk_name(n) for n in range(chunks)]
    for path in paths:
        path.write_bytes(os.urandom(size))
    volume.remount()
    drop_caches()
    return [volume.mountpoint / "prompt" / path.name for path in paths]


def look_up(paths: list[Path]) -> None:
    """What LMCache's lookup does: one stat per chunk, in prompt order, in this process."""
    for path in paths:
        os.stat(path)


def prefetched(volume: KvfsMount) -> int:
    return stats(volume.mountpoint)["prefetch_bytes"]


@pytest.fixture
def cold(make_mount: Callable[..., KvfsMount]) -> KvfsMount:
    return make_mount("--capacity", "2G")


def test_lookups_prefetch_and_opens_pass_straight_through(cold: KvfsMount) -> None:
    paths = store_prompt(cold, 6)
    look_up(paths)
    assert wait_for(lambda: prefetched(cold) == 6 * CHUNK), stats(cold.mountpoint)
    blobs = blob_files(cold)
    # In memory; a page or two may already be reclaimed where the page cache is tight (a CI
    # container's memory limit counts it), so the mark is most of it, not every page.
    assert sum(resident_bytes(blob) for blob in blobs) >= 0.9 * 6 * CHUNK
    before = stats(cold.mountpoint)
    contents = [path.read_bytes() for path in paths]
    after = stats(cold.mountpoint)
    assert all(len(content) == CHUNK for content in contents)
    assert after["verified_bytes"] == before["verified_bytes"]  # no second check at open
    assert after["prefetch_used_bytes"] == 6 * CHUNK and after["prefetch_wasted_bytes"] == 0
    assert after["loads"][next(iter(after["loads"]))]["bytes"] == 6 * CHUNK


def test_an_open_joins_the_prefetch_in_flight(cold: KvfsMount) -> None:
    """A chunk opened while its prefetch is under way (or prefetched while its open checks
    it) is read and checked once: whichever comes second waits for the other."""
    big = 16 * CHUNK  # long enough to check (cold) that the open surely meets the prefetch
    paths = store_prompt(cold, 2, size=big)
    cold.kill9()  # nothing checked on this host: the open must check too (as another host's)
    cold.mount()
    drop_caches()
    look_up(paths)
    assert len(paths[1].read_bytes()) == big  # at once: its check is in flight
    assert wait_for(lambda: stats(cold.mountpoint)["verified_bytes"] >= 2 * big)
    shown = stats(cold.mountpoint)
    assert shown["verifications_joined"] >= 1, shown
    assert shown["verified_bytes"] == 2 * big, shown  # each chunk read and checked once
    assert len(paths[0].read_bytes()) == big


def test_a_single_stat_and_listings_read_nothing(cold: KvfsMount) -> None:
    paths = store_prompt(cold, 4)
    os.stat(paths[0])  # an operator's stat: one lookup, no burst
    for command in (["ls", "-l", str(paths[0].parent)], ["du", "-s", str(cold.mountpoint)],
                    ["find", str(cold.mountpoint), "-size", "+1M"],
                    ["stat", str(paths[1])]):
        subprocess.run(command, check=True, capture_output=True)
    shown = stats(cold.mountpoint)
    assert (shown["prefetch_bytes"], shown["verified_bytes"]) == (0, 0), shown
    assert sum(resident_bytes(blob) for blob in blob_files(cold)) == 0


def test_listing_tools_read_nothing_where_the_kernel_kept_only_the_listing(
        cold: KvfsMount) -> None:
    """Under memory pressure the kernel may drop a directory's entries and keep its listing:
    `ls -l` then looks every name up, a burst like an engine's (a full bench run's `ls -lR`
    prefetched 1 GiB that way). Shell tools never prefetch; an engine's burst in the same
    state still does."""
    paths = store_prompt(cold, 4)
    directory = os.open(paths[0].parent, os.O_RDONLY | os.O_DIRECTORY)  # keeps its listing
    try:
        listed = str(paths[0].parent)
        subprocess.run(["ls", "-l", listed], check=True, capture_output=True)
        for command in (["ls", "-l", listed], ["du", "-a", listed],
                        ["find", listed, "-size", "+1M"]):
            Path("/proc/sys/vm/drop_caches").write_text("2\n")  # entries go, the listing stays
            looked_up = stats(cold.mountpoint)["lookup_hits"]
            subprocess.run(command, check=True, capture_output=True)
            shown = stats(cold.mountpoint)
            assert shown["lookup_hits"] - looked_up == len(paths), (command, shown)
            assert (shown["prefetch_bytes"], shown["verified_bytes"]) == (0, 0), shown
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        look_up(paths)  # an engine's lookups, in the same state
        assert wait_for(lambda: prefetched(cold) == 4 * CHUNK), stats(cold.mountpoint)
    finally:
        os.close(directory)


def test_prefetch_stays_within_its_budget(make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount("--capacity", "2G", "--prefetch", "16M")
    paths = store_prompt(volume, 6)
    look_up(paths)
    assert wait_for(lambda: stats(volume.mountpoint)["prefetch_over_budget"] >= 1)
    assert wait_for(lambda: prefetched(volume) >= 2 * CHUNK)
    assert prefetched(volume) < 6 * CHUNK  # two chunks fit at once: the burst came faster


def test_prefetch_off(make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount("--capacity", "2G", "--prefetch", "0")
    paths = store_prompt(volume, 4)
    look_up(paths)
    assert all(len(path.read_bytes()) == CHUNK for path in paths)
    assert prefetched(volume) == 0


def test_a_chunk_damaged_after_its_prefetch_still_fails_its_open(cold: KvfsMount) -> None:
    paths = store_prompt(cold, 3)
    look_up(paths)
    assert wait_for(lambda: prefetched(cold) == 3 * CHUNK)
    (victim,) = [blob for blob in blob_files(cold) if blob.stat().st_size == CHUNK][:1]
    with open(victim, "r+b") as damaged:  # behind kvfs's back, after the prefetch checked it
        damaged.seek(CHUNK // 2)
        byte = damaged.read(1)
        damaged.seek(CHUNK // 2)
        damaged.write(bytes([byte[0] ^ 1]))
    failures = 0
    for path in paths:
        try:
            path.read_bytes()
        except OSError as error:
            assert error.errno == errno.EIO
            failures += 1
    assert failures == 1
    assert stats(cold.mountpoint)["checksum_errors"] >= 1


def kvfs_stat(volume: KvfsMount, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVFS), "stat", str(volume.mountpoint), *options],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "240"})


def test_stat_shows_whether_loads_pay(cold: KvfsMount) -> None:
    paths = store_prompt(cold, 2)
    for path in paths:
        path.read_bytes()
    loads = stats(cold.mountpoint)["loads"]["meta-llama/Llama-3.1-8B"]
    assert loads["bytes"] == 2 * CHUNK and loads["seconds"] > 0
    slow = kvfs_stat(cold, "--break-even", "Llama-3.1-8B=100000")
    assert slow.returncode == 0 and "SLOWER THAN RECOMPUTING" in slow.stdout, slow.stdout
    fast = kvfs_stat(cold, "--break-even", "meta-llama/Llama-3.1-8B=0.0001")
    assert "pays: loading is" in fast.stdout and "SLOWER" not in fast.stdout, fast.stdout
    default = kvfs_stat(cold)  # the README's table: Llama-3.1-8B pays above 4.5 GB/s
    assert "4.50" in default.stdout, default.stdout
    bad = kvfs_stat(cold, "--break-even", "llama")
    assert bad.returncode != 0 and "MODEL=GBPS" in bad.stderr


def read_direct(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT wants
        assert os.readv(fd, [buffer]) == CHUNK
        return bytes(buffer)
    finally:
        os.close(fd)


def test_o_direct_readers_get_the_check_ahead_and_no_page_cache(cold: KvfsMount) -> None:
    """Readers that use O_DIRECT (vLLM's tier) do not read the page cache: their prefetch is
    the check alone, with O_DIRECT reads, so that their opens need none."""
    paths = store_prompt(cold, 6)
    contents = {path: path.read_bytes() for path in paths}
    cold.kill9()  # nothing checked on this host any more: as if another host wrote them
    cold.mount()
    drop_caches()
    for path in paths[:3]:  # readers seen to be O_DIRECT (lookups apart: no burst)
        assert read_direct(path) == contents[path]
        time.sleep(1.2)
    before = stats(cold.mountpoint)
    look_up(paths[3:])
    assert wait_for(lambda: prefetched(cold) == 3 * CHUNK), stats(cold.mountpoint)
    assert sum(resident_bytes(blob) for blob in blob_files(cold)) == 0
    assert all(read_direct(path) == contents[path] for path in paths[3:])
    after = stats(cold.mountpoint)
    assert after["verified_bytes"] - before["verified_bytes"] == 3 * CHUNK  # by the prefetch
    assert after["verifications_skipped"] - before["verifications_skipped"] == 3


def test_o_direct_readers_after_a_remount_read_verified_chunks_once(cold: KvfsMount) -> None:
    """The share of O_DIRECT readers outlives a remount: the first lookups after it, before
    any open, do not read chunks this host verified already (an O_DIRECT reader would read
    them a second time)."""
    paths = store_prompt(cold, 6)  # written here: verified, and the marks outlive the remount
    contents = {path: path.read_bytes() for path in paths}
    for path in paths[:3]:  # readers seen to be O_DIRECT (lookups apart: no burst)
        assert read_direct(path) == contents[path]
        time.sleep(1.2)
    cold.remount()
    drop_caches()
    before = stats(cold.mountpoint)
    look_up(paths[3:])
    time.sleep(1)  # (a prefetch would be done)
    assert all(read_direct(path) == contents[path] for path in paths[3:])
    after = stats(cold.mountpoint)
    assert after["prefetch_bytes"] == before["prefetch_bytes"] == 0
    assert after["verified_bytes"] == before["verified_bytes"], "nothing read twice"
