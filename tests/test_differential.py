"""Differential test: kvfs against a plain directory, under random sequences of file operations.

A hypothesis state machine applies every operation to a kvfs mount and to a plain directory on
the local disk side by side, and compares what each returns (data, sizes, listings, modes,
xattrs, link targets and errnos) after every step; after every step it also compares the
whole trees and checks that kvfs's usage counters equal a recount of its metadata. The trees
with contents and xattrs, and kvfs's space accounting, are compared at the end of each example.

Operations: create (O_CREAT with and without O_EXCL / O_TRUNC / O_APPEND), writes at offsets
(holes, across the 1 MiB checksum blocks, far past the end: 64 GiB, 1 TiB, at and past the
16 TiB limit: EFBIG), open-act-close sessions mixing pwrite, write, lseek, ftruncate and pread
on one handle, sessions of several descriptors of one file at once (readers before and after
a writer) read and written through shared and private maps as through pread and pwrite,
truncate (to sparse sizes: 64 GiB, 1 TiB; 16 TiB and more: EFBIG), rename and
renameat2 (NOREPLACE, EXCHANGE) of files, directories and special files (onto existing
entries, into their own subtree, between two names of one inode), unlink, mkdir, rmdir,
symlinks (to generated names, dangling, looping, absolute, with a trailing slash; the other
operations follow them), hard links (of files, special files and symlinks, following them or
not; of directories: EPERM), mkfifo, mknod (character and block devices, regular files), unix
socket binds (which make socket inodes), whole and partial reads, listdir, stat and lstat,
chmod (also to setuid, setgid and sticky modes), utime, user xattrs, and writes, O_TRUNC
opens and truncates of world-writable files by another user (nobody, through setpriv), which
must clear setuid and setgid exactly as Linux does. Paths are drawn mostly among the names
that exist and the free names in existing directories, else at random (mostly below missing
directories: the errno cases).

Compared for every name (lstat, so symlinks are not followed): file type, permission bits,
owner and group; for everything but directories st_size, st_nlink, and which other names
share its inode (the partition of names into inodes, not the inode numbers); symlink targets;
st_rdev of device nodes; for regular files, the bytes allocated (st_blocks) against the data
the plain directory's file holds (its SEEK_DATA ranges, in 4 KiB blocks): holes take nothing
on either side. Contents of large sparse files are compared where the plain file holds data,
at its start and end, and around every hole's edges.

Only the differences kvfs documents (README: "Guarantees", "Semantics not offered") are allowed:
- Close-to-open visibility: other handles see a writer's bytes once it closes, so every
  operation opens, acts and closes. The writer itself sees its own size (fstat, SEEK_END,
  writes after seeking to the end), compared within each session.
- atime is the last use, mtime is set when a writer commits: times are compared only right
  after utime() set them.
- Directories' st_size and st_nlink are not compared.
- `.kvfs` in the root is reserved and not listed: names in the root never use it (deeper
  directories do), and no symlink target can lead back to the root (targets never hold
  `.`, `..`, or an absolute path that exists).
- The mount has nodev: device nodes (and fifos, which would block) are created, inspected,
  renamed, linked and removed, never opened.
- lseek past ext4's largest file size (16 TiB - 4 KiB) is EINVAL there and allowed by the
  kernel for every FUSE file system: seeks stay below it.

Cost: by default 100 examples of up to 50 steps (25 to 45 s on 2 cores). Other profiles,
selected with the environment variable KVFS_HYPOTHESIS_PROFILE:

    KVFS_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_differential.py
        5000 examples of up to 80 steps (about an hour): after changes to the namespace
        or write paths, or as a soak. It also makes files of ext4's largest size (truncate
        to 16 TiB - 4 KiB, writes from 16 TiB - 5000 that are cut short there), which cost
        kvfs seconds per change (a checksum per MiB);
    KVFS_HYPOTHESIS_PROFILE=quick    5 examples of up to 20 steps: a smoke run.

Both roots lie in a 0755 directory under /var/tmp and kvfs is mounted with --allow-other, so
that user nobody can reach them. A failure prints the shortest sequence of steps hypothesis
found as a runnable program; it is saved in .hypothesis/ and replayed first on the next run.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import random
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import KvfsMount, assert_counters_exact, assert_only_spares_staged, stats
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from local_redis import LocalRedis

KiB = 1 << 10
MiB = 1 << 20
TiB = 1 << 40
LIMIT = 1 << 44  # kvfs's largest file size (16 TiB); ext4's is one 4 KiB block less

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
    # The same examples on every run of the default profile (what CI runs): a failure is
    # repeatable; the long profile explores afresh each time.
    derandomize=PROFILE != "long",
    # ... and a failure there is reported as found: shrinking it can take longer than the
    # test's time limit, which would leave the mount mid-step.
    phases=list(Phase) if PROFILE == "long" else [Phase.explicit, Phase.generate],
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

NOBODY = 65534
# Only the standard library is needed: the system interpreter, which nobody can surely run.
CHILD_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

# -- what the rules are made of ----------------------------------------------------------------

NAMES = ("a", "b", "c")
DEEP_NAMES = (*NAMES, ".kvfs")  # reserved in the root only

Parts = tuple[str, ...]

paths = st.builds(lambda first, rest: (first, *rest), st.sampled_from(NAMES),
                  st.lists(st.sampled_from(DEEP_NAMES), max_size=2))
# Far past the end: 64 GiB, 1 TiB; from 16 TiB - 100 on, writes are refused (EFBIG). ext4's
# largest size is 16 TiB - 4 KiB: a write from below it that reaches past it is cut short
# there. Files that large cost kvfs seconds per change (a checksum per MiB), so only the long
# profile makes them: writes from 16 TiB - 5000 bytes, truncates to 16 TiB - 4 KiB.
HUGE = PROFILE == "long"
far_offsets = st.sampled_from([1 << 36, (1 << 36) + 4095, TiB + 3, LIMIT - 100, LIMIT, 1 << 62,
                               *([LIMIT - 5000] if HUGE else [])])
offsets = st.one_of(
    st.integers(0, 9000),
    st.integers(0, 300_000),
    st.sampled_from([4096, MiB - 7, MiB, MiB + 3, 2 * MiB + 100, 3 * MiB]),
    far_offsets,
)
sizes = st.one_of(st.integers(0, 10_000),
                  st.sampled_from([0, 1, 4096, MiB - 1, MiB, MiB + 1, 2 * MiB + 5]),
                  # sparse: a hole up to the size; past 16 TiB - 4 KiB: EFBIG
                  st.sampled_from([1 << 36, (1 << 36) + 5, TiB, LIMIT, LIMIT + 1, 1 << 62,
                                   *([LIMIT - 4096] if HUGE else [])]))
block_offsets = st.integers(0, 768).map(lambda blocks: blocks * 4096)  # whole blocks
near_offsets = st.one_of(st.integers(0, 300_000), block_offsets)
# linux/falloc.h; each answered as ext4 answers it, refusals included. Not COLLAPSE_RANGE and
# INSERT_RANGE: the kernel's FUSE refuses them (EOPNOTSUPP) before any daemon sees them.
FALLOCATE_MODES = {"0": 0, "KEEP_SIZE": 0x01, "PUNCH_HOLE": 0x01 | 0x02, "ZERO_RANGE": 0x10,
                   "ZERO_RANGE|KEEP_SIZE": 0x10 | 0x01}
COPY_SECONDS = 20  # a copy_file_range that takes longer has stalled
file_modes = st.sampled_from([0o600, 0o644, 0o640, 0o755, 0o444])
dir_modes = st.sampled_from([0o755, 0o700, 0o750])
chmod_modes = st.sampled_from([0o600, 0o644, 0o640, 0o755, 0o444, 0o4755, 0o2775, 0o2745,
                               0o6777, 0o1777, 0o6711])
# Modes that let nobody write: setgid with and without group exec, setuid, neither.
shared_modes = st.sampled_from([0o6777, 0o4777, 0o2777, 0o2767, 0o6766, 0o2666, 0o0777,
                                0o0666])
xattr_names = st.sampled_from(["user.x", "user.y"])
# Small, and past what ext4 keeps in the inode (both names' values fit one 4 KiB block there)
xattr_values = st.one_of(st.binary(max_size=40), st.binary(min_size=400, max_size=1500))
# Symlink targets: relative, going down from the link's directory only (no `.` or `..`), so
# that whatever they resolve to lies below the root and never is the root (`.kvfs`).
link_targets = st.one_of(
    st.lists(st.sampled_from((*NAMES, "x")), min_size=1, max_size=3).map("/".join),
    st.sampled_from(["a/", "x/y/", "/nonexistent-kvfs-target/x"]),
)
device_numbers = st.sampled_from([(240, 1), (254, 300), (4095, 1048575)])

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
    # lseek past ext4's largest size: EINVAL there, allowed by FUSE (the kernel's limit for
    # every FUSE file system, whatever kvfs's), so not compared
    st.tuples(st.just("seek"), offsets.filter(lambda offset: offset < LIMIT - 4096)),
    st.tuples(st.just("ftruncate"), sizes),
    st.tuples(st.just("pread"), offsets, st.integers(0, 100_000)),
    # what the writer itself sees of its file while it is open: its own size and end
    st.tuples(st.just("fstat")),
    st.tuples(st.just("seek_end")),
    # preallocation, holes and zeroed ranges; copies within the file
    st.tuples(st.just("fallocate"), st.sampled_from(sorted(FALLOCATE_MODES)),
              st.one_of(st.integers(0, 300_000), block_offsets),
              st.one_of(st.integers(1, 3 * MiB), block_offsets.filter(bool))),
    st.tuples(st.just("copy_range"), near_offsets, near_offsets, st.integers(0, 2 * MiB)),
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
    if isinstance(outcome, dict):
        return "{" + ", ".join(f"{key!r}: {describe(value)}"
                               for key, value in outcome.items()) + "}"
    return repr(outcome)


def first_difference(ours: bytes, theirs: bytes) -> str:
    for index, (x, y) in enumerate(zip(ours, theirs, strict=False)):
        if x != y:
            return f"first differing byte at {index}"
    return f"lengths {len(ours)} vs {len(theirs)}"


def dict_difference(ours: dict, theirs: dict) -> str:
    lines = [f"\n  {key}: kvfs {describe(ours.get(key, '<absent>'))}, plain directory "
             f"{describe(theirs.get(key, '<absent>'))}"
             for key in sorted({*ours, *theirs}) if ours.get(key) != theirs.get(key)]
    return "; differing entries:" + "".join(lines)


def assert_same(what: str, ours: Any, theirs: Any) -> None:
    if ours == theirs:
        return
    detail = ""
    if (isinstance(ours, tuple) and isinstance(theirs, tuple) and len(ours) == 2
            and isinstance(ours[1], bytes) and isinstance(theirs[1], bytes)):
        detail = f" ({first_difference(ours[1], theirs[1])})"
    if isinstance(ours, dict) and isinstance(theirs, dict):
        detail = dict_difference(ours, theirs)
    raise AssertionError(f"{what}: kvfs {describe(ours)}, plain directory "
                         f"{describe(theirs)}{detail}")


_libc = ctypes.CDLL(None, use_errno=True)


def getxattr_into(path: Path, name: str, size: int) -> bytes | int:
    """getxattr(2) with a buffer of `size` bytes: the value, or with size 0 its length (an
    ERANGE where the buffer is too small)."""
    buffer = ctypes.create_string_buffer(max(size, 1))
    got = _libc.getxattr(os.fsencode(path), name.encode(), buffer if size else None, size)
    if got < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return buffer.raw[:got] if size else got


def store_with_xattr(temp: Path, dest: Path, content: bytes, name: str, value: bytes
                     ) -> bytes:
    """vLLM's tier with a checksum (its PR #57912): a temp file written, its xattr set
    through the open descriptor, closed, renamed over the name; the name's xattr read."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, content)
        os.setxattr(fd, name, value)
    finally:
        os.close(fd)
    os.rename(temp, dest)
    return os.getxattr(dest, name)


