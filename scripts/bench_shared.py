"""Benchmark kvfs's shared pool (Redis metadata, two mounts) against kvfs on LMDB (one mount)
and the plain backing directory, side by side, in one run on the same disk.

    .venv/bin/python scripts/bench_shared.py [--quick] [--out bench-results/NAME.json]

Needs root (drop_caches). Three targets, each with a "writer" and a "reader" root:

    plain   the backing directory itself                        writer = reader
    lmdb    one kvfs mount on embedded LMDB (the default)       writer = reader
    redis   one pool, two kvfs daemons ("hosts") on one Redis   writer = mount A, reader = mount B

Measured: stat latency of existing (and missing) names the writer created, read by the reader,
first time and repeated at once; create + 4 KiB write + close; 32 MiB chunk files written by the
writer and read whole by the reader, cold (after drop_caches) and warm (in the page cache); and
the cross-host visibility latency of LMCache's store pattern: a writer process writes
`<key>.tmp` and renames it to `<key>.data`, a poller process stats the reader's `<key>.data` in
a tight loop, and the latency is from the moment rename() returned to the first stat that
succeeds (CLOCK_MONOTONIC, both processes on this machine; it can be slightly negative: the
reader may find the name before the writer's rename() has returned). Runs rotate which target
goes first (see scripts/bench.py on why order matters here). Medians over --runs; ratios are
kvfs/plain. WARNING and worse records of the daemons' logs are reported and kept in the JSON.
Everything is unmounted, Redis stopped and the work directory removed at the end, also after an
error or Ctrl-C. Results are printed and saved as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import PROCESSES, fmt, in_processes, throughput
from bench_io import (
    CHUNK_BYTES,
    MIB,
    REPO,
    KvfsMount,
    create_small_files,
    drop_caches,
    kv_name,
    log_problems,
    make_empty_files,
    read_files,
    run_cleaning_up,
    save_report,
    stat_paths,
    write_files,
)
from local_redis import LocalRedis
from rich.console import Console
from rich.table import Table

CONSOLE = Console(width=None if sys.stdout.isatty() else 132)
TARGETS = ("plain", "lmdb", "redis")
LABELS = {"plain": "plain", "lmdb": "kvfs LMDB", "redis": "kvfs Redis"}
MISSING_BASE = 10**12  # kv_name indices from here on are never created
VISIBILITY_TIMEOUT_S = 10.0


def in_turn(run: int) -> tuple[str, ...]:
    """All targets, the first one rotating between runs."""
    shift = run % len(TARGETS)
    return TARGETS[shift:] + TARGETS[:shift]


def clock() -> float:
    """CLOCK_MONOTONIC in seconds: one clock for every process on this machine."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


@dataclass(frozen=True)
class Plan:
    quick: bool
    runs: int
    stat_files: int  # names created by the writer, stat()ed by the reader
    small_files: int  # files per create-and-commit run
    chunk_files: int  # 32 MiB files in the read data set
    visibility_keys: int
    visibility_bytes: int  # size of each `<key>.tmp` the visibility writer writes

    @classmethod
    def make(cls, quick: bool, runs: int | None) -> Plan:
        if quick:
            return cls(quick, runs or 1, stat_files=500, small_files=300, chunk_files=4,
                       visibility_keys=50, visibility_bytes=MIB)
        return cls(quick, runs or 3, stat_files=2_000, small_files=1_000, chunk_files=16,
                   visibility_keys=200, visibility_bytes=MIB)


@dataclass
class Metric:
    section: str
    name: str
    unit: str
    higher_is_better: bool
    ratios: bool = True  # whether kvfs/plain means something for this metric
    runs: dict[str, list[float]] = field(default_factory=lambda: {t: [] for t in TARGETS})

    def median(self, target: str) -> float | None:
        values = self.runs[target]
        return statistics.median(values) if values else None

    def ratio(self, target: str) -> float | None:
        plain, value = self.median("plain"), self.median(target)
        return value / plain if self.ratios and plain and value is not None else None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "median": {t: self.median(t) for t in TARGETS},
                "ratio_to_plain": {t: self.ratio(t) for t in TARGETS[1:]}}


