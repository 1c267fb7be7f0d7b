"""LOOKUP answers for the Python inside scripts/fuse_ring_floor.c (scripts/bench_uring.py).

The daemon calls `setup(spec)` once, then `lookup(parent, name)` with the GIL on whatever
thread serves each request: "constant" answers "f" in the root from constants (what Python
adds to a request), and a directory path answers from the kvfs metadata store (LMDB) there,
through kvfs's own `MetaStore.lookup`.
"""

from __future__ import annotations

import functools
import stat
from collections.abc import Callable
from pathlib import Path

from kvfs.engine import LmdbEngine
from kvfs.meta import MetaStore
from kvfs.meta.schema import FAMILIES
from kvfs.volume import DEFAULT_MAP_SIZE

Entry = tuple[int, int, int] | None  # (ino, mode, size), or no such name
ROOT = 1


def _constant(parent: int, name: bytes) -> Entry:
    return (2, stat.S_IFREG | 0o644, 0) if parent == ROOT and name == b"f" else None


def _stored(meta: MetaStore, parent: int, name: bytes) -> Entry:
    inode = meta.lookup(parent, name, cached=True)
    return None if inode is None else (inode.ino, inode.mode, inode.size)


lookup: Callable[[int, bytes], Entry] = _constant


def setup(spec: str) -> None:
    global lookup
    if spec != "constant":
        meta = MetaStore(LmdbEngine(Path(spec), FAMILIES, DEFAULT_MAP_SIZE))
        lookup = functools.partial(_stored, meta)
