"""SGLang 0.5.23's HiCache `file` storage backend (HiCacheFile), run unchanged over a
directory (a kvfs mount), as one SGLang rank runs it: the tests drive kvfs with SGLang's code,
not a model of it.

    python tests/sglang_hicache.py store|lookup|load --root DIR --pages N [--first I]
        [--page-mib 8] [--seed S] [--tp-rank R] [--tp-size T]

prints one JSON line: what was done, how long it took, and per page index what missed, failed
or (loads) came back different from what `store` with the same seed and rank wrote. Stores and
loads run in separate processes, like two SGLang instances sharing one directory.

Run unchanged, from `.venv/sglang-hicache/` (scripts/setup.sh unpacks them from the wheel):
`sglang/srt/mem_cache/hicache_storage.py` (HiCacheStorageConfig; HiCacheFile's set, exists and
get), `sglang/srt/mem_cache/storage/file/lru_file_evictor.py` (LRUFileEvictor, which
HiCacheFile builds; inert without a size cap, SGLang's default) and `sglang/srt/environ.py`
(the SGLANG_* settings; standard library only).

Stood in (registered in sys.modules before those load), because the real ones import all of
SGLang's GPU runtime:
- `sglang` itself: a package whose path is `.venv/sglang-hicache/sglang`, without the wheel's
  `__init__.py` (which imports the language API and the transformers patches, and through them
  torch with CUDA kernels). `sglang.srt`, `...mem_cache`, `...storage` and `...storage.file` are
  then namespace packages of the unpacked files, so the storage package's `__init__.py` (the
  backend factory, which imports every storage backend) does not run either.
- `sglang.srt.utils.common.human_readable_int`: the evictor parses its size cap with it, only
  when one is set (SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE; unset here: kvfs's capacity bounds the
  pool); it raises if called. The real module imports torch.distributed, triton, zmq and more.

What SGLang's HiCacheController does around HiCacheFile is repeated in a few lines: the
directory comes from SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (how an operator points SGLang at
a mount); one file per page, keyed by a 64-hex sha256 page hash; a store is `set` per page
(a stat, numpy's tofile into `.<uuid4 hex>.tmp`, a rename); a lookup is `exists` per page (one
stat); a load is `get` per page found, into a page-sized CPU tensor (open, one readinto). An
exception out of `get` (EIO, a short read) is what the controller catches per batch of pages,
counting the batch a miss: here that page is `failed`.

A page is `--page-mib` MiB of one rank (8 MiB: 64 tokens of Llama-3.1-8B in bf16, TP 1), in
SGLang's page-first layout (one contiguous page). Its content is a pure function of (seed, tp
rank, page index): a random pattern of the seed, xored with a word of (seed, rank, index), and
every 4 KiB starting with (MAGIC, index, rank, offset / 4 KiB), so any process can check every
byte and tell which page a data file holds.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from json_worker import Collected, repeat, run_json, timed

REPO = Path(__file__).resolve().parent.parent
SGLANG_DIR = REPO / ".venv" / "sglang-hicache"
MIB = 1 << 20
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DTYPE = torch.bfloat16
BLOCK = 4096
MAGIC = 0x6B7666732D73676C  # "kvfs-sgl"
WORDS = BLOCK // 8


# -- stand-ins for the modules SGLang's three files import -----------------------------------


def human_readable_int(value: str) -> int:
    raise NotImplementedError("HiCacheFile's size cap is not stood in (off by default)")


def _stand_in(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


@functools.cache
def load_sglang() -> types.ModuleType:
    """SGLang's hicache_storage module, loaded from SGLANG_DIR."""
    source = SGLANG_DIR / "sglang/srt/mem_cache/hicache_storage.py"
    assert source.is_file(), f"{source} is missing: run scripts/setup.sh"
    _stand_in("sglang", __path__=[str(SGLANG_DIR / "sglang")])
    _stand_in("sglang.srt.utils.common", human_readable_int=human_readable_int)
    from sglang.srt.mem_cache import hicache_storage  # type: ignore[import-not-found]

    return hicache_storage


