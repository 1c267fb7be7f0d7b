"""Directories of millions of names: one flat kvfs directory against the plain directory.

    .venv/bin/python scripts/bench_big_dir.py [--names 10000000] [--plain-names 1000000]
        [--quick] [--sample 10000] [--workdir DIR] [--out bench-results/NAME.json]

Engines keep every KV file in one flat directory: SGLang's HiCache `file` backend writes
`<64-hex sha256><suffix>.bin` pages into one directory and, at start-up, lists it whole and
stats every file (`LRUFileEvictor._scan_existing_files`: os.listdir, then os.stat of each
name). One ext4 directory refused more files at about 7.5 million (SGLang #28653).

The kvfs directory is filled without FUSE: with the volume unmounted, the names are written
into its metadata store (LMDB) through the store's own helpers (what `Namespace.make` writes
for an empty file), 10,000 per transaction, as empty files (no data file), in two steps:
first to --plain-names, then to --names; the volume is mounted and measured after each. The
plain directory, in the same work directory (same file system), gets --plain-names real empty
files (mknod). Each timed step follows a drop of the kernel's caches (`echo 3 >
/proc/sys/vm/drop_caches`) and, on kvfs, a remount: pages of the LMDB map that a running
daemon has mapped survive a drop, so only a fresh daemon's map is as cold as the plain
directory's blocks. The stats and listings are then repeated on the running daemon after
another drop ("again: kvfs's map warm"): the kernel's caches cold, the metadata in memory.

- `stat` of --sample random existing names and of --sample missing ones (µs each, median);
- create + write 4 KiB + close of --sample new files (after an untimed warm-up of as many in
  another directory, deleted at once), then unlink of the same files (files/s);
- the whole directory listed in pages: `os.scandir`, names only, and SGLang's start-up scan
  (listdir, then stat every `.bin` file, then sort by mtime); entries/s, with the daemon's
  peak RSS during the listing (VmHWM, reset before it through /proc/PID/clear_refs; it counts
  the LMDB pages the daemon maps), its peak anonymous memory (sampled), its CPU time, the
  FUSE requests it answered (`.kvfs/stats`), and the kernel's slab growth.

kvfs/plain ratios are taken at --plain-names, where both sides hold the same names. Needs
root. Everything is unmounted and removed at the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shlex
import shutil
import stat
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from bench_io import (
    REPO,
    KvfsMount,
    drop_caches,
    log_problems,
    run_cleaning_up,
    save_report,
    stat_timed,
)
from rich.console import Console
from rich.table import Table

from kvfs.data.volume import Volume, VolumeError
from kvfs.engines.interface import Txn
from kvfs.meta import ROOT_INO, Inode, MetaCore

T = TypeVar("T")
CONSOLE = Console(width=None if sys.stdout.isatty() else 132)
MIB = 1 << 20
DIRECTORY = "hicache"
# SGLang's key suffix for Llama-3.1-8B-Instruct, TP rank 0 of 1 (HiCacheFile.config_suffix)
SUFFIX = "_meta-llama-Llama-3.1-8B-Instruct_0_1"
MISSING_BASE = 10**12  # page indices from here on are never filled
NEW_BASE = 2 * 10**12  # ... nor these: the files the create step makes
WARM_UP_BASE = 3 * 10**12
FILL_BATCH = 10_000  # names per metadata transaction of the fill
FILL_SYNC_EVERY = 8  # batches between waits for LMDB to hold the fill so far (bounds memory)
SMALL_FILE = os.urandom(4096)
REPEAT_LIMIT_S = 600  # a listing that took longer is not repeated on the running daemon
SAMPLE_SECONDS = 0.02  # the daemon's anonymous memory is sampled this often during a listing


def page_name(index: int) -> str:
    """An SGLang HiCache page file: a sha256 page hash, the rank's suffix, `.bin`."""
    return hashlib.sha256(b"kvfs-big-dir-%d" % index).hexdigest() + SUFFIX + ".bin"


# -- the offline fill ----------------------------------------------------------------------------


