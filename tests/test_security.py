"""Permissions: the kernel enforces stored modes and owners (default_permissions)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

NOBODY = 65534


def as_nobody(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                           "--clear-groups", *command], capture_output=True, text=True)


def test_modes_and_owners_are_enforced_for_other_users(reachable: Path, make_mount) -> None:
    kvfs = make_mount("--capacity", "64M", "--allow-other", where=reachable)
    root = kvfs.mountpoint
    (root / "secret").write_bytes(b"root only")
    os.chmod(root / "secret", 0o600)
    (root / "public").write_bytes(b"for everyone")
    os.chmod(root / "public", 0o644)
    (root / "mine").mkdir()
    os.chown(root / "mine", NOBODY, NOBODY)

    assert as_nobody("cat", str(root / "public")).stdout == "for everyone"
    denied = as_nobody("cat", str(root / "secret"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    assert as_nobody("touch", str(root / "new")).returncode != 0  # root dir is 0755, root's
    assert as_nobody("rm", "-f", str(root / "public")).returncode != 0
    assert as_nobody("sh", "-c", f"echo hi > {root / 'mine' / 'file'}").returncode == 0
    made = os.stat(root / "mine" / "file")
    assert (made.st_uid, made.st_gid) == (NOBODY, NOBODY)
    kvfs.remount()
    assert os.stat(root / "mine" / "file").st_uid == NOBODY
    assert as_nobody("cat", str(root / "secret")).returncode != 0


def test_other_users_are_kept_out_without_allow_other(reachable: Path, make_mount) -> None:
    kvfs = make_mount("--capacity", "64M", where=reachable)
    (kvfs.mountpoint / "public").write_bytes(b"x")
    os.chmod(kvfs.mountpoint / "public", 0o644)
    assert as_nobody("cat", str(kvfs.mountpoint / "public")).returncode != 0


def test_data_stays_inside_the_data_directory(make_mount, tmp_path: Path) -> None:
    """File names never become paths on the volume: data files are named by number."""
    kvfs = make_mount("--capacity", "64M")
    for name in ("..", "...", "..data", "-rf", "blobs", "meta"):
        path = kvfs.mountpoint / name
        if name == "..":
            continue
        path.write_bytes(name.encode())
    before = {p.name for p in tmp_path.iterdir()}
    assert before == {"mnt0", "data0"}
    stored = {p.relative_to(kvfs.data).parts[0] for p in kvfs.data.rglob("*") if p.is_file()}
    assert stored <= {"blobs", "meta", "kvfs.lock", "kvfs.log", "verified-blobs"}
