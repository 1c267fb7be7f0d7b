"""The embedded engine's change log: every answered change, in order, until LMDB holds it.

A change of the embedded engine (kvfs/engine.py) is answered as soon as it is visible in
memory and written here; the committer then moves changes into LMDB in synced groups. The log
is what makes an answered change survive the daemon's death (its writes sit in the page cache,
which outlives the process); a change in LMDB needs it no more.

Records are copied into segment files `DIR/changes-<first seq, 16 hex>.log`, each allocated
whole (SEGMENT_MAX, fallocate) and mapped shared: an append is a copy into the page cache,
no system call (a write(2) per change cost 10-14 µs here, a tenth of a create), and a full
volume fails the segment's allocation, not a page fault. What follows the last record is
zeros.

    header   magic u32, seq u64, payload length u32, xxh3_64 of the payload u64
    payload  entries: family (u8 length + name), key (u16 length + bytes), kind (u8):
             PUT (+ u32 length + value), DELETE, ADD (+ i64 delta)

Sequence numbers follow each other without gaps. Replay reads the segments in order; a torn
or damaged record ends its segment (an append that failed goes on in a new one) and a gap in
the sequence ends the replay: after a power loss the log holds a prefix of what was answered,
never a record that skips one.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

MAGIC = 0x6B766C67  # "kvlg"
_HEADER = struct.Struct("<IQIQ")
_FAMILY = struct.Struct("<B")
_KEY = struct.Struct("<H")
_KIND = struct.Struct("<B")
_VALUE = struct.Struct("<I")
_DELTA = struct.Struct("<q")
_PUT_HEAD = struct.Struct("<BI")  # kind, value length
_ADD_ENTRY = struct.Struct("<Bq")  # kind, delta
PUT, DELETE, ADD = 0, 1, 2
_DELETE_KIND = _KIND.pack(DELETE)
SEGMENT_MAX = 16 << 20  # bytes of a segment (more for a larger record): applied ones are
# deleted whole
PREFIX = "changes-"



class Keep:
    """The value is unchanged (only a counter delta, if any, applies)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = Keep()
# What a change does to one key's value: a new value (bytes), its removal (None) or neither
# (KEEP); a counter delta may come with each.
Value = bytes | None | Keep


def encode(writes: dict[str, dict[bytes, list]]) -> bytes:
    """A change's writes as one record's payload (pieces joined once: the loop encodes every
    change it answers)."""
    parts: list[bytes | bytearray | memoryview] = []
    add = parts.extend
    for family, keys in writes.items():
        head = _family_head(family)
        for key, (base, delta) in keys.items():
            key_head = _KEY.pack(len(key))
            if base is None:
                add((head, key_head, key, _DELETE_KIND))
            elif base is not KEEP:
                assert isinstance(base, bytes | bytearray | memoryview)
                add((head, key_head, key, _PUT_HEAD.pack(PUT, len(base)), base))
            if delta:
                add((head, key_head, key, _ADD_ENTRY.pack(ADD, delta)))
    return b"".join(parts)


@functools.cache
def _family_head(family: str) -> bytes:
    name = family.encode()
    return _FAMILY.pack(len(name)) + name


def decode(payload: bytes) -> Iterator[tuple[str, bytes, int, bytes | int | None]]:
    """(family, key, kind, value or delta) of each entry, in order."""
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
        if kind == PUT:
            (length,) = _VALUE.unpack_from(payload, at)
            yield family, key, kind, payload[at + 4: at + 4 + length]
            at += 4 + length
        elif kind == ADD:
            yield family, key, kind, _DELTA.unpack_from(payload, at)[0]
            at += 8
        else:
            yield family, key, kind, None


class ChangeLog:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._map: mmap.mmap | None = None  # the segment being written
        self._size = 0  # bytes of records in it
        self._segments: list[tuple[int, Path]] = []  # (first seq, path), oldest first

    def _listed(self) -> list[tuple[int, Path]]:
        found = []
        for path in self.directory.glob(PREFIX + "*.log"):
            try:
                found.append((int(path.stem.removeprefix(PREFIX), 16), path))
            except ValueError:
                log.warning("not a change log segment: %s", path)
        return sorted(found)

    def replay(self, after: int) -> Iterator[tuple[int, bytes]]:
        """(seq, payload) of every intact record after `after`, in order."""
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
                if (magic != MAGIC or len(payload) != length
                        or xxhash.xxh3_64_intdigest(payload) != digest):
                    log.warning("change log segment %s ends at offset %d (torn)", path.name, at)
                    break  # a failed append: the next segment goes on (if in sequence)
                if seq > expected:
                    log.warning("change log ends at seq %d (%s)", expected - 1, path.name)
                    return
                at += _HEADER.size + length
                if seq == expected:
                    yield seq, payload
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
