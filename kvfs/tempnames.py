"""Writers sharing one temp name.

LMCache's `fs` plugin writes every chunk as `<key>.tmp`, closes it and renames it to
`<key>.data`. Two instances storing the same chunk at once open the same `<key>.tmp`: the
first to finish renames it away, and the other's rename would fail with ENOENT (LMCache then
logs the store as failed, though the chunk is whole). So for a moment after such a rename the
old name still leads to the moved file, but only for the other processes that were writing
it (or open it just after the rename): their rename is then a rename onto itself, which the
kernel answers with success. Nobody else sees the old name, and the process that renamed never
does, so a new file created under the old name is always a new file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import trio

GRACE_SECONDS = 2.0  # how long after the last writer closes the old name still serves it


def tgid_of(pid: int) -> int:
    """The process of a thread (the kernel reports the calling thread's id)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


@dataclass
class _MovedName:
    ino: int
    processes: set[int]  # writers of the file, other than the renamer
    until: float  # inf while one of them has the file open


@dataclass
class _Rename:
    parent: int
    name: bytes
    renamer: int
    at: float


@dataclass
class SharedTempNames:
    _moved: dict[tuple[int, bytes], _MovedName] = field(default_factory=dict)
    _writers: dict[int, dict[int, float]] = field(default_factory=dict)  # ino -> process -> until
    _renames: dict[int, _Rename] = field(default_factory=dict)  # ino -> its last rename

    def writer_opened(self, ino: int, process: int) -> None:
        now = trio.current_time()
        self._prune(now)
        self._writers.setdefault(ino, {})[process] = math.inf
        rename = self._renames.get(ino)
        if rename and rename.at > now - GRACE_SECONDS and process != rename.renamer:
            # It looked the old name up before the rename and opened the file just after.
            key = (rename.parent, rename.name)
            moved = self._moved.setdefault(key, _MovedName(ino, set(), math.inf))
            if moved.ino == ino:
                moved.processes.add(process)
                moved.until = math.inf

    def writer_closed(self, ino: int, process: int) -> None:
        until = trio.current_time() + GRACE_SECONDS
        self._writers.setdefault(ino, {})[process] = until
        for moved in self._moved.values():
            if moved.ino == ino and process in moved.processes:
                moved.until = until

    def renamed(self, parent: int, name: bytes, ino: int, renamer: int) -> None:
        now = trio.current_time()
        self._renames[ino] = _Rename(parent, name, renamer, now)
        writers = {process: until for process, until in self._writers.get(ino, {}).items()
                   if until > now and process != renamer}
        if writers:
            self._moved[(parent, name)] = _MovedName(ino, set(writers), max(writers.values()))

    def moved(self, parent: int, name: bytes, pid: int) -> int | None:
        """The file renamed away from (parent, name), if the asking thread's process was
        writing it; else None."""
        moved = self._moved.get((parent, name))
        if moved is None:
            return None
        if moved.until <= trio.current_time():
            del self._moved[(parent, name)]
            return None
        return moved.ino if tgid_of(pid) in moved.processes else None

    def created(self, parent: int, name: bytes) -> None:
        self._moved.pop((parent, name), None)

    def _prune(self, now: float) -> None:
        if len(self._writers) + len(self._renames) < 4096:
            return
        self._writers = {ino: processes for ino, processes in self._writers.items()
                         if max(processes.values()) > now}
        self._renames = {ino: rename for ino, rename in self._renames.items()
                         if rename.at > now - GRACE_SECONDS}
