"""Records and errors that both stores use: the data store (kvfs/data/store.py) reads and writes
blobs by their `BlobInfo`, the metadata store (kvfs/meta/) keeps it; either refuses a request
with `FsError`.
"""

from __future__ import annotations

import errno
import struct
import zlib
from array import array
from dataclasses import dataclass

BLOB_RECORD = struct.Struct("<QQQII")
SUMS_COMPRESSED = 1  # blob record flag: the sums are zlib-compressed (large sparse files)
SUMS_PENDING = 2  # blob record flag: written by the kernel, block sums not taken yet
SUMS_COMPRESS_FROM = 64 << 10


class FsError(OSError):
    """A refusal kvfs answers on purpose (ENOENT, EEXIST, ...), as opposed to an error of the
    volume underneath: the FUSE layer logs and counts only the latter."""

    errno: int  # always set (made by `fail`); OSError's may be None


def fail(code: int) -> FsError:
    return FsError(code, errno.errorcode.get(code, str(code)))


@dataclass(frozen=True, slots=True)
class BlobInfo:
    """What is known about one immutable data file: its owner, sizes and block checksums."""

    blob_id: int
    ino: int
    size: int
    allocated: int
    block_size: int
    sums: array  # xxh3-64 of each block (empty while pending)
    pending: bool = False  # the sums are taken after the commit (kernel-written blobs)

    def pack(self) -> bytes:
        sums, flags = self.sums.tobytes(), SUMS_PENDING if self.pending else 0
        if len(sums) >= SUMS_COMPRESS_FROM:  # mostly holes: one repeated sum
            sums, flags = zlib.compress(sums, 1), flags | SUMS_COMPRESSED
        return BLOB_RECORD.pack(self.ino, self.size, self.allocated, self.block_size, flags) + sums

    @classmethod
    def unpack(cls, blob_id: int, raw: bytes) -> BlobInfo:
        ino, size, allocated, block_size, flags = BLOB_RECORD.unpack_from(raw)
        packed = bytes(raw[BLOB_RECORD.size:])
        sums = array("Q")
        sums.frombytes(zlib.decompress(packed) if flags & SUMS_COMPRESSED else packed)
        return cls(blob_id, ino, size, allocated, block_size, sums, bool(flags & SUMS_PENDING))