def add_entries(core: MetaCore, parent: int, names: list[bytes], ids: range, now: int,
                txn: Txn) -> None:
    """What `Namespace.make` writes for an empty regular file, for each of `names` in one
    transaction (the names are new: not looked up first)."""
    directory = core.get(txn, parent)
    mode = stat.S_IFREG | 0o644
    for index, name in enumerate(names):
        inode = Inode(ids[2 * index], mode, 1, 0, 0, 0, 0, 0, now, now, now, parent, 0, 0, name)
        core.put(txn, inode)
        core.index_use(txn, inode, None, now)
        core.count_model(txn, inode, name, 1, 0)
        core.link(txn, parent, name, inode, ids[2 * index + 1])
    core.put(txn, directory._replace(mtime_ns=now, ctime_ns=now))
    txn.add("counters", b"files", len(names))


@dataclass(frozen=True)
class Fill:
    first: int
    last: int
    seconds: float  # until LMDB held every name (synced) and the store was closed

    @property
    def rate(self) -> float:
        return (self.last - self.first) / self.seconds


def lock_volume(volume: Volume, timeout: float = 60) -> int:
    """The volume's lock, once the unmounted daemon's helper processes (which share it) have
    exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return volume.lock()
        except VolumeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def fill_offline(data: Path, first: int, last: int) -> Fill:
    """Names `first` .. `last - 1` into the unmounted volume's directory DIRECTORY."""
    volume = Volume(data)
    lock = lock_volume(volume)
    try:
        started = time.perf_counter()
        meta = volume.open_metadata()
        try:
            directory = meta.namespace.lookup(ROOT_INO, DIRECTORY.encode())
            if directory is None:
                raise RuntimeError(f"{data}: no directory {DIRECTORY} to fill")
            shown = time.monotonic()
            for batch, low in enumerate(range(first, last, FILL_BATCH)):
                names = [page_name(i).encode() for i in range(low, min(low + FILL_BATCH, last))]
                end = meta.engine.allocate(b"next_ino", 2 * len(names))  # inode + cookie each
                meta.core.change(partial(add_entries, meta.core, directory.ino, names,
                                         range(end - 2 * len(names), end), time.time_ns()))
                if (batch + 1) % FILL_SYNC_EVERY == 0:
                    meta.engine.sync()
                if time.monotonic() - shown > 10:
                    shown = time.monotonic()
                    done = low + len(names) - first
                    CONSOLE.log(f"  fill: {low + len(names):,} names "
                                f"({done / (time.perf_counter() - started):,.0f}/s)")
            meta.engine.sync()
        finally:
            meta.close()
        return Fill(first, last, time.perf_counter() - started)
    finally:
        os.close(lock)


# -- the clients -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Latencies:
    found: int
    seconds: list[float]

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.seconds)
        return {"median_us": statistics.median(ordered) * 1e6,
                "mean_us": statistics.fmean(ordered) * 1e6,
                "p99_us": ordered[int(0.99 * (len(ordered) - 1))] * 1e6,
                "found": self.found}


def stat_each(paths: list[str]) -> Latencies:
    return Latencies(*stat_timed(paths))


def create_files(paths: list[str]) -> None:
    """Create, write 4 KiB, close each."""
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, SMALL_FILE)
        finally:
            os.close(fd)


def unlink_files(paths: list[str]) -> None:
    for path in paths:
        os.unlink(path)


def scandir_names(directory: str) -> int:
    with os.scandir(directory) as entries:
        return sum(1 for _ in entries)


def sglang_startup_scan(directory: str) -> int:
    """SGLang's LRUFileEvictor._scan_existing_files: listdir, stat each owned `.bin` file,
    sort by mtime (oldest first)."""
    found = []
    for name in os.listdir(directory):
        if not name.endswith(".bin"):
            continue
        stem = name[:-4]
        if not stem.endswith(SUFFIX):
            continue
        try:
            status = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        found.append((status.st_mtime, stem, status.st_size))
    found.sort(key=lambda entry: entry[0])
    return len(found)


