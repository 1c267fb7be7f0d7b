"""The command line through real processes: mount_kvfs.py, `kvfs umount`, `kvfs fsck`.

Every failure the CLI reports must be one line on stderr and a non-zero exit; every success
must mean what it says (a returned mount is live, a returned umount has no daemon left).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import (
    MOUNT_SCRIPT,
    KvfsMount,
    allocated,
    blob_files,
    daemon_pid,
    is_mounted,
    kvfs_cli,
    pid_alive,
    run_mount,
    wait_dead,
    wait_for,
)

GiB = 1 << 30


# -- helpers -----------------------------------------------------------------------------


def one_line_error(result: subprocess.CompletedProcess, *phrases: str) -> str:
    """Assert a failed command said why in exactly one line that contains each phrase."""
    assert result.returncode != 0, f"expected failure, got 0; stderr={result.stderr!r}"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    for phrase in phrases:
        assert phrase.lower() in lines[0].lower(), f"{phrase!r} not in {lines[0]!r}"
    return lines[0]


def capacity_of(mountpoint: Path) -> int:
    st = os.statvfs(mountpoint)
    return st.f_blocks * st.f_frsize


def mounted_daemons_of(data: Path) -> int | None:
    """The pid in DATA/kvfs.lock when that process is alive, else None."""
    lock = data / "kvfs.lock"
    if not lock.exists() or not lock.read_text().strip():
        return None
    pid = daemon_pid(data)
    return pid if pid_alive(pid) else None


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)



def only_blob(data: Path) -> Path:
    blobs = blob_files(data)
    assert len(blobs) == 1, blobs
    return blobs[0]


def flip_byte(path: Path, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def scratch_mounts() -> Iterator[list[tuple[Path, Path]]]:
    """(mountpoint, data) pairs mounted by a test directly; unmounted and reaped at teardown."""
    started: list[tuple[Path, Path]] = []
    yield started
    for mountpoint, data in started:
        pid = mounted_daemons_of(data) if (data / "kvfs.lock").exists() else None
        if is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        if pid is not None and not wait_dead(pid, 10):
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)


# -- mounting ----------------------------------------------------------------------------


def test_mount_returns_once_live_and_daemon_runs_in_background(
        tmp_path: Path, scratch_mounts: list[tuple[Path, Path]]) -> None:
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    scratch_mounts.append((mnt, data))
    result = run_mount(mnt, data, "--capacity", "3G")
    # Nothing may be waited for here: the mount must already be usable.
    st = os.statvfs(mnt)
    (mnt / "first").write_bytes(b"hello")
    assert result.returncode == 0, result.stderr
    assert st.f_blocks * st.f_frsize == 3 * GiB
    assert is_mounted(mnt)
    assert (mnt / "first").read_bytes() == b"hello"
    pid = daemon_pid(data)
    assert pid_alive(pid), "the daemon named in kvfs.lock is not running"
    # The daemon is detached: its own session, not the (exited) mount command.
    assert os.getsid(pid) == pid
    assert result.stdout == ""
    subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
    assert wait_dead(pid)
    assert "unmounted" in (data / "kvfs.log").read_text()


def _missing(tmp_path: Path) -> Path:
    return tmp_path / "nope"


def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "file"
    path.write_text("x")
    return path


def _not_empty(tmp_path: Path) -> Path:
    path = tmp_path / "full"
    path.mkdir()
    (path / "something").write_text("x")
    return path


@pytest.mark.parametrize(("make_mountpoint", "phrase"), [
    (_missing, "does not exist"),
    (_a_file, "not a directory"),
    (_not_empty, "not empty"),
])
def test_bad_mountpoint_is_one_line(tmp_path: Path, make_mountpoint: Callable[[Path], Path],
                                    phrase: str) -> None:
    mountpoint = make_mountpoint(tmp_path)
    data = tmp_path / "data"
    result = run_mount(mountpoint, data)
    one_line_error(result, phrase, str(mountpoint))
    assert not is_mounted(mountpoint)
    assert mounted_daemons_of(data) is None


def test_already_mounted_is_one_line(make_mount: Callable[..., KvfsMount],
                                     tmp_path: Path) -> None:
    first = make_mount("--capacity", "1G")
    result = run_mount(first.mountpoint, tmp_path / "other-data")
    one_line_error(result, "already mounted")
    assert pid_alive(first.pid)
    assert os.statvfs(first.mountpoint).f_blocks * 4096 == GiB


def test_data_dir_served_by_another_daemon_is_one_line(
        make_mount: Callable[..., KvfsMount], tmp_path: Path) -> None:
    first = make_mount("--capacity", "1G")
    (first.mountpoint / "kept").write_bytes(b"kept")
    second_mnt = tmp_path / "second"
    second_mnt.mkdir()
    result = run_mount(second_mnt, first.data)
    one_line_error(result, "already served", str(first.pid))
    assert not is_mounted(second_mnt)
    # The running daemon is untouched and still owns the lock.
    assert daemon_pid(first.data) == first.pid
    assert (first.mountpoint / "kept").read_bytes() == b"kept"


def test_data_dir_under_a_regular_file_is_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "plain").write_text("x")
    result = run_mount(mnt, tmp_path / "plain" / "data")
    one_line_error(result, "data")
    assert not is_mounted(mnt)


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs (root ignores mode bits, not a read-only mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(ro)], check=True)
    try:
        (ro / "data").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        yield ro
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


@pytest.mark.parametrize("existing", [True, False])
def test_data_dir_on_readonly_volume_is_one_line(tmp_path: Path, readonly_dir: Path,
                                                 existing: bool) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    data = readonly_dir / ("data" if existing else "new")
    result = run_mount(mnt, data)
    one_line_error(result, str(data))
    assert not is_mounted(mnt)


@pytest.mark.parametrize("args", [
    ["--no-such-option"],
    ["--capacity", "lots"],
    ["--capacity", "-5G"],
    ["--capacity", ""],
    ["--io-uring", "on"],  # (options kvfs does not have are refused like any unknown one)
    ["--write-behind", "5"],
])
def test_bad_arguments_are_one_line(tmp_path: Path, args: list[str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_mount(mnt, tmp_path / "data", *args)
    line = one_line_error(result)
    assert "usage" not in line.lower() or "error" in line.lower()
    assert args[0] in line
    assert not is_mounted(mnt)
    assert not (tmp_path / "data").exists(), "a rejected command must not create the volume"


def test_capacity_zero_is_refused_or_kept(make_mount: Callable[..., KvfsMount]) -> None:
    """--capacity 0 must be refused, or honoured and kept like any other capacity."""
    volume = make_mount(mount=False)
    result = run_mount(volume.mountpoint, volume.data, "--capacity", "0")
    if result.returncode != 0:
        one_line_error(result, "capacity")
        return
    volume.pid = daemon_pid(volume.data)
    assert capacity_of(volume.mountpoint) == 0
    volume.remount()
    assert capacity_of(volume.mountpoint) == 0


def volume_room(path: Path) -> int:
    """What kvfs can fit on the volume holding `path` (kvfs caps its capacity there)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize(("text", "expected"), [
    ("512M", 512 << 20), ("10G", 10 << 30), ("2T", 2 << 40),
])
def test_capacity_shows_in_df(make_mount: Callable[..., KvfsMount], text: str,
                              expected: int) -> None:
    volume = make_mount("--capacity", text)
    # Where the volume holds less, the capacity follows its free space, which other writers
    # on the disk move between two reads: df must show what kvfs showed just before or after.
    shown = capacity_of(volume.mountpoint)
    df = subprocess.run(["df", "-B1", "--output=size", str(volume.mountpoint)],
                        capture_output=True, text=True, check=True)
    shown_after = capacity_of(volume.mountpoint)
    assert min(shown, shown_after) <= int(df.stdout.split()[-1]) <= max(shown, shown_after)
    room = volume_room(volume.data)
    if expected < room - (256 << 20):
        assert shown == expected
    else:  # more than the volume holds: kvfs shows what fits (less a small reserve)
        assert room - (256 << 20) <= shown < min(expected, room + (64 << 20))


