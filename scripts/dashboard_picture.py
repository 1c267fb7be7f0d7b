"""Draw the Grafana dashboard (deploy/grafana/kvfs.json) with the data of a live mount:
docs/dashboard.png.

    .venv/bin/python scripts/dashboard_picture.py [--seconds 120] [--capacity 1G]
        [--rate-window 15s] [--out docs/dashboard.png]

Needs matplotlib (`.venv/bin/pip install -e .[docs]`), Debian's prometheus (scripts/setup.sh
installs it) and the clients' code that scripts/setup.sh unpacks (vLLM's tier, SGLang,
LMCache).

Mounts a kvfs with `--metrics-port` and a small `--capacity` in a scratch directory under
/tmp, starts a Prometheus (tests/prometheus_server.py) that scrapes it every second, and runs
real client traffic for `--seconds`: vLLM's filesystem tier (tests/vllm_tier.py), SGLang's
HiCache file backend (tests/sglang_hicache.py) and LMCache engines (tests/lmcache_engine.py),
every store and load a process of its own, storing more than the pool holds so that it
evicts. Then it evaluates every panel's queries over the run with Prometheus's query_range,
with the dashboard's variables as tests/test_prometheus.py substitutes them (all mounts; the
rate window `--rate-window`, wider than Grafana's four scrape intervals so that the bursts of
a short run read as rates), and draws each panel where its gridPos puts it, in one PNG.
Everything it started is stopped and the scratch directory removed at the end, also after an
error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib.dates as mdates
from bench_io import REPO, KvfsMount, run_cleaning_up, run_engine
from local_redis import free_port
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # not pyplot: a file, no display or backend
from matplotlib.patches import FancyBboxPatch, Wedge
from matplotlib.ticker import FuncFormatter, MaxNLocator
from prometheus_server import INSTALL, LocalPrometheus, installed
from rich.console import Console
from sglang_hicache import run_worker as run_sglang
from vllm_tier import run_worker as run_vllm

CONSOLE = Console(width=None if sys.stdout.isatty() else 132)
DASHBOARD = REPO / "deploy" / "grafana" / "kvfs.json"

# The traffic, per round of each client (its rounds one after another, the clients at once).
# The pauses between rounds bring the clients' byte rates near each other: a vLLM round
# starts two small processes, an LMCache round two engines (torch and LMCache to import).
VLLM_BLOCKS = 32  # 2 MiB blocks: a 512-token prompt of Llama-3.1-8B
VLLM_ROUNDS_LOADED = 3  # a load pass asks for the blocks of this many latest rounds
VLLM_PAUSE_S = 5.0
SGLANG_PAGES = 8  # 8 MiB pages; a load pass asks for the first half only
SGLANG_PAUSE_S = 1.0
LMCACHE_CHUNKS = 4  # 32 MiB chunks
LMCACHE_PAUSE_S = 1.0
QUIET_S = 5.0  # before and after the traffic: the panels show it start and stop

# Grafana's dark theme
BACKGROUND, PANEL, BORDER, TEXT, DIM, GRID = (
    "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e9c", "#24292e")
PALETTE = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
           "#705da0", "#37872d", "#fade2a", "#447ebc", "#c15c17", "#890f02", "#0a437c",
           "#6d1f62", "#584477", "#96d98d", "#ffee52", "#c0d8ff", "#ffb357")
GREEN, RED = "#73bf69", "#f2495c"

# Grafana's grid: 24 columns; a row unit is about half a column on a wide screen.
COLUMN_IN, ROW_IN, GAP_IN, HEADER_IN = 0.82, 0.46, 0.08, 0.55
TITLE_IN = 0.3  # a panel's title bar
DPI = 100


# -- the traffic -----------------------------------------------------------------------------


@dataclass
class Client:
    """One client's loop: its rounds, and what they did."""

    name: str
    one_round: Callable[[int], dict[str, int]]
    pause: float  # seconds between rounds
    rounds: int = 0
    done: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def loop(self, deadline: float, stopping: threading.Event) -> None:
        while time.monotonic() < deadline and not stopping.is_set():
            try:
                for key, amount in self.one_round(self.rounds).items():
                    self.done[key] = self.done.get(key, 0) + amount
            except Exception as error:  # one failed request; the engine serves the next
                if stopping.is_set():
                    return
                self.failures.append(f"round {self.rounds}: {error}".splitlines()[0][:300])
            self.rounds += 1
            stopping.wait(self.pause)


