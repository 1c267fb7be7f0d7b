"""Real LMCache 0.5.6 engines, each in its own process (`tests/lmcache_engine.py`):
starting them, reading their results, and checking what they loaded.

The KV bytes of each chunk are a pure function of a seed, so a reader proves it got exactly a
writer's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).resolve().parent / "lmcache_engine.py"
CHUNK_TOKENS = 256
ENGINE_ENV = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
              "LMCACHE_LOG_LEVEL": "WARNING"}
# LMCache's fs connector writes every key through one shared `<name>.tmp`: when two engines
# store the same chunk at once, the one that renames second finds no `.tmp` (ENOENT, as on any
# filesystem) and logs its put as failed. Harmless: the chunk is whole, one engine's bytes.


class Engines:
    """Starts engine processes and kills, by pid, any still running at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *ops: str, **options: Any) -> subprocess.Popen[str]:
        argv = [sys.executable, str(ENGINE), *ops]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is not False:
                argv += [flag, str(value)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENGINE_ENV)
        self.procs.append(proc)
        return proc

    @staticmethod
    def result(proc: subprocess.Popen[str], timeout: float = 300) -> dict[str, Any]:
        stdout, stderr = proc.communicate(timeout=timeout)
        lines = stdout.strip().splitlines()
        assert lines, f"engine {proc.pid} exited {proc.returncode} without a result:\n" \
                      f"{stderr[-3000:]}"
        return json.loads(lines[-1])

    def run(self, *ops: str, **options: Any) -> dict[str, Any]:
        return self.result(self.start(*ops, **options))

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def assert_exact(result: dict[str, Any], chunks: int, seeds: set[int]) -> None:
    """The engine found and loaded every token, each chunk byte-equal to one of `seeds`."""
    assert result["errors"] == []
    assert result["lookup"]["tokens_hit"] == chunks * CHUNK_TOKENS
    loaded = result["retrieve"]
    assert loaded["tokens_hit"] == chunks * CHUNK_TOKENS
    assert loaded["bytes_loaded"] == chunks * result["chunk_bytes"]
    assert set(loaded["chunk_seeds"]) <= seeds, loaded["chunk_seeds"]
    assert loaded["exact"]
