"""Crashes and corruption: what survives an unmount, a kill -9, and damage behind kvfs's back.

The kill -9 test runs writer and reader processes (this file, run as a script: see
`worker_main`) whose content is self-verifying: a header naming the file, its version and
length, and a hash of the body. After the crash every visible file must be one whole version,
the versions must agree with what the writers logged, and no byte may leak on the volume.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import (
    KvfsMount,
    allocated,
    assert_only_spares_staged,
    blob_files,
    drop_caches,
    is_mounted,
    keeper_pid,
    kvfs_cli,
    pid_alive,
    run_mount,
    stats,
    wait_dead,
    wait_for,
)

MiB = 1 << 20


# -- helpers -----------------------------------------------------------------------------


def statvfs_used(mountpoint: Path) -> int:
    st = os.statvfs(mountpoint)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def round_up(size: int, unit: int = 4096) -> int:
    return -(-size // unit) * unit


CONTROL_DIR = ".kvfs"  # kvfs's own virtual files (live stats): no data on the volume


def walk_data(root: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """os.walk of a mount, without kvfs's control directory."""
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root and CONTROL_DIR in dirnames:
            dirnames.remove(CONTROL_DIR)
        yield dirpath, dirnames, filenames


def visible_files(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under root."""
    found = {}
    for dirpath, _, filenames in walk_data(root):
        for name in filenames:
            path = Path(dirpath) / name
            found[str(path.relative_to(root))] = path.stat().st_size
    return found


def assert_no_leak(volume: KvfsMount) -> None:
    """Data on the volume == usage kvfs reports == what the namespace shows, once the data
    files of what was just dropped are deleted (the reaper does that in a worker thread)."""
    def blob_and_visible_bytes() -> tuple[int, int]:
        on_volume = 0
        for path in blob_files(volume):
            with contextlib.suppress(FileNotFoundError):  # deleted since it was listed
                on_volume += path.stat().st_size
        return on_volume, sum(visible_files(volume.mountpoint).values())

    wait_for(lambda: len(set(blob_and_visible_bytes())) == 1)
    on_volume, visible = blob_and_visible_bytes()
    assert on_volume == visible, f"{on_volume} bytes of blob files, {visible} bytes visible"
    assert statvfs_used(volume.mountpoint) == round_up(
        sum(allocated(p) for p in blob_files(volume)))
    assert_only_spares_staged(volume.data, volume)


def fsck_clean(volume: KvfsMount) -> None:
    assert not is_mounted(volume.mountpoint)
    result = kvfs_cli("fsck", "--data", str(volume.data))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean" in result.stderr + result.stdout


# -- persistence -------------------------------------------------------------------------


SIZES = [0, 1, 4095, 4096, MiB - 1, MiB, MiB + 1, 3 * MiB + 17, 40 * MiB]


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything a remount must preserve, per path: type, mode, mtime, size, digest, xattrs."""
    result: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in walk_data(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            digest = hashlib.blake2b(path.read_bytes()).hexdigest() if path.is_file() else None
            xattrs = {attr: os.getxattr(path, attr) for attr in sorted(os.listxattr(path))}
            result[str(path.relative_to(root))] = (
                st.st_mode, st.st_mtime_ns, st.st_size, digest, xattrs)
    return result


def test_files_survive_remount_bit_exactly(kvfs: KvfsMount) -> None:
    root = kvfs.mountpoint
    rng = random.Random(1)
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    dirs = [root, root / "a", root / "a" / "b", root / "a" / "b" / "c"]
    for index, size in enumerate(SIZES):
        path = dirs[index % len(dirs)] / f"file-{index}-{size}"
        with open(path, "wb", buffering=0) as f:
            remaining = os.urandom(size)
            view = memoryview(remaining)
            while view:  # uneven pieces, like a real writer
                piece = rng.randint(1, 3 * MiB)
                f.write(view[:piece])
                view = view[piece:]
        os.setxattr(path, "user.kv.index", str(index).encode())
        if index % 2:
            os.setxattr(path, "user.kv.blob", os.urandom(rng.randint(0, 4000)))
        if index % 3 == 0:
            os.chmod(path, 0o600 + index % 8)
        if index % 4 == 0:
            os.utime(path, ns=(1_600_000_000_123_456_789 + index, 1_500_000_000_987_654_321))
    os.setxattr(root / "a", "user.dir", b"on a directory")
    os.chmod(root / "a" / "b", 0o711)
    os.utime(root / "empty-dir", ns=(1_400_000_000_000_000_001, 1_400_000_000_000_000_002))
    # What a user sees before the remount, after the kernel's caches are gone.
    drop_caches()
    before = snapshot(root)
    assert len(before) == len(SIZES) + 4
    kvfs.remount()
    after = snapshot(root)
    assert after.keys() == before.keys()
    for path in before:
        assert after[path] == before[path], path
    assert_no_leak(kvfs)
    kvfs.unmount()
    fsck_clean(kvfs)


def test_stat_right_after_close_matches_after_remount(kvfs: KvfsMount) -> None:
    """What stat shows right after close (no cache drop) is what the volume keeps."""
    paths = []
    for index in range(5):
        path = kvfs.mountpoint / f"f{index}"
        with open(path, "wb") as f:
            f.write(os.urandom(100_000 + index))
            time.sleep(0.02)  # let the commit's mtime differ from the create's
        paths.append(path)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}
    kvfs.remount()
    after = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}
    assert after == before


