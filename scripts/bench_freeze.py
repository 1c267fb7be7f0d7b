"""What a volume that stops answering costs engines' I/O: the plain directory, kvfs on LMDB and
kvfs on a Redis pool, each on an ext4 image of its own (loop-mounted), frozen with `fsfreeze`
(as an array that stalls its writes, or a lost path while the host queues I/O) while one
process per operation loops.

    .venv/bin/python scripts/bench_freeze.py [--freeze 8] [--out bench-results/NAME.json]

Needs root (mount, fsfreeze). Each operation runs in a process of its own, one every 10 ms:

    read    read and check a stored 8 MiB file (in the page cache: a hot prefix)
    stat    stat a stored file (an engine's lookup hit)
    miss    stat a missing name (a lookup miss)
    store   write 2 MiB to <key>.tmp and rename it to <key> (LMCache's and vLLM's store)

Per target and operation: those done while the volume was frozen, the longest of those begun
during the freeze (a store begun then waits for the thaw, on every target), and errors. Redis
runs outside the frozen volume. Everything is unmounted and thawed at the end, also after an
error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_io import REPO, KvfsMount, fresh_ext4, log_problems, run_cleaning_up, save_report
from local_redis import LocalRedis
from rich.console import Console
from rich.table import Table

CONSOLE = Console(width=None if sys.stdout.isatty() else 132)
TARGETS = ("plain", "lmdb", "redis")
LABELS = {"plain": "plain", "lmdb": "kvfs LMDB", "redis": "kvfs Redis"}
OPERATIONS = ("read", "stat", "miss", "store")
STORED_FILES = 4
FILE_BYTES = 8 << 20
STORE_BYTES = 2 << 20
VOLUME_BYTES = 1 << 30
BEFORE_S = 2.0  # operations run this long before the freeze, and AFTER_S after the thaw
AFTER_S = 3.0

# One operation in a loop until `until` (CLOCK_MONOTONIC, shared by all processes); prints
# [[start, end, error or null], ...] as JSON.
LOOP = """
import errno, json, os, sys, time
from pathlib import Path
operation, root, until = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
expected = bytes([1]) * int(sys.argv[4])
payload = b"S" * int(sys.argv[5])
spans, turn = [], 0
while time.monotonic() < until:
    start = time.monotonic()
    error = None
    try:
        if operation == "read":
            assert (root / "chunk1").read_bytes() == expected, "wrong bytes"
        elif operation == "stat":
            (root / "chunk2").stat()
        elif operation == "miss":
            assert not (root / "never-stored").exists()
        else:
            key = root / f"store{turn % 8}"
            key.with_suffix(".tmp").write_bytes(payload)
            os.rename(key.with_suffix(".tmp"), key)
            turn += 1
    except (OSError, AssertionError) as failure:
        error = errno.errorcode.get(getattr(failure, "errno", None) or 0, str(failure))
    spans.append([start, time.monotonic(), error])
    time.sleep(0.01)
