#!/usr/bin/env python3
"""Chaos soak of a shared pool: two kvfs mounts of one pool, the engines' own client code
storing and loading on both, and one fault at a time at random moments, for a given time.

    nice -n 10 .venv/bin/python scripts/chaos.py --quick          # about two minutes
    nice -n 10 .venv/bin/python scripts/chaos.py --minutes 10     # faults for 10 minutes

Needs root (FUSE, a tmpfs for the volume), redis-server, and the clients scripts/setup.sh
unpacks. The pool: a redis-server of the soak's own (AOF, `appendfsync always`), the data
directory on a tmpfs of its own (so that filling the volume touches nothing else), two
mounts ("hosts" A and B) with a short session TTL, a capacity below what the clients keep
(so that eviction runs) and the keeper's takeover wait.

Clients, each in a process of its own, run their own code (tests/vllm_tier.py,
tests/sglang_hicache.py, tests/lmcache_engine.py) one pass after another, every pass
journaled with its CLOCK_MONOTONIC span: on each host vLLM's `fs` tier stores its own 8
blocks (files removed first) and loads the other host's, byte for byte; SGLang's HiCacheFile
stores the pages it misses and loads all of them, checked; LMCache's `fs` plugin looks up,
retrieves (checked) and stores a prompt on A, and looks up and retrieves it on B (two
writers of one LMCache key share its temporary name, a race of any filesystem).

Faults, one at a time (each kind once per shuffled round), at random moments:
- kill: `kill -9` of one daemon, then the same mount command, which takes the mount over
  from its keeper (engines' requests wait);
- kill-keeper: `kill -9` of one daemon and its keeper: a dead mount, which the next mount
  command clears;
- stop: `SIGSTOP` of one daemon for longer than the session TTL, then `SIGCONT`: the other
  host reaps it, and it registers again as a new session;
- redis: `kill -9` of Redis, and a start from its append-only file;
- full: the volume filled by a file outside the pool, then removed.

After each fault: both mounts must serve again (a file written on each is read back on the
other); then, with the clients paused between passes, the pool's counters must equal an fsck
recount, nothing but spares may be staged, used bytes and the blob files must be within the
capacity, and no request may have ended in an unexpected error (`handler_errors`). The
pool's committed bytes, sampled ten times a second throughout, must never pass the capacity.
Every
client pass is judged by the fault whose window it overlaps: a byte read that differs from
what was written is a violation wherever it happens; an error is one unless
docs/operations.md ("When the daemon dies") or docs/multi-host.md ("Durability and
failures") promise it for that fault (ALLOWED); a lookup that finds nothing, or a load whose
file went between lookup and open (`ENOENT`: evicted or replaced), is a miss. At the end
both mounts are unmounted and `kvfs fsck` must find the pool clean.

A table sums up faults, client passes, bytes verified, errors by fault and violations; the
JSON report goes to --out. The exit status is 1 on any violation. The work directory (under
/var/tmp) is removed at the end, also after an error, Ctrl-C or SIGTERM: clients, daemons,
keepers, Redis and the tmpfs are ended and unmounted.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import itertools
import json
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_io import REPO, log_problems, run_cleaning_up, save_report  # (tests/ on sys.path)
from conftest import (
    KvfsMount,
    assert_only_spares_staged,
    blob_bytes_on_disk,
    daemon_pid,
    is_mounted,
    pid_alive,
    run_mount,
    stats,
    wait_dead,
    wait_for,
)
from local_redis import LocalRedis
from redis import Redis, RedisError
from rich.console import Console
from rich.table import Table
from soak import human
from test_restart import keeper_pid
from test_shared import assert_pool_counters_exact, fsck

MIB = 1 << 20
CAPACITY = "40M"  # below what the clients keep (about 44 MiB): eviction runs
VOLUME_SIZE = "160m"  # the tmpfs under the data directory: room is the capacity's, until full
SESSION_TTL = 2.0
TAKEOVER_WAIT = 20.0
BLOCKS = 8  # vLLM blocks (2 MiB) each host stores, and the other loads
PAGES = 8  # SGLang pages (1 MiB)
LMCACHE_CHUNKS = 4  # LMCache "small" preset chunks (1 MiB)
PASS_GAP = 0.05  # seconds between a client's passes: an engine's pace, not a spin
SERVE_TIMEOUT = 90.0  # after a fault, both mounts serve again within this
PAUSE_TIMEOUT = 120.0  # clients reach the end of their pass within this
KINDS = ("kill", "kill-keeper", "stop", "redis", "full")
E = errno.errorcode
# Errors the docs promise an engine for each fault; anything else (and any error with no
# fault under way) is a violation.
ALLOWED: dict[str, set[str]] = {
    # operations.md, When the daemon dies: a file the dead daemon served, or a store it had
    # not committed, fails at its next call (EBADF, ENOTCONN at close); its temporary file
    # is gone after the next daemon's recovery (vLLM's clean-up or rename: ENOENT).
    "kill": {"ENOTCONN", "EBADF", "ENOENT", "ENOENT (rename)", "EEXIST (temporary)",
             "short write"},
    # ... and without the keeper: ENOTCONN until the next mount; files held open across it
    # fail ENOTCONN, ECONNABORTED or EIO.
    "kill-keeper": {"ENOTCONN", "ECONNABORTED", "EIO", "EBADF", "ENOENT", "ENOENT (rename)",
                    "EEXIST (temporary)", "short write"},
    # multi-host.md: no request waits longer than --deadline; past it, EIO. A store whose
    # temporary file the stalled host had closed but not yet renamed is the least recently
    # used file once the other host has written for the stall: evicted, its rename finds no
    # temporary file (operations.md, Capacity: a closed file may be evicted at any time).
    "stop": {"EIO", "ENOENT (rename)", "EEXIST (temporary)", "short write"},
    # multi-host.md: Redis unreachable: every request that needs metadata fails EIO.
    "redis": {"EIO", "EEXIST (temporary)", "short write"},
    # operations.md: ENOSPC once open and pinned files fill the volume (a write cut short
    # first, as on any full filesystem); the capacity shrinks to what fits, so eviction may
    # take a temporary file between its close and its rename.
    "full": {"ENOSPC", "short write", "ENOENT (rename)"},
    "none": set(),
}
# operations.md, Capacity: when the files being written on both hosts at once need more than
# the capacity, stores fail as on a full filesystem (ENOSPC; a write served in parts comes
# back short) and a file closed but not yet renamed may be evicted for another (vLLM's
# rename: ENOENT). The soak's clients have up to 52 MiB in flight against 40 MiB, by design,
# so these are allowed in any window; each is still counted and listed.
POOL_PRESSURE = {"ENOSPC", "short write", "ENOENT (rename)"}
# A write the daemon serves in parts (vLLM's 2 MiB O_DIRECT writes) of which a later part
# fails (EIO, ENOTCONN, ENOSPC) returns the bytes written before: a "short write" to vLLM's
# and numpy's checks, the same failure.
# A store that fails (as above) and whose clean-up fails too leaves its temporary file; vLLM
# names a thread's temporary files by the block's name and a suffix of the thread's own,
# so the next store of that block by that thread finds it (O_EXCL: EEXIST) until the file
# is evicted. Allowed in the fault's window, and afterwards for the temporaries the quiet
# check after a fault listed.
ERRNO = re.compile(r"\[Errno (\d+)\]")
SHORT_WRITE = re.compile(r"Short write|requested and \d+ written")
NUMBERS = re.compile(r"\b(0x)?[0-9a-f]*[0-9][0-9a-f]*\b")  # (log lines told apart by text)


# -- clients (this script run with --client) --------------------------------------------------


class Records(logging.Handler):
    """What the client's code logs at WARNING and worse, taken pass by pass."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))

    def take(self) -> list[tuple[int, str]]:
        taken, self.records = self.records, []
        return taken


