"""LMCache 0.5.7's multiprocess-mode `fs` L2 adapter (FSL2Adapter), run unchanged over a
directory (a kvfs mount), as an LMCache MP server started with
`lmcache server ... --l2-adapter '{"type":"fs","base_path":DIR}'` runs it: the tests drive
kvfs with LMCache's code, not a model of it.

    python tests/lmcache_mp.py store|lookup|load --dir DIR --chunks N [--first I]
        [--chunk-mib 32] [--seed S] [--seeds S,T] [--batch B] [--rounds R]
        [--barrier DIR --parties P]

prints one JSON line: what was done, how long it took, and per chunk index what was stored,
missed, failed or (loads) came back as something other than one seed's whole chunk. Stores and
loads run in separate processes, like MP servers on hosts sharing one directory.

The server itself is not run: it is the whole of LMCache 0.5.7, whose package would take the
import name of the 0.5.6 installed in .venv and which requires what .venv has not (gRPC,
FastAPI, OpenTelemetry, and CUDA-only packages: cupy-cuda13x, cufile-python, nvtx); its clients
are vLLM's LMCacheMPConnector in GPU workers. The adapter is driven directly, through the
interface the server's store and prefetch controllers call, as they call it: the adapter is
built from the `--l2-adapter` JSON by the server's own parser
(`parse_args_to_l2_adapters_config`) and factory; a store is `submit_store_task(keys, objects)`
(the store controller submits one task per batch of keys L1 finished writing), then a poll of
the adapter's store event fd and `pop_completed_store_tasks`; a lookup is
`submit_lookup_and_lock_task` and `query_lookup_and_lock_result` after its event fd; a load is
`submit_load_task` of the keys found and `query_load_result`. The adapter's own code runs
unchanged on its own event loop thread (aiofiles): a store of a key is `exists(<name>.data)`
(skipped if there), open of one fixed temp name `<name>.tmp` with "wb"
(O_WRONLY|O_CREAT|O_TRUNC), one write of the chunk, close, `os.replace` onto `<name>.data`, no
fsync (where one of these fails, it counts the task failed and removes the temp name:
`exists(<name>.tmp)`, then unlink; an error of that unlink ends the task, its later keys not
stored); a lookup is `exists` per key; a load is open "rb" and readinto until full (a short
file is a miss).

Run unchanged, from `.venv/lmcache-0.5.7/` (scripts/setup.sh unpacks them from the 0.5.7rc2
wheel): `lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py` and what it imports:
`l2_adapters/{base,config,factory}.py`, `distributed/{api,internal_api,error}.py`,
`distributed/serde/base.py` (SerdeConfig), `mp_observability/{event,event_bus,otel_init}.py`
(the event bus the adapter publishes to), `platform/event_notifier.py` (its eventfds),
`lmcache/logging.py`, and the native extension `lmcache_native` (Bitmap; it links against
torch's libraries, so torch is imported first).

Stood in (registered in sys.modules before those load), because the real ones pull in
LMCache's device layer (device detection, CUDA ops, every serde codec):
- `lmcache` itself: a package whose path is `.venv/lmcache-0.5.7/lmcache`, without the wheel's
  `__init__.py` (which resolves device ops). `lmcache.v1`, `...distributed` and
  `...l2_adapters` are then namespace packages of the unpacked files, so the adapters
  package's `__init__.py` (which lists every adapter module) does not run either. The
  installed LMCache 0.5.6 is never imported.
- `lmcache.v1.platform`: exposes `create_event_notifier` of the real `event_notifier.py`
  only; its `__init__.py` detects devices.
- `lmcache.v1.distributed.serde`: exposes `SerdeConfig` of the real `serde/base.py` only; its
  `__init__.py` imports every codec (TurboQuant, FP8, AES-GCM). Only `"serde"` in an adapter's
  JSON uses it (none here).
- `lmcache.v1.memory_management.MemoryObj`: a placeholder class, only named in annotations.
  The objects handed to the adapter are `Chunk`s with what it uses of a MemoryObj:
  `byte_array`, a writable memoryview of the chunk's bytes (LMCache's is a memoryview of a
  ctypes array over its L1 tensor).

A chunk is `--chunk-mib` MiB (32: 256 tokens of Llama-3.1-8B in fp16, LMCache's chunk), keyed
as the server keys it: model name, `kv_rank` of TP 1 (`ObjectKey.ComputeKVRank(1, 0, 1, 0)`),
a 32-byte chunk hash of index `i`. Its content is a pure function of (seed, index): a random
pattern of the seed, xored with a word of (seed, index), and every 4 KiB starting with
(MAGIC, seed, index, block), so any process can check every byte and tell which seeds'
blocks a mixed chunk holds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import json
import logging
import os
import select
import sys
import time
import types
from pathlib import Path
from typing import Any

# Before LMCache's modules load: init_logger reads it once per logger.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402, F401  (loads the libraries lmcache_native links against)
from json_worker import Collected, run_json, timed  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LMCACHE_DIR = REPO / ".venv" / "lmcache-0.5.7"
ADAPTER = "lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py"
MIB = 1 << 20
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 4096
WORDS = BLOCK // 8
MAGIC = 0x6B7666732D6D706C  # "kvfs-mpl"
WAIT_S = 300.0  # for one task of the adapter


# -- stand-ins for the modules the adapter's imports would pull in ----------------------------


class MemoryObj:
    """Placeholder: lmcache.v1.memory_management.MemoryObj, named in annotations only."""


def _stand_in(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


@functools.cache
def load_lmcache() -> types.SimpleNamespace:
    """LMCache 0.5.7's fs L2 adapter module, its config module and ObjectKey, loaded from
    LMCACHE_DIR."""
    assert (LMCACHE_DIR / ADAPTER).is_file(), f"{LMCACHE_DIR / ADAPTER} is missing: " \
        "run scripts/setup.sh"
    package = LMCACHE_DIR / "lmcache"
    _stand_in("lmcache", __path__=[str(package)])
    _stand_in("lmcache.v1.memory_management", MemoryObj=MemoryObj)
    platform = _stand_in("lmcache.v1.platform", __path__=[str(package / "v1/platform")])
    notifier = importlib.import_module("lmcache.v1.platform.event_notifier")
    platform.create_event_notifier = notifier.create_event_notifier
    serde = _stand_in("lmcache.v1.distributed.serde",
                      __path__=[str(package / "v1/distributed/serde")])
    serde.SerdeConfig = importlib.import_module("lmcache.v1.distributed.serde.base").SerdeConfig
    fs = importlib.import_module(ADAPTER.removesuffix(".py").replace("/", "."))
    config = importlib.import_module("lmcache.v1.distributed.l2_adapters.config")
    factory = importlib.import_module("lmcache.v1.distributed.l2_adapters.factory")
    api = importlib.import_module("lmcache.v1.distributed.api")
    return types.SimpleNamespace(fs=fs, config=config, factory=factory, api=api,
                                 consume_fd=notifier.consume_fd)


# -- chunk content ---------------------------------------------------------------------------


def chunk_hash(index: int) -> bytes:
    """Chunk `index`'s hash: 32 bytes, as the server's chunk hashes are."""
    return hashlib.sha256(b"kvfs-lmcache-mp-%d" % index).digest()


class Content:
    """The bytes of chunk `index` under `seed`."""

    def __init__(self, seed: int, chunk_bytes: int) -> None:
        assert chunk_bytes % BLOCK == 0, "chunks of whole 4 KiB blocks"
        self.seed = seed
        self.pattern = np.random.default_rng(seed).integers(
            0, 2**64, chunk_bytes // 8, dtype=np.uint64, endpoint=False)
        self.blocks = np.arange(chunk_bytes // BLOCK, dtype=np.uint64)

    def write(self, index: int, out: np.ndarray) -> None:
        mix = (self.seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % 2**64
        np.bitwise_xor(self.pattern, np.uint64(mix), out=out)
        blocks = out.reshape(-1, WORDS)
        blocks[:, 0] = MAGIC
        blocks[:, 1] = self.seed
        blocks[:, 2] = index
        blocks[:, 3] = self.blocks


def block_seeds(words: np.ndarray) -> dict[str, int]:
    """What a chunk's 4 KiB blocks are stamped with: {seed: blocks} ("none": not stamped, a
    hole or foreign bytes)."""
    blocks = words.reshape(-1, WORDS)
    stamped = blocks[:, 0] == MAGIC
    seeds, counts = np.unique(blocks[stamped, 1], return_counts=True)
    found = {str(int(seed)): int(count) for seed, count in zip(seeds, counts, strict=True)}
    if not stamped.all():
        found["none"] = int((~stamped).sum())
    return found


class Chunk:
    """What FSL2Adapter uses of a MemoryObj: `byte_array`, the chunk's bytes, writable."""

    def __init__(self, row: np.ndarray) -> None:
        self.byte_array = memoryview(row.view(np.uint8))


