"""POSIX semantics through a real kvfs mount: syscalls and plain shell tools."""

from __future__ import annotations

import ctypes
import errno
import mmap
import multiprocessing
import os
import socket
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import drop_caches, stats

MiB = 1 << 20
LIBC = ctypes.CDLL(None, use_errno=True)


def errno_of(call, *args) -> int:
    with pytest.raises(OSError) as caught:
        call(*args)
    return caught.value.errno


def sh(*command: str, cwd: Path | None = None) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True,
                          cwd=cwd).stdout


def test_write_read_at_offsets_and_truncate(kvfs) -> None:
    path = kvfs.mountpoint / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.pwrite(fd, b"hello", 0)
    os.pwrite(fd, b"world", 3 * MiB + 7)  # a hole in between
    assert os.pread(fd, 5, 0) == b"hello"
    os.ftruncate(fd, 3 * MiB + 10)
    os.close(fd)
    data = path.read_bytes()
    assert len(data) == 3 * MiB + 10
    assert data[:5] == b"hello" and data[-3:] == b"wor" and data[5:3 * MiB + 7] == bytes(
        3 * MiB + 2)
    os.truncate(path, 2)
    assert path.read_bytes() == b"he"
    with open(path, "ab") as appender:
        appender.write(b"llo")
    assert path.read_bytes() == b"hello"
    with open(path, "r+b") as patcher:
        patcher.seek(1)
        patcher.write(b"E")
    assert path.read_bytes() == b"hEllo"


@pytest.mark.parametrize("existing", [False, True])
def test_writer_sees_its_own_size_and_end(kvfs, tmp_path: Path, existing: bool) -> None:
    """A writer's fstat, SEEK_END and ftruncate see what it wrote, as on ext4; other handles
    see the file as last committed until the writer closes."""
    outcomes = {}
    for root in (kvfs.mountpoint, tmp_path):
        path = root / "f"
        if existing:
            path.write_bytes(b"0123456789")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        seen = [os.write(fd, b"a" * 100), os.fstat(fd).st_size,
                os.lseek(fd, 0, os.SEEK_END), os.write(fd, b"b" * 10), os.fstat(fd).st_size]
        os.ftruncate(fd, 400)
        seen += [os.fstat(fd).st_size, os.lseek(fd, 0, os.SEEK_END)]
        os.ftruncate(fd, 50)
        seen += [os.fstat(fd).st_size, os.lseek(fd, 0, os.SEEK_END), os.write(fd, b"c")]
        os.close(fd)
        seen.append(path.read_bytes())
        outcomes[root] = seen
    assert outcomes[kvfs.mountpoint] == outcomes[tmp_path]
    assert outcomes[tmp_path][-1] == b"a" * 50 + b"c"


def written_in_two(path: Path, flags: int, between) -> int:
    """Write a file in two parts, O_DIRECT-aligned, with `between` (a client's look at it
    while it is being written) after each; returns its size."""
    part = mmap.mmap(-1, MiB)  # (page-aligned, as O_DIRECT wants)
    part.write(os.urandom(MiB))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        for _ in range(2):
            os.write(fd, part)
            between(fd)
    finally:
        os.close(fd)
    return 2 * MiB if not flags & os.O_APPEND else 2 * MiB + 10


@pytest.mark.parametrize("look", ["none", "fstat", "stat", "ls -l", "link", "du"])
@pytest.mark.parametrize("flags", [os.O_TRUNC, os.O_DIRECT, os.O_APPEND])
def test_a_closed_files_attributes_are_the_committed_ones_at_once(kvfs, look: str,
                                                                   flags: int) -> None:
    """A commit sends the writer's kernel inode no invalidation (each write marks the size,
    times and blocks stale in its cache, and a file being written is described uncached):
    right after the close, stat must show what a kernel that holds nothing of the file
    reads, whoever looked at the file while it was written and however."""
    directory = kvfs.mountpoint / "attributes"
    directory.mkdir()
    path = directory / "chunk"
    if flags & os.O_APPEND:
        path.write_bytes(b"0123456789")
        os.stat(path)  # (its attributes cached before the writer opens)
    looks = {"none": lambda fd: None, "fstat": os.fstat, "stat": lambda fd: os.stat(path),
             "ls -l": lambda fd: sh("ls", "-l", str(directory)),
             "link": lambda fd: os.link(path, directory / f"link{os.fstat(fd).st_size}"),
             "du": lambda fd: sh("du", "-a", str(directory))}
    size = written_in_two(path, flags, looks[look])

    def seen(name: str) -> tuple:
        status = (directory / name).stat()
        return status.st_size, status.st_blocks, status.st_mtime_ns, status.st_ctime_ns

    names = sorted(entry.name for entry in directory.iterdir())
    after_close = [seen(name) for name in names]
    assert after_close[names.index("chunk")][0] == size
    looked_up = stats(kvfs.mountpoint)["requests"]["lookup"]["count"]
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # the kernel forgets the inodes
    assert [seen(name) for name in names] == after_close
    assert stats(kvfs.mountpoint)["requests"]["lookup"]["count"] > looked_up  # (asked anew)


