"""SGLang 0.5.23's HiCache `file` storage backend (HiCacheFile and its evictor, run unchanged
by tests/sglang_hicache.py) on real kvfs mounts. One process stores and others look up and
load, as SGLang instances sharing SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR do; every loaded page
is compared with what was stored, byte for byte.

Skipped where set-up could not fetch SGLang's wheel (.venv/sglang-hicache missing).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    KvfsMount,
    assert_counters_exact,
    assert_only_spares_staged,
    blob_files,
    drop_caches,
    stats,
    wait_for,
)
from sglang_hicache import MIB, MODEL, SGLANG_DIR, page_key, run_worker, stamped_page
from test_shared import assert_pool_counters_exact

PAGES = 32
PAGE_MIB = 2  # small pages keep the file quick; SGLang's are 8 MiB (64 tokens, TP 1)

pytestmark = pytest.mark.skipif(not SGLANG_DIR.is_dir(), reason=f"{SGLANG_DIR} is missing: "
                                "set-up could not fetch SGLang's wheel")


def page_name(index: int, tp_rank: int = 0, tp_size: int = 1) -> str:
    """The file HiCacheFile keeps page `index` of a rank in."""
    return f"{page_key(index)}_{MODEL.replace('/', '-')}_{tp_rank}_{tp_size}.bin"


def store(root: Path, pages: int = PAGES, **options: Any) -> dict[str, Any]:
    return run_worker("store", root, pages, page_mib=PAGE_MIB, **options)


def load(root: Path, pages: int = PAGES, **options: Any) -> dict[str, Any]:
    return run_worker("load", root, pages, page_mib=PAGE_MIB, **options)


def assert_loaded(result: dict[str, Any], indices: list[int]) -> None:
    """Every one of `indices` was found and loaded exactly; nothing else was."""
    assert result["errors"] == [] and result["failed"] == [] and result["vanished"] == []
    assert result["mismatched"] == []
    assert result["loaded"] == result["hits"] == len(indices)
    asked = range(result["first"], result["first"] + result["pages"])
    assert sorted(set(asked) - set(result["missing"])) == indices


def assert_only_pages(root: Path, names: set[str]) -> None:
    """The directory holds exactly these page files, whole: no `.<uuid>.tmp` left behind."""
    listed = {path.name for path in root.iterdir()}
    assert listed == names, f"left over {sorted(listed - names)}, lost {sorted(names - listed)}"
    assert {(root / name).stat().st_size for name in names} <= {PAGE_MIB * MIB}


def test_pages_one_instance_stores_another_finds_and_loads_byte_exact(
        kvfs: KvfsMount) -> None:
    root = kvfs.mountpoint / "hicache"
    stored = store(root, seed=7)
    assert stored["failed"] == [] and stored["errors"] == []
    assert_only_pages(root, {page_name(i) for i in range(PAGES)})

    # At once from another process (a miss past the last page), then from the volume
    # (verified) on a fresh mount.
    assert_loaded(load(root, PAGES + 4, seed=7), list(range(PAGES)))
    kvfs.remount()
    drop_caches()
    looked_up = run_worker("lookup", root, PAGES, page_mib=PAGE_MIB)
    assert looked_up["hits"] == PAGES and looked_up["missing"] == []
    assert_loaded(load(root, seed=7), list(range(PAGES)))

    # Storing again finds every page (HiCacheFile's exists) and rewrites none.
    blobs = [(blob.stat().st_ino, blob.stat().st_mtime_ns) for blob in blob_files(kvfs)]
    assert store(root, seed=7)["failed"] == []
    assert [(blob.stat().st_ino, blob.stat().st_mtime_ns) for blob in blob_files(kvfs)] == blobs
    shown = stats(kvfs.mountpoint)
    assert shown["checksum_errors"] == shown["handler_errors"] == 0
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_pages_stored_on_one_host_load_byte_exact_on_another(shared_pool) -> None:
    writer, reader = shared_pool(2, "--capacity", "1G")
    stored = store(writer.mountpoint / "hicache", seed=3)
    assert stored["failed"] == [] and stored["errors"] == []
    drop_caches()
    assert_loaded(load(reader.mountpoint / "hicache", seed=3), list(range(PAGES)))
    assert stats(reader.mountpoint)["checksum_errors"] == 0
    assert_only_pages(reader.mountpoint / "hicache", {page_name(i) for i in range(PAGES)})
    for host in (writer, reader):
        assert_pool_counters_exact(host)


def test_two_ranks_past_capacity_lru_evicts_and_every_page_loaded_is_exact(
        make_mount) -> None:
    """Two TP ranks, 64 MiB each, through a 96 MiB pool: rank 0 stores pages 0-31, loads 0-7
    again (hot), then rank 1 stores its 0-31. Evicted pages are misses, in LRU order: rank 0's
    8-31, then its 0-7, then rank 1's."""
    capacity = 96 * MIB
    kvfs = make_mount("--capacity", "96M")
    root = kvfs.mountpoint / "hicache"
    first = store(root, tp_rank=0, tp_size=2, seed=5)
    assert first["failed"] == [] and first["errors"] == []
    assert_loaded(load(root, 8, tp_rank=0, tp_size=2, seed=5), list(range(8)))
    second = store(root, tp_rank=1, tp_size=2, seed=5)
    for error in second["errors"]:  # a store may fail, cleanly: no room, nothing left behind
        # (ENOSPC, or numpy's tofile finding a write cut short where only part of it fit;
        # HiCacheFile logs it, removes its temp file and counts the page not stored)
        assert "No space left on device" in error or "requested and" in error, error
    assert stats(kvfs.mountpoint)["used_bytes"] <= capacity

    loaded = [load(root, tp_rank=rank, tp_size=2, seed=5) for rank in (0, 1)]
    held = {(rank, index) for rank in (0, 1) for index in range(PAGES)
            if index not in loaded[rank]["missing"]}
    assert len(held) * PAGE_MIB * MIB <= capacity, "the pool holds its capacity"
    evicted = {(0, index) for index in loaded[0]["missing"]} | {
        (1, index) for index in set(loaded[1]["missing"]) - set(second["failed"])}
    assert evicted, "past its capacity the pool evicted"
    lru_order = [{(0, i) for i in range(8, PAGES)}, {(0, i) for i in range(8)},
                 {(1, i) for i in range(PAGES) if i not in second["failed"]}]
    for older, newer in zip(lru_order, lru_order[1:], strict=False):
        assert not evicted & newer or older <= evicted, f"not LRU: evicted {sorted(evicted)}"
    for rank in (0, 1):
        assert_loaded(loaded[rank], sorted(index for r, index in held if r == rank))
    assert_only_pages(root, {page_name(index, rank, 2) for rank, index in held})
    assert stats(kvfs.mountpoint)["used_bytes"] <= capacity
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_damaged_page_fails_its_load_then_misses_and_others_load_exact(
        kvfs: KvfsMount) -> None:
    root = kvfs.mountpoint / "hicache"
    assert store(root, seed=9)["failed"] == []
    kvfs.remount()
    blobs = {}
    for blob in blob_files(kvfs):
        with open(blob, "rb") as data:
            blobs[stamped_page(data.read(24))] = blob
    assert sorted(blobs) == [(index, 0) for index in range(PAGES)]
    victim = 13
    with open(blobs[victim, 0], "r+b") as data:
        data.seek(MIB + 5)
        data.write(b"\x00\xff")
    drop_caches()

    damaged = load(root, seed=9)
    assert damaged["mismatched"] == [], "a damaged page is never served"
    assert damaged["failed"] + damaged["vanished"] == [victim]
    assert damaged["loaded"] == PAGES - 1
    # EIO at the open's check (passthrough), or a short read where the daemon serves the
    # page (the kernel hands on the part read before the damaged block's EIO): get raises,
    # and SGLang's controller counts the batch a miss. Or, where the prefetch that the
    # lookups started found the damage first and dropped the page, get finds no file: a miss.
    (error,) = damaged["errors"]
    assert ("Input/output error" in error or "Short read" in error if damaged["failed"]
            else "Failed to fetch" in error), error
    assert stats(kvfs.mountpoint)["checksum_errors"] == 1
    assert wait_for(lambda: len(list(root.iterdir())) == PAGES - 1), "the page is dropped"

    again = load(root, seed=9)
    assert again["missing"] == [victim], "dropped: a miss, recomputed by SGLang"
    assert_loaded(again, [index for index in range(PAGES) if index != victim])
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


