"""Small-file stores, kvfs against the plain backing directory: files per second.

    .venv/bin/python scripts/bench_creates.py [--files 2000] [--runs 3] [--threads 1 16]
                                              [--redis]
                                              [--fresh-ext4 SIZE]

Each store is what vLLM's own filesystem tier does per block (KNOWLEDGE.md §6), with a 4 KiB
payload so that metadata, not bytes, is what is timed: `exists(dest)`, open a per-thread
temporary name `O_CREAT|O_EXCL|O_WRONLY|O_TRUNC`, one write, close, `os.replace` onto the
destination. The files go into one directory per run, spread over 16 subdirectories as
vLLM's tree spreads them. Runs alternate which side goes first; the median of --runs is
reported with the ratio kvfs/plain. With --redis, a second kvfs mount keeps its metadata in
a throwaway local Redis (a shared pool of one host) and is measured beside the first; with
--fresh-ext4, everything runs on a new ext4 file system with its journal, in an image of SIZE
in the work directory (stable figures from run to run). Needs root (mounting). The mounts,
Redis, the image and the work directory (default bench-work/ in the repository) are removed
at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import humanfriendly
from bench_io import REPO, KvfsMount, fresh_ext4
from local_redis import LocalRedis
from rich.console import Console
from rich.table import Table

PAYLOAD = os.urandom(4096)
SUBDIRECTORIES = 16


def store_files(root: Path, files: int, threads: int) -> float:
    """Store `files` files from `threads` threads at once; returns files per second."""
    for sub in range(SUBDIRECTORIES):
        (root / f"{sub:02x}").mkdir(parents=True)
    barrier = threading.Barrier(threads + 1)

    def worker(index: int) -> None:
        suffix = f"_{os.getpid()}_{index}.tmp"
        barrier.wait()
        for number in range(index, files, threads):
            dest = os.path.join(root, f"{number % SUBDIRECTORIES:02x}", f"{number:016x}.bin")
            if os.path.exists(dest):
                continue
            fd = os.open(dest + suffix, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC,
                         0o644)
            try:
                os.write(fd, PAYLOAD)
            finally:
                os.close(fd)
            os.replace(dest + suffix, dest)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in workers:
        thread.join()
    return files / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=2000, help="files per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per case (median)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work")
    parser.add_argument("--redis", action="store_true",
                        help="also measure a mount whose metadata is in Redis")
    parser.add_argument("--fresh-ext4", metavar="SIZE", type=image_size,
                        help="run on a new ext4 file system with a journal, in an image of "
                             "SIZE (e.g. 8G) made in --workdir and removed at the end")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        workdir = (args.workdir if args.fresh_ext4 is None
                   else stack.enter_context(fresh_ext4(args.workdir, args.fresh_ext4)))
        return measure(args, Path(tempfile.mkdtemp(prefix="creates-", dir=workdir)))


def image_size(text: str) -> int:
    try:
        return humanfriendly.parse_size(text, binary=True)
    except humanfriendly.InvalidSize as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def measure(args: argparse.Namespace, work: Path) -> int:
    """Store files in each variant; prints the table."""
    console = Console(highlight=False)
    redis = LocalRedis(work / "redis") if args.redis else None
    variants = {"kvfs": []}
    if redis is not None:
        variants["kvfs-redis"] = ["--meta", redis.url]
    mounts = {name: KvfsMount(work / f"{name}-data", work / f"{name}-mnt", options)
              for name, options in variants.items()}
    roots = {"plain": work / "plain"} | {name: mount.mountpoint
                                        for name, mount in mounts.items()}
    for root in roots.values():
        root.mkdir()
    rates: dict[tuple[str, int], list[float]] = {}
    try:
        if redis is not None:
            redis.start()
        for mount in mounts.values():
            mount.mount()
        for threads in args.threads:
            for run in range(args.runs):
                for target in list(roots) if run % 2 == 0 else list(roots)[::-1]:
                    root = roots[target] / f"t{threads}-r{run}"
                    # (kept to the end: deleting them slows the next run's inode allocations)
                    rate = store_files(root, args.files, threads)
                    rates.setdefault((target, threads), []).append(rate)
                    console.print(f"{threads:>2} threads, run {run + 1}, {target}: "
                                  f"{rate:,.0f} files/s")
    finally:
        for mount in mounts.values():
            mount.unmount()
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = Table(title=f"store of {args.files:,} × 4 KiB files (exists, O_EXCL temp, write, "
                        f"close, rename); median of {args.runs}")
    table.add_column("")
    for threads in args.threads:
        table.add_column(f"{threads} thread{'s' if threads > 1 else ''}: files/s", justify="right")
        table.add_column("/plain", justify="right")
    median = {key: statistics.median(values) for key, values in rates.items()}
    for target in roots:
        table.add_row(target, *(cell for threads in args.threads for cell in (
            f"{median[(target, threads)]:,.0f}",
            f"{median[(target, threads)] / median[('plain', threads)]:.3f}")))
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
