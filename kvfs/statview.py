"""`kvfs stat`: the mount's live state as a table, as JSON, or refreshed every second."""

from __future__ import annotations

import json
import time
from pathlib import Path

from humanfriendly import format_size
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from kvfs.control import CONTROL_DIR, STATS_NAME

VERIFY_RULES = {  # which bytes can reach a reader unverified (README, "What kvfs guarantees")
    "once": "each file checked once on this host after it changed; the device is trusted after",
    "open": "each file checked at every open unless its checked pages are all in memory",
    "always": "every block checked as the daemon serves it",
}


def read_stats(mountpoint: Path) -> dict:
    return json.loads((mountpoint / CONTROL_DIR.decode() / STATS_NAME.decode()).read_text())


def _size(value: float) -> str:
    return format_size(value, binary=True)


def render(state: dict, previous: dict | None = None, interval: float = 1.0) -> Group:
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
    return Group(summary, models)


def _rate(state: dict, previous: dict, key: str, interval: float) -> str:
    def value(snapshot: dict) -> int:
        if key == "lookups":
            return snapshot["lookup_hits"] + snapshot["lookup_misses"]
        return snapshot[key]

    delta = (value(state) - value(previous)) / interval
    return f"{_size(delta)}/s" if key.startswith("bytes") else f"{delta:.0f}/s"


def show(mountpoint: Path, as_json: bool, watch: bool) -> None:
    console = Console()
    if as_json:
        console.print_json(data=read_stats(mountpoint))
        return
    if not watch:
        console.print(render(read_stats(mountpoint)))
        return
    previous = read_stats(mountpoint)
    with Live(render(previous, previous), console=console, screen=False) as live:
        while True:
            time.sleep(1.0)
            state = read_stats(mountpoint)
            live.update(render(state, previous))
            previous = state
