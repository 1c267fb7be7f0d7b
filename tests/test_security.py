"""Permissions: the kernel enforces stored modes and owners (default_permissions) where other
users may reach the mount; where root alone can, root has the rights it has anywhere."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from conftest import assert_only_spares_staged, stats

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


def roots_rights(root: Path) -> dict[str, object]:
    """What root may do in `root`: each check's outcome."""
    (root / "read-only").write_bytes(b"r")
    (root / "read-only").chmod(0o444)
    (root / "nothing").write_bytes(b"n")
    (root / "nothing").chmod(0o000)
    (root / "script").write_text("#!/bin/sh\necho ran\n")
    (root / "script").chmod(0o644)
    (root / "closed").mkdir(mode=0o555)
    sticky = root / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "theirs").write_bytes(b"t")
    os.chown(sticky / "theirs", NOBODY, NOBODY)

    def outcome(action) -> object:
        try:
            return action()
        except OSError as error:
            return error.errno

    outcomes: dict[str, object] = {
        "write read-only": outcome(lambda: (root / "read-only").write_bytes(b"w")),
        "read mode 000": outcome((root / "nothing").read_bytes),
        "create in 0555": outcome(lambda: (root / "closed" / "new").write_bytes(b"x")),
        "remove another's in sticky": outcome((sticky / "theirs").unlink),
        "chdir into 0000": outcome(lambda: subprocess.run(
            ["sh", "-c", f"chmod 0 {root / 'closed'} && cd {root / 'closed'}"],
            check=True).returncode),
    }
    for mode in (0o644, 0o744, 0o000):
        (root / "script").chmod(mode)
        outcomes[f"access X_OK {mode:o}"] = os.access(root / "script", os.X_OK)
        outcomes[f"access RW {mode:o}"] = os.access(root / "script", os.R_OK | os.W_OK)
        outcomes[f"run {mode:o}"] = outcome(lambda: subprocess.run(
            [str(root / "script")], capture_output=True, text=True).stdout)
    outcomes["access X_OK dir 0000"] = os.access(root / "closed", os.X_OK)
    (root / "closed").chmod(0o755)
    return outcomes


def test_root_alone_has_roots_rights_and_no_getattr_per_store(make_mount, tmp_path: Path
                                                              ) -> None:
    """Without --allow-other only root reaches the mount (above) and kvfs mounts without
    default_permissions: root may do there what it may do on the local filesystem (execute
    needs an execute bit, also for access(2)), and a store (create, write, close, rename)
    costs no GETATTR of its directory, which the kernel's checks would ask for."""
    kvfs = make_mount("--capacity", "64M")
    plain = tmp_path / "plain"
    plain.mkdir()
    assert roots_rights(kvfs.mountpoint) == roots_rights(plain)

    directory = kvfs.mountpoint / "stores"
    directory.mkdir()
    # (reading .kvfs/stats asks for its attributes: counted in `before`, `after` and apart)
    before = stats(kvfs.mountpoint)["requests"]
    by_reading = stats(kvfs.mountpoint)["requests"]["getattr"]["count"] - before["getattr"]["count"]
    before = stats(kvfs.mountpoint)["requests"]
    for number in range(20):
        temporary = directory / f"{number}.tmp"
        temporary.write_bytes(b"kv")
        temporary.rename(directory / f"{number}.bin")
    after = stats(kvfs.mountpoint)["requests"]

    def asked(request: str) -> int:
        return (after.get(request, {"count": 0})["count"]
                - before.get(request, {"count": 0})["count"])

    assert (asked("create"), asked("rename"), asked("getattr")) == (20, 20, by_reading)
    assert stat.S_IMODE(os.stat(directory / "19.bin").st_mode) == 0o644


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
    assert stored <= {"blobs", "meta", "kvfs.lock", "kvfs.log", "verified-blobs", "direct-readers",
                      "staging"}
    assert_only_spares_staged(kvfs.data, kvfs)
