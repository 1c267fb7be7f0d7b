"""Prometheus metrics at http://ADDRESS:PORT/metrics, read from the live state at each scrape.

Names follow Prometheus's conventions: one prefix `kvfs_`, base units as suffixes (`_bytes`,
`_seconds`, `_ratio`), counters end in `_total`, latencies are histograms, and labels take a
few values each (a request kind, a metadata call, a client, a model), never a file's name.
docs/operations.md lists them, and what each was called before.
"""

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

from kvfs.observe.clients import CLIENTS
from kvfs.observe.latency import LATENCY_BOUNDS_US, METADATA_CALLS, RequestTimes
from kvfs.observe.loads import break_even
from kvfs.pool.space import HIGH_WATERMARK

Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily

# metric name (after kvfs_) -> (field of the stats snapshot, help)
GAUGES = {
    "capacity_bytes": ("capacity_bytes", "Bytes the pool may use"),
    "used_bytes": ("used_bytes", "Bytes in use in the pool (committed plus being written)"),
    "claimed_bytes": ("claimed_bytes", "Room the pool's hosts hold for what their writers stage"),
    "files": ("files", "Files in the pool"),
    "hosts": ("hosts", "Mounts sharing the pool (1 on one host)"),
    "blobs_held": ("blobs_held", "Data files this host has open"),
    "pool_lost": ("pool_lost", "Shared pool: 1 once Redis no longer holds this mount's pool "
                               "(it then serves nothing; see kvfs fsck)"),
    "spare_staged_files": ("spare_staged_files", "Empty staged files made ahead for writers"),
    "blobs_publishing": ("blobs_publishing",
                         "Committed blobs not yet moved into blobs/ (readers find them staged)"),
}
COUNTERS = {
    "commits": ("commits", "Files committed at close"),
    "evictions": ("evictions", "Files evicted to stay within the capacity"),
    "evicted_bytes": ("evicted_bytes", "Bytes the evicted files took"),
    "evicted_unused_bytes": ("evicted_unused_bytes",
                             "Bytes of evicted files nobody looked up, opened or read after "
                             "their last store"),
    "checksum_errors": ("checksum_errors",
                        "Reads and opens refused because data failed its checksum"),
    "verified_bytes": ("verified_bytes", "Bytes read to verify data before passing it through"),
    "handler_errors": ("handler_errors", "Requests answered EIO after an unexpected error"),
    "volume_errors": ("volume_errors", "Errors of the volume underneath met by requests"),
    "readahead_errors": ("readahead_errors", "Readahead runs that failed"),
    "background_errors": ("background_errors",
                          "Failed rounds of eviction, recency flushes, data deletion"),
    "daemon_read_bytes": ("bytes_read", "Bytes the daemon served to readers (not passthrough)"),
    "daemon_written_bytes": ("bytes_written",
                             "Bytes the daemon received from writers (not passthrough)"),
    "prefetched_bytes": ("prefetch_bytes",
                         "Bytes read and verified after lookups, ahead of their opens"),
    "prefetch_used_bytes": ("prefetch_used_bytes", "Prefetched bytes a reader opened later"),
    "prefetch_wasted_bytes": ("prefetch_wasted_bytes",
                              "Prefetched bytes no reader opened within a minute"),
    "opens_renewed": ("opens_renewed",
                      "Opens moved to a fresh kernel inode (ESTALE, retried by the kernel)"),
    "foreign_xattrs_refused": ("foreign_xattrs_refused",
                               "Getxattrs outside user.* answered before the request loop"),
    "sessions_reaped": ("sessions_reaped", "Shared pool: dead hosts this host cleaned up after"),
    "sessions_lost": ("sessions_lost",
                      "Shared pool: times this host was declared dead while alive"),
    "metadata_conflicts": ("metadata_conflicts",
                           "Metadata changes run again after another host's change"),
    "metadata_timeouts": ("metadata_timeouts",
                          "Shared pool: metadata round trips without an answer in the deadline"),
    "metadata_unreachable": ("metadata_unreachable",
                             "Shared pool: metadata round trips refused (Redis unreachable)"),
}
REQUESTS = ("kvfs_request_seconds",
            "Time the daemon took to answer FUSE requests, by request (its own part)")
METADATA = ("kvfs_metadata_seconds", "Time metadata calls took, by call")
BREAK_EVEN = ("kvfs_model_break_even_bytes_per_second",
              "Load rate above which reusing the model's KV beats recomputing it")