# -- kill -9 under load ------------------------------------------------------------------

MAGIC = b"KVFSTEST"
HEADER = struct.Struct("<8s32sQQ32s")  # magic, name digest, version, total length, body digest


def name_digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def make_content(name: str, version: int, length: int) -> bytes:
    body = os.urandom(max(0, length - HEADER.size))
    header = HEADER.pack(MAGIC, name_digest(name), version, HEADER.size + len(body),
                         hashlib.sha256(body).digest())
    return header + body


class LengthError(ValueError):
    """The header is this file's, but the content read is longer or shorter than it says."""


def parse_content(name: str, content: bytes) -> int:
    """The version a whole, correct content holds; raises ValueError for anything else."""
    if len(content) < HEADER.size:
        raise ValueError(f"{name}: {len(content)} bytes, shorter than a header")
    magic, owner, version, length, digest = HEADER.unpack_from(content)
    if magic != MAGIC or owner != name_digest(name):
        raise ValueError(f"{name}: not this file's header")
    if length != len(content):
        raise LengthError(f"{name}: header says {length} bytes, file has {len(content)}")
    if hashlib.sha256(content[HEADER.size:]).digest() != digest:
        raise ValueError(f"{name}: body does not match its digest (version {version})")
    return version


def writer(root: Path, ident: str, first_version: int, log: Path) -> None:
    """Rewrite this writer's files in a loop, logging each version before open, after close."""
    rng = random.Random(f"{ident}-{first_version}")
    mine = root / ident
    mine.mkdir(exist_ok=True)
    version = first_version
    with open(log, "a", buffering=1) as journal:
        while True:
            version += 1
            name = f"{ident}/f{rng.randrange(4)}"
            content = make_content(name, version, rng.randint(HEADER.size, 4 * MiB))
            via_rename = rng.random() < 0.4
            target = root / name
            path = target.with_suffix(".tmp") if via_rename else target
            journal.write(f"start {name} {version}\n")
            with open(path, "wb", buffering=0) as f:
                view = memoryview(content)
                while view:
                    piece = rng.choice([4096, 65536, 200_000, 1 << 20, 1_500_000])
                    f.write(view[:piece])
                    view = view[piece:]
            if via_rename:
                os.rename(path, target)
            journal.write(f"done {name} {version}\n")


