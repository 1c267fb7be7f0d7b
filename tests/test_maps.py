"""Memory maps see what reads see, and write only their own version.

Every open gets the bytes of its own version through mmap as through pread: a reader the
version it opened, a writer its own staged copy. Opens that cannot share the kernel inode
already holding other opens of the file are moved to a fresh kernel inode
(kvfs/files/kernel_inodes.py). Checked on one host with passthrough, without it, and on a Redis
pool; readers and writers in processes of their own where the case names them. After every
step: no committed blob file changed in place, and the counters equal a recount.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import KvfsMount, assert_counters_exact, blob_files, stats

SIZE = 8192
OLD = b"x" * SIZE


@pytest.fixture(params=["passthrough", "daemon", "redis"])
def mount(request: pytest.FixtureRequest, make_mount) -> KvfsMount:
    if request.param == "redis":
        (pool,) = request.getfixturevalue("shared_pool")(1)
        return pool
    return make_mount(*(["--passthrough", "off"] if request.param == "daemon" else []))


def committed_blobs(kvfs: KvfsMount) -> dict[Path, str]:
    found = {}
    for path in blob_files(kvfs):
        with contextlib.suppress(FileNotFoundError):  # (retired meanwhile)
            found[path] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def assert_blobs_unchanged(kvfs: KvfsMount, before: dict[Path, str]) -> None:
    """Committed blob files are never written in place: each is as it was or gone."""
    for path, digest in before.items():
        with contextlib.suppress(FileNotFoundError):  # (deleted: retired, never rewritten)
            assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, path


def assert_consistent(kvfs: KvfsMount, before: dict[Path, str]) -> dict[Path, str]:
    assert_blobs_unchanged(kvfs, before)
    assert_counters_exact(kvfs.mountpoint, kvfs.data)
    return committed_blobs(kvfs)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)


def mapped(fd: int, shared: bool = True, writable: bool = False) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(fd, SIZE, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE, prot)


def map_write(fd: int, offset: int, data: bytes) -> None:
    with mapped(fd, writable=True) as view:
        view[offset:offset + len(data)] = data
        view.flush()


def map_read(fd: int, shared: bool) -> bytes:
    with mapped(fd, shared=shared) as view:
        return bytes(view[:SIZE])


class Holder:
    """A process of its own holding one open of a file: it answers `read` with what
    pread and a shared and a private map of its descriptor show."""

    SCRIPT = textwrap.dedent("""
        import mmap, os, sys
        fd = os.open(sys.argv[1], int(sys.argv[2]))
        print("open", flush=True)
        for line in sys.stdin:
            if line.strip() == "read":
                size = os.fstat(fd).st_size
                views = [os.pread(fd, size, 0)]
                for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
                    with mmap.mmap(fd, size, flags, mmap.PROT_READ) as view:
                        views.append(bytes(view))
                print(" ".join(view.hex() for view in views), flush=True)
            elif line.strip() == "write":
                os.pwrite(fd, b"NEW!", 0)
                print("written", flush=True)
        os.close(fd)
    """)

    def __init__(self, path: Path, flags: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(path),
                                         str(flags)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self._answer() == "open"

    def _answer(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def _ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def views(self) -> list[bytes]:
        """pread, shared map, private map."""
        return [bytes.fromhex(view) for view in self._ask("read").split()]

    def write(self) -> None:
        assert self._ask("write") == "written"

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0


def test_a_shared_map_beside_a_reader_writes_its_own_version(mount: KvfsMount) -> None:
    """The reported loss: a reader process holds the file; another process maps it shared,
    writes and closes. The reader keeps its version, the file becomes the writer's, and
    the committed blob is never touched."""
    path = mount.mountpoint / "victim"
    write_file(path, OLD)
    before = committed_blobs(mount)
    reader = Holder(path, os.O_RDONLY)
    writer = os.open(path, os.O_RDWR)
    try:
        map_write(writer, 0, b"MMAP")
        assert os.pread(writer, SIZE, 0) == b"MMAP" + OLD[4:]
        assert_blobs_unchanged(mount, before)
    finally:
        os.close(writer)
    assert reader.views() == [OLD] * 3
    reader.close()
    assert path.read_bytes() == b"MMAP" + OLD[4:]
    assert_consistent(mount, before)


@pytest.mark.parametrize("last", ["mapper", "writer"])
def test_two_writers_each_map_their_own_copy_and_the_last_close_wins(
        mount: KvfsMount, last: str) -> None:
    """A writer process has written without closing; a second writer maps the file and
    stores into the map. Each sees its own bytes; whichever closes last is the file, whole.
    (Python's mmap holds a duplicate of the descriptor: closing the map is a close.)"""
    path = mount.mountpoint / "f"
    write_file(path, OLD)
    before = committed_blobs(mount)
    first = Holder(path, os.O_RDWR)
    first.write()  # b"NEW!" at 0, not closed
    second = os.open(path, os.O_RDWR)
    view = mapped(second, writable=True)
    view[4:8] = b"MMAP"
    view.flush()
    assert os.pread(second, SIZE, 0) == OLD[:4] + b"MMAP" + OLD[8:]
    assert first.views() == [b"NEW!" + OLD[4:]] * 3
    assert_blobs_unchanged(mount, before)
    if last == "mapper":
        first.close()
        assert path.read_bytes() == b"NEW!" + OLD[4:]
    view.close()
    os.close(second)
    if last == "writer":
        assert path.read_bytes() == OLD[:4] + b"MMAP" + OLD[8:]
        first.close()
    expected = OLD[:4] + b"MMAP" + OLD[8:] if last == "mapper" else b"NEW!" + OLD[4:]
    assert path.read_bytes() == expected
    assert_consistent(mount, before)


@pytest.mark.parametrize("access", [os.O_RDWR, os.O_WRONLY], ids=["served", "kernel"])
def test_a_reader_beside_a_writer_maps_the_committed_version(mount: KvfsMount,
                                                              access: int) -> None:
    """Beside a writer the daemon serves (read-write) or the kernel writes through (write
    only, where passthrough is on), a reader reads and maps the committed version."""
    path = mount.mountpoint / "f"
    write_file(path, OLD)
    before = committed_blobs(mount)
    writer = Holder(path, access)
    writer.write()
    reader = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(reader, SIZE, 0) == OLD
        assert map_read(reader, shared=True) == OLD
        assert map_read(reader, shared=False) == OLD
        with mapped(reader, shared=False, writable=True) as view:  # copy on write: its own
            view[:4] = b"PRIV"
            assert bytes(view[:8]) == b"PRIV" + OLD[4:8]
        assert os.pread(reader, SIZE, 0) == OLD
    finally:
        os.close(reader)
    writer.close()
    assert path.read_bytes() == b"NEW!" + OLD[4:]
    assert_consistent(mount, before)


def test_readers_of_two_versions_each_map_their_own(mount: KvfsMount) -> None:
    path = mount.mountpoint / "f"
    write_file(path, OLD)
    old_reader = Holder(path, os.O_RDONLY)
    before = committed_blobs(mount)
    new = b"y" * 100  # shorter: the old reader's size stays its version's
    write_file(path, new)
    new_reader = os.open(path, os.O_RDONLY)
    try:
        assert os.fstat(new_reader).st_size == len(new)
        assert os.pread(new_reader, SIZE, 0) == new
        for flags in (mmap.MAP_SHARED, mmap.MAP_PRIVATE):
            with mmap.mmap(new_reader, len(new), flags, mmap.PROT_READ) as view:
                assert bytes(view) == new
    finally:
        os.close(new_reader)
    assert old_reader.views() == [OLD] * 3
    old_reader.close()
    assert_consistent(mount, before)


def test_a_writer_alone_maps_and_writes_like_pwrite(mount: KvfsMount) -> None:
    """Shared writable maps of a writer with the file to itself (no ENODEV, also where the
    daemon serves it), mixed with pwrite, committed whole at close."""
    path = mount.mountpoint / "f"
    write_file(path, OLD)
    before = committed_blobs(mount)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"PW", 100)
        with mapped(fd, writable=True) as view:
            assert bytes(view[100:102]) == b"PW"
            view[0:4] = b"MMAP"
            view.flush()
        assert os.pread(fd, 4, 0) == b"MMAP"
    finally:
        os.close(fd)
    expected = bytearray(OLD)
    expected[0:4], expected[100:102] = b"MMAP", b"PW"
    assert path.read_bytes() == expected
    assert_consistent(mount, before)