# -- page content ----------------------------------------------------------------------------


def page_key(index: int) -> str:
    """Page `index`'s key: a sha256 hex digest, as SGLang's page hashes are."""
    return hashlib.sha256(b"kvfs-sglang-hicache-%d" % index).hexdigest()


def stamped_page(data: bytes) -> tuple[int, int]:
    """(page index, tp rank) of the page a data file holds, from its first block's stamp."""
    magic, index, rank = np.frombuffer(data[:24], dtype=np.uint64)
    assert magic == MAGIC, "not a page written by tests/sglang_hicache.py"
    return int(index), int(rank)


class Content:
    """The bytes of page `index` of rank `rank` under `seed`."""

    def __init__(self, seed: int, rank: int, page_bytes: int) -> None:
        assert page_bytes % BLOCK == 0, "pages of whole 4 KiB blocks"
        self.seed = seed
        self.rank = rank
        self.pattern = np.random.default_rng(seed).integers(
            0, 2**64, page_bytes // 8, dtype=np.uint64, endpoint=False)
        self.blocks = np.arange(page_bytes // BLOCK, dtype=np.uint64)

    def write(self, index: int, out: np.ndarray) -> None:
        mix = (self.seed * 0x9E3779B97F4A7C15 + self.rank * 0x94D049BB133111EB
               + index * 0xBF58476D1CE4E5B9 + 1) % 2**64
        np.bitwise_xor(self.pattern, np.uint64(mix), out=out)
        blocks = out.reshape(-1, WORDS)
        blocks[:, 0] = MAGIC
        blocks[:, 1] = index
        blocks[:, 2] = self.rank
        blocks[:, 3] = self.blocks


# -- one SGLang rank's HiCacheFile -----------------------------------------------------------


class HiCacheRank:
    """HiCacheFile over `root` for MODEL as rank `tp_rank` of `tp_size`: pages `first`,
    `first + 1`, ... of `page_bytes` each, one slot per page in a CPU host buffer."""

    def __init__(self, root: Path, first: int, pages: int, page_bytes: int, seed: int = 0,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        storage = load_sglang()
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(root)
        if tp_rank:  # SGLang's rank 0 makes the directory (HiCacheFile does, for rank 0)
            root.mkdir(parents=True, exist_ok=True)
        self.backend = storage.HiCacheFile(storage.HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
            attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
            is_page_first_layout=True, model_name=MODEL))
        self.first = first
        self.indices = range(first, first + pages)
        self.keys = [page_key(index) for index in self.indices]
        self.host = np.zeros((pages, page_bytes), dtype=np.uint8)
        self.slots = self.host.view(np.uint64)
        self.pages = torch.from_numpy(self.host).view(DTYPE)  # rows: flat data pages
        self.content = Content(seed, tp_rank, page_bytes)

    def fill(self) -> None:
        """Every slot holds its page's content (what a store writes)."""
        for index in self.indices:
            self.content.write(index, self.slots[index - self.first])

    def store(self) -> list[int]:
        """HiCacheFile.set for every page; the pages it refused or failed."""
        return [index for index, key in zip(self.indices, self.keys, strict=True)
                if not self.backend.set(key, self.pages[index - self.first])]

    def lookup(self) -> list[int]:
        """HiCacheFile.exists for every page; the pages found."""
        return [index for index, key in zip(self.indices, self.keys, strict=True)
                if self.backend.exists(key)]

    def load(self, indices: list[int], errors: list[str]) -> tuple[list[int], list[int]]:
        """HiCacheFile.get of these pages into their slots: (vanished, failed), the pages it
        found no file for and those whose get raised (the message added to `errors`)."""
        vanished: list[int] = []
        failed: list[int] = []
        for index in indices:
            try:
                got = self.backend.get(self.keys[index - self.first],
                                       self.pages[index - self.first])
            except Exception as exc:  # the controller's catch: the page is not loaded
                failed.append(index)
                errors.append(f"page {index}: {type(exc).__name__}: {exc}")
                continue
            if got is None:
                vanished.append(index)
        return vanished, failed

    def mismatched(self, indices: list[int]) -> list[int]:
        """The pages whose slots do not hold exactly their content."""
        expected = np.empty_like(self.slots[0])
        wrong = []
        for index in indices:
            self.content.write(index, expected)
            if not np.array_equal(self.slots[index - self.first], expected):
                wrong.append(index)
        return wrong


# -- worker processes ------------------------------------------------------------------------


def work(args: argparse.Namespace, errors: list[str], collected: Collected) -> dict[str, Any]:
    rank = HiCacheRank(args.root, args.first, args.pages, args.page_mib * MIB, args.seed,
                       args.tp_rank, args.tp_size)
    indices = list(rank.indices)
    report: dict[str, Any] = {"op": args.op, "first": args.first, "pages": args.pages,
                              "page_bytes": args.page_mib * MIB, "seed": args.seed,
                              "tp_rank": args.tp_rank, "tp_size": args.tp_size}
    if args.op == "store":
        rank.fill()
        failed, seconds = timed(rank.store)
        return report | {"seconds": seconds, "failed": failed}
    if args.seconds:  # loads again and again (json_worker.repeat)
        def load() -> dict[str, Any]:
            found = rank.lookup()
            vanished, failed = rank.load(found, errors)
            loaded = sorted(set(found) - set(vanished) - set(failed))
            return {"hits": len(found) - len(vanished), "failed": len(failed),
                    "mismatched": len(rank.mismatched(loaded))}
        return report | {"passes": repeat(load, args.seconds, collected)}
    found, seconds = timed(rank.lookup)
    report |= {"hits": len(found), "missing": sorted(set(indices) - set(found)),
               "lookup_seconds": seconds}
    if args.op == "load":
        rank.slots.fill(0xA5A5A5A5A5A5A5A5)  # touched before timing, and never a page
        (vanished, failed), seconds = timed(rank.load, found, errors)
        loaded = sorted(set(found) - set(vanished) - set(failed))
        report |= {"seconds": seconds, "loaded": len(loaded), "vanished": vanished,
                   "failed": failed, "mismatched": rank.mismatched(loaded)}
    return report


def run_worker(op: str, root: Path, pages: int, *, first: int = 0, page_mib: int = 8,
               seed: int = 0, tp_rank: int = 0, tp_size: int = 1,
               seconds: float = 0) -> dict[str, Any]:
    """Run `op` in a process of its own; its JSON report."""
    return run_json(Path(__file__), [
        op, "--root", str(root), "--pages", str(pages), "--first", str(first),
        "--page-mib", str(page_mib), "--seed", str(seed), "--tp-rank", str(tp_rank),
        "--tp-size", str(tp_size), "--seconds", str(seconds)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=("store", "lookup", "load"),
                        help="store: set each page; lookup: exists each; "
                             "load: lookup, then get and check the hits")
    parser.add_argument("--root", type=Path, required=True,
                        help="the storage directory (SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR)")
    parser.add_argument("--pages", type=int, required=True)
    parser.add_argument("--first", type=int, default=0, help="index of the first page")
    parser.add_argument("--page-mib", type=int, default=8,
                        help="MiB per page and rank (8: 64 tokens of Llama-3.1-8B at TP 1)")
    parser.add_argument("--seed", type=int, default=0, help="page content (stores and checks)")
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=0,
                        help="load: look up and load again and again for this long, and "
                             "report each pass")
    args = parser.parse_args()
    if not 0 <= args.tp_rank < args.tp_size:
        parser.error("--tp-rank must be below --tp-size")
    collected = Collected()
    logging.getLogger().addHandler(collected)
    errors: list[str] = []
    report = work(args, errors, collected)
    print(json.dumps({**report, "errors": errors + collected.messages}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
