"""A shared pool's changes answered before Redis has them (`--write-behind MS`).

A store on a Redis pool is three changes (the create, the close's content commit and the
rename), each a commit script's round trip, and the close first syncs the file's data: ~2.6
ms at one thread, where the embedded engine takes ~0.5. With write-behind, a change whose reads
this host's memory answers (`RedisEngine.change_on_loop`) is answered at once and queued; a
thread of its own (`kvfs-behind`) sends the queue every MS milliseconds, or at once when a
caller waits for it (`settle`), as one batch: one `syncfs` of the volume if closes left their
data's sync to it (so that no host can see a name before its bytes are on the volume), then
one COMMIT_SCRIPT call checks and applies the changes in order and announces them; a batch
sent again after a reply that never came is answered as the first time (its token).

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
  removing a directory, every removal, a rename onto an existing name and a close that
  replaces content: what other hosts' changes build on, or what frees data on the change's
  word.
- What a crash may lose: every change is journaled before it is answered (`journal`: a
  copy into a mapped segment in the session's staging directory, kvfs/engines/changelog.py's format;
  no system call, no sync), and segments go once Redis has their changes. The host that
  reaps a dead session (kvfs/pool/reaper.py) applies what its journal holds past the last batch
  Redis took, checked as any batch: a daemon that dies, its machine up, loses nothing (a
  change another host made stale meanwhile is not applied: logged). After the machine itself
  went down the journal is not read (what it and the data it names kept is not known): the
  changes of the last MS milliseconds and the batch on its way are lost, as a local
  filesystem loses what was not synced; their staged data belongs to no committed file, and
  is deleted with the dead session. Redis unreachable: the queue waits and goes once Redis is
  back; callers that wait for it meanwhile get EIO, as any request that needs Redis does; an
  unmount that cannot send it leaves the session and its journal to the reaper.
- A host only stalled past its session's TTL is reaped as a dead one, its journal applied.
  Its batches' tokens are the sequence numbers of their last changes, the reaper's too, so
  when it wakes Redis answers the changes the reaper took TAKEN, applying the rest; this
  host reads those records again from Redis (`_send`), journals anew once it has rejoined
  (`rejournal`), and goes on.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol, Self, TypeVar, runtime_checkable

from kvfs.engines.changelog import ChangeLog
from kvfs.records import FsError

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_SECONDS = 8.0  # at unmount, for the queue to reach Redis
RETRY_SECONDS = 0.5  # after a batch Redis did not take
# A batch's answer per change (COMMIT_SCRIPT, kvfs/engines/redis_engine.py): found stale,
# applied, or sent already under this sender's name (by the reaper of this session, from its
# journal)
STALE, APPLIED, TAKEN = 0, 1, 2


class Answered(Protocol):
    """A change answered ahead of Redis (the shared engine's transaction): what the queue
    reads of it."""

    @property
    def function(self) -> Callable[[Self], object] | None:
        """What made the change, to make it again (`_redo`)."""
        ...

    def journaled(self) -> bytes:
        """Its entry in the journal."""
        ...

    def record_writes(self) -> list[tuple[bytes, bytes | None]]:
        """(Redis key, value or None) of each record it writes (counters aside)."""
        ...


C = TypeVar("C", bound=Answered)


class BatchEngine(Protocol[C]):
    """The engine whose changes the queue sends (the shared one, kvfs/engines/redis_engine.py): what
    the queue calls."""

    def change(self, change: Callable[[C], T]) -> T:
        """Make a change the long way (a worker's), committed before it returns."""
        ...

    def commit_batch(self, batch: list[C], token: bytes) -> list[int]:
        """Check and apply `batch` in one step: STALE, APPLIED or TAKEN per change."""
        ...

    def forget_ahead(self, change: C) -> None:
        """What `change` wrote, held otherwise by Redis now: out of the engine's cache."""
        ...

    def unsee_ahead(self, change: C) -> None:
        """... and out of this host's kernel."""
        ...

    def unreachable(self) -> bool:
        """Whether the last request found Redis unreachable."""
        ...


@runtime_checkable
class WritesBehind(Protocol):
    """An engine that answers changes ahead of its store (the shared one): what the daemon
    and the reaper ask of it."""

    def write_behind(self, gather_seconds: float, sync_volume: Callable[[], None],
                     journal: Path) -> WriteBehind[Any]:
        """Answer changes ahead of the pool from now on, sent in batches every
        `gather_seconds`, journaled in the directory `journal` (the session's staging
        directory); `sync_volume` flushes the data volume before a batch that follows
        closes. Returns the queue (closes leave their data's sync to it)."""
        ...

    def replay_behind(self, directory: Path, sender: bytes, same_boot: bool
                      ) -> tuple[int, int]:
        """(reaping a dead session) Apply what its write-behind journal in `directory`
        holds that Redis lacks, unless it comes from another boot; delete the journal.
        Returns (applied, not applied)."""
        ...


class WriteBehind(Generic[C]):
    """The queue of changes answered ahead of Redis, and the thread that sends it."""

    def __init__(self, engine: BatchEngine[C], gather_seconds: float,
                 sync_volume: Callable[[], None], journal: ChangeLog) -> None:
        self.engine = engine
        self.journal = journal  # (the loop appends, the sender releases: under `_cond`)
        self.gather_seconds = gather_seconds
        self.sync_volume = sync_volume
        self.records: dict[bytes, bytes | None] = {}  # what the queue wrote, newest value
        self._written_by: dict[bytes, int] = {}  # record -> the last change that wrote it
        self._queue: list[C] = []
        self._sending: list[C] = []  # the batch on its way: changes _settled + 1 ...
        self._answered = self._settled = 0  # changes answered; of those, in Redis
        self._unsynced = self._synced = 0  # closes that left their data's sync to a batch
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

    def queue(self, change: C) -> None:
        """(the loop) `change` is answered: it goes with the next batch, and this host reads
        its writes from now on."""
        with self._cond:
            self.journal.append(self._answered + 1, change.journaled())
            self._answered += 1
            for record, value in change.record_writes():
                self.records[record] = value
                self._written_by[record] = self._answered
            self._wake_sender()
            self._queue.append(change)
        self.answered += 1

    def data_left(self) -> None:
        """(the loop) A close left its data's sync to the next batch, which syncs the volume
        before any commit of this host's reaches Redis."""
        with self._cond:
            self._wake_sender()
            self._unsynced += 1

    def rejournal(self) -> None:
        """(the loop) This host was declared dead while it stalled: its reaper applied the
        journal and deleted it, and this host's later changes went to segments no longer
        named. Journal anew, in its staging directory (made again), what Redis may still
        lack: the batch on its way and the queue."""
        with self._cond:
            self.journal.drop_all()
            self.journal.start(self._settled + 1)
            for seq, change in enumerate(self._sending + self._queue, self._settled + 1):
                self.journal.append(seq, change.journaled())

    def _wake_sender(self) -> None:
        """(lock held, before adding work) Wake the sender if it waits for work; while it
        gathers a batch it sleeps on (a wake-up per change was a thread switch and a GIL
        hand-over per change)."""
        if not self._waiting():
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

    def sent(self, hurry: bool = True) -> bool:
        """`settle` for as long as it takes while Redis answers (a batch under conflicts
        may take seconds); False once Redis cannot be reached, or the sender has given up
        (closed: what it did not send stays journaled)."""
        while not self.settle(RETRY_SECONDS, hurry):
            if self.engine.unreachable() or not self._thread.is_alive():
                return False
        return True

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
                self._sending = batch
                answered, unsynced, self._hurry = self._answered, self._unsynced, False
            read_again = self._send_until_taken(batch, unsynced, b"%d" % answered)
            if read_again is None:
                return  # (closing, and Redis cannot be reached)
            for change in read_again:  # (the cache, then the queue, stop answering with it)
                self.engine.forget_ahead(change)
            sent = [record for change in batch for record, _ in change.record_writes()]
            with self._cond:  # (held briefly: the loop takes it to queue)
                for record in sent:
                    if self._written_by.get(record, answered + 1) <= answered:
                        del self._written_by[record], self.records[record]
                self._settled, self._synced, self._sending = answered, unsynced, []
                self.journal.release(answered)
                self._cond.notify_all()
            for change in read_again:
                self.engine.unsee_ahead(change)

    def _send_until_taken(self, batch: list[C], unsynced: int, token: bytes
                          ) -> list[C] | None:
        """Sync the volume if closes wait for it, then send `batch` until Redis takes it,
        with the same `token` each time (a try whose reply never came may have been applied:
        the script then answers as it did, applying nothing twice); the changes whose records
        are to be read again from Redis (`_send`). None if the mount closes while Redis cannot
        be reached (the journal keeps them)."""
        while True:
            try:
                if unsynced > self._synced:
                    self._sync_volume()
                return self._send(batch, token)
            except FsError as error:
                if error.errno == errno.ENOSPC:  # (Redis past its maxmemory refuses it)
                    log.error("Redis is past its maxmemory: %d metadata changes answered "
                              "ahead of it undone", len(batch))
                    self.lost += len(batch)
                    return batch
                if self._closing:  # (else Redis is unreachable: the batch goes again)
                    log.error("unmounted with %d metadata changes not in Redis (%s): the "
                              "host that reaps this session applies them (its journal)",
                              len(batch) + len(self._queue), error)
                    return None
                log.warning("%d metadata changes wait for Redis: %s", len(batch), error)
                time.sleep(RETRY_SECONDS)
            except Exception:  # (a bug: the batch is undone, the mount stays up)
                log.exception("a batch of %d metadata changes failed: undone", len(batch))
                self.lost += len(batch)
                return batch

    def _sync_volume(self) -> None:
        """Flush what the closes left to this batch to the volume with one `syncfs`: one
        journal commit and one device flush for all of them (N fresh 4 KiB files on ext4
        here, N = 8 / 32: 1.1-1.3 / 1.6-2.0 ms, against 4.2-4.8 / 17.5-19.6 ms for an
        `fdatasync` each, and 1.1-1.6 / 3.3 ms with their writeback started first, each sync
        still flushing the device: 818 / 860 stores a second against 967 / 1,103). The
        price: it also waits for the rest of this host's dirty data on the volume, which on a
        volume kvfs has to itself is data of files whose closes are coming (a batch behind
        512 MiB of another directory's writes took 200 ms). A failure is logged: the files'
        block sums find what did not reach the volume."""
        try:
            self.sync_volume()
        except OSError as error:
            log.error("syncing the volume failed: %s", error)

    def _send(self, batch: list[C], token: bytes) -> list[C]:
        """One batch: the changes in one script; those whose records Redis holds otherwise
        than they were answered: made again (redone or lost), or taken by the host that
        reaped this session while this one stalled (applied from the journal, or found
        stale there: not made again)."""
        if not batch:
            return []
        answers = self.engine.commit_batch(batch, token)
        self.batches += 1
        redone = [change for change, ok in zip(batch, answers, strict=True) if ok == STALE]
        taken = [change for change, ok in zip(batch, answers, strict=True) if ok == TAKEN]
        if taken:
            log.warning("%d metadata changes answered ahead of Redis were applied by the host "
                        "that reaped this session (from its journal) while it stalled",
                        len(taken))
        for change in redone:
            self._redo(change)
        return redone + taken

    def _redo(self, change: C) -> None:
        """A queued change that Redis found stale: made again from what Redis holds."""
        try:
            if change.function is not None:
                self.engine.change(change.function)
            self.redone += 1
        except Exception as error:
            self.lost += 1
            log.warning("a metadata change answered ahead of Redis could not be made: %s "
                        "(undone)", error)

    def close(self) -> bool:
        """Send what is queued (the thread ends once it has, or given up); whether all went.
        Then the journal goes; else it stays for the reaper."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=CLOSE_SECONDS)
        with self._cond:
            if self._thread.is_alive() or self._settled < self._answered:
                return False
            self.journal.drop_all()
            return True

    def counts(self) -> dict[str, int]:
        return dict(zip(COUNTS, (self.answered, self.batches, self.redone, self.lost,
                                 len(self._queue)), strict=True))


COUNTS = ("write_behind_answered", "write_behind_batches", "write_behind_redone",
          "write_behind_lost", "write_behind_queued")


def write_behind_counts(engine: object) -> dict[str, int]:
    """The counters of `engine`'s write-behind (zeros where it has none)."""
    behind = getattr(engine, "behind", None)
    return dict.fromkeys(COUNTS, 0) if behind is None else behind.counts()
