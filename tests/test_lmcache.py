"""Real LMCache 0.5.6 engines, each in its own process, storing and loading KV through kvfs
(tests/lmcache_engines.py starts them; the `engines` fixture is in conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stats
from lmcache_engines import Engines, assert_exact

KVFS_CLI = Path(sys.executable).parent / "kvfs"


def chunk_files(directory: Path, suffix: str) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(suffix))


def test_fs_plugin_shares_every_chunk_between_engines(kvfs, engines: Engines) -> None:
    base = kvfs.mountpoint / "lmcache"
    writer = engines.run("store", dir=base, chunks=8, kv_seed=11)
    assert writer["errors"] == []
    assert writer["store"] == {**writer["store"], "chunks": 8, "flushed": True}

    files = chunk_files(base, ".data")
    assert len(files) == 8 and len(list(base.iterdir())) == 8  # no .tmp left behind
    assert {f.stat().st_size for f in files} == {writer["chunk_bytes"]}

    reader = engines.run("lookup", "retrieve", dir=base, chunks=8, kv_seed=11)
    assert_exact(reader, 8, {11})


def test_fs_plugin_finds_everything_after_remount_and_crash(kvfs, engines: Engines) -> None:
    base = kvfs.mountpoint / "lmcache"
    writer = engines.run("store", dir=base, chunks=6, kv_seed=21)
    assert writer["errors"] == [] and writer["store"]["flushed"]

    kvfs.remount()
    after_remount = engines.run("lookup", "retrieve", dir=base, chunks=6, kv_seed=21)
    assert_exact(after_remount, 6, {21})

    kvfs.kill9()
    fsck = subprocess.run([str(KVFS_CLI), "fsck", "--data", str(kvfs.data), "--repair"],
                          capture_output=True, text=True, timeout=120)
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    kvfs.mount()
    after_crash = engines.run("lookup", "retrieve", dir=base, chunks=6, kv_seed=21)
    assert_exact(after_crash, 6, {21})
    assert after_crash["retrieve"]["digest"] == after_remount["retrieve"]["digest"]


def test_fs_plugin_concurrent_writers_of_the_same_llama_chunks(make_mount, engines: Engines,
                                                               tmp_path: Path) -> None:
    """Two engines store the same 32 MiB chunks at once; a third reads whole chunks back."""
    kvfs = make_mount("--capacity", "2G")
    base = kvfs.mountpoint / "lmcache"
    common = dict(dir=base, preset="llama-3.1-8b", chunks=4, barrier=tmp_path / "barrier",
                  parties=2)
    writers = [engines.start("store", kv_seed=seed, **common) for seed in (1, 2)]
    for result in map(engines.result, writers):
        assert result["store"]["chunks"] == 4 and result["store"]["flushed"]
        for error in result["errors"]:  # only the second rename of a shared temp name
            assert "No such file or directory" in error and ".tmp' -> '" in error, error

    files = chunk_files(base, ".data")
    assert len(files) == 4 and len(list(base.iterdir())) == 4, sorted(base.iterdir())
    assert {f.stat().st_size for f in files} == {32 * 1024 * 1024}

    reader = engines.run("lookup", "retrieve", dir=base, preset="llama-3.1-8b", chunks=4,
                         verify_seeds="1,2")
    assert_exact(reader, 4, {1, 2})


@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_local_disk_stores_and_reads_back_its_own_chunks(make_mount, engines: Engines,
                                                         odirect: bool) -> None:
    """Also with `use_odirect`: its stores and reads go through the kernel (a pool big
    enough for kernel writers), none through the daemon."""
    kvfs = make_mount("--capacity", "8G")
    directory = kvfs.mountpoint / "local_disk"
    result = engines.run("store", "lookup", "retrieve", backend="local_disk", dir=directory,
                         odirect=odirect, chunks=6, kv_seed=5)
    assert result["store"]["flushed"]
    assert_exact(result, 6, {5})
    files = chunk_files(directory, ".pt")
    assert len(files) == 6 and {f.stat().st_size for f in files} == {result["chunk_bytes"]}
    shown = stats(kvfs.mountpoint)
    if shown["data_path"] == "passthrough":
        assert shown["write_opens_passthrough"] == 6 and shown["write_opens_daemon"] == 0
        assert shown["opens_passthrough"] >= 6 and shown["opens_daemon"] == 0
        assert shown["bytes_read"] == shown["bytes_written"] == 0


@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_local_disk_engines_on_one_directory_read_whole_chunks(kvfs, engines: Engines,
                                                               tmp_path: Path,
                                                               odirect: bool) -> None:
    """Two engines rewrite the same chunk files at once, a third writes its own prompt."""
    common = dict(backend="local_disk", dir=kvfs.mountpoint / "local_disk", odirect=odirect,
                  chunks=4, barrier=tmp_path / "barrier", parties=3)
    ops = ("store", "lookup", "retrieve")
    same_prompt = [engines.start(*ops, kv_seed=seed, verify_seeds="1,2", **common)
                   for seed in (1, 2)]
    other_prompt = engines.start(*ops, prompt_seed=7, kv_seed=3, **common)
    for proc in same_prompt:
        assert_exact(engines.result(proc), 4, {1, 2})
    assert_exact(engines.result(other_prompt), 4, {3})
    assert len(chunk_files(kvfs.mountpoint / "local_disk", ".pt")) == 8
