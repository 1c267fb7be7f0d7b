"""`kvfs fsck`: check an unmounted volume's metadata against its data, and repair it.

Checks every directory entry and inode, every blob record against its data file (size and
every block checksum), looks for data files no record names, and recounts usage. Repair drops
files whose data is missing or damaged, reclaims orphaned data and fixes the counters.

The repairs only fsck makes (`Repairs`, over the store's core, kvfs/meta/core.py) and
`recount` live here.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from kvfs.data.store import ChecksumError, DataStore
from kvfs.data.verify import take_sums
from kvfs.data.volume import Volume, VolumeError
from kvfs.engines.interface import Txn
from kvfs.meta import MODEL_BYTES, MODEL_FILES, ROOT_INO, Inode, MetaCore, MetaStore, u64
from kvfs.meta.recency import Recency
from kvfs.observe.models import model_of
from kvfs.pool.reaper import reap_doomed, recover
from kvfs.records import BlobInfo


class FsckError(Exception):
    """fsck cannot run at all (volume in use, not a kvfs volume)."""


def run(data_dir: Path, repair: bool, console: Console | None = None,
        meta_url: str | None = None) -> bool:
    """Returns True when the volume is clean or was repaired. A shared pool (`meta_url`) is
    checked only while no host has it mounted."""
    # File names are data, not markup, and each report stays on one greppable line.
    console = console or Console(stderr=True, markup=False, highlight=False, soft_wrap=True)
    data_dir = data_dir.resolve()
    volume = Volume(data_dir)
    if not volume.exists():
        raise FsckError(f"{data_dir} is not a kvfs volume (no meta/data.mdb or "
                        f"shared-metadata)")
    try:
        lock_fd = volume.lock()
    except VolumeError as error:
        raise FsckError(f"{error}; unmount it first") from None
    try:
        # (a pool whose engine lost it: repairing makes a new one there, and reclaims the data)
        meta = volume.open_metadata(meta_url, rebuild=repair)
    except Exception as error:
        os.close(lock_fd)
        raise FsckError(str(error)) from None
    try:
        live = [session for session in meta.pool.sessions() if meta.engine.alive(session)]
        if live:
            raise FsckError(f"{data_dir} is mounted by {len(live)} hosts; unmount them first")
        checker = Checker(meta, volume, volume.open_data(), console)
        problems = checker.check(repair)
    finally:
        meta.close()
        os.close(lock_fd)
    if not problems:
        console.print(f"kvfs fsck: {data_dir} is clean ({checker.files} files, "
                      f"{checker.used} bytes)")
        return True
    verdict = "repaired" if repair else "found (run with --repair to fix)"
    console.print(f"kvfs fsck: {problems} problems {verdict}")
    return repair


class Checker:
    def __init__(self, meta: MetaStore, volume: Volume, data: DataStore,
                 console: Console) -> None:
        self.meta = meta
        self.repairs = Repairs(meta.core, meta.recency)
        self.volume = volume
        self.data = data
        self.console = console
        self.problems = 0
        self.files = 0
        self.used = 0

    def report(self, message: str) -> None:
        self.problems += 1
        self.console.print(f"  problem: {message}")

    def check(self, repair: bool) -> int:
        leftovers = {
            "staged data files": sum(path.is_file() for path in self.data.staging_root.rglob("*")),
            "data files of removed files": len(self.meta.content.doomed()),
            "host sessions": len(self.meta.pool.sessions()),
        }
        if any(leftovers.values()):
            self.report("left by a crash: " + ", ".join(
                f"{count} {what}" for what, count in leftovers.items() if count))
            if repair:
                for blob_id in recover(self.meta, self.data, self.volume):
                    self._take_sums(blob_id)
        inodes = {inode.ino: inode for inode in self.meta.namespace.inodes()}
        self._check_entries(inodes, repair)
        blobs = {blob.blob_id: blob for blob in self.meta.content.blobs()}
        self._check_blobs(inodes, blobs, repair)
        self._check_orphan_data(blobs, repair)
        self._check_counters(repair)
        return self.problems

    def _check_entries(self, inodes: dict[int, Inode], repair: bool) -> None:
        linked = {ROOT_INO}
        names: dict[int, int] = {}
        for parent, name, ino in self.meta.namespace.entries():
            if ino not in inodes or parent not in inodes:
                self.report(f"entry {name!r} in directory {parent} names missing inode {ino}")
                if repair:
                    self.repairs.remove_entry(parent, name, ino)
            else:
                linked.add(ino)
                names[ino] = names.get(ino, 0) + 1
        for ino, count in names.items():
            inode = inodes[ino]
            if not inode.is_dir and inode.nlink != count:
                self.report(f"{inode.name!r} (inode {ino}) has {count} names, nlink "
                            f"{inode.nlink}")
                if repair:
                    self.repairs.set_nlink(ino, count)
        for ino in inodes.keys() - linked:
            self.report(f"inode {ino} ({inodes[ino].name!r}) is in no directory")
            if repair:
                self.meta.content.drop_files([ino])
            del inodes[ino]

    def _check_blobs(self, inodes: dict[int, Inode], blobs: dict[int, BlobInfo],
                     repair: bool) -> None:
        owned = {inode.blob: inode for inode in inodes.values() if inode.blob}
        for blob_id in owned.keys() - blobs.keys():
            inode = owned.pop(blob_id)
            self.report(f"{inode.name!r} (inode {inode.ino}) has no record of its data")
            if repair:
                self.meta.content.drop_files([inode.ino])
        for blob_id in blobs.keys() - owned.keys():
            self.report(f"data record {blob_id:016x} belongs to no file")
            if repair:
                self.repairs.forget_blob(blob_id)
        total = sum(blobs[blob_id].size for blob_id in owned)
        with _progress(self.console) as progress:
            task = progress.add_task("verifying data", total=total)
            for blob_id, inode in owned.items():
                blob = blobs[blob_id]
                damage = self.data.verify(blob)
                progress.advance(task, blob.size)
                if damage is None:
                    continue
                self.report(f"{inode.name!r} (inode {inode.ino}): {damage}")
                if repair:
                    self.meta.content.drop_files([inode.ino])
        if repair:
            reap_doomed(self.meta, self.data)

    def _take_sums(self, blob_id: int) -> None:
        """A file written in this boot whose sums a host had not taken yet: take them now;
        drop the file if its data is not what was committed."""
        try:
            take_sums(self.meta, self.data, blob_id)
        except ChecksumError as error:
            info = self.meta.content.blob_info(blob_id)
            self.report(f"blob {blob_id:016x}: {error}")
            if info is not None:
                self.meta.content.drop_files([info.ino])

    def _check_orphan_data(self, blobs: dict[int, BlobInfo], repair: bool) -> None:
        content = self.meta.content
        known = set(content.doomed()) | {blob.blob_id for blob in content.blobs()}
        for shard in self.data.blobs_dir.iterdir():
            for entry in os.scandir(shard):
                try:
                    blob_id = int(entry.name, 16)
                except ValueError:
                    blob_id = -1
                if blob_id in known:
                    continue
                self.report(f"orphaned data file {entry.path} ({entry.stat().st_size} bytes)")
                if repair:
                    os.unlink(entry.path)

    def _check_counters(self, repair: bool) -> None:
        self.used, self.files, models = recount(self.meta)
        usage = self.meta.recency.usage()
        if (usage.used, usage.files) != (self.used, self.files):
            self.report(f"usage counters say {usage.used} bytes in {usage.files} files, "
                        f"counted {self.used} bytes in {self.files} files")
        if self.meta.recency.models() != models:
            self.report(f"per-model usage says {self.meta.recency.models()}, counted {models}")
        if repair and ((usage.used, usage.files) != (self.used, self.files)
                       or self.meta.recency.models() != models):
            self.repairs.set_usage(self.used, self.files, models)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), console=console, transient=True)


# -- recount and repairs (over the store's core: the namespace logic stays in kvfs/meta/) ---


def recount(meta: MetaStore) -> tuple[int, int, dict[str, dict[str, int]]]:
    """What the usage counters should say, counted from the records: used bytes, files and
    per-model usage (fsck and tests compare them with the counters)."""
    used = sum(blob.allocated for blob in meta.content.blobs())
    files = 0
    models: dict[str, dict[str, int]] = {}
    for inode in meta.namespace.inodes():
        if inode.is_dir:
            continue
        files += 1
        model = model_of(inode.name)
        if model is not None:
            counts = models.setdefault(model, {"files": 0, "bytes": 0})
            counts["files"] += 1
            counts["bytes"] += inode.allocated
    return used, files, models


class Repairs:
    """The repairs only fsck makes, over the store's core."""

    def __init__(self, core: MetaCore, recency: Recency) -> None:
        self.core = core
        self.recency = recency

    def remove_entry(self, parent: int, name: bytes, ino: int) -> None:
        """Delete a directory entry whose inode is missing."""
        def change(txn: Txn) -> None:
            self.core.unlink(txn, parent, name, ino)
        self.core.change(change)

    def set_nlink(self, ino: int, nlink: int) -> None:
        """Set a file's link count to the number of its names."""
        def change(txn: Txn) -> None:
            self.core.put(txn, self.core.get(txn, ino)._replace(nlink=nlink))
        self.core.change(change)

    def forget_blob(self, blob_id: int) -> None:
        """Delete a blob record no inode points at (its data file goes with it)."""
        def change(txn: Txn) -> None:
            txn.delete("blob", u64(blob_id))
            txn.put("doomed", u64(blob_id), b"")
        self.core.change(change)

    def set_usage(self, used: int, files: int, models: dict[str, dict[str, int]]) -> None:
        """Reset the usage counters to what was counted (by adding the difference)."""
        now = self.recency.usage()
        def change(txn: Txn) -> None:
            txn.add("counters", b"used_bytes", used - now.used)
            txn.add("counters", b"files", files - now.files)
            txn.clear("models")
            for model, counts in models.items():
                txn.add("models", model.encode() + MODEL_FILES, counts["files"])
                txn.add("models", model.encode() + MODEL_BYTES, counts["bytes"])
        self.core.change(change)
