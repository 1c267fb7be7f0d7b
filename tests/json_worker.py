"""What the client drivers (tests/vllm_tier.py, tests/sglang_hicache.py) share: each runs in a
process of its own (`run_json`) and prints one JSON line, its report, with what the client's
own code logged (`Collected`), how long its calls took (`timed`) and, for a loop, each pass
(`repeat`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PASS_PAUSE = 0.02  # seconds between the passes of `repeat`


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


def repeat(one_pass: Callable[[], dict[str, Any]], seconds: float,
           collected: Collected) -> list[dict[str, Any]]:
    """`one_pass` again and again for `seconds`, as an engine serving one request after
    another does: each pass's record, with when it started (seconds since the first) and the
    first message the client's code logged in it."""
    passes: list[dict[str, Any]] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        began = time.monotonic() - start
        logged = len(collected.messages)
        record = one_pass()
        messages = collected.messages[logged:]
        passes.append({"at": round(began, 3), **record,
                       "message": messages[0] if messages else ""})
        del collected.messages[logged:]  # a pass's messages are in its record
        time.sleep(PASS_PAUSE)
    return passes


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start
