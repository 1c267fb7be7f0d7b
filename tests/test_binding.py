"""kvfs's pyfuse3 fork (vendor/pyfuse3): what kvfs relies on, through a minimal file system
of its own (tests/binding_fs.py) in a process of its own, apart from kvfs: passthrough by a
registered backing file, fallocate reaching the file system, the reply thread, READDIR
without OPENDIR, node ids apart from inode numbers, readers without FLUSH."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import is_mounted, wait_for

from kvfs.fuse import binding

FS = Path(__file__).with_name("binding_fs.py")


@dataclass
class Mounted:
    mountpoint: Path
    backing: Path
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Mounted]:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    backing = tmp_path / "backing"
    backing.write_bytes(b"read by the kernel from the backing file\n")
    here = Mounted(mountpoint, backing, tmp_path / "log")
    daemon = subprocess.Popen([sys.executable, str(FS), str(mountpoint), str(backing),
                               str(here.log)])
    try:
        assert wait_for(lambda: is_mounted(mountpoint), 20), "the file system did not mount"
        yield here
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def test_the_installed_pyfuse3_is_the_fork_kvfs_asks_for() -> None:
    """The fork's version (vendor/pyfuse3/pyproject.toml) is the one kvfs's pyproject.toml
    pins and the one installed: a fork changed without its pin fails set-up."""
    repo = Path(__file__).resolve().parent.parent
    fork = tomllib.loads((repo / "vendor" / "pyfuse3" / "pyproject.toml").read_text())
    kvfs = tomllib.loads((repo / "pyproject.toml").read_text())
    version = fork["project"]["version"]
    assert f"pyfuse3=={version}" in kvfs["project"]["dependencies"]
    assert binding.require() == version


def test_init_grants_passthrough_and_starts_the_reply_thread(mounted: Mounted) -> None:
    assert wait_for(lambda: any(line.startswith("init") for line in mounted.lines()))
    (init,) = [line for line in mounted.lines() if line.startswith("init")]
    assert "replies_from_thread=True" in init
    assert "passthrough=True" in init


def test_a_backing_file_serves_reads_without_the_daemon(mounted: Mounted) -> None:
    assert (mounted.mountpoint / "passed").read_bytes() == mounted.backing.read_bytes()
    assert (mounted.mountpoint / "plain").read_bytes() == b"read through the daemon\n"
    reads = [line for line in mounted.lines() if line.startswith("read ")]
    assert reads and all(line == "read 2" for line in reads)  # none for the backed file


def test_fallocate_reaches_the_file_system(mounted: Mounted) -> None:
    fd = os.open(mounted.mountpoint / "plain", os.O_RDWR)
    try:
        os.posix_fallocate(fd, 4096, 8192)
    finally:
        os.close(fd)
    assert "fallocate 2 0 4096 8192" in mounted.lines()


def test_readdir_comes_without_opendir_and_tells_plus(mounted: Mounted) -> None:
    assert sorted(os.listdir(mounted.mountpoint)) == ["alias", "passed", "plain"]
    listings = [line for line in mounted.lines() if line.startswith("readdir")]
    assert listings and all(line.startswith("readdir fh=1 ") for line in listings)
    assert any(line.endswith("plus=True") for line in listings)


def test_a_node_id_apart_from_the_inode_number(mounted: Mounted) -> None:
    status = os.stat(mounted.mountpoint / "alias")
    assert status.st_ino == 4  # what stat shows: the inode number
    assert "getattr alias" in mounted.lines()  # what the kernel sends: the node id


def test_readers_send_no_flush_and_writers_do(mounted: Mounted) -> None:
    (mounted.mountpoint / "plain").read_bytes()
    assert not [line for line in mounted.lines() if line.startswith("flush")]
    os.close(os.open(mounted.mountpoint / "plain", os.O_WRONLY))
    assert "flush 2" in mounted.lines()
