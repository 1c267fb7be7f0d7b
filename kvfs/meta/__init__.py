"""The metadata store of a kvfs volume: one object per concern, each holding the store's shared
core, all written once over the transactions of a metadata engine
(kvfs/engines/lmdb_engine.py, kvfs/engines/redis_engine.py):

    schema.py     the key schema (its docstring), records, constants
    core.py       MetaCore: the engine, this mount's session, the inode-id stock, and the
                  helpers over `Txn` that several concerns share
    namespace.py  Namespace: directories, names, attributes, xattrs
    content.py    Content: blob records, content commits, pending sums, doomed blobs, dropping
                  files
    pool.py       Pool: the hosts of a shared pool: sessions, held blobs, boots
    recency.py    Recency: use and room: recency index, pins, usage counters, capacity, models
    formats.py    Formats: formatting and migrating the store's format

`MetaStore` composes them: `meta.namespace.lookup(...)`, `meta.content.commit_content(...)`.
The concerns call only the core, never each other. fsck's repairs and `recount` live with
fsck (kvfs/cli/fsck.py), over the same core.
"""

from __future__ import annotations

from kvfs.engines.interface import Engine
from kvfs.meta.content import Content
from kvfs.meta.core import MetaCore
from kvfs.meta.formats import Formats
from kvfs.meta.namespace import Namespace
from kvfs.meta.pool import Pool
from kvfs.meta.recency import Recency
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
    "Inode", "MetaCore", "MetaStore", "Removed", "Usage", "check_name", "from_u64", "u64",
]


class MetaStore:
    """Namespace and attributes of one kvfs volume, kept in a metadata engine: its concerns
    over one shared core."""

    def __init__(self, engine: Engine, readonly: bool = False) -> None:
        self.engine = engine
        self.core = MetaCore(engine)
        self.namespace = Namespace(self.core)
        self.content = Content(self.core)
        self.pool = Pool(self.core)
        self.recency = Recency(self.core)
        self.formats = Formats(self.core)
        if not readonly:
            try:
                self.core.change(self.formats.open)
            except BaseException:
                engine.close()
                raise

    @property
    def session(self) -> bytes:
        """This mount's session in a shared pool (set by kvfs/pool/sessions.py)."""
        return self.core.session

    @session.setter
    def session(self, session: bytes) -> None:
        self.core.session = session

    def close(self) -> None:
        self.engine.close()
