"""vLLM 0.34.0's own filesystem KV tier, run unchanged over a directory (a kvfs mount), as one
vLLM instance runs it: the tests and bench.py drive kvfs with vLLM's code, not a model of it.

    python tests/vllm_tier.py store|lookup|load --root DIR --blocks N [--first I]
        [--block-mib 2] [--seed S] [--job-blocks 4] [--buffered]

prints one JSON line: what was done, how long it took, and per block index what missed,
failed or (loads) came back different from what `store` with the same seed wrote. Stores and
loads run in separate processes, like two vLLM instances sharing one directory.

Run unchanged, from `.venv/vllm-tier/` (scripts/setup.sh unpacks them from the wheel):
`vllm/v1/kv_offload/tiering/fs/io.py` (probe_o_direct, batch_store_block, batch_load_block),
`vllm/v1/kv_offload/file_mapper.py` (FileMapper: block key -> file name) and
`vllm/v1/kv_offload/tiering/fs/thread_pool.py` (DualQueueThreadPool, 16 + 16 threads).

Stood in (registered in sys.modules before those load), because importing the real ones
drags in all of vLLM (torch with CUDA, the scheduler, the config system):
- `vllm` itself, an empty package: io.py's `from vllm.fs_io_C import ...` fails, so io.py
  takes its pure-Python path. The wheel's C extension (the same calls: access, open, write,
  close, rename; open, read, close; with the GIL released) links against CUDA torch
  (libtorch_cuda, libnvrtc) and cannot load on machines without them.
- `vllm.logger.init_logger`: logging.getLogger (vLLM's adds formatting only).
- `vllm.v1.kv_offload.base`: OffloadKey and its three helpers, copied (a key is the block
  hash followed by the KV cache group index, 4 bytes big-endian); OffloadingSpec a
  placeholder: only FileMapper.from_offloading_spec uses it, and VllmTier passes the values
  it would derive for Llama-3.1-8B to FileMapper itself.
- `...offloading.canonical_mapping.canonical_format_id`: used only with the canonical
  layout, which is off by default; it raises if called.
- `vllm.v1.kv_offload.tiering.base.JobId`: int, as there.

What manager.py (FileSystemTierManager, which needs vLLM's scheduler types) does around those
files is repeated in VllmTier in a few lines each: write config.json and probe O_DIRECT in the
model's directory, submit one store or load task per job, a lookup is os.path.exists per block
(its path without the C extension), a failed load keeps the blocks loaded before the failure.

Block content is a pure function of (seed, block index): a random pattern of the seed, xored
with a word of (seed, index), and every 4 KiB page starting with (MAGIC, index, page), so any
process can check every byte and tell which block a data file holds.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import mmap
import os
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NewType

import numpy as np
from json_worker import Collected, repeat, run_json, timed

REPO = Path(__file__).resolve().parent.parent
VLLM_DIR = REPO / ".venv" / "vllm-tier"
VLLM_FILES = ("vllm/v1/kv_offload/tiering/fs/io.py", "vllm/v1/kv_offload/file_mapper.py",
              "vllm/v1/kv_offload/tiering/fs/thread_pool.py")
MIB = 1 << 20
# Llama-3.1-8B, bf16: 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes per token.
MODEL = "meta-llama/Llama-3.1-8B"
LAYERS = 32
TOKEN_BYTES = LAYERS * 2 * 8 * 128 * 2
GPU_BLOCK_TOKENS = 16  # vLLM's default block size: a 2 MiB block, one hash per block
THREADS = 16  # FileSystemTierManager's default, per queue
PAGE = 4096
MAGIC = 0x6B7666732D766C6C  # "kvfs-vll"
WORDS = PAGE // 8


# -- stand-ins for the vLLM modules the three files import ----------------------------------

OffloadKey = NewType("OffloadKey", bytes)


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class OffloadingSpec:
    """Placeholder: file_mapper.py names it in an annotation of a method not used here."""


def canonical_format_id(kv_cache_layout: str) -> str:
    raise NotImplementedError("the canonical KV layout is not stood in (off by default)")


def _stand_in(name: str, **attributes: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


@functools.cache
def load_vllm() -> types.SimpleNamespace:
    """vLLM's io, file_mapper and thread_pool modules, loaded from VLLM_DIR."""
    _stand_in("vllm")
    _stand_in("vllm.logger", init_logger=logging.getLogger)
    _stand_in("vllm.v1.kv_offload.base", OffloadKey=OffloadKey, OffloadingSpec=OffloadingSpec,
              make_offload_key=make_offload_key, get_offload_block_hash=get_offload_block_hash,
              get_offload_group_idx=get_offload_group_idx)
    _stand_in("vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping",
              canonical_format_id=canonical_format_id)
    _stand_in("vllm.v1.kv_offload.tiering.base", JobId=int)
    modules = {}
    for relative in VLLM_FILES:
        name = relative.removesuffix(".py").replace("/", ".")
        spec = importlib.util.spec_from_file_location(name, VLLM_DIR / relative)
        assert spec and spec.loader, f"{VLLM_DIR / relative} is missing: run scripts/setup.sh"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules[name.rsplit(".", 1)[1]] = module
    return types.SimpleNamespace(**modules)