def test_temp_names_never_remain_after_two_ranks_store_at_once(kvfs: KvfsMount) -> None:
    """Two TP ranks store into one directory at once (each a `.<uuid>.tmp` per page, renamed
    over its page): afterwards the directory lists the pages only, on the mount and after a
    remount, and the volume holds their blobs and nothing staged but the spares."""
    root = kvfs.mountpoint / "hicache"
    root.mkdir()
    results: dict[int, dict[str, Any]] = {}
    ranks = [threading.Thread(target=lambda rank=rank: results.__setitem__(
        rank, store(root, tp_rank=rank, tp_size=2, seed=rank))) for rank in (0, 1)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert all(results[rank]["failed"] == [] == results[rank]["errors"] for rank in (0, 1))
    names = {page_name(index, rank, 2) for rank in (0, 1) for index in range(PAGES)}
    assert_only_pages(root, names)
    assert len(blob_files(kvfs)) == 2 * PAGES
    assert_only_spares_staged(kvfs.data, kvfs)
    kvfs.remount()
    assert_only_pages(root, names)
    for rank in (0, 1):
        assert_loaded(load(root, tp_rank=rank, tp_size=2, seed=rank), list(range(PAGES)))
    assert_counters_exact(kvfs.mountpoint, kvfs.data)
