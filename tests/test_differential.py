"""Differential test: kvfs against a plain directory, under random sequences of file operations.

A hypothesis state machine applies every operation to a kvfs mount and to a plain directory on
the local disk side by side, and compares what each returns — data, sizes, listings, modes,
xattrs and errnos — after every step; the whole trees (with contents and xattrs) and kvfs's
space accounting are compared at the end of each example.

Operations: create (O_CREAT with and without O_EXCL / O_TRUNC / O_APPEND), writes at offsets
(holes, across the 1 MiB checksum blocks), open-act-close sessions mixing pwrite, write, lseek,
ftruncate and pread on one handle, truncate, rename and renameat2 (NOREPLACE, EXCHANGE) of
files and directories (onto existing entries, into their own subtree), unlink, mkdir, rmdir,
whole and partial reads, listdir, stat, chmod, utime, user xattrs.

Only the differences kvfs documents (README: "Guarantees", "Semantics not offered") are allowed:
- Close-to-open visibility, stat showing the committed size: every operation opens, acts and
  closes; nothing is compared (fstat, SEEK_END) while a handle is open for writing.
- atime is the last use, mtime is set when a writer commits: times are compared only right
  after utime() set them.
- Directories' st_size and st_nlink are not compared.
- No symlinks, hard links or special files: not generated. `.kvfs` in the root is reserved and
  not listed: names in the root never use it (deeper directories do).
- Shared temp names: a file renamed away while (or within 2 s after) two writers had it open
  still answers lookups of its old name for 2 s. The test tracks those windows and leaves the
  old name alone until it has expired.

Cost: by default 100 examples of up to 50 steps (about 10 s on 2 cores). Other profiles, selected
with the environment variable KVFS_HYPOTHESIS_PROFILE:

    KVFS_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_differential.py
        5000 examples of up to 80 steps (about 15 minutes): after changes to the namespace
        or write paths, or as a soak;
    KVFS_HYPOTHESIS_PROFILE=quick    5 examples of up to 20 steps: a smoke run.

A failure prints the shortest sequence of steps hypothesis found as a runnable program; it is
saved in .hypothesis/ and replayed first on the next run.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import random
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import KvfsMount
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

MiB = 1 << 20

PROFILES: dict[str, dict[str, int]] = {
    "default": {"max_examples": 100, "stateful_step_count": 50},
    "quick": {"max_examples": 5, "stateful_step_count": 20},
    "long": {"max_examples": 5000, "stateful_step_count": 80},
}
PROFILE = os.environ.get("KVFS_HYPOTHESIS_PROFILE", "default")
if PROFILE not in PROFILES:
    raise ValueError(f"KVFS_HYPOTHESIS_PROFILE={PROFILE!r}: use one of {', '.join(PROFILES)}")
SETTINGS = settings(
    **PROFILES[PROFILE],
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- what the rules are made of ----------------------------------------------------------------

NAMES = ("a", "b", "c")
DEEP_NAMES = (*NAMES, ".kvfs")  # reserved in the root only

Parts = tuple[str, ...]

paths = st.builds(lambda first, rest: (first, *rest), st.sampled_from(NAMES),
                  st.lists(st.sampled_from(DEEP_NAMES), max_size=2))
offsets = st.one_of(
    st.integers(0, 9000),
    st.integers(0, 300_000),
    st.sampled_from([4096, MiB - 7, MiB, MiB + 3, 2 * MiB + 100, 3 * MiB]),
)
sizes = st.one_of(st.integers(0, 10_000),
                  st.sampled_from([0, 1, 4096, MiB - 1, MiB, MiB + 1, 2 * MiB + 5]))
file_modes = st.sampled_from([0o600, 0o644, 0o640, 0o755, 0o444])
dir_modes = st.sampled_from([0o755, 0o700, 0o750])
xattr_names = st.sampled_from(["user.x", "user.y"])

XATTR_CREATE = getattr(os, "XATTR_CREATE", 1)
XATTR_REPLACE = getattr(os, "XATTR_REPLACE", 2)
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100


@dataclass(frozen=True)
class Payload:
    """Bytes to write, described briefly (hypothesis prints failing steps with this repr)."""

    seed: int
    length: int

    def data(self) -> bytes:
        return random.Random(self.seed).randbytes(self.length)

    def __repr__(self) -> str:
        return f"Payload(seed={self.seed}, length={self.length})"


payloads = st.builds(
    Payload, st.integers(0, 1 << 16),
    st.one_of(st.integers(0, 100), st.integers(0, 70_000),
              st.sampled_from([4096, MiB - 1, MiB + 5])))

ACCESS = {"O_RDONLY": os.O_RDONLY, "O_WRONLY": os.O_WRONLY, "O_RDWR": os.O_RDWR}
EXTRA = {"O_CREAT": os.O_CREAT, "O_TRUNC": os.O_TRUNC, "O_APPEND": os.O_APPEND,
         "O_EXCL": os.O_EXCL}
open_flags = st.tuples(st.sampled_from(sorted(ACCESS)),
                       st.lists(st.sampled_from(sorted(EXTRA)), unique=True, max_size=3)
                       ).map(lambda f: (f[0], *sorted(f[1])))
write_flags = st.sampled_from([(), ("O_CREAT",), ("O_CREAT", "O_TRUNC"), ("O_CREAT", "O_EXCL"),
                               ("O_APPEND", "O_CREAT"), ("O_TRUNC",)])

actions = st.lists(st.one_of(
    st.tuples(st.just("pwrite"), offsets, payloads),
    st.tuples(st.just("write"), payloads),
    st.tuples(st.just("seek"), offsets),
    st.tuples(st.just("ftruncate"), sizes),
    st.tuples(st.just("pread"), offsets, st.integers(0, 100_000)),
), max_size=6)


def flags_of(names: tuple[str, ...]) -> int:
    flags = 0
    for name in names:
        flags |= ACCESS.get(name, 0) | EXTRA.get(name, 0)
    return flags


# -- running one operation on both sides -----------------------------------------------------


def attempt(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """("ok", result) or ("error", errno name): what a caller of `call` sees."""
    try:
        return ("ok", call(*args))
    except OSError as error:
        return ("error", errno.errorcode.get(error.errno or 0, error.errno))


def describe(outcome: Any) -> str:
    """A short form of an outcome for messages: long bytes become length and digest."""
    if isinstance(outcome, bytes) and len(outcome) > 64:
        return f"<{len(outcome)} bytes {hashlib.blake2b(outcome, digest_size=6).hexdigest()}>"
    if isinstance(outcome, tuple | list):
        inner = ", ".join(describe(item) for item in outcome)
        return f"({inner})" if isinstance(outcome, tuple) else f"[{inner}]"
    return repr(outcome)


def first_difference(ours: bytes, theirs: bytes) -> str:
    for index, (x, y) in enumerate(zip(ours, theirs, strict=False)):
        if x != y:
            return f"first differing byte at {index}"
    return f"lengths {len(ours)} vs {len(theirs)}"


def assert_same(what: str, ours: Any, theirs: Any) -> None:
    if ours == theirs:
        return
    detail = ""
    if (isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == 2
            and isinstance(ours[1], bytes) and isinstance(theirs[1], bytes)):
        detail = f" ({first_difference(ours[1], theirs[1])})"
    raise AssertionError(f"{what}: kvfs {describe(ours)}, plain directory "
                         f"{describe(theirs)}{detail}")


_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(source: Path, target: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target),
                       flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def summary(st_: os.stat_result) -> tuple:
    """What must agree between kvfs and a plain directory for one entry."""
    if stat.S_ISDIR(st_.st_mode):
        return ("dir", stat.S_IMODE(st_.st_mode), st_.st_uid, st_.st_gid)
    return (stat.filemode(st_.st_mode), st_.st_uid, st_.st_gid, st_.st_size, st_.st_nlink)


def tree(root: Path, contents: bool = False) -> dict[str, tuple]:
    """Relative path -> summary (and, if asked, digest and user xattrs) of everything below."""
    found: dict[str, tuple] = {}
    pending = [root]
    while pending:
        directory = pending.pop()
        for name in sorted(os.listdir(directory)):
            path = directory / name
            info = os.lstat(path)
            entry = summary(info)
            if contents:
                if stat.S_ISREG(info.st_mode):
                    entry += (hashlib.blake2b(path.read_bytes()).hexdigest(),)
                xattrs = sorted(a for a in os.listxattr(path) if a.startswith("user."))
                entry += (tuple((a, os.getxattr(path, a)) for a in xattrs),)
            found[str(path.relative_to(root))] = entry
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
    return found


def clear(root: Path) -> None:
    for name in os.listdir(root):
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def read_all(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 4 * MiB):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def write_at(path: Path, flags: int, offset: int, data: bytes, mode: int) -> int:
    fd = os.open(path, flags | os.O_WRONLY, mode)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def act(fd: int, action: tuple) -> Any:
    kind = action[0]
    if kind == "pwrite":
        return os.pwrite(fd, action[2].data(), action[1])
    if kind == "write":
        return os.write(fd, action[1].data())
    if kind == "seek":
        return os.lseek(fd, action[1], os.SEEK_SET)
    if kind == "ftruncate":
        return os.ftruncate(fd, action[1])
    if kind == "pread":
        return os.pread(fd, action[2], action[1])
    raise AssertionError(kind)


def session(path: Path, flags: int, steps: list[tuple], mode: int) -> tuple[list, int | None]:
    """open, act, close: each call's outcome, and the inode if it was opened for writing."""
    opened = attempt(os.open, path, flags, mode)
    if opened[0] != "ok":
        return [("open", opened)], None
    fd = opened[1]
    results: list = [("open", ("ok", None))]
    ino = None
    try:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            ino = os.fstat(fd).st_ino
        for step in steps:
            results.append((step[0], attempt(act, fd, step)))
    finally:
        results.append(("close", attempt(os.close, fd)))
    return results, ino


