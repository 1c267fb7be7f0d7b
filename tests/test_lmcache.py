"""Real LMCache 0.5.6 engines, each in its own process, storing and loading KV through kvfs.

Every engine is `python -m kvfs.lmcache_engine` (see that module): the KV bytes of each chunk
are a pure function of a seed, so a reader proves it got exactly a writer's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHUNK_TOKENS = 256
KVFS_CLI = Path(sys.executable).parent / "kvfs"
ENGINE_ENV = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
              "LMCACHE_LOG_LEVEL": "WARNING"}
# LMCache's fs connector writes every key through one shared `<name>.tmp`: when two engines
# store the same chunk at once, the one that renames second finds no `.tmp` (ENOENT, as on any
# filesystem) and logs its put as failed. Harmless: the chunk is whole, one engine's bytes.


class Engines:
    """Starts engine processes and kills, by pid, any still running at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *ops: str, **options: Any) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "kvfs.lmcache_engine", *ops]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False:
                argv += [flag, str(value)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENGINE_ENV)
        self.procs.append(proc)
        return proc

    @staticmethod
    def result(proc: subprocess.Popen[str], timeout: float = 300) -> dict[str, Any]:
        stdout, stderr = proc.communicate(timeout=timeout)
        lines = stdout.strip().splitlines()
        assert lines, f"engine {proc.pid} exited {proc.returncode} without a result:\n" \
                      f"{stderr[-3000:]}"
        return json.loads(lines[-1])

    def run(self, *ops: str, **options: Any) -> dict[str, Any]:
        return self.result(self.start(*ops, **options))

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture
def engines() -> Iterator[Engines]:
    started = Engines()
    yield started
    started.cleanup()


def assert_exact(result: dict[str, Any], chunks: int, seeds: set[int]) -> None:
    """The engine found and loaded every token, each chunk byte-equal to one of `seeds`."""
    assert result["errors"] == []
    assert result["lookup"]["tokens_hit"] == chunks * CHUNK_TOKENS
    loaded = result["retrieve"]
    assert loaded["tokens_hit"] == chunks * CHUNK_TOKENS
    assert loaded["bytes_loaded"] == chunks * result["chunk_bytes"]
    assert set(loaded["chunk_seeds"]) <= seeds, loaded["chunk_seeds"]
    assert loaded["exact"]


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
def test_local_disk_stores_and_reads_back_its_own_chunks(kvfs, engines: Engines,
                                                         odirect: bool) -> None:
    directory = kvfs.mountpoint / "local_disk"
    result = engines.run("store", "lookup", "retrieve", backend="local_disk", dir=directory,
                         odirect=odirect, chunks=6, kv_seed=5)
    assert result["store"]["flushed"]
    assert_exact(result, 6, {5})
    files = chunk_files(directory, ".pt")
    assert len(files) == 6 and {f.stat().st_size for f in files} == {result["chunk_bytes"]}


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
