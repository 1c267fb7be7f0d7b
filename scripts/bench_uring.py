"""What FUSE over io_uring would give kvfs's lookups: one request timed through each stack.

    .venv/bin/python scripts/bench_uring.py [--calls 10000] [--runs 3] [--names 10000]
                                            [--enable-uring] [--out FILE.json]

scripts/bench_floor.py shows that on this VM most of a FUSE round trip is waking a CPU: the
daemon's, or the caller's, which goes idle while it waits. With FUSE over io_uring (Linux
>= 6.14, libfuse >= 3.18) the kernel queues a request on the queue of the CPU its caller runs
on, and libfuse serves each queue from a thread pinned to that CPU: the caller's CPU serves
its request, and no other CPU is woken.

Times one LOOKUP (an `O_CREAT|O_EXCL` of an existing name) through:
- the plain directory (no FUSE),
- libfuse 3.18 in C answering from constants, reading /dev/fuse (sleeping) and over io_uring
  (scripts/fuse_ring_floor.c),
- the same daemon calling Python with the GIL on the serving thread (scripts/ring_lookup.py):
  answering from constants, and looking the name up in a kvfs metadata store of --names
  names through kvfs's own `MetaStore.lookup`, both ways,
- kvfs itself over a store of the same names: over /dev/fuse (polling) and with
  `--io-uring on` (its lookups answered on the queue threads: `lookup_now`),
each with the client anywhere, on the daemons' CPU and on another (bench_floor.py's
placements). Uses the libfuse 3.18 that scripts/setup.sh builds into .venv/libfuse. Needs
root, gcc and the kernel's io_uring for FUSE: `--enable-uring` turns the fuse module's
`enable_uring` on for the run (and back off after). Medians of --runs runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench_floor import foreground_daemon, placements, report, running_on, time_placements
from bench_io import REPO, KvfsMount, kv_name, make_empty_files
from rich.console import Console
from ring_lookup import ROOT

from kvfs.engine import LmdbEngine
from kvfs.meta import MetaStore
from kvfs.meta.schema import FAMILIES
from kvfs.volume import DEFAULT_MAP_SIZE

ENABLE_URING = Path("/sys/module/fuse/parameters/enable_uring")
LIBFUSE = REPO / ".venv" / "libfuse"
PLAIN = "plain directory (no FUSE)"  # (bench_floor's floor_table subtracts it by name)
# LOOKUP answered by: C constants, or ring_lookup.setup("constant") or (a store) its path.
HANDLERS = {"C, constants": None, "Python, constants": "constant",
            "Python, kvfs's MetaStore.lookup": "store"}


def build_ring_daemon(work: Path) -> Path:
    """fuse_ring_floor against kvfs's libfuse (3.18, scripts/setup.sh) and this Python."""
    [library] = LIBFUSE.glob("lib/*/libfuse3.so")
    python_libdir = sysconfig.get_config_var("LIBDIR")
    binary = work / "fuse_ring_floor"
    subprocess.run(["gcc", "-O2", "-o", str(binary), str(REPO / "scripts" / "fuse_ring_floor.c"),
                    f"-I{LIBFUSE / 'include' / 'fuse3'}", f"-I{sysconfig.get_paths()['include']}",
                    f"-L{library.parent}", f"-Wl,-rpath,{library.parent}", f"-L{python_libdir}",
                    f"-Wl,-rpath,{python_libdir}", "-lfuse3",
                    f"-lpython{sysconfig.get_config_var('LDVERSION')}"], check=True)
    return binary


@contextmanager
def uring_enabled(turn_on: bool) -> Iterator[None]:
    before = ENABLE_URING.read_text().strip() if ENABLE_URING.exists() else "missing"
    if before != "Y" and not turn_on:
        raise SystemExit(f"bench_uring: the kernel's FUSE io_uring is off ({ENABLE_URING}: "
                         f"{before}); run with --enable-uring")
    if before != "Y":
        ENABLE_URING.write_text("Y")
    try:
        yield
    finally:
        if before == "N":
            ENABLE_URING.write_text("N")