# -- the daemon and the machine ------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """/proc/PID/status's kB fields, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def cpu_seconds(pid: int) -> float:
    parts = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def slab_bytes() -> int:
    """Bytes of the kernel's slab objects in use (dentries, inodes, ...): /proc/slabinfo's
    active objects times their size. (Not meminfo's Slab, which counts the pages the caches
    hold: objects freed by a drop_caches leave pages that later ones fill without growth.)"""
    total = 0
    for line in Path("/proc/slabinfo").read_text().splitlines()[2:]:
        fields = line.split()
        total += int(fields[1]) * int(fields[3])
    return total


class DaemonWatch:
    """The daemon's peak RSS (VmHWM, reset at the start), peak anonymous memory (sampled),
    CPU time and the requests it answered, over one step."""

    def __init__(self, pid: int, stats_path: Path) -> None:
        self.pid = pid
        self.stats_path = stats_path
        self.anon_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self.anon_peak = max(self.anon_peak, proc_status(self.pid).get("RssAnon", 0))
            if self._stop.wait(SAMPLE_SECONDS):
                return

    def requests(self) -> dict[str, dict[str, float]]:
        return json.loads(self.stats_path.read_text())["requests"]

    @contextlib.contextmanager
    def watching(self, into: dict[str, Any]) -> Iterator[None]:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5\n")  # VmHWM := VmRSS
        before_requests, before_cpu = self.requests(), cpu_seconds(self.pid)
        into["daemon_rss_before_bytes"] = proc_status(self.pid)["VmRSS"]
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()
        into["daemon_cpu_seconds"] = cpu_seconds(self.pid) - before_cpu
        status = proc_status(self.pid)
        into["daemon_vmhwm_bytes"] = status["VmHWM"]
        into["daemon_rss_after_bytes"] = status["VmRSS"]
        into["daemon_anon_peak_bytes"] = max(self.anon_peak, status.get("RssAnon", 0))
        after = self.requests()
        into["requests"] = {
            request: {"count": int(now["count"] - before_requests.get(request, {}).get("count", 0)),
                      "seconds": round(now["seconds"]
                                       - before_requests.get(request, {}).get("seconds", 0), 3)}
            for request, now in after.items()
            if now["count"] != before_requests.get(request, {}).get("count", 0)}


def disk_bytes(path: Path) -> int:
    """Bytes the files under `path` take on the disk."""
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


# -- the benchmark -------------------------------------------------------------------------------


@dataclass
class Step:
    """One measurement of one side at one directory size."""

    target: str  # plain or kvfs
    names: int
    step: str
    unit: str
    value: float
    details: dict[str, Any] = field(default_factory=dict)


WARM = ", again: kvfs's map warm"  # a repeat on the running daemon, kernel caches dropped
STAT_HITS = "stat existing names"
STAT_MISSES = "stat missing names"
CREATE = "create + write 4 KiB + close"
UNLINK = "unlink"
SCANDIR = "scandir, names only"
SGLANG = "SGLang start-up scan (listdir + stat each)"
RSS_SCANDIR = "daemon peak RSS (VmHWM), scandir"
RSS_SGLANG = "daemon peak RSS (VmHWM), SGLang scan"
ANON_SGLANG = "daemon peak anonymous memory, SGLang scan"
SLAB_SGLANG = "kernel slab objects in use, growth, SGLang scan"
MOUNT = "mount time"
FILL = "fill rate (kvfs: offline, LMDB; plain: mknod)"
LMDB_SIZE = "LMDB size on disk"
STEPS = (  # (step, unit, higher is better), in the table's order
    (STAT_HITS, "µs", False), (STAT_HITS + WARM, "µs", False),
    (STAT_MISSES, "µs", False), (STAT_MISSES + WARM, "µs", False),
    (CREATE, "files/s", True), (UNLINK, "files/s", True),
    (SCANDIR, "entries/s", True), (SCANDIR + WARM, "entries/s", True),
    (SGLANG, "entries/s", True), (SGLANG + WARM, "entries/s", True),
    (RSS_SCANDIR, "MiB", False), (RSS_SGLANG, "MiB", False), (ANON_SGLANG, "MiB", False),
    (SLAB_SGLANG, "MiB", False), (MOUNT, "s", False), (FILL, "names/s", True),
    (LMDB_SIZE, "MiB", False),
)


