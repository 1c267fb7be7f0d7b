"""Counters of what the mount is doing, kept in memory by the daemon."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyfuse3

# Upper bounds of the request-latency buckets, microseconds: powers of two, 16 µs to 1 s.
LATENCY_BOUNDS_US = tuple(1 << power for power in range(4, 21))
_OVERFLOW = len(LATENCY_BOUNDS_US)  # the bucket past the last bound


class RequestTimes:
    """How long the daemon took to answer each kind of request: from its handler's start to
    its answer (pyfuse3's dispatch and the kernel's round trip, tens of µs, come on top)."""

    def __init__(self) -> None:
        self._buckets: dict[str, list[int]] = {}  # request -> counts per bound, then overflow
        self._seconds: dict[str, float] = {}

    def record(self, request: str, elapsed_ns: int) -> None:
        """(No lock: handlers record on the loop, one at a time.)"""
        bucket = (elapsed_ns // 1000 - 1).bit_length() - 4
        buckets = self._buckets.get(request)
        if buckets is None:
            buckets = self._buckets[request] = [0] * (_OVERFLOW + 1)
            self._seconds[request] = 0.0
        buckets[0 if bucket < 0 else bucket if bucket < _OVERFLOW else _OVERFLOW] += 1
        self._seconds[request] += elapsed_ns / 1e9

    def answered(self) -> int:
        """Requests of every kind answered so far."""
        return sum(sum(buckets) for buckets in list(self._buckets.values()))

    def histograms(self) -> dict[str, tuple[list[int], float]]:
        """request -> (counts per bucket of LATENCY_BOUNDS_US then overflow, total seconds);
        also from another thread (the metrics server's): list() copies in one C call."""
        return {request: (list(buckets), self._seconds.get(request, 0.0))
                for request, buckets in list(self._buckets.items())}

    def as_dict(self) -> dict[str, dict[str, float | None]]:
        return {request: {"count": sum(buckets), "seconds": round(seconds, 6),
                          "p50_us": _quantile(buckets, 0.5), "p99_us": _quantile(buckets, 0.99)}
                for request, (buckets, seconds) in sorted(self.histograms().items())}


def _quantile(buckets: list[int], share: float) -> int | None:
    """The bucket bound under which `share` of the requests were answered (None: above all)."""
    wanted, seen = share * sum(buckets), 0
    for bound, count in zip(LATENCY_BOUNDS_US, buckets, strict=False):
        seen += count
        if seen >= wanted:
            return bound
    return None


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

    def as_dict(self) -> dict[str, object]:
        counters: dict[str, object] = {counter.name: getattr(self, counter.name)
                                       for counter in fields(self) if counter.name != "requests"}
        # GETXATTRs outside user.* the binding answers ENODATA itself (`requests` does not
        # count them)
        counters["foreign_xattrs_refused"] = pyfuse3.foreign_xattr_refusals()
        counters["requests"] = self.requests.as_dict()
        return counters
