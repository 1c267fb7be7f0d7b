"""The metadata store of a kvfs volume, one concern per module, all written once over the
transactions of a metadata engine (kvfs/engines/lmdb_engine.py, kvfs/engines/redis_engine.py):

    schema.py     the key schema (its docstring), records, constants
    base.py       the store's state and the helpers over `Txn` that several concerns share
    namespace.py  directories, names, attributes, xattrs
    content.py    blob records, content commits, pending sums, doomed blobs, dropping files
    pool.py       the hosts of a shared pool: sessions, held blobs, boots
    recency.py    use and room: recency index, pins, usage counters, capacity, models
    formats.py    formatting and migrating the store's format

fsck's repairs and `recount` live with fsck (kvfs/cli/fsck.py).
"""

from __future__ import annotations

import threading

from kvfs.engines.interface import Engine
from kvfs.meta.content import ContentOps
from kvfs.meta.formats import FormatOps
from kvfs.meta.namespace import NamespaceOps
from kvfs.meta.pool import PoolOps
from kvfs.meta.recency import RecencyOps
from kvfs.meta.schema import (
    DEFAULT_MAP_SIZE,
    FAMILIES,
    FORMAT,
    ID_BATCH,
    LINK_MAX,
    MODEL_BYTES,
    MODEL_FILES,
    NAME_MAX,
    PATH_MAX,
    PIN_XATTR,
    READDIR_BATCH,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    TOUCH_BATCH,
    V1_FORMAT,
    V2_FORMAT,
    XATTR_VALUE_MAX,
    Inode,
    Removed,
    Usage,
    check_name,
    from_u64,
    u64,
)

__all__ = [
    "DEFAULT_MAP_SIZE", "FAMILIES", "FORMAT", "ID_BATCH", "LINK_MAX", "MODEL_BYTES",
    "MODEL_FILES", "NAME_MAX", "PATH_MAX", "PIN_XATTR", "READDIR_BATCH", "RENAME_EXCHANGE",
    "RENAME_NOREPLACE", "ROOT_INO", "TOUCH_BATCH", "V1_FORMAT", "V2_FORMAT", "XATTR_VALUE_MAX",
    "Inode", "MetaStore", "Removed", "Usage", "check_name", "from_u64", "u64",
]


class MetaStore(NamespaceOps, ContentOps, PoolOps, RecencyOps, FormatOps):
    """Namespace and attributes of one kvfs volume, kept in a metadata engine."""


    def __init__(self, engine: Engine, readonly: bool = False) -> None:
        self.engine = engine
        self.session = b""  # this mount's session in a shared pool (kvfs/pool/sessions.py)
        self._ids: range = range(0)  # inode numbers and cookies in stock
        self._ids_lock = threading.Lock()
        if not readonly:
            try:
                self._change(self._open_format)
            except BaseException:
                self.engine.close()
                raise

    def close(self) -> None:
        self.engine.close()

