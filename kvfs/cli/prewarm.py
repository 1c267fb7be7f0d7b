"""`kvfs prewarm`: read files through the mount ahead of traffic so they are served from memory.

Without passthrough kvfs serves the first read of a file past the kernel page cache and keeps
it there from the second on, so each file is read twice: once from the volume, once into the
page cache. With passthrough the first open verifies the file into the page cache and the
second read is served from there, at memory speed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kvfs.fuse.control import CONTROL_DIR

CHUNK = 8 << 20


def files_under(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            for directory, subdirectories, names in os.walk(path):
                if CONTROL_DIR.decode() in subdirectories:
                    subdirectories.remove(CONTROL_DIR.decode())  # live state, not cache
                yield from (Path(directory) / name for name in sorted(names))
        else:
            yield path


def prewarm(paths: list[Path], console: Console | None = None) -> tuple[int, int]:
    """Read every file whole, twice; returns (files, bytes) warmed."""
    console = console or Console(stderr=True)
    files = [path for path in files_under(paths) if path.is_file()]
    total = sum(path.stat().st_size for path in files)
    buffer = bytearray(CHUNK)
    warmed = 0
    with Progress(TextColumn("prewarming"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("prewarm", total=2 * total)
        for path in files:
            for _ in range(2):
                with open(path, "rb", buffering=0) as source:
                    while count := source.readinto(buffer):
                        progress.advance(task, count)
            warmed += path.stat().st_size
    return len(files), warmed