# -- the visibility workers (child processes) -------------------------------------------------


def visibility_writer(directory: str, keys: int, size: int, ready: Any, results: Any) -> None:
    """LMCache's store: for each key, once the poller is polling for it, write `<key>.tmp`
    whole, close it and rename it onto `<key>.data`; note when rename() returned."""
    payload = os.urandom(size)
    renamed = []
    for index in range(keys):
        if ready.recv() != index:
            raise RuntimeError("visibility writer and poller out of step")
        time.sleep(0.002)  # let the poller settle into its loop
        base = os.path.join(directory, kv_name(index).removesuffix(".data"))
        fd = os.open(base + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        before = clock()
        os.rename(base + ".tmp", base + ".data")
        renamed.append((before, clock()))
    results.put(("writer", renamed))


def visibility_poller(directory: str, keys: int, ready: Any, results: Any) -> None:
    """Another host's lookup: stat `<key>.data` in a tight loop until it exists."""
    seen: list[float | None] = []
    polls = []
    for index in range(keys):
        path = os.path.join(directory, kv_name(index))
        ready.send(index)
        deadline = clock() + VISIBILITY_TIMEOUT_S
        count = 0
        while True:
            count += 1
            try:
                os.stat(path)
            except FileNotFoundError:
                if clock() > deadline:
                    seen.append(None)
                    break
                continue
            seen.append(clock())
            break
        polls.append(count)
    results.put(("poller", (seen, polls)))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


# -- the suite ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, plan: Plan, workdir: Path, mount_options: list[str],
                 redis_options: list[str]) -> None:
        self.plan = plan
        self.workdir = workdir
        self.mount_options = mount_options
        self.redis_options = redis_options  # (the Redis mounts' alone)
        self.redis = LocalRedis(workdir / "redis")
        self.lmdb = KvfsMount(workdir / "lmdb-data", workdir / "lmdb-mnt", mount_options)
        self.host_a: KvfsMount | None = None  # made once Redis has its port
        self.host_b: KvfsMount | None = None
        self.writers: dict[str, Path] = {}
        self.readers: dict[str, Path] = {}
        self.metrics: dict[tuple[str, str], Metric] = {}
        self.visibility: dict[str, dict[str, Any]] = {}
        self.kvfs_stats: dict[str, Any] = {}
        self.log_problems: list[str] = []  # WARNING and worse in the daemons' logs
        self.notes: list[str] = []
        self.section = ""

    @property
    def mounts(self) -> list[KvfsMount]:
        return [m for m in (self.lmdb, self.host_a, self.host_b) if m is not None]

    def record(self, name: str, unit: str, target: str, value: float,
               higher_is_better: bool = True, ratios: bool = True) -> None:
        metric = self.metrics.setdefault(
            (self.section, name), Metric(self.section, name, unit, higher_is_better, ratios))
        metric.runs[target].append(value)

    def note(self, text: str) -> None:
        self.notes.append(text)
        CONSOLE.log(f"[yellow]note:[/] {text}")

    @contextmanager
    def stage(self, label: str) -> Iterator[None]:
        self.section = label
        started = time.monotonic()
        with CONSOLE.status(f"[bold]{label}[/] …"):
            yield
        CONSOLE.log(f"[green]done[/] {label} ({time.monotonic() - started:.0f} s)")

    def progress(self, text: str) -> None:
        CONSOLE.log(f"  {self.section}: {text}")

    def paths(self, side: dict[str, Path], target: str, directory: str,
              names: list[str]) -> list[str]:
        return [str(side[target] / directory / name) for name in names]

    def setup(self) -> None:
        plain = self.workdir / "plain"
        for path in (plain, self.lmdb.data, self.lmdb.mountpoint):
            path.mkdir(parents=True, exist_ok=True)
        self.redis.start()
        self.host_a = KvfsMount(self.workdir / "pool-data", self.workdir / "host-a",
                                ["--meta", self.redis.url, *self.mount_options,
                                 *self.redis_options])
        self.host_b = KvfsMount(self.workdir / "pool-data", self.workdir / "host-b",
                                ["--meta", self.redis.url, *self.mount_options,
                                 *self.redis_options])
        for mount in self.mounts:
            mount.mountpoint.mkdir(parents=True, exist_ok=True)
            mount.mount()
        self.writers = {"plain": plain, "lmdb": self.lmdb.mountpoint,
                        "redis": self.host_a.mountpoint}
        self.readers = {"plain": plain, "lmdb": self.lmdb.mountpoint,
                        "redis": self.host_b.mountpoint}
        CONSOLE.log(f"plain {plain}; kvfs LMDB at {self.lmdb.mountpoint}; kvfs Redis "
                    f"({self.redis.url}) at {self.host_a.mountpoint} (writer) and "
                    f"{self.host_b.mountpoint} (reader)")

    def run(self) -> None:
        self.setup()
        self.lookups()
        self.creates()
        self.reads()
        self.visibility_latency()
        self.kvfs_stats = {str(m.mountpoint): read_stats(m.mountpoint) for m in self.mounts}

    def lookups(self) -> None:
        count = self.plan.stat_files
        names = [kv_name(i) for i in range(count)]
        missing = [kv_name(MISSING_BASE + i) for i in range(count)]
        with self.stage(f"stat latency, {count:,} names (writer creates, reader stats)"):
            for target in TARGETS:
                directory = self.writers[target] / "names"
                directory.mkdir()
                make_empty_files(str(directory), 0, count)
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    paths = self.paths(self.readers, target, "names", random.sample(names, count))
                    drop_caches(2)
                    [first] = in_processes(stat_paths, [(paths,)])
                    [again] = in_processes(stat_paths, [(paths,)])
                    [absent] = in_processes(stat_paths, [(self.paths(
                        self.readers, target, "names", missing),)])
                    for label, span in (("first time (dentries cold)", first),
                                        ("repeated at once", again)):
                        latencies = [s * 1e6 for s in span.latencies]
                        self.record(f"stat existing, {label}, p50", "µs", target,
                                    statistics.median(latencies), higher_is_better=False)
                        self.record(f"stat existing, {label}, p99", "µs", target,
                                    percentile(latencies, 0.99), higher_is_better=False)
                    self.record("stat missing names, p50", "µs", target,
                                statistics.median(absent.latencies) * 1e6,
                                higher_is_better=False)
                    self.progress(f"run {run + 1}: {target} first "
                                  f"{statistics.median(first.latencies) * 1e6:.0f} µs, again "
                                  f"{statistics.median(again.latencies) * 1e6:.0f} µs")

    def creates(self) -> None:
        with self.stage(f"creates, {self.plan.small_files:,} files (writer)"):
            names = [kv_name(i) for i in range(self.plan.small_files)]
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    directory = self.writers[target] / f"small-{run}"
                    directory.mkdir()
                    # (kept to the end: deleting them slows the next run's inode allocations)
                    rate = throughput(in_processes(create_small_files, [(
                        self.paths(self.writers, target, f"small-{run}", names),)]))
                    self.record("create + write 4 KiB + close", "files/s", target, rate)
                    self.progress(f"run {run + 1}: {target} {rate:,.0f} files/s")

    def reads(self) -> None:
        names = [f"chunk-{i:03d}" for i in range(self.plan.chunk_files)]
        size = self.plan.chunk_files * CHUNK_BYTES
        with self.stage(f"reads, {self.plan.chunk_files} chunk files of 32 MiB "
                        f"({size / 2**30:.2f} GiB; writer writes, reader reads)"):
            for target in TARGETS:
                (self.writers[target] / "chunks").mkdir()
                in_processes(write_files, [(self.paths(self.writers, target, "chunks", names),)])
            for run in range(self.plan.runs):
                for target in in_turn(run):
                    paths = self.paths(self.readers, target, "chunks", names)
                    reader = {"lmdb": self.lmdb, "redis": self.host_b}.get(target)
                    if reader is not None:
                        reader.remount()  # the reading daemon starts cold too
                    drop_caches()
                    cold = throughput(in_processes(read_files, [(paths,)])) / 1e9
                    # The better of two passes: a VM's host can make one pass fault slowly.
                    warm = max(throughput(in_processes(read_files, [(paths,)]))
                               for _ in range(2)) / 1e9
                    self.record("cold read (after drop_caches)", "GB/s", target, cold)
                    self.record("warm read (page cache, best of 2 passes)", "GB/s", target,
                                warm)
                    self.progress(f"run {run + 1}: {target} cold {cold:.2f}, warm {warm:.2f} GB/s")

    def visibility_latency(self) -> None:
        keys = self.plan.visibility_keys
        with self.stage(f"visibility: writer's rename → reader's stat, {keys} keys"):
            for target in TARGETS:
                (self.writers[target] / "visible").mkdir()
                result = self.visibility_run(str(self.writers[target] / "visible"),
                                             str(self.readers[target] / "visible"))
                latencies = [ms for ms in result["latencies_ms"] if ms is not None]
                if len(latencies) < keys:
                    self.note(f"visibility on {target}: {keys - len(latencies)} of {keys} "
                              f"keys not seen within {VISIBILITY_TIMEOUT_S:.0f} s")
                self.visibility[target] = result
                if not latencies:
                    continue
                for label, value in (("p50", percentile(latencies, 0.5)),
                                     ("p99", percentile(latencies, 0.99)),
                                     ("max", max(latencies))):
                    self.record(f"rename returned → stat finds it, {label}",
                                "ms", target, value, higher_is_better=False, ratios=False)
                self.record("rename() call itself, p50", "ms", target,
                            percentile(result["rename_ms"], 0.5), higher_is_better=False,
                            ratios=False)
                self.progress(f"{target}: p50 {percentile(latencies, 0.5):.2f} ms, "
                              f"max {max(latencies):.2f} ms")

    def visibility_run(self, write_dir: str, read_dir: str) -> dict[str, Any]:
        keys, size = self.plan.visibility_keys, self.plan.visibility_bytes
        poller_end, writer_end = PROCESSES.Pipe()
        results = PROCESSES.Queue()
        processes = [
            PROCESSES.Process(target=visibility_poller, args=(read_dir, keys, poller_end,
                                                              results)),
            PROCESSES.Process(target=visibility_writer, args=(write_dir, keys, size, writer_end,
                                                              results)),
        ]
        for process in processes:
            process.start()
        got: dict[str, Any] = {}
        try:
            while len(got) < len(processes):
                try:
                    role, value = results.get(timeout=1)
                    got[role] = value
                except queue.Empty:
                    if any(p.exitcode for p in processes):
                        raise RuntimeError("a visibility process failed") from None
        finally:
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
        renamed = got["writer"]
        seen, polls = got["poller"]
        return {
            "latencies_ms": [None if at is None else (at - after) * 1e3
                             for at, (_, after) in zip(seen, renamed, strict=True)],
            "rename_ms": [(after - before) * 1e3 for before, after in renamed],
            "polls": polls,
        }

    def cleanup(self) -> None:
        """Unmount every host (waiting for its daemon), stop Redis, keep the daemons' log
        problems, remove the work directory (and bench-work/ if this left it empty)."""
        for mount in reversed(self.mounts):
            mount.unmount()
        self.redis.stop()
        self.log_problems = [f"{data.name}: {line}"
                             for data in (self.lmdb.data, self.workdir / "pool-data")
                             for line in log_problems(data / "kvfs.log")]
        still = [str(m.mountpoint) for m in self.mounts if m.mounted]
        if still:
            CONSOLE.print(f"[red]still mounted: {', '.join(still)}; not removing "
                          f"{self.workdir}[/]")
            return
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.workdir.parent == REPO / "bench-work":
            with contextlib.suppress(OSError):
                self.workdir.parent.rmdir()


