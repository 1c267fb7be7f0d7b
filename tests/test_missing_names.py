"""Lookups of missing names answered before the request loop (kvfs/missing_names.py, kvfs's
pyfuse3 patch), on a real mount: in a directory made since the mount the patch answers each
lookup of a missing name itself, and never one of a name the directory holds, whichever way
the name came or went; directories older than the mount are answered by the operations."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pyfuse3
from conftest import (
    KvfsMount,
    answered_early,
    assert_counters_exact,
    drop_caches,
    missing,
    stats,
)

from kvfs.missing_names import SMALL_DIRECTORY

AT_FDCWD = -100
RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(source: Path, target: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(source), AT_FDCWD, os.fsencode(target),
                       flags) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), str(source))


def check(directory: Path, expected: set[str], gone: set[str]) -> None:
    """Every expected name is found and listed, every gone one is missing, as is a fresh one
    per name: with the kernel's dentries dropped first, each lookup reaches the daemon."""
    drop_caches()  # (the kernel's dentries too: each lookup reaches the daemon)
    assert set(os.listdir(directory)) == expected
    drop_caches()
    for name in sorted(expected):
        assert not missing(directory / name), f"{name} exists but a lookup says it is missing"
    for name in sorted(gone) + [f"never-{n}" for n in range(len(expected))]:
        assert missing(directory / name), f"{name} is gone but a lookup finds it"


def test_misses_in_a_directory_made_since_the_mount_never_hide_a_name(kvfs: KvfsMount
                                                                      ) -> None:
    root = kvfs.mountpoint
    older = root / "older"  # (made before the mount that follows: not answered early)
    older.mkdir()
    (older / "moved-in").write_bytes(b"m")
    (older / "linked").write_bytes(b"l")
    kvfs.remount()
    made = root / "made"
    made.mkdir()
    expected: set[str] = set()
    gone: set[str] = set()

    before = answered_early(root)
    fresh = [made / f"fresh-{n}" for n in range(20)]
    assert all(missing(path) for path in fresh)  # (fresh names: none is in the kernel's cache)
    assert answered_early(root) - before == len(fresh)

    # Each way a name comes: create, mkdir, symlink, fifo, rename in, hard link, rename
    # within, rename over an existing name, exchange.
    for n in range(8):
        (made / f"file-{n}").write_bytes(b"x" * n)
    (made / "sub").mkdir()
    (made / "link-to").symlink_to("file-0")
    os.mkfifo(made / "fifo")
    os.rename(older / "moved-in", made / "moved-in")
    os.link(older / "linked", made / "linked")
    os.rename(made / "file-1", made / "renamed")
    os.rename(made / "file-2", made / "file-3")  # (over an existing name)
    renameat2(made / "file-4", made / "sub", RENAME_EXCHANGE)
    expected |= {f"file-{n}" for n in (0, 3, 5, 6, 7)} | {
        "file-4", "sub", "link-to", "fifo", "moved-in", "linked", "renamed"}
    gone |= {"file-1", "file-2"}
    check(made, expected, gone)

    # Each way a name goes: unlink, rmdir, rename out, rename over it from elsewhere.
    os.unlink(made / "file-0")
    os.rmdir(made / "file-4")  # (the directory, exchanged above)
    os.rename(made / "renamed", older / "renamed")
    (older / "over").write_bytes(b"o")
    os.rename(older / "over", made / "file-5")
    expected -= {"file-0", "file-4", "renamed"}
    gone |= {"file-0", "file-4", "renamed"}
    check(made, expected, gone)
    assert not missing(older / "renamed") and (made / "file-5").read_bytes() == b"o"

    # A directory made inside, and one moved in from before the mount.
    inner = made / "inner"
    inner.mkdir()
    (inner / "a").write_bytes(b"a")
    os.rename(older, made / "older")
    expected |= {"inner", "older"}
    check(made, expected, gone)
    check(inner, {"a"}, set())
    assert not missing(made / "older" / "linked")

    # After a remount a directory becomes complete at the first miss the operations answer
    # there (these are small): the rest are answered early, the same.
    assert answered_early(root) > len(fresh)
    kvfs.remount()
    check(made, expected, gone)
    check(inner, {"a"}, set())
    assert answered_early(root) == len(gone) + len(expected) - 1
    counted = stats(root)
    assert counted["lookup_misses"] >= len(gone) + len(expected)
    assert_counters_exact(root, kvfs.data)


def test_misses_count_with_the_daemons_own(kvfs: KvfsMount) -> None:
    """`lookup_misses` counts every miss that reached the daemon, those the patch answered
    (`missing_names_answered`) with those the operations did."""
    root = kvfs.mountpoint
    (root / "old").mkdir()  # (too large to become complete: the operations answer there)
    for n in range(SMALL_DIRECTORY + 1):
        (root / "old" / f"file-{n}").touch()
    kvfs.remount()
    (root / "new").mkdir()
    start = stats(root)
    for n in range(10):
        assert missing(root / "old" / f"a-{n}") and missing(root / "new" / f"b-{n}")
    with open(root / "new" / "c", "x"):  # (O_EXCL: the kernel asks the daemon first)
        pass
    end = stats(root)
    assert end["missing_names_answered"] - start["missing_names_answered"] == 11
    assert end["lookup_misses"] - start["lookup_misses"] == 21
    assert end["requests"]["lookup"]["count"] - start["requests"]["lookup"]["count"] >= 10
    try:
        os.open(root / "new" / "c", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError as error:
        assert error.errno == errno.EEXIST
    else:
        raise AssertionError("O_EXCL of an existing name succeeded")


def test_the_table_of_names_is_bounded() -> None:
    """The patch keeps at most the names it was given room for; past that it stops
    answering (once, and says so) and every LOOKUP goes to the operations again."""
    pyfuse3.answer_missing_names(1.0, 255, 1000)
    try:
        assert pyfuse3.complete_directory(2)
        kept = [pyfuse3.name_added(2, b"name-%d" % n) for n in range(5000)]
        assert all(kept[:1000]) and kept.count(False) == 1
    finally:
        pyfuse3.stop_answering_missing_names()


def test_a_small_directory_older_than_the_mount_becomes_complete_at_its_first_miss(
        kvfs: KvfsMount) -> None:
    root = kvfs.mountpoint
    small, large = root / "small", root / "large"
    small.mkdir()
    large.mkdir()
    for n in range(3):
        (small / f"s-{n}").write_bytes(b"s")
    for n in range(SMALL_DIRECTORY + 1):
        (large / f"l-{n}").touch()
    kvfs.remount()
    assert missing(small / "first") and answered_early(root) == 0  # (the operations, once)
    assert all(missing(small / f"next-{n}") for n in range(10))
    assert answered_early(root) == 10
    assert all(missing(large / f"x-{n}") for n in range(10))  # (too large: the operations)
    assert all(missing(root / f"y-{n}") for n in range(3))  # (the root: never complete)
    assert answered_early(root) == 10
    check(small, {"s-0", "s-1", "s-2"}, {"first"})
    (small / "late").write_bytes(b"l")
    os.rename(small / "s-0", small / "s-zero")
    os.rename(large / "l-0", small / "from-large")
    check(small, {"s-zero", "s-1", "s-2", "late", "from-large"}, {"s-0", "first"})
    assert (root / ".kvfs" / "stats").exists()
    assert_counters_exact(root, kvfs.data)
