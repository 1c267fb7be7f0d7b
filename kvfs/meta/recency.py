"""Use and room, what eviction (kvfs/pool/space.py) reads: the recency index (files by last use),
pins, the usage counters, the capacity and per-model usage."""

from __future__ import annotations

from kvfs.engines.interface import CLAIM_PREFIX, Txn, claims_total
from kvfs.meta.core import MetaCore
from kvfs.meta.schema import TOUCH_BATCH, Inode, Usage, from_u64, u64


class Recency:
    """Files by last use, pins, and the counters of the space they take."""

    def __init__(self, core: MetaCore) -> None:
        self.core = core
        self.engine = core.engine

    def record_uses(self, uses: dict[int, int]) -> None:
        """Record the last use (ns) of files, TOUCH_BATCH per transaction (each reads its
        inodes at once); gone inodes are skipped."""
        pending = list(uses.items())
        for first in range(0, len(pending), TOUCH_BATCH):
            batch = pending[first:first + TOUCH_BATCH]

            def change(txn: Txn, batch: list[tuple[int, int]] = batch) -> None:
                raws = txn.get_many("inode", [u64(ino) for ino, _ in batch])
                for (ino, used_ns), raw in zip(batch, raws, strict=True):
                    if raw is None:
                        continue
                    inode = Inode.unpack(ino, raw)
                    if used_ns > inode.atime_ns:
                        self.core.put(txn, inode._replace(atime_ns=used_ns))
                        self.core.index_use(txn, inode, inode.atime_ns, used_ns)
            self.core.change(change)

    def least_recent(self, limit: int, after: bytes = b"") -> list[tuple[bytes, Inode]]:
        """Up to `limit` files, least recently used first, each with its position; pass the
        last position as `after` to continue."""
        found = []
        with self.engine.snapshot() as txn:
            for key, _ in txn.scan("recency", after + b"\0" if after else b""):
                raw = txn.get("inode", key[8:])
                if raw is not None:
                    found.append((bytes(key), Inode.unpack(from_u64(key[8:]), raw)))
                if len(found) >= limit:
                    break
        return found

    def pinned(self) -> set[int]:
        with self.engine.snapshot() as txn:
            return {from_u64(key) for key, _ in txn.scan("pins")}

    def usage(self) -> Usage:
        with self.engine.snapshot() as txn:
            counters = txn.counts("counters")  # (one read of them all: one round trip)
            return Usage(self._capacity(txn), counters.get(b"used_bytes", 0),
                         counters.get(b"files", 0), claims_total(counters),
                         counters.get(CLAIM_PREFIX + self.core.session, 0))

    def _capacity(self, txn: Txn) -> int:
        raw = txn.get("settings", b"capacity")
        return from_u64(raw) if raw else 0

    def capacity(self) -> int:
        with self.engine.snapshot() as txn:
            return self._capacity(txn)

    def set_capacity(self, capacity: int) -> None:
        def change(txn: Txn) -> None:
            txn.put("settings", b"capacity", u64(capacity))
        self.core.change(change)

    def models(self) -> dict[str, dict[str, int]]:
        """Per-model usage (models that have files or bytes)."""
        with self.engine.snapshot() as txn:
            counts = txn.counts("models")
        usage: dict[str, dict[str, int]] = {}
        for key, value in counts.items():
            model, _, kind = key.rpartition(b"\0")
            usage.setdefault(model.decode(), {"files": 0, "bytes": 0})[kind.decode()] = value
        return {model: used for model, used in usage.items() if used["files"] or used["bytes"]}
