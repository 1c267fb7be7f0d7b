"""Deleting what nothing names any more: the one set of rules for the daemon on one host, the
hosts of a shared pool, crash recovery and fsck (all blocking: worker threads or off-line).

- Doomed blobs (replaced or removed in a metadata change): their data files are deleted, then
  their records. In a shared pool a blob some host still holds open, or still publishes from
  its staging directory, is left for a later sweep.
- A session that ended without unmounting (a host that died; at recovery or fsck, every
  session of the pool): its staging directory is rolled forward (committed blobs published,
  the rest deleted); files whose block sums it had not taken yet are kept, to be hashed, if it
  ran in this machine's boot (their bytes are in this page cache or on the volume), and
  dropped otherwise (they may never have reached the volume: a miss, never a wrong chunk).
  Its holds go with its session record, which the reaper claims (removes) first.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvfs.data.store import DataStore
from kvfs.data.volume import Volume, boot_id
from kvfs.meta import MetaStore

log = logging.getLogger(__name__)


def reap_doomed(meta: MetaStore, data: DataStore, candidates: Iterable[int] | None = None
                ) -> int:
    """Delete the data files of doomed blobs, then their records: `candidates` (the blobs a
    host just freed), or every doomed blob. Returns how many went."""
    doomed = list(candidates) if candidates is not None else meta.content.doomed()
    if meta.engine.shared:
        doomed = [blob_id for blob_id in doomed
                  if not meta.pool.holders(blob_id) and not data.staged_anywhere(blob_id)]
    for blob_id in doomed:
        data.remove(blob_id)
    meta.content.reaped(doomed)
    return len(doomed)


@dataclass(frozen=True)
class Leftovers:
    """What a session that ended without unmounting left, and what became of it."""

    published: int  # committed blobs moved from its staging directory into blobs/
    discarded: int  # staged data no commit named
    to_hash: list[int]  # blobs whose sums are still to be taken (it ran in this boot)
    dropped: int  # files dropped because their sums were never taken (another boot)


def reap_session(meta: MetaStore, data: DataStore, volume: Volume, session: bytes,
                 record: dict) -> Leftovers | None:
    """Clean up after the dead `session`; `record`: what it registered (host, pid, boot).
    None if another reaper claimed it first."""
    directory = data.staging_root / session.hex()
    same_boot = record.get("boot") == boot_id()
    if not meta.pool.end_session(session):
        return None
    published, discarded = (data.recover(meta.content.is_committed_blob, directory)
                            if directory.is_dir() else (0, 0))
    pending = meta.content.pending(session)
    if pending and not same_boot:
        meta.content.drop_files({ino for _, ino in pending})
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:  # (its host was only stalled, and is back staging there)
        if error.errno != errno.ENOTEMPTY:
            raise
    volume.forget_mount(session)
    leftovers = Leftovers(published, discarded,
                          [blob_id for blob_id, _ in pending] if same_boot else [],
                          0 if same_boot else len(pending))
    log.warning("host %s (pid %s, session %s) stopped: %d staged blobs published, %d "
                "discarded, %d files with pending sums %s", record.get("host"),
                record.get("pid"), session.hex(), published, discarded, len(pending),
                "to hash" if same_boot else "dropped (another boot)")
    return leftovers


def recover(meta: MetaStore, data: DataStore, volume: Volume) -> list[int]:
    """Finish what a crash interrupted, before a mount or by fsck: staged blobs, sessions
    (every session of a shared pool: all its hosts are gone), unlinks. Touches no committed
    data, except files the kernel wrote whose sums were still to be taken when the machine
    went down. Returns the blobs whose sums are still to be taken (same boot)."""
    published, discarded = data.recover(meta.content.is_committed_blob)
    to_hash: list[int] = []
    for session, raw in meta.pool.sessions().items():
        reaped = reap_session(meta, data, volume, session, json.loads(raw))
        if reaped is not None:
            to_hash += reaped.to_hash
    meta.pool.drop_claims(set())  # (no host runs: no writer holds room)
    pending = meta.content.pending()
    this_boot = boot_id().encode()
    rebooted = meta.pool.swap_boot(this_boot) != this_boot
    if pending and rebooted:
        meta.content.drop_files({ino for _, ino in pending})
        log.warning("recovery: %d files written just before a reboot dropped (their "
                    "checksums were not taken yet)", len(pending))
    unlinks = reap_doomed(meta, data)
    if published or discarded or unlinks:
        log.info("recovery: %d staged blobs published, %d discarded, %d unlinks finished",
                 published, discarded, unlinks)
    return to_hash + ([] if rebooted else [blob_id for blob_id, _ in pending])