def renameat2(source: Path, target: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target),
                       flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def within(seconds: float, call: Callable[..., Any], *args: Any) -> Any:
    """call(*args), failing the test if it has not returned after `seconds` (it stalled)."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(call, *args).result(timeout=seconds)
    except TimeoutError:
        raise AssertionError(f"{call.__name__}{args} stalled") from None
    finally:
        pool.shutdown(wait=False)  # (a stalled call's thread is left behind)


def round_up(size: int, unit: int = 4096) -> int:
    return -(-size // unit) * unit


def round_down(size: int, unit: int = 4096) -> int:
    return size // unit * unit


# -- what is compared --------------------------------------------------------------------------

KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink",
         stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char",
         stat.S_IFBLK: "block"}


def data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The (start, end) ranges below `size` that hold data (SEEK_DATA / SEEK_HOLE: what the
    plain directory's file system says; everything else is a hole)."""
    ranges: list[tuple[int, int]] = []
    position = 0
    while position < size:
        try:
            start = os.lseek(fd, position, os.SEEK_DATA)
        except OSError as error:
            if error.errno == errno.ENXIO:
                break
            raise
        if start >= size:
            break
        position = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        ranges.append((start, position))
    return ranges


def data_blocks(path: Path) -> int:
    """Bytes of the 4 KiB blocks a plain file holds data in: what it must take on kvfs too.
    (Not st_blocks: ext4 counts its extent tree's blocks there, once they are written back.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        blocks: set[int] = set()
        for start, end in data_ranges(fd, size):
            blocks.update(range(start // 4096, round_up(end) // 4096))
        return len(blocks) * 4096
    finally:
        os.close(fd)


def summary(path: Path, plain: bool, follow: bool = False) -> tuple:
    """What must agree between kvfs and a plain directory for one entry: type, permission
    bits, owner; for non-directories size and link count; device numbers, symlink targets,
    and the bytes a regular file takes (kvfs: st_blocks; plain: its data blocks)."""
    st_ = os.stat(path, follow_symlinks=follow)
    kind = KINDS.get(stat.S_IFMT(st_.st_mode), oct(stat.S_IFMT(st_.st_mode)))
    entry: tuple = (kind, oct(stat.S_IMODE(st_.st_mode)), st_.st_uid, st_.st_gid)
    if kind == "dir":
        return entry
    entry += (f"size={st_.st_size}", f"nlink={st_.st_nlink}")
    if kind in ("char", "block"):
        entry += (f"rdev={os.major(st_.st_rdev)},{os.minor(st_.st_rdev)}",)
    if kind == "symlink":
        entry += (f"target={os.readlink(path)}",)
    if kind == "file":
        taken = data_blocks(path) if plain else st_.st_blocks * 512
        entry += (f"allocated={taken}",)
    return entry


# Files up to this size are read whole; larger (sparse) ones where the plain file has data,
# at both ends and around the edges of every hole.
WHOLE = 4 * MiB
WINDOW = 64 * KiB


def read_plan(plain_path: Path) -> list[tuple[int, int]] | None:
    """Which ranges of a file to compare, chosen by the plain directory's copy: None when it
    is not a regular file that can be opened (then both sides are read whole, bounded)."""
    try:
        fd = os.open(plain_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        size = info.st_size
        if size <= WHOLE:
            return [(0, size)]
        wanted = [(0, WINDOW), (size - WINDOW, size)]
        for start, end in data_ranges(fd, size):
            wanted.append((round_down(start, WINDOW) - WINDOW, round_up(end, WINDOW) + WINDOW))
    finally:
        os.close(fd)
    merged: list[tuple[int, int]] = []
    for start, end in sorted((max(0, s), min(size, e)) for s, e in wanted):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def read_planned(path: Path, plan: list[tuple[int, int]] | None) -> Any:
    """The bytes of `path` the plan names: all of them for a small file, else the digest of
    each range. Without a plan, the whole file (at most 64 MiB of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if plan is None or plan == [(0, plan[0][1])] and plan[0][1] <= WHOLE:
            limit = 64 * MiB if plan is None else plan[0][1] + 1  # one more: a longer file
            chunks = []
            while limit > 0 and (chunk := os.read(fd, min(4 * MiB, limit))):
                chunks.append(chunk)
                limit -= len(chunk)
            return b"".join(chunks)
        digests = []
        for start, end in plan:
            digest = hashlib.blake2b(digest_size=8)
            position = start
            while position < end:
                chunk = os.pread(fd, min(4 * MiB, end - position), position)
                if not chunk:
                    break
                digest.update(chunk)
                position += len(chunk)
            digests.append((start, position, digest.hexdigest()))
        return tuple(digests)
    finally:
        os.close(fd)


def tree(root: Path, plain: bool, contents: bool = False, reference: Path | None = None
         ) -> dict[str, tuple]:
    """Relative path -> summary of everything below (lstat: symlinks are not followed), with
    the names that share its inode, and if asked contents (ranges chosen by the same path
    below `reference`, the plain directory) and user xattrs."""
    found: dict[str, tuple] = {}
    inodes: dict[int, list[str]] = {}
    pending = [root]
    while pending:
        directory = pending.pop()
        for name in sorted(os.listdir(directory)):
            path = directory / name
            relative = str(path.relative_to(root))
            info = os.lstat(path)
            entry = summary(path, plain)
            if contents:
                if stat.S_ISREG(info.st_mode):
                    plan = read_plan((reference or root) / relative)
                    entry += (describe(read_planned(path, plan)),)
                xattrs = sorted(a for a in os.listxattr(path, follow_symlinks=False)
                                if a.startswith("user."))
                entry += (tuple((a, os.getxattr(path, a, follow_symlinks=False))
                                for a in xattrs),)
            found[relative] = entry
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)
            else:
                inodes.setdefault(info.st_ino, []).append(relative)
    for names in inodes.values():
        if len(names) > 1:
            for relative in names:
                found[relative] += (f"same inode as {sorted(set(names) - {relative})}",)
    return found


