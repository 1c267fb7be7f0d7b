"""Counters of what the mount is doing, kept in memory by the daemon."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyfuse3

from kvfs.observe.clients import ClientTraffic
from kvfs.observe.latency import LATENCY_BOUNDS_US, METADATA_CALLS, RequestTimes

__all__ = ["LATENCY_BOUNDS_US", "RequestTimes", "Stats"]


@dataclass
class Stats:
    lookup_hits: int = 0
    lookup_misses: int = 0
    bytes_opened: int = 0  # committed content opened for reading, however it is then read
    bytes_committed: int = 0  # content writers committed (whoever moved the bytes)
    bytes_read: int = 0  # served by the daemon (not through the kernel's passthrough)
    bytes_written: int = 0  # received by the daemon (not written through passthrough)
    commits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0  # what those files took on the volume
    evicted_unused_bytes: int = 0  # of those, files nobody used after their last store
    checksum_errors: int = 0
    opens_passthrough: int = 0  # reads by the kernel straight from the blob
    opens_daemon: int = 0  # reads served (and verified per request) by kvfs
    write_opens_passthrough: int = 0  # writes by the kernel straight into the staged blob
    write_opens_daemon: int = 0  # writes served by kvfs
    opens_renewed: int = 0  # opens sent to a fresh kernel inode (kvfs/files/kernel_inodes.py)
    verified_bytes: int = 0  # read to verify blobs before passing them through
    verifications_skipped: int = 0  # blobs verified before and still wholly in memory
    verifications_joined: int = 0  # opens that waited for a check already under way
    prefetch_bytes: int = 0  # read and verified ahead of their opens, after lookups
    prefetch_used_bytes: int = 0  # of those, opened by a reader later
    prefetch_wasted_bytes: int = 0  # of those, not opened within a minute
    prefetch_over_budget: int = 0  # lookups not prefetched: the budget was spent
    hashed_after_close: int = 0  # kernel-written blobs whose sums were taken after the close
    handler_errors: int = 0  # unexpected exceptions answered with EIO
    volume_errors: int = 0  # errors of the volume underneath (EIO, ...) met by requests
    readahead_errors: int = 0  # readahead runs that failed (their readers retried)
    background_errors: int = 0  # failed rounds of eviction, recency flushes, data deletion
    sessions_reaped: int = 0  # shared pool: dead hosts this host cleaned up after
    sessions_lost: int = 0  # shared pool: times this host was declared dead while alive
    blobs_held: int = 0  # blobs this host has open now (in a shared pool, held for all to see)
    spare_staged_files: int = 0  # empty staged files made ahead for writers (kvfs/files/spares.py)
    blobs_publishing: int = 0  # committed blobs the publisher has yet to move into blobs/
    requests: RequestTimes = field(default_factory=RequestTimes)
    clients: ClientTraffic = field(default_factory=ClientTraffic)

    def as_dict(self) -> dict[str, object]:
        counters: dict[str, object] = {counter.name: getattr(self, counter.name)
                                       for counter in fields(self)
                                       if counter.name not in ("requests", "clients")}
        # GETXATTRs outside user.* the binding answers ENODATA itself (`requests` does not
        # count them)
        counters["foreign_xattrs_refused"] = pyfuse3.foreign_xattr_refusals()
        counters["requests"] = self.requests.as_dict()
        counters["metadata_calls"] = METADATA_CALLS.as_dict()
        counters["clients"] = self.clients.as_dict()
        return counters
