"""The embedded engine's change log: every answered change, in order, until LMDB holds it.

A change of the embedded engine (kvfs/engines/lmdb_engine.py) is answered as soon as it is
visible in memory and written here; the committer then moves changes into LMDB in synced
groups. The log is what makes an answered change survive the daemon's death (its writes sit in
the page cache, which outlives the process); a change in LMDB needs it no more.

Records are copied into segment files `DIR/changes-<first seq, 16 hex>.log` (DIR: the host's
runtime directory, kvfs/engines/lmdb_env.py; segments where earlier daemons kept them, in the
volume's metadata directory or another runtime directory, are replayed too), each allocated
whole (SEGMENT_MAX, fallocate) and mapped shared: an append is a copy into the page cache,
no system call (a write(2) per change would cost a good part of a create), and a full
volume fails the segment's allocation, not a page fault. What follows the last record is
zeros.

    header   magic u32, seq u64, payload length u32, xxh3_64 of the payload u64
    payload  the change's writes, {family: {key: [value, delta]}}, in marshal's format
             (version 4): value is the new bytes, None (removed) or Ellipsis (KEEP: only
             the delta applies). One C call each way: the loop encodes every change it
             answers.

Records of the entries format (magic MAGIC_ENTRIES) hold entries instead: family (u8 length
+ name), key (u16 length + bytes), kind (u8): PUT (+ u32 length + value), DELETE, ADD (+ i64
delta). Replay reads both formats, so that a log in either is applied.

Sequence numbers follow each other without gaps. Replay reads the segments in order; a torn
or damaged record ends its segment (an append that failed goes on in a new one) and a gap in
the sequence ends the replay: after a power loss the log holds a prefix of what was answered,
never a record that skips one.
"""

from __future__ import annotations

import logging
import marshal
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from types import EllipsisType

import xxhash

log = logging.getLogger(__name__)

MAGIC = 0x6B766C32  # "kvl2": a marshal payload
MAGIC_ENTRIES = 0x6B766C67  # "kvlg": a payload of entries (read, never written)
MARSHAL_VERSION = 4
_HEADER = struct.Struct("<IQIQ")
_FAMILY = struct.Struct("<B")
_KEY = struct.Struct("<H")
_KIND = struct.Struct("<B")
_VALUE = struct.Struct("<I")
_DELTA = struct.Struct("<q")
PUT, DELETE, ADD = 0, 1, 2
SEGMENT_MAX = 16 << 20  # bytes of a segment (more for a larger record): applied ones are
# deleted whole
PREFIX = "changes-"

# What a change does to one key's value: a new value (bytes), its removal (None) or neither
# (KEEP: the value is unchanged, only a counter delta applies); a delta may come with each.
KEEP = ...
Value = bytes | None | EllipsisType
# One key's pending change, [value, counter delta], and a change's writes by family and key.
Pending = list
Writes = dict[str, dict[bytes, Pending]]


def encode(writes: Writes) -> bytes:
    """A change's writes as one record's payload."""
    return marshal.dumps(writes, MARSHAL_VERSION)


def decode(payload: bytes, magic: int = MAGIC) -> Writes:
    """A change's writes from its record's payload."""
    if magic == MAGIC:
        writes: Writes = marshal.loads(payload)
        return writes
    return _decode_entries(payload)


def _decode_entries(payload: bytes) -> Writes:
    """The writes of a record of entries (MAGIC_ENTRIES)."""
    writes: Writes = {}
    at = 0
    while at < len(payload):
        (length,) = _FAMILY.unpack_from(payload, at)
        family = payload[at + 1: at + 1 + length].decode()
        at += 1 + length
        (length,) = _KEY.unpack_from(payload, at)
        key = payload[at + 2: at + 2 + length]
        at += 2 + length
        (kind,) = _KIND.unpack_from(payload, at)
        at += 1
        pending = writes.setdefault(family, {}).setdefault(key, [KEEP, 0])
        if kind == PUT:
            (length,) = _VALUE.unpack_from(payload, at)
            pending[:] = [payload[at + 4: at + 4 + length], 0]
            at += 4 + length
        elif kind == ADD:
            pending[1] += _DELTA.unpack_from(payload, at)[0]
            at += 8
        else:
            pending[:] = [None, 0]
    return writes