def vllm_round(root: Path) -> Callable[[int], dict[str, int]]:
    """Store a prompt's blocks, then load those of the latest rounds (older ones may be
    evicted: misses)."""
    def one_round(number: int) -> dict[str, int]:
        stored = run_vllm("store", root, VLLM_BLOCKS, first=number * VLLM_BLOCKS)
        first = max(0, number - VLLM_ROUNDS_LOADED + 1) * VLLM_BLOCKS
        loaded = run_vllm("load", root, (number + 1) * VLLM_BLOCKS - first,
                                      first=first)
        check_round("vLLM", "blocks", stored, loaded)
        return {"stored blocks": VLLM_BLOCKS, "loaded blocks": loaded["loaded"],
                "missed blocks": len(loaded["missing"])}
    return one_round


def check_round(client: str, units: str, stored: dict[str, Any],
                loaded: dict[str, Any]) -> None:
    """A client's round whose stores or loads failed, or loaded wrong bytes, ends the run."""
    if stored["failed"] or loaded["failed"] or loaded["mismatched"]:
        raise RuntimeError(f"{client}: {len(stored['failed'])} stores and "
                           f"{len(loaded['failed'])} loads failed, "
                           f"{len(loaded['mismatched'])} {units} loaded wrong")


def sglang_round(root: Path) -> Callable[[int], dict[str, int]]:
    """Store a prompt's pages, then load the first half: the rest is stored, never used."""
    def one_round(number: int) -> dict[str, int]:
        first = number * SGLANG_PAGES
        stored = run_sglang("store", root, SGLANG_PAGES, first=first)
        loaded = run_sglang("load", root, SGLANG_PAGES // 2, first=first)
        check_round("SGLang", "pages", stored, loaded)
        return {"stored pages": SGLANG_PAGES, "loaded pages": loaded["loaded"],
                "missed pages": len(loaded["missing"])}
    return one_round


def lmcache_round(directory: Path) -> Callable[[int], dict[str, int]]:
    """One engine stores a prompt and retrieves it; another instance then reuses the
    previous round's prompt (partly evicted by now, perhaps)."""
    chunk_tokens = 256

    def one_round(number: int) -> dict[str, int]:
        done = {"stored chunks": 0, "retrieved chunks": 0}
        prompts = [(["store", "lookup", "retrieve"], number)]
        if number:
            prompts.append((["lookup", "retrieve"], number - 1))
        for ops, prompt in prompts:
            report = run_engine(ops, directory, LMCACHE_CHUNKS, "fs", "--prompt-seed",
                                str(prompt))
            done["stored chunks"] += report.get("store", {}).get("chunks", 0)
            done["retrieved chunks"] += report["retrieve"]["tokens_hit"] // chunk_tokens
        return done
    return one_round


def child_pids() -> list[int]:
    """The processes this one started (every thread's children)."""
    pids = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            pids += [int(pid) for pid in (task / "children").read_text().split()]
    return pids


# -- the dashboard's queries -----------------------------------------------------------------


@dataclass
class Series:
    legend: str
    times: list[float]  # matplotlib's date numbers
    values: list[float]


def expression(expr: str, rate_window: str) -> str:
    """A panel's query with the dashboard's variables as tests/test_prometheus.py puts them:
    every mount, and a fixed rate window."""
    return expr.replace("$instance", ".+").replace("$__rate_interval", rate_window)


def legend_of(legend_format: str, labels: dict[str, str]) -> str:
    if not legend_format:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda match: labels.get(match[1], ""),
                  legend_format).strip()


