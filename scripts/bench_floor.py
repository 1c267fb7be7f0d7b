"""What one FUSE request costs, layer by layer: the floor under kvfs's metadata speed.

    .venv/bin/python scripts/bench_floor.py [--calls 20000] [--runs 3] [--out FILE.json]

Times one request, a LOOKUP of an existing name (`open(O_CREAT|O_EXCL)` of it: the kernel must
ask the daemon, whatever it has cached, and the answer is EEXIST), through four stacks:
- the plain backing directory (no FUSE: the syscall alone),
- `fuse_floor`, libfuse's low-level API in C answering from constants (scripts/fuse_floor.c,
  built here with gcc against the libfuse in .venv/libfuse): the kernel's round trip,
- a minimal pyfuse3 daemon on trio answering from constants: what Python adds per request,
- kvfs: its lookup of a stored name (a metadata read, the prefetcher's bookkeeping).
The C daemon runs twice: sleeping on /dev/fuse between requests, and polling it for POLL_US
first: on a small VM most of a round trip is waking a sleeping daemon, and a daemon that never
sleeps is the floor of floors.
Every daemon runs on the first CPU this process may use, and each stack is timed three ways:
the client wherever the scheduler puts it (what clients get), on the daemon's CPU, and on
another CPU. On this VM, waking a CPU that has gone idle is most of a round trip, and a
sequential client's CPU goes idle at every request it waits for; a daemon on the client's own
CPU (what FUSE over io_uring's per-CPU queues give) skips that wake-up.
A store of vLLM's tier sends 11 requests (3 lookups, 2 getattrs of the directory, create,
getxattr, flush, release, rename), so 11 × the floor bounds the files per second any daemon of
that stack can store. Medians of --runs runs, each of --calls calls. Needs root (mounting) and
gcc; the mounts and the work directory are removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench_io import REPO, KvfsMount
from rich.console import Console
from rich.table import Table

LIBFUSE = REPO / ".venv" / "libfuse"
REQUESTS_PER_STORE = 11
POLL_US = 100  # how long the polling C daemon polls /dev/fuse before it sleeps
MINIMAL_PYFUSE3 = """
import errno, stat, sys, pyfuse3, trio
class Floor(pyfuse3.Operations):
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
    if includes and libraries:  # the libfuse kvfs's pyfuse3 uses (scripts/build_fuse.sh)
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
def foreground_daemon(command: list[str], mountpoint: Path, *extra: str,
                      log: Path | None = None) -> Iterator[Path]:
    """A daemon (`command` MOUNTPOINT `extra`...) that mounts `mountpoint` and serves until
    unmounted; ended by its pid. `log`: where its stderr goes."""
    mountpoint.mkdir()
    with open(log, "wb") if log else contextlib.nullcontext() as stderr:
        daemon = subprocess.Popen([*command, str(mountpoint), *extra], stderr=stderr)
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


def forced_lookups(paths: Sequence[Path], calls: int) -> float:
    """Microseconds per open(O_CREAT|O_EXCL) of an existing name (of `paths`, in turn): one
    LOOKUP each."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    chosen = [str(paths[i % len(paths)]) for i in range(calls)]
    started = time.perf_counter()
    for path in chosen:
        try:
            os.close(os.open(path, flags, 0o644))
            raise RuntimeError(f"{path} did not exist")
        except FileExistsError:
            pass
    return (time.perf_counter() - started) / calls * 1e6


def placements(cpus: set[int]) -> dict[str, set[int]]:
    """Where the client may run, by name: the daemons run on min(cpus)."""
    daemon_cpu = min(cpus)
    found = {"client anywhere": cpus, "client on the daemon's CPU": {daemon_cpu}}
    if len(cpus) > 1:
        found["client on another CPU"] = cpus - {daemon_cpu}
    return found


@contextmanager
def running_on(cpus: set[int]) -> Iterator[None]:
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


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
    cpus = os.sched_getaffinity(0)
    wheres = placements(cpus)
    try:
        # The daemons are started from here, pinned to one CPU (they inherit it).
        with ExitStack() as stack, running_on({min(cpus)}):
            (work / "plain").mkdir()
            floor = str(build_floor_daemon(work))
            stacks: dict[str, Path] = {"plain directory (no FUSE)": work / "plain"}
            for poll_us in (0, POLL_US):
                how = f"polling {poll_us} µs" if poll_us else "sleeping"
                stacks[f"libfuse low-level, C, {how}"] = stack.enter_context(
                    foreground_daemon([floor], work / f"c-{poll_us}", str(poll_us)))
            stacks["pyfuse3 on trio, minimal"] = stack.enter_context(
                foreground_daemon([sys.executable, "-c", MINIMAL_PYFUSE3], work / "pyfuse3"))
            stacks["kvfs"] = stack.enter_context(kvfs_mount(work))
            for root in (stacks["plain directory (no FUSE)"], stacks["kvfs"]):
                (root / "f").write_bytes(b"")
            micros = time_placements({name: [root / "f"] for name, root in stacks.items()},
                                     wheres, args.runs, args.calls, console)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    report(micros, args.runs, args.calls, args.out, console, cpus=sorted(cpus))
    return 0


def time_placements(stacks: dict[str, list[Path]], wheres: dict[str, set[int]], runs: int,
                    calls: int, console: Console) -> dict[str, dict[str, list[float]]]:
    """µs per forced LOOKUP of each stack's paths: placement -> stack -> one per run."""
    micros: dict[str, dict[str, list[float]]] = {where: {name: [] for name in stacks}
                                                 for where in wheres}
    for run in range(runs):
        for where, client_cpus in wheres.items():
            with running_on(client_cpus):
                for name, paths in stacks.items():
                    forced_lookups(paths, min(1000, calls))  # warm
                    micros[where][name].append(forced_lookups(paths, calls))
            console.print(f"run {run + 1}, {where}: " + ", ".join(
                f"{name} {values[-1]:.1f} µs" for name, values in micros[where].items()))
    return micros


def report(micros: dict[str, dict[str, list[float]]], runs: int, calls: int,
           out: Path | None, console: Console, **facts: object) -> None:
    """The medians as a table, and everything as JSON in `out` (with `facts`)."""
    medians = {where: {name: statistics.median(values) for name, values in by_stack.items()}
               for where, by_stack in micros.items()}
    console.print(floor_table(medians, f"one LOOKUP request, µs per call (median of "
                                       f"{runs} × {calls}); stores/s it bounds"))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"calls": calls, "runs": runs, **facts, "micros": micros,
                                   "medians": medians}, indent=2))


def floor_table(medians: dict[str, dict[str, float]], title: str) -> Table:
    """Per stack and client placement: µs per call, and the stores/s that
    REQUESTS_PER_STORE requests of that cost (above plain's) allow."""
    table = Table(title=title, header_style="bold")
    table.add_column("stack")
    for where in medians:
        table.add_column(where, justify="right")
    stacks = next(iter(medians.values()))
    for name in stacks:
        cells = []
        for by_stack in medians.values():
            cost = by_stack[name] - by_stack["plain directory (no FUSE)"]
            bound = f" ({1e6 / (REQUESTS_PER_STORE * cost):,.0f}/s)" if cost > 0 else ""
            cells.append(f"{by_stack[name]:.1f}{bound}")
        table.add_row(name, *cells)
    return table


if __name__ == "__main__":
    sys.exit(main())