Step = Callable[[], dict[str, Any]]


def vllm_steps(spec: dict[str, Any]) -> list[Step]:
    """vLLM's fs tier: store this host's blocks (removed first), then load the other's."""
    from json_worker import Collected
    from vllm_tier import VllmTier, passes

    root = Path(spec["root"]) / "vllm"
    own = VllmTier(root, spec["first"], BLOCKS, seed=spec["seed"])
    peer = VllmTier(root, spec["peer_first"], BLOCKS, seed=spec["peer_seed"])
    own.fill()
    collected = Collected()
    logging.getLogger().addHandler(collected)

    def one(tier: VllmTier, op: str) -> dict[str, Any]:
        # (one pass: `repeat` starts none if its millisecond went by before it looked)
        while not (records := passes(tier, op, list(tier.indices), 0.001, collected)):
            pass
        return records[0]

    def store() -> dict[str, Any]:
        record = one(own, "store")
        return {"op": "store", "units": BLOCKS, "failed": record["failed"],
                "bytes": (BLOCKS - record["failed"]) * own.block_size,
                "exception": record.get("error")}

    def load() -> dict[str, Any]:
        peer.slots.fill(0xA5A5A5A5A5A5A5A5)  # a block not loaded never passes for one
        record = one(peer, "load")
        loaded = record["hits"] - record["failed"]
        return {"op": "load", "units": BLOCKS, "hits": record["hits"],
                "failed": record["failed"], "mismatched": record["mismatched"],
                "bytes": (loaded - record["mismatched"]) * peer.block_size}

    return [store, load]


def sglang_steps(spec: dict[str, Any]) -> list[Step]:
    """SGLang's HiCacheFile, made once as SGLang makes it at start: store the pages it
    misses (`set` skips a page whose file exists), then look up and load all, checked."""
    from sglang_hicache import HiCacheRank

    rank = HiCacheRank(Path(spec["root"]) / "sglang", 0, PAGES, MIB, spec["seed"])
    rank.fill()
    slots = rank.slots.copy()  # (loads overwrite the slots: stores write these)

    def store() -> dict[str, Any]:
        rank.slots[:] = slots
        failed = rank.store()
        return {"op": "store", "units": PAGES, "failed": len(failed),
                "bytes": (PAGES - len(failed)) * MIB}

    def load() -> dict[str, Any]:
        rank.slots.fill(0xA5A5A5A5A5A5A5A5)  # a page not loaded never passes for one
        errors: list[str] = []
        found = rank.lookup()
        vanished, failed = rank.load(found, errors)
        loaded = sorted(set(found) - set(vanished) - set(failed))
        wrong = len(rank.mismatched(loaded))
        return {"op": "load", "units": PAGES, "hits": len(found) - len(vanished),
                "failed": len(failed), "mismatched": wrong,
                "bytes": (len(loaded) - wrong) * MIB, "errors": errors}

    return [store, load]


def lmcache_steps(spec: dict[str, Any]) -> list[Step]:
    """LMCache's fs plugin: look up and retrieve the prompt (checked chunk by chunk), and on
    the storing host store what is missing."""
    from lmcache_engine import PRESETS, parse_args, run

    chunk = PRESETS["small"].chunk_bytes
    ops = ["lookup", "retrieve", *(["store"] if spec["store"] else [])]
    argv = [*ops, "--backend", "fs", "--dir", str(Path(spec["root"]) / "lmcache"),
            "--preset", "small", "--chunks", str(LMCACHE_CHUNKS), "--kv-seed",
            str(spec["seed"]), "--timeout", "60", "--instance", f"chaos-{spec['host']}"]

    def cycle() -> dict[str, Any]:
        out = run(parse_args(argv))
        seeds = out["retrieve"]["chunk_seeds"]
        wrong = sum(seed is None for seed in seeds)
        stored = out.get("store", {})
        return {"op": "lookup+retrieve" + ("+store" if spec["store"] else ""),
                "units": LMCACHE_CHUNKS, "hits": len(seeds), "failed": 0,
                "mismatched": wrong, "bytes": (len(seeds) - wrong) * chunk,
                "errors": out["errors"],
                **({"stored": stored.get("chunks", 0), "flushed": stored.get("flushed")}
                   if stored else {})}

    return [cycle]