def test_capacity_change_is_kept_and_default_keeps_previous(
        make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount(mount=False)  # options given per mount, not remembered by the fixture
    volume.mount("--capacity", "512M")
    assert capacity_of(volume.mountpoint) == 512 << 20
    volume.remount("--capacity", "10G")
    assert capacity_of(volume.mountpoint) == 10 << 30
    volume.remount()
    assert capacity_of(volume.mountpoint) == 10 << 30


def test_default_capacity_is_free_space_at_first_mount_and_kept(
        make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount(mount=False)
    volume.data.mkdir()
    free_before = shutil.disk_usage(volume.data).free
    volume.mount()
    free_after = shutil.disk_usage(volume.data).free
    capacity = capacity_of(volume.mountpoint)
    slack = 256 << 20  # the metadata files, kvfs's volume reserve, other tests writing
    assert free_after - slack <= capacity <= free_before
    (volume.mountpoint / "f").write_bytes(os.urandom(1 << 20))
    volume.remount()
    assert abs(capacity_of(volume.mountpoint) - capacity) <= slack
    # A stored default is a capacity like any other: an explicit one replaces it for good.
    volume.remount("--capacity", "1G")
    volume.remount()
    assert capacity_of(volume.mountpoint) == 1 << 30


# -- foreground and unmounting -----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_foreground_stops_cleanly_on_signal(tmp_path: Path, signum: int) -> None:
    mnt, data = tmp_path / "mnt", tmp_path / "data"
    mnt.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(MOUNT_SCRIPT), str(mnt), "--data", str(data), "--capacity", "1G",
         "--foreground"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: is_mounted(mnt) or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()
        assert wait_for(lambda: capacity_of(mnt) == GiB)
        assert daemon_pid(data) == proc.pid
        (mnt / "f").write_bytes(b"data")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert not is_mounted(mnt)
        assert "unmounted" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if is_mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)


def test_fusermount_makes_daemon_exit_cleanly(make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount("--capacity", "1G")
    (volume.mountpoint / "f").write_bytes(b"x" * 5000)
    pid = volume.pid
    subprocess.run(["fusermount3", "-u", str(volume.mountpoint)], check=True)
    assert wait_dead(pid)
    volume.pid = 0
    log = (volume.data / "kvfs.log").read_text()
    assert "unmounted" in log
    assert "Traceback" not in log
    # And the volume is consistent afterwards.
    result = kvfs_cli("fsck", "--data", str(volume.data))
    assert result.returncode == 0, result.stderr


def test_kvfs_umount_waits_for_daemon(make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount("--capacity", "1G")
    (volume.mountpoint / "f").write_bytes(b"y" * 5000)
    pid = volume.pid
    result = kvfs_cli("umount", str(volume.mountpoint))
    assert result.returncode == 0, result.stderr
    # No waiting here: umount returned, so the daemon must be gone already.
    assert not pid_alive(pid)
    assert not is_mounted(volume.mountpoint)
    volume.pid = 0
    # The lock is free: fsck (which takes it) runs right away.
    assert kvfs_cli("fsck", "--data", str(volume.data)).returncode == 0


def test_kvfs_umount_of_non_kvfs_dir_is_one_line(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    one_line_error(kvfs_cli("umount", str(plain)), "not a kvfs mount")
    one_line_error(kvfs_cli("umount", str(tmp_path / "missing")), "not a kvfs mount")


def test_kvfs_umount_of_other_fs_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "tmpfs"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(other)], check=True)
    try:
        one_line_error(kvfs_cli("umount", str(other)), "not a kvfs mount")
        assert is_mounted(other)
    finally:
        subprocess.run(["umount", "-l", str(other)], check=False)


# -- fsck --------------------------------------------------------------------------------


@pytest.fixture
def filled(make_mount: Callable[..., KvfsMount]) -> KvfsMount:
    """An unmounted volume holding one 3 MiB file `victim` and a few bystanders."""
    volume = make_mount("--capacity", "1G")
    write_file(volume.mountpoint / "victim.bin", os.urandom(3 << 20))
    volume.unmount()
    victim_blob = only_blob(volume.data)
    volume.mount()
    for index in range(3):
        write_file(volume.mountpoint / "dir" / f"ok{index}", os.urandom(100_000 + index))
    volume.unmount()
    volume.victim_blob = victim_blob  # type: ignore[attr-defined]
    return volume


def fsck(data: Path, *extra: str) -> subprocess.CompletedProcess:
    return kvfs_cli("fsck", "--data", str(data), *extra)


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def assert_bystanders_intact(volume: KvfsMount) -> None:
    names = sorted(os.listdir(volume.mountpoint / "dir"))
    assert names == ["ok0", "ok1", "ok2"]
    for index in range(3):
        assert (volume.mountpoint / "dir" / f"ok{index}").stat().st_size == 100_000 + index


def test_fsck_clean_volume(filled: KvfsMount) -> None:
    result = fsck(filled.data)
    assert result.returncode == 0, output(result)
    assert "clean" in output(result)
    before = {p: p.stat().st_size for p in blob_files(filled)}
    assert fsck(filled.data, "--repair").returncode == 0
    assert {p: p.stat().st_size for p in blob_files(filled)} == before


def test_fsck_refuses_while_mounted(make_mount: Callable[..., KvfsMount]) -> None:
    volume = make_mount("--capacity", "1G")
    (volume.mountpoint / "f").write_bytes(b"z")
    for extra in ([], ["--repair"]):
        one_line_error(fsck(volume.data, *extra), "unmount")
    assert (volume.mountpoint / "f").read_bytes() == b"z"


def test_fsck_of_non_volume_is_one_line(tmp_path: Path) -> None:
    one_line_error(fsck(tmp_path), "not a kvfs volume")


def _check_damage_found_and_repaired(volume: KvfsMount, *names: str) -> str:
    result = fsck(volume.data)
    assert result.returncode != 0, output(result)
    for name in names:
        assert name in output(result), output(result)
    repaired = fsck(volume.data, "--repair")
    assert repaired.returncode == 0, output(repaired)
    again = fsck(volume.data)
    assert again.returncode == 0, output(again)
    assert "clean" in output(again)
    return output(result)


def test_fsck_finds_and_drops_corrupt_blob(filled: KvfsMount) -> None:
    flip_byte(filled.victim_blob, 2 << 20)  # type: ignore[attr-defined]
    _check_damage_found_and_repaired(filled, "victim.bin")
    filled.mount()
    assert "victim.bin" not in os.listdir(filled.mountpoint)
    assert not (filled.mountpoint / "victim.bin").exists()
    assert_bystanders_intact(filled)
    assert not filled.victim_blob.exists()  # type: ignore[attr-defined]
    st = os.statvfs(filled.mountpoint)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert used == sum(allocated(p) for p in blob_files(filled))


def test_fsck_finds_and_drops_truncated_blob(filled: KvfsMount) -> None:
    os.truncate(filled.victim_blob, 1 << 20)  # type: ignore[attr-defined]
    _check_damage_found_and_repaired(filled, "victim.bin")
    filled.mount()
    assert "victim.bin" not in os.listdir(filled.mountpoint)
    assert_bystanders_intact(filled)


def test_fsck_finds_and_drops_missing_blob(filled: KvfsMount) -> None:
    filled.victim_blob.unlink()  # type: ignore[attr-defined]
    _check_damage_found_and_repaired(filled, "victim.bin", "missing")
    filled.mount()
    assert "victim.bin" not in os.listdir(filled.mountpoint)
    assert_bystanders_intact(filled)


def test_fsck_finds_blob_grown_behind_its_back(filled: KvfsMount) -> None:
    with open(filled.victim_blob, "ab") as f:  # type: ignore[attr-defined]
        f.write(b"extra")
    _check_damage_found_and_repaired(filled, "victim.bin")


def test_fsck_reclaims_orphaned_data_file(filled: KvfsMount) -> None:
    source = filled.victim_blob  # type: ignore[attr-defined]
    orphan_id = 0x00000000DEADBE00 | 0x5A
    orphan = filled.data / "blobs" / f"{orphan_id & 0xFF:02x}" / f"{orphan_id:016x}"
    shutil.copyfile(source, orphan)
    report = _check_damage_found_and_repaired(filled, "orphan")
    assert f"{orphan_id:016x}" in "".join(report.split())  # see the wrapping bug test below
    assert "victim.bin" not in report  # the original is not confused with its copy
    assert not orphan.exists()
    assert source.exists()
    filled.mount()
    assert (filled.mountpoint / "victim.bin").stat().st_size == 3 << 20
    assert_bystanders_intact(filled)


def test_fsck_reclaims_leftover_staging(filled: KvfsMount) -> None:
    staging = filled.data / "staging" / f"{0xABCDEF:016x}"
    staging.write_bytes(os.urandom(10_000))
    _check_damage_found_and_repaired(filled, "staged")
    assert not staging.exists()


# -- known bugs: fsck prints through rich, which wraps and interprets what it prints -------


def test_fsck_names_orphan_path_on_one_line(filled: KvfsMount) -> None:
    orphan_id = 0x00000000DEADBE5A
    orphan = filled.data / "blobs" / "5a" / f"{orphan_id:016x}"
    shutil.copyfile(filled.victim_blob, orphan)  # type: ignore[attr-defined]
    result = fsck(filled.data)
    assert result.returncode != 0
    assert any(str(orphan) in line for line in output(result).splitlines()), output(result)


def _damaged_file_named(volume: KvfsMount, name: str) -> None:
    volume.mount()
    write_file(volume.mountpoint / name, os.urandom(50_000))
    volume.unmount()
    known = {volume.victim_blob}  # type: ignore[attr-defined]
    new = [p for p in blob_files(volume) if p not in known and p.stat().st_size == 50_000]
    assert len(new) == 1
    flip_byte(new[0], 10)


@pytest.mark.parametrize("name", ["[bold]x.bin", "x[bold red]y.bin"])
def test_fsck_reports_bracketed_names_verbatim(filled: KvfsMount, name: str) -> None:
    _damaged_file_named(filled, name)
    result = fsck(filled.data)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1
    assert name in output(result), output(result)


# -- a daemon that died without unmounting -----------------------------------------------


def test_kvfs_umount_clears_a_dead_mount(make_mount: Callable[..., KvfsMount]) -> None:
    """(Mounting again clears it too: tests/test_restart.py.)"""
    volume = make_mount("--capacity", "1G")
    (volume.mountpoint / "kept").write_bytes(b"kept")
    os.kill(volume.pid, signal.SIGKILL)
    assert wait_dead(volume.pid)
    volume.pid = 0
    assert is_mounted(volume.mountpoint)  # the kernel still has the (dead) mount
    result = kvfs_cli("umount", str(volume.mountpoint))
    assert result.returncode == 0, result.stderr
    assert not is_mounted(volume.mountpoint)
    volume.mount()
    assert (volume.mountpoint / "kept").read_bytes() == b"kept"