def _families(state: dict | None) -> Iterator[Family]:
    """Every family; without a state (no snapshot: at registration, or metadata unreachable)
    only those the daemon's memory answers."""
    up = GaugeMetricFamily("kvfs_metadata_reachable",
                           "1 if this scrape read the pool's metadata (for a shared pool: "
                           "reached Redis), else 0")
    up.add_metric([], 1.0 if state is not None and state["metadata_reachable"] else 0.0)
    yield up
    yield GaugeMetricFamily("kvfs_eviction_high_watermark_ratio",
                            "Share of the capacity above which background eviction starts",
                            value=HIGH_WATERMARK)
    if state is None:
        return
    for name, (field, text) in GAUGES.items():
        yield GaugeMetricFamily(f"kvfs_{name}", text, value=state[field])
    info = GaugeMetricFamily("kvfs_info", "The mount's data path and verify mode (always 1)",
                             labels=["data_path", "verify"])
    info.add_metric([state["data_path"], state["verify"]], 1.0)
    yield info
    for name, (field, text) in COUNTERS.items():
        yield CounterMetricFamily(f"kvfs_{name}", text, value=state[field])
    lookups = CounterMetricFamily("kvfs_lookups", "Lookups that reached the daemon, by result",
                                  labels=["result"])
    lookups.add_metric(["hit"], state["lookup_hits"])
    lookups.add_metric(["miss"], state["lookup_misses"])
    yield lookups
    opens = CounterMetricFamily("kvfs_opens", "Opens of files, by access and data path",
                                labels=["access", "path"])
    for access, prefix in (("read", "opens_"), ("write", "write_opens_")):
        for path in ("passthrough", "daemon"):
            opens.add_metric([access, path], state[f"{prefix}{path}"])
    yield opens
    drops = CounterMetricFamily("kvfs_metadata_loop_drops",
                                "Shared pool: the request loop's Redis connection dropped, by "
                                "cause (deadline, broken, failover)", labels=["cause"])
    for cause in ("deadline", "broken", "failover"):
        drops.add_metric([cause], state["metadata_loop_drops"].get(cause, 0))
    yield drops
    yield from _client_families(state["clients"])
    yield from _model_families(state)


def _client_families(clients: dict[str, dict[str, int]]) -> Iterator[Family]:
    for field, text in (("loaded_bytes", "Bytes of stored files opened for reading"),
                        ("stored_bytes", "Bytes of content writers committed")):
        counter = CounterMetricFamily(f"kvfs_{field}", f"{text}, by client (from the file name)",
                                      labels=["client"])
        for client in CLIENTS:
            counter.add_metric([client], clients[client][field])
        yield counter


def _model_families(state: dict) -> Iterator[Family]:
    """Per model (from LMCache's file names): what the pool holds, what this host loaded and
    how long loading took, and the rate above which loading pays."""
    for field, text in (("files", "Files in the pool per model"),
                        ("bytes", "Bytes in the pool per model")):
        family = GaugeMetricFamily(f"kvfs_model_{field}", text, labels=["model"])
        for model, usage in state["models"].items():
            family.add_metric([model], usage[field])
        yield family
    for field, text in (("bytes", "Bytes opened for reading per model (loads)"),
                        ("seconds", "Seconds with a load of the model open")):
        counter = CounterMetricFamily(f"kvfs_model_load_{field}", text, labels=["model"])
        for model, loads in state["loads"].items():
            counter.add_metric([model], loads[field])
        yield counter
    family = GaugeMetricFamily(*BREAK_EVEN, labels=["model"])
    for model in sorted({*state["models"], *state["loads"]}):
        gbps = break_even(model, {})
        if gbps is not None:
            family.add_metric([model], gbps * 1e9)
    yield family


def _histogram(name_and_help: tuple[str, str], label: str,
               times: RequestTimes) -> HistogramMetricFamily:
    family = HistogramMetricFamily(*name_and_help, labels=[label])
    for kind, (buckets, seconds) in sorted(times.histograms().items()):
        cumulative, total = [], 0
        for bound, count in zip((*LATENCY_BOUNDS_US, None), buckets, strict=True):
            total += count
            cumulative.append(("+Inf" if bound is None else str(bound / 1e6), total))
        family.add_metric([kind], cumulative, sum_value=seconds)
    return family


class KvfsCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict], requests: RequestTimes) -> None:
        self.snapshot = snapshot
        self.requests = requests

    def describe(self) -> Iterator[Family]:
        """The metrics' names, for registration (before the mount serves: no snapshot)."""
        yield from _families(None)
        yield HistogramMetricFamily(*REQUESTS, labels=["request"])
        yield HistogramMetricFamily(*METADATA, labels=["call"])

    def collect(self) -> Iterator[Family]:
        try:
            state: dict | None = self.snapshot()
        except Exception:  # (metadata unreachable: what memory holds, and the 0 that says so)
            state = None
        yield from _families(state)
        yield _histogram(REQUESTS, "request", self.requests)
        yield _histogram(METADATA, "call", METADATA_CALLS)


def serve_metrics(snapshot: Callable[[], dict], requests: RequestTimes, port: int,
                  address: str) -> None:
    """Serve from a thread of prometheus_client's own; scrapes read a fresh snapshot."""
    REGISTRY.register(KvfsCollector(snapshot, requests))
    start_http_server(port, addr=address)
