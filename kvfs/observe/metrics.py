"""Prometheus metrics at http://ADDRESS:PORT/metrics, read from the live state at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import (
    REGISTRY,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from kvfs.observe.stats import LATENCY_BOUNDS_US, RequestTimes

GAUGES = {
    "capacity_bytes": "Bytes the mount may use",
    "used_bytes": "Bytes in use (committed plus being written)",
    "files": "Files in the mount",
    "spare_staged_files": "Empty staged files made ahead for writers",
    "blobs_publishing": "Committed blobs not yet moved into blobs/ (readers find them staged)",
}
COUNTERS = {
    "lookup_hits": "Lookups of existing names that reached the daemon",
    "lookup_misses": "Lookups of missing names that reached the daemon",
    "foreign_xattrs_refused": "Getxattrs outside user.* answered before the request loop",
    "bytes_opened": "Bytes of committed files opened for reading (passthrough or not)",
    "bytes_committed": "Bytes of content writers committed",
    "bytes_read": "Bytes the daemon served to readers (not passthrough)",
    "bytes_written": "Bytes the daemon received from writers (not passthrough)",
    "commits": "Files committed at close",
    "evictions": "Files evicted to stay within the capacity",
    "checksum_errors": "Reads refused because data failed its checksum",
    "handler_errors": "Requests answered EIO after an unexpected error",
    "prefetch_bytes": "Bytes read and verified after lookups, ahead of their opens",
    "prefetch_used_bytes": "Prefetched bytes a reader opened later",
    "prefetch_wasted_bytes": "Prefetched bytes no reader opened within a minute",
    "opens_renewed": "Opens moved to a fresh kernel inode (ESTALE, retried by the kernel)",
}
REQUESTS = ("kvfs_request_seconds",
            "Time the daemon took to answer FUSE requests, by request (its own part)")
LOADS = {"bytes": "Bytes opened for reading per model (loads)",
         "seconds": "Seconds with a load of the model open"}


class KvfsCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict], requests: RequestTimes) -> None:
        self.snapshot = snapshot
        self.requests = requests

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily
                                   | HistogramMetricFamily]:
        """The metrics' names, for registration (before the mount serves: no snapshot)."""
        for name, text in GAUGES.items():
            yield GaugeMetricFamily(f"kvfs_{name}", text)
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(f"kvfs_{name}", text)
        for field in ("files", "bytes"):
            yield GaugeMetricFamily(f"kvfs_model_{field}", f"{field} per model",
                                    labels=["model"])
        for field, text in LOADS.items():
            yield CounterMetricFamily(f"kvfs_model_load_{field}", text, labels=["model"])
        yield HistogramMetricFamily(*REQUESTS, labels=["request"])

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily
                                  | HistogramMetricFamily]:
        state = self.snapshot()
        for name, text in GAUGES.items():
            yield GaugeMetricFamily(f"kvfs_{name}", text, value=state[name])
        for name, text in COUNTERS.items():
            yield CounterMetricFamily(f"kvfs_{name}", text, value=state[name])
        for field in ("files", "bytes"):
            family = GaugeMetricFamily(f"kvfs_model_{field}", f"{field} per model",
                                       labels=["model"])
            for model, usage in state["models"].items():
                family.add_metric([model], usage[field])
            yield family
        for field, text in LOADS.items():
            counter = CounterMetricFamily(f"kvfs_model_load_{field}", text, labels=["model"])
            for model, loads in state["loads"].items():
                counter.add_metric([model], loads[field])
            yield counter
        yield self._request_histogram()

    def _request_histogram(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(*REQUESTS, labels=["request"])
        for request, (buckets, seconds) in sorted(self.requests.histograms().items()):
            cumulative, total = [], 0
            for bound, count in zip((*LATENCY_BOUNDS_US, None), buckets, strict=True):
                total += count
                cumulative.append(("+Inf" if bound is None else str(bound / 1e6), total))
            family.add_metric([request], cumulative, sum_value=seconds)
        return family


def serve_metrics(snapshot: Callable[[], dict], requests: RequestTimes, port: int,
                  address: str) -> None:
    """Serve from a thread of prometheus_client's own; scrapes read a fresh snapshot."""
    REGISTRY.register(KvfsCollector(snapshot, requests))
    start_http_server(port, addr=address)
