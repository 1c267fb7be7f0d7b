"""`kvfs stat`: the mount's live state as a table, as JSON, or refreshed every second."""

from __future__ import annotations

import json
import time
from pathlib import Path

from humanfriendly import format_size
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvfs.fuse.control import CONTROL_DIR, STATS_NAME
from kvfs.observe.loads import OTHER, break_even

VERIFY_RULES = {  # which bytes can reach a reader unverified (README, "What kvfs guarantees")
    "once": "each file checked once on this host after it changed; the device is trusted after",
    "open": "each file checked at every open unless its checked pages are all in memory",
    "always": "every block checked as the daemon serves it",
}


def read_stats(mountpoint: Path) -> dict:
    return json.loads((mountpoint / CONTROL_DIR.decode() / STATS_NAME.decode()).read_text())


def _size(value: float) -> str:
    return format_size(value, binary=True)


def render(state: dict, previous: dict | None = None, interval: float = 1.0,
           break_evens: dict[str, float] | None = None) -> Group:
    lookups = state["lookup_hits"] + state["lookup_misses"]
    hit_ratio = f"{state['lookup_hits'] / lookups:.1%}" if lookups else "-"
    used_share = state["used_bytes"] / state["capacity_bytes"] if state["capacity_bytes"] else 0
    summary = Table(title="kvfs", show_header=True, header_style="bold")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    if previous is not None:
        summary.add_column("per second", justify="right")
    rows = [
        ("data path", f"{state['data_path']}, verify {state['verify']}: "
                      f"{VERIFY_RULES[state['verify']]}", None),
        ("hosts sharing the pool", str(state["hosts"]), None),
        ("capacity", _size(state["capacity_bytes"]), None),
        ("used", f"{_size(state['used_bytes'])} ({used_share:.1%})", None),
        ("files", str(state["files"]), None),
        ("lookups (hit ratio)", f"{lookups} ({hit_ratio})", "lookups"),
        ("loaded (opened for reading)", _size(state["bytes_opened"]), "bytes_opened"),
        ("stored (committed)", _size(state["bytes_committed"]), "bytes_committed"),
        ("  of which read by the daemon", _size(state["bytes_read"]), "bytes_read"),
        ("  of which written to the daemon", _size(state["bytes_written"]), "bytes_written"),
        ("prefetched after lookups (used, wasted)",
         f"{_size(state['prefetch_bytes'])} ({_size(state['prefetch_used_bytes'])}, "
         f"{_size(state['prefetch_wasted_bytes'])})", "prefetch_bytes"),
        ("evictions", str(state["evictions"]), "evictions"),
        ("checksum errors", str(state["checksum_errors"]), "checksum_errors"),
    ]
    for label, value, rate_key in rows:
        cells = [label, value]
        if previous is not None:
            cells.append(_rate(state, previous, rate_key, interval) if rate_key else "")
        summary.add_row(*cells)
    models = Table(title="per model", header_style="bold")
    models.add_column("model")
    models.add_column("files", justify="right")
    models.add_column("bytes", justify="right")
    for model, usage in sorted(state["models"].items()):
        models.add_row(model, str(usage["files"]), _size(usage["bytes"]))
    return Group(summary, models, requests_table(state["requests"]),
                 loads_table(state["loads"], break_evens or {}))


def requests_table(requests: dict[str, dict[str, float | None]]) -> Table:
    """Requests the daemon answered, by kind, and how long it took (its own part)."""
    table = Table(title="requests answered by the daemon", header_style="bold")
    for column in ("request", "count", "mean", "p50 ≤", "p99 ≤"):
        table.add_column(column, justify="left" if column == "request" else "right")
    for request, times in requests.items():
        count = int(times["count"] or 0)
        mean = f"{(times['seconds'] or 0) / count * 1e6:.0f} µs" if count else "-"
        table.add_row(request, str(count), mean, _micros(times["p50_us"]),
                      _micros(times["p99_us"]))
    return table


def _micros(bound: float | None) -> str:
    return "> 1 s" if bound is None else f"{bound:.0f} µs"


def loads_table(loads: dict[str, dict[str, float]], chosen: dict[str, float]) -> Table:
    """What loads achieved on this host against the rate above which reuse pays."""
    table = Table(title="loads on this host: does reuse pay?", header_style="bold")
    for column in ("model", "loaded", "busy", "GB/s", "break-even GB/s", "verdict"):
        table.add_column(column, justify="left" if column in ("model", "verdict") else "right")
    for model, load in sorted(loads.items()):
        rate = load["bytes"] / load["seconds"] / 1e9 if load["seconds"] else None
        threshold = break_even(model, chosen) if model != OTHER else None
        table.add_row(model, _size(load["bytes"]), f"{load['seconds']:.1f} s",
                      "-" if rate is None else f"{rate:.2f}",
                      "-" if threshold is None else f"{threshold:.2f}",
                      verdict(rate, threshold))
    return table


def verdict(rate: float | None, threshold: float | None) -> str:
    if rate is None:
        return "no loads yet"
    if threshold is None:
        return "unknown: set --break-even MODEL=GBPS"
    if rate >= threshold:
        return f"pays: loading is {rate / threshold:.1f}x the break-even"
    return f"SLOWER THAN RECOMPUTING: loads at {rate / threshold:.0%} of the break-even"


def _rate(state: dict, previous: dict, key: str, interval: float) -> str:
    def value(snapshot: dict) -> int:
        if key == "lookups":
            return snapshot["lookup_hits"] + snapshot["lookup_misses"]
        return snapshot[key]

    delta = (value(state) - value(previous)) / interval
    return f"{_size(delta)}/s" if key.startswith("bytes") else f"{delta:.0f}/s"


def show(mountpoint: Path, as_json: bool, watch: bool,
         break_evens: dict[str, float] | None = None) -> None:
    console = Console()
    if as_json:
        console.print_json(data=read_stats(mountpoint))
        return
    if not watch:
        console.print(render(read_stats(mountpoint), break_evens=break_evens))
        return
    previous = read_stats(mountpoint)
    with Live(render(previous, previous, break_evens=break_evens), console=console,
              screen=False) as live:
        while True:
            time.sleep(1.0)
            state = read_stats(mountpoint)
            live.update(render(state, previous, break_evens=break_evens))
            previous = state
