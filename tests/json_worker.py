"""Run a client driver (tests/vllm_tier.py, tests/sglang_hicache.py) in a process of its own:
each prints one JSON line, its report."""

from __future__ import annotations

import json
import subprocess
import sys
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
