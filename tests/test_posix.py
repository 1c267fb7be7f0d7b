"""POSIX and Linux conformance of kvfs, checked differentially against the local disk.

Every check runs the same scenario on a kvfs mount and on a plain directory of the local disk
(/var/tmp) and asserts that both give the same outcome: the return value or the errno name of
each step, and the relevant stat fields. So the tests state Linux's behaviour without
hard-coding it; on top, a few facts POSIX mandates are asserted outright (so that both sides
cannot pass by being wrong the same way).

Covered:
- errnos of every refused case: open, creat, mkdir, mknod, mkfifo, unlink, rmdir, rename and
  renameat2 (EEXIST, ENOENT, ENOTDIR, EISDIR, ENOTEMPTY, EINVAL for a directory moved into its
  own subtree, EBUSY, EBADF), link (EPERM for a directory), symlinks (ELOOP for loops and
  O_NOFOLLOW, ENOENT for dangling targets), ENAMETOOLONG, truncate (EFBIG for 1 << 62,
  EINVAL, EISDIR); rename and link across directories never give EXDEV;
- hard links (shared st_ino, st_nlink), symlinks (readlink, lstat, resolution, lchown, link of
  a symlink), fifos, unix sockets, character and block device nodes, sparse 1 TiB truncate,
  and that all of these survive a remount of kvfs;
- permissions for user nobody (uid/gid 65534, run through setpriv in a child process):
  EACCES for missing read/write/search permission, EPERM for chmod/chown/utime by a
  non-owner, the rules for chown and chgrp by an owner, sticky directories, moving a
  directory to another parent (needs write permission on it), protected hard links;
- set-user-ID and set-group-ID bits: cleared on write by non-root, on truncate by non-root,
  on chown; set-group-ID dropped by chmod for a foreign group; inheritance from set-group-ID
  directories;
- timestamps: which calls change the mtime and ctime of the file and of the parent
  directories (namespace operations, attribute changes, content changes), utimensat with
  explicit times, UTIME_NOW and UTIME_OMIT.

Not compared, as kvfs documents (README, "Guarantees" and "Semantics not offered"): atime;
directories' st_size and st_nlink; anything while a handle is open for writing (writes become
visible, and the mtime is set, when the writer closes). Timestamps are compared as "changed or
not" across an operation (with a pause before it), never as absolute values. The name `.kvfs`
in the mount root is reserved: listings leave it out.

Both roots lie in a 0755 directory under /var/tmp and kvfs is mounted with --allow-other, so
that user nobody can reach them. The mount has nodev: device nodes are created and inspected,
never opened.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import KvfsMount

NOBODY = 65534
FOREIGN_GROUP = 4242  # a group neither root nor nobody is a member of
TICK = 0.02  # more than a jiffy: the local disk's coarse timestamps move across it
KiB = 1 << 10
MiB = 1 << 20
TiB = 1 << 40
SECOND = 10**9  # in nanoseconds

Outcome = tuple[str, Any]  # ("ok", value) or ("err", errno name)
OK: Outcome = ("ok", None)


def err(name: str) -> Outcome:
    return ("err", name)


def outcome(call: Callable[[], Any]) -> Outcome:
    """What a caller of `call` sees: ("ok", its value) or ("err", the errno's name)."""
    try:
        return ("ok", call())
    except OSError as error:
        return ("err", errno.errorcode.get(error.errno or 0, repr(error)))


def require(got: dict[str, Any], required: dict[str, Any]) -> None:
    """Absolute facts: `got` (a scenario's result, equal on both sides) has these entries."""
    assert {key: got[key] for key in required} == required


def differences(ours: Any, local: Any, where: str = "") -> list[str]:
    """Where two scenario results differ, as 'key/key: kvfs ..., local disk ...' lines."""
    if isinstance(ours, dict) and isinstance(local, dict):
        found = []
        for key in [*local, *(key for key in ours if key not in local)]:
            found += differences(ours.get(key, "<absent>"), local.get(key, "<absent>"),
                                 f"{where}/{key}" if where else str(key))
        return found
    if ours == local:
        return []
    return [f"{where or 'result'}:\n  kvfs       {ours!r}\n  local disk {local!r}"]


# -- the two roots ---------------------------------------------------------------------------


@dataclass
class Pair:
    """A kvfs mount and a plain local directory; scenarios run on each and must agree."""

    plain: Path
    kvfs: Path
    mount: KvfsMount

    def both(self, scenario: Callable[[Path], Any]) -> Outcome:
        local = outcome(lambda: scenario(self.plain))
        ours = outcome(lambda: scenario(self.kvfs))
        if ours != local:
            found = (differences(ours[1], local[1]) if ours[0] == local[0] == "ok"
                     else [f"kvfs {ours!r}\n  local disk {local!r}"])
            raise AssertionError("kvfs differs from the local disk:\n" + "\n".join(found))
        return local

    def same(self, scenario: Callable[[Path], Any]) -> Any:
        """Like both(), for scenarios that must succeed: returns their (common) value."""
        kind, value = self.both(scenario)
        assert kind == "ok", f"the scenario failed on both sides: {value}"
        return value


@pytest.fixture
def pair(reachable: Path, make_mount: Callable[..., KvfsMount]) -> Iterator[Pair]:
    plain = reachable / "plain"
    plain.mkdir()
    plain.chmod(0o755)
    mount = make_mount("--capacity", "1G", "--allow-other", where=reachable)
    old_umask = os.umask(0o022)  # the same for both sides and for the child processes
    try:
        yield Pair(plain, mount.mountpoint, mount)
    finally:
        os.umask(old_umask)


# -- running as user nobody ------------------------------------------------------------------

# The child gets Python statements and named arguments (JSON); it prints the value of
# `result`, or the errno of the OSError the statements raised.
CHILD = """\
import json, os, sys
scope = {"os": os, **json.loads(sys.argv[2])}
try:
    exec(sys.argv[1], scope)
except OSError as error:
    print(json.dumps({"errno": error.errno}))
else:
    print(json.dumps({"result": scope.get("result")}))
"""
# Only the standard library is needed: the system interpreter, which nobody can surely run.
CHILD_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

CREATE = "os.close(os.open(p, os.O_WRONLY | os.O_CREAT, 0o644))"
APPEND = "fd = os.open(p, os.O_WRONLY | os.O_APPEND)\nos.write(fd, b'more')\nos.close(fd)"
OPEN_READ = "os.close(os.open(p, os.O_RDONLY))"
OPEN_WRITE = "os.close(os.open(p, os.O_WRONLY))"


def as_nobody(code: str, **names: Any) -> Any:
    """Run `code` as uid/gid 65534 without supplementary groups; paths in `names` become
    strings. Returns its `result`, raises OSError with the errno the child got."""
    arguments = {name: os.fspath(value) if isinstance(value, Path) else value
                 for name, value in names.items()}
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         CHILD_PYTHON, "-I", "-S", "-c", CHILD, code, json.dumps(arguments)],
        capture_output=True, text=True, timeout=30, cwd="/")
    if done.returncode != 0 or not done.stdout.strip():
        raise AssertionError(f"the child running as nobody failed: {done.stderr}")
    answer = json.loads(done.stdout)
    if "errno" in answer:
        raise OSError(answer["errno"], os.strerror(answer["errno"]))
    return answer["result"]


def nobody(code: str, **names: Any) -> Outcome:
    return outcome(lambda: as_nobody(code, **names))


# -- file system helpers ---------------------------------------------------------------------

KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink",
         stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char",
         stat.S_IFBLK: "block"}


