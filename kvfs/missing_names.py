"""Lookups of names a directory does not hold, answered before the request loop.

A store sends the daemon three lookups of missing names (vLLM's `exists`, the kernel's lookup
before an `O_CREAT|O_EXCL` open of a new temporary name, and the one it makes of a rename's
target whatever it has cached), and vLLM's tree two more per new directory: most of a store's
requests. On one host every name comes and goes through this daemon, so a directory made
while mounted starts empty and this host sees every name it gains or loses. kvfs's pyfuse3
patch keeps the names of those directories (by hash, in C) and answers a lookup of any other
name there itself, a cacheable miss, without a Python task (`.kvfs/stats`
`missing_names_answered`, also counted in `lookup_misses`). The embedded engine reports each
change of the `dentry` family (`LmdbEngine.track_names`): names are added before the change that
makes them is visible and removed after, so the patch's table never lacks a name a read could
find. A directory older than the mount becomes complete at the first miss Python answers in
it, if it holds at most SMALL_DIRECTORY entries (vLLM's leaf directories do; LMCache's flat
directory of a million chunks does not): its names are read then and reported. That is safe
on the loop alone: every change that adds a name runs there, inline (the embedded engine's
changes are not awaited), so none can fall between the listing and the marking. The root
(which also holds the virtual `.kvfs`) and the control directory never become complete.

On a shared pool other hosts add names too: there the record cache's complete directories
(`RecordCache`: those this host made, while other hosts' announcements reach it) are mirrored
(`RecordCache.track`): names are added as the cache learns them, from this host's changes or
other hosts' announcements (the same moment a Python lookup would see them), a directory
whose name leaves the cache stops being complete (`incomplete`, the patch's
`directory_incomplete`), and all stop when announcements may have been missed (`reset`).
Misses are answered there with the shared pool's negative timeout; another host's name
reaches this kernel as its cached miss is invalidated, as before. No older directory becomes
complete there.

The table is bounded (NAMES_MAX names, 12 bytes per slot, at most half the slots used: 48 MiB
at most): past that the patch stops answering and every miss goes to the loop again, as
before (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pyfuse3

from kvfs.meta import MetaStore
from kvfs.meta.schema import dentry_parts, from_u64

log = logging.getLogger(__name__)

NAMES_MAX = 2_000_000  # names of complete directories the patch keeps at most
SMALL_DIRECTORY = 64  # entries of a directory older than the mount that may become complete
LARGE_DIRECTORIES_KEPT = 65_536  # directories found larger, remembered (then all forgotten)


class MissingNames:
    """The patch's table of known names, kept by the embedded engine's `dentry` changes (a
    `KeyTracker`) or a shared pool's record cache (a `DirectoryTracker`). (The patch's
    functions are not in pyfuse3's type stub.)"""

    def __init__(self, meta: MetaStore, negative_timeout: float, name_max: int,
                 never_complete: Callable[[int], bool]) -> None:
        self.meta = meta
        self.negative_timeout = negative_timeout
        self.name_max = name_max  # (longer names: the operations' ENAMETOOLONG)
        self.never_complete = never_complete  # directories with names the engine lacks
        self.answering = False
        self._old_directories = False  # whether a small one may become complete (one host)
        self._large: set[int] = set()

    def start(self) -> bool:
        """Answer misses before the loop from now on, where the engine and pyfuse3 can."""
        engine = self.meta.engine
        # (a shared engine's complete directories can become incomplete: a newer patch)
        if hasattr(pyfuse3, "directory_incomplete" if engine.shared else "answer_missing_names"):
            self._answer()
            engine.track_names(self)
            self._old_directories = not engine.shared
        return self.answering

    def _answer(self) -> None:
        """Answer from an empty table from now on."""
        pyfuse3.answer_missing_names(  # type: ignore[attr-defined]
            self.negative_timeout, self.name_max, NAMES_MAX)
        self.answering = True

    def adding(self, keys: list[bytes], emptied: list[bytes]) -> None:
        kept = all([pyfuse3.complete_directory(from_u64(prefix))  # type: ignore[attr-defined]
                    for prefix in emptied])  # (directories just made)
        self._kept(kept and all([pyfuse3.name_added(*dentry_parts(key))  # type: ignore[attr-defined]
                                 for key in keys]))

    def missed_in(self, parent: int) -> None:
        """The loop answered a miss in `parent` (a directory older than the mount): make it
        complete if it is small. On the loop only (see the module's docstring)."""
        if (not self._old_directories or not self.answering or parent in self._large
                or self.never_complete(parent)):
            return
        entries = self.meta.readdir_types_page(parent, 0, SMALL_DIRECTORY + 1)
        if len(entries) > SMALL_DIRECTORY:
            if len(self._large) >= LARGE_DIRECTORIES_KEPT:
                self._large.clear()
            self._large.add(parent)
            return
        self._kept(pyfuse3.complete_directory(parent)  # type: ignore[attr-defined]
                   and all([pyfuse3.name_added(parent, name)  # type: ignore[attr-defined]
                            for name, _, _, _ in entries]))

    def _kept(self, kept: bool) -> None:
        if not kept and self.answering:
            self.answering = False
            log.warning("more than %d names in complete directories: lookups of missing "
                        "names go to the request loop from now on", NAMES_MAX)

    def removed(self, keys: list[bytes]) -> None:
        for key in keys:
            pyfuse3.name_removed(*dentry_parts(key))  # type: ignore[attr-defined]

    def incomplete(self, parents: list[bytes]) -> None:
        for parent in parents:
            pyfuse3.directory_incomplete(from_u64(parent))  # type: ignore[attr-defined]

    def reset(self) -> None:
        if self.answering:
            self._answer()