def names_below(root: Path) -> list[Parts]:
    """Every path below `root` (not following symlinks), as parts."""
    found: list[Parts] = []
    pending: list[Parts] = [()]
    while pending:
        parts = pending.pop()
        for name in sorted(os.listdir(root.joinpath(*parts))):
            found.append((*parts, name))
            if stat.S_ISDIR(os.lstat(root.joinpath(*parts, name)).st_mode):
                pending.append((*parts, name))
    return sorted(found)


def clear(root: Path) -> None:
    for name in os.listdir(root):
        path = root / name
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()


def write_at(path: Path, flags: int, offset: int, data: bytes, mode: int) -> int:
    fd = os.open(path, flags | os.O_WRONLY, mode)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def read_at(path: Path, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
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
    if kind == "fallocate":
        return fallocate(fd, FALLOCATE_MODES[action[1]], action[2], action[3])
    if kind == "copy_range":
        return within(COPY_SECONDS, os.copy_file_range, fd, fd, action[3], action[1], action[2])
    if kind in ("fstat", "seek_end"):  # sizes of regular files (directories' differ)
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return stat.S_IFMT(mode)
        return os.fstat(fd).st_size if kind == "fstat" else os.lseek(fd, 0, os.SEEK_END)
    raise AssertionError(kind)


def session(path: Path, flags: int, steps: list[tuple], mode: int) -> tuple[list, bool]:
    """open, act, close: each call's outcome, and whether it was opened for writing."""
    opened = attempt(os.open, path, flags, mode)
    if opened[0] != "ok":
        return [("open", opened)], False
    fd = opened[1]
    results: list = [("open", ("ok", None))]
    try:
        for step in steps:
            results.append((step[0], attempt(act, fd, step)))
    finally:
        results.append(("close", attempt(os.close, fd)))
    return results, flags & os.O_ACCMODE != os.O_RDONLY


def bind_socket(path: Path) -> None:
    """A unix socket bound to `path` (which makes the socket inode), then closed."""
    assert len(os.fsencode(path)) < 108, f"{path} is too long for a unix socket address"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(os.fspath(path))


# The child run as nobody: writes (or truncates) an existing file; prints what it got.
CHILD = """\
import os, sys
path, how, data = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
try:
    if how == "truncate":
        os.truncate(path, len(data))
        result = 0
    else:
        flags = {"append": os.O_APPEND, "write": 0, "trunc": os.O_TRUNC}[how]
        fd = os.open(path, os.O_WRONLY | flags)
        try:
            result = os.write(fd, data)
        finally:
            os.close(fd)
except OSError as error:
    print("error", error.errno)
else:
    print("ok", result)
"""


def write_as_nobody(path: Path, how: str, data: bytes) -> int:
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         CHILD_PYTHON, "-I", "-S", "-c", CHILD, os.fspath(path), how, data.hex()],
        capture_output=True, text=True, timeout=30, cwd="/")
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2:
        raise AssertionError(f"the child running as nobody failed: {done.stderr}")
    if words[0] == "error":
        code = int(words[1])
        raise OSError(code, os.strerror(code))
    return int(words[1])