def shape(path: Path | str, follow: bool = False) -> dict[str, Any]:
    """The stat fields that must agree: type, permission bits, owner, and for everything but
    directories size and link count; device numbers of device nodes."""
    st = os.stat(path, follow_symlinks=follow)
    info: dict[str, Any] = {"kind": KINDS[stat.S_IFMT(st.st_mode)],
                            "mode": oct(stat.S_IMODE(st.st_mode)),
                            "uid": st.st_uid, "gid": st.st_gid}
    if not stat.S_ISDIR(st.st_mode):
        info.update(size=st.st_size, nlink=st.st_nlink)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        info["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return info


def tree(top: Path) -> dict[str, dict[str, Any]]:
    """Everything below `top` (not following symlinks, without `.kvfs`): shape, small files'
    contents, symlink targets, and which earlier path a hard link shares its inode with."""
    found: dict[str, dict[str, Any]] = {}
    first_path: dict[int, str] = {}
    pending = [top]
    while pending:
        directory = pending.pop(0)
        for name in sorted(os.listdir(directory)):
            if name == ".kvfs":
                continue
            path = directory / name
            relative = str(path.relative_to(top))
            info = shape(path)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size <= 64 * KiB:
                info["data"] = path.read_bytes()
            if stat.S_ISLNK(st.st_mode):
                info["target"] = os.readlink(path)
            if stat.S_ISDIR(st.st_mode):
                pending.append(path)
            elif st.st_nlink > 1:
                info["same_as"] = first_path.setdefault(st.st_ino, relative)
            found[relative] = info
    return found


def write(path: Path | str, data: bytes = b"x", mode: int = 0o644, flags: int = os.O_TRUNC
          ) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def make(root: Path, *names: str) -> None:
    """Directories (names ending in /) and files (containing their own name)."""
    for name in names:
        if name.endswith("/"):
            (root / name).mkdir()
        else:
            write(root / name, name.encode())


def opened(path: Path | str, flags: int, mode: int = 0o644) -> None:
    os.close(os.open(path, flags, mode))


def read_at(path: Path | str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def exists(path: Path | str) -> Outcome:
    """lstat() as a comparable outcome."""
    return outcome(lambda: shape(path)["kind"])


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_SYMLINK_FOLLOW = 0x400
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def checked(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def utimensat(path: Path | str, atime: tuple[int, int], mtime: tuple[int, int],
              flags: int = 0) -> None:
    times = (Timespec * 2)(Timespec(*atime), Timespec(*mtime))
    checked(LIBC.utimensat(AT_FDCWD, os.fsencode(path), times, flags))


def renameat2(source: Path | str, target: Path | str, flags: int) -> None:
    checked(LIBC.renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target),
                           flags))


def linkat(source: Path | str, target: Path | str, flags: int) -> None:
    """(os.link() calls plain link(), which never follows a symlink, unless told not to.)"""
    checked(LIBC.linkat(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target), flags))


def stamp(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_mtime_ns, st.st_ctime_ns


def changes(action: Callable[[], Any], **watched: Path | tuple[Path, Path]) -> dict[str, str]:
    """Which of mtime and ctime `action` changes on each watched path (a pair of paths: the
    entry's name before and after the action)."""
    before = {name: stamp(where[0] if isinstance(where, tuple) else where)
              for name, where in watched.items()}
    time.sleep(TICK)
    action()
    found = {}
    for name, where in watched.items():
        after = stamp(where[1] if isinstance(where, tuple) else where)
        moved = [label for label, old, new in zip(("mtime", "ctime"), before[name], after,
                                                  strict=True) if old != new]
        found[name] = "+".join(moved) or "unchanged"
    return found


# -- errnos of refused namespace operations --------------------------------------------------


def test_create_mkdir_mknod_and_their_errnos(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        return {
            "mkdir existing dir": outcome(lambda: os.mkdir(t / "d")),
            "mkdir over a file": outcome(lambda: os.mkdir(t / "f")),
            "mkdir under a file": outcome(lambda: os.mkdir(t / "f" / "x")),
            "mkdir in a missing dir": outcome(lambda: os.mkdir(t / "no" / "x")),
            "mkdir with a trailing slash": outcome(lambda: os.mkdir(f"{t}/slash/")),
            "mkdir 01777": outcome(lambda: os.mkdir(t / "sticky", 0o1777)),
            "mkdir 07777": outcome(lambda: os.mkdir(t / "all", 0o7777)),
            "create 04777": outcome(lambda: opened(t / "suid", os.O_CREAT | os.O_WRONLY,
                                                   0o4777)),
            "create excl over a file": outcome(
                lambda: opened(t / "f", os.O_CREAT | os.O_EXCL | os.O_WRONLY)),
            "create excl over a dir": outcome(
                lambda: opened(t / "d", os.O_CREAT | os.O_EXCL | os.O_RDONLY)),
            "create in a missing dir": outcome(
                lambda: opened(t / "no" / "f", os.O_CREAT | os.O_WRONLY)),
            "create under a file": outcome(
                lambda: opened(t / "f" / "x", os.O_CREAT | os.O_WRONLY)),
            "mknod regular": outcome(lambda: os.mknod(t / "reg", stat.S_IFREG | 0o640)),
            "mknod without type": outcome(lambda: os.mknod(t / "untyped", 0o600)),
            "mknod S_IFDIR": outcome(lambda: os.mknod(t / "dir", stat.S_IFDIR | 0o755)),
            "mknod S_IFLNK": outcome(lambda: os.mknod(t / "lnk", stat.S_IFLNK | 0o777)),
            "mknod existing": outcome(lambda: os.mknod(t / "f", stat.S_IFREG | 0o644)),
            "mkfifo existing": outcome(lambda: os.mkfifo(t / "d")),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"mkdir existing dir": err("EEXIST"), "mkdir over a file": err("EEXIST"),
                  "mkdir under a file": err("ENOTDIR"),
                  "mkdir in a missing dir": err("ENOENT"),
                  "create excl over a file": err("EEXIST"), "mknod S_IFDIR": err("EPERM")})


def test_open_errnos(pair: Pair) -> None:
    def write_read_only(path: Path) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.write(fd, b"x")
        finally:
            os.close(fd)

    def read_write_only(path: Path) -> bytes:
        fd = os.open(path, os.O_WRONLY)
        try:
            return os.read(fd, 1)
        finally:
            os.close(fd)

    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        return {
            "missing": outcome(lambda: opened(t / "nope", os.O_RDONLY)),
            "dir for writing": outcome(lambda: opened(t / "d", os.O_WRONLY)),
            "dir for reading and writing": outcome(lambda: opened(t / "d", os.O_RDWR)),
            "dir with O_CREAT": outcome(lambda: opened(t / "d", os.O_CREAT | os.O_RDONLY)),
            "dir for reading": outcome(lambda: opened(t / "d", os.O_RDONLY)),
            "file with O_DIRECTORY": outcome(
                lambda: opened(t / "f", os.O_RDONLY | os.O_DIRECTORY)),
            "under a file": outcome(lambda: opened(t / "f" / "x", os.O_RDONLY)),
            "file with a trailing slash": outcome(lambda: opened(f"{t}/f/", os.O_RDONLY)),
            "new file with a trailing slash": outcome(
                lambda: opened(f"{t}/new/", os.O_CREAT | os.O_WRONLY)),
            "O_EXCL without O_CREAT": outcome(lambda: opened(t / "f", os.O_RDONLY | os.O_EXCL)),
            "write on a read-only fd": outcome(lambda: write_read_only(t / "f")),
            "read on a write-only fd": outcome(lambda: read_write_only(t / "f")),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"missing": err("ENOENT"), "dir for writing": err("EISDIR"),
                  "under a file": err("ENOTDIR"), "file with O_DIRECTORY": err("ENOTDIR"),
                  "write on a read-only fd": err("EBADF")})


def test_unlink_and_rmdir_errnos(pair: Pair) -> None:
    def unlink_while_open(path: Path) -> bytes:
        with open(path, "rb") as reader:
            os.unlink(path)
            return reader.read()

    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/g", "t/d/", "t/e/", "t/full/", "t/full/x")
        t = root / "t"
        return {
            "unlink a dir": outcome(lambda: os.unlink(t / "d")),
            "unlink missing": outcome(lambda: os.unlink(t / "nope")),
            "unlink under a file": outcome(lambda: os.unlink(t / "f" / "x")),
            "unlink a file with a trailing slash": outcome(lambda: os.unlink(f"{t}/f/")),
            "rmdir a file": outcome(lambda: os.rmdir(t / "f")),
            "rmdir non-empty": outcome(lambda: os.rmdir(t / "full")),
            "rmdir dot": outcome(lambda: os.rmdir(f"{t}/d/.")),
            "rmdir dotdot": outcome(lambda: os.rmdir(f"{t}/d/..")),
            "rmdir missing": outcome(lambda: os.rmdir(t / "nope")),
            "unlink while open for reading": outcome(lambda: unlink_while_open(t / "g")),
            "old name after unlink": exists(t / "g"),
            "rmdir empty": outcome(lambda: os.rmdir(t / "d")),
            "rmdir with a trailing slash": outcome(lambda: os.rmdir(f"{t}/e/")),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"unlink a dir": err("EISDIR"), "rmdir a file": err("ENOTDIR"),
                  "rmdir non-empty": err("ENOTEMPTY"), "rmdir dot": err("EINVAL"),
                  "unlink while open for reading": ("ok", b"t/g"),
                  "old name after unlink": err("ENOENT"), "rmdir empty": OK})