def read_stats(mountpoint: Path) -> dict[str, Any] | None:
    try:
        return json.loads((mountpoint / ".kvfs" / "stats").read_text())
    except (OSError, ValueError):
        return None


# -- output --------------------------------------------------------------------------------------


def value_text(value: float | None, unit: str) -> str:
    if unit == "ms" and value is not None:
        return f"{value:.2f}"
    return fmt(value, unit)


def print_report(bench: Bench) -> None:
    table = Table(title=f"plain vs kvfs on LMDB (1 mount) vs kvfs on Redis (2 mounts: A writes, "
                        f"B reads); median of {bench.plan.runs} run(s)")
    for column in ("benchmark", "unit", *LABELS.values(), "LMDB/plain", "Redis/plain"):
        table.add_column(column, justify="left" if column == "benchmark" else "right")
    section = None
    for metric in bench.metrics.values():
        if metric.section != section:
            section = metric.section
            table.add_row(f"[bold]{section}[/]", end_section=False)
        ratios = [metric.ratio(t) for t in TARGETS[1:]]
        arrow = "↑" if metric.higher_is_better else "↓"
        table.add_row(f"  {metric.name}", f"{metric.unit} {arrow}",
                      *(value_text(metric.median(t), metric.unit) for t in TARGETS),
                      *("—" if r is None else f"{r:.2f}" for r in ratios))
    CONSOLE.print(table)
    for text in bench.notes:
        CONSOLE.print(f"[yellow]note:[/] {text}")