def evaluate(prom: LocalPrometheus, target: dict[str, Any], start: float, end: float,
             rate_window: str, step: float) -> list[Series]:
    """The target's series over [start, end], one value per step (NaN where it has none)."""
    result = prom.api("query_range", query=expression(target["expr"], rate_window),
                      start=str(start), end=str(end), step=str(step))["result"]
    grid = [start + index * step for index in range(int((end - start) / step) + 1)]
    times = [float(mdates.date2num(datetime.fromtimestamp(instant))) for instant in grid]
    series = []
    for one in result:
        by_step = {round((float(at) - start) / step): float(value)
                   for at, value in one["values"]}
        values = [by_step.get(index, math.nan) for index in range(len(grid))]
        if any(not math.isnan(value) for value in values):
            series.append(Series(legend_of(target.get("legendFormat", ""), one["metric"]),
                                 times, values))
    return sorted(series, key=lambda one: one.legend)


# -- drawing ---------------------------------------------------------------------------------

IEC = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
SHORT = ((1e12, " T"), (1e9, " Bil"), (1e6, " Mil"), (1e3, " K"))


def number(value: float) -> str:
    """Three significant digits at most, no exponent, no trailing zeros."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def in_unit(value: float, unit: str) -> str:
    """`value` as Grafana shows its unit (IEC bytes, percent, seconds, short)."""
    if math.isnan(value):
        return "-"
    if unit in ("bytes", "Bps"):
        power = 0
        while abs(value) >= 1024 ** (power + 1) and power < len(IEC) - 1:
            power += 1
        return f"{number(value / 1024 ** power)} {IEC[power]}{'/s' if unit == 'Bps' else ''}"
    if unit == "percentunit":
        return f"{number(value * 100)}%"
    if unit == "s":
        size = abs(value)
        if size == 0:
            return "0 s"
        if size < 1e-3:
            return f"{number(value * 1e6)} µs"
        return f"{number(value * 1e3)} ms" if size < 1 else f"{number(value)} s"
    for factor, suffix in SHORT:
        if abs(value) >= factor:
            return f"{number(value / factor)}{suffix}"
    return number(value)


class UnitLocator(MaxNLocator):
    """Round ticks in the unit's own steps: 256 MiB, not 268 MB."""

    def __init__(self, unit: str) -> None:
        super().__init__(nbins=5, steps=[1, 2, 2.5, 5, 10])
        self.unit = unit

    def tick_values(self, vmin: float, vmax: float) -> Sequence[float]:
        if self.unit not in ("bytes", "Bps"):
            return super().tick_values(vmin, vmax)
        scale = 1024.0 ** max(0, min(len(IEC) - 1, int(math.log(max(abs(vmax), 1), 1024))))
        return [tick * scale for tick in super().tick_values(vmin / scale, vmax / scale)]


