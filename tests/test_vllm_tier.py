"""vLLM 0.34.0's own filesystem KV tier (its io.py, file_mapper.py and thread_pool.py, run
unchanged by tests/vllm_tier.py) on real kvfs mounts. One process stores and others look up
and load, as vLLM instances sharing a `root_dir` do, with vLLM's 16 + 16 I/O threads and its
O_DIRECT probe; every loaded block is compared with what was stored, byte for byte.

Skipped where set-up could not fetch vLLM's wheel (.venv/vllm-tier missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import KvfsMount, assert_counters_exact, blob_files, drop_caches, stats, wait_for
from test_shared import assert_pool_counters_exact
from vllm_tier import MIB, VLLM_DIR, run_worker, stamped_index

from kvfs.pool.space import HIGH_WATERMARK

BLOCKS = 64  # of 2 MiB (16 tokens of Llama-3.1-8B): 128 MiB per store
JOB_BLOCKS = 4  # the worker's default: blocks per job, as one request's blocks are submitted

pytestmark = pytest.mark.skipif(not VLLM_DIR.is_dir(), reason=f"{VLLM_DIR} is missing: "
                                "set-up could not fetch vLLM's wheel")


def assert_loaded(result: dict[str, Any], indices: list[int]) -> None:
    """Every one of `indices` was a hit and loaded exactly; nothing else was."""
    assert result["errors"] == [] and result["failed"] == [] and result["mismatched"] == []
    assert result["loaded"] == result["hits"] == len(indices)
    asked = range(result["first"], result["first"] + result["blocks"])
    assert sorted(set(asked) - set(result["missing"])) == indices


def at_rest(kvfs: KvfsMount) -> bool:
    """Usage is at or below the high watermark: background eviction has nothing to do."""
    shown = stats(kvfs.mountpoint)
    return shown["used_bytes"] <= HIGH_WATERMARK * shown["capacity_bytes"]


def tier_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def assert_only_blocks(root: Path, blocks: int) -> None:
    """The tier holds `blocks` block files and its config.json: no temp file left behind."""
    files = tier_files(root)
    assert [path.name for path in files if path.suffix != ".bin"] == ["config.json"], files
    assert len(files) == blocks + 1
    assert {path.stat().st_size for path in files if path.suffix == ".bin"} == {2 * MIB}


@pytest.mark.parametrize("buffered", [False, True], ids=["odirect", "buffered"])
def test_blocks_one_instance_stores_another_loads_byte_exact(make_mount,
                                                             buffered: bool) -> None:
    kvfs = make_mount("--capacity", "8G")  # room for kernel writers (a large reserve each)
    root = kvfs.mountpoint / "vllm"
    stored = run_worker("store", root, BLOCKS, seed=7, buffered=buffered)
    assert stored["probe"], "vLLM's O_DIRECT probe succeeds on kvfs"
    assert stored["o_direct"] is not buffered
    assert stored["failed"] == [] and stored["errors"] == []
    assert_only_blocks(root, BLOCKS)
    after_store = stats(kvfs.mountpoint)
    if not buffered and after_store["data_path"] == "passthrough":
        assert after_store["write_opens_passthrough"] > 0, "O_DIRECT stores pass through"

    # At once from another process, then from the volume (verified) on a fresh mount.
    assert_loaded(run_worker("load", root, BLOCKS, seed=7, buffered=buffered),
                  list(range(BLOCKS)))
    kvfs.remount()
    drop_caches()
    loaded = run_worker("load", root, BLOCKS, seed=7, buffered=buffered)
    assert_loaded(loaded, list(range(BLOCKS)))
    assert loaded["o_direct"] is not buffered
    shown = stats(kvfs.mountpoint)
    assert shown["checksum_errors"] == shown["handler_errors"] == 0
    if not buffered and shown["data_path"] == "passthrough":
        assert shown["opens_passthrough"] > 0, "O_DIRECT loads pass through"
    assert_only_blocks(root, BLOCKS)
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_blocks_stored_on_one_host_load_byte_exact_on_another(shared_pool) -> None:
    writer, reader = shared_pool(2, "--capacity", "8G")
    stored = run_worker("store", writer.mountpoint / "vllm", BLOCKS, seed=3)
    assert stored["o_direct"] and stored["failed"] == [] and stored["errors"] == []
    drop_caches()
    loaded = run_worker("load", reader.mountpoint / "vllm", BLOCKS, seed=3)
    assert loaded["o_direct"]
    assert_loaded(loaded, list(range(BLOCKS)))
    assert stats(reader.mountpoint)["checksum_errors"] == 0
    assert_only_blocks(reader.mountpoint / "vllm", BLOCKS)
    for host in (writer, reader):
        assert_pool_counters_exact(host)


def test_past_capacity_lru_evicts_and_every_block_loaded_is_exact(make_mount) -> None:
    """128 MiB of blocks through a 96 MiB pool: 0-31 stored, 0-7 loaded again (hot), then
    32-63 stored. Evicted blocks are misses, in LRU order: 8-31, then 0-7, then 32-63."""
    kvfs = make_mount("--capacity", "96M")
    root = kvfs.mountpoint / "vllm"
    first = run_worker("store", root, 32, seed=5)
    assert first["failed"] == [] and first["errors"] == []
    assert_loaded(run_worker("load", root, 8, seed=5), list(range(8)))
    second = run_worker("store", root, 32, first=32, seed=5)
    for error in second["errors"]:  # a store may fail, cleanly: no room, nothing left behind
        # (ENOSPC, or a write cut short where only part of it fit, as Linux does; vLLM
        # counts that as a failed store and removes its temp file)
        assert "No space left on device" in error or "Short write" in error, error
    assert not [path for path in tier_files(root) if path.name.endswith(".tmp")]
    # The pool at rest: background eviction (above the high watermark) has run, so that no
    # block is evicted between the loader's lookup and its open (a miss vLLM would recompute).
    assert wait_for(lambda: at_rest(kvfs)), stats(kvfs.mountpoint)

    loaded = run_worker("load", root, BLOCKS, seed=5)
    missing = set(loaded["missing"])
    assert (BLOCKS - len(missing)) * 2 * MIB <= 96 * MIB, "the pool holds its capacity"
    evicted = missing - set(second["failed"])
    assert evicted, "past its capacity the pool evicted"
    lru_order = [set(range(8, 32)), set(range(8)), set(range(32, 64)) - set(second["failed"])]
    for older, newer in zip(lru_order, lru_order[1:], strict=False):
        assert not evicted & newer or older <= evicted, f"not LRU: evicted {sorted(evicted)}"
    assert_loaded(loaded, sorted(set(range(BLOCKS)) - missing))
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


@pytest.mark.parametrize("buffered", [False, True], ids=["odirect", "buffered"])
def test_damaged_block_fails_its_load_then_misses_and_others_load_exact(
        kvfs: KvfsMount, buffered: bool) -> None:
    root = kvfs.mountpoint / "vllm"
    assert run_worker("store", root, BLOCKS, seed=9, buffered=buffered)["failed"] == []
    kvfs.remount()
    blobs = {}
    for blob in blob_files(kvfs):
        if blob.stat().st_size == 2 * MIB:
            with open(blob, "rb") as data:
                blobs[stamped_index(data.read(16))] = blob
    assert sorted(blobs) == list(range(BLOCKS))
    victim = 13  # second of its job's four blocks (12-15)
    with open(blobs[victim], "r+b") as data:
        data.seek(MIB + 5)
        data.write(b"\x00\xff")
    drop_caches()

    damaged = run_worker("load", root, BLOCKS, seed=9, buffered=buffered)
    assert damaged["mismatched"] == [], "a damaged block is never served"
    # vLLM's batched load stops at the failing block; the rest of the job is not loaded.
    assert damaged["failed"] == list(range(victim, 16))
    assert damaged["loaded"] == BLOCKS - len(damaged["failed"])
    # EIO at the open's check (passthrough), or a short read where the daemon serves each
    # block (the kernel hands on the part read before the damaged block's EIO)
    assert all("Input/output error" in error or "hort read" in error or "hort-read" in error
               for error in damaged["errors"]), damaged["errors"]
    assert stats(kvfs.mountpoint)["checksum_errors"] == 1
    assert wait_for(lambda: len(tier_files(root)) == BLOCKS), "the damaged block is dropped"

    again = run_worker("load", root, BLOCKS, seed=9, buffered=buffered)
    assert again["missing"] == [victim], "dropped: a miss, recomputed by vLLM"
    assert_loaded(again, [index for index in range(BLOCKS) if index != victim])
    assert_counters_exact(kvfs.mountpoint, kvfs.data)
