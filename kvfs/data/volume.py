"""A kvfs volume on disk: its layout and its lock (recovery after a crash: kvfs/pool/reaper.py).

The one owner of the data directory's layout; the daemon (kvfs/daemon.py) and `kvfs fsck`
(kvfs/cli/fsck.py) both go through it:

    DATA/meta/              the metadata store, LMDB (kvfs/meta/), on one host
    DATA/shared-metadata    instead, on a pool several hosts share: the engine's address
    DATA/pool-id            and the pool's identity, which the engine holds too: a mount
                            refuses an engine that lost the pool (kvfs fsck --repair)
    DATA/blobs/, staging/   the data store: blob files (kvfs/data/store.py)
    DATA/kvfs.lock          flock-held by the one process serving or checking the volume; its pid
                            (one host; in a shared pool the lock is only taken by fsck)
    DATA/mounts/<session>   a shared pool's mounts: pid and mountpoint of each daemon
    DATA/kvfs.log           the daemon's log (unless --log-file or --syslog)
    DATA/verified-blobs     verification marks left by the last unmount of this boot
                            (in a shared pool: verified-blobs.<host name>, one per host)
    DATA/direct-readers     the share of O_DIRECT readers the last unmount saw (per host
                            in a shared pool, as above): what the prefetch starts from
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import Protocol, runtime_checkable

import lmdb

from kvfs.data.store import DataStore
from kvfs.engines.interface import Engine
from kvfs.engines.lmdb_engine import LmdbEngine
from kvfs.meta import DEFAULT_MAP_SIZE, FAMILIES, MetaStore
from kvfs.records import FsError

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "kvfs"
LOCK_NAME = "kvfs.lock"
LOG_NAME = "kvfs.log"
VERIFIED_NAME = "verified-blobs"
DIRECT_READERS_NAME = "direct-readers"
SHARED_NAME = "shared-metadata"
MOUNTS_NAME = "mounts"
POOL_ID_NAME = "pool-id"


def boot_id() -> str:
    """This machine's boot: page caches, and kernel writes not yet on the volume, live as
    long as it."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


class VolumeError(Exception):
    """Why a volume cannot be used, for the user as one line."""


@runtime_checkable
class PoolEngine(Protocol):
    """A shared engine that knows which pool it holds (kvfs/engines/redis_engine.py)."""

    def identity(self) -> bytes | None: ...
    def claim_identity(self, candidate: bytes) -> bytes: ...
    def guard(self, pool: bytes) -> None: ...