def test_rename_errnos(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/d/", "t/d/sub/", "t/d/sub/deep/", "t/f", "t/g", "t/e/",
             "t/full/", "t/full/x", "t/empty/")
        t = root / "t"
        return {
            "dir into its child": outcome(lambda: os.rename(t / "d", t / "d" / "sub" / "d")),
            "dir into its grandchild": outcome(
                lambda: os.rename(t / "d", t / "d" / "sub" / "deep" / "d")),
            "dir into itself": outcome(lambda: os.rename(t / "d", t / "d" / "d")),
            "dir onto its child": outcome(lambda: os.rename(t / "d", t / "d" / "sub")),
            "dir onto its parent": outcome(lambda: os.rename(t / "d" / "sub", t / "d")),
            "dir over a file": outcome(lambda: os.rename(t / "e", t / "f")),
            "file over a dir": outcome(lambda: os.rename(t / "f", t / "e")),
            "dir over a non-empty dir": outcome(lambda: os.rename(t / "e", t / "full")),
            "missing source": outcome(lambda: os.rename(t / "nope", t / "x")),
            "into a missing dir": outcome(lambda: os.rename(t / "f", t / "no" / "f")),
            "to a path under a file": outcome(lambda: os.rename(t / "g", t / "f" / "x")),
            "from a path under a file": outcome(lambda: os.rename(t / "f" / "x", t / "y")),
            "file to a name with a trailing slash": outcome(
                lambda: os.rename(t / "f", f"{t}/h/")),
            "dot": outcome(lambda: os.rename(f"{t}/d/.", t / "x")),
            "dir over an empty dir": outcome(lambda: os.rename(t / "e", t / "empty")),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"dir into its child": err("EINVAL"), "dir into itself": err("EINVAL"),
                  "dir over a file": err("ENOTDIR"), "file over a dir": err("EISDIR"),
                  "dir over a non-empty dir": err("ENOTEMPTY"),
                  "missing source": err("ENOENT"), "dir over an empty dir": OK})


def test_rename_replaces_atomically_and_the_old_name_is_gone(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/a", "t/b", "t/d/", "t/d/inner", "t/e/")
        t = root / "t"
        with open(t / "b", "rb") as reader:
            renamed = outcome(lambda: os.rename(t / "a", t / "b"))
            return {
                "rename over a file": renamed,
                "old name at once": exists(t / "a"),
                "new name": (t / "b").read_bytes(),
                "reader of the replaced file": reader.read(),
                "dir over an empty dir": outcome(lambda: os.rename(t / "d", t / "e")),
                "old dir name": exists(t / "d"),
                "moved dir's content": (t / "e" / "inner").read_bytes(),
                "onto itself": outcome(lambda: os.rename(t / "b", t / "b")),
                "tree": tree(t),
            }

    got = pair.same(scenario)
    require(got, {"rename over a file": OK, "old name at once": err("ENOENT"),
                  "new name": b"t/a", "reader of the replaced file": b"t/b",
                  "old dir name": err("ENOENT"), "onto itself": OK})


def test_rename_and_link_across_directories_never_give_exdev(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "a/", "a/b/", "a/b/c/", "a/b/c/f", "a/g", "x/", "x/y/")
        return {
            "file to a sibling tree": outcome(
                lambda: os.rename(root / "a" / "b" / "c" / "f", root / "x" / "y" / "f")),
            "dir to a sibling tree": outcome(
                lambda: os.rename(root / "a" / "b", root / "x" / "y" / "b")),
            "dir up one level": outcome(
                lambda: os.rename(root / "x" / "y" / "b" / "c", root / "x" / "c")),
            "link to a sibling tree": outcome(
                lambda: os.link(root / "a" / "g", root / "x" / "c" / "g")),
            "a": tree(root / "a"),
            "x": tree(root / "x"),
        }

    got = pair.same(scenario)
    assert all(value != err("EXDEV") for value in got.values())
    require(got, {"file to a sibling tree": OK, "dir to a sibling tree": OK})


def test_renameat2_flags(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/a", "t/b", "t/dir/", "t/dir/inner")
        t = root / "t"
        return {
            "noreplace onto a file": outcome(
                lambda: renameat2(t / "a", t / "b", RENAME_NOREPLACE)),
            "noreplace to a new name": outcome(
                lambda: renameat2(t / "a", t / "c", RENAME_NOREPLACE)),
            "exchange two files": outcome(lambda: renameat2(t / "b", t / "c", RENAME_EXCHANGE)),
            "exchange a file and a dir": outcome(
                lambda: renameat2(t / "c", t / "dir", RENAME_EXCHANGE)),
            "exchange with a missing name": outcome(
                lambda: renameat2(t / "b", t / "nope", RENAME_EXCHANGE)),
            "both flags": outcome(
                lambda: renameat2(t / "b", t / "c", RENAME_EXCHANGE | RENAME_NOREPLACE)),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"noreplace onto a file": err("EEXIST"),
                  "exchange with a missing name": err("ENOENT"), "both flags": err("EINVAL")})


def test_name_length_limits(pair: Pair) -> None:
    longest, too_long = "n" * 255, "n" * 256
    wide_longest, wide_too_long = "é" * 127 + "n", "é" * 128  # 255 and 256 bytes in UTF-8

    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        return {
            "create 255": outcome(lambda: write(t / longest)),
            "create 255 bytes of UTF-8": outcome(lambda: write(t / wide_longest)),
            "create 256": outcome(lambda: write(t / too_long)),
            "create 256 bytes of UTF-8": outcome(lambda: write(t / wide_too_long)),
            "stat 256": outcome(lambda: shape(t / too_long)),
            "mkdir 256": outcome(lambda: os.mkdir(t / "d" / too_long)),
            "rename to 256": outcome(lambda: os.rename(t / "f", t / too_long)),
            "link to 256": outcome(lambda: os.link(t / "f", t / too_long)),
            "symlink named 256": outcome(lambda: os.symlink("f", t / too_long)),
            "mkfifo 256": outcome(lambda: os.mkfifo(t / too_long)),
            "path over PATH_MAX": outcome(lambda: write(t / "/".join(["p" * 200] * 21))),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"create 255": OK, "create 255 bytes of UTF-8": OK,
                  "create 256": err("ENAMETOOLONG"), "mkdir 256": err("ENAMETOOLONG"),
                  "rename to 256": err("ENAMETOOLONG")})


# -- truncate ----------------------------------------------------------------------------------


def test_truncate_and_ftruncate_errnos(pair: Pair) -> None:
    def ftruncate(path: Path, size: int, flags: int = os.O_WRONLY) -> None:
        fd = os.open(path, flags)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        os.mkfifo(t / "fifo")
        return {
            "truncate to 1 << 62": outcome(lambda: os.truncate(t / "f", 1 << 62)),
            "ftruncate to 1 << 62": outcome(lambda: ftruncate(t / "f", 1 << 62)),
            "truncate to -1": outcome(lambda: os.truncate(t / "f", -1)),
            "ftruncate to -1": outcome(lambda: ftruncate(t / "f", -1)),
            "truncate a dir": outcome(lambda: os.truncate(t / "d", 0)),
            "truncate a fifo": outcome(lambda: os.truncate(t / "fifo", 0)),
            "truncate missing": outcome(lambda: os.truncate(t / "nope", 0)),
            "truncate under a file": outcome(lambda: os.truncate(t / "f" / "x", 0)),
            "ftruncate a read-only fd": outcome(lambda: ftruncate(t / "f", 0, os.O_RDONLY)),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"truncate to 1 << 62": err("EFBIG"), "ftruncate to 1 << 62": err("EFBIG"),
                  "truncate to -1": err("EINVAL"), "truncate a dir": err("EISDIR"),
                  "truncate missing": err("ENOENT"), "ftruncate a read-only fd": err("EINVAL")})


