"""What one FUSE request costs, layer by layer: the floor under kvfs's metadata speed.

    .venv/bin/python scripts/bench_floor.py [--calls 20000] [--runs 3] [--out FILE.json]

Times one request, a LOOKUP of an existing name (`open(O_CREAT|O_EXCL)` of it: the kernel must
ask the daemon, whatever it has cached, and the answer is EEXIST), through four stacks:
- the plain backing directory (no FUSE: the syscall alone),
- `fuse_floor`, libfuse's low-level API in C answering from constants (scripts/fuse_floor.c,
  built here with gcc against the libfuse in .venv/libfuse): the kernel's round trip,
- a minimal pyfuse3 daemon on trio answering from constants: what Python adds per request,
- kvfs: its lookup of a stored name (a metadata read, the prefetcher's bookkeeping).
The C and pyfuse3 daemons run twice: sleeping on /dev/fuse between requests, and polling it
for kvfs's READ_SPIN_US first (kvfs's pyfuse3 patch; kvfs itself always polls): on a small VM
most of a round trip is waking a sleeping daemon.
A store of vLLM's tier sends 11 requests (3 lookups, 2 getattrs of the directory, create,
getxattr, flush, release, rename), so 11 × the floor bounds the files per second any daemon of
that stack can store. Medians of --runs runs, each of --calls calls. Needs root (mounting) and
gcc; the mounts and the work directory are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench_io import REPO, KvfsMount
from rich.console import Console
from rich.table import Table

from kvfs.fuse_ops import READ_SPIN_US

LIBFUSE = REPO / ".venv" / "libfuse"
REQUESTS_PER_STORE = 11
MINIMAL_PYFUSE3 = """
import errno, stat, sys, pyfuse3, trio
class Floor(pyfuse3.Operations):
    read_spin_us = int(sys.argv[2])
    async def getattr(self, inode, ctx=None):
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        directory = inode == pyfuse3.ROOT_INODE
        entry.st_mode = stat.S_IFDIR | 0o755 if directory else stat.S_IFREG | 0o644
        entry.attr_timeout = entry.entry_timeout = 86400
        return entry
    async def lookup(self, parent, name, ctx=None):
        if parent == pyfuse3.ROOT_INODE and name == b"f":
            return await self.getattr(2)
        raise pyfuse3.FUSEError(errno.ENOENT)
pyfuse3.init(Floor(), sys.argv[1], {"fsname=pyfuse3-floor"})
try:
    trio.run(pyfuse3.main)
finally:
    pyfuse3.close()
"""


def build_floor_daemon(work: Path) -> Path:
    binary = work / "fuse_floor"
    includes = sorted(LIBFUSE.glob("include/fuse3"))
    libraries = sorted(LIBFUSE.glob("lib/*/libfuse3.so"))
    if includes and libraries:  # the libfuse kvfs's pyfuse3 uses (scripts/build_passthrough.sh)
        flags = [f"-I{includes[0]}", f"-L{libraries[0].parent}",
                 f"-Wl,-rpath,{libraries[0].parent}"]
    else:
        flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                               capture_output=True, text=True).stdout.split()
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(REPO / "scripts" / "fuse_floor.c"),
                    *flags, "-lfuse3"], check=True)
    return binary


def mounted(mountpoint: Path) -> bool:
    return any(line.split()[4] == str(mountpoint)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


@contextmanager
def foreground_daemon(command: list[str], mountpoint: Path, *extra: str) -> Iterator[Path]:
    """A daemon (`command` MOUNTPOINT `extra`...) that mounts `mountpoint` and serves until
    unmounted; ended by its pid."""
    mountpoint.mkdir()
    daemon = subprocess.Popen([*command, str(mountpoint), *extra])
    try:
        deadline = time.monotonic() + 30
        while not mounted(mountpoint):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not mount {mountpoint}")
            time.sleep(0.05)
        yield mountpoint
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
        try:
            daemon.wait(timeout=10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


@contextmanager
def kvfs_mount(work: Path) -> Iterator[Path]:
    kvfs = KvfsMount(work / "kvfs-data", work / "kvfs", [])
    kvfs.mountpoint.mkdir()
    kvfs.mount()
    try:
        yield kvfs.mountpoint
    finally:
        kvfs.unmount()


def forced_lookups(path: Path, calls: int) -> float:
    """Microseconds per open(O_CREAT|O_EXCL) of an existing name: one LOOKUP each."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    started = time.perf_counter()
    for _ in range(calls):
        try:
            os.close(os.open(path, flags, 0o644))
            raise RuntimeError(f"{path} did not exist")
        except FileExistsError:
            pass
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="requests per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per stack (median)")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work")
    parser.add_argument("--out", type=Path, help="also save the results as JSON")
    args = parser.parse_args()
    console = Console(highlight=False)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="floor-", dir=args.workdir))
    try:
        with ExitStack() as stack:
            (work / "plain").mkdir()
            floor = str(build_floor_daemon(work))
            stacks: dict[str, Path] = {"plain directory (no FUSE)": work / "plain"}
            for spin in (0, READ_SPIN_US):
                how = f"polling {spin} µs" if spin else "sleeping"
                stacks[f"libfuse low-level, C, {how}"] = stack.enter_context(
                    foreground_daemon([floor], work / f"c-{spin}", str(spin)))
                stacks[f"pyfuse3 on trio, minimal, {how}"] = stack.enter_context(
                    foreground_daemon([sys.executable, "-c", MINIMAL_PYFUSE3],
                                      work / f"pyfuse3-{spin}", str(spin)))
            stacks["kvfs"] = stack.enter_context(kvfs_mount(work))
            for root in (stacks["plain directory (no FUSE)"], stacks["kvfs"]):
                (root / "f").write_bytes(b"")
            micros = {name: [] for name in stacks}
            for run in range(args.runs):
                for name, root in stacks.items():
                    forced_lookups(root / "f", min(1000, args.calls))  # warm
                    micros[name].append(forced_lookups(root / "f", args.calls))
                console.print(f"run {run + 1}: " + ", ".join(
                    f"{name} {values[-1]:.1f} µs" for name, values in micros.items()))
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    medians = {name: statistics.median(values) for name, values in micros.items()}
    plain = medians["plain directory (no FUSE)"]
    table = Table(title=f"one LOOKUP request (median of {args.runs} × {args.calls})",
                  header_style="bold")
    for column in ("stack", "µs per call", "request cost (− plain)",
                   f"stores/s bound ({REQUESTS_PER_STORE} requests)"):
        table.add_column(column, justify="left" if column == "stack" else "right")
    for name, value in medians.items():
        cost = value - plain
        bound = f"{1e6 / (REQUESTS_PER_STORE * cost):,.0f}" if cost > 0 else "-"
        table.add_row(name, f"{value:.1f}", f"{cost:.1f}" if cost > 0 else "-", bound)
    console.print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"calls": args.calls, "runs": args.runs,
                                        "micros": micros, "medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
