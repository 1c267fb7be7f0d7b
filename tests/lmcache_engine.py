"""Run one real LMCache 0.5.6 engine in this process and store/look up/retrieve a prompt.

Usage (one JSON line on stdout, LMCache's logging on stderr):

    PYTHONHASHSEED=0 python tests/lmcache_engine.py store lookup retrieve \\
        --backend fs --dir /mnt/kvfs/lmcache --preset llama-3.1-8b --chunks 4

Every instance that is to share must run with the same PYTHONHASHSEED, model string, world
size, dtype and chunk size. Under vLLM the chunk-hash chain starts from a seed that vLLM
derives from PYTHONHASHSEED (random when unset), and LMCache takes it from vLLM whenever vLLM
is importable; without vLLM the keys happen not to depend on it. If PYTHONHASHSEED is unset
this script re-executes itself with PYTHONHASHSEED=0, so instances started through it agree.

The engine keeps no CPU copy of chunks (``local_cpu: false``), so every lookup and retrieve,
also of chunks stored by the same process, goes to the storage directory.

The prompt (token ids) is a pure function of ``--prompt-seed`` and the KV bytes of chunk ``i``
a pure function of ``(--kv-seed, i)``, so another process can check exactly what it retrieved.
The engine uses LMCache's own ``MockGPUConnector`` with the copy steps filled in: "GPU"
memory is a CPU tensor, ``from_gpu`` copies the seeded bytes into LMCache's buffers and
``to_gpu`` copies retrieved buffers into a paged-KV stand-in that is verified afterwards.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Must be set before lmcache is imported: it otherwise posts usage telemetry.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402
import xxhash  # noqa: E402


@dataclass(frozen=True)
class KVShape:
    """Shape of one model's KV cache as LMCache sees it (per TP worker)."""

    model: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk_tokens: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk_tokens


