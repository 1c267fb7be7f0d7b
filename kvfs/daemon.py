"""Mount lifecycle: checks, daemonizing, serving, clean shutdown (the volume's lock and
recovery are kvfs/data/volume.py's)."""

from __future__ import annotations

import contextlib
import errno
import logging
import logging.handlers
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyfuse3
import trio

from kvfs.data.cache import DEFAULT_CACHE_BYTES, DEFAULT_READAHEAD_BYTES, BlockCache
from kvfs.data.verify import LateHasher, Verifier, VerifyMode
from kvfs.data.volume import DEFAULT_DATA_DIR, Volume, VolumeError
from kvfs.data.volume_helper import VolumeHelper
from kvfs.engines.redis_layout import DEFAULT_DEADLINE
from kvfs.files import Contents, FileState, FileTable, Retirer, Writer
from kvfs.files.kernel_inodes import KernelInodes
from kvfs.files.passthrough import Passthrough
from kvfs.files.prefetch import DEFAULT_BUDGET as DEFAULT_PREFETCH_BUDGET
from kvfs.files.prefetch import Prefetcher
from kvfs.files.spares import SpareFiles, SpareMode
from kvfs.fuse import tuning
from kvfs.fuse.control import snapshot
from kvfs.fuse.keeper import (
    GENERATION_SHIFT,
    TAKEOVER_SECONDS,
    KeeperLink,
    Takeover,
    start_keeper,
    take_over,
)
from kvfs.fuse.mounts import find_mount
from kvfs.fuse.notifier import KernelNotifier
from kvfs.fuse.operations import KvfsOperations
from kvfs.meta import DEFAULT_MAP_SIZE, Removed
from kvfs.meta.calls import MetaCalls
from kvfs.observe.loads import LoadMeter
from kvfs.observe.metrics import serve_metrics
from kvfs.observe.stats import Stats
from kvfs.pool.reaper import recover
from kvfs.pool.sessions import DEFAULT_TTL, Session, new_session_id
from kvfs.pool.space import Space
from kvfs.records import FsError

log = logging.getLogger("kvfs")

class MountError(VolumeError):
    """A reason not to mount, shown to the user as one line."""


@dataclass
class MountConfig:
    mountpoint: Path
    data: Path = DEFAULT_DATA_DIR
    capacity: int | None = None
    foreground: bool = False
    debug: bool = False
    allow_other: bool = False
    fsync: bool = False
    cache_bytes: int = DEFAULT_CACHE_BYTES
    readahead_bytes: int = DEFAULT_READAHEAD_BYTES
    read_ahead_kb: int = tuning.DEFAULT_READ_AHEAD_KB
    max_background: int = tuning.DEFAULT_MAX_BACKGROUND
    meta_url: str | None = None  # a shared engine (redis://...); None: LMDB in DATA/meta
    session_ttl: float = DEFAULT_TTL
    deadline: float = DEFAULT_DEADLINE  # seconds a request may wait on the shared engine
    meta_map_size: int = DEFAULT_MAP_SIZE
    log_file: Path | None = None
    syslog: bool = False
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    passthrough: bool = True  # kernel passthrough where available (--passthrough auto)
    verify: VerifyMode = VerifyMode.ONCE  # ALWAYS: the daemon serves every byte
    odirect: str = "kernel"  # "daemon": O_DIRECT opens are served by kvfs
    prefetch_bytes: int = DEFAULT_PREFETCH_BUDGET  # prefetch from lookups; 0: off
    spares: SpareMode = SpareMode.ON  # staged files made ahead (kvfs/files/spares.py)
    takeover_wait: float = TAKEOVER_SECONDS  # for the next daemon (kvfs/fuse/keeper.py)


DEAD_CONNECTION = (errno.ENOTCONN, errno.ECONNABORTED)  # a FUSE mount whose daemon is gone