def test_the_same_process_reading_and_writing_one_file(mount: KvfsMount) -> None:
    """One process with a reader and then a writer of one file (what a program rewriting
    a file it reads does): neither open fails, each maps its own version."""
    path = mount.mountpoint / "f"
    write_file(path, OLD)
    before = committed_blobs(mount)
    reader = os.open(path, os.O_RDONLY)
    writer = os.open(path, os.O_RDWR)
    try:
        map_write(writer, 0, b"MMAP")
        assert map_read(reader, shared=True) == OLD
        assert os.pread(reader, SIZE, 0) == OLD
    finally:
        os.close(writer)
        os.close(reader)
    assert path.read_bytes() == b"MMAP" + OLD[4:]
    assert stats(mount.mountpoint)["opens_renewed"] >= 1
    assert_consistent(mount, before)


RENAME_WHITEOUT = 4
FS_IOC_GETFLAGS = 0x80086601


def test_whiteout_renames_and_inode_flags_are_refused_as_documented(
        make_mount) -> None:
    """Neither exists in kvfs: RENAME_WHITEOUT is EINVAL (as on a file system without
    whiteouts), FS_IOC_GETFLAGS is ENOTTY (as on one without inode flags); nothing
    changes."""
    kvfs = make_mount()
    (kvfs.mountpoint / "a").write_bytes(b"a")
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.renameat2(-100, str(kvfs.mountpoint / "a").encode(), -100,
                            str(kvfs.mountpoint / "b").encode(), RENAME_WHITEOUT)
    assert result == -1 and ctypes.get_errno() == errno.EINVAL
    assert sorted(os.listdir(kvfs.mountpoint)) == ["a"]
    with open(kvfs.mountpoint / "a", "rb") as file, pytest.raises(OSError) as refused:
        fcntl.ioctl(file.fileno(), FS_IOC_GETFLAGS, struct.pack("l", 0))
    assert refused.value.errno == errno.ENOTTY
