"""A shared pool's changes answered before Redis has them (`--write-behind MS`).

A store on a Redis pool is three changes (the create, the close's content commit and the
rename), each a commit script's round trip, and the close first syncs the file's data: ~2.6
ms at one thread, where the embedded engine takes ~0.5. With write-behind, a change whose reads
this host's memory answers (`RedisEngine.change_on_loop`) is answered at once and queued; a
thread of its own (`kvfs-behind`) sends the queue every MS milliseconds, or at once when a
caller waits for it (`settle`), as one batch: the files whose closes left their data's sync to
it are synced together (so that no host can see a name before its bytes are on the volume),
then one COMMIT_SCRIPT call checks and applies the changes in order and announces them.

- This host sees what it answered at once: the queued changes' records (`records`) are read
  before the record cache and Redis. Scans, counters and changes made the long way (in a
  worker) first wait until the queue is in Redis (`settle`), so that no listing, count or
  change of this host's is ahead of what it answered. (A loop change answered while such a
  change runs goes to Redis after it: if it read what that change wrote, the batch finds it
  stale, below.)
- A change the batch finds stale (another host changed what it read meanwhile) is made again
  from Redis, the long way, with the inode numbers, cookies and times it was answered with
  (`_redo`): a rename onto a name that another host stored meanwhile replaces that file, as if
  it came after it. A change that now fails (its file removed by another host, its name taken
  by another host's `O_EXCL` create in the same few milliseconds) is undone, logged and counted
  (`write_behind_lost`). Either way the names and attributes it wrote are read again from
  Redis, by this host's cache and kernel.
- Never answered ahead (the metadata store marks them, `Txn.agree_first`): creating, moving or
  removing a directory, and every removal: what other hosts' changes build on.
- What a crash may lose: a daemon killed with changes queued loses them (at most MS
  milliseconds of them, and the batch on its way); the staged data they named belongs to no
  committed file, and is deleted with the dead session. Redis unreachable: the queue waits
  and goes once Redis is back; callers that wait for it meanwhile get EIO, as any request
  that needs Redis does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvfs.records import FsError

if TYPE_CHECKING:
    from kvfs.redis_engine import RedisEngine, _Change

log = logging.getLogger(__name__)

CLOSE_SECONDS = 8.0  # at unmount, for the queue to reach Redis
RETRY_SECONDS = 0.5  # after a batch Redis did not take
SYNCERS = 4  # threads that sync a batch's files at once
SYNCFS_DIRTY_MAX = 16 << 20  # dirty page cache up to which a batch syncs the whole volume
_libc = ctypes.CDLL(None, use_errno=True)


class WriteBehind:
    """The queue of changes answered ahead of Redis, and the thread that sends it."""

    def __init__(self, engine: RedisEngine, gather_seconds: float) -> None:
        self.engine = engine
        self.gather_seconds = gather_seconds
        self.records: dict[bytes, bytes | None] = {}  # what the queue wrote, newest value
        self._written_by: dict[bytes, int] = {}  # record -> the last change that wrote it
        self._queue: list[_Change] = []
        self._answered = self._settled = 0  # changes answered; of those, in Redis
        self._to_sync: list[int] = []  # descriptors of files closes left to the next batch
        self._unsynced = self._synced = 0  # (how many so far, and of those synced)
        self._syncers = ThreadPoolExecutor(SYNCERS, thread_name_prefix="kvfs-behind-sync")
        self._hurry = False  # a caller waits: send without gathering
        self._closing = False
        self._cond = threading.Condition()
        self._thread_state = threading.local()
        self.answered = self.batches = self.redone = self.lost = 0
        self._thread = threading.Thread(target=self._run, name="kvfs-behind", daemon=True)
        self._thread.start()

    # -- the loop's side ------------------------------------------------------------------

    @property
    def open(self) -> bool:
        """Whether changes may be answered ahead (until `close`)."""
        return not self._closing

    def idle(self) -> bool:
        """Nothing queued, no data waiting for a sync: a change may commit directly."""
        return not self._queue and self._synced >= self._unsynced

    def queue(self, change: _Change) -> None:
        """(the loop) `change` is answered: it goes with the next batch, and this host reads
        its writes from now on."""
        with self._cond:
            self._answered += 1
            for record, value in change.record_writes():
                self.records[record] = value
                self._written_by[record] = self._answered
            self._queue.append(change)
            self._cond.notify()
        self.answered += 1

    def data_left(self, fd: int) -> None:
        """(the loop) A close left the sync of its file's data (`fd`, which the queue now
        owns) to the next batch, which syncs it before any commit of this host's reaches
        Redis."""
        with self._cond:
            self._to_sync.append(fd)
            self._unsynced += 1
            self._cond.notify()

    # -- waiting for the queue ------------------------------------------------------------

    def on_sender(self) -> bool:
        """Whether this thread is the sender (whose reads and redone changes go to Redis)."""
        return getattr(self._thread_state, "sender", False)

    def settle(self, timeout: float | None = None, hurry: bool = True) -> bool:
        """Wait until every change answered so far is in Redis (and what closes wrote before
        them on the volume), or `timeout` seconds pass; whether they are. `hurry`: the batch
        goes at once rather than when it has gathered."""
        if self.on_sender():
            return True
        with self._cond:
            answered, unsynced = self._answered, self._unsynced
            if self._settled >= answered and self._synced >= unsynced:
                return True
            if hurry:
                self._hurry = True
                self._cond.notify_all()
            return self._cond.wait_for(
                lambda: self._settled >= answered and self._synced >= unsynced, timeout)

    # -- the sender -----------------------------------------------------------------------

    def _waiting(self) -> bool:
        """(lock held) Whether there is anything to send or sync."""
        return bool(self._queue) or self._synced < self._unsynced

    def _run(self) -> None:
        self._thread_state.sender = True
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._waiting())
                if not self._closing:  # (let a batch gather, unless someone waits)
                    self._cond.wait_for(lambda: self._hurry or self._closing,
                                        self.gather_seconds)
                if not self._waiting():
                    return  # (closing)
                batch, self._queue = self._queue, []
                to_sync, self._to_sync = self._to_sync, []
                answered, unsynced, self._hurry = self._answered, self._unsynced, False
            try:
                self._sync(to_sync)
                redone = self._send(batch)
            except FsError as error:  # (Redis unreachable: the batch goes again, first)
                with self._cond:
                    self._queue[:0] = batch
                    if self._closing:
                        self.lost += len(self._queue)
                        log.error("unmounted with %d metadata changes not in Redis (%s): "
                                  "they are lost", len(self._queue), error)
                        return
                log.warning("%d metadata changes wait for Redis: %s", len(batch), error)
                time.sleep(RETRY_SECONDS)
                continue
            except Exception:  # (a bug: the batch is undone, the mount stays up)
                log.exception("a batch of %d metadata changes failed: undone", len(batch))
                self.lost += len(batch)
                redone = batch
            for change in redone:  # (the cache, then the queue, stop answering with it)
                self.engine.forget_ahead(change)
            with self._cond:
                for change in batch:
                    for record, _ in change.record_writes():
                        if self._written_by.get(record, answered + 1) <= answered:
                            del self._written_by[record], self.records[record]
                self._settled, self._synced = answered, unsynced
                self._cond.notify_all()
            for change in redone:
                self.engine.unsee_ahead(change)

    def _sync(self, descriptors: list[int]) -> None:
        """Flush these files' data to the volume, then close them: one `syncfs` of the
        volume while the machine holds little dirty data (32 fresh 4 KiB files on ext4 here:
        1.1-1.7 ms, one journal commit), else an `fdatasync` of each, all at once (6 ms for
        those 32, 19 ms one after another; a `syncfs` would wait for every other writer's
        dirty data too: 200 ms behind 512 MiB of chunk writes). A failure is logged: the
        files' block sums find what did not reach the volume."""
        if not descriptors:
            return
        if _dirty_bytes() <= SYNCFS_DIRTY_MAX:
            error = _syncfs(descriptors[0])
            for fd in descriptors:
                os.close(fd)
            errors = [error] * len(descriptors)
        else:
            errors = list(self._syncers.map(_sync_and_close, descriptors))
        for fd, error in zip(descriptors, errors, strict=True):
            if error is not None:
                log.error("syncing a written file (descriptor %d) failed: %s", fd, error)

    def _send(self, batch: list[_Change]) -> list[_Change]:
        """One batch: the changes in one script; those that had to be made again (redone or
        lost)."""
        if not batch:
            return []
        applied = self.engine.commit_batch(batch)
        self.batches += 1
        redone = [change for change, ok in zip(batch, applied, strict=True) if not ok]
        for change in redone:
            self._redo(change)
        return redone

    def _redo(self, change: _Change) -> None:
        """A queued change that Redis found stale: made again from what Redis holds (unless
        it is there already: a batch sent again after a reply that did not come)."""
        try:
            if change.function is not None and not self.engine.holds_writes(change):
                self.engine.change(change.function)
            self.redone += 1
        except Exception as error:
            self.lost += 1
            log.warning("a metadata change answered ahead of Redis could not be made: %s "
                        "(undone)", error)

    def close(self) -> None:
        """Send what is queued (the thread ends once it has, or given up)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=CLOSE_SECONDS)
        self._syncers.shutdown(wait=False)

    def counts(self) -> dict[str, int]:
        return {"write_behind_answered": self.answered, "write_behind_batches": self.batches,
                "write_behind_redone": self.redone, "write_behind_lost": self.lost,
                "write_behind_queued": len(self._queue)}


def _dirty_bytes() -> int:
    """The machine's dirty page cache (/proc/meminfo; unknown: as if much)."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"Dirty:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return SYNCFS_DIRTY_MAX + 1


def _syncfs(fd: int) -> OSError | None:
    if _libc.syncfs(fd):
        error = ctypes.get_errno()
        return OSError(error, os.strerror(error))
    return None


def _sync_and_close(fd: int) -> OSError | None:
    try:
        os.fdatasync(fd)
    except OSError as error:
        return error
    finally:
        os.close(fd)
    return None


def write_behind_counts(engine: object) -> dict[str, int]:
    """The counters of `engine`'s write-behind (zeros where it has none)."""
    behind = getattr(engine, "behind", None)
    if behind is None:
        return dict.fromkeys(("write_behind_answered", "write_behind_batches",
                              "write_behind_redone", "write_behind_lost",
                              "write_behind_queued"), 0)
    return behind.counts()