CLIENTS: dict[str, Callable[[dict[str, Any]], list[Step]]] = {
    "vllm": vllm_steps, "sglang": sglang_steps, "lmcache": lmcache_steps}


def client_main(spec: dict[str, Any]) -> None:
    """Run the client's steps one after another until the stop file appears; wait between
    two passes while the pause file is there. Each pass is one journal line."""
    control = Path(spec["control"])
    stop, pause = control / "stop", control / "pause"
    with open(spec["journal"], "a", buffering=1) as journal:

        def write(**fields: Any) -> None:
            journal.write(json.dumps(fields) + "\n")

        records = Records()
        logging.getLogger().addHandler(records)
        try:
            steps = CLIENTS[spec["client"]](spec)
        except Exception as exc:
            write(kind="setup-failed", t=time.monotonic(),
                  error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
            return
        for logger in logging.Logger.manager.loggerDict.values():  # (LMCache's: no propagate)
            if isinstance(logger, logging.Logger) and not logger.propagate:
                logger.addHandler(records)
        write(kind="ready", t=time.monotonic())
        for step in itertools.cycle(steps):
            if stop.exists():
                break
            if pause.exists():
                generation = pause.read_text().strip()
                write(kind="paused", generation=generation, t=time.monotonic())
                while pause.exists() and not stop.exists():
                    time.sleep(0.05)
                write(kind="resumed", t=time.monotonic())
                continue
            records.take()
            began = time.monotonic()
            try:
                record = step()
            except Exception as exc:  # the client's code raised: judged with the pass
                record = {"op": step.__name__, "exception": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()[-1500:]}
            record["logged"] = records.take()
            write(kind="pass", t0=began, t1=time.monotonic(), **record)
            time.sleep(PASS_GAP)
        write(kind="end", t=time.monotonic())


def probe(write: Path, read: Path, name: str, timeout: float, result: Path) -> None:
    """(In a child process) Write a file through one mount (a temporary name, renamed) and
    read it back through the other, retrying until `timeout`; exits 0 once it reads back
    exact. `result` gets when each side first worked and the errors met until then."""
    content = os.urandom(64 * 1024 + len(name))
    started = time.monotonic()
    outcome: dict[str, Any] = {"errors": {}}
    while time.monotonic() - started < timeout:
        try:
            if "written_s" not in outcome:
                temporary = write / "chaos" / f"{name}.tmp"
                temporary.write_bytes(content)
                temporary.rename(write / "chaos" / name)
                outcome["written_s"] = round(time.monotonic() - started, 3)
            if (read / "chaos" / name).read_bytes() == content:
                outcome["read_s"] = round(time.monotonic() - started, 3)
                (read / "chaos" / name).unlink()
                break
            outcome["errors"]["other bytes"] = outcome["errors"].get("other bytes", 0) + 1
        except OSError as error:
            key = E.get(error.errno or 0, str(error))
            outcome["errors"][key] = outcome["errors"].get(key, 0) + 1
        time.sleep(0.1)
    result.write_text(json.dumps(outcome))
    sys.exit(0 if "read_s" in outcome else 1)


# -- the soak ---------------------------------------------------------------------------------


class Abort(Exception):
    """The soak cannot go on (a mount that cannot be made again)."""


@dataclass
class Fault:
    number: int
    kind: str
    host: str
    started: float
    injected: float = 0.0  # the fault is over (remounted, resumed, restarted, emptied)
    served: float | None = None  # both mounts served again
    details: dict[str, Any] = field(default_factory=dict)
    passes: int = 0
    bytes_verified: int = 0
    misses: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # "client@host op ERRNO"
    examples: dict[str, str] = field(default_factory=dict)  # the first text of each
    violations: list[str] = field(default_factory=list)


@dataclass
class ClientTally:
    passes: int = 0
    stored_bytes: int = 0
    bytes_verified: int = 0
    hits: int = 0
    misses: int = 0
    failed: int = 0
    mismatched: int = 0
    errors: int = 0


@dataclass
class Client:
    name: str  # client@host
    spec: dict[str, Any]
    process: subprocess.Popen | None = None
    offset: int = 0  # journal read so far
    ready: bool = False
    setup_error: str = ""
    tally: ClientTally = field(default_factory=ClientTally)

    @property
    def journal(self) -> Path:
        return Path(self.spec["journal"])

    def new_lines(self) -> list[dict[str, Any]]:
        """Journal lines written since the last call (whole lines only)."""
        try:
            with open(self.journal, "rb") as file:
                file.seek(self.offset)
                text = file.read()
        except FileNotFoundError:
            return []
        whole = text[:text.rfind(b"\n") + 1]
        self.offset += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]