def check_mountpoint(path: Path) -> None:
    entry = find_mount(path)
    cleared = False
    if entry is not None:
        if entry.fstype != "fuse.kvfs" or connected(path):
            raise MountError(f"mountpoint {path} is already mounted")
        clear_dead_mount(path)
        cleared = True
    try:
        if not path.is_dir():
            raise MountError(f"mountpoint {path} is not a directory" if path.exists()
                             else f"mountpoint {path} does not exist")
    except OSError as error:
        if error.errno in DEAD_CONNECTION:
            raise MountError(f"mountpoint {path} is a dead mount of another file system; "
                             f"run: fusermount3 -u {path}") from None
        raise MountError(f"mountpoint {path}: {error.strerror}") from None
    if not any(path.iterdir()):
        return
    if not cleared:
        raise MountError(f"mountpoint {path} is not empty")
    # Engines that went on storing while no kvfs served the path wrote into the bare
    # directory: refusing it would keep them writing there, on the disk underneath.
    log.warning("mountpoint %s: what engines wrote into it while no kvfs served it is hidden "
                "under the new mount (on the disk underneath)", path)


def connected(path: Path) -> bool:
    """Whether a daemon serves the FUSE mount at `path` (statfs is never answered from the
    kernel's caches)."""
    try:
        os.statvfs(path)
    except OSError as error:
        return error.errno not in DEAD_CONNECTION
    return True


def clear_dead_mount(path: Path) -> None:
    """Lazily unmount the kvfs mount at `path` whose daemon is gone (killed, crashed, and no
    keeper holds its connection: kvfs/fuse/keeper.py), as the next daemon must before it
    mounts there: the restart a supervisor makes is then the same command. What processes
    had open on the dead mount keeps failing; their new opens reach the new mount."""
    result = subprocess.run(["fusermount3", "-u", "-z", str(path)], capture_output=True,
                            text=True)
    if result.returncode:
        raise MountError(f"mountpoint {path} is a dead kvfs mount that fusermount3 could not "
                         f"clear: {result.stderr.strip() or result.returncode}")
    log.warning("cleared the dead kvfs mount at %s (its daemon is gone)", path)


@contextlib.contextmanager
def logging_set_up(config: MountConfig) -> Iterator[None]:
    """Log records go through a queue to a thread that writes them: a log on a volume whose
    writes block (frozen, its path lost) holds up that thread, never the request loop."""
    level = logging.DEBUG if config.debug else logging.INFO
    if config.foreground:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    elif config.syslog:
        handler = logging.handlers.SysLogHandler(address="/dev/log")
    else:
        handler = logging.FileHandler(config.log_file or Volume(config.data).log_path)
    # The pid tells apart the daemons of a shared pool that log into one DATA/kvfs.log.
    handler.setFormatter(logging.Formatter(
        "%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s"))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    enqueue = logging.handlers.QueueHandler(records)
    enqueue.setFormatter(logging.Formatter("%(message)s"))  # (the writer's formats the line)
    logging.basicConfig(level=level, handlers=[enqueue], force=True)
    writer = logging.handlers.QueueListener(records, handler)
    writer.start()
    try:
        yield
    finally:
        writer.stop()  # (what was logged is written before the process ends)