@pytest.mark.parametrize("name", ["same", "hard link"])
def test_a_commit_beside_a_reader_shows_in_every_name_once_it_closes(kvfs, name: str) -> None:
    """A writer beside a reader gets a kernel inode of its own (kvfs/files/kernel_inodes.py);
    the reader's inode holds the reader's size until it closes, and then every name of the
    file, whichever kernel inode it leads to, has the committed size, as on ext4."""
    first = kvfs.mountpoint / "chunk"
    first.write_bytes(b"x" * 100)
    second = first
    if name == "hard link":
        second = kvfs.mountpoint / "link"
        os.link(first, second)
    assert second.stat().st_size == 100  # (both names' attributes cached)
    reader = os.open(first, os.O_RDONLY)
    try:
        writer = os.open(second, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(writer, b"y" * 1897)
        finally:
            os.close(writer)
        assert os.pread(reader, 200, 0) == b"x" * 100  # (it reads the version it opened)
        os.stat(first)  # (the reader's kernel inode asked while it is open)
    finally:
        os.close(reader)
    assert {first.stat().st_size, second.stat().st_size} == {1897}
    assert first.read_bytes() == second.read_bytes() == b"y" * 1897


def test_new_file_written_then_appended_after_seek_end(kvfs, tmp_path: Path) -> None:
    """The data-corrupting case: write 100 bytes, seek to the end, write 10: 110 bytes."""
    contents = []
    for root in (kvfs.mountpoint, tmp_path):
        fd = os.open(root / "g", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x" * 100)
        end = os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, b"y" * 10)
        os.close(fd)
        contents.append((end, (root / "g").read_bytes()))
    assert contents[0] == contents[1] == (100, b"x" * 100 + b"y" * 10)


def test_large_file_roundtrip_and_shell_tools(kvfs) -> None:
    payload = os.urandom(40 * MiB + 123)
    (kvfs.mountpoint / "dir").mkdir()
    big = kvfs.mountpoint / "dir" / "big.data"
    big.write_bytes(payload)
    assert big.read_bytes() == payload
    listing = sh("ls", "-l", str(big))
    assert str(len(payload)) in listing.split()
    assert int(sh("du", "-k", str(big)).split()[0]) == -(-len(payload) // 4096) * 4
    assert int(sh("stat", "-c", "%s", str(big))) == len(payload)
    df = sh("df", "-k", str(kvfs.mountpoint)).splitlines()[1].split()
    assert int(df[1]) == 1 << 20  # 1G capacity in KiB
    assert int(df[2]) >= len(payload) // 1024
    sh("cp", str(big), str(kvfs.mountpoint / "copy"))
    assert (kvfs.mountpoint / "copy").read_bytes() == payload
    sh("mv", str(kvfs.mountpoint / "copy"), str(kvfs.mountpoint / "dir" / "moved"))
    found = sh("find", str(kvfs.mountpoint), "-type", "f").split()
    assert sorted(found) == sorted([str(big), str(kvfs.mountpoint / "dir" / "moved")])
    sh("rm", "-r", str(kvfs.mountpoint / "dir"))
    assert os.listdir(kvfs.mountpoint) == []
    assert int(sh("df", "-k", str(kvfs.mountpoint)).splitlines()[1].split()[2]) == 0


def test_directories(kvfs) -> None:
    root = kvfs.mountpoint
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_bytes(b"x")
    assert errno_of(os.rmdir, root / "a") == errno.ENOTEMPTY
    assert errno_of(os.mkdir, root / "a") == errno.EEXIST
    assert errno_of(os.rmdir, root / "a" / "b" / "f") == errno.ENOTDIR
    assert errno_of(os.unlink, root / "a") == errno.EISDIR
    assert os.stat(root / "a").st_nlink == 3
    (root / "a" / "b" / "f").unlink()
    os.rmdir(root / "a" / "b")
    assert os.stat(root / "a").st_nlink == 2
    os.rmdir(root / "a")
    assert os.listdir(root) == []


def test_rename_semantics(kvfs) -> None:
    root = kvfs.mountpoint
    (root / "d1").mkdir()
    (root / "d2").mkdir()
    (root / "d1" / "x").write_bytes(b"old-x")
    (root / "d2" / "y").write_bytes(b"old-y")
    os.rename(root / "d1" / "x", root / "d2" / "y")  # across directories, over a file
    assert (root / "d2" / "y").read_bytes() == b"old-x"
    assert not (root / "d1" / "x").exists()
    (root / "d1" / "sub").mkdir()
    assert errno_of(os.rename, root / "d1", root / "d1" / "sub" / "inside") == errno.EINVAL
    assert errno_of(os.rename, root / "d2" / "y", root / "d1") == errno.EISDIR
    assert errno_of(os.rename, root / "d1", root / "d2" / "y") == errno.ENOTDIR
    (root / "d2" / "y").unlink()
    os.rename(root / "d1" / "sub", root / "d2")  # over an empty directory
    assert sorted(os.listdir(root)) == ["d1", "d2"]
    assert errno_of(os.rename, root / "nope", root / "other") == errno.ENOENT


def test_xattrs(kvfs) -> None:
    path = kvfs.mountpoint / "f"
    path.write_bytes(b"")
    os.setxattr(path, "user.kvfs.pin", b"1")
    os.setxattr(path, "user.note", b"v" * 1000)
    assert os.getxattr(path, "user.kvfs.pin") == b"1"
    assert sorted(os.listxattr(path)) == ["user.kvfs.pin", "user.note"]
    os.removexattr(path, "user.note")
    assert os.listxattr(path) == ["user.kvfs.pin"]
    assert errno_of(os.getxattr, path, "user.none") == errno.ENODATA
    assert errno_of(os.setxattr, path, "trusted.x", b"1") in (errno.ENOTSUP, errno.EPERM)
    assert errno_of(os.setxattr, path, "user.huge", b"v" * MiB) in (errno.E2BIG, errno.ENOSPC)
    kvfs.remount()
    assert os.getxattr(path, "user.kvfs.pin") == b"1"



def test_attributes_outside_user_are_absent_and_counted(kvfs) -> None:
    """kvfs keeps user.* attributes alone; the kernel's own questions (security.capability
    before a first write, ACLs and SELinux labels for `ls -l`) get ENODATA, from the patched
    pyfuse3 without a task on the loop, and `.kvfs/stats` counts them there."""
    path = kvfs.mountpoint / "f"
    path.write_bytes(b"abc")
    os.setxattr(path, "user.note", b"1")
    before = stats(kvfs.mountpoint)
    names = ("security.capability", "security.selinux", "system.posix_acl_access", "trusted.x")
    for name in names:
        assert errno_of(os.getxattr, path, name) == errno.ENODATA
    assert os.getxattr(path, "user.note") == b"1"
    after = stats(kvfs.mountpoint)
    handled = (after["requests"]["getxattr"]["count"]
               - before["requests"].get("getxattr", {"count": 0})["count"])
    refused = after["foreign_xattrs_refused"] - before["foreign_xattrs_refused"]
    assert (refused, handled) == (len(names), 1)  # the binding answers them itself

def test_attributes(kvfs) -> None:
    path = kvfs.mountpoint / "f"
    path.write_bytes(b"abc")
    os.chmod(path, 0o600)
    os.chown(path, 1234, 5678)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    kvfs.remount()
    info = os.stat(path)
    assert stat.S_IMODE(info.st_mode) == 0o600 and stat.S_ISREG(info.st_mode)
    assert (info.st_uid, info.st_gid) == (1234, 5678)
    assert info.st_mtime_ns == 2_000_000_000
    assert info.st_atime_ns >= 1_000_000_000  # atime is the last use: lookups move it on


def test_every_file_type_with_shell_tools_and_across_remounts(kvfs) -> None:
    """Symlinks, hard links, fifos, sockets and device nodes are metadata-only inodes; the
    kernel does their I/O. Hard links share one blob, counted once."""
    root = kvfs.mountpoint
    (root / "models").mkdir()
    (root / "models" / "f").write_bytes(b"x" * MiB)
    sh("ln", "-s", "models", str(root / "current"))
    sh("ln", str(root / "models" / "f"), str(root / "hard"))
    sh("mkfifo", str(root / "fifo"))
    sh("mknod", str(root / "null"), "c", "1", "3")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(root / "sock"))
        server.listen()
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(root / "sock"))
            client.sendall(b"ping")
            assert server.accept()[0].recv(4) == b"ping"
    writer = subprocess.Popen(["sh", "-c", f"echo through > {root / 'fifo'}"])
    assert (root / "fifo").read_text() == "through\n"
    assert writer.wait(10) == 0
    for _ in range(2):
        assert (root / "current" / "f").read_bytes() == b"x" * MiB
        assert os.readlink(root / "current") == "models"
        assert os.stat(root / "hard").st_ino == os.stat(root / "models" / "f").st_ino
        assert os.stat(root / "hard").st_nlink == 2
        assert stat.S_ISFIFO(os.stat(root / "fifo").st_mode)
        assert stat.S_ISSOCK(os.stat(root / "sock").st_mode)
        assert os.stat(root / "null").st_rdev == os.makedev(1, 3)
        assert errno_of(open, root / "null") == errno.EACCES  # mounted nodev (libfuse)
        assert stats(root)["used_bytes"] == MiB  # two names, one blob
        assert stats(root)["files"] == 5  # f (= hard), current, fifo, null, sock
        kvfs.remount()
    assert errno_of(os.link, root / "models", root / "dirlink") == errno.EPERM
    assert errno_of(os.symlink, "x", root / "hard") == errno.EEXIST
    os.symlink("loop", root / "loop")
    assert errno_of(os.stat, root / "loop") == errno.ELOOP
    assert errno_of(os.stat, root / "current" / "nothing") == errno.ENOENT
    sh("rm", str(root / "models" / "f"))
    assert (root / "hard").read_bytes() == b"x" * MiB
    assert os.stat(root / "hard").st_nlink == 1
    sh("rm", str(root / "hard"))
    assert stats(root)["used_bytes"] == 0