def round_up(size: int, unit: int = 4096) -> int:
    return -(-size // unit) * unit


# -- the state machine -------------------------------------------------------------------------

# kvfs keeps a renamed file's old name for its other writers (README, "Shared temp names") when
# the renamed file had two writers within WRITERS_WINDOW seconds; the old name then finds the
# moved file for WRITERS_WINDOW seconds. The test assumes a little longer, to be safe.
WRITERS_WINDOW = 2.0
MARGIN = 0.6


class KvfsVsPlainDirectory(RuleBasedStateMachine):
    # Set by the test: one mount for the whole run. Kept across examples (kvfs keeps them).
    mount: ClassVar[KvfsMount]
    reference: ClassVar[Path]
    writer_closes: ClassVar[dict[int, list[float]]]  # kvfs ino -> when writable handles closed
    old_names: ClassVar[dict[tuple[int, str], float]]  # (kvfs parent ino, name) -> until

    def __init__(self) -> None:
        super().__init__()
        self.ours = self.mount.mountpoint
        self.theirs = self.reference
        assert os.listdir(self.ours) == [] and os.listdir(self.theirs) == []

    # -- helpers ---------------------------------------------------------------------------

    def both(self, what: str, call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
        """Run call(root, *args) on kvfs and on the plain directory; they must agree."""
        ours = attempt(call, self.ours, *args)
        theirs = attempt(call, self.theirs, *args)
        assert_same(what, ours, theirs)
        return ours

    def kvfs_ino(self, parts: Parts) -> int | None:
        try:
            return os.lstat(self.ours.joinpath(*parts)).st_ino
        except OSError:
            return None

    def shadowed(self, *targets: Parts) -> bool:
        """Whether a path goes through an old name kvfs still keeps for a renamed file's
        writers: the one documented case where a name that is gone still answers lookups."""
        now = time.monotonic()
        for key in [k for k, until in self.old_names.items() if until <= now]:
            del self.old_names[key]
        if not self.old_names:
            return False
        root_ino = os.lstat(self.ours).st_ino
        for parts in targets:
            parent = root_ino
            for depth, name in enumerate(parts):
                if (parent, name) in self.old_names:
                    note(f"leaving {'/'.join(parts)} alone: {name} is a kept old name")
                    return True
                try:
                    info = os.lstat(self.ours.joinpath(*parts[: depth + 1]))
                except OSError:
                    break
                if not stat.S_ISDIR(info.st_mode):
                    break
                parent = info.st_ino
        return False

    def writer_closed(self, ino: int | None) -> None:
        if ino is not None:
            self.writer_closes.setdefault(ino, []).append(time.monotonic())

    def recent_writers(self, ino: int) -> int:
        since = time.monotonic() - WRITERS_WINDOW - MARGIN
        return sum(1 for t in self.writer_closes.get(ino, ()) if t > since)

    def compare_file(self, parts: Parts) -> None:
        self.both(f"read back {'/'.join(parts)}", lambda root: read_all(root.joinpath(*parts)))

    # -- namespace -------------------------------------------------------------------------

    @rule(parts=paths, mode=dir_modes)
    def mkdir(self, parts: Parts, mode: int) -> None:
        if not self.shadowed(parts):
            self.both(f"mkdir {'/'.join(parts)}",
                      lambda root: os.mkdir(root.joinpath(*parts), mode))

    @rule(parts=paths)
    def rmdir(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"rmdir {'/'.join(parts)}", lambda root: os.rmdir(root.joinpath(*parts)))

    @rule(parts=paths)
    def unlink(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"unlink {'/'.join(parts)}", lambda root: os.unlink(root.joinpath(*parts)))

    @rule(source=paths, dest=paths, how=st.sampled_from(["rename", "noreplace", "exchange"]))
    def rename(self, source: Parts, dest: Parts, how: str) -> None:
        if self.shadowed(source, dest):
            return
        flags = {"rename": 0, "noreplace": RENAME_NOREPLACE, "exchange": RENAME_EXCHANGE}[how]
        moved = self.kvfs_ino(source)
        parent = self.kvfs_ino(source[:-1])
        is_file = moved is not None and os.path.isfile(self.ours.joinpath(*source))
        writers = self.recent_writers(moved) if is_file and moved is not None else 0
        outcome = self.both(
            f"{how} {'/'.join(source)} -> {'/'.join(dest)}",
            lambda root: renameat2(root.joinpath(*source), root.joinpath(*dest), flags))
        if outcome[0] == "ok" and writers >= 2 and parent is not None and source != dest:
            self.old_names[(parent, source[-1])] = time.monotonic() + WRITERS_WINDOW + MARGIN

    @rule(parts=paths)
    def listdir(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"listdir {'/'.join(parts)}",
                      lambda root: sorted(os.listdir(root.joinpath(*parts))))

    @rule(parts=paths)
    def stat_path(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"stat {'/'.join(parts)}",
                      lambda root: summary(os.stat(root.joinpath(*parts))))

    @rule(parts=paths, mode=file_modes)
    def chmod(self, parts: Parts, mode: int) -> None:
        if not self.shadowed(parts):
            self.both(f"chmod {'/'.join(parts)} {mode:o}",
                      lambda root: os.chmod(root.joinpath(*parts), mode))

    @rule(parts=paths, mtime=st.integers(0, 2_000_000_000 * 10**9))
    def utime(self, parts: Parts, mtime: int) -> None:
        if self.shadowed(parts):
            return

        def set_and_get(root: Path) -> int:
            path = root.joinpath(*parts)
            os.utime(path, ns=(mtime, mtime))
            return os.stat(path).st_mtime_ns

        self.both(f"utime {'/'.join(parts)}", set_and_get)

    # -- file content ----------------------------------------------------------------------

    @rule(parts=paths, flags=write_flags, offset=offsets, payload=payloads, mode=file_modes)
    def write(self, parts: Parts, flags: tuple[str, ...], offset: int, payload: Payload,
              mode: int) -> None:
        if self.shadowed(parts):
            return
        data = payload.data()
        outcome = self.both(
            f"write {'/'.join(parts)} {flags} at {offset} {payload}",
            lambda root: write_at(root.joinpath(*parts), flags_of(flags), offset, data, mode))
        if outcome[0] == "ok":
            self.writer_closed(self.kvfs_ino(parts))
            self.compare_file(parts)

    @rule(parts=paths, flags=open_flags, steps=actions, mode=file_modes)
    def open_act_close(self, parts: Parts, flags: tuple[str, ...], steps: list[tuple],
                       mode: int) -> None:
        if self.shadowed(parts):
            return
        ours, ino = session(self.ours.joinpath(*parts), flags_of(flags), steps, mode)
        theirs, _ = session(self.theirs.joinpath(*parts), flags_of(flags), steps, mode)
        self.writer_closed(ino)
        for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
            assert_same(f"open {'/'.join(parts)} {flags}: call {index} {mine[0]}", mine, other)
        assert len(ours) == len(theirs)
        if ino is not None:
            self.compare_file(parts)

    @rule(parts=paths, size=sizes)
    def truncate(self, parts: Parts, size: int) -> None:
        if self.shadowed(parts):
            return
        ino = self.kvfs_ino(parts)
        outcome = self.both(f"truncate {'/'.join(parts)} {size}",
                            lambda root: os.truncate(root.joinpath(*parts), size))
        if outcome[0] == "ok":
            self.writer_closed(ino)  # kvfs truncates through a write handle of its own
            self.compare_file(parts)

    @rule(parts=paths)
    def read_whole(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"read {'/'.join(parts)}", lambda root: read_all(root.joinpath(*parts)))

    @rule(parts=paths, offset=offsets, length=st.integers(0, 2 * MiB))
    def read_part(self, parts: Parts, offset: int, length: int) -> None:
        if not self.shadowed(parts):
            self.both(f"pread {'/'.join(parts)} {length} at {offset}",
                      lambda root: read_at(root.joinpath(*parts), offset, length))

    # -- xattrs ----------------------------------------------------------------------------

    @rule(parts=paths, name=xattr_names, value=st.binary(max_size=40),
          flags=st.sampled_from([0, XATTR_CREATE, XATTR_REPLACE]))
    def setxattr(self, parts: Parts, name: str, value: bytes, flags: int) -> None:
        if not self.shadowed(parts):
            self.both(f"setxattr {'/'.join(parts)} {name} flags={flags}",
                      lambda root: os.setxattr(root.joinpath(*parts), name, value, flags))

    @rule(parts=paths, name=xattr_names)
    def getxattr(self, parts: Parts, name: str) -> None:
        if not self.shadowed(parts):
            self.both(f"getxattr {'/'.join(parts)} {name}",
                      lambda root: os.getxattr(root.joinpath(*parts), name))

    @rule(parts=paths)
    def listxattr(self, parts: Parts) -> None:
        if not self.shadowed(parts):
            self.both(f"listxattr {'/'.join(parts)}",
                      lambda root: sorted(a for a in os.listxattr(root.joinpath(*parts))
                                          if a.startswith("user.")))

    @rule(parts=paths, name=xattr_names)
    def removexattr(self, parts: Parts, name: str) -> None:
        if not self.shadowed(parts):
            self.both(f"removexattr {'/'.join(parts)} {name}",
                      lambda root: os.removexattr(root.joinpath(*parts), name))

    # -- whole trees -----------------------------------------------------------------------

    @invariant()
    def same_tree(self) -> None:
        assert_same("tree (types, modes, owners, file sizes)", tree(self.ours),
                    tree(self.theirs))

    @rule()
    def same_contents(self) -> None:
        assert_same("tree with contents and xattrs", tree(self.ours, contents=True),
                    tree(self.theirs, contents=True))

    def teardown(self) -> None:
        try:
            self.same_contents()
            # Space: what statvfs says is used is exactly what the files hold, nothing is
            # left staged, and an emptied volume uses nothing.
            files = sum(os.lstat(self.ours / relative).st_size
                        for relative, entry in tree(self.ours).items() if entry[0] != "dir")
            assert statvfs_used(self.ours) == round_up(files)
            assert list((self.mount.data / "staging").iterdir()) == []
        finally:
            clear(self.ours)
            clear(self.theirs)
        assert statvfs_used(self.ours) == 0


def statvfs_used(root: Path) -> int:
    info = os.statvfs(root)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


# -- the test ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvfsMount]:
    base = tmp_path_factory.mktemp("differential")
    (base / "mnt").mkdir()
    mount = KvfsMount(base / "mnt", base / "data", ["--capacity", "1G"])
    try:
        mount.mount()
        yield mount
        mount.unmount()
    finally:
        mount.cleanup()


@pytest.mark.timeout(0 if PROFILE == "long" else 300)
def test_kvfs_behaves_like_a_plain_directory(shared_mount: KvfsMount,
                                             tmp_path: Path) -> None:
    reference = tmp_path / "plain"
    reference.mkdir()
    KvfsVsPlainDirectory.mount = shared_mount
    KvfsVsPlainDirectory.reference = reference
    KvfsVsPlainDirectory.writer_closes = {}
    KvfsVsPlainDirectory.old_names = {}
    old_umask = os.umask(0o022)  # the same for both sides, whatever the caller's
    try:
        run_state_machine_as_test(KvfsVsPlainDirectory, settings=SETTINGS)
    finally:
        os.umask(old_umask)
