"""Benchmark kvfs against the plain backing directory, side by side, on the same disk.

    .venv/bin/python scripts/bench.py [--quick] [--only GROUP ...] [--out bench-results/NAME.json]

Needs root (drop_caches, kvfs's sysfs tuning) and fio. One kvfs volume and one plain directory
live under the work directory (default bench-work/ in the repository, so both are on the same
filesystem) and get the same bytes; every benchmark runs on both in the same run, alternating,
and reports the median of --runs runs and the ratio kvfs/plain (the median of the runs'
ratios: each run measures both sides back to back). Everything is unmounted and
removed at the end, also after an error or Ctrl-C. Results are printed and saved as JSON.

These machines are Firecracker VMs with free page reporting: memory idle for a few seconds goes
back to the host and the next touch costs a host fault, so the first side to grow the page cache
can be several times slower. Runs therefore alternate which side goes first, and each timed
write follows an untimed write of the same size that is deleted at once, so both sides write
into memory that was just in use.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from bench_io import (
    CHUNK_BYTES,
    ENGINE,
    MIB,
    REPO,
    KvfsMount,
    Span,
    create_small_files,
    drop_caches,
    evict_file_pages,
    fio_bandwidth,
    kv_name,
    list_directory,
    lmcache_lookup_and_load,
    lmcache_store,
    look_up_then_load,
    make_empty_files,
    make_tree,
    read_files,
    run_cleaning_up,
    run_engine,
    save_report,
    stat_paths,
    walk_tree,
    warm_files,
    write_files,
)
from lmcache_mp import LMCACHE_DIR
from lmcache_mp import run_worker as run_lmcache_mp
from rich.console import Console
from rich.table import Table
from sglang_hicache import SGLANG_DIR
from sglang_hicache import run_worker as run_sglang
from vllm_tier import VLLM_DIR, run_worker

from kvfs.data.verify import HASH_QUIET_SECONDS

CONSOLE = Console()
PROCESSES = multiprocessing.get_context("forkserver")
TARGETS = ("plain", "kvfs")
MISSING_BASE = 10**12  # kv_name indices from here on are never created
REPEATED_HITS = "stat existing names, repeated at once (kernel-cached)"
REPEATED_MISSES = "stat missing names, repeated at once (kernel-cached)"
# --only names -> Bench methods, in the order a full run takes them.
GROUPS = {"cold-read": "cold_read", "warm-read": "warm_and_hot_read",
          "concurrent-readers": "concurrent_readers", "daemon-memory": "daemon_memory",
          "write": "write", "lmcache-pattern": "lmcache_pattern", "fio": "fio",
          "lmcache-engines": "lmcache_engines", "lmcache-local-disk": "lmcache_local_disk",
          "lmcache-mp": "lmcache_mp", "vllm": "vllm_tier", "sglang": "sglang_hicache",
          "small-files": "small_file_commits", "metadata": "metadata_and_scaling",
          "cold-prompt": "cold_prompt"}
READS_DATA_SET = {"cold-read", "warm-read", "concurrent-readers", "daemon-memory",
                  "cold-prompt"}
COLD_PROMPT = "cold prompt: lookups, then loads (another host wrote it)"
PROMPT_GAPS = (0.2, 0.0)  # seconds between a prompt's lookups and its loads
LOCAL_DISK_SECTION = "real LMCache engine, local_disk backend, use_odirect (one process)"
VLLM_SECTION = "vLLM fs tier (its own io.py, 16 threads, separate processes)"
VLLM_CONFIGS = tuple((block_mib, buffered) for block_mib in (2, 32) for buffered in (False, True))
VLLM_JOBS = 32  # jobs per store or load (requests of data_bytes / 32): all 16 threads busy
VLLM_LOOKUP = "first lookups on a fresh mount (os.path.exists)"
# The 2 MiB O_DIRECT store alone, measured on both sides in turn this many times (quick: 3):
# its run-to-run swing on these VMs (plain 1.2-2.7 GB/s) outweighs three pairs.
VLLM_STORE_PAIRS = 8
VLLM_STORES = "2 MiB blocks, O_DIRECT: store, back to back"
MP_SECTION = "LMCache 0.5.7 MP server's fs L2 adapter (its own code, separate processes)"
MP_CHUNK_MIB = 32  # LMCache's chunk: 256 tokens of Llama-3.1-8B, fp16, TP 1
SGLANG_SECTION = "SGLang HiCache file backend (its own HiCacheFile, separate processes)"
SGLANG_PAGE_MIB = 8  # a page of Llama-3.1-8B bf16, 64 tokens, TP 1
TREE_FILES_EACH = 4  # files per directory of the walked tree
TREE_WALKS = (("du -s", ["du", "-s", "{root}"]),
              ("find -size +1", ["find", "{root}", "-size", "+1"]),
              ("ls -lR", ["ls", "-lR", "{root}"]))


def vllm_config(block_mib: int, buffered: bool) -> str:
    return f"{block_mib} MiB blocks, {'buffered' if buffered else 'O_DIRECT'}"


def in_turn(run: int) -> tuple[str, ...]:
    """Both targets, the first one alternating between runs."""
    return TARGETS if run % 2 == 0 else TARGETS[::-1]


@dataclass(frozen=True)
class Plan:
    quick: bool
    runs: int
    chunk_files: int  # 32 MiB files in the read/write data set
    meta_files: int  # directory size at which stat rates and readdir are measured
    stat_sample: int  # names stat()ed per measurement
    small_files: int  # files per create-and-commit run
    scale_counts: tuple[int, ...]
    engine_runs: int
    engine_chunks: int
    fio_bytes: int
    rss_passes: int  # reads of the whole data set through one daemon
    cache_bytes: int
    populate_limit_s: float  # give up on a scaling step whose creation would take longer
    tree_directories: int  # directories of the tree that du, find and ls -lR walk

    @classmethod
    def make(cls, quick: bool, runs: int, cache_bytes: int) -> Plan:
        if quick:
            return cls(quick, runs, chunk_files=8, meta_files=10_000, stat_sample=2_000,
                       small_files=500, scale_counts=(1_000, 10_000), engine_runs=1,
                       engine_chunks=4, fio_bytes=256 * MIB, rss_passes=3,
                       cache_bytes=cache_bytes, populate_limit_s=60, tree_directories=1_024)
        return cls(quick, runs, chunk_files=32, meta_files=100_000, stat_sample=10_000,
                   small_files=2_000, scale_counts=(1_000, 10_000, 100_000, 1_000_000),
                   engine_runs=runs, engine_chunks=8, fio_bytes=1024 * MIB, rss_passes=4,
                   cache_bytes=cache_bytes, populate_limit_s=600, tree_directories=4_096)

    @property
    def data_bytes(self) -> int:
        return self.chunk_files * CHUNK_BYTES


@dataclass
class Metric:
    section: str
    name: str
    unit: str
    higher_is_better: bool
    runs: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TARGETS})

    def median(self, target: str) -> float | None:
        values = self.runs[target]
        return statistics.median(values) if values else None

    @property
    def ratio(self) -> float | None:
        """kvfs / plain: the median of each run's ratio where every run measured both (a
        run's two sides ran back to back: the VM's drift between runs cancels), else the
        ratio of the medians."""
        plain, kvfs = self.runs["plain"], self.runs["kvfs"]
        if plain and len(plain) == len(kvfs) and all(plain):
            return statistics.median(k / p for k, p in zip(kvfs, plain, strict=True))
        plain_median, kvfs_median = self.median("plain"), self.median("kvfs")
        return (kvfs_median / plain_median if plain_median and kvfs_median is not None
                else None)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "median": {t: self.median(t) for t in TARGETS},
                "ratio_kvfs_plain": self.ratio}


@dataclass(frozen=True)
class Check:
    name: str
    target: str
    measured: str
    ok: bool | None  # None: could not be measured


class RssSampler:
    """Samples the kvfs daemon's RSS (whichever daemon is current) and keeps the peak per phase:
    all of it, and its private part (less file pages it maps: LMDB's map of the metadata,
    page cache the kernel may drop, grows with the names the volume holds)."""

    def __init__(self, mount: KvfsMount) -> None:
        self.mount = mount
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.private_peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            pid = self.mount.pid
            if not pid:
                continue
            try:
                memory = psutil.Process(pid).memory_info()
            except psutil.Error:
                continue
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), memory.rss)
            private = memory.rss - memory.shared  # (Linux: shared is RssFile + RssShmem)
            self.private_peaks[self.phase] = max(self.private_peaks.get(self.phase, 0), private)


def in_processes(worker: Callable[..., Any], calls: list[tuple[Any, ...]]) -> list[Any]:
    """Run worker(*call, start_at) in one new process per call, all starting together."""
    with PROCESSES.Pool(len(calls)) as pool:
        start_at = time.perf_counter() + 0.1
        return pool.starmap(worker, [(*call, start_at) for call in calls])


def throughput(spans: list[Span]) -> float:
    """Work per second over all spans together (first start to last end)."""
    return sum(s.amount for s in spans) / (max(s.end for s in spans) - min(s.start for s in spans))


class Bench:
    def __init__(self, plan: Plan, workdir: Path, groups: list[str],
                 mount_options: list[str]) -> None:
        self.plan = plan
        self.groups = groups
        self.workdir = workdir
        self.plain = workdir / "plain"
        self.mount_options = ["--cache-size", str(plan.cache_bytes), *mount_options]
        self.kvfs = KvfsMount(workdir / "kvfs-data", workdir / "mnt", self.mount_options)
        self.roots = {"plain": self.plain, "kvfs": self.kvfs.mountpoint}
        self.metrics: dict[tuple[str, str], Metric] = {}
        self.notes: list[str] = []
        self.populate: list[dict[str, Any]] = []
        self.rss = RssSampler(self.kvfs)
        self.section = ""
        self.sections: set[str] = set()  # those whose stages ran

    # -- bookkeeping ---------------------------------------------------------------------

    def record(self, name: str, unit: str, target: str, value: float,
               higher_is_better: bool = True) -> None:
        metric = self.metrics.setdefault((self.section, name),
                                         Metric(self.section, name, unit, higher_is_better))
        metric.runs[target].append(value)

    def note(self, text: str) -> None:
        self.notes.append(text)
        CONSOLE.log(f"[yellow]note:[/] {text}")

    @contextmanager
    def stage(self, label: str, section: str | None = None) -> Iterator[None]:
        """Show progress of one stage; its metrics go to `section` (default: the label)."""
        self.section = section or label
        self.sections.add(self.section)
        self.rss.phase = label
        started = time.monotonic()
        with CONSOLE.status(f"[bold]{label}[/] …"):
            yield
        CONSOLE.log(f"[green]done[/] {label} ({time.monotonic() - started:.0f} s)")

    def progress(self, text: str) -> None:
        CONSOLE.log(f"  {self.section}: {text}")

    def chunk_paths(self, target: str) -> list[str]:
        return [str(self.roots[target] / "chunks" / f"chunk-{i:03d}")
                for i in range(self.plan.chunk_files)]

    def blob_files(self) -> list[Path]:
        return sorted((self.kvfs.data / "blobs").glob("*/*"))

    def warm_up_writes(self, target: str) -> None:
        """Write and delete as many bytes as the timed write will (see the module docstring)."""
        directory = self.roots[target] / "warm-up"
        directory.mkdir()
        in_processes(write_files, [([str(directory / f"chunk-{i:03d}")
                                     for i in range(self.plan.chunk_files)],)])
        shutil.rmtree(directory)

    def warm_backing(self) -> None:
        """Backing data in the page cache, kvfs's own caches (daemon and FUSE pages) empty."""
        warm_files([Path(p) for p in self.chunk_paths("plain")] + self.blob_files())
        self.kvfs.remount()

    # -- the suite -----------------------------------------------------------------------

    def setup(self) -> None:
        for path in (self.plain / "chunks", self.kvfs.data, self.kvfs.mountpoint):
            path.mkdir(parents=True, exist_ok=True)
        self.kvfs.mount()
        self.rss.start()
        if not READS_DATA_SET & set(self.groups):
            return
        (self.kvfs.mountpoint / "chunks").mkdir()
        with self.stage("data set"):
            for target in TARGETS:
                in_processes(write_files, [(self.chunk_paths(target),)])
            self.progress(f"{self.plan.chunk_files} files of 32 MiB on each side")

    def run(self) -> None:
        self.setup()
        for group in self.groups:
            getattr(self, GROUPS[group])()

    def cold_read(self) -> None:
        with self.stage("cold read"):
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    if target == "kvfs":
                        self.kvfs.remount()
                    drop_caches()
                    cpu = self.daemon_cpu()
                    gbps = throughput(in_processes(read_files, [(self.chunk_paths(target),)]))
                    self.record("cold read, 32 MiB files (from disk)", "GB/s", target, gbps / 1e9)
                    if target == "kvfs":
                        self.record("daemon CPU per GiB of cold reads", "s", "kvfs",
                                    (self.daemon_cpu() - cpu) / (self.plan.data_bytes / 2**30),
                                    higher_is_better=False)
                    self.progress(f"run {run + 1}: {target} {gbps / 1e9:.2f} GB/s")

    def warm_and_hot_read(self) -> None:
        with self.stage("warm-backing and hot read"):
            for run in range(self.plan.runs):
                self.warm_backing()
                for target in in_turn(run):
                    paths = self.chunk_paths(target)
                    cpu = self.daemon_cpu()
                    warm = throughput(in_processes(read_files, [(paths,)]))
                    if target == "kvfs":
                        self.record("daemon CPU per GiB of warm-backing reads", "s", "kvfs",
                                    (self.daemon_cpu() - cpu) / (self.plan.data_bytes / 2**30),
                                    higher_is_better=False)
                    hot = throughput(in_processes(read_files, [(paths,)]))
                    # kvfs serves a version's first read past the page cache and keeps it there
                    # from the second on: the third read is the first served by the kernel.
                    kept = throughput(in_processes(read_files, [(paths,)]))
                    self.record("warm-backing read (backing in page cache, kvfs caches cold)",
                                "GB/s", target, warm / 1e9)
                    self.record("hot re-read from another process", "GB/s", target, hot / 1e9)
                    self.record("third read (kvfs: page cache kept)", "GB/s", target, kept / 1e9)
                    self.progress(f"run {run + 1}: {target} warm {warm / 1e9:.2f}, "
                                  f"hot {hot / 1e9:.2f}, third {kept / 1e9:.2f} GB/s")

    def concurrent_readers(self) -> None:
        with self.stage("concurrent readers (warm backing)"):
            for readers in (2, 4, 8):
                for same in (False, True):
                    name = (f"{readers} readers, {'same' if same else 'different'} files, total")
                    for run in range(self.plan.runs):
                        self.warm_backing()
                        for target in in_turn(run):
                            paths = self.chunk_paths(target)
                            share = paths[: len(paths) // readers]
                            calls = [(share if same else paths[i::readers],)
                                     for i in range(readers)]
                            gbps = throughput(in_processes(read_files, calls))
                            self.record(name, "GB/s", target, gbps / 1e9)
                    self.progress(f"{name}: ratio {self.metrics[(self.section, name)].ratio:.2f}")

    def daemon_cpu(self) -> float:
        """CPU seconds the kvfs daemon has used so far (all its threads)."""
        times = psutil.Process(self.kvfs.pid).cpu_times()
        return times.user + times.system

    def settled_daemon_cpu(self) -> float:
        """daemon_cpu() once the daemon is idle: what it does after a writer's close (sums of
        blobs the kernel wrote) counts against those writes, not against what comes next.
        Those sums wait until writers have been quiet for HASH_QUIET_SECONDS first."""
        deadline = time.monotonic() + 30
        time.sleep(HASH_QUIET_SECONDS)
        before = self.daemon_cpu()
        while True:
            time.sleep(0.2)
            now = self.daemon_cpu()
            if now - before < 0.01 or time.monotonic() > deadline:
                return now
            before = now

    def daemon_memory(self) -> None:
        with self.stage("daemon memory"):
            self.warm_backing()
            paths = self.chunk_paths("kvfs")
            baseline = psutil.Process(self.kvfs.pid).memory_info().rss
            self.rss.peaks.pop(self.section, None)
            for _ in range(self.plan.rss_passes):
                evict_file_pages([Path(p) for p in paths])  # every pass through the daemon
                in_processes(read_files, [(paths,)])
            time.sleep(0.05)
            peak = self.rss.peaks[self.section]
            read_gib = self.plan.rss_passes * self.plan.data_bytes / 2**30
            self.record(f"daemon RSS peak reading {read_gib:.0f} GiB "
                        f"(--cache-size {self.plan.cache_bytes / MIB:.0f} MiB)",
                        "MiB", "kvfs", peak / MIB, higher_is_better=False)
            self.record("daemon RSS after mount", "MiB", "kvfs", baseline / MIB,
                        higher_is_better=False)
            self.progress(f"RSS {baseline / MIB:.0f} MiB after mount, peak {peak / MIB:.0f} MiB")

    def write(self) -> None:
        with self.stage("write"):
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    directory = self.roots[target] / f"write-{run}"
                    directory.mkdir()
                    paths = [str(directory / f"chunk-{i:03d}")
                             for i in range(self.plan.chunk_files)]
                    self.warm_up_writes(target)
                    gbps = throughput(in_processes(write_files, [(paths,)]))
                    self.record("write 32 MiB files (one write() + close)", "GB/s", target,
                                gbps / 1e9)
                    shutil.rmtree(directory)
                    self.progress(f"run {run + 1}: {target} {gbps / 1e9:.2f} GB/s")

    def cold_start(self, target: str) -> None:
        """Nothing of the data set in memory; on kvfs, nothing verified on this host either,
        as when another host wrote it (the marks a clean unmount keeps are removed)."""
        if target == "kvfs":
            self.kvfs.unmount()
            for marks in self.kvfs.data.glob("verified*"):
                marks.unlink()
            self.kvfs.mount()
        drop_caches()

    def cold_prompt(self) -> None:
        """Prefetch from lookups (kvfs/files/prefetch.py): a prompt's chunks looked up, then loaded
        after a gap or at once; and real LMCache engines, B retrieving A's prefix cold."""
        with self.stage(COLD_PROMPT):
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    for gap in PROMPT_GAPS:
                        self.cold_start(target)
                        before = self.kvfs_stats() if target == "kvfs" else {}
                        [span] = in_processes(look_up_then_load,
                                              [(self.chunk_paths(target), gap)])
                        self.record(prompt_metric(gap), "GB/s", target,
                                    throughput([span]) / 1e9)
                        if target == "kvfs":
                            self.record_waste(before)
                    self.cold_start(target)
                    for command in (["du", "-s"], ["ls", "-lR"]):  # (the chunks, not the
                        # metadata group's million names: minutes of ls -lR per run)
                        subprocess.run([*command, str(self.roots[target] / "chunks")],
                                       check=True, capture_output=True)
                    if target == "kvfs":
                        after = self.kvfs_stats()
                        self.record("chunk bytes read by ls -lR and du of a cold pool", "MiB",
                                    "kvfs", after["verified_bytes"] / MIB, higher_is_better=False)
                self.progress(f"run {run + 1} done")
            if ENGINE.exists():
                self.cold_engine_retrieve()

    def cold_engine_retrieve(self) -> None:
        chunks = self.plan.engine_chunks
        for run in range(self.plan.engine_runs):
            for target in in_turn(run):
                directory = self.roots[target] / f"cold-engine-{run}"
                directory.mkdir()
                try:
                    run_engine(["store"], directory, chunks)
                    self.cold_start(target)
                    loaded = run_engine(["lookup", "retrieve"], directory, chunks)
                except (RuntimeError, KeyError, ValueError) as error:
                    self.note(f"cold LMCache engine run failed on {target}: {error}")
                    return
                finally:
                    shutil.rmtree(directory)
                self.record("LMCache engine B retrieves A's prefix cold", "GB/s", target,
                            loaded["retrieve"]["gbps"])
            self.progress(f"engines, run {run + 1} done")

    def kvfs_stats(self) -> dict[str, Any]:
        return json.loads((self.kvfs.mountpoint / ".kvfs" / "stats").read_text())

    def record_waste(self, before: dict[str, Any]) -> None:
        """Prefetched bytes no reader opened (wasted ones count after a minute: here, the
        prefetched bytes not yet opened at the end of the load)."""
        after = self.kvfs_stats()
        fetched = after["prefetch_bytes"] - before["prefetch_bytes"]
        used = after["prefetch_used_bytes"] - before["prefetch_used_bytes"]
        self.record("prefetched bytes never opened", "%", "kvfs",
                    100 * (fetched - used) / fetched if fetched else 0.0,
                    higher_is_better=False)

    def lmcache_pattern(self) -> None:
        with self.stage("LMCache fs-plugin pattern"):
            names = [kv_name(i).removesuffix(".data") for i in range(self.plan.chunk_files)]
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    directory = self.roots[target] / f"lmcache-{run}"
                    directory.mkdir()
                    self.warm_up_writes(target)
                    store = in_processes(lmcache_store, [(str(directory), names)])
                    [(lookup, load)] = in_processes(lmcache_lookup_and_load,
                                                    [(str(directory), names)])
                    self.record("store: write <key>.tmp + rename to <key>.data", "GB/s", target,
                                throughput(store) / 1e9)
                    self.record("other process: stat every key", "µs", target,
                                statistics.median(lookup.latencies) * 1e6,
                                higher_is_better=False)
                    self.record("other process: read every chunk back", "GB/s", target,
                                throughput([load]) / 1e9)
                    shutil.rmtree(directory)
                self.progress(f"run {run + 1} done")

    def fio(self) -> None:
        with self.stage("fio sequential, 1 MiB blocks"):
            size = self.plan.fio_bytes
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    root = self.roots[target]
                    name = f"fio-{run}"
                    self.warm_up_writes(target)
                    written = fio_bandwidth(root, name, "write", size)
                    if target == "kvfs":
                        self.kvfs.remount()
                    drop_caches()
                    read = fio_bandwidth(root, name, "read", size)
                    (root / name).unlink()
                    self.record(f"fio write {size / 2**30:g} GiB", "GB/s", target, written / 1e9)
                    self.record(f"fio read {size / 2**30:g} GiB (cold)", "GB/s", target, read / 1e9)
                    self.progress(f"run {run + 1}: {target} write {written / 1e9:.2f}, "
                                  f"read {read / 1e9:.2f} GB/s")

    def lmcache_engines(self) -> None:
        with self.stage("real LMCache engines (fs plugin)"):
            if not ENGINE.exists():
                self.note(f"{ENGINE.relative_to(REPO)} does not exist yet: LMCache engine "
                          f"benchmarks skipped")
                return
            chunks = self.plan.engine_chunks
            for run in range(self.plan.engine_runs):
                for target in in_turn(run):
                    report = self.engine_report(target, run, f"engine-{run}", chunks,
                                                [["store"], ["lookup", "retrieve"]])
                    if report is None:
                        return
                    self.record(f"engine A store, {chunks} chunks of 32 MiB", "GB/s", target,
                                report["store"]["bytes"] / report["store"]["seconds"] / 1e9)
                    self.record("engine B lookup", "ms", target,
                                report["lookup"]["seconds"] * 1e3, higher_is_better=False)
                    self.record("engine B retrieve", "GB/s", target, report["retrieve"]["gbps"])
                self.progress(f"run {run + 1} done")

    def lmcache_local_disk(self) -> None:
        """LMCache's local_disk backend with O_DIRECT: it finds only what its own process
        stored, so one engine stores, looks up and retrieves (twice the fs group's chunks)."""
        with self.stage(LOCAL_DISK_SECTION):
            chunks = 2 * self.plan.engine_chunks
            for run in range(self.plan.engine_runs):
                for target in in_turn(run):
                    report = self.engine_report(target, run, f"local-disk-{run}", chunks,
                                                [["store", "lookup", "retrieve"]],
                                                "local_disk", "--odirect")
                    if report is None:
                        return
                    self.record("store, 32 MiB chunks", "GB/s", target,
                                report["store"]["bytes"] / report["store"]["seconds"] / 1e9)
                    self.record("retrieve", "GB/s", target, report["retrieve"]["gbps"])
                self.progress(f"run {run + 1} done")

    def engine_report(self, target: str, run: int, name: str, chunks: int,
                      processes: list[list[str]], *backend: str) -> dict[str, Any] | None:
        """Real LMCache engine processes in turn (tests/lmcache_engine.py, one list of ops
        each) in a fresh directory of `target`: their reports merged, or None (noted) if one
        failed. A retrieve that was not exact is noted."""
        directory = self.roots[target] / name
        directory.mkdir()
        try:
            report = {key: value for ops in processes
                      for key, value in run_engine(ops, directory, chunks, *backend).items()}
            retrieved = report["retrieve"]
        except (RuntimeError, KeyError, ValueError) as error:
            self.note(f"LMCache engine run ({' '.join(backend) or 'fs'}) failed on {target}: "
                      f"{error}; its benchmarks skipped")
            return None
        finally:
            shutil.rmtree(directory)
        if not retrieved["exact"]:
            self.note(f"engine run {run + 1} on {target}: retrieve not exact "
                      f"({retrieved['tokens_hit']} tokens hit)")
        return report

    def vllm_tier(self) -> None:
        """vLLM's own fs tier (tests/vllm_tier.py): one process stores, then, on a fresh
        mount, others look up, load cold (page cache dropped) and load again (warm)."""
        with self.stage(VLLM_SECTION):
            if not VLLM_DIR.is_dir():
                self.note(f"{VLLM_DIR} is missing (scripts/setup.sh fetches it): vLLM tier "
                          f"benchmarks skipped")
                return
            for block_mib, buffered in VLLM_CONFIGS:
                for run in range(self.plan.runs):
                    for target in in_turn(run):
                        self.vllm_run(block_mib, buffered, run, target)
                    self.progress(f"{vllm_config(block_mib, buffered)}: run {run + 1} done")
            self.vllm_stores()

    def vllm_stores(self) -> None:
        """The 2 MiB O_DIRECT store alone, both sides in turn, VLLM_STORE_PAIRS times (each
        after its warm-up write): the pairs' ratios decide what three runs cannot."""
        blocks = self.plan.data_bytes // (2 * MIB)
        options = dict(block_mib=2, job_blocks=max(1, blocks // VLLM_JOBS), buffered=False)
        for pair in range(3 if self.plan.quick else VLLM_STORE_PAIRS):
            for target in in_turn(pair):
                root = self.roots[target] / f"vllm-pair-{pair}"
                self.warm_up_writes(target)
                self.settled_daemon_cpu()
                report = run_worker("store", root, blocks, seed=pair, **options)
                self.record(VLLM_STORES, "GB/s", target,
                            self.plan.data_bytes / report["seconds"] / 1e9)
                shutil.rmtree(root)
        self.progress(f"{VLLM_STORES}: ratio {self.metrics[(self.section, VLLM_STORES)].ratio:.2f}")

    def vllm_run(self, block_mib: int, buffered: bool, run: int, target: str) -> None:
        config = vllm_config(block_mib, buffered)
        blocks = self.plan.data_bytes // (block_mib * MIB)
        root = self.roots[target] / f"vllm-{run}"
        options = dict(block_mib=block_mib, job_blocks=max(1, blocks // VLLM_JOBS),
                       buffered=buffered, seed=run)
        self.warm_up_writes(target)
        cpu = self.settled_daemon_cpu()
        reports = {"store": run_worker("store", root, blocks, **options)}
        cpu_used = self.settled_daemon_cpu() - cpu
        if target == "kvfs":
            self.kvfs.remount()
        drop_caches(2)
        reports["lookup"] = run_worker("lookup", root, blocks, **options)
        drop_caches()
        cpu = self.settled_daemon_cpu()
        reports["cold load"] = run_worker("load", root, blocks, **options)
        reports["warm load"] = run_worker("load", root, blocks, **options)
        cpu_used += self.settled_daemon_cpu() - cpu
        shutil.rmtree(root)
        for op, report in reports.items():
            problems = {key: len(report[key]) for key in ("missing", "failed", "mismatched",
                                                          "errors") if report.get(key)}
            if report["o_direct"] == buffered:
                problems["o_direct"] = report["o_direct"]
            if problems:
                self.note(f"vLLM tier {config}, run {run + 1} on {target}, {op}: {problems}")
        for op in ("store", "cold load", "warm load"):
            self.record(f"{config}: {op}", "GB/s", target,
                        self.plan.data_bytes / reports[op]["seconds"] / 1e9)
        self.record(f"{config}: {VLLM_LOOKUP}", "µs", target,
                    reports["lookup"]["lookup_seconds"] / blocks * 1e6, higher_is_better=False)
        if target == "kvfs":
            self.record(f"daemon CPU per GiB moved (store, cold and warm load), {config}", "s",
                        target, cpu_used / (3 * self.plan.data_bytes / 2**30),
                        higher_is_better=False)

    def lmcache_mp(self) -> None:
        """LMCache MP mode's `fs` L2 adapter (tests/lmcache_mp.py): one process stores the data
        set as one store task of 32 MiB chunks; then, on a fresh mount, another looks them up
        and loads them cold (page cache dropped) and again (warm)."""
        def problems(op: str, report: dict[str, Any]) -> dict[str, Any]:
            found = {key: report[key] for key in ("errors", "missing", "failed", "mixed")
                     if report.get(key)}
            if op == "store" and set(report["outcome"].values()) != {"stored"}:
                found["outcome"] = report["outcome"]
            return found
        with self.stage(MP_SECTION):
            if not LMCACHE_DIR.is_dir():
                self.note(f"{LMCACHE_DIR} is missing (scripts/setup.sh unpacks it): LMCache MP "
                          f"benchmarks skipped")
                return
            self.store_then_loads("LMCache MP", "lmcache-mp", run_lmcache_mp, MP_CHUNK_MIB,
                                  f"{MP_CHUNK_MIB} MiB chunks", problems)

    def sglang_hicache(self) -> None:
        """SGLang's HiCache `file` backend (tests/sglang_hicache.py): one process stores the
        data set in 8 MiB pages; then, on a fresh mount, another looks them up and loads them
        cold (page cache dropped) and again (warm)."""
        def problems(op: str, report: dict[str, Any]) -> dict[str, Any]:
            return {key: len(report[key]) for key in ("missing", "failed", "vanished",
                                                      "mismatched") if report.get(key)}
        with self.stage(SGLANG_SECTION):
            if not SGLANG_DIR.is_dir():
                self.note(f"{SGLANG_DIR} is missing (scripts/setup.sh fetches it): SGLang "
                          f"benchmarks skipped")
                return
            self.store_then_loads("SGLang", "sglang", run_sglang, SGLANG_PAGE_MIB,
                                  f"{SGLANG_PAGE_MIB} MiB pages", problems)

    def store_then_loads(self, client: str, folder: str,
                         run_client: Callable[..., dict[str, Any]], unit_mib: int, label: str,
                         problems: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        """A client driver's store of the data set in `unit_mib` units; then, on a fresh mount,
        its cold load (page cache dropped) and its warm load; each GB/s recorded as
        "`label`: op", what went wrong noted."""
        units = self.plan.data_bytes // (unit_mib * MIB)
        for run in range(self.plan.runs):
            for target in in_turn(run):
                root = self.roots[target] / f"{folder}-{run}"
                self.warm_up_writes(target)
                reports = {"store": run_client("store", root, units, seed=run)}
                if target == "kvfs":
                    self.kvfs.remount()
                drop_caches()
                reports["cold load"] = run_client("load", root, units, seed=run)
                reports["warm load"] = run_client("load", root, units, seed=run)
                shutil.rmtree(root)
                for op, report in reports.items():
                    if found := problems(op, report):
                        self.note(f"{client} run {run + 1} on {target}, {op}: {found}")
                    self.record(f"{label}: {op}", "GB/s", target,
                                self.plan.data_bytes / report["seconds"] / 1e9)
            self.progress(f"{client}: run {run + 1} done")

    def small_file_commits(self) -> None:
        with self.stage("small-file create and commit"):
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    directory = self.roots[target] / f"small-{run}"
                    directory.mkdir()
                    paths = [str(directory / kv_name(i)) for i in range(self.plan.small_files)]
                    # (kept to the end: deleting them slows the next run's inode allocations)
                    rate = throughput(in_processes(create_small_files, [(paths,)]))
                    self.record("create + write 4 KiB + close", "files/s", target, rate)
                    self.progress(f"run {run + 1}: {target} {rate:,.0f} files/s")

    def metadata_and_scaling(self) -> None:
        """Grow one flat directory step by step; stat latency and mount time at each size."""
        directories = {t: self.roots[t] / "flat" for t in TARGETS}
        for directory in directories.values():
            directory.mkdir()
        have = 0
        kvfs_rate = 0.0
        for count in self.plan.scale_counts:
            label = f"{count:,} files"
            if kvfs_rate and (count - have) / kvfs_rate > self.plan.populate_limit_s:
                self.note(f"scaling at {label} skipped: creating {count - have:,} more files "
                          f"through the mount would take ~{(count - have) / kvfs_rate / 60:.0f} "
                          f"min at the measured {kvfs_rate:,.0f} files/s (limit "
                          f"{self.plan.populate_limit_s / 60:.0f} min)")
                break
            with self.stage(f"populate to {label}", "populate"):
                for target in TARGETS:
                    span = make_empty_files(str(directories[target]), have, count)
                    rate = span.amount / (span.end - span.start)
                    self.populate.append({"target": target, "from": have, "to": count,
                                          "files_per_s": rate})
                    self.progress(f"{target}: {rate:,.0f} files/s (mknod)")
                    if target == "kvfs":
                        kvfs_rate = rate
                have = count
            with self.stage(f"scaling at {label}", "scaling"):
                self.scaling_step(directories, count)
            if count == self.plan.meta_files:
                with self.stage(f"metadata at {label}", "metadata"):
                    self.metadata_rates(directories, count)
        with self.stage(f"shell tools over {self.plan.tree_directories:,} directories",
                        "metadata"):
            self.tree_walks()

    def tree_walks(self) -> None:
        """du, find and ls -lR over a tree of small directories, first on a fresh mount with
        the kernel's dentries dropped (what an operator's first look at a pool costs)."""
        directories, files_each = self.plan.tree_directories, TREE_FILES_EACH
        self.note(f"shell tools walk {directories:,} directories of {files_each} files each")
        roots = {t: str(self.roots[t] / "tree") for t in TARGETS}
        for target in TARGETS:
            os.mkdir(roots[target])
            span = make_tree(roots[target], directories, files_each)
            self.progress(f"{target}: tree made, {span.amount / (span.end - span.start):,.0f} "
                          "entries/s (mkdir, mknod)")
        for run in range(self.plan.runs):
            for target in in_turn(run):
                if target == "kvfs":
                    self.kvfs.unmount()
                    self.kvfs.mount()
                for name, command in TREE_WALKS:
                    drop_caches(2)
                    span = walk_tree(command, roots[target], span.amount)
                    self.record(tree_metric(name), "entries/s", target,
                                span.amount / (span.end - span.start))
            self.progress(f"run {run + 1} done")

    def scaling_step(self, directories: dict[str, Path], count: int) -> None:
        sample = min(self.plan.stat_sample, count, 2_000)
        for run in range(self.plan.runs):
            names = random.sample(range(count), sample)
            for target in in_turn(run):
                if target == "kvfs":
                    self.kvfs.unmount()
                    self.record(mount_time_name(count), "s", target, self.kvfs.mount(),
                                higher_is_better=False)
                drop_caches(2)
                paths = [str(directories[target] / kv_name(i)) for i in names]
                [span] = in_processes(stat_paths, [(paths,)])
                self.record(stat_latency_name(count), "µs", target,
                            statistics.median(span.latencies) * 1e6, higher_is_better=False)

    def metadata_rates(self, directories: dict[str, Path], count: int) -> None:
        sample = min(self.plan.stat_sample, count)
        for run in range(self.plan.runs):
            existing = random.sample(range(count), sample)
            missing = range(MISSING_BASE + run * sample, MISSING_BASE + (run + 1) * sample)
            for target in in_turn(run):
                directory = directories[target]
                paths = [str(directory / kv_name(i)) for i in existing]
                drop_caches(2)
                [cold] = in_processes(stat_paths, [(paths,)])
                # Again at once: a few names, so that short kernel cache timeouts still hold.
                in_processes(stat_paths, [(paths[:1000],)])
                [cached] = in_processes(stat_paths, [(paths[:1000],)])
                absent_paths = [str(directory / kv_name(i)) for i in missing]
                [absent] = in_processes(stat_paths, [(absent_paths,)])
                [absent_cached] = in_processes(stat_paths, [(absent_paths[:1000],)])
                drop_caches(2)
                listing = in_processes(list_directory, [(str(directory),)])
                self.record("stat existing names (dentries cold)", "ops/s", target,
                            throughput([cold]))
                self.record(REPEATED_HITS, "ops/s", target, throughput([cached]))
                self.record("stat missing names", "ops/s", target, throughput([absent]))
                self.record(REPEATED_MISSES, "ops/s", target, throughput([absent_cached]))
                self.record(f"readdir of {count:,} entries", "entries/s", target,
                            throughput(listing))
            self.progress(f"run {run + 1} done")

    # -- teardown ------------------------------------------------------------------------

    def cleanup(self) -> None:
        self.rss.stop()
        self.kvfs.unmount()
        if self.kvfs.mounted:
            CONSOLE.print(f"[red]{self.kvfs.mountpoint} is still mounted; not removing "
                          f"{self.workdir}[/]")
            return
        shutil.rmtree(self.workdir, ignore_errors=True)


def tree_metric(walk: str) -> str:
    return f"{walk} over a tree ({TREE_FILES_EACH} files per directory)"


def prompt_metric(gap: float) -> str:
    return (f"loads {gap * 1e3:.0f} ms after the lookups (first open to last byte)" if gap
            else "loads right after the lookups (first open to last byte)")


def stat_latency_name(count: int) -> str:
    return f"stat latency (dentries cold), {count:,} files"


def mount_time_name(count: int) -> str:
    return f"mount time, {count:,} files"


# -- verdicts and output -------------------------------------------------------------------------

RATIO_TARGETS = (
    ("cold read", "cold read", "cold read, 32 MiB files (from disk)", 0.95),
    ("warm-backing read", "warm-backing and hot read",
     "warm-backing read (backing in page cache, kvfs caches cold)", 0.9),
    ("hot re-read", "warm-backing and hot read", "hot re-read from another process", 0.9),
    *((f"{readers} readers, {kind} files", "concurrent readers (warm backing)",
       f"{readers} readers, {kind} files, total", 0.9)
      for readers in (4, 8) for kind in ("different", "same")),
    ("write", "write", "write 32 MiB files (one write() + close)", 0.85),
    ("LMCache store", "LMCache fs-plugin pattern",
     "store: write <key>.tmp + rename to <key>.data", 0.85),
    ("LMCache engine B retrieve", "real LMCache engines (fs plugin)", "engine B retrieve",
     0.9),
    ("LMCache local_disk store (O_DIRECT)", LOCAL_DISK_SECTION, "store, 32 MiB chunks", 0.85),
    ("LMCache local_disk retrieve (O_DIRECT)", LOCAL_DISK_SECTION, "retrieve", 0.9),
    ("cold prompt, loads 200 ms after lookups", COLD_PROMPT, prompt_metric(0.2), 1.3),
    ("cold prompt, loads right after lookups", COLD_PROMPT, prompt_metric(0.0), 0.95),
    ("LMCache engine B retrieves cold", COLD_PROMPT, "LMCache engine B retrieves A's prefix cold",
     1.0),
    ("stat of missing names", "metadata", "stat missing names", 0.5),
    # (the "at most 1.5x plain's time")
    ("repeated stat of names", "metadata", REPEATED_HITS, 0.67),
    ("repeated stat of missing names", "metadata", REPEATED_MISSES, 0.67),
    *((f"{name} over a tree", "metadata", tree_metric(name), 0.2) for name, _ in TREE_WALKS),
    *((f"vLLM tier {vllm_config(*config)}: {op}", VLLM_SECTION, f"{vllm_config(*config)}: {op}",
       minimum) for config in VLLM_CONFIGS
      for op, minimum in (("store", 0.85), ("cold load", 0.9), ("warm load", 0.9))),
    (f"vLLM tier {VLLM_STORES}", VLLM_SECTION, VLLM_STORES, 0.85),
    *((f"LMCache MP {op}", MP_SECTION, f"{MP_CHUNK_MIB} MiB chunks: {op}", 0.9)
      for op in ("store", "cold load", "warm load")),
    *((f"SGLang {op}", SGLANG_SECTION, f"{SGLANG_PAGE_MIB} MiB pages: {op}", 0.9)
      for op in ("store", "cold load", "warm load")),
)
CPU_PER_GIB_LIMIT = 0.05  # daemon CPU seconds per GiB read


def checks(bench: Bench) -> list[Check]:
    metrics = bench.metrics
    found = []
    for label, section, name, minimum in RATIO_TARGETS:
        if section not in bench.sections:
            continue
        ratio = metrics[(section, name)].ratio if (section, name) in metrics else None
        found.append(Check(label, f"kvfs/plain ≥ {minimum}",
                           "not measured" if ratio is None else f"{ratio:.2f}",
                           None if ratio is None else ratio >= minimum))
    for (_, name), metric in metrics.items():
        if name.startswith("daemon CPU per GiB"):
            seconds = metric.median("kvfs")
            found.append(Check(name, f"≤ {CPU_PER_GIB_LIMIT} s", f"{seconds:.3f} s",
                               seconds <= CPU_PER_GIB_LIMIT))
    latency = {count: metrics[key].median("kvfs") for count in bench.plan.scale_counts
               if (key := ("scaling", stat_latency_name(count))) in metrics}
    if len(latency) > 1:
        small, large = min(latency), max(latency)
        growth = latency[large] / latency[small]
        found.append(Check(f"stat latency at {large:,} vs {small:,} files", "within 2×",
                           f"{growth:.2f}×", growth <= 2))
    mounts = {name: metrics[key].median("kvfs") for count in bench.plan.scale_counts
              if (key := ("scaling", name := mount_time_name(count))) in metrics}
    if mounts:
        name, slowest = max(mounts.items(), key=lambda item: item[1])
        found.append(Check(f"{name} (slowest)", "< 2 s", f"{slowest:.2f} s", slowest < 2))
    peak = next((m.median("kvfs") for (s, n), m in metrics.items()
                 if s == "daemon memory" and n.startswith("daemon RSS peak")), None)
    limit = bench.plan.cache_bytes / MIB + 150
    if peak is not None:
        found.append(Check("daemon RSS peak reading", f"< cache + 150 MiB = {limit:.0f} MiB",
                           f"{peak:.0f} MiB", peak < limit))
    if bench.rss.private_peaks:
        phase, highest = max(bench.rss.private_peaks.items(), key=lambda item: item[1])
        phase_rss = bench.rss.peaks[phase] / MIB
        found.append(Check(f"daemon private memory peak, whole run ({phase}; RSS with the "
                           f"metadata map {phase_rss:.0f} MiB)",
                           f"< cache + 150 MiB = {limit:.0f} MiB", f"{highest / MIB:.0f} MiB",
                           highest / MIB < limit))
    return found


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit in ("GB/s", "s"):
        return f"{value:.2f}"
    if unit in ("µs", "ms"):
        return f"{value:.1f}"
    return f"{value:,.0f}"


def print_report(bench: Bench, found: list[Check]) -> None:
    table = Table(title=f"kvfs vs plain directory (median of {bench.plan.runs} runs)")
    for column in ("benchmark", "unit", "plain", "kvfs", "kvfs/plain"):
        table.add_column(column, justify="left" if column == "benchmark" else "right")
    section = None
    for metric in bench.metrics.values():
        if metric.section != section:
            section = metric.section
            table.add_row(f"[bold]{section}[/]", end_section=False)
        ratio = metric.ratio
        arrow = "↑" if metric.higher_is_better else "↓"
        table.add_row(f"  {metric.name}", f"{metric.unit} {arrow}",
                      fmt(metric.median("plain"), metric.unit),
                      fmt(metric.median("kvfs"), metric.unit),
                      "—" if ratio is None else f"{ratio:.2f}")
    CONSOLE.print(table)
    verdicts = Table(title="targets")
    for column in ("check", "target", "measured", "result"):
        verdicts.add_column(column)
    for check in found:
        result = {True: "[green]ok[/]", False: "[red]MISSED[/]", None: "[yellow]n/a[/]"}
        verdicts.add_row(check.name, check.target, check.measured, result[check.ok])
    CONSOLE.print(verdicts)
    for text in bench.notes:
        CONSOLE.print(f"[yellow]note:[/] {text}")


def save(bench: Bench, found: list[Check], out: Path, started: float, finished: bool) -> None:
    save_report(out, {
        "finished": finished,
        "seconds": round(time.monotonic() - started, 1),
        "plan": asdict(bench.plan),
        "groups": bench.groups,
        "mount_options": bench.mount_options,
        "metrics": [m.as_json() for m in bench.metrics.values()],
        "checks": [asdict(c) for c in found],
        "rss_peak_bytes_by_phase": bench.rss.peaks,
        "private_memory_peak_bytes_by_phase": bench.rss.private_peaks,
        "populate": bench.populate,
        "notes": bench.notes,
    }, bench.workdir, CONSOLE, workdir_filesystem=subprocess.run(
        ["findmnt", "-no", "SOURCE,FSTYPE", "-T", str(bench.workdir.parent)],
        capture_output=True, text=True).stdout.strip())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller data set and directories (about 3 minutes)")
    parser.add_argument("--runs", type=int, default=3, help="runs per benchmark (median)")
    parser.add_argument("--out", type=Path, help="JSON results (default "
                        "bench-results/bench-DATE[-quick].json)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work",
                        help="where the plain directory and the kvfs volume live")
    parser.add_argument("--cache-size", type=int, default=256, metavar="MIB",
                        help="kvfs --cache-size in MiB (default 256)")
    parser.add_argument("--mount-options", default="", metavar="'OPTIONS'",
                        help="more options for the kvfs mount, e.g. '--verify open'")
    parser.add_argument("--only", action="append", choices=GROUPS, metavar="GROUP",
                        help=f"run only this group (repeatable): {', '.join(GROUPS)}")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        CONSOLE.print("[red]bench needs root (drop_caches, kvfs kernel tuning)[/]")
        return 1
    plan = Plan.make(args.quick, args.runs, args.cache_size * MIB)
    out = args.out or REPO / "bench-results" / (
        time.strftime("bench-%Y%m%d-%H%M%S") + ("-quick" if args.quick else "") + ".json")
    bench = Bench(plan, args.workdir.resolve(), [g for g in GROUPS if g in (args.only or GROUPS)],
                  shlex.split(args.mount_options))
    if bench.workdir.exists() and any(bench.workdir.iterdir()):
        CONSOLE.print(f"[red]work directory {bench.workdir} is not empty; remove it first[/]")
        return 1
    started, finished = run_cleaning_up(bench, CONSOLE)
    found = checks(bench)
    print_report(bench, found)
    save(bench, found, out, started, finished)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