def test_name_limits_and_lmcache_names(kvfs) -> None:
    root = kvfs.mountpoint
    names = [
        "a" * 255,
        "meta-llama-SEP-Llama-3.1-8B@1@0@-33f9a1b2c3d4e5f6@float16.data",
        "-leading-dash%20@and@at.pt",
        "sp ace\ttab\u00e9\u4e2d",
    ]
    for name in names:
        (root / name).write_bytes(name.encode())
    assert sorted(os.listdir(root)) == sorted(names)
    for name in names:
        assert (root / name).read_bytes() == name.encode()
    assert errno_of(open, root / ("b" * 256), "wb") == errno.ENAMETOOLONG
    assert errno_of(os.stat, root / ("b" * 256)) == errno.ENAMETOOLONG
    assert errno_of(os.mkdir, root / ("c" * 300)) == errno.ENAMETOOLONG


def test_readdir_of_many_entries_is_complete(kvfs) -> None:
    directory = kvfs.mountpoint / "many"
    directory.mkdir()
    count = 12_000
    for index in range(count):
        os.close(os.open(directory / f"chunk-{index:06d}.data", os.O_CREAT | os.O_WRONLY, 0o644))
    names = os.listdir(directory)
    assert len(names) == count == len(set(names))
    assert int(sh("sh", "-c", f"ls -f '{directory}' | grep -c chunk")) == count
    # Removing entries while listing must not make the listing skip survivors.
    survivors = set()
    with os.scandir(directory) as entries:
        for index, entry in enumerate(entries):
            if index % 2 == 0:
                os.unlink(entry.path)
            else:
                survivors.add(entry.name)
    assert set(os.listdir(directory)) == survivors