def time_locator(seconds: float, most: int) -> mdates.DateLocator:
    """Ticks on round clock times, at most `most` of them over `seconds`."""
    step = next((step for step in (5, 10, 15, 30, 60, 120, 300, 600, 1800)
                 if seconds / step <= most), 3600)
    if step < 60:
        return mdates.SecondLocator(bysecond=range(0, 60, step))
    if step < 3600:
        return mdates.MinuteLocator(byminute=range(0, 60, step // 60))
    return mdates.HourLocator()


class Canvas:
    """The figure, and inches on it measured from its top left corner."""

    def __init__(self, rows: int) -> None:
        self.width = 24 * COLUMN_IN
        self.height = HEADER_IN + rows * ROW_IN
        self.figure = Figure(figsize=(self.width, self.height), dpi=DPI, facecolor=BACKGROUND)

    def rect(self, left: float, top: float, width: float, height: float
             ) -> tuple[float, float, float, float]:
        return (left / self.width, 1 - (top + height) / self.height,
                width / self.width, height / self.height)

    def panel(self, grid: dict[str, int], title: str) -> tuple[float, float, float, float]:
        """Draw a panel's frame and title; the inches inside it, below the title."""
        left, top = grid["x"] * COLUMN_IN + GAP_IN / 2, HEADER_IN + grid["y"] * ROW_IN
        width, height = grid["w"] * COLUMN_IN - GAP_IN, grid["h"] * ROW_IN - GAP_IN
        frame = self.figure.add_axes(self.rect(left, top, width, height))
        frame.set_axis_off()
        frame.add_patch(FancyBboxPatch((0, 0), 1, 1, boxstyle="round,pad=0,rounding_size=0.01",
                                       transform=frame.transAxes, facecolor=PANEL,
                                       edgecolor=BORDER, linewidth=1))
        frame.text(0.1 / width, 1 - 0.16 / height, title, transform=frame.transAxes,
                   color=TEXT, fontsize=10.5, fontweight="bold", va="center")
        return left, top + TITLE_IN, width, height - TITLE_IN


def timeseries(canvas: Canvas, box: tuple[float, float, float, float],
               series: list[Series], unit: str) -> None:
    """Lines over time, the legend below them (Grafana's default list legend)."""
    left, top, width, height = box
    plot_left, plot_width = left + 0.85, width - 1.0
    longest = max((len(one.legend) for one in series), default=1)
    columns = max(1, min(len(series), int(plot_width / (0.3 + 0.062 * longest))))
    legend_rows = math.ceil(len(series) / columns) if series else 0
    legend_in = 0.05 + 0.16 * legend_rows
    plot_height = height - 0.3 - legend_in - 0.1
    axes: Axes = canvas.figure.add_axes(canvas.rect(plot_left, top + 0.1, plot_width,
                                                    plot_height))
    axes.set_facecolor(PANEL)
    for spine in axes.spines.values():
        spine.set_visible(False)
    axes.grid(True, color=GRID, linewidth=0.8)
    axes.tick_params(colors=DIM, labelsize=8, length=0)
    axes.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
    if series:
        span = (series[0].times[-1] - series[0].times[0]) * 86400
        axes.xaxis.set_major_locator(time_locator(span, int(plot_width / 0.75)))
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: in_unit(value, unit)))
    axes.yaxis.set_major_locator(UnitLocator(unit))
    if not series:
        axes.set_yticks([])
        axes.text(0.5, 0.5, "No data", transform=axes.transAxes, ha="center", va="center",
                  color=DIM, fontsize=12)
        return
    for index, one in enumerate(series):
        color = PALETTE[index % len(PALETTE)]
        axes.plot(one.times, one.values, color=color, linewidth=1.3, label=one.legend)
        axes.fill_between(one.times, one.values, color=color, alpha=0.06, linewidth=0)
    axes.set_xlim(series[0].times[0], series[0].times[-1])
    shown = [v for one in series for v in one.values if not math.isnan(v)]
    if max(shown) <= 0 <= min(shown):  # flat at zero: a 0 to 1 axis, as Grafana draws it
        axes.set_ylim(0, 1)
    else:
        axes.set_ylim(bottom=min(0.0, min(shown)))
    legend = axes.legend(loc="upper left", ncol=columns, frameon=False, fontsize=7.5,
                         labelcolor=TEXT, handlelength=1.2, columnspacing=1.2,
                         borderaxespad=0, bbox_to_anchor=(
                             -0.65 / plot_width, -(0.3 + 0.05) / plot_height))
    for line in legend.get_lines():
        line.set_linewidth(3)


def last(one: Series) -> float:
    return next((value for value in reversed(one.values) if not math.isnan(value)), math.nan)


