"""Latency histograms kept in memory: of FUSE requests (`Stats.requests`) and of metadata
calls (`METADATA_CALLS`), shown in `.kvfs/stats` and as Prometheus histograms."""

from __future__ import annotations

# Upper bounds of the latency buckets, microseconds: powers of two, 16 µs to 1 s.
LATENCY_BOUNDS_US = tuple(1 << power for power in range(4, 21))
_OVERFLOW = len(LATENCY_BOUNDS_US)  # the bucket past the last bound


class RequestTimes:
    """How long each kind of call took, in buckets. For FUSE requests: from a handler's start
    to its answer (pyfuse3's dispatch and the kernel's round trip, tens of µs, come on top)."""

    def __init__(self) -> None:
        self._buckets: dict[str, list[int]] = {}  # kind -> counts per bound, then overflow
        self._seconds: dict[str, float] = {}

    def record(self, request: str, elapsed_ns: int) -> None:
        """(No lock: callers record on the loop, one at a time.)"""
        bucket = (elapsed_ns // 1000 - 1).bit_length() - 4
        buckets = self._buckets.get(request)
        if buckets is None:
            buckets = self._buckets[request] = [0] * (_OVERFLOW + 1)
            self._seconds[request] = 0.0
        buckets[0 if bucket < 0 else bucket if bucket < _OVERFLOW else _OVERFLOW] += 1
        self._seconds[request] += elapsed_ns / 1e9

    def answered(self) -> int:
        """Calls of every kind recorded so far."""
        return sum(sum(buckets) for buckets in list(self._buckets.values()))

    def histograms(self) -> dict[str, tuple[list[int], float]]:
        """kind -> (counts per bucket of LATENCY_BOUNDS_US then overflow, total seconds);
        also from another thread (the metrics server's): list() copies in one C call."""
        return {request: (list(buckets), self._seconds.get(request, 0.0))
                for request, buckets in list(self._buckets.items())}

    def as_dict(self) -> dict[str, dict[str, float | None]]:
        return {request: {"count": sum(buckets), "seconds": round(seconds, 6),
                          "p50_us": _quantile(buckets, 0.5), "p99_us": _quantile(buckets, 0.99)}
                for request, (buckets, seconds) in sorted(self.histograms().items())}


def _quantile(buckets: list[int], share: float) -> int | None:
    """The bucket bound under which `share` of the calls were answered (None: above all)."""
    wanted, seen = share * sum(buckets), 0
    for bound, count in zip(LATENCY_BOUNDS_US, buckets, strict=False):
        seen += count
        if seen >= wanted:
            return bound
    return None


# Metadata calls by the called method's name (kvfs/meta/calls.py). One per process: every
# part of the daemon makes its own MetaCalls, and all of them record here.
METADATA_CALLS = RequestTimes()
