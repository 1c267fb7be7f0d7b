"""kvfs: a FUSE filesystem for sharing LLM inference KV cache through storage."""

from __future__ import annotations

import os
from pathlib import Path


def child_environment() -> dict[str, str]:
    """The environment of a process kvfs starts (its keeper, its volume helper): it
    imports this package, whatever the interpreter would import (a checkout beside another)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}


def runtime_directory() -> Path:
    """The host's directory for what must outlive a daemon but not the host, and never wait
    on the volume (memory: /run is a tmpfs): KVFS_RUNTIME_DIR, else /run/kvfs."""
    return Path(os.environ.get("KVFS_RUNTIME_DIR", "/run/kvfs"))