class Daemon:
    """One mounted kvfs: the stores, the FUSE session and its event loop."""

    def __init__(self, config: MountConfig, takeover: Takeover | None = None) -> None:
        self.config = config
        # A daemon taking the connection over from the keeper hands out file handles and node
        # ids apart from those its predecessors gave the kernel, which still holds them.
        self.takeover = takeover
        numbers_from = takeover.generation << GENERATION_SHIFT if takeover else 0
        self.keeper: KeeperLink | None = takeover.link if takeover else None
        self.volume = Volume(config.data)
        self.meta = self.volume.open_metadata(config.meta_url, config.meta_map_size,
                                              deadline=config.deadline)
        self.shared = self.meta.engine.shared
        session_id = new_session_id(self.meta)
        # Other hosts read a file from the shared volume, not from this host's page cache:
        # its data is flushed there before the commit that shows it to them.
        self.data = self.volume.open_data(config.fsync or self.shared, session_id)
        # One host recovers its own crash now; in a shared pool every mount is a new
        # session, and dead ones are cleaned up by whichever live host claims them first.
        pending = [] if self.shared else recover(self.meta, self.data, self.volume)
        if config.capacity is not None:
            self.meta.recency.set_capacity(config.capacity)
        elif not self.meta.recency.capacity():
            self.meta.recency.set_capacity(shutil.disk_usage(config.data).free)
        self.stats = Stats()
        self.session = Session(self.volume, self.meta, self.data, self.stats,
                               config.mountpoint, config.session_ttl)
        self.kernel = KernelInodes(numbers_from,
                                   self.meta.core.next_id() if takeover else 0)
        self.notifier = KernelNotifier(self.kernel)
        self.space = Space(self.meta, config.data, self.stats, self.session,
                           open_inodes=self._open_inodes, evicted=self._evicted,
                           deletions_done=self._deletions_done)
        self.cache = BlockCache(self.data, self.stats, config.cache_bytes,
                                config.readahead_bytes)
        self.passthrough = Passthrough(
            "--verify always" if config.verify is VerifyMode.ALWAYS
            else "" if config.passthrough else "--passthrough off",
            o_direct=config.odirect == "kernel")
        self.helper = start_volume_helper()
        self.files = self._file_table(config, numbers_from)
        self.session.on_lost = self._session_lost
        self.files.verifier.load(self.volume.verified_path(self.shared))
        self.files.prefetcher.load_direct_readers(self.volume.direct_readers_path(self.shared))
        for blob_id in pending:
            self.files.hasher.want(blob_id)
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.operations = KvfsOperations(self.meta, self.files, self.space, self.stats,
                                         self.notifier, self.passthrough, numbers_from,
                                         on_kernel_init=self._kernel_init)

    def _kernel_init(self, request: bytes) -> None:
        if self.keeper is not None:
            self.keeper.kernel_init(request)

    def _file_table(self, config: MountConfig, numbers_from: int) -> FileTable:
        """The open-file table and its parts (kvfs/files/__init__.py), each given the parts
        it calls."""
        meta_call = MetaCalls(self.meta.engine)

        async def take_blob_ids(count: int) -> range:  # (fresh ones, to name staged files)
            return await meta_call(self.meta.content.allocate_blob_ids, count)

        verifier = Verifier(self.data, self.stats, config.verify)
        hasher = LateHasher(self.data, self.meta, verifier, self.stats)
        spares = SpareFiles(self.data, self.helper if config.spares is SpareMode.ON else None,
                            self.stats, take_blob_ids)
        state = FileState(self.meta, numbers_from)
        retirer = Retirer(state, self.meta, self.data, self.cache, verifier, self.session,
                          self.kernel, self.stats, on_removed=self.notifier.names_removed)
        writer = Writer(state, retirer, self.meta, self.data, self.space, self.session,
                        self.stats, verifier, hasher, spares, self.helper,
                        take_blob_ids, on_attributes_changed=self.notifier.attributes_changed,
                        on_committed=self.notifier.committed)
        content = Contents(self.meta, self.data, self.session, verifier, hasher, retirer)
        prefetcher = Prefetcher(self.meta, self.data, verifier, self.session, self.stats,
                                config.prefetch_bytes)
        return FileTable(state, writer, retirer, content, meta=self.meta, data=self.data,
                         cache=self.cache, space=self.space, session=self.session,
                         stats=self.stats, passthrough=self.passthrough, kernel=self.kernel,
                         verifier=verifier, prefetcher=prefetcher, loads=LoadMeter())

    def _session_lost(self) -> None:
        self.files.session_lost()
        self.space.session_lost()

    def _open_inodes(self) -> frozenset[int]:
        return self.files.open_inodes()

    async def _evicted(self, removed: list[Removed]) -> None:
        await self.files.evicted(removed)

    async def _deletions_done(self) -> bool:
        return await self.files.deletions_done()

    def mount(self) -> None:
        options = set(pyfuse3.default_options)
        if not self.config.allow_other and os.geteuid() == 0:
            # Root's processes alone reach this mount (without allow_other the kernel keeps
            # every other user out), and root passes every permission check but execute,
            # which the kernel makes without the option too. The kernel's checks would cost
            # a GETATTR of the directory before each create or rename in it (they need its
            # mode, which the previous change there marked stale): two of a store's requests.
            # `KvfsOperations.access` answers access(2) and chdir.
            options.discard("default_permissions")
        options |= {f"fsname=kvfs:{self.config.data}", "subtype=kvfs"}
        if self.config.allow_other:
            options.add("allow_other")
        if self.config.debug:
            options.add("debug")
        if self.takeover is not None:
            self._take_over(options)
        else:
            try:
                pyfuse3.init(self.operations, str(self.config.mountpoint), options)
            except RuntimeError as error:
                raise MountError(f"cannot mount {self.config.mountpoint}: {error}") from None
            self.keeper = start_keeper(pyfuse3.get_session_fd(), self.config.mountpoint,
                                       self.config.takeover_wait, self._log_file())
        log.info("mounted %s at %s (capacity %d bytes)", self.config.data,
                 self.config.mountpoint, self.meta.recency.capacity())
        # Now that there is a kernel session to tell: other hosts' changes invalidate its
        # caches of names and attributes.
        self.meta.namespace.watch_others(self.notifier.others_changed_name,
                               self.notifier.attributes_changed)
        if self.config.metrics_port is not None:
            try:
                serve_metrics(self._snapshot, self.stats.requests, self.config.metrics_port,
                              self.config.metrics_address)
            except OSError as error:
                pyfuse3.close(unmount=True)
                raise MountError(f"cannot serve metrics on {self.config.metrics_address}:"
                                 f"{self.config.metrics_port}: {error.strerror}") from None

    def _take_over(self, options: set[str]) -> None:
        """Serve the connection a dead daemon left to the keeper (kvfs/fuse/keeper.py)."""
        assert self.takeover is not None
        try:
            pyfuse3.init(self.operations, f"/dev/fd/{self.takeover.fuse_fd}", options)
        except RuntimeError as error:
            raise MountError(f"cannot take {self.config.mountpoint} over: {error}") from None
        resent = pyfuse3.resume(self.takeover.init_request)
        log.warning("took over %s from its keeper (daemon %d of the connection); requests "
                    "the last one had read: %s", self.config.mountpoint,
                    self.takeover.generation + 1,
                    "sent again" if resent == 0 else f"lost ({os.strerror(resent)})")

    def _log_file(self) -> Path | None:
        """Where the keeper logs: the daemon's log file, or (foreground) its stderr."""
        if self.config.foreground:
            return None
        return self.config.log_file or self.volume.log_path

    def _snapshot(self) -> dict:
        """For the metrics server's thread: the loop takes the snapshot."""
        if self._trio_token is None:
            raise RuntimeError("the mount is not serving yet")
        return trio.from_thread.run(snapshot, self.meta, self.space, self.stats,
                                    self.passthrough, self.config.verify, self.files.loads,
                                    trio_token=self._trio_token)

    async def serve(self) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signal, nursery.cancel_scope)
            nursery.start_soon(trio.to_thread.run_sync, self._tune_kernel)
            nursery.start_soon(self.space.run)  # first: the capacity may have shrunk
            nursery.start_soon(self.files.run_reaper)
            nursery.start_soon(self.files.run_publisher)
            nursery.start_soon(self.files.hasher.run)
            nursery.start_soon(self.files.spares.run)
            nursery.start_soon(self.files.prefetcher.run)
            nursery.start_soon(self.session.run, self.files.hasher.want)
            nursery.start_soon(self.session.sweep_doomed)
            nursery.start_soon(self.session.send_releases)
            self.cache.start(nursery)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()

    async def _stop_on_signal(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("signal %d: unmounting", signum)
                pyfuse3.terminate()
                return

    def _tune_kernel(self) -> None:
        tuning.tune_mount(self.config.mountpoint, self.config.read_ahead_kb,
                          self.config.max_background)

    def close(self) -> None:
        self.notifier.stop()  # before the session it notifies goes
        if self.keeper is not None:
            self.keeper.leaving()
        if self.takeover is not None:  # libfuse unmounts only what it mounted itself
            subprocess.run(["fusermount3", "-u", "-z", str(self.config.mountpoint)],
                           capture_output=True, check=False)
        pyfuse3.close(unmount=True)
        try:
            self.meta.recency.record_uses(self.space.take_uses())
            self.files.hasher.take_remaining_sums()
            self.files.publish_remaining()
            self.files.reap_remaining()
            if self.shared:
                self._leave_pool()
            else:
                self.meta.pool.end_claim()
        except FsError as error:  # a shared engine out of reach: others finish the work
            log.error("unmounted without finishing (%s): recovery, or another host, "
                      "completes it", error)
        if self.helper is not None:
            self.helper.close()
        try:
            self.files.verifier.save(self.volume.verified_path(self.shared))
            self.files.prefetcher.save_direct_readers(
                self.volume.direct_readers_path(self.shared))
        except OSError as error:
            log.warning("verification marks not kept: %s", error)
        self.meta.engine.sync()
        self.meta.close()
        log.info("unmounted %s", self.config.mountpoint)

    def _leave_pool(self) -> None:
        """A clean unmount of a shared pool: what this host doomed and nobody holds goes
        now, its session record and staging directory go (others need not clean up)."""
        try:
            self.session.end()
        except (OSError, FsError) as error:
            log.warning("leaving the pool: %s (another host cleans up after this session)",
                        error)


def start_volume_helper() -> VolumeHelper | None:
    """The volume helper process (kvfs/data/volume_helper.py); None if it cannot start: the loop
    then creates writers' staged files and publishes their blobs itself."""
    try:
        return VolumeHelper()
    except OSError as error:
        log.warning("the volume helper process cannot start (%s): the request loop creates "
                    "and publishes staged files itself", error)
        return None


def run(config: MountConfig) -> None:
    """Mount and serve; without `foreground`, return once the mount is live (daemon forked)."""
    try:
        # (the mountpoint's parent: a mount whose daemon is gone makes a lookup of the
        # mountpoint itself wait for the next daemon, while its keeper holds it)
        mountpoint = Path(os.path.abspath(config.mountpoint))
        config.mountpoint = mountpoint.parent.resolve() / mountpoint.name
        config.data = config.data.resolve()
    except OSError as error:
        raise MountError(f"cannot resolve paths: {error.strerror}") from None
    takeover = take_over(config.mountpoint)  # a dead daemon's connection, kept
    if takeover is None:
        check_mountpoint(config.mountpoint)
    lock_fd = Volume(config.data).lock(exclusive=config.meta_url is None)
    if config.foreground:
        if config.meta_url is None:
            Volume.record_pid(lock_fd)
        with logging_set_up(config):
            _serve(config, takeover)
        return
    read_end, write_end = os.pipe()
    child = os.fork()
    if child:
        os.close(write_end)
        os.close(lock_fd)
        with os.fdopen(read_end) as report:
            message = report.read().strip()
        if message != "ok":
            os.waitpid(child, 0)
            raise MountError(message or "kvfs daemon exited during start-up")
        return
    os.close(read_end)
    os.setsid()
    if config.meta_url is None:
        Volume.record_pid(lock_fd)
    code = 0
    try:
        with logging_set_up(config):
            try:
                _serve(config, takeover, ready_fd=write_end)
            except VolumeError as error:
                os.write(write_end, str(error).encode())
                code = 1
            except BaseException as error:
                log.exception("kvfs daemon failed")
                with contextlib.suppress(OSError):  # start-up failed: tell the parent why
                    os.write(write_end, f"kvfs daemon failed: {error!r}".encode())
                code = 1
    finally:
        os._exit(code)


def _serve(config: MountConfig, takeover: Takeover | None,
           ready_fd: int | None = None) -> None:
    # Every open handle holds one or two descriptors, and spare staged files are kept open:
    # a file server takes all the descriptors it may (the soft limit is often 1,024).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    daemon = Daemon(config, takeover)
    daemon.mount()
    if ready_fd is not None:
        os.write(ready_fd, b"ok")
        os.close(ready_fd)
        _detach_stdio()
    try:
        trio.run(daemon.serve)
    finally:
        daemon.close()


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