PRESETS: dict[str, KVShape] = {
    # 32 layers x K,V x 8 KV heads x 128 x fp16 x 256 tokens = 32 MiB per chunk.
    "llama-3.1-8b": KVShape("meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128, torch.float16, 256),
    # 4 layers x K,V x 4 heads x 64 x fp16 x 256 tokens = 1 MiB per chunk, for fast tests.
    "small": KVShape("kvfs/small-test-model", 4, 4, 64, torch.float16, 256),
}


def prompt_tokens(n_tokens: int, prompt_seed: int) -> torch.Tensor:
    """The deterministic token ids of the test prompt."""
    gen = torch.Generator().manual_seed(prompt_seed)
    return torch.randint(0, 128_000, (n_tokens,), dtype=torch.long, generator=gen)


def chunk_bytes(kv_seed: int, index: int, nbytes: int) -> torch.Tensor:
    """The deterministic KV bytes (flat uint8) of chunk `index` written with `kv_seed`."""
    gen = torch.Generator().manual_seed(kv_seed * 1_000_003 + index)
    words = torch.empty(nbytes // 8, dtype=torch.int64).random_(generator=gen)
    return words.view(torch.uint8)


def _mock_connector_class() -> type:
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class SeededConnector(MockGPUConnector):
        """MockGPUConnector whose copies are real: seeded bytes in, paged buffer out."""

        def __init__(self, shape: KVShape, n_tokens: int, kv_seed: int) -> None:
            super().__init__((shape.layers, 2, shape.chunk_tokens, shape.kv_heads,
                              shape.head_dim))
            self.shape = shape
            self.kv_seed = kv_seed
            self.paged = torch.empty(n_tokens * shape.bytes_per_token, dtype=torch.uint8)

        def _span(self, start: int, end: int) -> slice:
            per_token = self.shape.bytes_per_token
            return slice(start * per_token, end * per_token)

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            flat = memory_obj.tensor.view(torch.uint8).view(-1)
            nbytes = (end - start) * self.shape.bytes_per_token
            flat[:nbytes].copy_(chunk_bytes(self.kv_seed, start // self.shape.chunk_tokens,
                                            self.shape.chunk_bytes)[:nbytes])

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            span = self._span(start, end)
            flat = memory_obj.tensor.view(torch.uint8).view(-1)
            self.paged[span].copy_(flat[: span.stop - span.start])

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                             **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(obj, start, end)

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any,
                           **kwargs: Any) -> None:
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(obj, start, end)

    return SeededConnector


class _ErrorCounter(logging.Handler):
    """Collects LMCache log records at ERROR and above."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _attach_error_counter() -> _ErrorCounter:
    """LMCache loggers do not propagate, so hook each one that exists by now."""
    counter = _ErrorCounter()
    for name, obj in logging.Logger.manager.loggerDict.items():
        if name.startswith("lmcache") and isinstance(obj, logging.Logger):
            obj.addHandler(counter)
    return counter


def build_config(args: argparse.Namespace, shape: KVShape, n_tokens: int) -> Any:
    """An LMCacheEngineConfig for the fs plugin or local_disk on `args.dir`."""
    from lmcache.v1.config import LMCacheEngineConfig

    total_gib = n_tokens * shape.bytes_per_token / 1024**3
    common: dict[str, Any] = dict(
        chunk_size=shape.chunk_tokens,
        local_cpu=False,
        max_local_cpu_size=round(total_gib * 1.25 + 0.25, 3),
        save_unfull_chunk=False,
    )
    if args.backend == "fs":
        return LMCacheEngineConfig.from_defaults(
            **common,
            remote_serde="naive",
            remote_storage_plugins=["fs"],
            extra_config={
                "remote_storage_plugin.fs.base_path": str(args.dir),
                "save_chunk_meta": False,
            },
        )
    return LMCacheEngineConfig.from_defaults(
        **common,
        local_disk=str(args.dir).rstrip("/") + "/",
        max_local_disk_size=round(total_gib * 1.25 + 0.25, 3),
        extra_config={"use_odirect": args.odirect},
    )


def wait_stored(engine: Any, keys: list[Any], timeout: float) -> bool:
    """Block until no backend has a pending put for any of `keys`."""
    backends = list(engine.storage_manager.storage_backends.values())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(b.exists_in_put_tasks(k) for b in backends for k in keys):
            return True
        time.sleep(0.01)
    return False


def wait_barrier(directory: Path, parties: int, timeout: float) -> None:
    """Start the ops of several engines together, once all have finished their slow set-up."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"ready-{os.getpid()}").touch()
    deadline = time.monotonic() + timeout
    while len(list(directory.glob("ready-*"))) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of {parties} engines reached {directory}")
        time.sleep(0.005)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Create the engine, perform `args.ops` in order, return the JSON-able result."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.metadata import LMCacheMetadata

    shape = PRESETS[args.preset]
    n_tokens = args.chunks * shape.chunk_tokens
    tokens = prompt_tokens(n_tokens, args.prompt_seed)
    metadata = LMCacheMetadata(
        model_name=shape.model, world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=shape.dtype,
        kv_shape=(shape.layers, 2, shape.chunk_tokens, shape.kv_heads, shape.head_dim),
        chunk_size=shape.chunk_tokens,
    )
    connector = _mock_connector_class()(shape, n_tokens, args.kv_seed)
    config = build_config(args, shape, n_tokens)
    engine = LMCacheEngineBuilder.get_or_create(
        args.instance, config, metadata, connector,
        lambda tensor, src: None, lambda obj, src: obj,
    )
    engine.post_init()
    errors = _attach_error_counter()
    out: dict[str, Any] = {
        "pid": os.getpid(), "backend": args.backend, "dir": str(args.dir),
        "preset": args.preset, "chunk_bytes": shape.chunk_bytes, "tokens": n_tokens,
        "kv_seed": args.kv_seed,
    }
    slot_mapping = torch.arange(n_tokens, dtype=torch.long)
    first_lookup: float | None = None
    try:
        if args.barrier:
            wait_barrier(args.barrier, args.parties, args.timeout)
        for op in args.ops:
            if op == "store":
                keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
                t0 = time.perf_counter()
                engine.store(tokens, slot_mapping=slot_mapping)
                flushed = wait_stored(engine, keys, args.timeout)
                seconds = time.perf_counter() - t0
                out["store"] = {"chunks": len(keys), "bytes": len(keys) * shape.chunk_bytes,
                                "seconds": round(seconds, 4), "flushed": flushed}
            elif op == "lookup":
                t0 = time.perf_counter()
                first_lookup = t0 if first_lookup is None else first_lookup
                hit = engine.lookup(tokens)
                out["lookup"] = {"tokens_hit": hit,
                                 "seconds": round(time.perf_counter() - t0, 4)}
            elif op == "retrieve":
                out["retrieve"] = retrieved = retrieve(engine, connector, tokens, slot_mapping,
                                                       shape, args)
                if first_lookup is not None:  # what the prompt waited for: lookup to last byte
                    waited = retrieved.pop("ended_at") - first_lookup
                    out["prompt"] = {
                        "seconds": round(waited, 4),
                        "gbps": round(retrieved["bytes_loaded"] / waited / 1e9, 3)}
            else:
                raise ValueError(f"unknown op {op!r}")
    finally:
        LMCacheEngineBuilder.destroy(args.instance)
    out["errors"] = errors.messages
    return out


def retrieve(engine: Any, connector: Any, tokens: torch.Tensor, slot_mapping: torch.Tensor,
             shape: KVShape, args: argparse.Namespace) -> dict[str, Any]:
    """Retrieve every token, then check each chunk's bytes against the candidate seeds."""
    connector.paged.zero_()
    t0 = time.perf_counter()
    mask = engine.retrieve(tokens, slot_mapping=slot_mapping)
    ended_at = time.perf_counter()
    seconds = ended_at - t0
    hit = int(mask.sum())
    # A retrieved prefix is what LMCache hands on; count only whole leading chunks.
    n_chunks = hit // shape.chunk_tokens
    seeds = args.verify_seeds or [args.kv_seed]
    digest = xxhash.xxh3_128()
    sources: list[int | None] = []
    for index in range(n_chunks):
        got = connector.paged[index * shape.chunk_bytes:(index + 1) * shape.chunk_bytes]
        digest.update(got.numpy())
        match = next((s for s in seeds
                      if torch.equal(got, chunk_bytes(s, index, shape.chunk_bytes))), None)
        sources.append(match)
    loaded = hit * shape.bytes_per_token
    return {
        "tokens_hit": hit,
        "bytes_loaded": loaded,
        "seconds": round(seconds, 4),
        "gbps": round(loaded / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "digest": digest.hexdigest(),
        "chunk_seeds": sources,
        "exact": hit == len(tokens) and all(s is not None for s in sources),
        "ended_at": ended_at,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests/lmcache_engine.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="+", choices=["store", "lookup", "retrieve"],
                        help="operations to run in order")
    parser.add_argument("--backend", choices=["fs", "local_disk"], default="fs")
    parser.add_argument("--dir", type=Path, required=True,
                        help="fs base_path or local_disk directory")
    parser.add_argument("--odirect", action="store_true", help="local_disk use_odirect: true")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--chunks", type=int, default=4, help="prompt length in chunks")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the token ids")
    parser.add_argument("--kv-seed", type=int, default=1, help="seed of the stored KV bytes")
    parser.add_argument("--verify-seeds", type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated seeds a retrieved chunk may match "
                             "(default: --kv-seed)")
    parser.add_argument("--barrier", type=Path,
                        help="directory shared with other engines: wait until --parties "
                             "engines are ready there before the first op")
    parser.add_argument("--parties", type=int, default=2, help="engines meeting at --barrier")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for stores to reach the backend")
    parser.add_argument("--instance", default="kvfs-engine", help="LMCache instance id")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if "PYTHONHASHSEED" not in os.environ:
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    args = parse_args(argv)
    # Anything LMCache prints goes to stderr; only our JSON line reaches the real stdout.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    result = run(args)
    json_out.write(json.dumps(result) + "\n")
    json_out.flush()
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
