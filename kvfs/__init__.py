"""kvfs: a FUSE filesystem for sharing LLM inference KV cache through storage."""

from __future__ import annotations

import os
from pathlib import Path


def child_environment() -> dict[str, str]:
    """The environment of a process kvfs starts (its LMDB writer, its volume helper): it
    imports this package, whatever the interpreter would import (a checkout beside another)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