print(json.dumps(spans))
"""


@dataclass
class Outcome:
    frozen_from: float = 0.0
    frozen_to: float = 0.0
    spans: dict[str, list[list[Any]]] = field(default_factory=dict)

    def summary(self, operation: str) -> dict[str, Any]:
        spans = self.spans.get(operation, [])
        during = [s for s in spans if self.frozen_from <= s[1] <= self.frozen_to]
        begun = [s for s in spans if self.frozen_from <= s[0] < self.frozen_to]
        return {"done_while_frozen": len(during),
                "longest_begun_while_frozen_s": round(max((s[1] - s[0] for s in begun),
                                                          default=0.0), 3),
                "errors": sorted({s[2] for s in spans if s[2]}),
                "error_count": sum(1 for s in spans if s[2]), "done": len(spans)}


class Bench:
    def __init__(self, workdir: Path, freeze_s: float) -> None:
        self.workdir = workdir
        self.freeze_s = freeze_s
        self.redis = LocalRedis(workdir / "redis-server")
        self.outcomes: dict[str, Outcome] = {}
        self.log_problems: list[str] = []
        self._frozen: Path | None = None
        self._mounts: list[KvfsMount] = []

    def run(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis.start()
        for target in TARGETS:
            (self.workdir / target).mkdir()
            with fresh_ext4(self.workdir / target, VOLUME_BYTES) as volume:
                try:
                    self.outcomes[target] = self.measure(target, volume)
                finally:
                    self.unmount_all()

    def measure(self, target: str, volume: Path) -> Outcome:
        root = volume / "plain"
        if target != "plain":
            meta = ["--meta", self.redis.url] if target == "redis" else []
            mount = KvfsMount(volume / "pool", self.workdir / f"{target}-mnt",
                              ["--capacity", "512M", *meta])
            mount.mountpoint.mkdir()
            self._mounts.append(mount)
            mount.mount()
            root = mount.mountpoint
        root.mkdir(exist_ok=True)
        for index in range(STORED_FILES):
            (root / f"chunk{index}.tmp").write_bytes(bytes([index]) * FILE_BYTES)
            os.rename(root / f"chunk{index}.tmp", root / f"chunk{index}")
        outcome = Outcome()
        until = time.monotonic() + BEFORE_S + self.freeze_s + AFTER_S
        loops = {operation: subprocess.Popen(
            [sys.executable, "-c", LOOP, operation, str(root), str(until), str(FILE_BYTES),
             str(STORE_BYTES)], stdout=subprocess.PIPE, text=True, cwd="/")
            for operation in OPERATIONS}
        time.sleep(BEFORE_S)
        self._frozen = volume
        outcome.frozen_from = time.monotonic()
        subprocess.run(["fsfreeze", "-f", str(volume)], check=True)
        try:
            time.sleep(self.freeze_s)
        finally:
            self.thaw()
            outcome.frozen_to = time.monotonic()
        for operation, loop in loops.items():
            stdout, _ = loop.communicate(timeout=120)
            outcome.spans[operation] = json.loads(stdout)
        for mount in self._mounts:
            self.log_problems += log_problems(mount.data / "kvfs.log")
        CONSOLE.print(f"{LABELS[target]}: " + ", ".join(
            f"{operation} {outcome.summary(operation)['done_while_frozen']}"
            for operation in OPERATIONS) + " done while frozen")
        return outcome

    def thaw(self) -> None:
        if self._frozen is not None:
            subprocess.run(["fsfreeze", "-u", str(self._frozen)], capture_output=True)
            self._frozen = None

    def unmount_all(self) -> None:
        for mount in self._mounts:
            mount.unmount()
        self._mounts = []

    def cleanup(self) -> None:
        self.thaw()
        self.unmount_all()
        self.redis.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def print_report(bench: Bench) -> None:
    table = Table(title=f"a {bench.freeze_s:g} s freeze of the volume: operations done while "
                        "frozen / the longest begun then (s) / errors")
    table.add_column("target")
    for operation in OPERATIONS:
        table.add_column(operation, justify="right")
    for target, outcome in bench.outcomes.items():
        cells = []
        for operation in OPERATIONS:
            summary = outcome.summary(operation)
            cells.append(f"{summary['done_while_frozen']} / "
                         f"{summary['longest_begun_while_frozen_s']:.2f} / "
                         f"{summary['error_count']}")
        table.add_row(LABELS[target], *cells)
    CONSOLE.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--freeze", type=float, default=8.0, help="seconds frozen")
    parser.add_argument("--out", type=Path, help="JSON results (default "
                        "bench-results/freeze-DATE.json)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work" / "freeze",
                        help="where the images, mounts and Redis live (default %(default)s)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("fsfreeze"):
        CONSOLE.print("[red]bench_freeze needs root and fsfreeze[/]")
        return 1
    workdir = args.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        CONSOLE.print(f"[red]work directory {workdir} is not empty; remove it first[/]")
        return 1
    bench = Bench(workdir, args.freeze)
    _, finished = run_cleaning_up(bench, CONSOLE)
    print_report(bench)
    for record in bench.log_problems[:20]:
        CONSOLE.print(f"[yellow]kvfs log:[/] {record.splitlines()[0]}", soft_wrap=True)
    out = args.out or REPO / "bench-results" / time.strftime("freeze-%Y%m%d-%H%M%S.json")
    save_report(out, {"freeze_s": args.freeze, "finished": finished, "results": {
        target: {operation: outcome.summary(operation) for operation in OPERATIONS}
        for target, outcome in bench.outcomes.items()}}, workdir, CONSOLE)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