MAP_SESSION_LIMIT = 4 * MiB  # files mapped and read whole by `mapped_session`
map_steps = st.lists(st.tuples(
    st.integers(0, 4), st.sampled_from(["pread", "map_read", "private_read", "pwrite",
                                        "map_write"]),
    st.one_of(st.integers(0, 9000), st.sampled_from([4095, 4096, MiB - 2, MiB])),
    st.binary(min_size=1, max_size=64)), max_size=8)


def map_act(fd: int, kind: str, offset: int, payload: bytes) -> Any:
    """One read or write of a descriptor, through pread/pwrite or a map of the whole file.
    A map write stays within the file (past its end a map faults): "beyond" otherwise."""
    if kind == "pwrite":
        return os.pwrite(fd, payload, offset)
    if kind == "pread":
        return os.pread(fd, len(payload), offset)
    size = os.fstat(fd).st_size
    if kind == "map_write" and offset + len(payload) > size:
        return "beyond"
    if not size:
        return "empty"
    flags = mmap.MAP_PRIVATE if kind == "private_read" else mmap.MAP_SHARED
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if kind == "map_write" else 0)
    with mmap.mmap(fd, size, flags, prot) as view:
        if kind == "map_write":
            view[offset:offset + len(payload)] = payload
            view.flush()
            return len(payload)
        return bytes(view[offset:offset + len(payload)])


def describe_open(outcome: tuple[str, Any]) -> tuple[str, Any]:
    return ("ok", None) if outcome[0] == "ok" else outcome


def blob_fingerprint(path: Path) -> tuple:
    """What any write changes: the file's identity, size and mtime, and the digest of its
    content where that is small (huge sparse files are compared by the rest). Not the ctime,
    which a name's link or unlink moves too."""
    status = path.stat()
    digest = (hashlib.sha256(path.read_bytes()).hexdigest()
              if status.st_size <= MAP_SESSION_LIMIT else None)
    return status.st_ino, status.st_size, status.st_mtime_ns, digest