class ChangeLog:
    def __init__(self, directories: list[Path]) -> None:
        """Segments are written in the first of `directories`, and replayed from all."""
        self.directory = directories[0]
        self._directories = directories
        self._map: mmap.mmap | None = None  # the segment being written
        self._size = 0  # bytes of records in it
        self._segments: list[tuple[int, Path]] = []  # (first seq, path), oldest first

    def _listed(self) -> list[tuple[int, Path]]:
        found = []
        for path in (path for directory in self._directories
                     for path in directory.glob(PREFIX + "*.log")):
            try:
                found.append((int(path.stem.removeprefix(PREFIX), 16), path))
            except ValueError:
                log.warning("not a change log segment: %s", path)
        return sorted(found)

    def replay(self, after: int) -> Iterator[tuple[int, Writes]]:
        """(seq, writes) of every intact record after `after`, in order."""
        for seq, payload, magic in self.records(after):
            yield seq, decode(payload, magic)

    def records(self, after: int) -> Iterator[tuple[int, bytes, int]]:
        """(seq, payload, magic) of every intact record after `after`, in order."""
        expected = after + 1
        for _, path in self._listed():
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # (a read-only reader racing the committer) in LMDB now
                continue
            at = 0
            while at + _HEADER.size <= len(data):
                magic, seq, length, digest = _HEADER.unpack_from(data, at)
                if magic == 0 and length == 0:
                    break  # the segment's unused end
                payload = data[at + _HEADER.size: at + _HEADER.size + length]
                if (magic not in (MAGIC, MAGIC_ENTRIES) or len(payload) != length
                        or xxhash.xxh3_64_intdigest(payload) != digest):
                    log.warning("change log segment %s ends at offset %d (torn)", path.name, at)
                    break  # a failed append: the next segment goes on (if in sequence)
                if seq > expected:
                    log.warning("change log ends at seq %d (%s)", expected - 1, path.name)
                    return
                at += _HEADER.size + length
                if seq == expected:
                    yield seq, payload, magic
                    expected += 1

    def start(self, next_seq: int) -> None:
        """Write from `next_seq` on, into a new segment; earlier segments are replayed and
        applied already (`drop_all` first)."""
        self._open_segment(next_seq, 0)

    def append(self, seq: int, payload: bytes) -> None:
        length = _HEADER.size + len(payload)
        if self._map is None or self._size + length > len(self._map):
            self._open_segment(seq, length)
        assert self._map is not None
        at = self._size
        self._map[at + _HEADER.size: at + length] = payload
        # The header last: a reader beside this writer (a read-only open) finds a whole
        # record or one whose checksum fails, never a header over someone else's bytes.
        self._map[at: at + _HEADER.size] = _HEADER.pack(MAGIC, seq, len(payload),
                                                        xxhash.xxh3_64_intdigest(payload))
        self._size += length

    def release(self, applied: int) -> None:
        """Delete the segments whose every record is at most `applied` (never the one being
        written)."""
        while len(self._segments) > 1 and self._segments[1][0] <= applied + 1:
            _, path = self._segments.pop(0)
            path.unlink(missing_ok=True)

    def drop_all(self) -> None:
        """Every record is applied: no segment is needed any more."""
        self.close()
        for _, path in self._listed():
            path.unlink(missing_ok=True)
        self._segments = []

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _open_segment(self, first_seq: int, record: int) -> None:
        """A new segment for records from `first_seq` on, room for `record` bytes at least:
        allocated whole first, so that a full volume fails this change (ENOSPC), not a later
        write into the map (SIGBUS). One that failed is made again at the next change."""
        self.close()
        path = self.directory / f"{PREFIX}{first_seq:016x}.log"
        size = max(SEGMENT_MAX, record)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self._size = 0
        if not self._segments or self._segments[-1][0] != first_seq:
            self._segments.append((first_seq, path))
