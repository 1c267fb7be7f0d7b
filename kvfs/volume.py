"""A kvfs volume on disk: its layout, its lock, and what recovery does after a crash.

The one owner of the data directory's layout; the daemon (kvfs/daemon.py) and `kvfs fsck`
(kvfs/fsck.py) both go through it:

    DATA/meta/              the metadata store, LMDB (kvfs/meta.py)
    DATA/blobs/, staging/   the data store: blob files (kvfs/data.py)
    DATA/kvfs.lock          flock-held by the one process serving or checking the volume; its pid
    DATA/kvfs.log           the daemon's log (unless --log-file or --syslog)
    DATA/verified-blobs     verification marks left by the last unmount of this boot
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

import lmdb

from kvfs.data import DataStore
from kvfs.meta import DEFAULT_MAP_SIZE, MetaStore
from kvfs.passthrough import boot_id

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "kvfs"
LOCK_NAME = "kvfs.lock"
LOG_NAME = "kvfs.log"
VERIFIED_NAME = "verified-blobs"


class VolumeError(Exception):
    """Why a volume cannot be used, for the user as one line."""


class Volume:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta_dir = root / "meta"
        self.lock_path = root / LOCK_NAME
        self.log_path = root / LOG_NAME
        self.verified_path = root / VERIFIED_NAME

    def exists(self) -> bool:
        return (self.meta_dir / "data.mdb").exists()

    def lock(self) -> int:
        """Take the volume's lock (held for the process's life): one user per volume."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise VolumeError(f"cannot create data directory {self.root}: "
                              f"{error.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise VolumeError(f"data directory {self.root} is not writable")
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode().strip() or "?"
            os.close(fd)
            raise VolumeError(f"data directory {self.root} is already served by kvfs daemon "
                              f"pid {holder}") from None
        return fd

    @staticmethod
    def record_pid(lock_fd: int) -> None:
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)

    def open_metadata(self, map_size: int = DEFAULT_MAP_SIZE) -> MetaStore:
        try:
            return MetaStore(self.meta_dir, map_size)
        except (lmdb.Error, RuntimeError) as error:
            raise VolumeError(f"metadata in {self.meta_dir} cannot be opened ({error}); "
                              f"check it with: kvfs fsck --data {self.root}") from None

    def open_data(self, fsync: bool = False) -> DataStore:
        return DataStore(self.root, fsync=fsync)

    @staticmethod
    def recover(meta: MetaStore, data: DataStore) -> list[int]:
        """Finish what a crash interrupted: staged blobs and unlinks. Touches no committed
        data, except files the kernel wrote whose sums were still to be taken when the machine
        went down: their bytes may not have reached the volume, so they are dropped (a miss,
        not a wrong chunk). Returns the blobs whose sums are still to be taken (same boot)."""
        published, discarded = data.recover(meta.is_committed_blob)
        pending = meta.pending()
        this_boot = boot_id().encode()
        rebooted = meta.swap_boot(this_boot) != this_boot
        if pending and rebooted:
            meta.drop_files({ino for _, ino in pending})
            log.warning("recovery: %d files written just before a reboot dropped (their "
                        "checksums were not taken yet)", len(pending))
        unlinks = finish_unlinks(meta, data)
        if published or discarded or unlinks:
            log.info("recovery: %d staged blobs published, %d discarded, %d unlinks finished",
                     published, discarded, unlinks)
        return [] if rebooted else [blob_id for blob_id, _ in pending]


def finish_unlinks(meta: MetaStore, data: DataStore) -> int:
    """Delete the data files of doomed blobs, then their records; returns how many."""
    doomed = meta.doomed()
    for blob_id in doomed:
        data.remove(blob_id)
    meta.reaped(doomed)
    return len(doomed)
