#!/usr/bin/env python3
"""Where a vLLM-tier store of a small file goes on a Redis-backed mount: its Redis round trips
(by command, from MONITOR) and each step's latency as the client sees it.

Mounts kvfs on a throwaway Redis in a scratch directory, stores `--files` files of 4 KiB the
way vLLM's own tier does (`exists`, an `O_EXCL` temporary name, one write, close, rename), one
thread, and prints round trips per store and step latencies (p50 / p90). MONITOR slows Redis
down, so `--no-monitor` times the steps without it. Scripts that Redis runs count once (the
commands inside them are not round trips).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis
from bench_io import REPO, KvfsMount
from local_redis import LocalRedis
from rich.console import Console
from rich.table import Table

PAYLOAD = os.urandom(4096)
STEPS = ("exists", "create", "write", "close", "rename")


def store(directory: Path, number: int) -> list[float]:
    """One store; the seconds each of STEPS took."""
    path = str(directory / f"{number:016x}.bin")
    marks = [time.perf_counter()]
    os.path.exists(path)
    marks.append(time.perf_counter())
    fd = os.open(path + ".tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    marks.append(time.perf_counter())
    try:
        os.write(fd, PAYLOAD)
        marks.append(time.perf_counter())
    finally:
        os.close(fd)
    marks.append(time.perf_counter())
    os.replace(path + ".tmp", path)
    marks.append(time.perf_counter())
    return [after - before for before, after in zip(marks, marks[1:], strict=False)]


class Monitor:
    """Counts the commands clients send to Redis (not those its scripts run)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.commands: collections.Counter[str] = collections.Counter()
        self.counting = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with redis.Redis.from_url(self.url).monitor() as monitor:
                for command in monitor.listen():
                    if command["client_type"] != "lua" and self.counting.is_set():
                        self.commands[command["command"].split()[0].upper()] += 1
        except redis.ConnectionError:
            pass  # Redis stopped: the run is over


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=500, help="files stored (measured)")
    parser.add_argument("--no-monitor", action="store_true", help="time the steps only")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work")
    parser.add_argument("--mount-options", default="",
                        help="more options for the mount, e.g. '--prefetch 0'")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="redis-trips-", dir=args.workdir))
    local = LocalRedis(work / "redis")
    mount = KvfsMount(work / "data", work / "mnt", ["--meta", local.url,
                                                    *args.mount_options.split()])
    mount.mountpoint.mkdir()
    try:
        local.start()
        mount.mount()
        directory = mount.mountpoint / "blocks"
        directory.mkdir()
        for number in range(50):  # warm: the directory's records, the daemon's threads
            store(directory, args.files + number)
        monitor = None if args.no_monitor else Monitor(local.url)
        if monitor is not None:
            monitor.thread.start()
            time.sleep(0.5)
            monitor.counting.set()
        start = time.perf_counter()
        latencies = [store(directory, number) for number in range(args.files)]
        seconds = time.perf_counter() - start
        time.sleep(0.5)  # what the daemon does after the last close (a release)
        report(args.files, seconds, latencies, monitor)
    finally:
        mount.unmount()
        local.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(files: int, seconds: float, latencies: list[list[float]],
           monitor: Monitor | None) -> None:
    console = Console(highlight=False)
    console.print(f"{files:,} stores in {seconds:.2f} s: {files / seconds:,.0f} files/s, "
                  f"{seconds / files * 1e3:.2f} ms each"
                  + (" (Redis under MONITOR)" if monitor is not None else ""))
    steps = Table(title="client's view of one store, ms")
    for column in ("step", "p50", "p90"):
        steps.add_column(column, justify="right")
    for index, step in enumerate(STEPS):
        spans = sorted(each[index] * 1e3 for each in latencies)
        steps.add_row(step, f"{statistics.median(spans):.2f}", f"{spans[len(spans) * 9 // 10]:.2f}")
    console.print(steps)
    if monitor is not None:
        trips = Table(title="Redis round trips per store")
        trips.add_column("command")
        trips.add_column("per store", justify="right")
        for command, count in monitor.commands.most_common():
            trips.add_row(command, f"{count / files:.2f}")
        trips.add_row("all", f"{sum(monitor.commands.values()) / files:.2f}")
        console.print(trips)


if __name__ == "__main__":
    raise SystemExit(main())