def gauge(canvas: Canvas, box: tuple[float, float, float, float],
          series: list[Series], unit: str) -> None:
    """Each series' latest value on a half dial (Grafana's default thresholds: red from
    80 %)."""
    left, top, width, height = box
    for index, one in enumerate(series or [Series("No data", [], [math.nan])]):
        slot = width / max(1, len(series))
        axes = canvas.figure.add_axes(canvas.rect(left + index * slot + 0.15, top + 0.1,
                                                  slot - 0.3, height - 0.3))
        axes.set_axis_off()
        axes.set_xlim(-1.1, 1.1)
        axes.set_ylim(-0.45, 1.1)
        axes.set_aspect("equal")
        value = last(one)
        axes.add_patch(Wedge((0, 0), 1, 0, 180, width=0.22, facecolor=GRID))
        axes.add_patch(Wedge((0, 0), 1.06, 0, 180 * 0.2, width=0.04, facecolor=RED))
        axes.add_patch(Wedge((0, 0), 1.06, 180 * 0.2, 180, width=0.04, facecolor=GREEN))
        if not math.isnan(value):
            shown = min(1.0, max(0.0, value))
            axes.add_patch(Wedge((0, 0), 1, 180 * (1 - shown), 180, width=0.22,
                                 facecolor=RED if value >= 0.8 else GREEN))
        axes.text(0, 0.12, in_unit(value, unit), ha="center", va="center", fontsize=24,
                  color=RED if value >= 0.8 else GREEN, fontweight="bold")
        axes.text(0, -0.3, one.legend, ha="center", va="center", fontsize=8, color=DIM)


def stat(canvas: Canvas, box: tuple[float, float, float, float],
         series: list[Series], unit: str) -> None:
    """Each series' latest value over its sparkline, stacked (Grafana's stat panel)."""
    left, top, width, height = box
    if not series:
        canvas.figure.text(*canvas.rect(left + width / 2, top + height / 2, 0, 0)[:2],
                           "No data", color=DIM, ha="center", va="center", fontsize=12)
        return
    slot = (height - 0.1) / len(series)
    for index, one in enumerate(series):
        axes = canvas.figure.add_axes(canvas.rect(left + 0.1, top + index * slot,
                                                  width - 0.2, slot - 0.08))
        axes.set_axis_off()
        values = [v for v in one.values if not math.isnan(v)]
        spread = (max(values) - min(values)) or 1.0
        axes.fill_between(one.times, [min(values) - spread * 0.05 if not math.isnan(v)
                                      else math.nan for v in one.values], one.values,
                          color=GREEN, alpha=0.12, linewidth=0)
        axes.plot(one.times, one.values, color=GREEN, alpha=0.6, linewidth=1)
        axes.set_ylim(min(values) - spread * 0.05, max(values) + spread * 1.3)
        axes.text(0.03, 0.78, one.legend, transform=axes.transAxes, color=TEXT, fontsize=8,
                  va="center")
        axes.text(0.5, 0.45, in_unit(last(one), unit), transform=axes.transAxes,
                  color=GREEN, fontsize=18, fontweight="bold", ha="center", va="center")


DRAW = {"timeseries": timeseries, "gauge": gauge, "stat": stat}


def draw(dashboard: dict[str, Any], panels: list[list[Series]], subtitle: str,
         out: Path) -> None:
    rows = max(panel["gridPos"]["y"] + panel["gridPos"]["h"] for panel in dashboard["panels"])
    canvas = Canvas(rows)
    canvas.figure.text(GAP_IN / 2 / canvas.width, 1 - HEADER_IN / 2 / canvas.height,
                       dashboard["title"], color=TEXT, fontsize=15, fontweight="bold",
                       va="center")
    canvas.figure.text(1 - GAP_IN / 2 / canvas.width, 1 - HEADER_IN / 2 / canvas.height,
                       subtitle, color=DIM, fontsize=9, va="center", ha="right")
    for panel, series in zip(dashboard["panels"], panels, strict=True):
        box = canvas.panel(panel["gridPos"], panel["title"])
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        DRAW.get(panel["type"], timeseries)(canvas, box, series, unit)
    out.parent.mkdir(parents=True, exist_ok=True)
    canvas.figure.savefig(out, dpi=DPI, facecolor=BACKGROUND)


# -- the run ---------------------------------------------------------------------------------


