"""LMCache 0.5.7's multiprocess-mode `fs` L2 adapter (FSL2Adapter, run unchanged by
tests/lmcache_mp.py) on real kvfs mounts. One process stores and others look up and load, as
MP servers sharing the adapter's base_path do; every loaded chunk is compared with what was
stored, byte for byte.

The adapter stores a key through one fixed temp name, `<name>.tmp` opened with O_TRUNC, then
`os.replace` onto `<name>.data`. Two hosts storing one key at once open the same temp name: on
a plain shared directory their writes go into one file, and the name can hold a file cut short
by the other's O_TRUNC or a mix of their bytes. kvfs gives each open for writing its own staged
copy and commits it whole at close, so a chunk is always one writer's whole bytes.

Skipped where set-up could not fetch LMCache 0.5.7rc2's wheel (.venv/lmcache-0.5.7 missing).
"""

from __future__ import annotations

import re
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
)
from lmcache_mp import LMCACHE_DIR, MIB, chunk_hash, run_worker
from test_shared import assert_pool_counters_exact, fsck, staged_files, unmount_all

CHUNKS = 16
CHUNK_MIB = 4  # small chunks keep the file quick; LMCache's are 32 MiB (256 tokens, TP 1)

pytestmark = pytest.mark.skipif(not LMCACHE_DIR.is_dir(), reason=f"{LMCACHE_DIR} is missing: "
                                "set-up could not fetch LMCache 0.5.7rc2's wheel")


def chunk_name(index: int) -> str:
    """The file FSL2Adapter keeps chunk `index` in (Llama-3.1-8B, TP 1)."""
    return (f"meta-llama-SEP-Llama-3.1-8B-Instruct@0x01000100@0@{chunk_hash(index).hex()}"
            ".data")


def store(base: Path, chunks: int = CHUNKS, **options: Any) -> dict[str, Any]:
    return run_worker("store", base, chunks, chunk_mib=CHUNK_MIB, **options)


def load(base: Path, chunks: int = CHUNKS, **options: Any) -> dict[str, Any]:
    return run_worker("load", base, chunks, chunk_mib=CHUNK_MIB, **options)


def assert_only_chunks(base: Path, names: set[str]) -> None:
    """The directory holds exactly these chunk files, whole: no `<name>.tmp` left behind."""
    listed = {path.name for path in base.iterdir()}
    assert listed == names, f"left over {sorted(listed - names)}, lost {sorted(names - listed)}"
    assert {(base / name).stat().st_size for name in names} == {CHUNK_MIB * MIB}


def assert_loaded(result: dict[str, Any], indices: range | list[int], seeds: set[int]
                  ) -> dict[int, int]:
    """Every one of `indices` was found and loaded as one of `seeds`' whole chunks, nothing
    else was found; the seed of each."""
    assert result["errors"] == [] and result["failed"] == [] and result["mixed"] == {}
    asked = range(result["first"], result["first"] + result["chunks"])
    assert result["missing"] == sorted(set(asked) - set(indices))
    assert result["loaded"] == result["hits"] == len(indices)
    sources = {int(index): seed for index, seed in result["sources"].items()}
    assert sorted(sources) == list(indices) and set(sources.values()) <= seeds, sources
    return sources


def test_chunks_one_server_stores_another_finds_and_loads_byte_exact(kvfs: KvfsMount) -> None:
    base = kvfs.mountpoint / "l2"
    stored = store(base, seed=7)
    assert stored["errors"] == []
    assert stored["outcome"] == {str(index): "stored" for index in range(CHUNKS)}
    assert_only_chunks(base, {chunk_name(index) for index in range(CHUNKS)})

    # At once from another process (misses past the last chunk), then from the volume
    # (verified) on a fresh mount.
    assert_loaded(load(base, CHUNKS + 4, seed=7), range(CHUNKS), {7})
    kvfs.remount()
    drop_caches()
    assert_loaded(load(base, seed=7), range(CHUNKS), {7})

    # Storing again finds every chunk (the adapter's exists) and rewrites none.
    blobs = [(blob.stat().st_ino, blob.stat().st_mtime_ns) for blob in blob_files(kvfs)]
    again = store(base, seed=8)
    assert again["outcome"] == {str(index): "present" for index in range(CHUNKS)}
    assert [(blob.stat().st_ino, blob.stat().st_mtime_ns) for blob in blob_files(kvfs)] == blobs
    shown = stats(kvfs.mountpoint)
    assert shown["checksum_errors"] == shown["handler_errors"] == 0
    assert_only_spares_staged(kvfs.data, kvfs)
    assert_counters_exact(kvfs.mountpoint, kvfs.data)


