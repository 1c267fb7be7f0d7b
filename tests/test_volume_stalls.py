"""A volume whose writes block (`fsfreeze`: as an array that stalls its writes, or a path lost
while the host queues I/O): writers wait, as they do on the plain directory, and once the
volume answers again everything completes; nothing fails, nothing is lost, and the counters
equal a recount. Readers and lookups go on during the freeze, as they do on the plain
directory, on both engines: the request loop writes nothing on the volume (the embedded
engine's change log and lock table are in the runtime directory: docs/operations.md).

The volume is an ext4 image of the test's own, loop-mounted (root, `mkfs.ext4`, `fsfreeze`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import assert_counters_exact
from local_redis import LocalRedis

FILES = 4
FILE_BYTES = 1 << 20
STORE_WAIT_S = 60  # for a store held by the freeze to finish once the volume is thawed
READ_WAIT_S = 20  # for readers during a freeze of a shared pool (they take milliseconds)
HELD_S = 2  # a store that has not ended after this is held by the freeze (it takes far less)

# One process reads and checks every stored file and stats a missing name.
READER = """
import os, sys
from pathlib import Path
root, files, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for index in range(files):
    path = root / f"chunk{index}"
    assert path.stat().st_size == size, path
    assert path.read_bytes() == bytes([index]) * size, path
assert not (root / "never-stored").exists()
"""

# One process stores a file as the engines do: a temporary name, one write, a rename.
STORER = """
import os, sys
from pathlib import Path
root, size = Path(sys.argv[1]), int(sys.argv[2])
temporary = root / "late.tmp"
temporary.write_bytes(b"L" * size)
os.rename(temporary, root / "late")
"""


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A fresh ext4 file system, loop-mounted; thawed and unmounted at teardown (request it
    before make_mount, so that the kvfs mounts on it go first)."""
    tools = [shutil.which(tool) for tool in ("mkfs.ext4", "fsfreeze")]
    if os.geteuid() != 0 or None in tools:
        pytest.skip("needs root, mkfs.ext4 and fsfreeze")
    image, root = tmp_path / "volume.img", tmp_path / "volume"
    with image.open("wb") as file:
        file.truncate(1 << 30)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    root.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["fsfreeze", "-u", str(root)], capture_output=True, check=False)
        subprocess.run(["umount", "-l", str(root)], check=False)


def run_python(source: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", source, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended(process: subprocess.Popen, seconds: float) -> bool:
    """Whether the process ended within `seconds` (it is neither killed nor waited for
    further: while the volume is frozen, a process inside a kvfs close cannot be killed)."""
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


def finished(process: subprocess.Popen, seconds: float) -> None:
    """The process ended within `seconds`, and succeeded."""
    try:
        _, stderr = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError(f"still waiting after {seconds} s") from None
    assert process.returncode == 0, stderr


@pytest.mark.parametrize("engine", ["lmdb", "redis"])
def test_a_frozen_volume_holds_writers_and_loses_nothing(
        volume: Path, redis_server: LocalRedis, make_mount, engine: str) -> None:
    shared = ["--meta", redis_server.url] if engine == "redis" else []
    kvfs = make_mount("--capacity", "512M", *shared, data=volume / "pool")
    root = kvfs.mountpoint
    for index in range(FILES):
        (root / f"chunk{index}.tmp").write_bytes(bytes([index]) * FILE_BYTES)
        os.rename(root / f"chunk{index}.tmp", root / f"chunk{index}")
    # (this process holds nothing open on the mount: fsfreeze, forked from it, inherits no
    # handle whose close would wait on the frozen daemon)
    subprocess.run(["fsfreeze", "-f", str(volume)], check=True)
    try:
        storer = run_python(STORER, root, FILE_BYTES)
        reader = run_python(READER, root, FILES, FILE_BYTES)
        reads_went_on = ended(reader, READ_WAIT_S)
        store_held = not ended(storer, HELD_S)
    finally:
        subprocess.run(["fsfreeze", "-u", str(volume)], check=True)
    assert reads_went_on, f"the reader waited on the frozen volume for {READ_WAIT_S} s"
    assert store_held, "a store went through on a frozen volume"  # (as on ext4 itself)
    finished(storer, STORE_WAIT_S)
    finished(reader, STORE_WAIT_S)
    assert (root / "late").read_bytes() == b"L" * FILE_BYTES
    assert sorted(path.name for path in root.iterdir()) == sorted(
        [f"chunk{index}" for index in range(FILES)] + ["late"])
    assert os.path.exists(f"/proc/{kvfs.pid}")  # the same daemon throughout
    assert_counters_exact(root, kvfs.data)