# -- one MP server's fs L2 adapter -----------------------------------------------------------


class MpAdapter:
    """FSL2Adapter over `base_path` as the MP server builds it, for chunks `first`, `first + 1`,
    ... of `chunk_bytes` each, one L1 slot per chunk."""

    def __init__(self, base_path: Path, first: int, chunks: int, chunk_bytes: int) -> None:
        lm = load_lmcache()
        parser = lm.config.add_l2_adapters_args(argparse.ArgumentParser())
        spec = json.dumps({"type": "fs", "base_path": str(base_path)})
        (config,) = lm.config.parse_args_to_l2_adapters_config(
            parser.parse_args(["--l2-adapter", spec])).adapters
        self.adapter = lm.factory.create_l2_adapter_from_registry(config)
        self.first = first
        self.indices = range(first, first + chunks)
        kv_rank = lm.api.ObjectKey.ComputeKVRank(1, 0, 1, 0)
        self.keys = [lm.api.ObjectKey(chunk_hash=chunk_hash(index), model_name=MODEL,
                                      kv_rank=kv_rank) for index in self.indices]
        self.slots = np.zeros((chunks, chunk_bytes // 8), dtype=np.uint64)
        self.objects = [Chunk(row) for row in self.slots]

    def file_name(self, index: int) -> str:
        return str(self.adapter._key_to_path(self.keys[index - self.first]).name)

    @staticmethod
    def _wait(fd: int, ready: Any) -> Any:
        """Poll the adapter's event fd until `ready()` answers (as the controllers do)."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + WAIT_S
        while (result := ready()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the adapter did not finish a task")
            if poller.poll(50):
                load_lmcache().consume_fd(fd)
        return result

    def store(self, batch: int) -> dict[int, str]:
        """Submit one store task per `batch` chunks, all at once; per chunk index, what its
        task said: "stored" (its bytes written and renamed), "present" (the file existed,
        nothing written) or "failed" (with batch 1; a failed task of several chunks marks them
        all "failed")."""
        tasks = {}
        for start in range(0, len(self.keys), batch):
            task = self.adapter.submit_store_task(self.keys[start:start + batch],
                                                  self.objects[start:start + batch])
            tasks[task] = range(start, min(start + batch, len(self.keys)))
        done: dict[int, Any] = {}

        def finished() -> dict | None:
            done.update(self.adapter.pop_completed_store_tasks())
            return done if len(done) == len(tasks) else None

        self._wait(self.adapter.get_store_event_fd(), finished)
        chunk_bytes = self.slots[0].nbytes
        outcome = {}
        for task, span in tasks.items():
            result = done[task]
            for offset in span:
                outcome[self.first + offset] = (
                    "failed" if not result.is_successful() else
                    "stored" if result.bytes_transferred() == chunk_bytes * len(span) else
                    "present" if result.bytes_transferred() == 0 else "some")
        return outcome

    def lookup(self) -> list[int]:
        """submit_lookup_and_lock_task for every chunk; the indices found."""
        task = self.adapter.submit_lookup_and_lock_task(self.keys, {})
        bitmap = self._wait(self.adapter.get_lookup_and_lock_event_fd(),
                            lambda: self.adapter.query_lookup_and_lock_result(task))
        return [self.first + i for i in bitmap.get_indices_list()]

    def load(self, indices: list[int]) -> list[int]:
        """submit_load_task of these chunks into their slots; the indices loaded."""
        offsets = [index - self.first for index in indices]
        task = self.adapter.submit_load_task([self.keys[i] for i in offsets],
                                             [self.objects[i] for i in offsets])
        bitmap = self._wait(self.adapter.get_load_event_fd(),
                            lambda: self.adapter.query_load_result(task))
        return [indices[i] for i in bitmap.get_indices_list()]

    def close(self) -> None:
        self.adapter.close()


class Errors(Collected):
    """The warnings LMCache logs, each with its exception (the adapter logs a failed store
    with logger.exception: the errno and paths are in the exception)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.messages.append(message)


def collect_errors() -> Errors:
    """LMCache's loggers do not propagate: hook each one that exists by now."""
    errors = Errors()
    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("lmcache") and isinstance(logger, logging.Logger):
            logger.addHandler(errors)
    return errors


def wait_barrier(directory: Path, parties: int) -> None:
    """Start a round's stores of several processes together, past their slow set-up."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + WAIT_S
    while len(list(directory.glob("ready-*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of {parties} processes reached {directory}")
        time.sleep(0.001)


# -- worker processes ------------------------------------------------------------------------


def check(adapter: MpAdapter, loaded: list[int], seeds: list[int]) -> dict[str, Any]:
    """Which seed's whole chunk each loaded slot holds; those that hold none, and the seeds
    their blocks are stamped with."""
    chunk_bytes = adapter.slots[0].nbytes
    contents = [Content(seed, chunk_bytes) for seed in seeds]
    expected = np.empty_like(adapter.slots[0])
    sources: dict[str, int] = {}
    mixed: dict[str, dict[str, int]] = {}
    for index in loaded:
        got = adapter.slots[index - adapter.first]
        for content in contents:
            content.write(index, expected)
            if np.array_equal(got, expected):
                sources[str(index)] = content.seed
                break
        else:
            mixed[str(index)] = block_seeds(got)
    return {"sources": sources, "mixed": mixed}


def work(args: argparse.Namespace) -> dict[str, Any]:
    chunk_bytes = args.chunk_mib * MIB
    report: dict[str, Any] = {"op": args.op, "first": args.first, "chunks": args.chunks,
                              "chunk_bytes": chunk_bytes, "pid": os.getpid()}
    if args.op == "store":
        report |= {"seed": args.seed, "batch": args.batch, "rounds": []}
        content = Content(args.seed, chunk_bytes)
        for round_ in range(args.rounds):
            first = args.first + round_ * args.chunks
            adapter = MpAdapter(args.dir, first, args.chunks, chunk_bytes)
            try:
                for index in adapter.indices:
                    content.write(index, adapter.slots[index - first])
                if args.barrier:
                    wait_barrier(args.barrier / f"round-{round_}", args.parties)
                outcome, seconds = timed(adapter.store, args.batch or args.chunks)
            finally:
                adapter.close()
            report["rounds"].append({"first": first, "seconds": seconds, "outcome": outcome})
        if args.rounds == 1:
            report |= report.pop("rounds")[0]
        return report
    adapter = MpAdapter(args.dir, args.first, args.chunks, chunk_bytes)
    try:
        found, seconds = timed(adapter.lookup)
        report |= {"hits": len(found), "missing": sorted(set(adapter.indices) - set(found)),
                   "lookup_seconds": seconds}
        if args.op == "load":
            adapter.slots.fill(0xA5A5A5A5A5A5A5A5)  # touched before timing, and never a chunk
            loaded, seconds = timed(adapter.load, found)
            report |= {"seconds": seconds, "loaded": len(loaded),
                       "failed": sorted(set(found) - set(loaded)),
                       **check(adapter, loaded, args.seeds or [args.seed])}
    finally:
        adapter.close()
    return report


def run_worker(op: str, base: Path, chunks: int, *, first: int = 0, chunk_mib: int = 32,
               seed: int = 0, seeds: list[int] | None = None, batch: int = 0, rounds: int = 1,
               barrier: Path | None = None, parties: int = 2) -> dict[str, Any]:
    """Run `op` in a process of its own; its JSON report."""
    argv = [op, "--dir", str(base), "--chunks", str(chunks), "--first", str(first),
            "--chunk-mib", str(chunk_mib), "--seed", str(seed), "--batch", str(batch),
            "--rounds", str(rounds), "--parties", str(parties)]
    if seeds:
        argv += ["--seeds", ",".join(map(str, seeds))]
    if barrier:
        argv += ["--barrier", str(barrier)]
    return run_json(Path(__file__), argv)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=("store", "lookup", "load"),
                        help="store: store tasks of every chunk; lookup: a lookup task; "
                             "load: a lookup, then a load task of the hits, checked")
    parser.add_argument("--dir", type=Path, required=True,
                        help="the fs adapter's base_path")
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first chunk")
    parser.add_argument("--chunk-mib", type=int, default=32,
                        help="MiB per chunk (32: 256 tokens of Llama-3.1-8B, fp16, TP 1)")
    parser.add_argument("--seed", type=int, default=0, help="chunk content (stores, checks)")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                        help="loads: comma-separated seeds a chunk may be (default --seed)")
    parser.add_argument("--batch", type=int, default=0,
                        help="stores: chunks per store task, all submitted at once "
                             "(default: all in one task, one request's chunks)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="stores: rounds of --chunks fresh chunks each (round r starts "
                             "at --first + r * --chunks), each after its own barrier")
    parser.add_argument("--barrier", type=Path,
                        help="directory shared with other processes: each round's stores "
                             "start once --parties processes are ready there")
    parser.add_argument("--parties", type=int, default=2)
    args = parser.parse_args()
    load_lmcache()
    errors = collect_errors()
    report = work(args)
    print(json.dumps({**report, "errors": errors.messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