# -- block content ---------------------------------------------------------------------------


def offload_key(index: int) -> OffloadKey:
    """Block `index`'s key: a 32-byte hash, as vLLM's sha256 prefix hashes are, group 0."""
    return make_offload_key(hashlib.sha256(b"kvfs-vllm-tier-%d" % index).digest(), 0)


def stamped_index(data: bytes) -> int:
    """The block index a data file holds, from its first page's stamp."""
    magic, index = np.frombuffer(data[:16], dtype=np.uint64)
    assert magic == MAGIC, "not a block written by tests/vllm_tier.py"
    return int(index)


class Content:
    """The bytes of block `index` under `seed`, written into a slot of the primary buffer."""

    def __init__(self, seed: int, block_bytes: int) -> None:
        self.seed = seed
        self.pattern = np.random.default_rng(seed).integers(
            0, 2**64, block_bytes // 8, dtype=np.uint64, endpoint=False)
        self.pages = np.arange(block_bytes // PAGE, dtype=np.uint64)

    def write(self, index: int, out: np.ndarray) -> None:
        mix = (self.seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) % 2**64
        np.bitwise_xor(self.pattern, np.uint64(mix), out=out)
        pages = out.reshape(-1, WORDS)
        pages[:, 0] = MAGIC
        pages[:, 1] = index
        pages[:, 2] = self.pages


# -- vLLM's tier, as FileSystemTierManager runs it -------------------------------------------


class VllmTier:
    """vLLM's fs tier over `root` for Llama-3.1-8B (TP 1, rank 0): blocks `first`, `first + 1`,
    ... of `block_bytes` each (2 MiB: 16 tokens; 32 MiB: 256) in a page-aligned primary buffer,
    one slot per block, moved in jobs of `job_blocks` blocks (one request's blocks per job)."""

    def __init__(self, root: Path, first: int, blocks: int, block_bytes: int = 2 * MIB,
                 seed: int = 0, job_blocks: int = 4, buffered: bool = False) -> None:
        self.vllm = load_vllm()
        assert block_bytes % (TOKEN_BYTES * GPU_BLOCK_TOKENS) == 0, "whole 16-token blocks"
        self.first = first
        self.indices = range(first, first + blocks)
        self.keys = [offload_key(index) for index in self.indices]  # known before lookups
        self.job_blocks = job_blocks
        self.mapper = self.vllm.file_mapper.FileMapper(
            root_dir=str(root), model_name=MODEL, tokens_per_hash=GPU_BLOCK_TOKENS,
            blocks_per_file=block_bytes // (TOKEN_BYTES * GPU_BLOCK_TOKENS),
            tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="bfloat16",
            kv_cache_groups=[{"tokens_per_block": GPU_BLOCK_TOKENS, "layer_names": [
                f"model.layers.{layer}.self_attn.attn" for layer in range(LAYERS)]}],
            parallel_agnostic=True)
        config_path = self.mapper.get_config_file_path()
        os.makedirs(os.path.dirname(config_path), exist_ok=True)
        if not os.path.exists(config_path):
            with open(config_path, "w") as f:
                json.dump(self.mapper.get_run_config(), f, indent=2, sort_keys=True)
        self.probe = self.vllm.io.probe_o_direct(os.path.dirname(config_path))
        self.o_direct = self.probe and not buffered
        self.memory = mmap.mmap(-1, blocks * block_bytes)
        self.view = memoryview(self.memory).cast("B", (blocks, block_bytes))
        self.block_size: int = self.view.strides[0]
        self.slots = np.frombuffer(self.memory, dtype=np.uint64).reshape(blocks, -1)
        self.content = Content(seed, block_bytes)
        self.pool = self.vllm.thread_pool.DualQueueThreadPool(
            THREADS, THREADS, thread_name_prefix="vllm_kv_py_fs")
        self._job_ids = itertools.count()

    def path(self, index: int) -> str:
        return self.mapper.get_file_name(self.keys[index - self.first])

    def slot(self, index: int) -> np.ndarray:
        return self.slots[index - self.first]

    def fill(self) -> None:
        """Every slot holds its block's content (what a store writes)."""
        for index in self.indices:
            self.content.write(index, self.slot(index))

    def store(self, indices: Sequence[int]) -> list[int]:
        """Store these blocks; returns those of the jobs that failed."""
        jobs = self._jobs(indices)
        for job_id, job in jobs.items():
            task = functools.partial(
                self.vllm.io.batch_store_block, [self.path(i) for i in job], self.view,
                [(i - self.first) * self.block_size for i in job], self.block_size,
                self.o_direct)
            self.pool.enqueue_store(job_id, 1, [task])
        return self._finish(jobs, {})

    def lookup(self, indices: Sequence[int]) -> list[bool]:
        return [os.path.exists(self.path(i)) for i in indices]

    def load(self, indices: Sequence[int]) -> list[int]:
        """Load these blocks into their slots; returns those not loaded (in a failed job, the
        failing block and those after it)."""
        jobs = self._jobs(indices)
        loaded_before_failure: dict[int, int] = {}
        for job_id, job in jobs.items():
            task = functools.partial(self._load_job, job_id, job, loaded_before_failure)
            self.pool.enqueue_load(job_id, 1, [task])
        return self._finish(jobs, loaded_before_failure)

    def mismatched(self, indices: Sequence[int]) -> list[int]:
        """The blocks whose slots do not hold exactly their content."""
        expected = np.empty_like(self.slots[0])
        wrong = []
        for index in indices:
            self.content.write(index, expected)
            if not np.array_equal(self.slot(index), expected):
                wrong.append(index)
        return wrong

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    def _jobs(self, indices: Sequence[int]) -> dict[int, Sequence[int]]:
        return {next(self._job_ids): indices[start:start + self.job_blocks]
                for start in range(0, len(indices), self.job_blocks)}

    def _load_job(self, job_id: int, job: Sequence[int],
                  loaded_before_failure: dict[int, int]) -> None:
        try:
            self.vllm.io.batch_load_block(
                [self.path(i) for i in job], self.view,
                [(i - self.first) * self.block_size for i in job], self.block_size,
                self.o_direct)
        except OSError as exc:
            loaded_before_failure[job_id] = getattr(exc, "num_succeeded", 0)
            raise

    def _finish(self, jobs: dict[int, Sequence[int]],
                loaded_before_failure: dict[int, int]) -> list[int]:
        """Wait until the pool is idle; the blocks the failed jobs did not move."""
        self.pool.wait_idle()
        failed = []
        for job_id, success, _ in self.pool.get_finished():
            if not success:
                failed += jobs[job_id][loaded_before_failure.get(job_id, 0):]
        return sorted(failed)


# -- worker processes ------------------------------------------------------------------------


def work(args: argparse.Namespace, collected: Collected) -> dict[str, Any]:
    tier = VllmTier(args.root, args.first, args.blocks, args.block_mib * MIB, args.seed,
                    args.job_blocks, args.buffered)
    indices = list(tier.indices)
    report: dict[str, Any] = {"op": args.op, "first": args.first, "blocks": args.blocks,
                              "block_bytes": tier.block_size, "probe": tier.probe,
                              "o_direct": tier.o_direct}
    if args.seconds:
        tier.fill()
        report["passes"] = passes(tier, args.op, indices, args.seconds, collected)
    elif args.op == "store":
        tier.fill()
        failed, seconds = timed(tier.store, indices)
        report |= {"seconds": seconds, "failed": failed}
    else:
        hits, seconds = timed(tier.lookup, indices)
        found = [i for i, hit in zip(indices, hits, strict=True) if hit]
        report |= {"hits": len(found), "missing": sorted(set(indices) - set(found)),
                   "lookup_seconds": seconds}
        if args.op == "load":
            tier.slots.fill(0xA5A5A5A5A5A5A5A5)  # touched before timing, and never a block
            failed, seconds = timed(tier.load, found)
            loaded = sorted(set(found) - set(failed))
            report |= {"seconds": seconds, "loaded": len(loaded), "failed": failed,
                       "mismatched": tier.mismatched(loaded)}
    tier.shutdown()
    return report


def passes(tier: VllmTier, op: str, indices: list[int], seconds: float,
           collected: Collected) -> list[dict[str, Any]]:
    """`op` of `indices` again and again for `seconds` (json_worker.repeat): per pass, the
    blocks that failed and, for loads, the hits and the blocks loaded wrong. A store pass
    removes the blocks' files first, so that each pass writes them."""
    def store() -> dict[str, Any]:
        try:  # removed first, as an evictor does (vLLM skips a block whose file exists)
            for index in indices:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tier.path(index))
        except OSError as error:
            return {"failed": len(indices), "error": str(error)}
        return {"failed": len(tier.store(indices))}

    def load() -> dict[str, Any]:
        found = [i for i, hit in zip(indices, tier.lookup(indices), strict=True) if hit]
        failed = tier.load(found)
        return {"hits": len(found), "failed": len(failed),
                "mismatched": len(tier.mismatched(sorted(set(found) - set(failed))))}

    return repeat(store if op == "store" else load, seconds, collected)


def run_worker(op: str, root: Path, blocks: int, *, first: int = 0, block_mib: int = 2,
               seed: int = 0, job_blocks: int = 4, buffered: bool = False,
               seconds: float = 0) -> dict[str, Any]:
    """Run `op` in a process of its own; its JSON report."""
    return run_json(Path(__file__), [
        op, "--root", str(root), "--blocks", str(blocks), "--first", str(first),
        "--block-mib", str(block_mib), "--seed", str(seed), "--job-blocks", str(job_blocks),
        "--seconds", str(seconds), *(["--buffered"] if buffered else [])])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=("store", "lookup", "load"),
                        help="store: write the blocks; lookup: os.path.exists each; "
                             "load: lookup, then load and check the hits")
    parser.add_argument("--root", type=Path, required=True, help="the tier's root_dir")
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first block")
    parser.add_argument("--block-mib", type=int, default=2,
                        help="MiB per block: 2 (16 tokens of Llama-3.1-8B) or a multiple")
    parser.add_argument("--seed", type=int, default=0, help="block content (stores and checks)")
    parser.add_argument("--job-blocks", type=int, default=4, help="blocks per job (request)")
    parser.add_argument("--buffered", action="store_true",
                        help="no O_DIRECT even where vLLM's probe finds it works")
    parser.add_argument("--seconds", type=float, default=0,
                        help="store or load again and again for this long, and report "
                             "each pass")
    args = parser.parse_args()
    collected = Collected()
    logging.getLogger().addHandler(collected)
    report = work(args, collected)
    print(json.dumps({**report, "errors": collected.messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