def test_a_walk_of_a_wide_tree_looks_up_no_directory(kvfs) -> None:
    """`du` of a tree whose top holds 2,500 directories: the top's whole listing comes in
    its first READDIRPLUS, attributes included (kvfs tells glibc a 1 MiB buffer for such a
    directory), so no subdirectory is looked up; with 256 KiB, a third of them were."""
    top = kvfs.mountpoint / "top"
    top.mkdir()
    for index in range(2_500):
        (top / f"{index:03x}").mkdir()
    (top / "000" / "chunk").write_bytes(b"k" * 8192)
    kvfs.remount()
    drop_caches()
    before = stats(kvfs.mountpoint)["requests"]["lookup"]["count"]
    assert sh("du", "-s", "--block-size=1", str(top)).split()[0] == "8192"
    looked_up = stats(kvfs.mountpoint)["requests"]["lookup"]["count"] - before
    assert looked_up < 10, f"{looked_up} lookups for a walk of 2,500 directories"


def test_close_to_open_isolation(make_mount) -> None:
    """Daemon-served reads: a writer and readers of one inode at once. (With passthrough a
    writer waits for passthrough readers instead: test_passthrough.py.)"""
    kvfs = make_mount("--passthrough", "off")
    path = kvfs.mountpoint / "chunk"
    path.write_bytes(b"A" * MiB)
    reader = open(path, "rb")
    writer = open(path, "r+b")
    writer.write(b"B" * MiB)
    writer.flush()
    # Uncommitted writes are invisible to other opens, old readers keep their snapshot.
    assert path.read_bytes() == b"A" * MiB
    assert reader.read(10) == b"A" * 10
    writer.close()
    assert path.read_bytes() == b"B" * MiB
    reader.seek(0)
    assert reader.read() == b"A" * MiB
    reader.close()
    assert path.read_bytes() == b"B" * MiB


