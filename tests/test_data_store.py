"""The data store's streamed checksums agree with the content, whatever the write pattern."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import xxhash

from kvfs.data.staged import StagedFile
from kvfs.data.store import BLOCK_SIZE, DataStore

SIZES = [1, 4096, 100_000, BLOCK_SIZE, BLOCK_SIZE + 7, 3 * BLOCK_SIZE // 2]


def block_sums(content: bytes) -> list[int]:
    return [xxhash.xxh3_64_intdigest(content[i:i + BLOCK_SIZE])
            for i in range(0, len(content), BLOCK_SIZE)]


@pytest.mark.parametrize("seed", range(8))
def test_streamed_sums_match_content(tmp_path: Path, seed: int) -> None:
    """Sequential, overlapping, unaligned and truncating writes: the sums at commit are exactly
    those of the final bytes (streaming must never keep a stale block sum)."""
    store = DataStore(tmp_path)
    rng = random.Random(seed)
    for trial in range(40):
        staged = StagedFile(store, trial + 1, None, None)
        content = bytearray()
        position = 0
        for _ in range(rng.randint(1, 12)):
            choice = rng.random()
            if choice < 0.1:
                size = rng.randint(0, 5 * BLOCK_SIZE)
                staged.truncate(size)
                content = content[:size] + bytearray(max(0, size - len(content)))
                position = size
                continue
            offset = (position if choice < 0.6 else
                      rng.randint(0, len(content) + 100) if choice < 0.8 else
                      rng.randint(0, 4) * BLOCK_SIZE)
            data = os.urandom(rng.choice(SIZES))
            staged.write(offset, data)
            content.extend(bytes(max(0, offset - len(content))))
            content[offset:offset + len(data)] = data
            position = offset + len(data)
        blob = staged.finish(ino=trial)
        staged.close()
        assert blob.size == len(content)
        assert list(blob.sums) == block_sums(bytes(content))
        assert (tmp_path / "staging" / f"{trial + 1:016x}").read_bytes() == content