def reader(root: Path, log: Path) -> None:
    """Read whatever is there; every file must be one whole version (or empty: not written)."""
    with open(log, "a", buffering=1) as journal:
        while True:
            for dirpath, _, filenames in walk_data(root):
                for filename in filenames:
                    if filename.endswith(".tmp"):
                        continue
                    path = Path(dirpath) / filename
                    try:
                        content = path.read_bytes()
                    except FileNotFoundError:
                        continue
                    journal.write("read\n")
                    if content:
                        try:
                            parse_content(str(path.relative_to(root)), content)
                        except LengthError as error:
                            # Known bug (see test_open_reader_is_not_cut_by_inplace_rewrite):
                            # a concurrent in-place rewrite changes the size this reader sees.
                            journal.write(f"SIZE {error}\n")
                        except ValueError as error:
                            # A read cut short by the kill is the kernel's doing, not kvfs's:
                            # judge only reads the daemon survived.
                            alive = _mount_alive(root)
                            journal.write(f"{'BAD' if alive else 'cut'} {error}\n")


def _mount_alive(root: Path) -> bool:
    try:
        os.statvfs(root)
    except OSError:
        return False
    return True


def worker_main(argv: list[str]) -> None:
    role, root, log = argv[0], Path(argv[1]), Path(argv[-1])
    try:
        if role == "writer":
            writer(root, argv[2], int(argv[3]), log)
        else:
            reader(root, log)
    except OSError as error:  # the daemon is gone: ENOTCONN, ECONNABORTED, ...
        with open(log, "a") as journal:
            journal.write(f"exit {errno.errorcode.get(error.errno or 0, error.errno)}\n")