def committed_blob_sums(data: Path) -> dict[Path, tuple]:
    """kvfs's committed blob files, each with its fingerprint (read on the volume)."""
    found = {}
    for path in (data / "blobs").glob("*/*"):
        with contextlib.suppress(FileNotFoundError):
            found[path] = blob_fingerprint(path)
    return found


def assert_blobs_kept(data: Path, before: dict[Path, tuple]) -> None:
    """No committed blob file is written in place: each is as it was, or gone."""
    for path, fingerprint in before.items():
        with contextlib.suppress(FileNotFoundError):
            assert blob_fingerprint(path) == fingerprint, (
                f"committed blob {path.name} changed in place")


# -- the state machine -------------------------------------------------------------------------


class KvfsVsPlainDirectory(RuleBasedStateMachine):
    # Set by the test: one mount for the whole run. Kept across examples (kvfs keeps them).
    mount: ClassVar[KvfsMount]
    reference: ClassVar[Path]

    def __init__(self) -> None:
        super().__init__()
        self.ours = self.mount.mountpoint
        self.theirs = self.reference
        assert os.listdir(self.ours) == [] and os.listdir(self.theirs) == []
        # Plain files (inodes) that fallocate gave room without data: SEEK_DATA, which the
        # plain side's allocation is measured with, does not see that room; st_blocks does.
        self.preallocated: set[int] = set()

    # -- helpers ---------------------------------------------------------------------------

    def both(self, what: str, call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
        """Run call(root, *args) on kvfs and on the plain directory; they must agree."""
        ours = attempt(call, self.ours, *args)
        theirs = attempt(call, self.theirs, *args)
        assert_same(what, ours, theirs)
        return ours

    def is_plain(self, root: Path) -> bool:
        return root == self.theirs

    def can_open(self, parts: Parts) -> bool:
        """Whether opening the path is safe on both sides: not a device node (nodev makes
        kvfs refuse what the plain directory would open) nor a fifo (opening blocks)."""
        for root in (self.ours, self.theirs):
            try:
                kind = stat.S_IFMT(os.stat(root.joinpath(*parts)).st_mode)
            except OSError:
                continue
            if kind in (stat.S_IFIFO, stat.S_IFCHR, stat.S_IFBLK):
                return False
        return True

    def pick(self, data: st.DataObject, label: str = "path") -> Parts:
        """A path: most often one that exists or a free name in an existing directory (the
        plain directory's), else any (mostly below missing directories)."""
        existing = names_below(self.theirs)
        places = set(existing)
        for parts in [(), *existing]:
            if parts == () or stat.S_ISDIR(os.lstat(self.theirs.joinpath(*parts)).st_mode):
                places.update((*parts, name) for name in (DEEP_NAMES if parts else NAMES))
        return data.draw(st.one_of(st.sampled_from(sorted(places)), paths), label=label)

    def pick_file(self, data: st.DataObject) -> Parts:
        """Most often a regular file that exists, else as pick()."""
        files = [parts for parts in names_below(self.theirs)
                 if stat.S_ISREG(os.lstat(self.theirs.joinpath(*parts)).st_mode)]
        if files and data.draw(st.booleans(), label="an existing file"):
            return data.draw(st.sampled_from(files), label="path")
        return self.pick(data)

    def compare_file(self, parts: Parts) -> None:
        plan = read_plan(self.theirs.joinpath(*parts))
        self.both(f"read back {'/'.join(parts)}",
                  lambda root: read_planned(root.joinpath(*parts), plan))

    # -- namespace -------------------------------------------------------------------------

    @rule(data=st.data(), mode=dir_modes)
    def mkdir(self, data: st.DataObject, mode: int) -> None:
        parts = self.pick(data)
        self.both(f"mkdir {'/'.join(parts)}", lambda root: os.mkdir(root.joinpath(*parts), mode))

    @rule(data=st.data())
    def rmdir(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"rmdir {'/'.join(parts)}", lambda root: os.rmdir(root.joinpath(*parts)))

    @rule(data=st.data())
    def unlink(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"unlink {'/'.join(parts)}", lambda root: os.unlink(root.joinpath(*parts)))

    @rule(data=st.data(), how=st.sampled_from(["rename", "noreplace", "exchange"]))
    def rename(self, data: st.DataObject, how: str) -> None:
        source, dest = self.pick(data, "source"), self.pick(data, "dest")
        flags = {"rename": 0, "noreplace": RENAME_NOREPLACE, "exchange": RENAME_EXCHANGE}[how]
        self.both(f"{how} {'/'.join(source)} -> {'/'.join(dest)}",
                  lambda root: renameat2(root.joinpath(*source), root.joinpath(*dest), flags))

    @rule(data=st.data(), text=link_targets)
    def symlink(self, data: st.DataObject, text: str) -> None:
        parts = self.pick(data)
        outcome = self.both(f"symlink {'/'.join(parts)} -> {text}",
                            lambda root: os.symlink(text, root.joinpath(*parts)))
        if outcome[0] == "ok":
            self.both(f"readlink {'/'.join(parts)}",
                      lambda root: os.readlink(root.joinpath(*parts)))

    @rule(data=st.data())
    def readlink(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"readlink {'/'.join(parts)}", lambda root: os.readlink(root.joinpath(*parts)))

    @rule(data=st.data(), follow=st.booleans())
    def link(self, data: st.DataObject, follow: bool) -> None:
        source, dest = self.pick(data, "source"), self.pick(data, "dest")
        outcome = self.both(
            f"link {'/'.join(source)} -> {'/'.join(dest)} follow_symlinks={follow}",
            lambda root: os.link(root.joinpath(*source), root.joinpath(*dest),
                                 follow_symlinks=follow))
        if outcome[0] == "ok":
            for parts in (source, dest):
                self.both(f"lstat {'/'.join(parts)} after link", self.summarized(parts, False))

    @rule(data=st.data(), mode=file_modes)
    def mkfifo(self, data: st.DataObject, mode: int) -> None:
        parts = self.pick(data)
        self.both(f"mkfifo {'/'.join(parts)} {mode:o}",
                  lambda root: os.mkfifo(root.joinpath(*parts), mode))

    @rule(data=st.data(), kind=st.sampled_from(["S_IFCHR", "S_IFBLK", "S_IFREG"]),
          mode=st.sampled_from([0o600, 0o644, 0o666]), device=device_numbers)
    def mknod(self, data: st.DataObject, kind: str, mode: int, device: tuple[int, int]) -> None:
        parts = self.pick(data)
        bits = getattr(stat, kind) | mode
        self.both(f"mknod {'/'.join(parts)} {kind} {mode:o} {device}",
                  lambda root: os.mknod(root.joinpath(*parts), bits, os.makedev(*device)))

    @rule(data=st.data())
    def bind(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"bind a unix socket to {'/'.join(parts)}",
                  lambda root: bind_socket(root.joinpath(*parts)))

    @rule(data=st.data())
    def listdir(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"listdir {'/'.join(parts)}",
                  lambda root: sorted(os.listdir(root.joinpath(*parts))))

    def summarized(self, parts: Parts, follow: bool) -> Callable[[Path], tuple]:
        """summary() of one entry, for either tree; as in same_tree, the allocation of a file
        fallocate gave room without data is not compared."""
        try:
            preallocated = os.stat(self.theirs.joinpath(*parts),
                                   follow_symlinks=follow).st_ino in self.preallocated
        except OSError:
            preallocated = False

        def summarized(root: Path) -> tuple:
            entry = summary(root.joinpath(*parts), self.is_plain(root), follow)
            return tuple(field for field in entry if not (
                preallocated and str(field).startswith("allocated=")))

        return summarized

    @rule(data=st.data(), follow=st.booleans())
    def stat_path(self, data: st.DataObject, follow: bool) -> None:
        parts = self.pick(data)
        self.both(f"{'stat' if follow else 'lstat'} {'/'.join(parts)}",
                  self.summarized(parts, follow))

    @rule(data=st.data(), mode=chmod_modes)
    def chmod(self, data: st.DataObject, mode: int) -> None:
        parts = self.pick(data)
        self.both(f"chmod {'/'.join(parts)} {mode:o}",
                  lambda root: os.chmod(root.joinpath(*parts), mode))

    @rule(data=st.data(), mtime=st.integers(0, 2_000_000_000 * 10**9))
    def utime(self, data: st.DataObject, mtime: int) -> None:
        parts = self.pick(data)
        def set_and_get(root: Path) -> int:
            path = root.joinpath(*parts)
            os.utime(path, ns=(mtime, mtime))
            return os.stat(path).st_mtime_ns

        self.both(f"utime {'/'.join(parts)}", set_and_get)

    # -- file content ----------------------------------------------------------------------

    @rule(data=st.data(), flags=write_flags, offset=offsets, payload=payloads, mode=file_modes)
    def write(self, data: st.DataObject, flags: tuple[str, ...], offset: int, payload: Payload,
              mode: int) -> None:
        parts = self.pick(data)
        if not self.can_open(parts):
            return
        content = payload.data()
        outcome = self.both(
            f"write {'/'.join(parts)} {flags} at {offset} {payload}",
            lambda root: write_at(root.joinpath(*parts), flags_of(flags), offset, content,
                                  mode))
        if outcome[0] == "ok":
            self.compare_file(parts)

    @rule(data=st.data(), flags=open_flags, steps=actions, mode=file_modes)
    def open_act_close(self, data: st.DataObject, flags: tuple[str, ...], steps: list[tuple],
                       mode: int) -> None:
        parts = self.pick(data)
        if not self.can_open(parts):
            return
        ours, wrote = session(self.ours.joinpath(*parts), flags_of(flags), steps, mode)
        theirs, _ = session(self.theirs.joinpath(*parts), flags_of(flags), steps, mode)
        if any(step[0] == "fallocate" and step[1] != "PUNCH_HOLE" for step in steps):
            with contextlib.suppress(OSError):  # (the file opened: a symlink's target)
                self.preallocated.add(os.stat(self.theirs.joinpath(*parts)).st_ino)
        for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
            assert_same(f"open {'/'.join(parts)} {flags}: call {index} {mine[0]}", mine, other)
        assert len(ours) == len(theirs)
        if wrote:
            self.compare_file(parts)

    @rule(data=st.data(), truncate=st.booleans(), readers=st.tuples(st.integers(0, 2),
                                                                    st.integers(0, 2)),
          steps=map_steps, writer_closes_at=st.integers(0, 8))
    def mapped_session(self, data: st.DataObject, truncate: bool, readers: tuple[int, int],
                       steps: list[tuple], writer_closes_at: int) -> None:
        """Several descriptors of one file at once, read and written through maps and
        pread/pwrite: readers opened before and after one writer. The writer sees the same
        bytes on both sides (its own writes, by pwrite or a shared map); kvfs's readers see
        the version committed when they opened (close-to-open: the plain directory's see
        the writer's bytes at once, so theirs are not compared), by pread and maps alike.
        No committed blob file of kvfs changes in place at any step."""
        parts = self.pick_file(data)
        plain_path, our_path = self.theirs.joinpath(*parts), self.ours.joinpath(*parts)
        try:
            if (not stat.S_ISREG(os.stat(plain_path).st_mode)
                    or os.stat(plain_path).st_size > MAP_SESSION_LIMIT):
                return
        except OSError:
            return
        committed = plain_path.read_bytes()
        blobs = committed_blob_sums(self.mount.data)
        opened: list[tuple[int | None, int | None, bytes | None]] = []  # ours, theirs, snapshot

        def open_both(flags: int, reader: bool) -> None:
            ours = attempt(os.open, our_path, flags)
            theirs = attempt(os.open, plain_path, flags)
            assert_same(f"open {'/'.join(parts)} {flags:o}", describe_open(ours),
                        describe_open(theirs))
            if ours[0] == "ok":
                opened.append((ours[1], theirs[1], committed if reader else None))

        for _ in range(readers[0]):
            open_both(os.O_RDONLY, reader=True)
        open_both(os.O_RDWR | (os.O_TRUNC if truncate else 0), reader=False)
        for _ in range(readers[1]):
            open_both(os.O_RDONLY, reader=True)
        try:
            for index, (target, kind, offset, payload) in enumerate(steps):
                if index == writer_closes_at:
                    self.close_writer(opened)
                    committed = plain_path.read_bytes()
                    blobs = committed_blob_sums(self.mount.data)
                if not opened:
                    break
                ours, theirs, snapshot = opened[target % len(opened)]
                if ours is None:
                    continue
                what = f"{kind} of descriptor {target % len(opened)} of {'/'.join(parts)}"
                if snapshot is None:  # the writer: as on the plain directory
                    assert_same(what, attempt(map_act, ours, kind, offset, payload),
                                attempt(map_act, theirs, kind, offset, payload))
                elif kind in ("pread", "map_read", "private_read"):
                    expected = ("empty" if kind != "pread" and not snapshot
                                else snapshot[offset:offset + len(payload)])
                    assert_same(what, attempt(map_act, ours, kind, offset, payload),
                                ("ok", expected))
                assert_blobs_kept(self.mount.data, blobs)
        finally:
            self.close_writer(opened)
            for ours, theirs, _ in opened:
                for fd in (ours, theirs):
                    if fd is not None:
                        os.close(fd)
        assert_blobs_kept(self.mount.data, blobs)
        self.compare_file(parts)

    @staticmethod
    def close_writer(opened: list[tuple[int | None, int | None, bytes | None]]) -> None:
        for index, (ours, theirs, snapshot) in enumerate(opened):
            if snapshot is None:
                assert_same("close of the writer", attempt(os.close, ours),
                            attempt(os.close, theirs))
                opened[index] = (None, None, b"")

    @rule(data=st.data(), size=sizes)
    def truncate(self, data: st.DataObject, size: int) -> None:
        parts = self.pick(data)
        if not self.can_open(parts):
            return
        outcome = self.both(f"truncate {'/'.join(parts)} {size}",
                            lambda root: os.truncate(root.joinpath(*parts), size))
        if outcome[0] == "ok":
            self.compare_file(parts)

    @rule(data=st.data(), mode=shared_modes,
          how=st.sampled_from(["append", "write", "trunc", "truncate"]),
          content=st.binary(max_size=40))
    def write_as_another_user(self, data: st.DataObject, mode: int, how: str,
                              content: bytes) -> None:
        """nobody writes to (or truncates) a file everyone may write (root makes it first if
        it is missing): setuid goes, and setgid too, as Linux clears it (for a writer outside
        the file's group also when the file is not group-executable)."""
        parts = self.pick_file(data)
        if not self.can_open(parts):
            return
        if not os.path.lexists(self.theirs.joinpath(*parts)):
            made = self.both(f"create {'/'.join(parts)}",
                             lambda root: os.mknod(root.joinpath(*parts), stat.S_IFREG | 0o644))
            if made[0] != "ok":
                return
        chmodded = self.both(f"chmod {'/'.join(parts)} {mode:o}",
                             lambda root: os.chmod(root.joinpath(*parts), mode))
        if chmodded[0] != "ok":
            return
        outcome = self.both(f"nobody {how} {'/'.join(parts)} {content!r}",
                            lambda root: write_as_nobody(root.joinpath(*parts), how, content))
        self.both(f"stat {'/'.join(parts)} after nobody's {how}", self.summarized(parts, True))
        if outcome[0] == "ok":
            self.compare_file(parts)

    @rule(data=st.data())
    def read_whole(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        if self.can_open(parts):
            plan = read_plan(self.theirs.joinpath(*parts))
            self.both(f"read {'/'.join(parts)}",
                      lambda root: read_planned(root.joinpath(*parts), plan))

    @rule(data=st.data(), offset=offsets, length=st.integers(0, 2 * MiB))
    def read_part(self, data: st.DataObject, offset: int, length: int) -> None:
        parts = self.pick(data)
        if self.can_open(parts):
            self.both(f"pread {'/'.join(parts)} {length} at {offset}",
                      lambda root: read_at(root.joinpath(*parts), offset, length))

    # -- xattrs ----------------------------------------------------------------------------

    @rule(data=st.data(), name=xattr_names, value=xattr_values,
          flags=st.sampled_from([0, XATTR_CREATE, XATTR_REPLACE]))
    def setxattr(self, data: st.DataObject, name: str, value: bytes, flags: int) -> None:
        parts = self.pick(data)
        self.both(f"setxattr {'/'.join(parts)} {name} flags={flags}",
                  lambda root: os.setxattr(root.joinpath(*parts), name, value, flags))

    @rule(data=st.data(), name=xattr_names)
    def getxattr(self, data: st.DataObject, name: str) -> None:
        parts = self.pick(data)
        self.both(f"getxattr {'/'.join(parts)} {name}",
                  lambda root: os.getxattr(root.joinpath(*parts), name))

    @rule(data=st.data(), name=xattr_names, size=st.integers(0, 48))
    def getxattr_sized(self, data: st.DataObject, name: str, size: int) -> None:
        parts = self.pick(data)
        self.both(f"getxattr {'/'.join(parts)} {name} into {size} bytes",
                  lambda root: getxattr_into(root.joinpath(*parts), name, size))

    @rule(data=st.data(), name=xattr_names, value=xattr_values, payload=payloads)
    def store_with_xattr(self, data: st.DataObject, name: str, value: bytes,
                         payload: Payload) -> None:
        temp, dest = self.pick(data, "temp"), self.pick(data, "dest")
        if not (self.can_open(temp) and self.can_open(dest)):
            return
        content = payload.data()
        outcome = self.both(
            f"store {'/'.join(temp)} with {name} -> {'/'.join(dest)}",
            lambda root: store_with_xattr(root.joinpath(*temp), root.joinpath(*dest), content,
                                          name, value))
        if outcome[0] == "ok":
            self.compare_file(dest)

    @rule(data=st.data())
    def listxattr(self, data: st.DataObject) -> None:
        parts = self.pick(data)
        self.both(f"listxattr {'/'.join(parts)}",
                  lambda root: sorted(a for a in os.listxattr(root.joinpath(*parts))
                                      if a.startswith("user.")))

    @rule(data=st.data(), name=xattr_names)
    def removexattr(self, data: st.DataObject, name: str) -> None:
        parts = self.pick(data)
        self.both(f"removexattr {'/'.join(parts)} {name}",
                  lambda root: os.removexattr(root.joinpath(*parts), name))

    # -- whole trees -----------------------------------------------------------------------

    @invariant()
    def same_tree(self) -> None:
        assert_same("tree (types, modes, owners, sizes, links, targets, allocation)",
                    *self.comparable(tree(self.ours, plain=False), tree(self.theirs, plain=True)))

    def comparable(self, ours: dict[str, tuple], theirs: dict[str, tuple]
                   ) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """Both trees, the allocation of preallocated files left out of both."""
        for relative in theirs:
            with contextlib.suppress(OSError):
                if os.lstat(self.theirs / relative).st_ino not in self.preallocated:
                    continue
            for found in (ours, theirs):
                if relative in found:
                    found[relative] = tuple(field for field in found[relative]
                                            if not str(field).startswith("allocated="))
        return ours, theirs

    @invariant()
    def counters_exact(self) -> None:
        assert_counters_exact(self.mount.mountpoint, self.mount.data)

    @rule()
    def same_contents(self) -> None:
        assert_same("tree with contents and xattrs",
                    *self.comparable(
                        tree(self.ours, plain=False, contents=True, reference=self.theirs),
                        tree(self.theirs, plain=True, contents=True)))

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:  # a step failed: let its error be the one reported
            with contextlib.suppress(OSError):
                clear(self.ours)
                clear(self.theirs)
            return
        try:
            self.same_contents()
            # Space: statvfs shows the used bytes the counters hold (in its 4 KiB blocks),
            # which are what the files take (each inode once, however many names it has),
            # and nothing is left staged.
            used = stats(self.ours)["used_bytes"]
            assert statvfs_used(self.ours) == round_up(used)
            taken = {os.lstat(self.ours / relative).st_ino:
                     os.lstat(self.ours / relative).st_blocks * 512
                     for relative, entry in tree(self.ours, plain=False).items()
                     if entry[0] == "file"}
            assert used == sum(taken.values())
            assert_only_spares_staged(self.mount.data, self.mount)
        finally:
            clear(self.ours)
            clear(self.theirs)
        # An emptied volume uses nothing.
        assert statvfs_used(self.ours) == 0
        assert_counters_exact(self.mount.mountpoint, self.mount.data)


def statvfs_used(root: Path) -> int:
    info = os.statvfs(root)
    return (info.f_blocks - info.f_bfree) * info.f_frsize


# -- the test ----------------------------------------------------------------------------------


@dataclass
class Roots:
    mount: KvfsMount
    plain: Path


@pytest.fixture(scope="module", params=["1G", "8G", "redis"],
                ids=["daemon-writes", "kernel-writes", "redis-metadata"])
def roots(request: pytest.FixtureRequest) -> Iterator[Roots]:
    """A kvfs mount (--allow-other) and a plain directory, both in a 0755 directory under
    /var/tmp (pytest's tmp dirs are root-only), so that user nobody can reach them. A small
    pool leaves kernel writers little room (a share of the capacity each), so kvfs serves
    most writes there; a larger one lets the kernel write (passthrough, where available).
    `redis`: a 1 GiB pool whose metadata is in a Redis server of its own."""
    base = Path(tempfile.mkdtemp(prefix="kvfs-differential-", dir="/var/tmp"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, ignore_errors=True)
        base.chmod(0o755)
        (base / "mnt").mkdir()
        plain = base / "plain"
        plain.mkdir()
        plain.chmod(0o755)
        options = ["--capacity", request.param, "--allow-other"]
        if request.param == "redis":
            server = stack.enter_context(LocalRedis(base / "redis"))
            options = ["--capacity", "1G", "--allow-other", "--meta", server.url]
        mount = KvfsMount(base / "mnt", base / "data", options)
        stack.callback(mount.cleanup)
        mount.mount()
        yield Roots(mount, plain)
        mount.unmount()


@pytest.mark.timeout(0 if PROFILE == "long" else 300)
def test_kvfs_behaves_like_a_plain_directory(roots: Roots) -> None:
    KvfsVsPlainDirectory.mount = roots.mount
    KvfsVsPlainDirectory.reference = roots.plain
    old_umask = os.umask(0o022)  # the same for both sides (and nobody's), whatever the caller's
    try:
        run_state_machine_as_test(KvfsVsPlainDirectory, settings=SETTINGS)
    finally:
        os.umask(old_umask)
