"""What the client drivers (tests/vllm_tier.py, tests/sglang_hicache.py) share: each runs in a
process of its own (`run_json`) and prints one JSON line, its report, with what the client's
own code logged (`Collected`) and how long its calls took (`timed`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_json(script: Path, argv: list[str], timeout: float = 600) -> dict[str, Any]:
    """`script` with `argv` under this interpreter; its last line of output, as JSON."""
    result = subprocess.run([sys.executable, str(script), *argv], capture_output=True,
                            text=True, timeout=timeout)
    lines = result.stdout.strip().splitlines()
    if result.returncode or not lines:
        raise RuntimeError(f"{script.name} {' '.join(argv[:1])} exited {result.returncode}: "
                           f"{result.stderr.strip()[-2000:] or 'no output'}")
    return json.loads(lines[-1])


class Collected(logging.Handler):
    """Keeps the warnings the client's code logs (a failed job, a page not found)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start