def make_store(directory: Path, names: int) -> None:
    directory.mkdir()
    meta = MetaStore(LmdbEngine(directory, FAMILIES, DEFAULT_MAP_SIZE))
    for index in range(names):
        meta.make(ROOT, kv_name(index).encode(), stat.S_IFREG | 0o644, 0, 0)
    meta.engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000, help="requests per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per stack (median)")
    parser.add_argument("--names", type=int, default=10000, help="names in the stores")
    parser.add_argument("--enable-uring", action="store_true",
                        help="turn the fuse module's enable_uring on for the run")
    parser.add_argument("--workdir", type=Path, default=REPO / "bench-work")
    parser.add_argument("--out", type=Path, help="also save the results as JSON")
    args = parser.parse_args()
    console = Console(highlight=False)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="uring-", dir=args.workdir))
    cpus = os.sched_getaffinity(0)
    wheres = placements(cpus)
    names = [kv_name(i) for i in random.sample(range(args.names), min(args.names, 5000))]
    python_path = os.pathsep.join([str(REPO), str(REPO / "scripts"),
                                   sysconfig.get_paths()["purelib"]])
    try:
        with ExitStack() as stack, running_on({min(cpus)}):
            stack.enter_context(uring_enabled(args.enable_uring))
            ring = str(build_ring_daemon(work))
            make_store(work / "meta", args.names)
            (work / "plain").mkdir()
            make_empty_files(str(work / "plain"), 0, args.names)
            stacks = {PLAIN: (work / "plain", names)}
            os.environ["PYTHONPATH"] = python_path  # for the daemons' Python
            for how, flags in (("/dev/fuse, sleeping", []), ("io_uring", ["--io-uring"])):
                for what, handler in HANDLERS.items():
                    if handler == "constant" and not flags:
                        continue  # bench_floor.py times Python over /dev/fuse
                    index = len(stacks)  # (check_transport finds the stack by it)
                    python = [] if handler is None else ["--python", "ring_lookup", handler]
                    if handler == "store":
                        shutil.copytree(work / "meta", work / f"meta-{index}")
                        python[-1] = str(work / f"meta-{index}")
                    mountpoint = stack.enter_context(foreground_daemon(
                        [ring], work / f"mnt-{index}", *flags, *python,
                        log=work / f"daemon-{index}.log"))
                    stacks[f"libfuse 3.18, {what}, {how}"] = (
                        mountpoint, names if handler == "store" else ["f"])
            for how, options in (("/dev/fuse, polling", []),
                                 ("io_uring", ["--io-uring", "on"])):
                kvfs = KvfsMount(work / f"kvfs-data-{len(stacks)}", work / f"kvfs-{len(stacks)}",
                                 options)
                kvfs.mountpoint.mkdir()
                kvfs.mount()
                stack.callback(kvfs.unmount)
                make_empty_files(str(kvfs.mountpoint), 0, args.names)
                stacks[f"kvfs (pyfuse3 on trio), {how}"] = (kvfs.mountpoint, names)
            micros = time_placements({name: [root / entry for entry in chosen]
                                      for name, (root, chosen) in stacks.items()},
                                     wheres, args.runs, args.calls, console)
            check_transport(work, stacks)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    report(micros, args.runs, args.calls, args.out, console, names=args.names,
           cpus=sorted(cpus))
    return 0


def check_transport(work: Path, stacks: dict[str, tuple[Path, list[str]]]) -> None:
    """Each ring daemon served its lookups the way its stack's name says."""
    for log in sorted(work.glob("daemon-*.log")):
        said = log.read_text()
        name = list(stacks)[int(log.stem.split("-")[1])]
        wanted = "io_uring on" if name.endswith("io_uring") else "io_uring off"
        if wanted not in said:
            raise SystemExit(f"bench_uring: {name}: the daemon said {said.strip()!r}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
