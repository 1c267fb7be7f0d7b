#!/usr/bin/env python3
"""Two kvfs builds, or one build with two sets of mount options, paired on the clients' paths.

Each round runs every client workload on the plain directory, on kvfs A and on kvfs B, the
three in a rotating order, so that the machine's drift during a run touches all three alike.
The report gives each side's median and, per workload, the median (and range) over rounds of
B/A taken within one round. This is how a mechanism is judged: B is a checkout without it, and
it stays if B/A is at or below 0.9 on a client's path.

The workloads are the clients' own code in processes of their own: vLLM's fs tier
(tests/vllm_tier.py: a store of 2 MiB O_DIRECT blocks, then, on a fresh mount, a cold load
after the lookups and a warm one) and two real LMCache engines (tests/lmcache_engine.py:
engine A stores, engine B looks up and retrieves). Needs root (drop_caches).

    git worktree add /tmp/variant HEAD   # then change what is to be judged there
    .venv/bin/python scripts/bench_pair.py --b /tmp/variant --rounds 6
    .venv/bin/python scripts/bench_pair.py --b-options "--spares off"
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_io import (
    ENGINE,
    MIB,
    REPO,
    KvfsMount,
    drop_caches,
    run_cleaning_up,
    run_engine,
    save_report,
)
from rich.console import Console
from rich.table import Table
from vllm_tier import VLLM_DIR, run_worker

CONSOLE = Console()
SIDES = ("plain", "A", "B")
ORDERS = (("plain", "A", "B"), ("B", "plain", "A"), ("A", "B", "plain"),
          ("plain", "B", "A"), ("A", "plain", "B"), ("B", "A", "plain"))
VLLM_JOBS = 32  # jobs per store or load: all 16 of vLLM's threads busy
ENGINE_CHUNKS = 8  # LMCache chunks of 32 MiB per engine store
ROWS = ("vLLM 2 MiB O_DIRECT store", "vLLM 2 MiB O_DIRECT cold load",
        "vLLM 2 MiB O_DIRECT warm load", "LMCache engine A store", "LMCache engine B retrieve")


class Pair:
    def __init__(self, workdir: Path, checkouts: dict[str, Path], options: dict[str, list[str]],
                 rounds: int, data_bytes: int) -> None:
        self.workdir = workdir
        self.rounds = rounds
        self.blocks = data_bytes // (2 * MIB)
        self.mounts = {side: KvfsMount(workdir / f"{side}-data", workdir / f"{side}-mnt",
                                       options[side], checkouts[side]) for side in ("A", "B")}
        self.roots = {"plain": workdir / "plain",
                      **{side: mount.mountpoint for side, mount in self.mounts.items()}}
        self.gbps: dict[str, dict[str, list[float]]] = {row: {s: [] for s in SIDES}
                                                        for row in ROWS}
        self.notes: list[str] = []

    def run(self) -> None:
        for side, mount in self.mounts.items():
            for path in (mount.data, mount.mountpoint):
                path.mkdir(parents=True)
            mount.mount()
            CONSOLE.log(f"kvfs {side}: {mount.checkout} {' '.join(mount.options)}")
        self.roots["plain"].mkdir(parents=True)
        for number in range(self.rounds):
            for side in ORDERS[number % len(ORDERS)]:
                self.one_round(number, side)
            CONSOLE.log(f"round {number + 1}: B/A " + ", ".join(
                f"{row.split(' ', 1)[1]} {self.gbps[row]['B'][-1] / self.gbps[row]['A'][-1]:.2f}"
                for row in ROWS if self.gbps[row]["A"] and self.gbps[row]["B"]))

    def one_round(self, number: int, side: str) -> None:
        root = self.roots[side] / f"round-{number}"
        if VLLM_DIR.is_dir():
            self.vllm(root / "vllm", number, side)
        if ENGINE.exists():
            self.lmcache(root / "lmcache", side)
        shutil.rmtree(root)

    def remount(self, side: str) -> None:
        """kvfs's own caches empty (a fresh daemon), as after a restart or on another host."""
        if side in self.mounts:
            self.mounts[side].remount()

    def vllm(self, root: Path, number: int, side: str) -> None:
        options = dict(block_mib=2, job_blocks=max(1, self.blocks // VLLM_JOBS), seed=number)
        reports = {"store": run_worker("store", root, self.blocks, **options)}
        self.remount(side)
        drop_caches()
        reports["cold load"] = run_worker("load", root, self.blocks, **options)
        reports["warm load"] = run_worker("load", root, self.blocks, **options)
        for op, report in reports.items():
            problems = {key: len(report[key]) for key in ("missing", "failed", "mismatched",
                                                          "errors") if report.get(key)}
            if problems or not report["o_direct"]:
                self.note(f"round {number + 1}, {side}, vLLM {op}: {problems}, "
                          f"O_DIRECT {report['o_direct']}")
            self.gbps[f"vLLM 2 MiB O_DIRECT {op}"][side].append(
                self.blocks * 2 * MIB / report["seconds"] / 1e9)

    def lmcache(self, directory: Path, side: str) -> None:
        directory.mkdir(parents=True)
        store = run_engine(["store"], directory, ENGINE_CHUNKS)
        retrieve = run_engine(["lookup", "retrieve"], directory, ENGINE_CHUNKS)["retrieve"]
        if not retrieve["exact"]:
            self.note(f"{side}: LMCache retrieve not exact ({retrieve['tokens_hit']} tokens)")
        self.gbps["LMCache engine A store"][side].append(
            store["store"]["bytes"] / store["store"]["seconds"] / 1e9)
        self.gbps["LMCache engine B retrieve"][side].append(retrieve["gbps"])

    def note(self, text: str) -> None:
        self.notes.append(text)
        CONSOLE.log(f"[yellow]note:[/] {text}")

    def cleanup(self) -> None:
        for mount in self.mounts.values():
            mount.unmount()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def summary(self) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for row, runs in self.gbps.items():
            paired = [b / a for a, b in zip(runs["A"], runs["B"], strict=False)]
            if not paired:
                continue
            rows[row] = {**{side: statistics.median(runs[side]) for side in SIDES if runs[side]},
                         "B/A": statistics.median(paired), "B/A min": min(paired),
                         "B/A max": max(paired), "runs": runs}
        return rows


def print_summary(rows: dict[str, dict[str, Any]], rounds: int) -> None:
    table = Table(title=f"GB/s, medians of {rounds} rounds; B/A paired within each round")
    for column in ("row", *SIDES, "A/plain", "B/plain", "B/A (min..max)"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for row, found in rows.items():
        plain = found.get("plain")
        table.add_row(row, *(f"{found[side]:.2f}" if side in found else "-" for side in SIDES),
                      *(f"{found[side] / plain:.2f}" if plain else "-" for side in ("A", "B")),
                      f"{found['B/A']:.2f} ({found['B/A min']:.2f}..{found['B/A max']:.2f})")
    CONSOLE.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, default=REPO, help="kvfs checkout A (default: this)")
    parser.add_argument("--b", type=Path, default=REPO, help="kvfs checkout B (default: this)")
    parser.add_argument("--a-options", default="", help="more mount options for A")
    parser.add_argument("--b-options", default="", help="more mount options for B")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--mib", type=int, default=512, help="MiB per vLLM store and load")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work-pair")
    parser.add_argument("--out", type=Path, help="JSON results (default "
                        "bench-results/pair-DATE.json)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        CONSOLE.print("[red]bench_pair needs root (drop_caches)[/]")
        return 1
    for checkout in (args.a, args.b):
        if not (checkout / "mount_kvfs.py").is_file():
            CONSOLE.print(f"[red]{checkout} is not a kvfs checkout (no mount_kvfs.py)[/]")
            return 1
    workdir = args.workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        CONSOLE.print(f"[red]work directory {workdir} is not empty; remove it first[/]")
        return 1
    pair = Pair(workdir, {"A": args.a.resolve(), "B": args.b.resolve()},
                {"A": shlex.split(args.a_options), "B": shlex.split(args.b_options)},
                args.rounds, args.mib * MIB)
    _, finished = run_cleaning_up(pair, CONSOLE)
    rows = pair.summary()
    print_summary(rows, args.rounds)
    out = args.out or REPO / "bench-results" / time.strftime("pair-%Y%m%d-%H%M%S.json")
    save_report(out, {"rows": rows, "notes": pair.notes, "finished": finished}, workdir,
                CONSOLE, a=f"{args.a.resolve()} {args.a_options}",
                b=f"{args.b.resolve()} {args.b_options}")
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