def save(bench: Bench, out: Path, started: float, finished: bool) -> None:
    save_report(out, {
        "finished": finished,
        "seconds": round(time.monotonic() - started, 1),
        "plan": asdict(bench.plan),
        "mount_options": bench.mount_options,
        "redis_mount_options": bench.redis_options,
        "targets": {"plain": "the backing directory",
                    "lmdb": "one kvfs mount, embedded LMDB metadata",
                    "redis": "two kvfs mounts of one pool, metadata in one local Redis; "
                             "writer on mount A, reader on mount B"},
        "metrics": [m.as_json() for m in bench.metrics.values()],
        "visibility": bench.visibility,
        "kvfs_stats_at_end": bench.kvfs_stats,
        "kvfs_log_problems": bench.log_problems,
        "notes": bench.notes,
    }, bench.workdir, CONSOLE, redis=subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True).stdout.strip())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (well under a minute)")
    parser.add_argument("--runs", type=int, help="runs per benchmark (default 3, quick 1)")
    parser.add_argument("--out", type=Path, help="JSON results (default "
                        "bench-results/shared-DATE[-quick].json)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work" / "shared",
                        help="where the plain directory, the volumes, the mounts and Redis's "
                             "files live; must be empty (default %(default)s)")
    parser.add_argument("--mount-options", default="", metavar="'OPTIONS'",
                        help="more options for every kvfs mount, e.g. '--verify open'")
    parser.add_argument("--redis-mount-options", default="", metavar="'OPTIONS'",
                        help="more options for the two Redis mounts, e.g. '--session-ttl 10'")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        CONSOLE.print("[red]bench_shared needs root (drop_caches)[/]")
        return 1
    plan = Plan.make(args.quick, args.runs)
    out = args.out or REPO / "bench-results" / (
        time.strftime("shared-%Y%m%d-%H%M%S") + ("-quick" if args.quick else "") + ".json")
    workdir = args.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        CONSOLE.print(f"[red]work directory {workdir} is not empty; remove it first[/]")
        return 1
    bench = Bench(plan, workdir, shlex.split(args.mount_options),
                  shlex.split(args.redis_mount_options))
    started, finished = run_cleaning_up(bench, CONSOLE)
    print_report(bench)
    for record in bench.log_problems[:20]:
        CONSOLE.print(f"[yellow]kvfs log:[/] {record.splitlines()[0]}", soft_wrap=True)
    save(bench, out, started, finished)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
