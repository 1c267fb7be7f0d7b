"""Lookups of names a directory does not hold, answered before the request loop.

A store sends the daemon three lookups of missing names (vLLM's `exists`, the kernel's lookup
before an `O_CREAT|O_EXCL` open of a new temporary name, and the one it makes of a rename's
target whatever it has cached), and vLLM's tree two more per new directory: most of a store's
requests. On one host every name comes and goes through this daemon, so a directory made
while mounted starts empty and this host sees every name it gains or loses. kvfs's pyfuse3
patch keeps the names of those directories (by hash, in C) and answers a lookup of any other
name there itself, a cacheable miss, without a Python task (`.kvfs/stats`
`missing_names_answered`, also counted in `lookup_misses`). The embedded engine reports each
change of the `dentry` family (`LmdbEngine.track`): names are added before the change that
makes them is visible and removed after, so the patch's table never lacks a name a read could
find. Directories that existed before the mount go to the operations as before.

Not on a shared pool: there other hosts add names. The table is bounded (NAMES_MAX names,
12 bytes per slot, at most half the slots used: 48 MiB at most): past that the patch stops
answering and every miss goes to the loop again, as before (logged once).
"""

from __future__ import annotations

import logging

import pyfuse3

from kvfs.engine import LmdbEngine
from kvfs.meta.schema import dentry_parts, from_u64

log = logging.getLogger(__name__)

NAMES_MAX = 2_000_000  # names of directories made since the mount the patch keeps at most


class MissingNames:
    """The patch's table of known names, kept by the embedded engine's `dentry` changes (a
    `KeyTracker`). (The patch's functions are not in pyfuse3's type stub.)"""

    def __init__(self, negative_timeout: float, name_max: int) -> None:
        self.negative_timeout = negative_timeout
        self.name_max = name_max  # (longer names: the operations' ENAMETOOLONG)

    def start(self, engine: object) -> bool:
        """Answer misses before the loop from now on, where the engine and pyfuse3 can."""
        if not isinstance(engine, LmdbEngine) or not hasattr(pyfuse3, "answer_missing_names"):
            return False
        pyfuse3.answer_missing_names(self.negative_timeout, self.name_max, NAMES_MAX)
        engine.track("dentry", self)
        return True

    def adding(self, keys: list[bytes], emptied: list[bytes]) -> None:
        kept = all([pyfuse3.complete_directory(from_u64(prefix))  # type: ignore[attr-defined]
                    for prefix in emptied])  # (directories just made)
        kept &= all([pyfuse3.name_added(*dentry_parts(key))  # type: ignore[attr-defined]
                     for key in keys])
        if not kept:
            log.warning("more than %d names in directories made since the mount: lookups "
                        "of missing names go to the request loop from now on", NAMES_MAX)

    def removed(self, keys: list[bytes]) -> None:
        for key in keys:
            pyfuse3.name_removed(*dentry_parts(key))  # type: ignore[attr-defined]