def test_concurrent_writers_last_close_wins(kvfs) -> None:
    path = kvfs.mountpoint / "chunk.tmp"
    first = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    second = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for piece in range(8):
        os.write(first, b"1" * (MiB // 2))
        os.write(second, b"2" * (MiB // 3) if piece % 2 else b"2" * MiB)
    os.close(second)
    second_content = path.read_bytes()
    os.close(first)
    assert set(second_content) == {ord("2")}
    assert path.read_bytes() == b"1" * (4 * MiB)


def test_open_file_survives_unlink_and_rename_over(kvfs) -> None:
    root = kvfs.mountpoint
    (root / "victim").write_bytes(b"v" * (3 * MiB))
    (root / "target").write_bytes(b"t" * (2 * MiB))
    victim = open(root / "victim", "rb")
    target = open(root / "target", "rb")
    os.unlink(root / "victim")
    (root / "new.tmp").write_bytes(b"n" * MiB)
    os.rename(root / "new.tmp", root / "target")
    assert victim.read() == b"v" * (3 * MiB)
    assert target.read() == b"t" * (2 * MiB)
    assert os.fstat(victim.fileno()).st_size == 3 * MiB
    victim.close()
    target.close()
    assert (root / "target").read_bytes() == b"n" * MiB
    assert sorted(os.listdir(root)) == ["target"]


def o_direct_round_trip(root: Path, offset: int) -> tuple:
    """An O_DIRECT write then read of 4 MiB from buffers `offset` bytes past a page."""
    path = root / "direct.pt"
    payload = os.urandom(4 * MiB)
    buffer = mmap.mmap(-1, 4 * MiB + 4096)
    buffer[offset:offset + 4 * MiB] = payload
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        written = attempt(os.write, fd, memoryview(buffer)[offset:offset + 4 * MiB])
    finally:
        os.close(fd)
    buffer[:] = bytes(len(buffer))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        read = attempt(os.readv, fd, [memoryview(buffer)[offset:offset + 4 * MiB]])
    finally:
        os.close(fd)
    same = buffer[offset:offset + 4 * MiB] == payload
    path.unlink()
    return written, read, same


def attempt(call, *args) -> object:
    try:
        return call(*args)
    except OSError as error:
        return errno.errorcode[error.errno]


@pytest.mark.parametrize("offset", [0, 512, 64])
def test_o_direct_as_on_the_plain_directory(make_mount, tmp_path: Path, offset: int) -> None:
    """O_DIRECT goes through the kernel to the volume: page- and sector-aligned buffers
    work, a buffer 64 bytes off is refused (EINVAL) exactly as on the plain directory.
    (A pool big enough for kernel writers: in small ones kvfs serves writes itself.)"""
    kvfs = make_mount("--capacity", "8G")
    assert o_direct_round_trip(kvfs.mountpoint, offset) == o_direct_round_trip(tmp_path, offset)
    if offset % 512 == 0:
        assert o_direct_round_trip(kvfs.mountpoint, offset) == (4 * MiB, 4 * MiB, True)


def test_o_direct_through_the_daemon_takes_any_alignment(make_mount) -> None:
    """--odirect daemon: kvfs serves O_DIRECT opens itself, unaligned buffers too."""
    kvfs = make_mount("--capacity", "1G", "--odirect", "daemon")
    assert o_direct_round_trip(kvfs.mountpoint, 64) == (4 * MiB, 4 * MiB, True)
    shown = stats(kvfs.mountpoint)
    assert shown["opens_passthrough"] == shown["write_opens_passthrough"] == 0


FALLOC = {"0": 0, "KEEP_SIZE": 0x01, "PUNCH_HOLE": 0x03, "ZERO_RANGE": 0x10}
# The kernel's FUSE refuses these itself (fs/fuse/file.c: EOPNOTSUPP), whatever the daemon.
FALLOC_NOT_IN_FUSE = {"COLLAPSE_RANGE": 0x08, "INSERT_RANGE": 0x20}


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if LIBC.fallocate(fd, mode, ctypes.c_long(offset), ctypes.c_long(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@pytest.mark.parametrize("beside_a_reader", [False, True], ids=["kernel-writer", "served"])
@pytest.mark.parametrize("mode", sorted(FALLOC))
def test_fallocate_as_on_the_plain_directory(kvfs, tmp_path: Path, mode: str,
                                             beside_a_reader: bool) -> None:
    """Each fallocate mode, by a writer alone on its file (the kernel writes) and by one
    beside a reader (kvfs serves it): the same answers, size and bytes as ext4's."""
    outcomes = {}
    original = os.urandom(3 * MiB)
    for root in (kvfs.mountpoint, tmp_path):
        path = root / "f"
        path.write_bytes(original)
        reader = os.open(path, os.O_RDONLY) if beside_a_reader else None
        fd = os.open(path, os.O_RDWR)
        seen = [attempt(fallocate, fd, FALLOC[mode], MiB, 2 * 4096),
                attempt(fallocate, fd, FALLOC[mode], 3 * MiB - 4096, MiB),
                attempt(fallocate, fd, FALLOC[mode], 5, 100), os.fstat(fd).st_size]
        os.close(fd)
        if reader is not None:
            if root == kvfs.mountpoint:  # close-to-open: its version, unchanged
                assert os.pread(reader, 10, 0) == original[:10]
            os.close(reader)
        seen.append(path.read_bytes())
        outcomes[root] = seen
    assert outcomes[kvfs.mountpoint] == outcomes[tmp_path]
    assert stats(kvfs.mountpoint)["handler_errors"] == 0


@pytest.mark.parametrize("mode", sorted(FALLOC_NOT_IN_FUSE))
def test_fallocate_modes_fuse_lacks_are_refused_cleanly(kvfs, mode: str) -> None:
    path = kvfs.mountpoint / "f"
    path.write_bytes(b"k" * (3 * MiB))
    fd = os.open(path, os.O_RDWR)
    try:
        assert attempt(fallocate, fd, FALLOC_NOT_IN_FUSE[mode], MiB, MiB) == "ENOTSUP"
    finally:
        os.close(fd)
    assert path.read_bytes() == b"k" * (3 * MiB)


@pytest.mark.parametrize("within_one_file", [True, False])
def test_copy_file_range_as_on_the_plain_directory(kvfs, tmp_path: Path,
                                                   within_one_file: bool) -> None:
    """copy_file_range within one open file and between files, uncommitted bytes included;
    each call must return (not stall) with ext4's answer."""
    outcomes = {}
    original = os.urandom(2 * MiB + 5)
    for root in (kvfs.mountpoint, tmp_path):
        source = os.open(root / "a", os.O_RDWR | os.O_CREAT, 0o644)
        os.write(source, original)  # not yet committed
        target = source if within_one_file else os.open(root / "b", os.O_RDWR | os.O_CREAT,
                                                        0o644)
        calls = [(MiB, 0, 3 * MiB), (4096, 0, 2 * MiB), (100, 10, MiB + 3), (MiB, 5, 2 * MiB)]
        with ThreadPoolExecutor(1) as pool:
            seen = [pool.submit(attempt, os.copy_file_range, source, target, length, src,
                                dst).result(timeout=30) for length, src, dst in calls]
        seen.append(os.fstat(target).st_size)
        for fd in {source, target}:
            os.close(fd)
        seen += [(root / name).read_bytes() for name in ("a", "b") if (root / name).exists()]
        outcomes[root] = seen
    assert outcomes[kvfs.mountpoint] == outcomes[tmp_path]


def test_capacity_is_enforced(make_mount) -> None:
    kvfs = make_mount("--capacity", "8M")
    path = kvfs.mountpoint / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"x" * (6 * MiB))
    short = os.write(fd, b"y" * (3 * MiB))  # a short write: what fits
    assert 0 < short <= 2 * MiB
    assert errno_of(os.write, fd, b"y" * MiB) == errno.ENOSPC
    os.close(fd)
    assert path.stat().st_size == 6 * MiB + short
    assert os.statvfs(kvfs.mountpoint).f_bfree * 4096 <= 2 * MiB - short
    path.unlink()
    (kvfs.mountpoint / "g").write_bytes(b"z" * (7 * MiB))  # room again


def test_hostile_requests_leave_the_mount_alive(kvfs) -> None:
    root = kvfs.mountpoint
    path = root / "f"
    path.write_bytes(b"data")
    assert errno_of(os.truncate, path, (1 << 63) - 1) in (errno.EFBIG, errno.ENOSPC,
                                                          errno.EINVAL)
    fd = os.open(path, os.O_RDWR)
    assert errno_of(os.pwrite, fd, b"x", (1 << 62)) in (errno.EFBIG, errno.ENOSPC)
    assert errno_of(os.pwrite, fd, b"x", (1 << 63) - 1) in (errno.EFBIG, errno.EINVAL)
    assert os.pread(fd, 10, 1 << 62) == b""
    os.close(fd)
    assert errno_of(os.setxattr, path, "user.big", b"v" * MiB) in (errno.E2BIG, errno.ENOSPC)
    assert errno_of(os.listdir, path) == errno.ENOTDIR
    assert errno_of(open, root / "gone" / "x", "wb") == errno.ENOENT
    assert errno_of(os.rename, root / "gone", root / "x") == errno.ENOENT
    vanished = root / "vanished"
    vanished.write_bytes(b"x")
    fd = os.open(vanished, os.O_RDONLY)
    os.unlink(vanished)
    assert errno_of(os.chmod, vanished, 0o600) == errno.ENOENT
    assert os.read(fd, 10) == b"x"
    os.close(fd)
    assert path.read_bytes() == b"data"  # still alive and unchanged


def shared_temp_writer(temp: Path, final: Path, payload: bytes, opened, go, done) -> None:
    """One LMCache-like writer process: open <key>.tmp, write, then on `go` close and rename;
    exits 0 when its rename succeeded, 2 when the name was already renamed away (ENOENT)."""
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, payload)
    opened.set()
    go.wait(30)
    os.close(fd)
    try:
        os.rename(temp, final)
        code = 0
    except FileNotFoundError:
        code = 2
    done.set()
    os._exit(code)


@pytest.mark.parametrize("close_both_first", [False, True])
def test_writers_sharing_a_temp_name_leave_one_whole_chunk(kvfs, close_both_first: bool) -> None:
    """LMCache's fs plugin: every writer of a chunk writes `<key>.tmp`, closes, renames it to
    `<key>.data`. With two processes at once, both write one file (the same inode); the first
    rename moves it, the second finds no `<key>.tmp` (ENOENT, as on any filesystem: nobody
    sees a name after it was renamed away). The chunk is whole: one writer's bytes."""
    context = multiprocessing.get_context("fork")
    root = kvfs.mountpoint
    temp, final = root / "key.tmp", root / "key.data"
    events = [[context.Event() for _ in range(3)] for _ in range(2)]
    writers = [context.Process(target=shared_temp_writer,
                               args=(temp, final, str(n + 1).encode() * MiB, *events[n]))
               for n in range(2)]
    for writer, (opened, _, _) in zip(writers, events, strict=True):
        writer.start()
        assert opened.wait(30)
    for _, go, done in events:
        go.set()
        if not close_both_first:
            assert done.wait(30)
    for writer in writers:
        writer.join(30)
    assert sorted(writer.exitcode for writer in writers) == [0, 2]
    assert final.read_bytes() in (b"1" * MiB, b"2" * MiB)
    assert os.listdir(root) == ["key.data"]
    assert errno_of(os.stat, temp) == errno.ENOENT


def test_a_renamed_away_name_is_gone_at_once_for_everyone(kvfs) -> None:
    """The shell that wrote both names, and every other process, stop seeing the old name
    the moment rename returns."""
    root = kvfs.mountpoint
    sh("sh", "-c", f"echo first > {root / 'x'}; echo second > {root / 'y'}; "
                   f"mv {root / 'y'} {root / 'x'}; test ! -e {root / 'y'}")
    assert errno_of(os.stat, root / "y") == errno.ENOENT
    assert (root / "x").read_text() == "second\n"
    assert os.listdir(root) == ["x"]


def test_a_renamed_name_is_free_for_a_new_file_at_once(kvfs) -> None:
    """One process writing twice, renaming, and creating the old name again gets a new file."""
    root = kvfs.mountpoint
    (root / "a").write_bytes(b"first")
    with open(root / "a", "ab") as appender:
        appender.write(b"+more")
    os.rename(root / "a", root / "b")
    (root / "a").write_bytes(b"NEW")
    assert (root / "b").read_bytes() == b"first+more"
    assert (root / "a").read_bytes() == b"NEW"


def test_one_directory_looked_up_listed_and_changed_by_many_threads_at_once(kvfs) -> None:
    """16 threads at once stat existing and missing names, list the directory and store
    files into it (temporary name, rename), dentries dropped between rounds: every stat and
    every listing agrees with what the directory holds at that moment."""
    directory = kvfs.mountpoint / "d"
    directory.mkdir()
    stable = [f"f{number:04d}" for number in range(1000)]
    for number, name in enumerate(stable):
        (directory / name).write_bytes(b"x" * (number % 97))

    def stat_existing(worker: int) -> None:
        for number in range(worker, len(stable), 8):
            assert (directory / stable[number]).stat().st_size == number % 97

    def stat_missing(worker: int) -> None:
        for number in range(worker, 400, 4):
            assert errno_of(os.stat, directory / f"missing{number}") == errno.ENOENT

    def listing(worker: int) -> None:
        for _ in range(3):
            names = set(os.listdir(directory))
            assert names.issuperset(stable)
            assert not {name for name in names if name.startswith("missing")}

    def store(worker: int) -> None:
        for number in range(40):
            final = directory / f"s{worker}-{number}"
            temporary = directory / f"s{worker}-{number}.tmp"
            temporary.write_bytes(b"s" * number)
            os.replace(temporary, final)
            assert final.stat().st_size == number

    for _ in range(3):
        drop_caches()
        with ThreadPoolExecutor(16) as pool:
            work = ([pool.submit(stat_existing, worker) for worker in range(8)]
                    + [pool.submit(stat_missing, worker) for worker in range(4)]
                    + [pool.submit(listing, worker) for worker in range(2)]
                    + [pool.submit(store, worker) for worker in range(2)])
            for done in work:
                done.result()
        names = set(os.listdir(directory))
        assert names == set(stable) | {f"s{w}-{n}" for w in range(2) for n in range(40)}
