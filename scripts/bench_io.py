"""Building blocks of scripts/bench.py and the other benchmarks: kvfs mount control, cache
control, fio, and the I/O workers that run in child processes (so every timed read comes from a
process of its own).

Workers are plain functions of picklable arguments. Each waits until `start_at` (a
time.perf_counter() instant, which is CLOCK_MONOTONIC and so shared by all processes) to start
together with its siblings, and returns a `Span`: when it started and ended and how much it did.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfs.data.volume import Volume

REPO = Path(__file__).resolve().parent.parent
# The clients' drivers (tests/vllm_tier.py, tests/lmcache_engine.py) and the throwaway Redis
# (tests/local_redis.py) live with the tests; the scripts that import this module use them too.
sys.path.insert(0, str(REPO / "tests"))
MIB = 1 << 20
CHUNK_BYTES = 32 * MIB  # one LMCache chunk of Llama-3.1-8B fp16 (256 tokens)
SMALL_FILE_BYTES = 4096
ENGINE = REPO / "tests" / "lmcache_engine.py"  # a real LMCache engine process


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    amount: int  # bytes or operations
    latencies: tuple[float, ...] = ()  # seconds per operation, where measured


def kv_name(index: int) -> str:
    """An LMCache-like chunk key: long, and in hash order rather than creation order."""
    scrambled = (index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    return f"meta-llama-SEP-Llama-3.1-8B-Instruct@1@0@{scrambled:016x}@bfloat16.data"


def _wait_until(start_at: float) -> None:
    delay = start_at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _faulted_buffer(size: int) -> bytearray:
    """A buffer whose pages are already mapped, so page faults are not timed."""
    return bytearray(b"\x5a") * size


# -- workers (run in child processes) ---------------------------------------------------------


def read_files(paths: list[str], start_at: float, buffer: bytearray | None = None) -> Span:
    """Read each file whole with one readinto into a preallocated buffer, like LMCache."""
    view = memoryview(buffer if buffer is not None else _faulted_buffer(CHUNK_BYTES))
    _wait_until(start_at)
    total = 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            got = file.readinto(view)
        if got != CHUNK_BYTES:
            raise OSError(f"{path}: read {got} bytes, expected {CHUNK_BYTES}")
        total += got
    return Span(start, time.perf_counter(), total)


def write_files(paths: list[str], start_at: float) -> Span:
    """Create each file with one write() of a whole chunk and close it (kvfs commits)."""
    view = memoryview(bytearray(os.urandom(MIB)) * (CHUNK_BYTES // MIB))
    _wait_until(start_at)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = os.write(fd, view)
        finally:
            os.close(fd)
        if written != CHUNK_BYTES:
            raise OSError(f"{path}: wrote {written} bytes, expected {CHUNK_BYTES}")
    return Span(start, time.perf_counter(), len(paths) * CHUNK_BYTES)


def lmcache_store(directory: str, names: list[str], start_at: float) -> Span:
    """LMCache's fs plugin: write `<key>.tmp` in one write, close, rename onto `<key>.data`."""
    view = memoryview(bytearray(os.urandom(MIB)) * (CHUNK_BYTES // MIB))
    _wait_until(start_at)
    start = time.perf_counter()
    for name in names:
        temp = os.path.join(directory, name + ".tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, view)
        finally:
            os.close(fd)
        os.rename(temp, os.path.join(directory, name + ".data"))
    return Span(start, time.perf_counter(), len(names) * CHUNK_BYTES)


def lmcache_lookup_and_load(directory: str, names: list[str], start_at: float
                            ) -> tuple[Span, Span]:
    """LMCache's fs plugin on another instance: stat every key, then read each chunk whole."""
    paths = [os.path.join(directory, name + ".data") for name in names]
    _wait_until(start_at)
    lookup = stat_paths(paths, 0.0)
    return lookup, read_files(paths, 0.0)


def look_up_then_load(paths: list[str], gap: float, start_at: float) -> Span:
    """An engine's cold prompt: stat every chunk (the scheduler's lookup), wait `gap`
    seconds (a scheduling step, a queue), then read them all; timed from the first open
    to the last byte."""
    buffer = _faulted_buffer(CHUNK_BYTES)
    _wait_until(start_at)
    for path in paths:
        os.stat(path)
    time.sleep(gap)
    return read_files(paths, 0.0, buffer)


def stat_timed(paths: list[str]) -> tuple[int, list[float]]:
    """stat() each path (missing ones too): how many exist, and each call's seconds."""
    latencies = []
    found = 0
    clock = time.perf_counter
    for path in paths:
        before = clock()
        try:
            os.stat(path)
            found += 1
        except FileNotFoundError:
            pass
        latencies.append(clock() - before)
    return found, latencies


def stat_paths(paths: list[str], start_at: float) -> Span:
    """stat() each path (missing ones too), timing each call."""
    _wait_until(start_at)
    start = time.perf_counter()
    _, latencies = stat_timed(paths)
    return Span(start, time.perf_counter(), len(paths), tuple(latencies))


def create_small_files(paths: list[str], start_at: float) -> Span:
    """Create, write 4 KiB and close each file: one commit per file on kvfs."""
    payload = os.urandom(SMALL_FILE_BYTES)
    _wait_until(start_at)
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
    return Span(start, time.perf_counter(), len(paths))


def make_empty_files(directory: str, first: int, last: int) -> Span:
    """mknod kv_name(first) .. kv_name(last - 1): one request per file, to fill a directory."""
    start = time.perf_counter()
    for index in range(first, last):
        os.mknod(os.path.join(directory, kv_name(index)), stat.S_IFREG | 0o644)
    return Span(start, time.perf_counter(), last - first)


def make_tree(root: str, directories: int, files_each: int) -> Span:
    """`directories` directories under `root`, each with `files_each` empty files (mknod):
    vLLM's tier spreads its blocks over such a tree."""
    start = time.perf_counter()
    for number in range(directories):
        directory = os.path.join(root, f"{number:03x}")
        os.mkdir(directory)
        for index in range(files_each):
            os.mknod(os.path.join(directory, kv_name(index)), stat.S_IFREG | 0o644)
    return Span(start, time.perf_counter(), directories * (files_each + 1))


def walk_tree(command: list[str], root: str, entries: int) -> Span:
    """Run a shell tool (du, find, ls -lR) over the tree at `root` (its "{root}" argument);
    its output is dropped."""
    start = time.perf_counter()
    subprocess.run([root if part == "{root}" else part for part in command], check=True,
                   stdout=subprocess.DEVNULL)
    return Span(start, time.perf_counter(), entries)


def list_directory(directory: str, start_at: float) -> Span:
    """A full readdir (names and types, as os.scandir gets them)."""
    _wait_until(start_at)
    start = time.perf_counter()
    with os.scandir(directory) as entries:
        count = sum(1 for _ in entries)
    return Span(start, time.perf_counter(), count)


# -- the machine -----------------------------------------------------------------------------


def drop_caches(level: int = 3) -> None:
    """Write back dirty data, then drop the page cache (1), dentries and inodes (2) or both (3)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{level}\n")


def evict_file_pages(paths: list[Path]) -> None:
    """Drop these files' pages (and only theirs) from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_files(paths: list[Path]) -> None:
    """Pull these files into the page cache."""
    buffer = memoryview(bytearray(4 * MIB))
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass


@contextlib.contextmanager
def fresh_ext4(parent: Path, size: int) -> Iterator[Path]:
    """A new ext4 file system with its journal, in an image file of `size` bytes in `parent`,
    mounted (loop device) for the block; unmounted and its image deleted after. Small-file
    figures on it do not depend on what the disk deleted before: without a journal, as on
    these VMs' ext4, an inode allocation skips every inode freed in the last minutes. (A loop
    device buffers O_DIRECT I/O in its image's page cache: for metadata figures only.)"""
    image, mountpoint = parent / "ext4.img", parent / "ext4"
    with open(image, "wb") as file:
        file.truncate(size)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        mountpoint.mkdir()
        subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True)
        try:
            yield mountpoint
        finally:
            _unmount_when_free(mountpoint)
    finally:
        with contextlib.suppress(FileNotFoundError):
            mountpoint.rmdir()
        image.unlink()


def _unmount_when_free(mountpoint: Path, seconds: float = 30) -> None:
    """Unmount, waiting while it is busy (a daemon or its helper that served from it may
    still be exiting)."""
    deadline = time.monotonic() + seconds
    while subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode:
        if time.monotonic() > deadline:
            subprocess.run(["umount", str(mountpoint)], check=True)
        time.sleep(0.1)


def fio_bandwidth(directory: Path, filename: str, rw: str, size: int) -> float:
    """One sequential fio job (1 MiB blocks, buffered, one job); returns bytes per second."""
    result = subprocess.run(
        ["fio", "--name=seq", f"--directory={directory}", f"--filename={filename}",
         f"--rw={rw}", "--bs=1M", f"--size={size}", "--direct=0", "--numjobs=1",
         "--ioengine=psync", "--fallocate=none", "--output-format=json"],
        capture_output=True, text=True,
    )
    if result.returncode:
        raise RuntimeError(f"fio --rw={rw} of {directory / filename} failed "
                           f"({result.returncode}): {(result.stderr or result.stdout).strip()}")
    report = json.loads(result.stdout[result.stdout.index("{"):])
    return float(report["jobs"][0]["read" if rw == "read" else "write"]["bw_bytes"])


class KvfsMount:
    """One kvfs volume mounted by the repository's mount_kvfs.py (a daemon of its own)."""

    def __init__(self, data: Path, mountpoint: Path, options: list[str],
                 checkout: Path = REPO) -> None:
        self.data = data
        self.mountpoint = mountpoint
        self.options = options
        self.checkout = checkout  # the kvfs checkout whose mount_kvfs.py (and kvfs/) serves
        self.pid = 0

    @property
    def python(self) -> Path:
        """The checkout's own interpreter where it has a .venv (its own FUSE binding), else
        this one."""
        own = self.checkout / ".venv" / "bin" / "python"
        return own if own.exists() else Path(sys.executable)

    @property
    def mounted(self) -> bool:
        return any(line.split()[4] == str(self.mountpoint)
                   for line in Path("/proc/self/mountinfo").read_text().splitlines())

    def mount(self) -> float:
        """Mount; returns the seconds until mount_kvfs.py returned (the mount is live)."""
        start = time.perf_counter()
        result = subprocess.run(
            [str(self.python), str(self.checkout / "mount_kvfs.py"), str(self.mountpoint),
             "--data", str(self.data), *self.options],
            capture_output=True, text=True, cwd=self.checkout,
        )
        seconds = time.perf_counter() - start
        if result.returncode:
            raise RuntimeError(f"mounting kvfs failed: {result.stderr.strip()}")
        self.pid = Volume(self.data).daemon_pid(self.mountpoint.resolve())
        return seconds

    def unmount(self) -> None:
        """Unmount and wait for the daemon to exit (lazily if something still holds it)."""
        if self.mounted:
            result = subprocess.run(["fusermount3", "-u", str(self.mountpoint)],
                                    capture_output=True)
            if result.returncode:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                               capture_output=True)
        deadline = time.monotonic() + 60
        while self.pid and _alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.pid = 0

    def remount(self) -> float:
        self.unmount()
        return self.mount()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def run_engine(ops: list[str], directory: Path, chunks: int, backend: str = "fs",
               *options: str) -> dict[str, Any]:
    """One real LMCache engine process (tests/lmcache_engine.py); returns its JSON report."""
    result = subprocess.run(
        [sys.executable, str(ENGINE), *ops, "--backend", backend, *options, "--dir",
         str(directory), "--preset", "llama-3.1-8b", "--chunks", str(chunks)],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{' '.join(ops)} exited {result.returncode}: {tail}")
    report = json.loads(lines[-1])
    if report.get("errors"):
        raise RuntimeError(f"{' '.join(ops)} logged errors: {report['errors'][:2]}")
    return report


def run_cleaning_up(bench: Any, console: Any) -> tuple[float, bool]:
    """Run a benchmark (`run()`, then `cleanup()` whatever happens: an error, Ctrl-C, SIGTERM);
    returns when it started (monotonic) and whether it finished."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: clean up on kill too
    started = time.monotonic()
    finished = False
    try:
        bench.run()
        finished = True
    except KeyboardInterrupt:
        console.print("[red]interrupted: cleaning up[/]")
    except Exception:
        console.print_exception()
        console.print("[red]benchmark failed: cleaning up, reporting what was measured[/]")
    finally:
        with console.status("cleaning up …"):
            bench.cleanup()
    return started, finished


def save_report(out: Path, report: dict[str, Any], workdir: Path, console: Any,
                **environment: str) -> None:
    """Write a benchmark's `report` to `out` as JSON, with the run's environment: kernel,
    CPUs, Python, kvfs's commit, `workdir`, the time, and the entries of `environment`."""
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                         capture_output=True, text=True).stdout.strip()
    report = report | {"environment": {
        "kernel": platform.release(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "kvfs_git": git, "workdir": str(workdir), **environment,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"results saved to {out}")


RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # a kvfs log record's first line


def log_problems(log: Path) -> list[str]:
    """The WARNING and worse records of a kvfs log, each with its traceback if it has one."""
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    found: list[str] = []
    keep = False
    for line in lines:
        if RECORD_START.match(line):
            keep = any(level in line for level in (" WARNING ", " ERROR ", " CRITICAL "))
            if keep:
                found.append(line)
        elif keep:
            found[-1] += "\n" + line
    return found