def test_truncate_shrinks_and_extends_with_zeros(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        write(root / "f", b"hello world")
        found: dict[str, Any] = {}
        for size in (5, 9, 0, 3 * MiB + 1):
            os.truncate(root / "f", size)
            data = (root / "f").read_bytes()
            found[f"to {size}"] = (len(data), data[:16], data.count(0))
        fd = os.open(root / "f", os.O_RDWR)
        try:
            os.ftruncate(fd, 2)
            os.pwrite(fd, b"abc", 0)
        finally:
            os.close(fd)
        found["size at once after ftruncate, write and close"] = os.stat(root / "f").st_size
        found["ftruncate and write"] = (root / "f").read_bytes()
        fd = os.open(root / "f", os.O_WRONLY)
        try:
            os.ftruncate(fd, 1)
        finally:
            os.close(fd)
        found["size at once after ftruncate and close"] = os.stat(root / "f").st_size
        return found

    got = pair.same(scenario)
    require(got, {"to 5": (5, b"hello", 0), "to 9": (9, b"hello\0\0\0\0", 4),
                  "size at once after ftruncate, write and close": 3,
                  "ftruncate and write": b"abc", "size at once after ftruncate and close": 1})


def test_truncate_to_one_tib_is_sparse(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        write(root / "f", b"head")
        os.truncate(root / "f", TiB)
        fd = os.open(root / "g", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, TiB + 5)
        finally:
            os.close(fd)
        found = {}
        for name in ("f", "g"):
            st = os.stat(root / name)
            found[name] = {"size": st.st_size, "small st_blocks": st.st_blocks * 512 <= MiB,
                           "head": read_at(root / name, 0, 4),
                           "middle": read_at(root / name, TiB // 2, 8),
                           "tail": read_at(root / name, st.st_size - 3, 8)}
        return found

    got = pair.same(scenario)
    assert got == {
        "f": {"size": TiB, "small st_blocks": True, "head": b"head", "middle": bytes(8),
              "tail": bytes(3)},
        "g": {"size": TiB + 5, "small st_blocks": True, "head": bytes(4), "middle": bytes(8),
              "tail": bytes(3)},
    }


# -- hard links ------------------------------------------------------------------------------


def test_hard_links_share_one_inode(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "a/", "b/")
        write(root / "a" / "f", b"first")
        os.link(root / "a" / "f", root / "b" / "g")
        f, g = os.stat(root / "a" / "f"), os.stat(root / "b" / "g")
        found: dict[str, Any] = {"same inode": f.st_ino == g.st_ino,
                                 "nlink": (f.st_nlink, g.st_nlink), "tree": tree(root)}
        write(root / "b" / "g", b"second, longer")
        os.chmod(root / "a" / "f", 0o600)
        found["written through the other name"] = (root / "a" / "f").read_bytes()
        found["mode through the other name"] = shape(root / "b" / "g")["mode"]
        os.unlink(root / "a" / "f")
        found["after unlinking one"] = shape(root / "b" / "g")
        found["content after unlinking one"] = (root / "b" / "g").read_bytes()
        return found

    got = pair.same(scenario)
    require(got, {"same inode": True, "nlink": (2, 2),
                  "written through the other name": b"second, longer",
                  "mode through the other name": "0o600",
                  "content after unlinking one": b"second, longer"})
    assert got["after unlinking one"]["nlink"] == 1


def test_link_errnos(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/g", "t/d/")
        t = root / "t"
        write(t / "secret", b"s", 0o600)
        write(t / "nobodys", b"n")
        os.chown(t / "nobodys", NOBODY, NOBODY)
        (t / "open").mkdir()
        os.chmod(t / "open", 0o777)
        return {
            "link a dir": outcome(lambda: os.link(t / "d", t / "d2")),
            "onto an existing name": outcome(lambda: os.link(t / "f", t / "g")),
            "missing source": outcome(lambda: os.link(t / "nope", t / "h")),
            "into a missing dir": outcome(lambda: os.link(t / "f", t / "no" / "h")),
            "source under a file": outcome(lambda: os.link(t / "f" / "x", t / "h")),
            "onto itself": outcome(lambda: os.link(t / "f", t / "f")),
            "nobody links into a dir it cannot write": nobody(
                "os.link(p, q)", p=t / "nobodys", q=t / "h"),
            "nobody links root's 0600 file (protected_hardlinks)": nobody(
                "os.link(p, q)", p=t / "secret", q=t / "open" / "h"),
            "nobody links root's 0644 file": nobody("os.link(p, q)", p=t / "f",
                                                    q=t / "open" / "h"),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"link a dir": err("EPERM"), "onto an existing name": err("EEXIST"),
                  "missing source": err("ENOENT"),
                  "nobody links into a dir it cannot write": err("EACCES")})


def test_rename_onto_another_link_of_the_same_file_does_nothing(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        write(root / "a", b"data")
        os.link(root / "a", root / "b")
        return {"rename": outcome(lambda: os.rename(root / "a", root / "b")),
                "a": exists(root / "a"), "b": exists(root / "b"),
                "nlink": os.stat(root / "a").st_nlink}

    got = pair.same(scenario)
    assert got == {"rename": OK, "a": ("ok", "file"), "b": ("ok", "file"), "nlink": 2}


# -- symlinks --------------------------------------------------------------------------------


def test_symlink_readlink_and_lstat(pair: Pair) -> None:
    long_target = "x" * 4095  # PATH_MAX - 1, the longest a symlink can hold

    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/", "t/d/inner")
        t = root / "t"
        os.symlink("f", t / "to_f")
        os.symlink("d", t / "to_d")
        os.symlink("../f", t / "d" / "up")
        os.symlink("nowhere/at/all", t / "dangling")
        os.symlink(long_target, t / "long")
        os.symlink(b"\xff\xfebytes", os.fsencode(t / "bytes"))
        return {
            "readlink": os.readlink(t / "to_f"),
            "readlink of a long target": os.readlink(t / "long") == long_target,
            "readlink of a non-UTF-8 target": os.readlink(os.fsencode(t / "bytes")),
            "lstat": shape(t / "to_f"),
            "stat follows": shape(t / "to_f", follow=True),
            "read through": (t / "to_f").read_bytes(),
            "relative to its directory": (t / "d" / "up").read_bytes(),
            "through a dir symlink": (t / "to_d" / "inner").read_bytes(),
            "list through a dir symlink": sorted(os.listdir(t / "to_d")),
            "target longer than PATH_MAX": outcome(lambda: os.symlink("y" * 4096, t / "l2")),
            "empty target": outcome(lambda: os.symlink("", t / "empty")),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    assert got["readlink"] == "f" and got["readlink of a long target"]
    assert got["readlink of a non-UTF-8 target"] == b"\xff\xfebytes"
    assert got["lstat"]["kind"] == "symlink" and got["lstat"]["size"] == 1
    assert got["stat follows"]["kind"] == "file"
    assert got["tree"]["long"]["size"] == 4095


def test_symlink_errnos_and_loops(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        os.symlink("b", t / "a")
        os.symlink("a", t / "b")
        os.symlink("self", t / "self")
        os.symlink("nowhere", t / "dangling")
        os.symlink("f", t / "to_f")
        os.symlink("d", t / "to_d")
        for index in range(50):
            os.symlink("f" if index == 0 else f"chain{index - 1}", t / f"chain{index}")
        return {
            "symlink onto an existing name": outcome(lambda: os.symlink("x", t / "f")),
            "readlink of a file": outcome(lambda: os.readlink(t / "f")),
            "readlink of a dir": outcome(lambda: os.readlink(t / "d")),
            "readlink missing": outcome(lambda: os.readlink(t / "nope")),
            "open a loop": outcome(lambda: opened(t / "a", os.O_RDONLY)),
            "stat a loop": outcome(lambda: shape(t / "a", follow=True)),
            "lstat a loop": exists(t / "a"),
            "open a self loop": outcome(lambda: opened(t / "self", os.O_RDONLY)),
            "open dangling": outcome(lambda: opened(t / "dangling", os.O_RDONLY)),
            "stat dangling": outcome(lambda: shape(t / "dangling", follow=True)),
            "lstat dangling": exists(t / "dangling"),
            "O_NOFOLLOW": outcome(lambda: opened(t / "to_f", os.O_RDONLY | os.O_NOFOLLOW)),
            "a chain of 10": outcome(lambda: (t / "chain9").read_bytes()),
            "a chain of 50": outcome(lambda: (t / "chain49").read_bytes()),
            "under a symlink to a file": outcome(lambda: opened(t / "to_f" / "x", os.O_RDONLY)),
            "mkdir over dangling": outcome(lambda: os.mkdir(t / "dangling")),
            "rmdir a symlink to a dir": outcome(lambda: os.rmdir(t / "to_d")),
            "O_CREAT | O_EXCL on dangling": outcome(
                lambda: opened(t / "dangling", os.O_CREAT | os.O_EXCL | os.O_WRONLY)),
            "O_CREAT through dangling": outcome(
                lambda: opened(t / "dangling", os.O_CREAT | os.O_WRONLY)),
            "target made through dangling": exists(t / "nowhere"),
            "lsetxattr user.* on a symlink": outcome(
                lambda: os.setxattr(t / "to_f", "user.x", b"1", follow_symlinks=False)),
            "unlink a symlink to a dir": outcome(lambda: os.unlink(t / "to_d")),
            "its target": exists(t / "d"),
        }

    got = pair.same(scenario)
    require(got, {"symlink onto an existing name": err("EEXIST"),
                  "readlink of a file": err("EINVAL"), "open a loop": err("ELOOP"),
                  "open a self loop": err("ELOOP"), "lstat a loop": ("ok", "symlink"),
                  "open dangling": err("ENOENT"), "stat dangling": err("ENOENT"),
                  "lstat dangling": ("ok", "symlink"), "O_NOFOLLOW": err("ELOOP"),
                  "a chain of 10": ("ok", b"t/f"), "a chain of 50": err("ELOOP"),
                  "under a symlink to a file": err("ENOTDIR"),
                  "unlink a symlink to a dir": OK, "its target": ("ok", "dir")})


def test_symlink_ownership_links_and_renames(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/f", "t/d/")
        t = root / "t"
        os.symlink("f", t / "l")
        os.chown(t / "l", NOBODY, NOBODY, follow_symlinks=False)
        found: dict[str, Any] = {"lchown": (shape(t / "l"), shape(t / "f"))}
        os.chown(t / "l", 1, 1)
        os.chmod(t / "l", 0o600)
        found["chown and chmod follow"] = (shape(t / "l"), shape(t / "f"))
        utimensat(t / "l", (0, UTIME_OMIT), (1_000_000, 5), AT_SYMLINK_NOFOLLOW)
        found["utimensat nofollow"] = (os.lstat(t / "l").st_mtime_ns,
                                       os.stat(t / "f").st_mtime_ns == 1_000_000 * SECOND + 5)
        os.link(t / "l", t / "hard_to_link", follow_symlinks=False)
        linkat(t / "l", t / "hard_to_target", AT_SYMLINK_FOLLOW)
        os.rename(t / "l", t / "d" / "moved")
        found["a moved relative symlink resolves anew"] = outcome(
            lambda: shape(t / "d" / "moved", follow=True))
        found["tree"] = tree(t)
        return found

    got = pair.same(scenario)
    assert got["lchown"][0]["uid"] == NOBODY and got["lchown"][1]["uid"] == 0
    assert got["utimensat nofollow"] == (1_000_000 * SECOND + 5, False)
    assert got["tree"]["hard_to_link"]["kind"] == "symlink"
    assert got["tree"]["hard_to_target"]["kind"] == "file"


# -- fifos, sockets and device nodes ---------------------------------------------------------


def test_fifo(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        os.mkfifo(root / "fifo", 0o640)
        os.mknod(root / "fifo2", stat.S_IFIFO | 0o600)
        reader = os.open(root / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            writer = os.open(root / "fifo", os.O_WRONLY)
            try:
                os.write(writer, b"through the pipe")
                data = os.read(reader, 100)
            finally:
                os.close(writer)
        finally:
            os.close(reader)
        os.rename(root / "fifo2", root / "renamed")
        return {"fifo": shape(root / "fifo"), "data": data, "renamed": shape(root / "renamed"),
                "mkfifo again": outcome(lambda: os.mkfifo(root / "fifo")),
                "write without a reader": outcome(
                    lambda: opened(root / "fifo", os.O_WRONLY | os.O_NONBLOCK))}

    got = pair.same(scenario)
    assert got["fifo"] == {"kind": "fifo", "mode": "0o640", "uid": 0, "gid": 0, "size": 0,
                           "nlink": 1}
    assert got["data"] == b"through the pipe" and got["renamed"]["kind"] == "fifo"
    assert got["mkfifo again"] == err("EEXIST") and got["write without a reader"] == err("ENXIO")


def test_unix_socket_can_be_bound_and_connected(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        write(root / "file")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(str(root / "sock"))
            server.listen(1)
            client.connect(str(root / "sock"))
            connection, _ = server.accept()
            with connection:
                client.sendall(b"ping")
                received = connection.recv(4)
            return {"shape": shape(root / "sock"), "received": received,
                    "bind again": outcome(lambda: other.bind(str(root / "sock"))),
                    "connect to a file": outcome(lambda: other.connect(str(root / "file"))),
                    "unlink": outcome(lambda: os.unlink(root / "sock"))}
        finally:
            for sock in (server, client, other):
                sock.close()

    got = pair.same(scenario)
    assert got["shape"]["kind"] == "socket" and got["received"] == b"ping"
    require(got, {"bind again": err("EADDRINUSE"), "connect to a file": err("ECONNREFUSED"),
                  "unlink": OK})


def test_device_nodes(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        (root / "open").mkdir()
        os.chmod(root / "open", 0o777)
        return {
            "char": outcome(lambda: os.mknod(root / "null", stat.S_IFCHR | 0o666,
                                             os.makedev(1, 3))),
            "block": outcome(lambda: os.mknod(root / "loop", stat.S_IFBLK | 0o600,
                                              os.makedev(7, 0))),
            "nobody makes a char device": nobody(
                "os.mknod(p, 0o20644, os.makedev(1, 3))", p=root / "open" / "dev"),
            "nobody makes a fifo": nobody("os.mkfifo(p)", p=root / "open" / "fifo"),
            "nobody makes a socket node": nobody("os.mknod(p, 0o140644)",
                                                 p=root / "open" / "sock"),
            "tree": tree(root),
        }

    got = pair.same(scenario)
    assert got["tree"]["null"] == {"kind": "char", "mode": "0o644", "uid": 0, "gid": 0,
                                   "size": 0, "nlink": 1, "rdev": (1, 3)}
    assert got["tree"]["loop"]["kind"] == "block" and got["tree"]["loop"]["rdev"] == (7, 0)
    assert got["nobody makes a char device"] == err("EPERM")
    assert got["tree"]["open/fifo"]["uid"] == NOBODY


def test_special_files_and_links_survive_a_remount(pair: Pair) -> None:
    root = pair.kvfs
    (root / "d").mkdir()
    write(root / "d" / "f", b"content")
    os.link(root / "d" / "f", root / "g")
    os.symlink("d/f", root / "l")
    os.mkfifo(root / "fifo")
    os.mknod(root / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(root / "sock"))
    write(root / "sparse", b"head")
    os.truncate(root / "sparse", TiB)
    before = tree(root)
    inodes = {name: os.lstat(root / name).st_ino for name in before}
    pair.mount.remount()
    assert tree(root) == before
    assert {name: os.lstat(root / name).st_ino for name in before} == inodes
    assert os.stat(root / "sparse").st_size == TiB
    assert (root / "l").read_bytes() == b"content"


# -- permissions for other users -------------------------------------------------------------


def test_missing_permissions_give_eacces(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "t/", "t/public", "t/dir/", "t/dir/file", "t/dir/empty/", "t/closed/",
             "t/closed/inner", "t/unlisted/", "t/unlisted/known")
        t = root / "t"
        write(t / "secret", b"s", 0o600)
        os.chmod(t / "closed", 0o700)
        os.chmod(t / "unlisted", 0o711)
        return {
            "read a 0600 file": nobody(OPEN_READ, p=t / "secret"),
            "read a 0644 file": nobody(OPEN_READ, p=t / "public"),
            "write a 0644 file": nobody(OPEN_WRITE, p=t / "public"),
            "truncate a 0644 file": nobody("os.truncate(p, 0)", p=t / "public"),
            "O_TRUNC a 0644 file": nobody("os.close(os.open(p, os.O_RDONLY | os.O_TRUNC))",
                                          p=t / "public"),
            "create in a 0755 dir": nobody(CREATE, p=t / "dir" / "new"),
            "mkdir in a 0755 dir": nobody("os.mkdir(p)", p=t / "dir" / "new"),
            "mkfifo in a 0755 dir": nobody("os.mkfifo(p)", p=t / "dir" / "new"),
            "symlink in a 0755 dir": nobody("os.symlink('x', p)", p=t / "dir" / "new"),
            "unlink in a 0755 dir": nobody("os.unlink(p)", p=t / "dir" / "file"),
            "rmdir in a 0755 dir": nobody("os.rmdir(p)", p=t / "dir" / "empty"),
            "rename in a 0755 dir": nobody("os.rename(p, q)", p=t / "dir" / "file",
                                           q=t / "dir" / "moved"),
            "stat through a 0700 dir": nobody("os.stat(p)", p=t / "closed" / "inner"),
            "list a 0700 dir": nobody("result = os.listdir(p)", p=t / "closed"),
            "list a 0711 dir": nobody("result = os.listdir(p)", p=t / "unlisted"),
            "stat through a 0711 dir": nobody("os.stat(p)", p=t / "unlisted" / "known"),
            "read through a 0711 dir": nobody("result = open(p).read()",
                                              p=t / "unlisted" / "known"),
            "access W_OK": nobody("result = os.access(p, os.W_OK)", p=t / "public"),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"read a 0600 file": err("EACCES"), "read a 0644 file": OK,
                  "write a 0644 file": err("EACCES"), "create in a 0755 dir": err("EACCES"),
                  "unlink in a 0755 dir": err("EACCES"), "rename in a 0755 dir": err("EACCES"),
                  "stat through a 0700 dir": err("EACCES"), "list a 0711 dir": err("EACCES"),
                  "read through a 0711 dir": ("ok", "t/unlisted/known"),
                  "access W_OK": ("ok", False)})


def test_chmod_chown_and_utime_by_non_owners_and_owners(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        t = root / "t"
        t.mkdir()
        write(t / "writable", b"w")
        os.chmod(t / "writable", 0o666)
        write(t / "readable", b"r")
        for name, gid in (("own", NOBODY), ("own_root_group", 0), ("own_readonly", NOBODY)):
            write(t / name, name.encode())
            os.chown(t / name, NOBODY, gid)
        os.chmod(t / "own_readonly", 0o444)
        return {
            "chmod another's file": nobody("os.chmod(p, 0o777)", p=t / "writable"),
            "chown another's file to oneself": nobody("os.chown(p, 65534, 65534)",
                                                      p=t / "writable"),
            "chown one's file to root": nobody("os.chown(p, 0, -1)", p=t / "own"),
            "chgrp one's file to a foreign group": nobody(
                f"os.chown(p, -1, {FOREIGN_GROUP})", p=t / "own"),
            "chown one's file to oneself": nobody("os.chown(p, 65534, 65534)", p=t / "own"),
            "chown one's file to -1, -1": nobody("os.chown(p, -1, -1)", p=t / "own"),
            "chmod one's file": nobody("os.chmod(p, 0o640)", p=t / "own"),
            "chmod g+s with a foreign group": nobody("os.chmod(p, 0o2755)",
                                                     p=t / "own_root_group"),
            "chmod g+s with one's group": nobody("os.chmod(p, 0o2755)", p=t / "own_readonly"),
            "explicit utime on another's writable file": nobody("os.utime(p, ns=(1, 1))",
                                                                p=t / "writable"),
            "utime now on another's writable file": nobody("os.utime(p)", p=t / "writable"),
            "utime now on another's read-only file": nobody("os.utime(p)", p=t / "readable"),
            "explicit utime on one's read-only file": nobody("os.utime(p, ns=(1, 1))",
                                                             p=t / "own_readonly"),
            "user xattr on another's read-only file": nobody(
                "os.setxattr(p, 'user.x', b'1')", p=t / "readable"),
            "user xattr on another's writable file": nobody(
                "os.setxattr(p, 'user.x', b'1')", p=t / "writable"),
            "tree": tree(t),
        }

    got = pair.same(scenario)
    require(got, {"chmod another's file": err("EPERM"),
                  "chown another's file to oneself": err("EPERM"),
                  "chown one's file to root": err("EPERM"),
                  "chgrp one's file to a foreign group": err("EPERM"),
                  "chown one's file to oneself": OK, "chmod one's file": OK,
                  "explicit utime on another's writable file": err("EPERM"),
                  "utime now on another's writable file": OK,
                  "utime now on another's read-only file": err("EACCES")})
    assert got["tree"]["own"]["mode"] == "0o640"
    assert got["tree"]["own_root_group"]["mode"] == "0o755"  # S_ISGID silently dropped
    assert got["tree"]["own_readonly"]["mode"] == "0o2755"


def test_sticky_directory(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        sticky, owned, plain = root / "sticky", root / "owned", root / "plain"
        for directory in (sticky, owned, plain):
            directory.mkdir()
            os.chmod(directory, 0o1777 if directory != plain else 0o777)
            write(directory / "roots", b"r")
            os.chmod(directory / "roots", 0o666)
        os.chown(owned, NOBODY, NOBODY)
        (sticky / "rootdir").mkdir()
        as_nobody(CREATE, p=sticky / "mine")
        as_nobody(CREATE, p=sticky / "theirs")
        return {
            "mode": shape(sticky)["mode"],
            "unlink another's file": nobody("os.unlink(p)", p=sticky / "roots"),
            "rename another's file": nobody("os.rename(p, q)", p=sticky / "roots",
                                            q=sticky / "moved"),
            "rename onto another's file": nobody("os.rename(p, q)", p=sticky / "mine",
                                                 q=sticky / "roots"),
            "rmdir another's dir": nobody("os.rmdir(p)", p=sticky / "rootdir"),
            "write another's 0666 file": nobody(APPEND, p=sticky / "roots"),
            "rename one's own file": nobody("os.rename(p, q)", p=sticky / "mine",
                                            q=sticky / "mine2"),
            "unlink one's own file": nobody("os.unlink(p)", p=sticky / "mine2"),
            "the dir's owner unlinks another's file": nobody("os.unlink(p)",
                                                             p=owned / "roots"),
            "without the sticky bit": nobody("os.unlink(p)", p=plain / "roots"),
            "root unlinks nobody's file": outcome(lambda: os.unlink(sticky / "theirs")),
            "tree": tree(sticky),
        }

    got = pair.same(scenario)
    require(got, {"mode": "0o1777", "unlink another's file": err("EPERM"),
                  "rename another's file": err("EPERM"),
                  "rename onto another's file": err("EPERM"),
                  "write another's 0666 file": OK, "unlink one's own file": OK,
                  "the dir's owner unlinks another's file": OK, "without the sticky bit": OK,
                  "root unlinks nobody's file": OK})


def test_moving_a_directory_to_another_parent_needs_write_permission_on_it(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        make(root, "a/", "b/", "a/rootdir/", "a/rootfile")
        for name in ("a", "b"):
            os.chown(root / name, NOBODY, NOBODY)
        return {
            "to another parent": nobody("os.rename(p, q)", p=root / "a" / "rootdir",
                                        q=root / "b" / "rootdir"),
            "within its parent": nobody("os.rename(p, q)", p=root / "a" / "rootdir",
                                        q=root / "a" / "renamed"),
            "a file to another parent": nobody("os.rename(p, q)", p=root / "a" / "rootfile",
                                               q=root / "b" / "rootfile"),
            "a": tree(root / "a"),
            "b": tree(root / "b"),
        }

    got = pair.same(scenario)
    require(got, {"to another parent": err("EACCES"), "within its parent": OK,
                  "a file to another parent": OK})


# -- set-user-ID and set-group-ID bits -------------------------------------------------------

WRITERS = {  # who writes, the file's owner (and group), its mode
    "non-owner": ("nobody", 0, 0o6777),
    "owner": ("nobody", NOBODY, 0o6755),
    "owner, setgid without group exec": ("nobody", NOBODY, 0o2745),
    "root": ("root", 0, 0o6755),
}


@pytest.mark.parametrize("case", WRITERS)
def test_write_clears_setuid_and_setgid_unless_root(pair: Pair, case: str) -> None:
    who, owner, mode = WRITERS[case]

    def scenario(root: Path) -> dict[str, Any]:
        write(root / "f", b"data")
        os.chown(root / "f", owner, owner)
        os.chmod(root / "f", mode)
        if who == "root":
            write(root / "f", b"more", flags=os.O_APPEND)
        else:
            as_nobody(APPEND, p=root / "f")
        return {"mode": shape(root / "f")["mode"], "content": (root / "f").read_bytes()}

    got = pair.same(scenario)
    assert got["content"] == b"datamore"
    if case in ("non-owner", "owner"):
        assert not int(got["mode"], 8) & (stat.S_ISUID | stat.S_ISGID)
    if case == "root":
        assert got["mode"] == "0o6755"


TRUNCATERS = {  # who truncates, and how
    "nobody, truncate": ("nobody", "os.truncate(p, 1)"),
    "nobody, ftruncate": ("nobody",
                          "fd = os.open(p, os.O_WRONLY)\nos.ftruncate(fd, 1)\nos.close(fd)"),
    "nobody, O_TRUNC": ("nobody", "os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))"),
    "root, truncate": ("root", ""),
}


@pytest.mark.parametrize("case", TRUNCATERS)
def test_truncate_clears_setuid_and_setgid_unless_root(pair: Pair, case: str) -> None:
    who, code = TRUNCATERS[case]

    def scenario(root: Path) -> dict[str, Any]:
        write(root / "f", b"data")
        os.chown(root / "f", NOBODY, NOBODY)
        os.chmod(root / "f", 0o6755)
        if who == "root":
            os.truncate(root / "f", 1)
        else:
            as_nobody(code, p=root / "f")
        return shape(root / "f")

    got = pair.same(scenario)
    assert got["mode"] == ("0o6755" if who == "root" else "0o755")


CHOWNS = {  # who chowns, what (mode, is a directory), to which uid and gid
    "root gives a file away": ("root", 0o6755, False, NOBODY, NOBODY),
    "root gives away a file, setgid without group exec": ("root", 0o2745, False, NOBODY,
                                                          NOBODY),
    "root chowns a file to -1, -1": ("root", 0o6755, False, -1, -1),
    "root gives a directory away": ("root", 0o3755, True, NOBODY, NOBODY),
    "the owner chowns to itself": ("nobody", 0o6755, False, NOBODY, NOBODY),
    "the owner chowns to -1, -1": ("nobody", 0o6755, False, -1, -1),
}


@pytest.mark.parametrize("case", CHOWNS)
def test_chown_clears_setuid(pair: Pair, case: str) -> None:
    who, mode, is_dir, uid, gid = CHOWNS[case]

    def scenario(root: Path) -> dict[str, Any]:
        path = root / "x"
        if is_dir:
            path.mkdir()
        else:
            write(path, b"data")
        if who == "nobody":
            os.chown(path, NOBODY, NOBODY)
        os.chmod(path, mode)
        if who == "root":
            os.chown(path, uid, gid)
        else:
            as_nobody(f"os.chown(p, {uid}, {gid})", p=path)
        return shape(path)

    got = pair.same(scenario)
    if case == "root gives a file away":
        assert got["mode"] == "0o755" and got["uid"] == NOBODY


def test_setgid_directories_pass_on_their_group(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        (root / "d").mkdir()
        os.chown(root / "d", 0, FOREIGN_GROUP)
        os.chmod(root / "d", 0o2777)
        write(root / "d" / "f")
        (root / "d" / "sub").mkdir()
        os.mkfifo(root / "d" / "fifo")
        os.symlink("f", root / "d" / "link")
        as_nobody(CREATE, p=root / "d" / "nobodys")
        as_nobody("os.mkdir(p)", p=root / "d" / "nobodys_dir")
        (root / "plain").mkdir()
        write(root / "plain" / "f")
        return {"d": tree(root / "d"), "plain": tree(root / "plain")}

    got = pair.same(scenario)
    d = got["d"]
    assert {d[name]["gid"] for name in d} == {FOREIGN_GROUP}
    assert d["sub"]["mode"] == "0o2755" and d["nobodys_dir"]["mode"] == "0o2755"
    assert d["nobodys"]["uid"] == NOBODY and got["plain"]["f"]["gid"] == 0


# -- timestamps ------------------------------------------------------------------------------


def namespace_cases(root: Path) -> dict[str, dict[str, str]]:
    """For each operation: what it changes on the file and on the parent directories."""
    cases: dict[str, dict[str, str]] = {}

    def case(name: str, *entries: str) -> Path:
        here = root / name
        here.mkdir()
        make(here, *entries)
        return here

    d = case("create", "d/")
    cases["create"] = changes(lambda: write(d / "d" / "f"), dir=d / "d")
    d = case("mkdir", "d/")
    cases["mkdir"] = changes(lambda: os.mkdir(d / "d" / "sub"), dir=d / "d")
    d = case("mkfifo", "d/")
    cases["mkfifo"] = changes(lambda: os.mkfifo(d / "d" / "fifo"), dir=d / "d")
    d = case("symlink", "d/")
    cases["symlink"] = changes(lambda: os.symlink("x", d / "d" / "l"), dir=d / "d")
    d = case("link", "d/", "d/f", "e/")
    cases["link"] = changes(lambda: os.link(d / "d" / "f", d / "e" / "g"),
                            source_dir=d / "d", target_dir=d / "e", file=d / "d" / "f")
    d = case("unlink", "d/", "d/f")
    cases["unlink"] = changes(lambda: os.unlink(d / "d" / "f"), dir=d / "d")
    d = case("unlink one of two links", "d/", "d/f")
    os.link(d / "d" / "f", d / "d" / "g")
    cases["unlink one of two links"] = changes(lambda: os.unlink(d / "d" / "f"), dir=d / "d",
                                               other_link=d / "d" / "g")
    d = case("rmdir", "d/", "d/sub/")
    cases["rmdir"] = changes(lambda: os.rmdir(d / "d" / "sub"), dir=d / "d")
    d = case("rename within a dir", "d/", "d/f")
    cases["rename within a dir"] = changes(lambda: os.rename(d / "d" / "f", d / "d" / "g"),
                                           dir=d / "d", file=(d / "d" / "f", d / "d" / "g"))
    d = case("rename across dirs", "a/", "b/", "a/f")
    cases["rename across dirs"] = changes(lambda: os.rename(d / "a" / "f", d / "b" / "f"),
                                          source_dir=d / "a", target_dir=d / "b",
                                          file=(d / "a" / "f", d / "b" / "f"))
    d = case("rename a dir across dirs", "a/", "b/", "a/sub/")
    cases["rename a dir across dirs"] = changes(
        lambda: os.rename(d / "a" / "sub", d / "b" / "sub"), source_dir=d / "a",
        target_dir=d / "b", moved=(d / "a" / "sub", d / "b" / "sub"))
    d = case("rename over a file", "d/", "d/f", "d/g")
    cases["rename over a file"] = changes(lambda: os.rename(d / "d" / "f", d / "d" / "g"),
                                          dir=d / "d", file=(d / "d" / "f", d / "d" / "g"))
    d = case("rename onto itself", "d/", "d/f")
    cases["rename onto itself"] = changes(lambda: os.rename(d / "d" / "f", d / "d" / "f"),
                                          dir=d / "d", file=d / "d" / "f")
    d = case("refused mkdir", "d/", "d/f")
    cases["refused mkdir"] = changes(lambda: outcome(lambda: os.mkdir(d / "d" / "f")),
                                     dir=d / "d", file=d / "d" / "f")
    d = case("refused rmdir", "d/", "d/sub/", "d/sub/x")
    cases["refused rmdir"] = changes(lambda: outcome(lambda: os.rmdir(d / "d" / "sub")),
                                     dir=d / "d", sub=d / "d" / "sub")
    return cases


def test_timestamps_of_namespace_operations(pair: Pair) -> None:
    got = pair.same(namespace_cases)
    both = "mtime+ctime"
    # POSIX: the directories whose entries change get new mtime and ctime; link() and unlink()
    # change the file's ctime; failed calls change nothing.
    require(got, {
        "create": {"dir": both}, "mkdir": {"dir": both}, "mkfifo": {"dir": both},
        "symlink": {"dir": both}, "unlink": {"dir": both}, "rmdir": {"dir": both},
        "link": {"source_dir": "unchanged", "target_dir": both, "file": "ctime"},
        "unlink one of two links": {"dir": both, "other_link": "ctime"},
        "refused mkdir": {"dir": "unchanged", "file": "unchanged"},
        "refused rmdir": {"dir": "unchanged", "sub": "unchanged"},
    })
    for name in ("rename within a dir", "rename over a file"):
        assert got[name]["dir"] == both
    for name in ("rename across dirs", "rename a dir across dirs"):
        assert (got[name]["source_dir"], got[name]["target_dir"]) == (both, both)


def attribute_cases(root: Path) -> dict[str, dict[str, str]]:
    cases: dict[str, dict[str, str]] = {}

    def case(name: str) -> tuple[Path, Path]:
        here = root / name
        here.mkdir()
        write(here / "f", b"data")
        return here, here / "f"

    d, f = case("chmod")
    cases["chmod"] = changes(lambda: os.chmod(f, 0o600), file=f, dir=d)
    d, f = case("chmod to the same mode")
    cases["chmod to the same mode"] = changes(lambda: os.chmod(f, 0o644), file=f)
    d, f = case("chown")
    cases["chown"] = changes(lambda: os.chown(f, NOBODY, NOBODY), file=f, dir=d)
    d, f = case("chown to -1, -1")
    cases["chown to -1, -1"] = changes(lambda: os.chown(f, -1, -1), file=f)
    d, f = case("explicit utime")
    cases["explicit utime"] = changes(lambda: os.utime(f, ns=(10**18, 10**18)), file=f, dir=d)
    d, f = case("utime now")
    cases["utime now"] = changes(lambda: os.utime(f), file=f)
    d, f = case("utime of the dir")
    cases["utime of the dir"] = changes(lambda: os.utime(d, ns=(10**18, 10**18)), dir=d,
                                        file=f)
    d, f = case("setxattr")
    cases["setxattr"] = changes(lambda: os.setxattr(f, "user.x", b"1"), file=f, dir=d)
    d, f = case("removexattr")
    os.setxattr(f, "user.x", b"1")
    cases["removexattr"] = changes(lambda: os.removexattr(f, "user.x"), file=f)
    d, f = case("read")
    cases["read"] = changes(lambda: f.read_bytes(), file=f, dir=d)
    d, f = case("stat and list")
    cases["stat and list"] = changes(lambda: (os.stat(f), os.listdir(d)), file=f, dir=d)
    d, f = case("chmod the dir")
    cases["chmod the dir"] = changes(lambda: os.chmod(d, 0o700), dir=d, file=f)
    return cases


def test_timestamps_of_attribute_changes(pair: Pair) -> None:
    got = pair.same(attribute_cases)
    require(got, {
        "chmod": {"file": "ctime", "dir": "unchanged"},
        "chown": {"file": "ctime", "dir": "unchanged"},
        "explicit utime": {"file": "mtime+ctime", "dir": "unchanged"},
        "utime now": {"file": "mtime+ctime"},
        "setxattr": {"file": "ctime", "dir": "unchanged"},
        "read": {"file": "unchanged", "dir": "unchanged"},
        "stat and list": {"file": "unchanged", "dir": "unchanged"},
        "chmod the dir": {"dir": "ctime", "file": "unchanged"},
    })


def content_cases(root: Path) -> dict[str, dict[str, str]]:
    cases: dict[str, dict[str, str]] = {}

    def case(name: str, data: bytes = b"data") -> tuple[Path, Path]:
        here = root / name
        here.mkdir()
        write(here / "f", data)
        return here, here / "f"

    def ftruncate(path: Path, size: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    d, f = case("write and close")
    cases["write and close"] = changes(lambda: write(f, b"new", flags=0), file=f, dir=d)
    d, f = case("append")
    cases["append"] = changes(lambda: write(f, b"more", flags=os.O_APPEND), file=f)
    d, f = case("write nothing")
    cases["write nothing"] = changes(lambda: write(f, b"", flags=0), file=f)
    d, f = case("open for writing, close")
    cases["open for writing, close"] = changes(lambda: opened(f, os.O_WRONLY), file=f)
    d, f = case("O_TRUNC")
    cases["O_TRUNC"] = changes(lambda: opened(f, os.O_WRONLY | os.O_TRUNC), file=f, dir=d)
    d, f = case("O_TRUNC of an empty file", b"")
    cases["O_TRUNC of an empty file"] = changes(lambda: opened(f, os.O_WRONLY | os.O_TRUNC),
                                                file=f)
    d, f = case("truncate shorter")
    cases["truncate shorter"] = changes(lambda: os.truncate(f, 1), file=f, dir=d)
    d, f = case("truncate longer")
    cases["truncate longer"] = changes(lambda: os.truncate(f, 100), file=f)
    d, f = case("truncate to the same size")
    cases["truncate to the same size"] = changes(lambda: os.truncate(f, 4), file=f)
    d, f = case("ftruncate shorter")
    cases["ftruncate shorter"] = changes(lambda: ftruncate(f, 1), file=f)
    d, f = case("ftruncate to the same size")
    cases["ftruncate to the same size"] = changes(lambda: ftruncate(f, 4), file=f)
    d, f = case("open for reading, close")
    cases["open for reading, close"] = changes(lambda: opened(f, os.O_RDONLY), file=f)
    return cases


def test_timestamps_of_content_changes(pair: Pair) -> None:
    got = pair.same(content_cases)
    both = "mtime+ctime"
    require(got, {
        "write and close": {"file": both, "dir": "unchanged"}, "append": {"file": both},
        "write nothing": {"file": "unchanged"}, "open for writing, close": {"file": "unchanged"},
        "O_TRUNC": {"file": both, "dir": "unchanged"}, "O_TRUNC of an empty file": {"file": both},
        "truncate shorter": {"file": both, "dir": "unchanged"},
        "truncate longer": {"file": both}, "ftruncate shorter": {"file": both},
        "open for reading, close": {"file": "unchanged"},
    })


def test_utimensat(pair: Pair) -> None:
    def scenario(root: Path) -> dict[str, Any]:
        f = root / "f"
        write(f, b"data")
        found: dict[str, Any] = {}
        found["explicit"] = changes(
            lambda: utimensat(f, (1_000_000, 5), (2_000_000, 7)), file=f)
        found["explicit mtime"] = os.stat(f).st_mtime_ns
        found["omit mtime"] = changes(
            lambda: utimensat(f, (3_000_000, 0), (0, UTIME_OMIT)), file=f)
        found["mtime kept"] = os.stat(f).st_mtime_ns
        found["omit both"] = changes(lambda: utimensat(f, (0, UTIME_OMIT), (0, UTIME_OMIT)),
                                     file=f)
        found["omit both on a missing file"] = outcome(
            lambda: utimensat(root / "nope", (0, UTIME_OMIT), (0, UTIME_OMIT)))
        found["before 1970"] = outcome(
            lambda: utimensat(f, (0, UTIME_OMIT), (-1_000_000, 1)))
        found["mtime before 1970"] = os.stat(f).st_mtime_ns
        started = time.time_ns()
        found["now"] = changes(lambda: utimensat(f, (0, UTIME_NOW), (0, UTIME_NOW)), file=f)
        found["now is now"] = abs(os.stat(f).st_mtime_ns - started) < 5 * SECOND
        found["nanoseconds out of range"] = outcome(
            lambda: utimensat(f, (0, UTIME_OMIT), (0, 1_000_000_000)))
        found["missing file"] = outcome(lambda: utimensat(root / "nope", (0, 0), (0, 0)))
        return found

    got = pair.same(scenario)
    require(got, {"explicit": {"file": "mtime+ctime"}, "explicit mtime": 2_000_000 * SECOND + 7,
                  "omit mtime": {"file": "ctime"}, "mtime kept": 2_000_000 * SECOND + 7,
                  "now is now": True, "nanoseconds out of range": err("EINVAL"),
                  "missing file": err("ENOENT")})