class Picture:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scratch = Path(tempfile.mkdtemp(prefix="kvfs-dashboard-", dir="/tmp"))
        self.port = free_port()
        self.mount = KvfsMount(self.scratch / "data", self.scratch / "mnt",
                               ["--capacity", args.capacity, "--metrics-port", str(self.port)])
        self.prom: LocalPrometheus | None = None
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.clients: list[Client] = []

    def run(self) -> None:
        dashboard = json.loads(DASHBOARD.read_text())
        self.mount.mountpoint.mkdir()
        with CONSOLE.status("mounting kvfs, starting Prometheus …"):
            self.mount.mount()
            self.prom = LocalPrometheus(self.scratch / "prometheus",
                                        [f"127.0.0.1:{self.port}"], []).start()
            self.wait_for_scrapes()
        root = self.mount.mountpoint
        for directory in ("vllm", "sglang", "lmcache"):
            (root / directory).mkdir()
        self.clients = [Client("vLLM tier", vllm_round(root / "vllm"), VLLM_PAUSE_S),
                        Client("SGLang HiCache", sglang_round(root / "sglang"), SGLANG_PAUSE_S),
                        Client("LMCache", lmcache_round(root / "lmcache"), LMCACHE_PAUSE_S)]
        start = time.time()
        time.sleep(QUIET_S)
        with CONSOLE.status(f"client traffic for {self.args.seconds:.0f} s …"):
            deadline = time.monotonic() + self.args.seconds
            self.threads = [threading.Thread(target=client.loop, name=client.name,
                                             args=(deadline, self.stopping), daemon=True)
                            for client in self.clients]
            for thread in self.threads:
                thread.start()
            while any(thread.is_alive() for thread in self.threads):
                time.sleep(0.2)
            time.sleep(QUIET_S)
        end = time.time()
        for client in self.clients:
            CONSOLE.print(f"{client.name}: {client.rounds} rounds, " + ", ".join(
                f"{amount} {what}" for what, amount in client.done.items()))
            for failure in client.failures:
                CONSOLE.print(f"  [yellow]failed[/] {failure}", soft_wrap=True)
        with CONSOLE.status("evaluating the dashboard's queries …"):
            assert self.prom is not None
            panels = []
            for panel in dashboard["panels"]:
                series = [one for target in panel["targets"]
                          for one in evaluate(self.prom, target, start, end,
                                              self.args.rate_window, self.args.step)]
                panels.append(series)
                if not series:
                    CONSOLE.print(f"[yellow]no data:[/] {panel['title']}")
            version = self.prom.api("status/buildinfo")["version"]
        subtitle = (f"mount: All   rate window {self.args.rate_window}   "
                    f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to "
                    f"{datetime.fromtimestamp(end):%H:%M:%S}   "
                    f"Prometheus {version}, a live mount scraped every second")
        draw(dashboard, panels, subtitle, self.args.out)
        CONSOLE.print(f"wrote {self.args.out}")

    def wait_for_scrapes(self) -> None:
        assert self.prom is not None
        deadline = time.monotonic() + 30
        while not self.prom.query('up{job="kvfs"} == 1'):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Prometheus does not scrape 127.0.0.1:{self.port}")
            time.sleep(0.2)

    def cleanup(self) -> None:
        """Stop the clients (their processes too), unmount, stop Prometheus, remove the
        scratch directory."""
        self.stopping.set()
        keep = {self.mount.pid}  # stopped below, in their own way
        if self.prom is not None and self.prom.process is not None:
            keep.add(self.prom.process.pid)
        for pid in child_pids():
            if pid not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        for thread in self.threads:
            thread.join(30)
        try:
            self.mount.unmount()
        finally:
            if self.prom is not None:
                self.prom.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120, help="client traffic this long")
    parser.add_argument("--capacity", default="1G",
                        help="the pool's capacity: smaller than what the clients store")
    parser.add_argument("--rate-window", default="15s",
                        help="what $__rate_interval stands for in the queries")
    parser.add_argument("--step", type=float, default=1.0, help="seconds between points")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if not installed():
        CONSOLE.print(f"[red]no prometheus: {INSTALL}[/]")
        return 1
    picture = Picture(args)
    _, finished = run_cleaning_up(picture, CONSOLE)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
