"""The embedded engine's LMDB environment (kvfs/engines/lmdb_engine.py): how it is opened (one
named database per family), a layer of changes not yet in it, and how a layer goes into it in
one synced transaction, marked with the last change it holds.

The environment's data file is on the volume; its lock table and the engine's change log are
in the host's runtime directory, in memory (`host_files`): both are shared maps that the
request loop writes, and a page of a shared map on the volume, written again after the
volume's writeback, waits for the volume; a volume that stalls its writes (an array's
failover, a frozen file system) would then hold every request. They outlive the daemon,
not the host: a host that goes down loses the changes the committer had not put into LMDB
yet, which its last groups' unsynced meta page may lose anyway (`metasync=False`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from kvfs import runtime_directory
from kvfs.engines.changelog import KEEP, Value, Writes

log = logging.getLogger(__name__)

APPLIED_KEY = b"changes applied"  # settings: the last change LMDB holds (read from LMDB only)
COUNT = struct.Struct(">q")  # counters: signed, big-endian (as the u64 of kvfs-2)
LOCK_TABLE = "lock.mdb"


@dataclass
class Layer:
    """Changes not yet in LMDB: per family and key, the versions (seq, value, delta), oldest
    first. Only the engine's lock holder appends; snapshots read the versions they may see."""

    families: dict[str, dict[bytes, list[tuple[int, Value, int]]]] = field(default_factory=dict)
    last_seq: int = 0
    size: int = 0  # bytes of the changes' encodings (what they may take in the map)

    def add(self, seq: int, writes: Writes, size: int = 0) -> None:
        self.size += size
        for family, keys in writes.items():
            versions = self.families.setdefault(family, {})
            for key, (value, delta) in keys.items():
                versions.setdefault(key, []).append((seq, value, delta))
        self.last_seq = seq

    def folded(self) -> Writes:
        """The layer's end state per key, for one LMDB transaction."""
        writes: Writes = {}
        for family, keys in self.families.items():
            folded = writes.setdefault(family, {})
            for key, versions in keys.items():
                value: Value = KEEP
                delta = 0
                for _, changed, added in versions:
                    if changed is not KEEP:
                        value, delta = changed, 0
                    delta += added
                folded[key] = [value, delta]
        return writes


def host_files(path: Path, readonly: bool) -> list[Path]:
    """Where the change log and LMDB's lock table of the environment at `path` are (first:
    LOCK_TABLE there links to it), then where earlier daemons may have left log segments. A
    writer places them in the runtime directory, or on the volume where that cannot be made
    (logged); a reader finds them where the link says."""
    lock = path / LOCK_TABLE
    before = _linked(lock)
    if not readonly:
        _link_lock_table(lock, _runtime_files(path))
    here = _linked(lock) or path
    with contextlib.suppress(OSError):  # (gone with a reboot; a reader may not make it)
        here.mkdir(mode=0o700, parents=True, exist_ok=True)
    return list(dict.fromkeys([here, *filter(None, [before]), path]))


def _linked(lock: Path) -> Path | None:
    return Path(os.readlink(lock)).parent if lock.is_symlink() else None


def _runtime_files(path: Path) -> Path | None:
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:24]
    directory = runtime_directory() / "volumes" / digest
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        log.warning("%s cannot be made (%s): the change log and LMDB's lock table stay on "
                    "the volume, whose stalls then hold every request", directory, error)
        return None
    return directory


def _link_lock_table(lock: Path, directory: Path | None) -> None:
    """LOCK_TABLE on the volume a link to `directory`'s, or a file of its own (None)."""
    if _linked(lock) == directory:
        return
    if directory is None:
        lock.unlink()  # (a link: LMDB makes the file)
        return
    link = lock.with_name(LOCK_TABLE + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(directory / LOCK_TABLE)
    link.replace(lock)


def open_environment(path: Path, families: tuple[str, ...], map_size: int,
                     readonly: bool = False
                     ) -> tuple[lmdb.Environment, dict[str, lmdb._Database]]:
    """The engine's LMDB environment and its databases, one per family."""
    # metasync=False: a power loss may undo the last commits but never breaks the database.
    env = lmdb.open(str(path), map_size=map_size, max_dbs=32, metasync=False,
                    readahead=False, readonly=readonly, lock=True)
    try:
        return env, {family: env.open_db(family.encode(), create=not readonly)
                     for family in families}
    except BaseException:
        env.close()  # else this process could never open the environment again
        raise


def write_layer(env: lmdb.Environment, dbs: dict[str, lmdb._Database], layer: Layer) -> None:
    """A layer into LMDB in one synced transaction, with the last seq it holds."""
    with env.begin(write=True) as txn:
        _apply(txn, dbs, layer.folded())
        txn.put(APPLIED_KEY, str(layer.last_seq).encode(), db=dbs["settings"])


def _apply(txn: lmdb.Transaction[bytes], dbs: dict[str, lmdb._Database], writes: Writes) -> None:
    for family, keys in writes.items():
        db = dbs[family]
        for key, (value, delta) in keys.items():
            if value is None:
                txn.delete(key, db=db)
            elif value is not KEEP:
                txn.put(key, value, db=db)
            if delta:
                raw = txn.get(key, db=db)
                txn.put(key, COUNT.pack((COUNT.unpack(raw)[0] if raw else 0) + delta), db=db)