class Chaos:
    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.console = console
        self.seconds = 120.0 if args.quick else args.minutes * 60
        self.seed = args.seed if args.seed is not None else random.randrange(1 << 32)
        self.rng = random.Random(self.seed)
        args.workdir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="kvfs-chaos-", dir=args.workdir))
        self.volume = self.work / "volume"
        self.data = self.volume / "pool"
        self.control = self.work / "control"
        self.logs = self.work / "logs"
        self.redis = LocalRedis(self.work / "redis", extra=("--appendfsync", "always"))
        self.hosts: dict[str, KvfsMount] = {}
        self.clients: list[Client] = []
        self.faults: list[Fault] = []
        self.calm = Fault(0, "none", "", 0.0)  # what happened outside every fault
        self.notes: list[str] = []
        self.violations: list[str] = []
        self.kinds = [kind for kind in KINDS if kind in (args.faults or KINDS)]
        self.tmpfs = False
        self.stopped = 0  # a daemon under SIGSTOP, to resume whatever happens
        self.keepers: set[int] = set()
        self.filler = self.volume / "filler"
        self.handler_errors: dict[str, tuple[int, int]] = {}  # host -> (daemon pid, count)
        self.evictions: dict[str, tuple[int, int]] = {}  # host -> (daemon pid, count)
        self.leftovers: set[str] = set()  # temporary files failed stores left (paths in a mount)
        self.capacity = 0
        self.generation = 0
        self.fsck_output = ""
        self.log_problems: list[str] = []
        self.finished = False
        self.sampling = threading.Event()  # set: the sampler stops
        self.used_max = 0
        self.used_over = 0  # samples above the capacity
        self.held_max = 0  # ... of committed and claimed bytes
        self.loop_drops: dict[str, dict[str, int]] = {}  # host -> cause -> drops, at the end
        self.samples = 0
        self.deadline = 0.0  # (monotonic) no fault starts after this

    # -- set-up ----------------------------------------------------------------------------

    def options(self) -> list[str]:
        return ["--meta", self.redis.url, "--session-ttl", f"{SESSION_TTL:g}", "--capacity",
                CAPACITY, "--takeover-wait", f"{TAKEOVER_WAIT:g}"]

    def set_up(self) -> None:
        for directory in (self.volume, self.control, self.logs):
            directory.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME_SIZE}",
                                 "kvfs-chaos", str(self.volume)], capture_output=True,
                                text=True)
        self.tmpfs = result.returncode == 0
        if not self.tmpfs:
            self.note(f"no tmpfs for the volume ({result.stderr.strip()}): the full-volume "
                      "fault is skipped, the data directory is on the work directory's disk")
            self.kinds = [kind for kind in self.kinds if kind != "full"]
        self.redis.start()
        for name in ("A", "B"):
            mountpoint = self.work / f"mnt-{name}"
            mountpoint.mkdir()
            self.hosts[name] = KvfsMount(mountpoint, self.data, self.options())
            self.mount(name)
        # (SGLang's directory too: two HiCacheFiles starting at once race to make it, EEXIST)
        for made in ("chaos", "sglang"):
            (self.hosts["A"].mountpoint / made).mkdir()
        self.capacity = stats(self.hosts["A"].mountpoint)["capacity_bytes"]

    def mount(self, name: str) -> str:
        """The mount command (the same every time); its stderr. Raises Abort if it fails."""
        host = self.hosts[name]
        result = run_mount(host.mountpoint, host.data, *host.options)
        if result.returncode != 0:
            raise Abort(f"mounting host {name} failed: {result.stderr.strip()[-500:]}")
        host.pid = daemon_pid(host.data, host.mountpoint)
        with contextlib.suppress(AssertionError):
            self.keepers.add(keeper_pid(host.mountpoint))
        return result.stderr

    def start_clients(self) -> None:
        specs: list[dict[str, Any]] = [
            {"client": "vllm", "host": "A", "first": 0, "peer_first": 1000, "seed": 11,
             "peer_seed": 12},
            {"client": "vllm", "host": "B", "first": 1000, "peer_first": 0, "seed": 12,
             "peer_seed": 11},
            {"client": "sglang", "host": "A", "seed": 21},
            {"client": "sglang", "host": "B", "seed": 21},
            {"client": "lmcache", "host": "A", "seed": 31, "store": True},
            {"client": "lmcache", "host": "B", "seed": 31, "store": False},
        ]
        environment = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
        for spec in specs:
            name = f"{spec['client']}@{spec['host']}"
            spec |= {"root": str(self.hosts[spec["host"]].mountpoint),
                     "control": str(self.control),
                     "journal": str(self.logs / f"{name}.jsonl")}
            client = Client(name, spec)
            with open(self.logs / f"{name}.log", "w") as output:
                client.process = subprocess.Popen(
                    [sys.executable, __file__, "--client", json.dumps(spec)],
                    stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                    cwd=self.work, env=environment, start_new_session=True)
            self.clients.append(client)

    def wait_clients_ready(self) -> None:
        """Until every client has made its first pass (or failed to set up)."""
        deadline = time.monotonic() + 300
        pending = list(self.clients)
        while pending and time.monotonic() < deadline:
            for client in list(pending):
                for line in self.read_lines(client, self.calm):
                    if line["kind"] == "setup-failed":
                        client.setup_error = line["error"]
                if client.setup_error or client.tally.passes:
                    pending.remove(client)
                elif client.process is not None and client.process.poll() is not None:
                    client.setup_error = f"exited {client.process.returncode} (see its log)"
                    pending.remove(client)
            time.sleep(0.5)
        for client in pending:
            self.violation(self.calm, f"{client.name} made no pass in 300 s")
        for client in self.clients:
            if client.setup_error:
                message = f"{client.name} could not start: {client.setup_error}"
                if client.spec["client"] == "lmcache" and "ModuleNotFoundError" in message:
                    self.note(message)
                else:
                    self.violation(self.calm, message)

    # -- bookkeeping -----------------------------------------------------------------------

    def note(self, message: str) -> None:
        self.notes.append(message)
        self.console.print(f"[yellow]note[/yellow] {message}", markup=True, highlight=False)

    def violation(self, fault: Fault, message: str) -> None:
        text = f"{fault.kind}#{fault.number}: {message}" if fault.number else message
        fault.violations.append(message)
        self.violations.append(text)
        self.console.print(f"[red]VIOLATION[/red] {text}", highlight=False)

    def read_lines(self, client: Client, fault: Fault) -> list[dict[str, Any]]:
        """The client's new journal lines; its passes judged, each by `fault` if it
        overlaps the fault's window, else as calm."""
        lines = client.new_lines()
        for line in lines:
            if line["kind"] == "pass":
                self.judge(client, line, fault if line["t1"] >= fault.started else self.calm)
        return lines

    def judge(self, client: Client, line: dict[str, Any], fault: Fault) -> None:
        tally = client.tally
        tally.passes += 1
        fault.passes += 1
        loading = "load" in line["op"] or "retrieve" in line["op"]
        if loading:
            tally.bytes_verified += line.get("bytes", 0)
            fault.bytes_verified += line.get("bytes", 0)
            tally.hits += line.get("hits", 0)
            misses = line.get("units", 0) - line.get("hits", 0)
            tally.misses += misses
            fault.misses += misses
        else:
            tally.stored_bytes += line.get("bytes", 0)
        tally.failed += line.get("failed", 0)
        if line.get("mismatched"):
            tally.mismatched += line["mismatched"]
            self.violation(fault, f"{client.name} {line['op']}: {line['mismatched']} units "
                                  "came back with other bytes than were written")
        texts = self.error_texts(line)
        for problem, text in self.problems(texts, loading):
            tally.errors += 1
            key = f"{client.name} {line['op']} {problem}"
            fault.errors[key] += 1
            fault.examples.setdefault(key, text[:400])
            if problem == "EEXIST (temporary)" and any(
                    text.rstrip("'").endswith(name) for name in self.leftovers):
                continue
            if problem not in ALLOWED[fault.kind] | POOL_PRESSURE:
                self.violation(fault, f"{client.name} {line['op']}: {problem}; the pass "
                                      f"logged: {' | '.join(texts)[:1200]}")

    @staticmethod
    def error_texts(line: dict[str, Any]) -> list[str]:
        """What one pass reports of its failures: what the client's code logged at ERROR,
        the errors it returned, an exception it raised."""
        texts = [message for level, message in line.get("logged", [])
                 if level >= logging.ERROR]
        texts += line.get("errors", [])
        if line.get("exception"):
            texts.append(line["exception"])
        if line.get("failed") and not texts:
            texts.append("failed without a message")
        return texts

    @staticmethod
    def problems(texts: list[str], loading: bool) -> list[tuple[str, str]]:
        """Each error of a pass by its errno's name, with its text. A load whose file went
        between lookup and open (ENOENT) is a miss, not an error; a write cut short (the
        volume filled up: vLLM's and numpy's checks of what write() returned) is "short
        write"."""
        found = []
        for text in texts:
            match = ERRNO.search(text)
            if match:
                name = E.get(int(match.group(1)), match.group(1))
                if name == "ENOENT" and "' -> '" in text:
                    name = "ENOENT (rename)"
                elif name == "EEXIST" and text.rstrip("'").endswith(".tmp"):
                    name = "EEXIST (temporary)"
            elif SHORT_WRITE.search(text):
                name = "short write"
            else:
                name = f"other: {text[:80]}"
            if not (loading and name == "ENOENT"):
                found.append((name, text))
        return found

    # -- faults ----------------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        host = self.hosts[fault.host]
        if fault.kind in ("kill", "kill-keeper"):
            log = host.data / "kvfs.log"
            taken_before = log.read_text().count("took over")
            victims = [host.pid]
            if fault.kind == "kill-keeper":
                victims.append(keeper_pid(host.mountpoint))
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            for pid in victims:
                if not wait_dead(pid, 20):
                    raise Abort(f"pid {pid} survived SIGKILL")
            delay = self.rng.uniform(0.5, 3.0)
            fault.details["restart_delay_s"] = round(delay, 2)
            time.sleep(delay)
            began = time.monotonic()
            try:
                said = self.mount(fault.host)
            except Abort as error:
                if "is not empty" not in str(error):
                    raise
                said = str(error) + self.mount_over_bare(fault)
            fault.details["mount_s"] = round(time.monotonic() - began, 2)
            taken = log.read_text().count("took over") > taken_before
            fault.details["taken_over"] = taken
            fault.details["cleared_dead_mount"] = "cleared the dead kvfs mount" in said
            if fault.kind == "kill" and not taken:
                self.violation(fault, "the mount command did not take the mount over from "
                                      "its keeper")
            if fault.kind == "kill-keeper" and not fault.details["cleared_dead_mount"]:
                self.violation(fault, "the mount command did not clear the dead mount")
        elif fault.kind == "stop":
            before = stats(host.mountpoint)["sessions_lost"]
            other = self.hosts["B" if fault.host == "A" else "A"]
            reaped = stats(other.mountpoint)["sessions_reaped"]
            seconds = 4 * SESSION_TTL + self.rng.uniform(0.0, 2.0)
            fault.details["stopped_s"] = round(seconds, 2)
            self.stopped = host.pid
            os.kill(host.pid, signal.SIGSTOP)
            time.sleep(seconds)
            os.kill(host.pid, signal.SIGCONT)
            self.stopped = 0
            fault.details["sessions_lost_before"] = before
            fault.details["sessions_reaped_before"] = reaped
        elif fault.kind == "redis":
            assert self.redis.process is not None
            self.redis.process.kill()
            self.redis.process.wait()
            self.redis.process = None
            down = self.rng.uniform(0.0, 3.0)
            fault.details["down_s"] = round(down, 2)
            time.sleep(down)
            self.redis.start()
        elif fault.kind == "full":
            st = os.statvfs(self.volume)
            free = st.f_bavail * st.f_frsize
            size = max(0, free - 256 * 1024)
            fault.details["free_before"] = free
            with open(self.filler, "wb") as filler:
                while size > 0:
                    try:
                        os.posix_fallocate(filler.fileno(), 0, size)
                        break
                    except OSError as error:
                        if error.errno != errno.ENOSPC:
                            raise
                        size -= MIB  # kvfs wrote meanwhile
            fault.details["filled"] = size
            held = self.rng.uniform(4.0, 8.0)
            fault.details["held_s"] = round(held, 2)
            time.sleep(held)
            st = os.statvfs(self.volume)
            fault.details["free_while_full"] = st.f_bavail * st.f_frsize
            self.filler.unlink()
        fault.injected = time.monotonic()

    def probe(self, writer: str, reader: str, name: str, timeout: float) -> dict[str, Any]:
        """`probe` in a child process (forked: no start-up), which is killed if it hangs
        on a mount; what it found, with "hung" if it did."""
        result = self.work / f"{name}.json"
        child = multiprocessing.get_context("fork").Process(target=probe, args=(
            self.hosts[writer].mountpoint, self.hosts[reader].mountpoint, name, timeout,
            result))
        child.start()
        child.join(timeout + 30)
        if child.is_alive():
            child.kill()
            child.join(30)
            return {"hung": True}
        outcome: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
        result.unlink(missing_ok=True)
        return outcome

    def mount_over_bare(self, fault: Fault) -> str:
        """The mount command cleared the dead mount and then refused its mountpoint: the
        clients wrote into the bare directory (on the disk beneath) in between. Pause them,
        empty the directory, mount again; the mount command's stderr."""
        host = self.hosts[fault.host]
        found = sorted(entry.name for entry in host.mountpoint.iterdir())
        fault.details["bare_mountpoint_held"] = found
        self.violation(fault, f"the mount command cleared the dead mount, then refused the "
                              f"mountpoint as not empty: clients wrote {found} into the bare "
                              "directory in between (emptied, with the clients paused, to "
                              "go on)")
        self.pause_clients(fault)
        try:
            for entry in host.mountpoint.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            return self.mount(fault.host)
        finally:
            self.resume_clients()

    def serve_again(self, fault: Fault) -> bool:
        """Whether each mount reads back what the other wrote, within SERVE_TIMEOUT."""
        ok = True
        for writer, reader in (("A", "B"), ("B", "A")):
            outcome = self.probe(writer, reader, f"probe-{fault.number}-{writer}",
                                 SERVE_TIMEOUT)
            fault.details[f"probe_{writer}_to_{reader}"] = outcome
            if "read_s" not in outcome:
                ok = False
                self.violation(fault, f"{writer} -> {reader} does not serve "
                                      f"{SERVE_TIMEOUT:.0f} s after the fault: {outcome}")
        if ok:
            fault.served = time.monotonic()
        return ok

    def repair(self, fault: Fault) -> None:
        """A mount that does not serve: kill it and mount it again, so the soak goes on."""
        for name, host in self.hosts.items():
            if "read_s" in self.probe(name, name, f"repair-{fault.number}-{name}", 10):
                continue
            self.note(f"after {fault.kind}#{fault.number}: host {name} killed and mounted "
                      "again to go on")
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.pid, signal.SIGKILL)
            wait_dead(host.pid, 20)
            subprocess.run(["fusermount3", "-u", "-z", str(host.mountpoint)],
                           capture_output=True)
            self.mount(name)

    def pause_clients(self, fault: Fault) -> None:
        self.generation += 1
        (self.control / "pause").write_text(f"{self.generation}\n")
        waiting = {client.name for client in self.running_clients()}
        deadline = time.monotonic() + PAUSE_TIMEOUT
        while waiting and time.monotonic() < deadline:
            for client in self.running_clients():
                for line in self.read_lines(client, fault):
                    if (line["kind"] == "paused"
                            and line["generation"] == str(self.generation)):
                        waiting.discard(client.name)
                if client.process is not None and client.process.poll() is not None:
                    waiting.discard(client.name)
            time.sleep(0.1)
        for name in sorted(waiting):
            self.violation(fault, f"{name} did not finish its pass within "
                                  f"{PAUSE_TIMEOUT:.0f} s (hung)")

    def resume_clients(self) -> None:
        (self.control / "pause").unlink(missing_ok=True)

    def running_clients(self) -> list[Client]:
        return [client for client in self.clients if not client.setup_error]

    def check_pool(self, fault: Fault) -> None:
        """The invariants of a quiet pool (clients paused between passes)."""
        for client in self.running_clients():
            if client.process is not None and client.process.poll() is not None:
                self.violation(fault, f"{client.name} exited ({client.process.returncode})")
                client.setup_error = "exited"
        checks: list[tuple[str, Callable[[], None]]] = [
            (f"counters of {name}", functools.partial(assert_pool_counters_exact, host))
            for name, host in self.hosts.items()]
        checks.append(("staging", functools.partial(assert_only_spares_staged, self.data,
                                                    *self.hosts.values())))
        for what, check in checks:
            try:
                check()
            except AssertionError as error:
                self.violation(fault, f"{what}: {str(error).splitlines()[0][:300]}")
        shown = stats(self.hosts["A"].mountpoint)
        if not wait_for(lambda: stats(self.hosts["A"].mountpoint)["used_bytes"]
                        <= self.capacity, 10):
            self.violation(fault, f"used bytes {shown['used_bytes']} above the capacity "
                                  f"{self.capacity}")
        if not wait_for(lambda: blob_bytes_on_disk(self.data) <= self.capacity, 10):
            self.violation(fault, f"blob files take {blob_bytes_on_disk(self.data)} bytes, "
                                  f"above the capacity {self.capacity}")
        for name, host in self.hosts.items():
            shown = stats(host.mountpoint)
            pid, before = self.handler_errors.get(name, (host.pid, 0))
            before = before if pid == host.pid else 0  # (a new daemon counts from 0)
            if shown["handler_errors"] > before:
                self.violation(fault, f"host {name}: {shown['handler_errors'] - before} "
                                      "requests ended in an unexpected error "
                                      "(handler_errors; tracebacks in kvfs.log)")
            self.handler_errors[name] = (host.pid, shown["handler_errors"])
            pid, before = self.evictions.get(name, (host.pid, 0))
            fault.details[f"evictions_{name}"] = shown["evictions"] - (
                before if pid == host.pid else 0)
            self.evictions[name] = (host.pid, shown["evictions"])
            if shown["pool_lost"]:
                self.violation(fault, f"host {name} reports the pool lost")
        fault.details["used_bytes"] = shown["used_bytes"]
        leftovers = {str(Path(directory, name).relative_to(self.hosts["A"].mountpoint))
                     for directory, _, names in os.walk(self.hosts["A"].mountpoint / "vllm")
                     for name in names if name.endswith(".tmp")}
        fault.details["temporaries_left"] = len(leftovers - self.leftovers)
        self.leftovers |= leftovers

    def after_stop(self, fault: Fault) -> None:
        """The stopped host came back as a new session, or failed cleanly."""
        host = self.hosts[fault.host]
        other = self.hosts["B" if fault.host == "A" else "A"]
        lost = wait_for(lambda: stats(host.mountpoint)["sessions_lost"]
                        > fault.details["sessions_lost_before"], 10)
        fault.details["rejoined"] = lost
        fault.details["reaped_by_other"] = (stats(other.mountpoint)["sessions_reaped"]
                                            > fault.details["sessions_reaped_before"])
        if not lost:
            self.note(f"stop#{fault.number}: host {fault.host} was not declared dead "
                      f"(stopped {fault.details['stopped_s']} s)")

    def one_fault(self, number: int, kind: str) -> None:
        host = self.rng.choice(["A", "B"])
        fault = Fault(number, kind, host, time.monotonic())
        self.faults.append(fault)
        self.console.print(f"[bold]fault {number}[/bold]: {kind} on host {host} "
                           f"({max(0.0, self.deadline - time.monotonic()):.0f} s left)")
        self.inject(fault)
        if not self.serve_again(fault):
            self.repair(fault)
        elif kind == "stop":
            self.after_stop(fault)
        self.pause_clients(fault)
        try:
            self.check_pool(fault)
        finally:
            self.resume_clients()
        served = (f"served again {fault.served - fault.injected:.1f} s after"
                  if fault.served else "did not serve again")
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(fault.errors.items())) or "none"
        self.console.print(f"  {fault.passes} passes, {human(fault.bytes_verified)} verified, "
                           f"{served}; errors: {errors}", highlight=False)
        fault.details["recovery_s"] = (round(fault.served - fault.injected, 2)
                                       if fault.served else None)

    # -- the whole run ---------------------------------------------------------------------

    def sample_usage(self) -> None:
        """The pool's committed bytes, and those and the hosts' claims, read from Redis in
        one step ten times a second: hosts claim room before their writers stage, checked
        against the capacity in the same step, so no sample may pass it (`finish`)."""
        client = Redis.from_url(self.redis.url, socket_timeout=1, socket_connect_timeout=0.5)
        while not self.sampling.wait(0.1):
            try:
                counters = client.hgetall(b"{kvfs}:counters")
            except RedisError:  # (restarting)
                continue
            used = int(counters.get(b"used_bytes", 0))
            held = used + sum(int(value) for key, value in counters.items()
                              if key.startswith(b"claim:"))
            self.used_max = max(self.used_max, used)
            self.held_max = max(self.held_max, held)
            self.used_over += used > self.capacity
            self.samples += 1
        client.close()

    def run(self) -> None:
        self.console.print(f"kvfs chaos soak: {self.seconds / 60:g} minutes of faults in "
                           f"{self.work} (seed {self.seed})")
        try:
            self.soak()
        except Abort as error:
            self.violation(self.calm, f"the soak could not go on: {error}")
        finally:
            self.sampling.set()

    def soak(self) -> None:
        self.set_up()
        threading.Thread(target=self.sample_usage, daemon=True).start()
        self.start_clients()
        self.wait_clients_ready()
        self.deadline = time.monotonic() + self.seconds
        gap = (2.0, 5.0) if self.args.quick else (2.0, 10.0)
        deck: list[str] = []
        for number in itertools.count(1):
            if time.monotonic() >= self.deadline:
                break
            time.sleep(self.rng.uniform(*gap))
            for client in self.running_clients():
                self.read_lines(client, self.calm)
            if not deck:
                deck = self.rng.sample(self.kinds, len(self.kinds))
            self.one_fault(number, deck.pop())
        self.finish()

    def finish(self) -> None:
        (self.control / "stop").touch()
        for client in self.clients:
            if client.process is None:
                continue
            try:
                client.process.wait(PAUSE_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.violation(self.calm, f"{client.name} did not stop within "
                                          f"{PAUSE_TIMEOUT:.0f} s (hung)")
            self.read_lines(client, self.calm)
        for name, host in self.hosts.items():
            with contextlib.suppress(OSError, ValueError):  # (a host that is not serving)
                self.loop_drops[name] = stats(host.mountpoint)["metadata_loop_drops"]
            if subprocess.run(["fusermount3", "-u", str(host.mountpoint)],
                              capture_output=True).returncode:
                self.note(f"host {name} was busy at the end: unmounted lazily")
                subprocess.run(["fusermount3", "-u", "-z", str(host.mountpoint)],
                               capture_output=True)
            if not wait_dead(host.pid, 60):
                self.violation(self.calm, f"host {name}'s daemon did not exit after unmount")
            host.pid = 0
        checked = fsck(self.data, self.redis.url)
        self.fsck_output = (checked.stdout + checked.stderr).strip()
        if checked.returncode != 0 or "is clean" not in checked.stderr:
            self.violation(self.calm, f"final fsck exited {checked.returncode}: "
                                      f"{self.fsck_output[-800:]}")
        self.log_problems = log_problems(self.data / "kvfs.log")
        if self.used_over:
            self.violation(self.calm, f"committed bytes above the capacity in {self.used_over} "
                                      f"samples (at most {human(self.used_max)})")
        self.finished = True

    def cleanup(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.stopped, signal.SIGCONT)
        (self.control / "stop").touch()
        for client in self.clients:
            if client.process is not None and client.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(client.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    client.process.wait(20)
        self.filler.unlink(missing_ok=True)
        for host in self.hosts.values():
            if host.pid and pid_alive(host.pid):
                subprocess.run(["fusermount3", "-u", "-z", str(host.mountpoint)],
                               capture_output=True)
                if not wait_dead(host.pid, 15):
                    os.kill(host.pid, signal.SIGKILL)
                    wait_dead(host.pid, 10)
            if is_mounted(host.mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(host.mountpoint)],
                               capture_output=True)
        for pid in self.keepers:
            if pid_alive(pid) and not wait_dead(pid, 5):
                os.kill(pid, signal.SIGKILL)
        self.redis.stop()
        if self.tmpfs:
            if self.args.keep:
                with contextlib.suppress(OSError):
                    shutil.copytree(self.data, self.work / "pool-copy",
                                    ignore=shutil.ignore_patterns("blobs", "staging"))
            subprocess.run(["umount", "-l", str(self.volume)], capture_output=True)
        mounted = [host.mountpoint for host in self.hosts.values()
                   if is_mounted(host.mountpoint)] + ([self.volume] if is_mounted(self.volume)
                                                     else [])
        if self.args.keep:
            self.console.print(f"kept the work directory {self.work}")
        elif mounted:
            self.console.print(f"[red]still mounted: {mounted}; left {self.work}[/red]")
        else:
            shutil.rmtree(self.work, ignore_errors=True)

    # -- the report ------------------------------------------------------------------------

    def summary(self, seconds: float) -> dict[str, Any]:
        table = Table(title=f"kvfs chaos soak: {seconds / 60:.1f} minutes, seed {self.seed}"
                            f"{'' if self.finished else ' (did not finish)'}")
        for column in ("fault", "count", "recovery s (max)", "passes", "verified", "misses",
                       "errors", "violations"):
            table.add_column(column, justify="left" if column in ("fault", "errors")
                             else "right")
        by_kind: dict[str, list[Fault]] = {}
        for fault in [*self.faults, self.calm]:
            by_kind.setdefault(fault.kind, []).append(fault)
        rows: dict[str, dict[str, Any]] = {}
        row: dict[str, Any]
        for kind, faults in by_kind.items():
            recovery = [f.details.get("recovery_s") for f in faults if f.number]
            errors: Counter[str] = Counter()
            for f in faults:
                for key, count in f.errors.items():
                    errors[key.split(" ", 2)[2]] += count
            rows[kind] = row = {
                "count": len([f for f in faults if f.number]),
                "recovery_max_s": max((r for r in recovery if r is not None), default=None),
                "passes": sum(f.passes for f in faults),
                "bytes_verified": sum(f.bytes_verified for f in faults),
                "misses": sum(f.misses for f in faults),
                "errors": dict(errors),
                "violations": sum(len(f.violations) for f in faults)}
            table.add_row(kind if kind != "none" else "no fault (calm)",
                          str(row["count"]) if kind != "none" else "",
                          "" if row["recovery_max_s"] is None else f"{row['recovery_max_s']:.1f}",
                          f"{row['passes']:,}", human(row["bytes_verified"]),
                          f"{row['misses']:,}",
                          ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "0",
                          f"[red]{row['violations']}[/red]" if row["violations"] else "0")
        self.console.print(table)
        clients = Table(title="clients")
        for column in ("client", "passes", "stored", "verified", "hits", "misses", "failed",
                       "mismatched", "errors"):
            clients.add_column(column, justify="left" if column == "client" else "right")
        for client in self.clients:
            t = client.tally
            clients.add_row(client.name, f"{t.passes:,}", human(t.stored_bytes),
                            human(t.bytes_verified), f"{t.hits:,}", f"{t.misses:,}",
                            f"{t.failed:,}", f"[red]{t.mismatched}[/red]" if t.mismatched
                            else "0", f"{t.errors:,}")
        self.console.print(clients)
        for note, count in Counter(self.notes).items():
            self.console.print(f"note: {note}" + (f" (x{count})" if count > 1 else ""),
                               highlight=False)
        self.console.print(f"committed bytes in {self.samples:,} samples: at most "
                           f"{human(self.used_max)} of {human(self.capacity)}, "
                           f"{self.used_over} above; with the claims at most "
                           f"{human(self.held_max)}", highlight=False)
        for message, count in Counter(
                NUMBERS.sub("N", problem.splitlines()[0].split(": ", 1)[-1])
                for problem in self.log_problems).most_common(12):
            self.console.print(f"  kvfs.log x{count}: {message[:150]}", markup=False,
                               highlight=False)
        self.console.print(f"loop connection drops by host and cause: {self.loop_drops}",
                           highlight=False)
        verdict = self.fsck_output.splitlines()[-1] if self.fsck_output else "not run"
        self.console.print(f"kvfs.log: {len(self.log_problems)} warnings and worse; "
                           f"fsck: {verdict}", highlight=False)
        if self.violations:
            self.console.print(f"[red bold]{len(self.violations)} violations:[/red bold]")
            for text in self.violations[:40]:
                self.console.print(f"  {text}", markup=False, highlight=False)
        else:
            self.console.print("[green bold]no violations[/green bold]")
        return {
            "seed": self.seed, "seconds": round(seconds, 1), "finished": self.finished,
            "settings": {"capacity": CAPACITY, "session_ttl": SESSION_TTL,
                         "takeover_wait": TAKEOVER_WAIT, "volume": VOLUME_SIZE if self.tmpfs
                         else "work directory", "redis": "appendonly, appendfsync always",
                         "kinds": self.kinds},
            "by_fault_kind": rows,
            "faults": [asdict(f) | {"errors": dict(f.errors)} for f in self.faults],
            "calm": asdict(self.calm) | {"errors": dict(self.calm.errors)},
            "clients": {c.name: asdict(c.tally) | ({"setup_error": c.setup_error}
                                                   if c.setup_error else {})
                        for c in self.clients},
            "used_bytes_sampled": {"samples": self.samples, "max": self.used_max,
                                   "samples_above_capacity": self.used_over,
                                   "max_with_claims": self.held_max,
                                   "capacity": self.capacity},
            "loop_connection_drops": self.loop_drops,
            "notes": self.notes, "violations": self.violations, "fsck": self.fsck_output,
            "kvfs_log_problems": self.log_problems[:200],
        }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="how long faults are injected (default 10)")
    parser.add_argument("--quick", action="store_true", help="about two minutes of faults")
    parser.add_argument("--faults", choices=KINDS, action="append",
                        help="inject only these faults (repeatable; default all)")
    parser.add_argument("--seed", type=int, help="random seed (default: a random one)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                        help="where to make the work directory (default /var/tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--out", type=Path,
                        default=REPO / "bench-results" / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
                                                         ".json",
                        help="the JSON report (default bench-results/chaos-DATE.json)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        client_main(json.loads(args.client))
        return 0
    console = Console(width=None if sys.stdout.isatty() else 140)
    if os.geteuid() != 0:
        console.print("chaos.py needs root (FUSE mounts, a tmpfs)")
        return 2
    chaos = Chaos(args, console)
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))  # (SIGTERM: run_cleaning_up)
    started, finished = run_cleaning_up(chaos, console)
    report = chaos.summary(time.monotonic() - started)
    save_report(args.out, report, chaos.work, console)
    return 0 if finished and chaos.finished and not chaos.violations else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