class Workers:
    def __init__(self, root: Path, logs: Path) -> None:
        self.root = root
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str) -> None:
        log = self.logs / f"{'-'.join(args)}.log"
        self.procs.append(subprocess.Popen(
            [sys.executable, __file__, *args[:1], str(self.root), *args[1:], str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    def busy(self, writers: int) -> bool:
        """Every writer has closed a file and the reader has read one."""
        logs = [log.read_text() for log in self.logs.glob("*.log")]
        return (sum("\ndone " in "\n" + text for text in logs) >= writers
                and any("read\n" in text for text in logs))

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=20)
        self.procs.clear()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[[Path], Workers]]:
    made: list[Workers] = []

    def factory(root: Path) -> Workers:
        logs = tmp_path / "logs"
        logs.mkdir(exist_ok=True)
        made.append(Workers(root, logs))
        return made[-1]

    yield factory
    for group in made:
        group.kill()


def journal_versions(logs: Path) -> tuple[dict[str, int], dict[str, int], int, list[str]]:
    """(last closed version per name, last started version per name, reads, reader errors)."""
    done: dict[str, int] = {}
    started: dict[str, int] = {}
    reads = 0
    bad = []
    for log in logs.glob("*.log"):
        for line in log.read_text().splitlines():
            if line.startswith("done "):
                _, name, version = line.split()
                done[name] = max(done.get(name, 0), int(version))
            elif line.startswith("start "):
                _, name, version = line.split()
                started[name] = max(started.get(name, 0), int(version))
            elif line == "read":
                reads += 1
            elif line.startswith("BAD"):
                bad.append(line)
    return done, started, reads, bad


WRITERS = 3


@pytest.mark.timeout(180)
def test_kill9_under_load_recovers_consistently(
        make_mount: Callable[..., KvfsMount], workers: Callable[[Path], Workers]) -> None:
    volume = make_mount("--capacity", "2G")
    root = volume.mountpoint
    # The moment of the kill, and how the volume is brought back, vary by round.
    rounds = [(0.05, "remount"), (1.2, "fsck"), (0.5, "remount"), (2.0, "remount")]
    for number, (run_for, recovery) in enumerate(rounds):
        group = workers(root)
        for index in range(WRITERS):
            group.start("writer", f"w{index}", str(number * 1_000_000))
        group.start("reader")
        assert wait_for(lambda: group.busy(WRITERS), timeout=30), "workers did not start"  # noqa: B023
        time.sleep(run_for)
        # Kill the daemon (and its keeper, which would hold the workers' requests for a
        # successor), then the workers, and only then clear the dead mount: a worker still
        # running after the unmount would write into the bare mountpoint directory.
        keeper = keeper_pid(root)
        os.kill(keeper, signal.SIGKILL)
        os.kill(volume.pid, signal.SIGKILL)
        assert wait_dead(volume.pid) and wait_dead(keeper)
        group.kill()
        volume.pid = 0
        subprocess.run(["fusermount3", "-u", "-z", str(root)], check=True)
        if recovery == "fsck":
            result = kvfs_cli("fsck", "--data", str(volume.data), "--repair")
            assert result.returncode == 0, result.stderr
        volume.mount()
        assert stats(root)["claimed_bytes"] == 0  # (the killed daemon's claim went)
        done, started, reads, bad = journal_versions(group.logs)
        assert not bad, bad
        assert_only_spares_staged(volume.data, volume)
        files = visible_files(root)
        for relative, size in files.items():
            content = (root / relative).read_bytes()
            assert len(content) == size
            if relative.endswith(".tmp"):  # its writer never renamed it
                name = relative.removesuffix(".tmp")
                if content:
                    assert parse_content(name, content) <= started[name]
                continue
            if not content:  # created or truncated by a writer that had not closed yet
                assert started[relative] > done.get(relative, 0), f"{relative}: emptied"
                continue
            version = parse_content(relative, content)
            assert done.get(relative, 0) <= version <= started[relative], (
                f"round {number}: {relative} holds version {version}, closed "
                f"{done.get(relative)} started {started[relative]}")
        for name in done:  # everything closed is still there
            assert name in files, f"round {number}: {name} was closed but is gone"
        assert_no_leak(volume)
        assert reads, "the reader never read anything: the round proved little"
    volume.unmount()
    fsck_clean(volume)


# -- corruption behind kvfs's back -------------------------------------------------------


@pytest.fixture
def three_files(kvfs: KvfsMount) -> dict[str, tuple[Path, bytes]]:
    """Three files, never read through kvfs (so no cache holds them): name -> (blob, data)."""
    made = {}
    for name, size in (("victim", 3 * MiB + 5), ("other", 2 * MiB), ("small", 70_000)):
        data = os.urandom(size)
        before = set(blob_files(kvfs))
        (kvfs.mountpoint / "d").mkdir(exist_ok=True)
        (kvfs.mountpoint / "d" / name).write_bytes(data)
        (blob,) = set(blob_files(kvfs)) - before
        assert blob.stat().st_size == size
        made[name] = (blob, data)
    return made


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def make_kvfs_read_from_volume(volume: KvfsMount, how: str) -> None:
    if how == "remount":
        volume.remount()
    else:
        drop_caches()


def assert_victim_dropped(volume: KvfsMount, files: dict[str, tuple[Path, bytes]]) -> None:
    daemon = volume.pid
    directory = volume.mountpoint / "d"
    # The mount is alive and the other files are intact.
    for name in ("other", "small"):
        assert (directory / name).read_bytes() == files[name][1]
    # The damaged file is gone, so LMCache sees a miss rather than an error.
    assert wait_for(lambda: "victim" not in os.listdir(directory))
    assert wait_for(lambda: not (directory / "victim").exists())
    assert pid_alive(daemon)
    assert_no_leak(volume)
    # Its name is usable again.
    (directory / "victim").write_bytes(b"fresh")
    assert (directory / "victim").read_bytes() == b"fresh"
    volume.unmount()
    fsck_clean(volume)


@pytest.mark.parametrize("how", ["drop_caches", "remount"])
@pytest.mark.parametrize("offset", [0, 3 * MiB + 4])
def test_flipped_byte_gives_eio_and_drops_file(kvfs: KvfsMount,
                                               three_files: dict[str, tuple[Path, bytes]],
                                               how: str, offset: int) -> None:
    flip_byte(three_files["victim"][0], offset)
    assert_victim_unreadable(kvfs, three_files, how, errno.EIO)


def assert_victim_unreadable(kvfs: KvfsMount, three_files: dict[str, tuple[Path, bytes]],
                             how: str, *codes: int) -> None:
    """Reading the damaged victim fails with one of `codes`, and the file is dropped."""
    make_kvfs_read_from_volume(kvfs, how)
    with pytest.raises(OSError) as caught:
        (kvfs.mountpoint / "d" / "victim").read_bytes()
    assert caught.value.errno in codes
    assert_victim_dropped(kvfs, three_files)


@pytest.mark.parametrize("how", ["drop_caches", "remount"])
def test_truncated_blob_gives_eio_and_drops_file(kvfs: KvfsMount,
                                                 three_files: dict[str, tuple[Path, bytes]],
                                                 how: str) -> None:
    os.truncate(three_files["victim"][0], MiB + 100)
    assert_victim_unreadable(kvfs, three_files, how, errno.EIO)


@pytest.mark.parametrize("how", ["drop_caches", "remount"])
def test_deleted_blob_gives_enoent_or_eio_and_drops_file(
        kvfs: KvfsMount, three_files: dict[str, tuple[Path, bytes]], how: str) -> None:
    three_files["victim"][0].unlink()
    assert_victim_unreadable(kvfs, three_files, how, errno.ENOENT, errno.EIO)


def test_corruption_under_an_open_reader_never_serves_bad_bytes(
        kvfs: KvfsMount, three_files: dict[str, tuple[Path, bytes]]) -> None:
    """With --verify always, damage found while a handle reads: it gets the verified bytes
    (cached) or EIO. (With passthrough, bytes are verified at open only: README, *Data
    path*; test_passthrough.py shows that window.)"""
    kvfs.remount("--verify", "always")
    victim = kvfs.mountpoint / "d" / "victim"
    original = three_files["victim"][1]
    with open(victim, "rb", buffering=0) as f:
        assert f.read(4096) == original[:4096]
        flip_byte(three_files["victim"][0], 2 * MiB + 1)
        drop_caches()
        f.seek(2 * MiB)
        try:
            got = f.read(MiB)
        except OSError as error:
            assert error.errno == errno.EIO
        else:
            assert got == original[2 * MiB: 3 * MiB]
    for name in ("other", "small"):
        assert (kvfs.mountpoint / "d" / name).read_bytes() == three_files[name][1]
    kvfs.unmount()
    result = kvfs_cli("fsck", "--data", str(kvfs.data), "--repair")
    assert result.returncode == 0


# -- damaged metadata --------------------------------------------------------------------


def _garbage_everything(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _garbage_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(os.urandom(8192))


def _garbage_short(path: Path) -> None:
    path.write_bytes(b"this is not an lmdb file\n" * 10)


@pytest.mark.parametrize("damage", [_garbage_everything, _garbage_header, _garbage_short])
def test_damaged_metadata_fails_mount_with_one_line(make_mount: Callable[..., KvfsMount],
                                                    damage: Callable[[Path], None]) -> None:
    volume = make_mount("--capacity", "1G")
    (volume.mountpoint / "f").write_bytes(os.urandom(50_000))
    volume.unmount()
    damage(volume.data / "meta" / "data.mdb")
    started = time.monotonic()
    result = run_mount(volume.mountpoint, volume.data)  # times out (fails) after 60 s
    assert time.monotonic() - started < 20
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "fsck" in lines[0]
    assert not is_mounted(volume.mountpoint)
    # No daemon is left behind holding the volume.
    pid_text = (volume.data / "kvfs.lock").read_text().strip()
    if pid_text:
        assert wait_dead(int(pid_text), 5)
    # fsck says the same in one line rather than a traceback.
    check = kvfs_cli("fsck", "--data", str(volume.data), timeout=20)
    assert check.returncode != 0
    assert len(check.stderr.splitlines()) == 1, check.stderr
    assert "Traceback" not in check.stderr


def test_open_reader_is_not_cut_by_inplace_rewrite(make_mount) -> None:
    """Daemon-served reads (with passthrough the writer waits: test_passthrough.py)."""
    kvfs = make_mount("--passthrough", "off")
    path = kvfs.mountpoint / "f"
    old = os.urandom(3 * MiB)
    path.write_bytes(old)
    with open(path, "rb", buffering=0) as reader, open(path, "wb", buffering=0) as writer:
        writer.write(b"x" * MiB)  # uncommitted: the writer has not closed
        os.stat(path)  # anyone's stat refreshes the kernel's idea of the size
        assert reader.read() == old


if __name__ == "__main__":
    worker_main(sys.argv[1:])
