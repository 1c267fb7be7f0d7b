#!/usr/bin/env python3
"""Soak kvfs: crash loops, races and fio verify, round after round, for a given time.

    .venv/bin/python scripts/soak.py                  # 20 minutes
    .venv/bin/python scripts/soak.py --minutes 240    # a long soak
    .venv/bin/python scripts/soak.py --quick          # about a minute: a smoke run
    .venv/bin/python scripts/soak.py --quick --redis  # the same on the shared-pool engine

Needs root (FUSE) and, for the fio rounds, fio (scripts/setup.sh installs both; without fio
those rounds are skipped and the summary says so). Run by a python without the project's
packages, the script re-runs itself with .venv/bin/python.

Every file the workers write verifies itself: a header (magic, digest of the file's name,
version, total length, digest of the body), then a body derived from the name and the version.
Rounds, in turn until the time is up:

- crash: writer processes rewrite their files (in place, or through `<name>.tmp` and a rename)
  while readers check everything they read; at a random moment the daemon and its keeper
  (which would hand the connection to the next daemon) get kill -9, then
  `fusermount3 -u`, a remount (every third round `kvfs fsck --repair` first) and a check: every
  visible file is one whole, exact version consistent with the writers' journals, nothing is
  left in staging/, and the blob bytes on the volume, the bytes visible through the mount and
  the space statvfs reports as used all agree.
- race: with the daemon alive, readers against a writer renaming new versions over one name
  (whole versions, never going back), reads of files unlinked or renamed over while open,
  writers unlinking the file they are writing, several writers of one name at once (readers
  see whole versions, the last to close wins), LMCache's shared `<key>.tmp` (every rename
  succeeds); then the same space check.
- fio: several jobs writing sequentially and randomly (4 KiB to 1 MiB blocks) with crc32c
  verify headers, verified in the job and again after the files are committed.

With --redis the volume is a shared pool (metadata in a redis-server of the soak's own, session
TTL 1 s): after a crash the remount is a new session, and it is the new session that finds the
old one dead and cleans up after it, so the checks after a crash wait for that (a few seconds).

At the end the volume is unmounted and `kvfs fsck` must find it clean. A table summarizes
rounds, operations, crashes survived, bytes verified and every error found; the exit status is
1 if there was any. The work directory (a fresh one under /var/tmp unless --workdir says
otherwise) is removed at the end, also after Ctrl-C or SIGTERM (--keep keeps it); the mount is
unmounted and every process the soak started is ended.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfs.cli.fsck import recount
from kvfs.data.volume import Volume

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the throwaway Redis and the keeper lookup live there
from conftest import keeper_pid  # noqa: E402
from local_redis import LocalRedis  # noqa: E402

VENV_PYTHON = REPO / ".venv" / "bin" / "python"

try:
    from rich.console import Console
    from rich.table import Table
except ImportError:  # a python without the project's packages: use the project's own
    if VENV_PYTHON.exists() and Path(sys.executable).absolute() != VENV_PYTHON:
        os.execv(VENV_PYTHON, [str(VENV_PYTHON), __file__, *sys.argv[1:]])
    raise

KiB = 1 << 10
MiB = 1 << 20
CAPACITY = "8G"  # far above what the soak keeps, so that nothing is ever evicted
SESSION_TTL = "1"  # --redis: seconds before a crashed daemon's session is found dead
CRASH_WRITERS = 3
CRASH_READERS = 2
FILES_PER_WRITER = 4
# One cycle of rounds: crash rounds are the cheapest and find the most.
ROUNDS = ["crash", "race", "fio", "crash", "crash", "race", "crash"]
OPS = {"done", "read", "closed", "renamed", "unlinked", "empty"}  # journal lines that count

# -- self-verifying content --------------------------------------------------------------------

MAGIC = b"KVFSSOAK"
HEADER = struct.Struct("<8s32sQQ32s")  # magic, name digest, version, total length, body digest


class BadContent(ValueError):
    """Content that is not one whole, exact version of the file it was read from."""


def name_digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def body_of(name: str, version: int, length: int) -> bytes:
    return random.Random(f"{name}\0{version}").randbytes(length)


def make_content(name: str, version: int, length: int) -> bytes:
    """`length` bytes in all (at least a header) of version `version` of file `name`."""
    body = body_of(name, version, max(0, length - HEADER.size))
    return HEADER.pack(MAGIC, name_digest(name), version, HEADER.size + len(body),
                       hashlib.sha256(body).digest()) + body


def check_content(name: str, content: bytes) -> int:
    """The version a whole, exact content of `name` holds; raises BadContent otherwise."""
    if len(content) < HEADER.size:
        raise BadContent(f"{name}: {len(content)} bytes, shorter than a header")
    magic, owner, version, length, digest = HEADER.unpack_from(content)
    if magic != MAGIC:
        raise BadContent(f"{name}: no header (starts {content[:16]!r})")
    if owner != name_digest(name):
        raise BadContent(f"{name}: holds another file's content (version {version})")
    if length != len(content):
        raise BadContent(f"{name}: version {version} says {length} bytes, {len(content)} read")
    body = memoryview(content)[HEADER.size:]
    if hashlib.sha256(body).digest() != digest or body != body_of(name, version, len(body)):
        raise BadContent(f"{name}: version {version}: body differs from what was written")
    return version


def sizes(rng: random.Random, largest: int) -> int:
    return rng.choice([HEADER.size, rng.randint(HEADER.size, 64 * KiB),
                       rng.randint(HEADER.size, largest)])


def write_pieces(fd: int, content: bytes, rng: random.Random, pause: float = 0.0) -> None:
    """Write like real writers do: uneven pieces, sometimes with a pause in between."""
    view = memoryview(content)
    while view:
        piece = rng.choice([4096, 65536, 200_000, MiB, 1_500_000])
        done = os.write(fd, view[:piece])
        view = view[done:]
        if pause and rng.random() < 0.3:
            time.sleep(rng.uniform(0, pause))


def write_file(path: Path, content: bytes, rng: random.Random, pause: float = 0.0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_pieces(fd, content, rng, pause)
    finally:
        os.close(fd)


def read_pieces(fd: int, rng: random.Random, pause: float = 0.0) -> bytes:
    chunks = []
    while chunk := os.read(fd, rng.choice([4096, 100_000, MiB, 4 * MiB])):
        chunks.append(chunk)
        if pause and rng.random() < 0.2:
            time.sleep(rng.uniform(0, pause))
    return b"".join(chunks)


def read_file(path: Path, rng: random.Random, pause: float = 0.0) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_pieces(fd, rng, pause)
    finally:
        os.close(fd)


def errname(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, str(error.errno))


def mount_alive(root: Path) -> bool:
    try:
        os.statvfs(root)
    except OSError:
        return False
    return True


# -- workers (this script run with --worker) ---------------------------------------------------

Say = Callable[..., None]


def crash_writer(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """Rewrite this writer's files for ever, journaling each version before open, after close."""
    ident = spec["ident"]
    (root / "crash" / ident).mkdir(parents=True, exist_ok=True)
    version = spec["base"]
    while True:
        version += 1
        name = f"crash/{ident}/f{rng.randrange(FILES_PER_WRITER)}"
        content = make_content(name, version, sizes(rng, 4 * MiB))
        target = root / name
        via_rename = rng.random() < 0.4
        path = target.with_name(target.name + ".tmp") if via_rename else target
        say("start", name, version)
        write_file(path, content, rng)
        if via_rename:
            os.rename(path, target)
        say("done", name, version, time.monotonic())