class Volume:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.meta_dir = root / "meta"
        self.lock_path = root / LOCK_NAME
        self.log_path = root / LOG_NAME
        self.shared_path = root / SHARED_NAME
        self.mounts_dir = root / MOUNTS_NAME

    def exists(self) -> bool:
        return (self.meta_dir / "data.mdb").exists() or self.shared_path.exists()

    def shared_url(self) -> str | None:
        """The address of the shared engine this volume's metadata is in (None: embedded)."""
        try:
            return self.shared_path.read_text().strip()
        except FileNotFoundError:
            return None

    def verified_path(self, shared: bool) -> Path:
        return self._per_host(VERIFIED_NAME, shared)

    def direct_readers_path(self, shared: bool) -> Path:
        return self._per_host(DIRECT_READERS_NAME, shared)

    def _per_host(self, name: str, shared: bool) -> Path:
        return self.root / (f"{name}.{socket.gethostname()}" if shared else name)

    def lock(self, exclusive: bool = True) -> int:
        """Take the volume's lock (held for the process's life): one user per volume, or
        (shared: the daemons of a shared pool) any number of daemons but no fsck."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise VolumeError(f"cannot create data directory {self.root}: "
                              f"{error.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise VolumeError(f"data directory {self.root} is not writable")
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode().strip() or "?"
            os.close(fd)
            raise VolumeError(f"data directory {self.root} is already served by kvfs daemon "
                              f"pid {holder}") from None
        return fd

    @staticmethod
    def record_pid(lock_fd: int) -> None:
        """The one daemon of a volume says its pid in the lock (not in a shared pool)."""
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)

    def open_metadata(self, url: str | None = None, map_size: int = DEFAULT_MAP_SIZE,
                      readonly: bool = False, deadline: float | None = None,
                      rebuild: bool = False) -> MetaStore:
        """The metadata store: LMDB in meta/ (url None), or the shared engine at `url`, whose
        requests wait at most `deadline` seconds (None: the engine's default). A volume keeps
        the kind it was made with: the other is refused. A shared engine that lost this
        pool (it holds none, or another) is refused too; `rebuild` (fsck --repair) makes a
        new, empty pool there instead, whose checker then reclaims the old data files."""
        engine = self._open_engine(url, map_size, readonly, deadline)
        try:
            held = self._check_identity(engine, url, rebuild) \
                if isinstance(engine, PoolEngine) else None
            meta = MetaStore(engine, readonly)
            if isinstance(engine, PoolEngine):
                self._claim_identity(engine, held)
            return meta
        except VolumeError:
            engine.close()
            raise
        except (lmdb.Error, RuntimeError, FsError) as error:
            engine.close()
            where = url or self.meta_dir
            raise VolumeError(f"metadata in {where} cannot be opened ({error}); "
                              f"check it with: kvfs fsck --data {self.root}") from None

    def _open_engine(self, url: str | None, map_size: int, readonly: bool,
                     deadline: float | None) -> Engine:
        shared = self.shared_url()
        if url is None:
            if shared is not None:
                raise VolumeError(f"{self.root} is a shared pool with its metadata in "
                                  f"{shared}: give --meta {shared}")
            try:
                return LmdbEngine(self.meta_dir, FAMILIES, map_size, readonly)
            except lmdb.Error as error:
                raise VolumeError(f"metadata in {self.meta_dir} cannot be opened ({error}); "
                                  f"check it with: kvfs fsck --data {self.root}") from None
        if (self.meta_dir / "data.mdb").exists():
            raise VolumeError(f"{self.root} keeps its metadata in {self.meta_dir} (one host): "
                              f"mount it without --meta")
        if shared is not None and shared != url:
            raise VolumeError(f"{self.root} is a shared pool with its metadata in {shared}, "
                              f"not {url}")
        from kvfs.engines.redis_engine import RedisEngine  # the client: only shared pools load it

        try:
            engine = RedisEngine(url) if deadline is None else RedisEngine(url, deadline)
        except ValueError as error:
            raise VolumeError(str(error)) from None
        except (FsError, OSError) as error:
            raise VolumeError(f"metadata engine {url} cannot be reached ({error})") from None
        if shared is None and not readonly:
            self.root.mkdir(parents=True, exist_ok=True)
            self.shared_path.write_text(f"{url}\n")
        return engine

    def pool_id(self) -> bytes | None:
        try:
            return (self.root / POOL_ID_NAME).read_bytes().strip() or None
        except FileNotFoundError:
            return None

    def _check_identity(self, engine: PoolEngine, url: str | None, rebuild: bool
                        ) -> bytes | None:
        """Refuse an engine that lost this pool; returns the identity it holds (b"": a pool
        made before pools had one; None: no pool)."""
        held, mine = engine.identity(), self.pool_id()
        if held is None and mine is not None and not rebuild:
            raise VolumeError(f"{url} no longer holds the pool of {self.root} (Redis came "
                              f"back empty?), so none of its files can be vouched for; run: "
                              f"kvfs fsck --data {self.root} --meta {url} --repair")
        if held and mine is not None and held != mine:
            raise VolumeError(f"{url} holds another pool than {self.root} (pool "
                              f"{held.decode()}, not {mine.decode()})")
        return held

    def _claim_identity(self, engine: PoolEngine, held: bytes | None) -> None:
        """Record the pool's identity in the engine and on the volume, and guard the
        engine's commits with it. A new pool (also one fsck rebuilds) gets a new one."""
        mine = self.pool_id()
        candidate = held or (mine if held == b"" and mine else os.urandom(8).hex().encode())
        pool = engine.claim_identity(candidate)
        if pool != mine:
            temporary = self.root / f"{POOL_ID_NAME}.{os.getpid()}"
            temporary.write_bytes(pool + b"\n")
            temporary.rename(self.root / POOL_ID_NAME)
        engine.guard(pool)

    def open_data(self, fsync: bool = False, session: bytes = b"") -> DataStore:
        return DataStore(self.root, fsync=fsync, session=session.hex())

    def record_mount(self, session: bytes, mountpoint: Path) -> None:
        """A shared pool's daemons have no lock: each says where its pid is (`kvfs umount`)."""
        self.mounts_dir.mkdir(exist_ok=True)
        (self.mounts_dir / session.hex()).write_text(f"{os.getpid()} {mountpoint}\n")

    def forget_mount(self, session: bytes) -> None:
        (self.mounts_dir / session.hex()).unlink(missing_ok=True)

    def daemon_pid(self, mountpoint: Path) -> int:
        """The pid of the daemon serving `mountpoint` from this volume (0: not known)."""
        if self.shared_url() is None:
            text = self.lock_path.read_text() if self.lock_path.exists() else ""
            return int(text.strip() or 0)
        # The newest session first: a crashed daemon's record stays until it is cleaned up.
        for record in sorted(self.mounts_dir.glob("*"), reverse=True):
            pid, _, where = record.read_text().strip().partition(" ")
            if Path(where) == mountpoint:
                return int(pid)
        return 0