class Bench:
    def __init__(self, names: list[int], plain_names: int, sample: int, workdir: Path,
                 mount_options: list[str]) -> None:
        self.names = names  # the kvfs directory's sizes, ascending
        self.plain_names = plain_names
        self.sample = sample
        self.workdir = workdir
        self.plain = workdir / "plain" / DIRECTORY
        self.kvfs = KvfsMount(workdir / "kvfs-data", workdir / "mnt", mount_options)
        self.steps: list[Step] = []
        self.notes: list[str] = []
        self.log_problems: list[str] = []

    def record(self, target: str, names: int, step: str, value: float,
               **details: Any) -> None:
        unit = next(unit for name, unit, _ in STEPS if name == step)
        self.steps.append(Step(target, names, step, unit, value, details))
        text = f"{value:,.1f}" if unit in ("µs", "s") else f"{value:,.0f}"
        CONSOLE.log(f"  {target} at {names:,} names: {step}: {text} {unit}")

    def note(self, text: str) -> None:
        self.notes.append(text)
        CONSOLE.log(f"[yellow]note:[/] {text}")

    def run(self) -> None:
        for path in (self.plain, self.kvfs.data, self.kvfs.mountpoint):
            path.mkdir(parents=True)
        # A fresh volume: the first mount formats it; the directory is made through it.
        self.kvfs.mount()
        (self.kvfs.mountpoint / DIRECTORY).mkdir()
        self.kvfs.unmount()
        with stage(f"plain: {self.plain_names:,} files (mknod)"):
            start = time.perf_counter()
            for index in range(self.plain_names):
                os.mknod(os.path.join(self.plain, page_name(index)), stat.S_IFREG | 0o644)
            self.record("plain", self.plain_names, FILL,
                        self.plain_names / (time.perf_counter() - start))
        with stage(f"plain at {self.plain_names:,} names"):
            self.measure("plain", self.plain, self.plain_names)
        have = 0
        for count in self.names:
            with stage(f"kvfs: fill to {count:,} names, offline"):
                fill = fill_offline(self.kvfs.data, have, count)
                have = count
                self.record("kvfs", count, FILL, fill.rate, first=fill.first,
                            seconds=fill.seconds)
                meta = self.kvfs.data / "meta"
                self.record("kvfs", count, LMDB_SIZE, disk_bytes(meta) / MIB,
                            data_mdb_size_bytes=(meta / "data.mdb").stat().st_size)
            with stage(f"kvfs at {count:,} names"):
                self.record("kvfs", count, MOUNT, self.remount()[1])
                self.measure("kvfs", self.kvfs.mountpoint / DIRECTORY, count)
                self.kvfs.unmount()

    def measure(self, target: str, directory: Path, count: int) -> None:
        """Every timed step on one side, each after a drop of the kernel's caches (kvfs:
        remounted too); the stats and listings again on the running daemon."""
        existing = [str(directory / page_name(i))
                    for i in random.sample(range(count), min(self.sample, count))]
        missing = [str(directory / page_name(MISSING_BASE + i)) for i in range(self.sample)]
        for step, paths, wanted in ((STAT_HITS, existing, len(existing)),
                                    (STAT_MISSES, missing, 0)):
            for again in self.passes(target):
                latencies, details = self.timed(target, partial(stat_each, paths), again)
                details |= latencies.summary()
                if latencies.found != wanted:
                    self.note(f"{target} at {count:,}: {step}: {latencies.found:,} found, "
                              f"{wanted:,} expected")
                self.record(target, count, step + again, details["median_us"], **details)
        # An untimed warm-up of as many creates first (these VMs give idle memory back).
        warm_up = directory.parent / f"warm-up-{count}"
        warm_up.mkdir()
        create_files([str(warm_up / page_name(WARM_UP_BASE + i)) for i in range(self.sample)])
        shutil.rmtree(warm_up)
        new = [str(directory / page_name(NEW_BASE + count + i)) for i in range(self.sample)]
        for step, act in ((CREATE, create_files), (UNLINK, unlink_files)):
            _, details = self.timed(target, partial(act, new))
            self.record(target, count, step, len(new) / details["seconds"], **details)
        for step, lister in ((SCANDIR, scandir_names), (SGLANG, sglang_startup_scan)):
            for again in self.passes(target):
                first = value_of(self, target, count, step)
                if again and first and count / first > REPEAT_LIMIT_S:
                    self.note(f"{target} at {count:,}: {step} not repeated (the first pass "
                              f"took {count / first / 60:.0f} min)")
                    continue
                listed, details = self.timed(target, partial(lister, str(directory)), again)
                seconds, slab_growth = details["seconds"], details["kernel_slab_growth_bytes"]
                details["listed"] = listed
                if listed != count:
                    self.note(f"{target} at {count:,}: {step + again} listed {listed:,}")
                self.record(target, count, step + again, listed / seconds, **details)
                if again:
                    continue
                if lister is sglang_startup_scan:
                    self.record(target, count, SLAB_SGLANG, slab_growth / MIB)
                if target == "kvfs":
                    self.record(target, count,
                                RSS_SCANDIR if lister is scandir_names else RSS_SGLANG,
                                details["daemon_vmhwm_bytes"] / MIB)
                    if lister is sglang_startup_scan:
                        self.record(target, count, ANON_SGLANG,
                                    details["daemon_anon_peak_bytes"] / MIB)

    @staticmethod
    def passes(target: str) -> tuple[str, ...]:
        """kvfs: remounted, then again on the running daemon (its map warm); plain: once."""
        return ("", WARM) if target == "kvfs" else ("",)

    def timed(self, target: str, action: Callable[[], T], again: str = ""
              ) -> tuple[T, dict[str, Any]]:
        """`action()` after a drop of the kernel's caches. kvfs is remounted first unless
        `again` (a daemon whose LMDB map is as cold as the kernel's caches: pages a running
        daemon maps stay across a drop), and watched meanwhile (DaemonWatch)."""
        details: dict[str, Any] = {}
        if target != "kvfs":
            drop_caches()
            return self.timed_action(action, details), details
        if again:
            drop_caches()
        else:
            details["previous_unmount_seconds"], details["mount_seconds"] = self.remount()
        watch = DaemonWatch(self.kvfs.pid, self.kvfs.mountpoint / ".kvfs" / "stats")
        with watch.watching(details):
            result = self.timed_action(action, details)
        requests = ", ".join(f"{name} {r['count']:,} ({r['seconds']:.2f} s)"
                             for name, r in details["requests"].items())
        CONSOLE.log(f"    daemon: {details['daemon_cpu_seconds']:.1f} s CPU; "
                    f"handlers: {requests}")
        return result, details

    @staticmethod
    def timed_action(action: Callable[[], T], details: dict[str, Any]) -> T:
        """`action()`, its seconds and the kernel's slab growth meanwhile into `details`."""
        slab = slab_bytes()
        start = time.perf_counter()
        result = action()
        details["seconds"] = time.perf_counter() - start
        details["kernel_slab_growth_bytes"] = slab_bytes() - slab
        return result

    def remount(self) -> tuple[float, float]:
        """Unmount kvfs (once its daemon's helpers let go of the volume), drop the kernel's
        caches, mount; returns the seconds of each."""
        start = time.perf_counter()
        self.kvfs.unmount()
        os.close(lock_volume(Volume(self.kvfs.data)))
        unmounted = time.perf_counter() - start
        drop_caches()
        return unmounted, self.kvfs.mount()

    def cleanup(self) -> None:
        self.kvfs.unmount()
        self.log_problems = log_problems(self.kvfs.data / "kvfs.log")
        if self.kvfs.mounted:
            CONSOLE.print(f"[red]{self.kvfs.mountpoint} is still mounted; not removing "
                          f"{self.workdir}[/]")
            return
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def stage(label: str) -> Iterator[None]:
    started = time.monotonic()
    with CONSOLE.status(f"[bold]{label}[/] …"):
        yield
    CONSOLE.log(f"[green]done[/] {label} ({time.monotonic() - started:.0f} s)")