ROUNDS = 6
RACED = 8  # chunks per round
# What a store of a key that the other host stores at the same moment may log (and count
# failed), each seen in this test:
RACE_ERRORS = (
    # its os.replace finds no temp name: the other host renamed it first (as on any
    # filesystem; kvfs commits this host's bytes, whole, to the file it opened all the same);
    r"FileNotFoundError: .*\.tmp' -> '.*\.data'$",
    # LMCache: after that failure its clean-up's exists(<name>.tmp) then unlink races the
    # other host's rename, and the ENOENT of the unlink escapes as a failed task.
    r"store task \d+ failed: FileNotFoundError: .*\.tmp'$",
)


def test_two_hosts_storing_the_same_chunks_at_once_leave_one_writers_whole_chunk(
        shared_pool, redis_server, tmp_path: Path) -> None:
    """Two hosts of one pool store the same keys with different seeds at the same time, round
    after round (fresh keys each round; one store task per chunk, all submitted at once, so
    both hosts open each key's `<name>.tmp` together): afterwards, on both hosts, every key
    stored loads as exactly one seed's whole chunk, the same on both, never a mix (a key both
    hosts failed to store misses); no `.tmp` is left, the counters equal a recount and fsck
    finds the pool clean."""
    hosts = shared_pool(2, "--capacity", "2G")
    bases = [host.mountpoint / "l2" for host in hosts]
    bases[0].mkdir()
    results: dict[int, dict[str, Any]] = {}

    def writer(host: int) -> None:
        results[host] = store(bases[host], RACED, seed=host + 1, batch=1, rounds=ROUNDS,
                              barrier=tmp_path / "barrier", parties=2)

    threads = [threading.Thread(target=writer, args=(host,)) for host in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [0, 1], "a writer process failed"

    keys = range(ROUNDS * RACED)
    outcome = {host: {int(index): what for round_ in results[host]["rounds"]
                      for index, what in round_["outcome"].items()} for host in (0, 1)}
    for host in (0, 1):
        assert sorted(outcome[host]) == list(keys)
        assert set(outcome[host].values()) <= {"stored", "present", "failed"}
        failed = [index for index, what in outcome[host].items() if what == "failed"]
        assert len(failed) <= len(results[host]["errors"]) <= 2 * len(failed)
        for error in results[host]["errors"]:
            assert any(re.search(known, error) for known in RACE_ERRORS), error

    assert any("present" not in (outcome[0][index], outcome[1][index]) for index in keys), \
        "no key was stored by both hosts at once"

    # Found: exactly the keys a host renamed into place (or found there); a key both hosts
    # failed to store misses. Whole: every one of them one host's chunk, the same on both.
    stored = [index for index in keys if {"stored", "present"} & {outcome[0][index],
                                                                   outcome[1][index]}]
    loaded = [load(base, len(keys), seeds=[1, 2]) for base in bases]
    sources = [assert_loaded(result, stored, {1, 2}) for result in loaded]
    assert sources[0] == sources[1], "both hosts read the same chunk"
    for index in keys:  # a key one host stored and the other found there: the first's
        for host in (0, 1):
            if (outcome[host][index], outcome[1 - host][index]) == ("stored", "present"):
                assert sources[0][index] == host + 1, index

    names = {chunk_name(index) for index in stored}
    for base in bases:
        assert_only_chunks(base, names)
    for host in hosts:
        assert stats(host.mountpoint)["checksum_errors"] == 0
        assert_pool_counters_exact(host)
    assert_only_spares_staged(hosts[0].data, *hosts)
    unmount_all(hosts)
    assert staged_files(hosts[0].data) == []
    checked = fsck(hosts[0].data, redis_server.url)
    assert checked.returncode == 0 and "is clean" in checked.stderr, checked.stderr