def crash_reader(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """Read every file there is, again and again; each must be one whole version (or empty:
    created by a writer that has not closed yet)."""
    while True:
        for dirpath, _, filenames in os.walk(root / "crash"):
            for filename in filenames:
                if filename.endswith(".tmp"):
                    continue
                path = Path(dirpath) / filename
                name = str(path.relative_to(root))
                try:
                    content = read_file(path, rng)
                except FileNotFoundError:
                    continue
                if not content:
                    say("empty", name)
                    continue
                try:
                    version = check_content(name, content)
                except BadContent as error:
                    # A read cut short by the kill is the kernel's doing: judge only reads the
                    # daemon survived.
                    say("BAD" if mount_alive(root) else "cut", error)
                else:
                    say("read", name, version, len(content))
        time.sleep(0.01)


def rename_writer(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """Write new versions of race/target under temp names and rename each over it."""
    version = 0
    while time.monotonic() < spec["deadline"]:
        version += 1
        temp = root / "race" / f"target.{version}.tmp"
        write_file(temp, make_content("race/target", version, sizes(rng, 2 * MiB)), rng)
        os.rename(temp, root / "race" / "target")
        say("renamed", "race/target", version)


def target_reader(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """Read race/target slowly while it is renamed over: whole versions, never going back."""
    last = 0
    while time.monotonic() < spec["deadline"]:
        try:
            content = read_file(root / "race" / "target", rng, pause=0.01)
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        try:
            version = check_content("race/target", content)
        except BadContent as error:
            say("BAD", "reader of race/target:", error)
            continue
        if version < last:
            say("BAD", f"race/target went back from version {last} to {version}")
        last = version
        say("read", "race/target", version, len(content))


def same_name_writer(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """One of several writers of race/same at once (O_TRUNC rewrites, slow writes)."""
    version, step = spec["index"], spec["writers"]
    path = root / "race" / "same"
    while time.monotonic() < spec["deadline"]:
        version += step
        content = make_content("race/same", version, sizes(rng, 2 * MiB))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_pieces(fd, content, rng, pause=0.005)
        finally:
            closing = time.monotonic()
            os.close(fd)
            say("closed", "race/same", version, len(content), closing, time.monotonic())


def same_reader(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    while time.monotonic() < spec["deadline"]:
        try:
            content = read_file(root / "race" / "same", rng, pause=0.005)
        except FileNotFoundError:
            time.sleep(0.01)
            continue
        if not content:
            say("empty", "race/same")
            continue
        try:
            version = check_content("race/same", content)
        except BadContent as error:
            say("BAD", "reader of race/same:", error)
        else:
            say("read", "race/same", version, len(content))


def unlink_open(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """Files unlinked or renamed over while a handle reads them; writers whose file is
    unlinked under them."""
    round_ = 0
    while time.monotonic() < spec["deadline"]:
        round_ += 1
        name = f"race/u{round_ % 4}"
        path = root / name
        old = 2 * round_
        content = make_content(name, old, sizes(rng, 2 * MiB))
        write_file(path, content, rng)
        how = rng.choice(["unlink", "rename-over", "unlink-writer"])
        if how == "unlink-writer":
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            try:
                write_pieces(fd, make_content(name, old + 1, sizes(rng, MiB)), rng)
                os.unlink(path)
                os.write(fd, b"after the unlink")
            finally:
                os.close(fd)
            if path.exists():
                say("BAD", f"{name}: exists after its unlink (written while unlinked)")
            say("unlinked", name, old)
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            first = os.read(fd, rng.randint(0, len(content)))
            if how == "unlink":
                os.unlink(path)
            else:
                temp = root / "race" / f"u.{round_}.tmp"
                write_file(temp, make_content(name, old + 1, sizes(rng, 2 * MiB)), rng)
                os.rename(temp, path)
            rest = read_pieces(fd, rng)
        finally:
            os.close(fd)
        try:
            if check_content(name, first + rest) != old:
                say("BAD", f"{name}: an open reader saw another version after {how}")
        except BadContent as error:
            say("BAD", f"open reader after {how}:", error)
        say("read", name, old, len(first) + len(rest))
        if how == "unlink":
            if path.exists():
                say("BAD", f"{name}: still there after its unlink")
            say("unlinked", name, old)
            continue
        try:
            new = read_file(path, rng)
            if check_content(name, new) != old + 1:
                say("BAD", f"{name}: the new name does not hold the version renamed over it")
        except (BadContent, FileNotFoundError) as error:
            say("BAD", f"{name} after rename-over:", error)
        say("renamed", name, old + 1)


def shared_tmp_writer(root: Path, spec: dict, rng: random.Random, say: Say) -> None:
    """LMCache's fs plugin: every writer of a chunk writes <key>.tmp, closes and renames it to
    <key>.data; writers of one chunk share the temp name. The first rename moves it, a later
    one finds no temp name (ENOENT, as on any filesystem: counted, not an error). Like
    LMCache instances storing the same new prompt, each writer stores each key once (a name
    rewritten again while another writer still renames it is a race of any filesystem)."""
    version, step = spec["index"], spec["writers"]
    (root / "race" / "shared").mkdir(parents=True, exist_ok=True)
    written: set[int] = set()
    while time.monotonic() < spec["deadline"]:
        key = int(time.monotonic() / 0.25)  # writers pick the same key at the same time
        if key in written:
            time.sleep(0.01)
            continue
        written.add(key)
        version += step
        final = f"race/shared/k{key}.data"
        temp = root / "race" / "shared" / f"k{key}.tmp"
        write_file(temp, make_content(final, version, sizes(rng, MiB)), rng, pause=0.003)
        try:
            os.rename(temp, root / final)
        except FileNotFoundError:
            say("renamed-by-another", final, version)
        except OSError as error:
            say("BAD", f"rename k{key}.tmp -> k{key}.data failed: {errname(error)}")
        else:
            say("renamed", final, version)


ROLES: dict[str, Callable[[Path, dict, random.Random, Say], None]] = {
    role.__name__: role for role in (crash_writer, crash_reader, rename_writer, target_reader,
                                     same_name_writer, same_reader, unlink_open,
                                     shared_tmp_writer)
}


def worker_main(spec: dict) -> None:
    root = Path(spec["root"])
    rng = random.Random(spec["seed"])
    with open(spec["log"], "a", buffering=1) as journal:

        def say(*fields: Any) -> None:
            journal.write(" ".join(str(f) for f in fields) + "\n")

        try:
            ROLES[spec["role"]](root, spec, rng, say)
            say("end")
        except OSError as error:  # in a crash round: the daemon is gone (ENOTCONN, ...)
            say("exit", errname(error), time.monotonic(), error)
        except Exception:  # any other failure is the soak's to report
            say("CRASH", traceback.format_exc().replace("\n", " | "))


# -- the soak ----------------------------------------------------------------------------------


class Abort(Exception):
    """The soak cannot go on (the volume would not mount): report and stop."""


@dataclass
class Tally:
    rounds: int = 0
    operations: int = 0
    bytes_verified: int = 0
    errors: int = 0
    seconds: float = 0.0


@dataclass
class Journal:
    lines: list[list[str]]

    @classmethod
    def read(cls, paths: Iterable[Path]) -> Journal:
        lines = []
        for path in paths:
            # A worker killed mid-line leaves a partial last line: only whole lines count.
            text = path.read_text()
            lines += [line.split(" ") for line in text.split("\n")[:-1] if line]
        return cls(lines)

    def of(self, kind: str) -> list[list[str]]:
        return [line for line in self.lines if line[0] == kind]


@dataclass
class Soak:
    work: Path
    rng: random.Random
    quick: bool
    keep: bool
    console: Console
    pid: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    tallies: dict[str, Tally] = field(default_factory=dict)
    crashes: int = 0
    notes: list[str] = field(default_factory=list)
    workers_started: int = 0
    only: set[str] = field(default_factory=lambda: set(ROUNDS))
    redis: LocalRedis | None = None  # --redis: the shared-pool engine
    done: dict[str, int] = field(default_factory=dict)  # crash rounds: last version closed
    started: dict[str, int] = field(default_factory=dict)  # and last version started

    @property
    def mountpoint(self) -> Path:
        return self.work / "mnt"

    @property
    def data(self) -> Path:
        return self.work / "data"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    def tally(self, kind: str) -> Tally:
        return self.tallies.setdefault(kind, Tally())

    def error(self, kind: str, message: str) -> None:
        self.tally(kind).errors += 1
        self.errors.append(f"{kind}: {message}")
        self.console.print(f"[red]ERROR[/red] {kind}: {message}")

    # -- the mount -------------------------------------------------------------------------

    def mounted(self) -> bool:
        return any(line.split()[4] == str(self.mountpoint)
                   for line in Path("/proc/self/mountinfo").read_text().splitlines())

    @property
    def meta_options(self) -> list[str]:
        return ["--meta", self.redis.url] if self.redis else []

    @property
    def recovery_seconds(self) -> float:
        """How long recovery after a crash may take: none on one host (the mount does it);
        on a shared pool, until the new session has found the old one dead."""
        return 4 * float(SESSION_TTL) + 2 if self.redis else 0.0

    def dead_sessions_reaped(self) -> bool:
        """(shared pool, after a crash and remount) Wait, up to the recovery time, until the
        remount's is the only session left (its staging directory the only one); whether
        it is."""
        def one_left() -> bool:
            with os.scandir(self.data / "staging") as entries:
                return sum(entry.is_dir() for entry in entries) <= 1

        return wait_for(one_left, self.recovery_seconds)

    def mount(self) -> None:
        shared = [*self.meta_options, "--session-ttl", SESSION_TTL] if self.redis else []
        result = subprocess.run(
            [sys.executable, str(REPO / "mount_kvfs.py"), str(self.mountpoint), "--data",
             str(self.data), "--capacity", CAPACITY, *shared],
            capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise Abort(f"mount failed ({result.returncode}): {result.stderr.strip()}")
        self.pid = Volume(self.data).daemon_pid(self.mountpoint)

    def unmount(self) -> None:
        if self.mounted():
            subprocess.run(["fusermount3", "-u", str(self.mountpoint)], check=False,
                           capture_output=True)
            if self.mounted():  # busy: detach it
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                               capture_output=True)
        if self.pid and not wait_dead(self.pid, 30):
            self.error("unmount", f"daemon {self.pid} still running 30 s after the unmount")
            os.kill(self.pid, signal.SIGKILL)
            wait_dead(self.pid, 10)
        self.pid = 0

    def crash_daemon(self) -> None:
        """A crash of the host's kvfs: the daemon and its keeper, so that the mount dies."""
        os.kill(keeper_pid(self.mountpoint), signal.SIGKILL)
        os.kill(self.pid, signal.SIGKILL)
        if not wait_dead(self.pid, 20):
            raise Abort(f"daemon {self.pid} survived SIGKILL")
        self.pid = 0

    # -- workers ---------------------------------------------------------------------------

    def start(self, group: str, role: str, **spec: Any) -> Path:
        self.workers_started += 1
        log = self.logs / f"{group}-{role}-{self.workers_started}.log"
        full = {"role": role, "root": str(self.mountpoint), "log": str(log),
                "seed": self.rng.getrandbits(64), **spec}
        with open(log.with_suffix(".err"), "w") as stderr:
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(full)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr))
        return log

    def kill_workers(self) -> None:
        for pid in self.end_workers():
            self.error("workers", f"worker {pid} did not die")

    def end_workers(self) -> list[int]:
        """Kill every worker still running; returns the pids that would not die."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        stuck = []
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                stuck.append(proc.pid)
        self.procs.clear()
        return stuck

    def wait_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.error("workers", f"worker {proc.pid} ({proc.args[-1][:80]}) hung")
        self.kill_workers()

    def journal_errors(self, kind: str, journal: Journal, crash_time: float | None) -> None:
        for line in journal.lines:
            if line[0] in ("BAD", "CRASH"):
                self.error(kind, " ".join(line[1:]))
            elif line[0] == "exit" and (crash_time is None or float(line[2]) < crash_time):
                self.error(kind, f"worker failed while the daemon was alive: {' '.join(line)}")
            elif line[0] == "cut":
                self.notes.append(f"{kind}: a read cut by the crash (not judged)")

    # -- checks ----------------------------------------------------------------------------

    def visible_files(self) -> dict[str, int]:
        found = {}
        for dirpath, _, filenames in os.walk(self.mountpoint):
            for name in filenames:
                path = Path(dirpath) / name
                found[str(path.relative_to(self.mountpoint))] = path.stat().st_size
        return found

    def space_check(self, kind: str, settle: float = 0.0) -> None:
        """Blob bytes on the volume == bytes visible == statvfs used; nothing staged but the
        mount's spares (empty files, as many as its stats count), nothing left to publish."""
        deadline = time.monotonic() + settle
        while True:
            problems = self.space_problems()
            if not problems or time.monotonic() >= deadline:
                break
            time.sleep(0.1)  # handles closed by exiting workers are released asynchronously
        for problem in problems:
            self.error(kind, problem)

    def counters(self) -> tuple[tuple, tuple]:
        """(used bytes, files, per-model usage) as .kvfs/stats shows them, and as a recount of
        the metadata (read-only, beside the daemon) says."""
        stats = json.loads((self.mountpoint / ".kvfs" / "stats").read_text())
        volume = Volume(self.data)
        meta = volume.open_metadata(volume.shared_url(), readonly=True)
        try:
            counted = recount(meta)
        finally:
            meta.close()
        return (stats["used_bytes"], stats["files"], stats["models"]), counted

    def space_problems(self) -> list[str]:
        blobs = []
        for path in (self.data / "blobs").glob("*/*"):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile by the reaper
                blobs.append(path.stat())
        on_volume = sum(st.st_size for st in blobs)
        allocated = sum(min(st.st_blocks * 512, -(-st.st_size // 4096) * 4096) for st in blobs)
        visible = sum(self.visible_files().values())
        st = os.statvfs(self.mountpoint)
        used = (st.f_blocks - st.f_bfree) * st.f_frsize
        sizes = {}
        # (os.walk, not rglob: a dead session's directory may go while it is listed)
        for directory, _, names in os.walk(self.data / "staging"):
            for name in names:
                with contextlib.suppress(FileNotFoundError):  # taken and published meanwhile
                    sizes[name] = os.stat(os.path.join(directory, name)).st_size
        staged = sorted(name for name, size in sizes.items() if size)
        shown_stats = json.loads((self.mountpoint / ".kvfs" / "stats").read_text())
        spares = len(sizes) - len(staged)
        problems = []
        if spares != shown_stats["spare_staged_files"] or shown_stats["blobs_publishing"]:
            problems.append(f"{spares} empty staged files, {shown_stats['spare_staged_files']} "
                            f"spares, {shown_stats['blobs_publishing']} blobs to publish")
        if on_volume != visible:
            problems.append(f"{on_volume} bytes of blob files, {visible} bytes visible")
        if used != allocated:
            problems.append(f"statvfs says {used} bytes used, blob files take {allocated}")
        shown, counted = self.counters()
        if shown != counted:
            problems.append(f"usage counters {shown} differ from a recount {counted}")
        if staged:
            problems.append(f"left in staging/: {staged[:5]}")
        return problems

    # -- rounds ----------------------------------------------------------------------------

    def crash_round(self, number: int) -> None:
        kind = "crash"
        tally = self.tally(kind)
        group = f"crash{number}"
        logs = []
        for index in range(CRASH_WRITERS):
            logs.append(self.start(group, "crash_writer", ident=f"w{index}",
                                   base=number * 1_000_000))
        for _ in range(CRASH_READERS):
            logs.append(self.start(group, "crash_reader"))

        def busy() -> bool:
            journal = Journal.read(p for p in logs if p.exists())
            return (len({line[1] for line in journal.of("done")}) >= CRASH_WRITERS // 2 + 1
                    and bool(journal.of("read")))

        if not wait_for(busy, 30):
            self.error(kind, f"round {number}: the workers did not get going in 30 s")
        time.sleep(self.rng.uniform(0.05, 2.5))
        crash_time = time.monotonic()
        self.crash_daemon()
        self.kill_workers()  # before the unmount: nothing may write into the bare mountpoint
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                       capture_output=True)
        self.crashes += 1
        if number % 3 == 2:
            time.sleep(2 * float(SESSION_TTL) if self.redis else 0)  # its heartbeat expires
            fsck = run_kvfs("fsck", "--data", str(self.data), *self.meta_options, "--repair")
            if fsck.returncode != 0:
                self.error(kind, f"round {number}: fsck --repair exited {fsck.returncode}: "
                                 f"{(fsck.stdout + fsck.stderr).strip()[-500:]}")
        self.mount()
        journal = Journal.read(logs)
        self.journal_errors(kind, journal, crash_time)
        tally.operations += sum(1 for line in journal.lines if line[0] in OPS)
        tally.bytes_verified += sum(int(line[3]) for line in journal.of("read"))
        # What the writers closed and started, over all rounds so far.
        for line in journal.of("done"):
            self.done[line[1]] = max(self.done.get(line[1], 0), int(line[2]))
        for line in journal.of("start"):
            self.started[line[1]] = max(self.started.get(line[1], 0), int(line[2]))
        if self.redis and not self.dead_sessions_reaped():
            self.error(kind, f"round {number}: the dead session was not reaped within "
                             f"{self.recovery_seconds:.0f} s")
        self.verify_crash_files(number)
        self.space_check(kind, settle=self.recovery_seconds)

    def verify_crash_files(self, number: int) -> None:
        """Check every file the crash writers left."""
        kind = "crash"
        done, started = self.done, self.started
        files = {name: size for name, size in self.visible_files().items()
                 if name.startswith("crash/")}
        for relative, size in sorted(files.items()):
            try:
                content = (self.mountpoint / relative).read_bytes()
            except OSError as error:
                self.error(kind, f"round {number}: {relative}: read failed: {errname(error)}")
                continue
            self.tally(kind).bytes_verified += len(content)
            if len(content) != size:
                self.error(kind, f"round {number}: {relative}: stat says {size} bytes, "
                                 f"{len(content)} read")
            name = relative.removesuffix(".tmp")
            if not content:
                # Created or truncated by a writer that had not closed: allowed for temp
                # names, and for names whose latest start has no done.
                if not relative.endswith(".tmp") and started.get(name, 0) <= done.get(name, 0):
                    self.error(kind, f"round {number}: {relative} is empty, yet its last "
                                     f"version {done.get(name)} was closed")
                continue
            try:
                version = check_content(name, content)
            except BadContent as error:
                self.error(kind, f"round {number}: after recovery: {error}")
                continue
            low = 0 if relative.endswith(".tmp") else done.get(name, 0)
            if not low <= version <= started.get(name, 0):
                self.error(kind, f"round {number}: {relative} holds version {version}; closed "
                                 f"{done.get(name)}, started {started.get(name)}")
        for name in done:
            if name not in files:
                self.error(kind, f"round {number}: {name} was closed (version {done[name]}) "
                                 "but is gone")

    def race_round(self, number: int, seconds: float) -> None:
        kind = "race"
        tally = self.tally(kind)
        race = self.mountpoint / "race"
        if race.exists():
            shutil.rmtree(race)
        race.mkdir()
        # Made before its writers start: they race to rewrite it (served by kvfs). A file's
        # maker writes through the kernel, and others opening it then wait for its close.
        (race / "same").touch()
        deadline = time.monotonic() + seconds
        group = f"race{number}"
        logs: dict[str, list[Path]] = {}

        def start(role: str, **spec: Any) -> None:
            logs.setdefault(role, []).append(self.start(group, role, deadline=deadline, **spec))

        start("rename_writer")
        for _ in range(2):
            start("target_reader")
        for index in range(2):
            start("same_name_writer", index=index, writers=2)
        start("same_reader")
        start("unlink_open")
        for index in range(2):
            start("shared_tmp_writer", index=index, writers=2)
        self.wait_workers(seconds + 60)
        for path in (path for paths in logs.values() for path in paths):
            lines = Journal.read([path]).lines if path.exists() else []
            if not lines or lines[-1][0] not in ("end", "exit", "CRASH"):
                self.error(kind, f"round {number}: {path.name} ended without finishing: "
                                 f"{path.with_suffix('.err').read_text()[-300:]!r}")
        journal = Journal.read(path for paths in logs.values() for path in paths)
        self.journal_errors(kind, journal, None)
        tally.operations += sum(1 for line in journal.lines if line[0] in OPS)
        tally.bytes_verified += sum(int(line[3]) for line in journal.of("read"))
        self.verify_race_files(number, logs)
        self.space_check(kind, settle=5.0)
        shutil.rmtree(race)
        self.space_check(kind, settle=5.0)

    def final_version(self, kind: str, name: str) -> int | None:
        try:
            content = (self.mountpoint / name).read_bytes()
        except FileNotFoundError:
            return None
        self.tally(kind).bytes_verified += len(content)
        try:
            return check_content(name, content)
        except BadContent as error:
            self.error(kind, f"final content: {error}")
            return None

    def verify_race_files(self, number: int, logs: dict[str, list[Path]]) -> None:
        kind = "race"
        # The last version renamed over race/target is what it holds.
        renamed = [int(line[2]) for line in Journal.read(logs["rename_writer"]).of("renamed")]
        if renamed and self.final_version(kind, "race/target") != max(renamed):
            self.error(kind, f"round {number}: race/target does not hold the last version "
                             f"renamed over it ({max(renamed)})")
        # Writers of one name: the final content is a version whose close did not end
        # before another's began (the last to close wins).
        closes = {int(line[2]): (float(line[4]), float(line[5]))
                  for line in Journal.read(logs["same_name_writer"]).of("closed")}
        final = self.final_version(kind, "race/same")
        if closes and final not in closes:
            self.error(kind, f"round {number}: race/same holds version {final}, "
                             "which no writer closed")
        elif closes and final is not None:
            _, ended = closes[final]
            later = [v for v, (began, _) in closes.items() if v != final and began > ended]
            if later:
                self.error(kind, f"round {number}: race/same holds version {final}, but "
                                 f"version {later[0]} closed after it: the last close lost")
        # Shared temp names: every chunk is whole.
        for path in sorted((self.mountpoint / "race" / "shared").glob("k*.data")):
            self.final_version(kind, str(path.relative_to(self.mountpoint)))

    def fio_round(self, number: int) -> None:
        kind = "fio"
        tally = self.tally(kind)
        fio = shutil.which("fio")
        if fio is None:
            self.notes.append("fio is not installed: fio rounds skipped")
            return
        directory = self.mountpoint / "fio"
        directory.mkdir(exist_ok=True)
        size = (8 if self.quick else 32) * MiB
        job = self.work / f"fio-{number}.fio"
        job.write_text(FIO_JOB.format(directory=directory, size=size, direct=number % 2,
                                      seed=self.rng.getrandbits(32)))
        for extra in ([], ["--verify_only"]):
            result = subprocess.run([fio, "--output-format=json", *extra, str(job)],
                                    cwd=self.work, capture_output=True, text=True,
                                    timeout=600)
            what = f"round {number} fio {' '.join(extra) or 'write+verify'}"
            if result.returncode != 0:
                self.error(kind, f"{what} exited {result.returncode}: "
                                 f"{(result.stderr or result.stdout).strip()[-800:]}")
                break
            report = json.loads(result.stdout[result.stdout.index("{"):])
            for entry in report["jobs"]:
                if entry["error"]:
                    self.error(kind, f"{what}: job {entry['jobname']} error {entry['error']}")
                tally.operations += entry["write"]["total_ios"] + entry["read"]["total_ios"]
                tally.bytes_verified += entry["read"]["io_bytes"]
            complaints = [line for line in result.stderr.splitlines()
                          if "verify" in line.lower() or "crc32c" in line.lower()]
            for line in complaints[:10]:
                self.error(kind, f"{what}: {line}")
        shutil.rmtree(directory)
        self.space_check(kind, settle=5.0)

    # -- the whole run ---------------------------------------------------------------------

    def run(self, seconds: float) -> None:
        self.logs.mkdir(parents=True)
        self.mountpoint.mkdir()
        self.mount()
        deadline = time.monotonic() + seconds
        plan = [kind for kind in ROUNDS if kind in self.only]
        race_seconds = 4.0 if self.quick else 10.0
        number = 0
        while time.monotonic() < deadline:
            kind = plan[number % len(plan)]
            started = time.monotonic()
            self.console.print(f"[bold]{kind}[/bold] round {number} "
                               f"({max(0, deadline - started):.0f} s left)")
            if kind == "crash":
                self.crash_round(number)
            elif kind == "race":
                self.race_round(number, race_seconds)
            else:
                self.fio_round(number)
            self.tally(kind).rounds += 1
            self.tally(kind).seconds += time.monotonic() - started
            number += 1
        self.unmount()
        started = time.monotonic()
        fsck = run_kvfs("fsck", "--data", str(self.data), *self.meta_options)
        output = (fsck.stdout + fsck.stderr).strip()
        tally = self.tally("fsck")
        tally.rounds += 1
        tally.seconds += time.monotonic() - started
        if fsck.returncode != 0 or "clean" not in output:
            self.error("fsck", f"final fsck exited {fsck.returncode}: {output[-800:]}")

    def cleanup(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for stuck in self.end_workers():
            self.console.print(f"[red]worker {stuck} would not die[/red]")
        pid = self.pid or Volume(self.data).daemon_pid(self.mountpoint)
        if pid and pid_alive(pid):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                           capture_output=True)
            if not wait_dead(pid, 15):
                os.kill(pid, signal.SIGKILL)
                wait_dead(pid, 10)
        if self.mounted():
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=False,
                           capture_output=True)
        if self.redis:
            self.redis.stop()
        if self.keep:
            self.console.print(f"kept the work directory {self.work}")
        elif self.mounted():
            self.console.print(f"[red]{self.mountpoint} is still mounted: left {self.work}[/red]")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    def summary(self, seconds: float, interrupted: bool) -> None:
        table = Table(title=f"kvfs soak: {seconds / 60:.1f} minutes"
                            f"{' (interrupted)' if interrupted else ''}")
        for column in ("round", "rounds", "operations", "bytes verified", "seconds", "errors"):
            table.add_column(column, justify="left" if column == "round" else "right")
        total = Tally()
        for kind, tally in self.tallies.items():
            table.add_row(kind, str(tally.rounds), f"{tally.operations:,}",
                          human(tally.bytes_verified), f"{tally.seconds:.0f}",
                          f"[red]{tally.errors}[/red]" if tally.errors else "0")
            total.operations += tally.operations
            total.bytes_verified += tally.bytes_verified
        table.add_row("total", "", f"{total.operations:,}", human(total.bytes_verified), "",
                      str(len(self.errors)), style="bold")
        self.console.print(table)
        self.console.print(f"crashes survived: {self.crashes}")
        for note, count in Counter(self.notes).items():
            self.console.print(f"note: {note}" + (f" (x{count})" if count > 1 else ""))
        if self.errors:
            self.console.print(f"[red bold]{len(self.errors)} errors:[/red bold]")
            for error in self.errors[:50]:
                self.console.print(f"  {error}", markup=False)
            if len(self.errors) > 50:
                self.console.print(f"  ... and {len(self.errors) - 50} more")
        else:
            self.console.print("[green bold]no errors[/green bold]")


FIO_JOB = """
[global]
directory={directory}
ioengine=psync
direct={direct}
size={size}
numjobs=3
fallocate=none
bssplit=4k/30:16k/15:64k/15:256k/20:1m/20
verify=crc32c
verify_fatal=1
verify_state_save=0
do_verify=1
randseed={seed}
filename_format=$jobname.$jobnum

[seq]
rw=write

[rand]
rw=randwrite
"""


# -- helpers -----------------------------------------------------------------------------------


def run_kvfs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "kvfs"), *args],
                          capture_output=True, text=True, timeout=600)


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_dead(pid: int, timeout: float) -> bool:
    return wait_for(lambda: not pid_alive(pid), timeout)


def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def human(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long (default 20)")
    parser.add_argument("--quick", action="store_true", help="about one minute, smaller rounds")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                        help="where to make the work directory (default /var/tmp)")
    parser.add_argument("--seed", type=int, help="random seed (default: a random one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--only", choices=sorted(set(ROUNDS)), action="append",
                        help="run only these rounds (repeatable; default all)")
    parser.add_argument("--redis", action="store_true",
                        help="soak the shared-pool engine (a redis-server of its own)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    console = Console()
    if os.geteuid() != 0:
        console.print("soak.py needs root (FUSE mounts, fusermount3)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    seconds = 60.0 if args.quick else args.minutes * 60
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvfs-soak-", dir=args.workdir))
    soak = Soak(work, random.Random(seed), args.quick, args.keep, console,
                only=set(args.only or ROUNDS))
    if args.redis:
        soak.redis = LocalRedis(work / "redis").start()
    console.print(f"kvfs soak for {seconds / 60:g} minutes in {work} (seed {seed})")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    started = time.monotonic()
    interrupted = False
    try:
        soak.run(seconds)
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: cleaning up[/yellow]")
    except Abort as error:
        soak.error("abort", str(error))
    except Exception:  # report it with the rest, then clean up
        soak.error("soak", traceback.format_exc())
    finally:
        soak.cleanup()
    soak.summary(time.monotonic() - started, interrupted)
    if interrupted:
        return 130
    return 1 if soak.errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