# -- output --------------------------------------------------------------------------------------


def value_of(bench: Bench, target: str, names: int, step: str) -> float | None:
    return next((s.value for s in bench.steps
                 if (s.target, s.names, s.step) == (target, names, step)), None)


def text(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:,.1f}" if unit in ("µs", "s") else f"{value:,.0f}"


def table_rows(bench: Bench) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of the report: plain and kvfs at --plain-names, their ratio, and
    kvfs at each larger size."""
    small = bench.plain_names
    larger = [count for count in bench.names if count != small]
    columns = ["step", "unit", f"plain, {small:,}", f"kvfs, {small:,}", "kvfs/plain",
               *(f"kvfs, {count:,}" for count in larger)]
    rows = []
    for step, unit, higher in STEPS:
        # (plain has one state, caches dropped: the repeats on kvfs are set against it too)
        plain = value_of(bench, "plain", small, step.removesuffix(WARM))
        kvfs = value_of(bench, "kvfs", small, step)
        if plain is None and kvfs is None and all(value_of(bench, "kvfs", count, step) is None
                                                  for count in larger):
            continue
        ratio = "—" if plain is None or kvfs is None or not plain else f"{kvfs / plain:.2f}"
        rows.append([step, f"{unit} {'↑' if higher else '↓'}", text(plain, unit),
                     text(kvfs, unit), ratio,
                     *(text(value_of(bench, "kvfs", count, step), unit) for count in larger)])
    return columns, rows


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    """The table as Markdown (for docs/benchmarks.md)."""
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |"
                     for line in lines)


def print_report(bench: Bench) -> None:
    columns, rows = table_rows(bench)
    table = Table(title="one flat directory: kvfs vs plain (kvfs/plain at the same names)")
    for column in columns:
        table.add_column(column, justify="left" if column == "step" else "right")
    for row in rows:
        table.add_row(*row)
    CONSOLE.print(table)
    print(markdown(columns, rows))
    for note in bench.notes:
        CONSOLE.print(f"[yellow]note:[/] {note}")
    for problem in bench.log_problems[:20]:
        CONSOLE.print(f"[red]kvfs log:[/] {problem}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", type=int, default=10_000_000,
                        help="names in the kvfs directory (default 10,000,000)")
    parser.add_argument("--plain-names", type=int, default=1_000_000,
                        help="names in the plain directory, and the kvfs directory's first "
                             "size (default 1,000,000)")
    parser.add_argument("--quick", action="store_true",
                        help="100,000 names on both sides (a minute or two)")
    parser.add_argument("--sample", type=int, default=10_000,
                        help="names stat()ed, files created and unlinked per step")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work",
                        help="under which the run's directory is made (default bench-work/)")
    parser.add_argument("--mount-options", default="", metavar="'OPTIONS'",
                        help="more options for the kvfs mount")
    parser.add_argument("--out", type=Path, help="JSON results (default "
                        "bench-results/big-dir-DATE.json)")
    args = parser.parse_args()
    if args.quick:
        args.names = args.plain_names = 100_000
    if not 0 < args.plain_names <= args.names:
        parser.error("--plain-names must be at least 1 and at most --names")
    return args


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        CONSOLE.print("[red]needs root (mounting, drop_caches)[/]")
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="big-dir-", dir=args.workdir.resolve()))
    sizes = sorted({args.plain_names, args.names})
    bench = Bench(sizes, args.plain_names, args.sample, workdir,
                  shlex.split(args.mount_options))
    out = args.out or REPO / "bench-results" / time.strftime("big-dir-%Y%m%d-%H%M%S.json")
    started, finished = run_cleaning_up(bench, CONSOLE)
    print_report(bench)
    columns, rows = table_rows(bench)
    save_report(out, {
        "finished": finished,
        "seconds": round(time.monotonic() - started, 1),
        "names": args.names, "plain_names": args.plain_names, "sample": args.sample,
        "mount_options": bench.kvfs.options,
        "steps": [asdict(step) for step in bench.steps],
        "table": {"columns": columns, "rows": rows},
        "notes": bench.notes,
        "kvfs_log_problems": bench.log_problems,
    }, workdir, CONSOLE)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
