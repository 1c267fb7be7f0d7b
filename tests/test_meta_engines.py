"""One metadata suite, every engine: the same scenarios run straight on `MetaStore` (no FUSE)
over the embedded engine (LMDB) and over the shared one (Redis), as JuiceFS runs its
`testMeta` against each of its engines.

Every test ends with the store checked whole (the fixture's teardown, `check_store`): the usage
counters equal a recount of the records, every entry names a live inode, link counts match
the names, primary names are names, the recency index lists each file once at its atime, and
every blob record belongs to exactly the inode that points at it. Scenarios that need several
hosts of one pool run on Redis only.
"""

from __future__ import annotations

import errno
import functools
import stat
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest
import trio
import xxhash
from conftest import wait_for

from kvfs.cli.fsck import recount
from kvfs.engines.changelog import _HEADER, KEEP, MAGIC, MAGIC_ENTRIES, ChangeLog, decode
from kvfs.engines.interface import Engine, RoundTripNeeded, Txn
from kvfs.engines.lmdb_engine import LmdbEngine
from kvfs.engines.lmdb_env import APPLIED_KEY, host_files
from kvfs.engines.redis_engine import NotCached, RecordCache, RedisEngine, record_key
from kvfs.meta import (
    DEFAULT_MAP_SIZE,
    FAMILIES,
    NAME_MAX,
    PATH_MAX,
    PIN_XATTR,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    XATTR_VALUE_MAX,
    Inode,
    MetaStore,
    Removed,
    from_u64,
    u64,
)
from kvfs.records import BlobInfo, FsError

UID, GID = 1000, 1000
FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
BLOCK = 4096
MODEL_NAME = b"llama@1@0@c0ffee@bf16.data"  # an LMCache chunk file of model "llama"
ONLY_SHARED = "two hosts of one pool: the embedded engine serves one host"


# -- the engines ----------------------------------------------------------------------------


class Backend:
    """Opens metadata stores over the test's engine: LMDB in a fresh directory, or the test's
    own redis-server (there each store is one "host" of a pool)."""

    def __init__(self, kind: str, open_engine: Callable[[], Engine]) -> None:
        self.kind = kind
        self.open_engine = open_engine
        self.stores: list[MetaStore] = []
        self.used = False

    @property
    def shared(self) -> bool:
        return self.kind == "redis"

    def open(self) -> MetaStore:
        """A MetaStore over a fresh engine, as Volume.open_metadata builds it."""
        store = MetaStore(self.open_engine())
        self.stores.append(store)
        self.used = True
        return store

    def close(self, store: MetaStore) -> None:
        self.stores.remove(store)
        store.close()

    def finish(self) -> None:
        """Check the store whole, then close every store (also when the check fails)."""
        try:
            if self.used:
                check_store(self.stores[0] if self.stores else self.open())
        finally:
            while self.stores:
                self.close(self.stores[-1])


def watching_engine(url: str) -> RedisEngine:
    """A Redis engine as a mount runs it: told of other hosts' changes, so it caches names
    and attributes (RecordCache)."""
    engine = RedisEngine(url)
    engine.watch(lambda family, key: None)
    assert wait_for(engine.watching)
    return engine


@pytest.fixture(params=["lmdb", "redis", "redis-cached"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param.startswith("redis"):
        server = request.getfixturevalue("redis_server")  # stopped (by pid) after this ends
        cached = request.param == "redis-cached"
        chosen = Backend("redis", lambda: (watching_engine if cached else RedisEngine)(server.url))
    else:
        chosen = Backend("lmdb", lambda: LmdbEngine(tmp_path / "meta", FAMILIES,
                                                    DEFAULT_MAP_SIZE))
    yield chosen
    chosen.finish()


@pytest.fixture
def meta(backend: Backend) -> MetaStore:
    return backend.open()


@pytest.fixture
def pool(backend: Backend) -> tuple[MetaStore, MetaStore]:
    """Two hosts of one shared pool: two stores, each over its own engine (connection)."""
    if not backend.shared:
        pytest.skip(ONLY_SHARED)
    return backend.open(), backend.open()


# -- helpers --------------------------------------------------------------------------------


def refused(code: int, call: Callable[..., object], *args: object, **kwargs: object) -> None:
    """`call` fails with FsError `code`, exactly."""
    with pytest.raises(OSError) as caught:
        call(*args, **kwargs)
    assert isinstance(caught.value, FsError), repr(caught.value)
    got = caught.value.errno
    assert got == code, f"{errno.errorcode.get(got, got)} instead of {errno.errorcode[code]}"


def mkfile(meta: MetaStore, name: bytes, parent: int = ROOT_INO) -> Inode:
    return meta.namespace.make(parent, name, FILE, UID, GID)


def mkdir(meta: MetaStore, name: bytes, parent: int = ROOT_INO) -> Inode:
    return meta.namespace.make(parent, name, DIR, UID, GID)


def new_blob(meta: MetaStore, ino: int, size: int, allocated: int | None = None,
             pending: bool = False) -> BlobInfo:
    """A blob record for `ino` (one fresh blob id), `size` bytes in 4 KiB blocks."""
    (blob_id,) = meta.content.allocate_blob_ids(1)
    blocks = -(-size // BLOCK)
    sums = array("Q") if pending else array("Q", [blob_id * 1_000_003 + i for i in range(blocks)])
    return BlobInfo(blob_id, ino, size, blocks * BLOCK if allocated is None else allocated,
                    BLOCK, sums, pending)


def listing(meta: MetaStore, parent: int, after: int = 0) -> list[tuple[bytes, int, int]]:
    """(name, ino, cookie) of each entry, in readdir order."""
    return [(name, inode.ino, cookie)
            for name, inode, cookie in meta.namespace.readdir(parent, after)]


def from_memory(meta: MetaStore, read: Callable[[], object]) -> object:
    """What `read` gives from `meta`'s memory alone (where the daemon's loop tries cached
    reads), or RoundTripNeeded."""
    with meta.engine.from_memory():
        try:
            return read()
        except RoundTripNeeded:
            return RoundTripNeeded


def names_in(meta: MetaStore, parent: int) -> list[bytes]:
    return [name for name, _, _ in listing(meta, parent)]


def session_id(meta: MetaStore) -> bytes:
    """A fresh session id, taken from the pool's counter as a mount takes its own."""
    return meta.engine.allocate(b"next_session", 1).to_bytes(8, "big")


def check_store(meta: MetaStore) -> None:
    """The invariants every scenario must leave behind (see the module's docstring)."""
    used, files, models = recount(meta)
    usage = meta.recency.usage()
    assert (usage.used, usage.files, meta.recency.models()) == (used, files, models), \
        "usage counters differ from a recount"

    inodes = {inode.ino: inode for inode in meta.namespace.inodes()}
    assert inodes[ROOT_INO].is_dir
    names: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    subdirs: Counter[int] = Counter()
    for parent, name, ino in meta.namespace.entries():
        assert ino in inodes, f"entry {name!r} in {parent} names missing inode {ino}"
        assert parent in inodes and inodes[parent].is_dir, f"entry {name!r} in non-dir {parent}"
        names[ino].append((parent, name))
        subdirs[parent] += inodes[ino].is_dir
    for ino, inode in inodes.items():
        if inode.is_dir:
            assert inode.nlink == 2 + subdirs[ino], f"directory {ino} nlink {inode.nlink}"
            listed = sorted((name, child) for name, child, _ in listing(meta, ino))
            expected = sorted((name, child) for child, places in names.items()
                              for parent, name in places if parent == ino)
            assert listed == expected, f"readdir of {ino} differs from its entries"
            cookies = [cookie for _, _, cookie in listing(meta, ino)]
            assert cookies == sorted(set(cookies))
            typed = meta.namespace.readdir_types_page(ino, 0, len(inodes))
            assert [(name, child, cookie) for name, child, _, cookie in typed] == \
                listing(meta, ino), f"the listing without attributes of {ino} differs"
            assert all(file_type == stat.S_IFMT(inodes[child].mode)
                       for _, child, file_type, _ in typed), f"entry types in {ino}"
        if ino == ROOT_INO:
            assert not names[ino]
            continue
        assert sorted(meta.namespace.names(ino)) == sorted(names[ino]), f"links of {ino}"
        assert (inode.parent, inode.name) in names[ino], f"primary name of {ino} is no name"
        if inode.is_dir:
            assert len(names[ino]) == 1, f"directory {ino} has several names"
        else:
            assert inode.nlink == len(names[ino]), f"inode {ino} nlink {inode.nlink}"

    regular = {ino for ino, inode in inodes.items() if not inode.is_dir}
    recent = meta.recency.least_recent(len(inodes) + 10)
    assert sorted(inode.ino for _, inode in recent) == sorted(regular), "recency index"
    for key, inode in recent:
        assert int.from_bytes(key[:8], "big") == inode.atime_ns, f"recency of {inode.ino}"
    assert [key for key, _ in recent] == sorted(key for key, _ in recent)

    blobs = {blob.blob_id: blob for blob in meta.content.blobs()}
    owners = {inode.blob: inode for inode in inodes.values() if inode.blob}
    assert owners.keys() == blobs.keys(), "blob records and the inodes pointing at them"
    for blob_id, blob in blobs.items():
        owner = owners[blob_id]
        assert (blob.ino, blob.size, blob.allocated) == (owner.ino, owner.size,
                                                         owner.allocated)
    assert not set(meta.content.doomed()) & blobs.keys(), "a live blob is doomed"
    assert meta.recency.pinned() <= inodes.keys()
    for ino in meta.recency.pinned():
        meta.namespace.getxattr(ino, PIN_XATTR)


# -- namespace ------------------------------------------------------------------------------


def test_make_lookup_get(meta: MetaStore) -> None:
    assert meta.namespace.get(ROOT_INO).is_dir and meta.namespace.get(ROOT_INO).nlink == 2
    before = time.time_ns()
    f = mkfile(meta, b"f")
    d = mkdir(meta, b"d")
    assert (f.mode, f.nlink, f.uid, f.gid, f.size, f.blob, f.version) == (FILE, 1, UID, GID,
                                                                         0, 0, 0)
    assert (f.parent, f.name) == (ROOT_INO, b"f") and f.mtime_ns >= before
    assert d.is_dir and d.nlink == 2 and (d.parent, d.name) == (ROOT_INO, b"d")
    assert f.ino != d.ino and ROOT_INO not in (f.ino, d.ino)
    assert meta.namespace.lookup(ROOT_INO, b"f") == meta.namespace.get(f.ino) == f
    assert meta.namespace.lookup(ROOT_INO, b"d") == meta.namespace.get(d.ino) == d
    assert meta.namespace.lookup(ROOT_INO, b"missing") is None
    assert meta.namespace.get(ROOT_INO).nlink == 3  # one subdirectory
    refused(errno.ENOENT, meta.namespace.get, 999_999)

    refused(errno.EEXIST, mkfile, meta, b"f")
    refused(errno.EEXIST, mkdir, meta, b"f")
    refused(errno.EEXIST, mkfile, meta, b"d")
    refused(errno.ENOTDIR, mkfile, meta, b"x", f.ino)
    refused(errno.ENOENT, mkfile, meta, b"x", 999_999)
    assert meta.namespace.get(ROOT_INO).nlink == 3 and meta.recency.usage().files == 1

    inner = mkfile(meta, b"f", d.ino)  # one name in two directories: two files
    assert inner.ino != f.ino and meta.namespace.lookup(d.ino, b"f") == inner

    link = meta.namespace.make(d.ino, b"link", stat.S_IFLNK | 0o777, UID, GID, target=b"../f")
    assert stat.S_ISLNK(link.mode) and link.size == 4
    assert meta.namespace.readlink(link.ino) == b"../f"
    refused(errno.EINVAL, meta.namespace.readlink, f.ino)
    refused(errno.EINVAL, meta.namespace.make, d.ino, b"l2", stat.S_IFLNK | 0o777, UID, GID,
            target=b"")
    refused(errno.ENAMETOOLONG, meta.namespace.make, d.ino, b"l2", stat.S_IFLNK | 0o777, UID, GID,
            target=b"t" * PATH_MAX)
    device = meta.namespace.make(d.ino, b"dev", stat.S_IFCHR | 0o600, UID, GID, rdev=0x0501)
    fifo = meta.namespace.make(d.ino, b"fifo", stat.S_IFIFO | 0o600, UID, GID, rdev=0x0501)
    assert (device.rdev, fifo.rdev) == (0x0501, 0)  # only devices keep a device number
    assert meta.recency.usage().files == 5  # every non-directory counts

    shared = meta.namespace.make(ROOT_INO, b"sgid", DIR | stat.S_ISGID, UID, 4242)
    sub = meta.namespace.make(shared.ino, b"sub", DIR, UID, GID)
    inherited = meta.namespace.make(shared.ino, b"file", FILE, UID, GID)
    assert (sub.gid, inherited.gid) == (4242, 4242)  # BSD groups under a setgid directory
    assert sub.mode & stat.S_ISGID and not inherited.mode & stat.S_ISGID


def test_names_up_to_name_max(meta: MetaStore) -> None:
    longest, too_long = b"n" * NAME_MAX, b"n" * (NAME_MAX + 1)
    f = mkfile(meta, longest)
    assert meta.namespace.lookup(ROOT_INO, longest) == f
    assert names_in(meta, ROOT_INO) == [longest]
    d = mkdir(meta, b"d" * NAME_MAX)
    refused(errno.ENAMETOOLONG, mkfile, meta, too_long)
    refused(errno.ENAMETOOLONG, mkdir, meta, too_long, d.ino)
    refused(errno.ENAMETOOLONG, meta.namespace.lookup, ROOT_INO, too_long)
    refused(errno.ENAMETOOLONG, meta.namespace.link, f.ino, d.ino, too_long)
    refused(errno.ENAMETOOLONG, meta.namespace.rename, ROOT_INO, longest, d.ino, too_long, 0)
    refused(errno.ENAMETOOLONG, meta.namespace.rename, ROOT_INO, too_long, d.ino, b"x", 0)
    refused(errno.ENAMETOOLONG, meta.namespace.remove, ROOT_INO, too_long, False)
    for bad in (b"", b".", b"..", b"a/b", b"a\0b"):
        refused(errno.EINVAL, mkfile, meta, bad)
    meta.namespace.link(f.ino, d.ino, longest)
    meta.namespace.rename(d.ino, longest, ROOT_INO, b"m" * NAME_MAX, 0)
    assert sorted(names_in(meta, ROOT_INO)) == [b"d" * NAME_MAX, b"m" * NAME_MAX, longest]
    assert meta.namespace.get(f.ino).nlink == 2


def test_readdir_order_and_resumption(meta: MetaStore) -> None:
    d = mkdir(meta, b"d")
    assert listing(meta, d.ino) == []
    made = [(mkdir if i % 3 == 0 else mkfile)(meta, f"e{i:02}".encode(), d.ino)
            for i in range(20)]
    full = listing(meta, d.ino)
    assert [(name, ino) for name, ino, _ in full] == [(i.name, i.ino) for i in made]
    cookies = [cookie for _, _, cookie in full]
    assert cookies == sorted(set(cookies)) and cookies[0] > 0
    for stop in (0, 1, 7, 19):  # resume after the entry at `stop`
        assert listing(meta, d.ino, cookies[stop]) == full[stop + 1:]
    assert listing(meta, d.ino, cookies[-1]) == []

    # Between two readdir calls: entries come and go; resumption neither repeats nor skips.
    paused = cookies[9]
    meta.namespace.remove(d.ino, b"e03", True)  # listed already
    meta.namespace.remove(d.ino, b"e11", False)  # still to come
    added = mkfile(meta, b"late", d.ino)
    rest = listing(meta, d.ino, paused)
    assert [name for name, _, _ in rest] == [f"e{i:02}".encode() for i in range(10, 20)
                                             if i != 11] + [b"late"]
    assert rest[-1][1] == added.ino and rest[-1][2] > cookies[-1]
    meta.namespace.remove(d.ino, b"e09", True)  # the very entry the listing paused at
    assert listing(meta, d.ino, paused) == rest

    # A renamed entry is a new entry: it comes last.
    meta.namespace.rename(d.ino, b"e00", d.ino, b"first-renamed", 0)
    assert names_in(meta, d.ino)[-1] == b"first-renamed"


def test_readdir_and_recency_past_batch_sizes(meta: MetaStore) -> None:
    """More entries than one readdir batch (128), one Redis scan page (512) and one touch
    transaction (256)."""
    d = mkdir(meta, b"many")
    count = 520
    made = [mkfile(meta, f"{i:04}".encode(), d.ino).ino for i in range(count)]
    full = listing(meta, d.ino)
    assert [ino for _, ino, _ in full] == made
    assert [name for name, _, _ in full] == [f"{i:04}".encode() for i in range(count)]
    assert listing(meta, d.ino, full[509][2]) == full[510:]
    assert listing(meta, d.ino, full[99][2])[:3] == full[100:103]

    base = time.time_ns() + 10**12
    # the newest made: the oldest use
    meta.recency.record_uses({ino: base + count - i for i, ino in enumerate(made)})
    order = [inode.ino for _, inode in meta.recency.least_recent(count)]
    assert order == made[::-1]
    first = meta.recency.least_recent(300)
    second = meta.recency.least_recent(300, after=first[-1][0])
    assert [i.ino for _, i in first] + [i.ino for _, i in second] == made[::-1]


# -- links and removal ----------------------------------------------------------------------


def link_records(meta: MetaStore) -> set[tuple[int, int, bytes]]:
    """(ino, parent, name) of every `links` record (inode by inode: a shared engine keeps
    each one's apart)."""
    found = set()
    with meta.engine.snapshot() as txn:
        for inode in meta.namespace.inodes():
            prefix = u64(inode.ino)
            for key, _ in txn.scan("links", prefix):
                if key[:8] != prefix:
                    break
                found.add((inode.ino, from_u64(key[8:16]), bytes(key[16:])))
    return found


def test_hard_links_and_nlink(meta: MetaStore) -> None:
    d = mkdir(meta, b"d")
    f = mkfile(meta, MODEL_NAME)
    blob = new_blob(meta, f.ino, 10_000)
    meta.content.commit_content(f.ino, blob)
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": blob.allocated}}

    linked = meta.namespace.link(f.ino, d.ino, b"plain")
    assert linked.nlink == 2 and meta.namespace.get(f.ino).nlink == 2
    assert meta.namespace.lookup(d.ino, b"plain").ino == f.ino
    assert meta.namespace.lookup(ROOT_INO, MODEL_NAME).ino == f.ino
    assert sorted(meta.namespace.names(f.ino)) == sorted([(ROOT_INO, MODEL_NAME),
                                                          (d.ino, b"plain")])
    assert (linked.parent, linked.name) == (ROOT_INO, MODEL_NAME)  # the first name stays primary
    usage = meta.recency.usage()
    assert usage.files == 1 and usage.used == blob.allocated  # counted once
    assert link_records(meta) == {(f.ino, ROOT_INO, MODEL_NAME), (f.ino, d.ino, b"plain")}
    meta.namespace.link(f.ino, ROOT_INO, b"third")
    assert meta.namespace.get(f.ino).nlink == 3

    refused(errno.EPERM, meta.namespace.link, d.ino, ROOT_INO, b"dirlink")
    refused(errno.EEXIST, meta.namespace.link, f.ino, d.ino, b"plain")
    refused(errno.ENOTDIR, meta.namespace.link, f.ino, f.ino, b"x")
    refused(errno.ENOENT, meta.namespace.link, 999_999, d.ino, b"x")
    refused(errno.ENOENT, meta.namespace.link, f.ino, 999_999, b"x")

    removed = meta.namespace.remove(ROOT_INO, MODEL_NAME, False)  # the primary name goes
    assert isinstance(removed, Removed) and not removed.gone
    assert removed.names == [(ROOT_INO, MODEL_NAME)] and removed.inode.nlink == 2
    after = meta.namespace.get(f.ino)
    assert after.nlink == 2 and (after.parent, after.name) in meta.namespace.names(f.ino)
    assert (after.parent, after.name) != (ROOT_INO, MODEL_NAME)
    assert meta.recency.models() == {}  # its primary name is no model's any more
    assert meta.namespace.lookup(ROOT_INO, MODEL_NAME) is None

    assert link_records(meta) == {(f.ino, ROOT_INO, b"third"), (f.ino, d.ino, b"plain")}
    assert not meta.namespace.remove(ROOT_INO, b"third", False).gone
    # one name left: `links` holds none (the inode record names it)
    assert link_records(meta) == set() and meta.namespace.names(f.ino) == [(d.ino, b"plain")]
    meta.namespace.rename(d.ino, b"plain", ROOT_INO, b"moved", 0)
    assert meta.namespace.names(f.ino) == [(ROOT_INO, b"moved")] and link_records(meta) == set()
    meta.namespace.link(f.ino, d.ino, b"again")
    assert link_records(meta) == {(f.ino, ROOT_INO, b"moved"), (f.ino, d.ino, b"again")}
    meta.namespace.rename(ROOT_INO, b"moved", d.ino, b"plain", 0)
    assert link_records(meta) == {(f.ino, d.ino, b"plain"), (f.ino, d.ino, b"again")}
    assert not meta.namespace.remove(d.ino, b"again", False).gone
    last = meta.namespace.remove(d.ino, b"plain", False)
    assert last.gone and last.inode.ino == f.ino and last.names == [(d.ino, b"plain")]
    refused(errno.ENOENT, meta.namespace.get, f.ino)
    assert blob.blob_id in meta.content.doomed() and meta.content.blob_info(blob.blob_id) is None
    assert meta.recency.usage().files == 0 and meta.recency.usage().used == 0


def test_remove_files_and_directories(meta: MetaStore) -> None:
    d = mkdir(meta, b"d")
    sub = mkdir(meta, b"sub", d.ino)
    f = mkfile(meta, b"f", d.ino)
    link = meta.namespace.make(ROOT_INO, b"sym", stat.S_IFLNK | 0o777, UID, GID, target=b"d/f")
    assert meta.namespace.get(d.ino).nlink == 3

    refused(errno.ENOTEMPTY, meta.namespace.remove, ROOT_INO, b"d", True)
    refused(errno.EISDIR, meta.namespace.remove, ROOT_INO, b"d", False)
    refused(errno.EISDIR, meta.namespace.remove, d.ino, b"sub", False)
    refused(errno.ENOTDIR, meta.namespace.remove, d.ino, b"f", True)
    refused(errno.ENOTDIR, meta.namespace.remove, ROOT_INO, b"sym", True)
    refused(errno.ENOENT, meta.namespace.remove, d.ino, b"missing", False)
    refused(errno.ENOENT, meta.namespace.remove, d.ino, b"missing", True)
    refused(errno.ENOTDIR, meta.namespace.remove, f.ino, b"x", False)
    refused(errno.ENOENT, meta.namespace.remove, 999_999, b"x", False)

    mtime = meta.namespace.get(d.ino).mtime_ns
    gone = meta.namespace.remove(d.ino, b"f", False)
    assert gone.gone and gone.inode.ino == f.ino and gone.names == [(d.ino, b"f")]
    assert meta.namespace.lookup(d.ino, b"f") is None
    refused(errno.ENOENT, meta.namespace.get, f.ino)
    assert meta.namespace.get(d.ino).mtime_ns >= mtime

    rmdir = meta.namespace.remove(d.ino, b"sub", True)
    assert rmdir.gone and rmdir.inode.ino == sub.ino
    assert meta.namespace.get(d.ino).nlink == 2
    refused(errno.ENOENT, meta.namespace.get, sub.ino)
    assert meta.namespace.remove(ROOT_INO, b"d", True).gone
    assert meta.namespace.get(ROOT_INO).nlink == 2

    assert meta.namespace.remove(ROOT_INO, b"sym", False).gone
    refused(errno.ENOENT, meta.namespace.readlink, link.ino)
    assert listing(meta, ROOT_INO) == [] and meta.recency.usage().files == 0


# -- rename ---------------------------------------------------------------------------------


def test_rename_plain(meta: MetaStore) -> None:
    a, b = mkdir(meta, b"a"), mkdir(meta, b"b")
    f = mkfile(meta, b"f", a.ino)
    moved, replaced = meta.namespace.rename(a.ino, b"f", a.ino, b"g", 0)
    assert replaced is None and moved.ino == f.ino and (moved.parent, moved.name) == (a.ino,
                                                                                      b"g")
    assert meta.namespace.lookup(a.ino, b"f") is None
    assert meta.namespace.lookup(a.ino, b"g").ino == f.ino

    moved, replaced = meta.namespace.rename(a.ino, b"g", b.ino, b"h", RENAME_NOREPLACE)
    assert replaced is None and (moved.parent, moved.name) == (b.ino, b"h")
    assert names_in(meta, a.ino) == [] and names_in(meta, b.ino) == [b"h"]
    assert meta.namespace.names(f.ino) == [(b.ino, b"h")]

    sub = mkdir(meta, b"sub", a.ino)
    meta.namespace.rename(a.ino, b"sub", b.ino, b"sub2", 0)  # a directory changes parents
    assert (meta.namespace.get(a.ino).nlink, meta.namespace.get(b.ino).nlink) == (2, 3)
    moved_dir = meta.namespace.get(sub.ino)
    assert (moved_dir.parent, moved_dir.name) == (b.ino, b"sub2")

    refused(errno.ENOENT, meta.namespace.rename, a.ino, b"missing", b.ino, b"x", 0)
    refused(errno.ENOENT, meta.namespace.rename, 999_999, b"h", b.ino, b"x", 0)
    refused(errno.ENOTDIR, meta.namespace.rename, b.ino, b"h", f.ino, b"x", 0)
    refused(errno.EINVAL, meta.namespace.rename, b.ino, b"h", a.ino, b"x", 4)
    refused(errno.EINVAL, meta.namespace.rename, b.ino, b"h", a.ino, b"x",
            RENAME_NOREPLACE | RENAME_EXCHANGE)
    assert meta.namespace.lookup(b.ino, b"h").ino == f.ino

    # Per-model usage follows the name: into a model, from one model to another, out of it.
    chunk = mkfile(meta, b"tmp", a.ino)
    blob = new_blob(meta, chunk.ino, 2 * BLOCK)
    meta.content.commit_content(chunk.ino, blob)
    assert meta.recency.models() == {}
    meta.namespace.rename(a.ino, b"tmp", b.ino, MODEL_NAME, 0)
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": 2 * BLOCK}}
    meta.namespace.rename(b.ino, MODEL_NAME, b.ino, b"qwen@1@0@beef@bf16.data", 0)
    assert meta.recency.models() == {"qwen": {"files": 1, "bytes": 2 * BLOCK}}
    meta.namespace.rename(b.ino, b"qwen@1@0@beef@bf16.data", a.ino, b"done", 0)
    assert meta.recency.models() == {}


def test_rename_over_an_existing_file(meta: MetaStore) -> None:
    d = mkdir(meta, b"d")
    src, dst = mkfile(meta, b"src"), mkfile(meta, b"dst", d.ino)
    src_blob, dst_blob = new_blob(meta, src.ino, 5000), new_blob(meta, dst.ino, 9000)
    meta.content.commit_content(src.ino, src_blob)
    meta.content.commit_content(dst.ino, dst_blob)

    moved, replaced = meta.namespace.rename(ROOT_INO, b"src", d.ino, b"dst", 0)
    assert moved.ino == src.ino and (moved.parent, moved.name) == (d.ino, b"dst")
    assert isinstance(replaced, Removed) and replaced.gone
    assert replaced.inode.ino == dst.ino and replaced.names == [(d.ino, b"dst")]
    assert replaced.inode.blob == dst_blob.blob_id
    refused(errno.ENOENT, meta.namespace.get, dst.ino)
    assert dst_blob.blob_id in meta.content.doomed()
    assert meta.content.blob_info(dst_blob.blob_id) is None
    assert meta.recency.usage().used == src_blob.allocated and meta.recency.usage().files == 1
    assert meta.content.get(src.ino)[1] == src_blob

    # A target with another name loses only this one.
    other = mkfile(meta, b"other")
    meta.namespace.link(other.ino, d.ino, b"other-link")
    _, replaced = meta.namespace.rename(d.ino, b"dst", ROOT_INO, b"other", 0)
    assert replaced is not None and not replaced.gone and replaced.inode.nlink == 1
    assert meta.namespace.names(other.ino) == [(d.ino, b"other-link")]
    assert meta.namespace.get(other.ino).name == b"other-link"

    # Onto another name of the same file: nothing happens (POSIX).
    meta.namespace.link(src.ino, d.ino, b"alias")
    moved, replaced = meta.namespace.rename(ROOT_INO, b"other", d.ino, b"alias", 0)
    assert replaced is None and moved.ino == src.ino
    assert sorted(meta.namespace.names(src.ino)) == sorted([(ROOT_INO, b"other"),
                                                            (d.ino, b"alias")])


def test_rename_noreplace_and_exchange(meta: MetaStore) -> None:
    a, b = mkdir(meta, b"a"), mkdir(meta, b"b")
    x, y = mkfile(meta, b"x", a.ino), mkfile(meta, b"y", b.ino)
    refused(errno.EEXIST, meta.namespace.rename, a.ino, b"x", b.ino, b"y", RENAME_NOREPLACE)
    assert meta.namespace.lookup(a.ino, b"x").ino == x.ino
    assert meta.namespace.lookup(b.ino, b"y").ino == y.ino

    moved, replaced = meta.namespace.rename(a.ino, b"x", b.ino, b"y", RENAME_EXCHANGE)
    assert replaced is None and moved.ino == x.ino
    assert meta.namespace.lookup(a.ino, b"x").ino == y.ino
    assert meta.namespace.lookup(b.ino, b"y").ino == x.ino
    assert (meta.namespace.get(x.ino).parent, meta.namespace.get(x.ino).name) == (b.ino, b"y")
    assert (meta.namespace.get(y.ino).parent, meta.namespace.get(y.ino).name) == (a.ino, b"x")
    refused(errno.ENOENT, meta.namespace.rename, a.ino, b"x", b.ino, b"missing", RENAME_EXCHANGE)

    # A directory and a file in two directories: the parents' link counts follow.
    sub = mkdir(meta, b"sub", a.ino)
    assert (meta.namespace.get(a.ino).nlink, meta.namespace.get(b.ino).nlink) == (3, 2)
    meta.namespace.rename(a.ino, b"sub", b.ino, b"y", RENAME_EXCHANGE)
    assert (meta.namespace.get(a.ino).nlink, meta.namespace.get(b.ino).nlink) == (2, 3)
    assert meta.namespace.lookup(b.ino, b"y").ino == sub.ino
    assert meta.namespace.lookup(a.ino, b"sub").ino == x.ino
    assert meta.namespace.get(sub.ino).parent == b.ino

    # In one directory: its link count stays.
    here = mkfile(meta, b"here", b.ino)
    meta.namespace.rename(b.ino, b"here", b.ino, b"y", RENAME_EXCHANGE)
    assert meta.namespace.get(b.ino).nlink == 3
    assert meta.namespace.lookup(b.ino, b"here").ino == sub.ino
    assert (meta.namespace.get(here.ino).name, meta.namespace.get(sub.ino).name) == (b"y", b"here")
    meta.namespace.rename(b.ino, b"here", b.ino, b"y", RENAME_EXCHANGE)  # and back

    # Two files of two models: each takes the other's name, and so its model.
    small, big = mkfile(meta, MODEL_NAME, a.ino), mkfile(meta, b"qwen@1@0@beef@bf16.data")
    meta.content.commit_content(small.ino, new_blob(meta, small.ino, BLOCK))
    meta.content.commit_content(big.ino, new_blob(meta, big.ino, 3 * BLOCK))
    meta.namespace.rename(a.ino, MODEL_NAME, ROOT_INO, b"qwen@1@0@beef@bf16.data", RENAME_EXCHANGE)
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": 3 * BLOCK},
                             "qwen": {"files": 1, "bytes": BLOCK}}

    # Never a directory with one of its own descendants.
    deep = mkdir(meta, b"deep", sub.ino)
    refused(errno.EINVAL, meta.namespace.rename, b.ino, b"y", sub.ino, b"deep", RENAME_EXCHANGE)
    refused(errno.EINVAL, meta.namespace.rename, sub.ino, b"deep", b.ino, b"y", RENAME_EXCHANGE)
    assert meta.namespace.get(deep.ino).parent == sub.ino


def test_rename_noreplace_onto_another_name_of_the_same_file(meta: MetaStore) -> None:
    f = mkfile(meta, b"a")
    meta.namespace.link(f.ino, ROOT_INO, b"b")
    try:
        refused(errno.EEXIST, meta.namespace.rename, ROOT_INO, b"a", ROOT_INO, b"b",
                RENAME_NOREPLACE)
    finally:  # the store is the same either way: the teardown's check holds
        assert sorted(meta.namespace.names(f.ino)) == [(ROOT_INO, b"a"), (ROOT_INO, b"b")]


def test_rename_directory_rules(meta: MetaStore) -> None:
    top = mkdir(meta, b"top")
    child = mkdir(meta, b"child", top.ino)
    grandchild = mkdir(meta, b"grandchild", child.ino)
    refused(errno.EINVAL, meta.namespace.rename, ROOT_INO, b"top", top.ino, b"x", 0)
    refused(errno.EINVAL, meta.namespace.rename, ROOT_INO, b"top", child.ino, b"x", 0)
    refused(errno.EINVAL, meta.namespace.rename, ROOT_INO, b"top", grandchild.ino, b"x", 0)
    refused(errno.EINVAL, meta.namespace.rename, top.ino, b"child", grandchild.ino, b"x", 0)

    full = mkdir(meta, b"full")
    mkfile(meta, b"f", full.ino)
    empty = mkdir(meta, b"empty")
    plain = mkfile(meta, b"plain")
    refused(errno.ENOTEMPTY, meta.namespace.rename, ROOT_INO, b"empty", ROOT_INO, b"full", 0)
    refused(errno.ENOTDIR, meta.namespace.rename, ROOT_INO, b"empty", ROOT_INO, b"plain", 0)
    refused(errno.EISDIR, meta.namespace.rename, ROOT_INO, b"plain", ROOT_INO, b"empty", 0)
    assert meta.namespace.lookup(ROOT_INO, b"full").ino == full.ino

    root_links = meta.namespace.get(ROOT_INO).nlink
    moved, replaced = meta.namespace.rename(top.ino, b"child", ROOT_INO, b"empty", 0)
    assert moved.ino == child.ino and replaced is not None and replaced.gone
    assert replaced.inode.ino == empty.ino
    refused(errno.ENOENT, meta.namespace.get, empty.ino)
    assert meta.namespace.get(ROOT_INO).nlink == root_links  # one directory gone, one come
    assert meta.namespace.get(top.ino).nlink == 2
    assert meta.namespace.lookup(ROOT_INO, b"empty").ino == child.ino
    assert meta.namespace.lookup(child.ino, b"grandchild").ino == grandchild.ino
    assert meta.namespace.get(plain.ino).nlink == 1


# -- content --------------------------------------------------------------------------------


def test_content_blobs_and_usage(meta: MetaStore) -> None:
    ids = meta.content.allocate_blob_ids(3)
    more = meta.content.allocate_blob_ids(2)
    assert len(ids) == 3 and len(more) == 2 and min(more) > max(ids) > 0

    f = mkfile(meta, MODEL_NAME)
    first = new_blob(meta, f.ino, 3 * BLOCK + 100)
    inode, old = meta.content.commit_content(f.ino, first)
    assert old == 0
    assert (inode.size, inode.allocated, inode.blob, inode.version) == (
        3 * BLOCK + 100, 4 * BLOCK, first.blob_id, 1)
    assert meta.content.get(f.ino) == (inode, first)
    assert meta.content.blob_info(first.blob_id) == first
    assert meta.content.is_committed_blob(first.blob_id)
    assert meta.recency.usage().used == 4 * BLOCK and meta.recency.usage().files == 1
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": 4 * BLOCK}}

    sparse = new_blob(meta, f.ino, 1 << 26, allocated=2 * BLOCK)  # many sums: compressed
    inode, old = meta.content.commit_content(f.ino, sparse)
    assert old == first.blob_id and inode.version == 2
    assert meta.content.blob_info(first.blob_id) is None and first.blob_id in meta.content.doomed()
    stored = meta.content.blob_info(sparse.blob_id)
    assert stored == sparse and len(stored.sums) == (1 << 26) // BLOCK
    assert meta.recency.usage().used == 2 * BLOCK
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": 2 * BLOCK}}

    inode, old = meta.content.commit_content(f.ino, None)  # truncated to nothing
    assert old == sparse.blob_id and (inode.size, inode.allocated, inode.blob) == (0, 0, 0)
    assert meta.content.get(f.ino) == (inode, None)
    assert meta.recency.usage().used == 0
    assert meta.recency.models() == {"llama": {"files": 1, "bytes": 0}}

    # A file removed while its blob was written: the commit fails, nothing is recorded.
    late = mkfile(meta, b"late")
    orphan = new_blob(meta, late.ino, BLOCK)
    meta.namespace.remove(ROOT_INO, b"late", False)
    refused(errno.ENOENT, meta.content.commit_content, late.ino, orphan)
    assert meta.content.blob_info(orphan.blob_id) is None and meta.recency.usage().used == 0

    # Kernel-written blobs: pending until their sums are taken.
    g = mkfile(meta, b"g")
    pending = new_blob(meta, g.ino, 2 * BLOCK, pending=True)
    meta.content.commit_content(g.ino, pending)
    assert meta.content.pending() == [(pending.blob_id, g.ino)]
    assert meta.content.blob_info(pending.blob_id).pending
    settled = meta.content.record_sums(pending.blob_id, array("Q", [7, 8]))
    assert settled is not None and not settled.pending and list(settled.sums) == [7, 8]
    assert meta.content.pending() == [] and meta.content.blob_info(pending.blob_id) == settled
    assert meta.content.record_sums(first.blob_id, array("Q")) is None  # replaced long ago
    assert meta.recency.usage().used == 2 * BLOCK


# -- attributes and xattrs ------------------------------------------------------------------


def test_set_attrs(meta: MetaStore) -> None:
    f = mkfile(meta, b"f")
    d = mkdir(meta, b"d")
    changed = meta.namespace.set_attrs(f.ino, mode=0o4750, uid=7, gid=8, atime_ns=111, mtime_ns=222)
    assert changed.mode == stat.S_IFREG | 0o4750 and (changed.uid, changed.gid) == (7, 8)
    assert (changed.atime_ns, changed.mtime_ns) == (111, 222) and changed.ctime_ns >= f.ctime_ns
    assert meta.namespace.get(f.ino) == changed
    assert meta.namespace.set_attrs(d.ino, mode=0o700).mode == stat.S_IFDIR | 0o700

    cleared = meta.namespace.set_attrs(f.ino, clear_mode=stat.S_ISUID | stat.S_ISGID)
    assert cleared.mode == stat.S_IFREG | 0o750
    assert meta.namespace.set_attrs(f.ino, clear_mode=stat.S_ISUID) == cleared  # nothing to clear
    refused(errno.ENOENT, meta.namespace.set_attrs, 999_999, mode=0o600)

    # An atime set by hand moves the file in the recency index.
    g = mkfile(meta, b"g")
    assert [inode.ino for _, inode in meta.recency.least_recent(2)] == [f.ino, g.ino]
    meta.namespace.set_attrs(f.ino, atime_ns=time.time_ns() + 10**12)
    assert [inode.ino for _, inode in meta.recency.least_recent(2)] == [g.ino, f.ino]


def test_xattrs_and_pins(meta: MetaStore) -> None:
    f = mkfile(meta, b"f")
    d = mkdir(meta, b"d")
    assert meta.namespace.listxattr(f.ino) == []
    refused(errno.ENODATA, meta.namespace.getxattr, f.ino, b"user.missing")
    refused(errno.ENODATA, meta.namespace.removexattr, f.ino, b"user.missing")

    meta.namespace.setxattr(f.ino, b"user.b", b"2")
    meta.namespace.setxattr(f.ino, b"user.a", b"1")
    meta.namespace.setxattr(f.ino, b"user.empty", b"")
    meta.namespace.setxattr(f.ino, b"user.a", b"one")  # replaced
    assert meta.namespace.getxattr(f.ino, b"user.a") == b"one"
    assert meta.namespace.getxattr(f.ino, b"user.empty") == b""
    assert meta.namespace.listxattr(f.ino) == [b"user.a", b"user.b", b"user.empty"]
    meta.namespace.removexattr(f.ino, b"user.b")
    assert meta.namespace.listxattr(f.ino) == [b"user.a", b"user.empty"]
    refused(errno.ENODATA, meta.namespace.getxattr, f.ino, b"user.b")

    meta.namespace.setxattr(d.ino, b"user.big", b"v" * XATTR_VALUE_MAX)
    assert meta.namespace.getxattr(d.ino, b"user.big") == b"v" * XATTR_VALUE_MAX
    refused(errno.E2BIG, meta.namespace.setxattr, d.ino, b"user.bigger",
            b"v" * (XATTR_VALUE_MAX + 1))
    refused(errno.ERANGE, meta.namespace.setxattr, d.ino, b"", b"v")
    refused(errno.ERANGE, meta.namespace.setxattr, d.ino, b"u" * (NAME_MAX + 1), b"v")
    for call in (meta.namespace.listxattr, lambda ino: meta.namespace.getxattr(ino, b"user.a"),
                 lambda ino: meta.namespace.setxattr(ino, b"user.a", b"x"),
                 lambda ino: meta.namespace.removexattr(ino, b"user.a")):
        refused(errno.ENOENT, call, 999_999)

    assert meta.recency.pinned() == set()
    meta.namespace.setxattr(f.ino, PIN_XATTR, b"1")
    meta.namespace.setxattr(d.ino, PIN_XATTR, b"1")
    assert meta.recency.pinned() == {f.ino, d.ino}
    meta.namespace.removexattr(d.ino, PIN_XATTR)
    assert meta.recency.pinned() == {f.ino}

    meta.namespace.remove(ROOT_INO, b"f", False)  # its xattrs and its pin go with it
    assert meta.recency.pinned() == set()
    refused(errno.ENOENT, meta.namespace.listxattr, f.ino)
    again = mkfile(meta, b"f")
    assert meta.namespace.listxattr(again.ino) == []


# -- recency, eviction, doomed blobs --------------------------------------------------------


def test_recency_touch_and_least_recent(meta: MetaStore) -> None:
    a, b, c = mkfile(meta, b"a"), mkfile(meta, b"b"), mkfile(meta, b"c")
    mkdir(meta, b"dir")  # directories are never in the index
    assert [inode.ino for _, inode in meta.recency.least_recent(10)] == [a.ino, b.ino, c.ino]

    base = time.time_ns() + 10**12
    meta.recency.record_uses({a.ino: base + 3, b.ino: base + 1, c.ino: base + 2, 999_999: base})
    found = meta.recency.least_recent(10)
    assert [inode.ino for _, inode in found] == [b.ino, c.ino, a.ino]
    assert [inode.atime_ns for _, inode in found] == [base + 1, base + 2, base + 3]

    meta.recency.record_uses({a.ino: base})  # an older use changes nothing
    assert meta.namespace.get(a.ino).atime_ns == base + 3
    first = meta.recency.least_recent(2)
    assert [inode.ino for _, inode in first] == [b.ino, c.ino]
    assert [inode.ino for _, inode in meta.recency.least_recent(2, after=first[-1][0])] == [a.ino]
    assert meta.recency.least_recent(2, after=found[-1][0]) == []

    meta.content.commit_content(a.ino, new_blob(meta, a.ino, 100))  # a write is a use, now
    assert [inode.ino for _, inode in meta.recency.least_recent(10)] == [a.ino, b.ino, c.ino]
    meta.namespace.remove(ROOT_INO, b"b", False)
    assert [inode.ino for _, inode in meta.recency.least_recent(10)] == [a.ino, c.ino]
    late = mkfile(meta, b"late")
    assert [inode.ino for _, inode in meta.recency.least_recent(10)] == [a.ino, late.ino, c.ino]


def test_drop_files_holds_and_doomed_blobs(meta: MetaStore) -> None:
    d, e = mkdir(meta, b"d"), mkdir(meta, b"e")
    x, y, z = mkfile(meta, b"x", d.ino), mkfile(meta, MODEL_NAME, d.ino), mkfile(meta, b"z")
    meta.namespace.link(x.ino, e.ino, b"x2")
    x_blob, y_blob = new_blob(meta, x.ino, 8192), new_blob(meta, y.ino, 100)
    meta.content.commit_content(x.ino, x_blob)
    meta.content.commit_content(y.ino, y_blob)
    session = session_id(meta)
    meta.pool.hold(y_blob.blob_id, session)
    assert meta.pool.holders(y_blob.blob_id) == [session]

    dropped = meta.content.drop_files([x.ino, y.ino, z.ino, 999_999, x.ino], spare_held=True)
    assert [removed.inode.ino for removed in dropped] == [x.ino, z.ino]  # y is held open
    assert all(removed.gone for removed in dropped)
    assert sorted(dropped[0].names) == sorted([(d.ino, b"x"), (e.ino, b"x2")])
    assert dropped[1].names == [(ROOT_INO, b"z")]
    assert names_in(meta, d.ino) == [MODEL_NAME] and names_in(meta, e.ino) == []
    for ino in (x.ino, z.ino):
        refused(errno.ENOENT, meta.namespace.get, ino)
    assert meta.recency.usage().files == 1 and meta.recency.usage().used == y_blob.allocated

    meta.pool.release(y_blob.blob_id, session)
    assert meta.pool.holders(y_blob.blob_id) == []
    meta.pool.hold(y_blob.blob_id, session)  # without spare_held, held files go too
    (removed,) = meta.content.drop_files([y.ino])
    assert removed.inode.ino == y.ino and removed.gone and removed.names == [(d.ino, MODEL_NAME)]
    usage = meta.recency.usage()
    assert usage.files == 0 and usage.used == 0 and meta.recency.models() == {}
    assert meta.content.drop_files([y.ino]) == []

    doomed = meta.content.doomed()
    assert sorted(doomed) == sorted([x_blob.blob_id, y_blob.blob_id])
    meta.content.reaped(doomed[:1])
    assert meta.content.doomed() == doomed[1:]
    meta.content.reaped([])
    meta.content.reaped(doomed)
    assert meta.content.doomed() == []
    meta.pool.release(y_blob.blob_id, session)


def test_holds_recorded_by_commits_and_opens_read_in_the_same_change(meta: MetaStore
                                                                      ) -> None:
    """A writer's commit records its hold of the new blob; an open reads the inode and its
    blob in the change that records its hold of that blob (nothing recorded where the file
    is gone); releases of several blobs go in one change."""
    f, g = mkfile(meta, b"f"), mkfile(meta, b"g")
    session = session_id(meta)
    f_blob, g_blob = new_blob(meta, f.ino, 100), new_blob(meta, g.ino, 200)
    committed, _ = meta.content.commit_content(f.ino, f_blob, session)
    meta.content.commit_content(g.ino, g_blob)
    assert meta.pool.holders(f_blob.blob_id) == [session]
    assert meta.pool.holders(g_blob.blob_id) == []

    inode, blob = meta.content.get_held(g.ino, session)
    assert (inode, blob) == meta.content.get(g.ino) and blob is not None
    assert blob.blob_id == g_blob.blob_id and meta.pool.holders(g_blob.blob_id) == [session]
    meta.pool.release_many([f_blob.blob_id, g_blob.blob_id], session)
    assert meta.pool.holders(f_blob.blob_id) == meta.pool.holders(g_blob.blob_id) == []

    meta.namespace.remove(ROOT_INO, b"g", is_dir=False)
    refused(errno.ENOENT, meta.content.get_held, g.ino, session)
    assert meta.pool.holders(g_blob.blob_id) == []
    empty = mkfile(meta, b"empty")
    assert meta.content.get_held(empty.ino, session) == (meta.namespace.get(empty.ino), None)
    assert committed.blob == f_blob.blob_id


def test_reopen_keeps_everything(backend: Backend) -> None:
    meta = backend.open()
    d = mkdir(meta, b"d")
    f = mkfile(meta, MODEL_NAME, d.ino)
    blob = new_blob(meta, f.ino, 5 * BLOCK)
    meta.content.commit_content(f.ino, blob)
    meta.namespace.setxattr(f.ino, PIN_XATTR, b"1")
    meta.namespace.link(f.ino, ROOT_INO, b"alias")
    inodes, usage = sorted(meta.namespace.inodes(), key=lambda i: i.ino), meta.recency.usage()
    backend.close(meta)

    meta = backend.open()  # the format is found, not made again
    assert sorted(meta.namespace.inodes(), key=lambda i: i.ino) == inodes
    assert meta.recency.usage() == usage
    assert meta.content.get(f.ino)[1] == blob and meta.recency.pinned() == {f.ino}
    assert meta.namespace.lookup(ROOT_INO, b"alias").ino == f.ino
    assert mkfile(meta, b"new").ino > max(i.ino for i in inodes)  # ids never come back
    assert min(meta.content.allocate_blob_ids(1)) > blob.blob_id


def test_a_kvfs_3_store_gets_entry_types_at_open(backend: Backend) -> None:
    """kvfs-3 listing entries held the child's inode number and name alone: the open that
    finds that format adds each entry's type (readdir without attributes reads no inode)."""
    meta = backend.open()
    d = mkdir(meta, b"d")
    mkfile(meta, b"f", d.ino)
    meta.namespace.make(d.ino, b"s", stat.S_IFLNK | 0o777, UID, GID, target=b"f")
    made = listing(meta, d.ino)

    def as_kvfs_3(txn: Txn) -> None:
        for parent in (ROOT_INO, d.ino):
            for key, value in list(txn.scan("dirlist", u64(parent))):
                if key[:8] == u64(parent):
                    txn.put("dirlist", key, bytes(value[:8]) + bytes(value[9:]))
        txn.put("settings", b"format", b"kvfs-3")
    meta.engine.change(as_kvfs_3)
    backend.close(meta)

    meta = backend.open()
    assert listing(meta, d.ino) == made
    assert [(name, file_type) for name, _, file_type, _ in
            meta.namespace.readdir_types_page(d.ino, 0, 10)] == [(b"f", stat.S_IFREG),
                                                                 (b"s", stat.S_IFLNK)]


def test_a_kvfs_4_store_keeps_only_hard_links_in_links(backend: Backend) -> None:
    """kvfs-4 kept every name in `links`: the open that finds that format removes the
    records of files with one name and of directories; hard-linked files keep theirs."""
    meta = backend.open()
    d = mkdir(meta, b"d")
    single = mkfile(meta, b"single", d.ino)
    linked = mkfile(meta, b"linked", d.ino)
    meta.namespace.link(linked.ino, ROOT_INO, b"other")
    kept = link_records(meta)
    assert kept == {(linked.ino, d.ino, b"linked"), (linked.ino, ROOT_INO, b"other")}

    def as_kvfs_4(txn: Txn) -> None:
        for inode in (d, single):
            txn.put("links", u64(inode.ino) + u64(inode.parent) + inode.name, b"")
        txn.put("settings", b"format", b"kvfs-4")
    meta.engine.change(as_kvfs_4)
    assert len(link_records(meta)) == 4
    backend.close(meta)

    meta = backend.open()
    assert link_records(meta) == kept
    assert meta.namespace.names(single.ino) == [(d.ino, b"single")]
    assert sorted(meta.namespace.names(linked.ino)) == sorted([(d.ino, b"linked"),
                                                               (ROOT_INO, b"other")])
    meta.namespace.rename(d.ino, b"single", ROOT_INO, b"single", 0)
    assert meta.namespace.names(single.ino) == [(ROOT_INO, b"single")]
    assert link_records(meta) == kept


# -- concurrency ----------------------------------------------------------------------------


def change_concurrently(stores: list[MetaStore], parent: int, threads: int, files: int,
                        churn: int) -> list[int]:
    """`threads` threads per store each make `files` files in `parent` (model names), then
    rename `churn` of them (no longer model names) and remove `churn` others; returns the
    inode numbers made."""
    made: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(meta: MetaStore, worker: str) -> None:
        try:
            mine = [meta.namespace.make(parent, f"m@1@0@{worker}-{i}@bf16.data".encode(), FILE, UID,
                              GID).ino for i in range(files)]
            for i in range(0, 2 * churn, 2):
                meta.namespace.rename(parent, f"m@1@0@{worker}-{i}@bf16.data".encode(), parent,
                            f"renamed-{worker}-{i}".encode(), RENAME_NOREPLACE)
                meta.namespace.remove(parent, f"m@1@0@{worker}-{i + 1}@bf16.data".encode(), False)
            with lock:
                made.extend(mine)
        except BaseException as error:  # reported by the test's thread
            errors.append(error)

    workers = [threading.Thread(target=work, args=(meta, f"{host}.{thread}"))
               for host, meta in enumerate(stores) for thread in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, errors
    return made


def check_concurrent_outcome(meta: MetaStore, parent: int, made: list[int], workers: int,
                             files: int, churn: int) -> None:
    total, kept = workers * files, workers * (files - churn)
    assert len(made) == total and len(set(made)) == total, "an inode number given twice"
    entries = listing(meta, parent)
    assert len(entries) == kept and len({ino for _, ino, _ in entries}) == kept
    assert {ino for _, ino, _ in entries} <= set(made)
    renamed = sum(name.startswith(b"renamed-") for name, _, _ in entries)
    assert renamed == workers * churn
    assert meta.recency.usage().files == kept
    assert meta.recency.models() == {"m": {"files": kept - renamed, "bytes": 0}}
    assert meta.namespace.get(parent).nlink == 2


def test_concurrent_namespace_changes_on_one_host(meta: MetaStore) -> None:
    d = mkdir(meta, b"busy")
    made = change_concurrently([meta], d.ino, threads=4, files=60, churn=15)
    check_concurrent_outcome(meta, d.ino, made, workers=4, files=60, churn=15)


# -- a shared pool: several hosts (Redis only) -----------------------------------------------


def test_two_hosts_see_each_others_changes(pool: tuple[MetaStore, MetaStore]) -> None:
    one, two = pool
    d = mkdir(one, b"d")
    f = mkfile(one, b"f", d.ino)
    assert two.namespace.lookup(ROOT_INO, b"d") == one.namespace.get(d.ino)
    assert two.namespace.lookup(d.ino, b"f") == f
    assert [name for name, _, _ in listing(two, d.ino)] == [b"f"]

    moved, _ = two.namespace.rename(d.ino, b"f", ROOT_INO, b"g", 0)
    assert one.namespace.lookup(d.ino, b"f") is None
    assert one.namespace.lookup(ROOT_INO, b"g") == moved
    blob = new_blob(two, f.ino, 3 * BLOCK)
    two.content.commit_content(f.ino, blob)
    assert one.content.get(f.ino) == two.content.get(f.ino) and one.content.get(f.ino)[1] == blob
    one.namespace.setxattr(f.ino, b"user.k", b"v")
    assert two.namespace.getxattr(f.ino, b"user.k") == b"v"

    refused(errno.EEXIST, mkfile, two, b"g")  # made by the other host
    other = mkfile(two, b"h")
    assert other.ino not in (d.ino, f.ino)  # each host's id stock is its own
    assert one.recency.usage() == two.recency.usage() and one.recency.usage().files == 2

    assert one.namespace.remove(ROOT_INO, b"g", False).gone
    assert two.namespace.lookup(ROOT_INO, b"g") is None
    refused(errno.ENOENT, two.namespace.get, f.ino)
    assert blob.blob_id in two.content.doomed()
    mkfile(one, b"inner", d.ino)
    refused(errno.ENOTEMPTY, two.namespace.remove, ROOT_INO, b"d", True)
    two.namespace.remove(d.ino, b"inner", False)
    assert two.namespace.remove(ROOT_INO, b"d", True).gone
    assert one.namespace.lookup(ROOT_INO, b"d") is None and one.namespace.get(ROOT_INO).nlink == 2


def test_concurrent_creates_from_two_hosts(pool: tuple[MetaStore, MetaStore]) -> None:
    one, two = pool
    d = mkdir(one, b"busy")
    made = change_concurrently([one, two], d.ino, threads=4, files=100, churn=5)
    check_concurrent_outcome(two, d.ino, made, workers=8, files=100, churn=5)
    assert one.recency.usage() == two.recency.usage()


def test_changes_that_read_a_record_another_host_changed_run_again(
        pool: tuple[MetaStore, MetaStore]) -> None:
    """Read-modify-write of one record from two hosts, 4 threads each: no update is lost
    (each commit checks that what its change read is still there)."""
    engines = [store.engine for store in pool]

    def bump(txn: Txn) -> None:
        held = txn.get("settings", b"bumps")
        txn.put("settings", b"bumps", str(int(held or b"0") + 1).encode())

    def worker(engine: Engine) -> None:
        for _ in range(50):
            engine.change(bump)

    threads = [threading.Thread(target=worker, args=(engine,)) for engine in engines * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with engines[0].snapshot() as txn:
        assert txn.get("settings", b"bumps") == b"400"
    assert sum(engine.conflicts for engine in engines) > 0  # they did collide


def test_a_change_made_from_a_stale_cache_runs_again(pool: tuple[MetaStore, MetaStore]) -> None:
    """A host's cache of names and attributes, which its changes read, may trail another
    host's change until its announcement arrives (here none ever does). A change made from
    it is checked at commit and runs again from Redis, so it never acts on a stale name or
    loses another host's update; reads outside changes never use it."""
    one, two = pool
    if one.engine.watching():
        pytest.skip("needs a host that is not told of the other's changes")
    one.engine.cache.enable(True)  # caching, and deaf to the other host
    file = mkfile(one, b"f")
    assert one.namespace.lookup(ROOT_INO, b"x") is None  # (kept in the cache)
    made = mkfile(two, b"x")
    conflicts = one.engine.conflicts
    refused(errno.EEXIST, mkfile, one, b"x")
    assert one.engine.conflicts == conflicts + 1, "it read the stale entry and root first"
    assert one.namespace.lookup(ROOT_INO, b"x") == made

    assert one.namespace.get(file.ino).mode & 0o777 == 0o644
    two.namespace.set_attrs(file.ino, mode=0o600)
    changed = one.namespace.set_attrs(file.ino, uid=7)
    assert changed.mode & 0o777 == 0o600 and changed.uid == 7
    assert two.namespace.get(file.ino) == changed


def test_cached_reads_come_from_memory_pushed_by_the_host_that_changed_them(
        pool: tuple[MetaStore, MetaStore]) -> None:
    """The kernel's lookups and getattrs (`cached` reads) are served from memory
    (`from_memory`, where the daemon's loop tries them) with what other hosts announce as
    they commit, and what this host read itself is dropped when another host changes it."""
    one, two = pool
    if not two.engine.watching():
        pytest.skip("only an engine told of other hosts' changes caches")

    made = mkfile(one, b"x")
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.lookup(ROOT_INO, b"x", True))
                    == made)
    assert from_memory(two, lambda: two.namespace.get(made.ino, True)) == made
    uncached = from_memory(two, lambda: two.namespace.get(made.ino))
    assert uncached is RoundTripNeeded  # not cached: Redis
    changed = one.namespace.set_attrs(made.ino, mode=0o600)
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.get(made.ino, True)) == changed)
    one.namespace.remove(ROOT_INO, b"x", False)
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.lookup(ROOT_INO, b"x", True))
                    is None)

    def read_and_kept() -> bool:  # (a read that raced any change of its bucket is not kept)
        assert two.namespace.lookup(ROOT_INO, b"y", True) is None
        return from_memory(two, lambda: two.namespace.lookup(ROOT_INO, b"y", True)) is None
    assert wait_for(read_and_kept)
    other = mkfile(one, b"y")
    # (what this host read itself cannot be ordered against an announcement: dropped)
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.lookup(ROOT_INO, b"y", True))
                    in (RoundTripNeeded, other))
    assert two.namespace.lookup(ROOT_INO, b"y", True) == other


def test_a_directory_this_host_made_answers_its_missing_names_from_memory(
        pool: tuple[MetaStore, MetaStore]) -> None:
    """A directory made here starts complete in the cache: a lookup of a name it lacks (a
    store's new names) needs no round trip, whatever other hosts add or remove there later;
    a directory another host made does not (this host cannot know all of its names)."""
    one, two = pool
    if not two.engine.watching():
        pytest.skip("only an engine told of other hosts' changes caches")

    mine, theirs = mkdir(two, b"mine"), mkdir(one, b"theirs")
    assert from_memory(two, lambda: two.namespace.lookup(mine.ino, b"new", True)) is None
    assert from_memory(two, lambda: two.namespace.lookup(theirs.ino, b"new", True)) \
        is RoundTripNeeded
    made = mkfile(one, b"new", mine.ino)  # another host's, announced
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.lookup(mine.ino, b"new", True))
                    == made)
    assert from_memory(two, lambda: two.namespace.lookup(mine.ino, b"other", True)) is None
    refused(errno.EEXIST, two.namespace.make, mine.ino, b"new", FILE, UID, GID)  # (no stale miss)
    one.namespace.remove(mine.ino, b"new", False)
    assert wait_for(lambda: from_memory(two, lambda: two.namespace.lookup(mine.ino, b"new", True))
                    is None)
    again = mkfile(two, b"new", mine.ino)
    assert from_memory(two, lambda: two.namespace.lookup(mine.ino, b"new", True)) == again
    assert one.namespace.lookup(mine.ino, b"new") == again


def on_loop(meta: MetaStore, change: Callable[[], object],
            before: Callable[[], object] = lambda: None) -> object:
    """What `change` gives when the daemon's loop commits it (`change_on_loop`), or
    RoundTripNeeded; `before` runs first, in the same trio run."""
    engine = meta.engine
    assert isinstance(engine, RedisEngine)

    async def run() -> object:
        before()
        try:
            return await engine.change_on_loop(change)
        except RoundTripNeeded:
            return RoundTripNeeded
    return trio.run(run)


def test_a_change_whose_reads_the_cache_holds_commits_from_the_loop(
        pool: tuple[MetaStore, MetaStore]) -> None:
    """A create or rename whose every read the cache answers commits from the loop; one that
    needs a round trip, fails, or meets another host's change is left to a worker, so that
    a name is made once whoever races for it."""
    one, two = pool
    if not two.engine.watching():
        pytest.skip("only an engine told of other hosts' changes caches")
    engine = two.engine
    assert isinstance(engine, RedisEngine)
    mine, theirs = mkdir(two, b"mine"), mkdir(one, b"theirs")
    committed = engine.loop_commits
    made = on_loop(two, lambda: two.namespace.make(mine.ino, b"a", FILE, UID, GID))
    assert isinstance(made, Inode) and one.namespace.lookup(mine.ino, b"a") == made
    on_loop(two, lambda: two.namespace.rename(mine.ino, b"a", mine.ino, b"b", 0))
    assert one.namespace.lookup(mine.ino, b"a") is None
    assert one.namespace.lookup(mine.ino, b"b") == made._replace(
        name=b"b", ctime_ns=one.namespace.get(made.ino).ctime_ns)
    assert engine.loop_commits == committed + 2
    # A directory another host made: its names are not all in this host's cache.
    assert on_loop(two, lambda: two.namespace.make(theirs.ino, b"x", FILE, UID, GID)) \
        is RoundTripNeeded
    assert one.namespace.lookup(theirs.ino, b"x") is None  # (nothing was committed)
    # An error is the answer only once a worker has checked the view it came from.
    assert on_loop(two, lambda: two.namespace.make(mine.ino, b"b", FILE, UID, GID)) \
        is RoundTripNeeded
    # Another host makes the name just before: the loop's change either sees it (EEXIST)
    # or commits against a stale miss and is refused (a conflict); a worker then answers.
    for n in range(20):
        name = b"race-%d" % n
        outcome = on_loop(two, functools.partial(two.namespace.make, mine.ino, name, FILE, UID,
                                                 GID),
                          before=functools.partial(mkfile, one, name, mine.ino))
        assert outcome is RoundTripNeeded
        refused(errno.EEXIST, two.namespace.make, mine.ino, name, FILE, UID, GID)
        theirs_made = one.namespace.lookup(mine.ino, name)
        assert theirs_made is not None and two.namespace.lookup(mine.ino, name) == theirs_made
        assert theirs_made.uid == UID and one.namespace.get(theirs_made.ino).nlink == 1
    assert sorted(name for name, _, _ in listing(one, mine.ino)) == sorted(
        [b"b", *(b"race-%d" % n for n in range(20))])
    assert engine.loop_commits == committed + 2  # (here 5–10 of the 20 met a conflict)


def test_each_host_is_told_of_the_names_and_inodes_others_change(
        pool: tuple[MetaStore, MetaStore]) -> None:
    one, two = pool
    if one.engine.watching():
        pytest.skip("its engines already watch, for their caches (one watcher each)")
    told: dict[str, list[tuple[str, bytes]]] = {"one": [], "two": []}
    one.engine.watch(lambda family, key: told["one"].append((family, key)))
    two.engine.watch(lambda family, key: told["two"].append((family, key)))
    assert wait_for(lambda: one.engine.watching() and two.engine.watching())
    made = mkfile(one, b"told")
    assert wait_for(lambda: ("dentry", u64(ROOT_INO) + b"told") in told["two"])
    assert ("inode", u64(made.ino)) in told["two"]
    assert told["one"] == []  # its own kernel saw it
    two.namespace.rename(ROOT_INO, b"told", ROOT_INO, b"renamed", 0)
    assert wait_for(lambda: ("dentry", u64(ROOT_INO) + b"renamed") in told["one"])
    assert ("dentry", u64(ROOT_INO) + b"told") in told["one"]


def test_holds_and_sessions_across_hosts(pool: tuple[MetaStore, MetaStore]) -> None:
    one, two = pool
    first, second = session_id(one), session_id(two)
    assert first != second
    one.pool.register_session(first, b'{"host": "one"}')
    two.pool.register_session(second, b'{"host": "two"}')
    assert one.pool.sessions() == two.pool.sessions() == {first: b'{"host": "one"}',
                                                second: b'{"host": "two"}'}

    f = mkfile(one, b"f")
    blob = new_blob(one, f.ino, BLOCK)
    one.content.commit_content(f.ino, blob)
    one.pool.hold(blob.blob_id, first)
    two.pool.hold(blob.blob_id, second)
    both = sorted([first, second])
    assert one.pool.holders(blob.blob_id) == two.pool.holders(blob.blob_id) == both
    assert two.content.drop_files([f.ino], spare_held=True) == []  # open on a host: never evicted
    assert one.pool.holders(0) == []

    one.pool.release(blob.blob_id, first)
    assert two.pool.holders(blob.blob_id) == [second]
    one.pool.hold(blob.blob_id, first)
    assert one.pool.end_session(second)  # a host ends another's session: its holds go with it
    assert two.pool.holders(blob.blob_id) == [first]
    assert not two.pool.end_session(second)  # already gone
    assert two.pool.sessions() == {first: b'{"host": "one"}'}

    one.engine.beat(first, 30)
    assert two.engine.alive(first) and not two.engine.alive(second)

    assert one.pool.end_session(first)
    assert one.pool.sessions() == {} and two.pool.holders(blob.blob_id) == []
    (removed,) = two.content.drop_files([f.ino], spare_held=True)
    assert removed.gone and blob.blob_id in one.content.doomed()


# -- the embedded engine's change log --------------------------------------------------------

LOG_WRITER = """
import os, stat, sys
from pathlib import Path
from kvfs.engines.lmdb_engine import LmdbEngine
from kvfs.meta import DEFAULT_MAP_SIZE, FAMILIES, ROOT_INO, MetaStore
meta = MetaStore(LmdbEngine(Path(sys.argv[1]), FAMILIES, DEFAULT_MAP_SIZE))
meta.engine.sync()  # (the format record)
for number in range(int(sys.argv[2])):
    meta.namespace.make(ROOT_INO, b"f%d" % number, stat.S_IFREG | 0o644, 0, 0)
meta.namespace.rename(ROOT_INO, b"f0", ROOT_INO, b"renamed", 0)
os.kill(os.getpid(), 9)  # answered, and no close: as a daemon killed at that moment
"""


def changes_in_log(path: Path) -> int:
    return sum(1 for _ in ChangeLog(host_files(path, readonly=True)).replay(0))


def log_segments(path: Path) -> list[Path]:
    """The change log's segments of the environment at `path` (in the runtime directory)."""
    return sorted(host_files(path, readonly=True)[0].glob("changes-*.log"))


def last_record(segment: bytes) -> tuple[int, int]:
    """(start, end) of a change log segment's last record (its unused rest is zeros)."""
    start = at = 0
    while at + _HEADER.size <= len(segment):
        magic, _, length, _ = _HEADER.unpack_from(segment, at)
        if magic != MAGIC:
            break
        start, at = at, at + _HEADER.size + length
    return start, at


def lmdb_applied(path: Path) -> int:
    """The last change LMDB itself holds."""
    env = lmdb.open(str(path), readonly=True, max_dbs=32, lock=False)
    try:
        with env.begin() as txn:
            raw = txn.get(APPLIED_KEY, db=env.open_db(b"settings", txn=txn, create=False))
        return int(raw) if raw else 0
    finally:
        env.close()


def kill_log_writer(path: Path, files: int) -> None:
    """LOG_WRITER in a process of its own, killed (-9) once it made `files` files and renamed
    the first."""
    result = subprocess.run([sys.executable, "-c", LOG_WRITER, str(path), str(files)],
                            cwd=Path(__file__).parent.parent, capture_output=True, text=True)
    assert result.returncode == -9, result.stderr


def assert_every_answered_change_back(path: Path) -> None:
    """The store a killed LOG_WRITER of 300 files leaves holds every change it answered."""
    meta = MetaStore(LmdbEngine(path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        names = {name for name, _, _ in meta.namespace.readdir_page(ROOT_INO, 0, 1000)}
        assert names == {b"f%d" % n for n in range(1, 300)} | {b"renamed"}
        assert meta.recency.usage().files == 300
        check_store(meta)
    finally:
        meta.close()


def test_answered_changes_survive_a_killed_process(tmp_path: Path) -> None:
    """Every change answered before a kill -9 is there after the next open: those LMDB did
    not hold yet come back from the change log, which is then emptied."""
    kill_log_writer(tmp_path, 300)
    assert lmdb_applied(tmp_path) < changes_in_log(tmp_path)  # the last ones: only in the log
    assert_every_answered_change_back(tmp_path)
    assert log_segments(tmp_path) == []  # a clean close leaves no log


@pytest.mark.parametrize("first", ["on the volume", "in another runtime directory"])
def test_a_log_kept_elsewhere_by_the_killed_process_is_replayed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str) -> None:
    """The killed process kept its change log on the volume (its runtime directory could not
    be made) or in another runtime directory: the next open, in this one, replays it all."""
    volume = tmp_path / "meta"
    monkeypatch.setenv("KVFS_RUNTIME_DIR", str(
        Path("/proc/no-such-runtime") if first == "on the volume" else tmp_path / "runtime-1"))
    kill_log_writer(volume, 300)
    kept = list(volume.glob("changes-*.log")) if first == "on the volume" \
        else list((tmp_path / "runtime-1").glob("volumes/*/changes-*.log"))
    assert kept and lmdb_applied(volume) < changes_in_log(volume)
    monkeypatch.setenv("KVFS_RUNTIME_DIR", str(tmp_path / "runtime-2"))
    assert_every_answered_change_back(volume)
    assert log_segments(volume) == [] and not any(path.exists() for path in kept)
    assert (volume / "lock.mdb").readlink().parent.parent.parent == tmp_path / "runtime-2"


def entries_payload(writes: dict[str, dict[bytes, list]]) -> bytes:
    """A change's writes in the change log's entries format (`MAGIC_ENTRIES`), as
    kvfs/engines/changelog.py documents it."""
    out = bytearray()
    for family, keys in writes.items():
        for key, (value, delta) in keys.items():
            head = struct.pack("<B", len(family)) + family.encode() + struct.pack(
                "<H", len(key)) + key
            if value is None:
                out += head + struct.pack("<B", 1)
            elif value is not KEEP:
                out += head + struct.pack("<BI", 0, len(value)) + value
            if delta:
                out += head + struct.pack("<Bq", 2, delta)
    return bytes(out)


def test_a_log_of_entries_records_is_replayed(tmp_path: Path) -> None:
    """A log whose records hold entries (`MAGIC_ENTRIES`) left by a crash: the next open
    replays them like its own (the same log rewritten in that format gives the same store)."""
    kill_log_writer(tmp_path, 300)
    records = changes_in_log(tmp_path)
    for segment in log_segments(tmp_path):
        data, rewritten, at = segment.read_bytes(), bytearray(), 0
        while at + _HEADER.size <= len(data):
            magic, seq, length, _ = _HEADER.unpack_from(data, at)
            if magic != MAGIC:
                break
            payload = entries_payload(decode(data[at + _HEADER.size: at + _HEADER.size + length]))
            rewritten += _HEADER.pack(MAGIC_ENTRIES, seq, len(payload),
                                      xxhash.xxh3_64_intdigest(payload)) + payload
            at += _HEADER.size + length
        segment.write_bytes(rewritten + bytes(max(0, len(data) - len(rewritten))))
    assert changes_in_log(tmp_path) == records
    assert_every_answered_change_back(tmp_path)


def test_the_committer_moves_every_answered_change_into_lmdb(tmp_path: Path) -> None:
    """Changes answered from memory and the log reach LMDB in the committer thread: after a
    close, LMDB holds them all, and a reopen finds the names and counters they made."""
    meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        for number in range(100):
            meta.namespace.make(ROOT_INO, b"f%d" % number, stat.S_IFREG | 0o644, 0, 0)
        assert meta.engine.sync(timeout=30) and meta.engine.commit_failures == 0
    finally:
        meta.close()
    assert lmdb_applied(tmp_path) > 100
    meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        assert meta.recency.usage().files == 100
        check_store(meta)
    finally:
        meta.close()


BUSY_WRITER = """
import stat, sys, time
from pathlib import Path
from kvfs.engines.lmdb_engine import LmdbEngine
from kvfs.meta import DEFAULT_MAP_SIZE, FAMILIES, ROOT_INO, MetaStore
meta = MetaStore(LmdbEngine(Path(sys.argv[1]), FAMILIES, DEFAULT_MAP_SIZE))
meta.engine.sync()
Path(sys.argv[1], "started").touch()
deadline, number = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < deadline:
    meta.namespace.make(ROOT_INO, b"f%d" % number, stat.S_IFREG | 0o644, 0, 0)
    number += 1
meta.close()
"""


def test_read_only_opens_beside_a_busy_writer_read_one_moment(tmp_path: Path) -> None:
    """What fsck and the tests' recounts do: open read-only while a daemon's committer moves
    changes from the log into LMDB. Each open reads one moment: the file counter equals the
    names listed, whatever the committer moved between the open's replay and its read."""
    writer = subprocess.Popen([sys.executable, "-c", BUSY_WRITER, str(tmp_path), "6"],
                              cwd=Path(__file__).parent.parent)
    try:
        assert wait_for(lambda: (tmp_path / "started").exists())
        opens = 0
        while writer.poll() is None:
            meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE, readonly=True),
                             readonly=True)
            try:
                with meta.engine.snapshot() as txn:
                    files = txn.count("counters", b"files")
                    names = sum(1 for key, _ in txn.scan("dentry", u64(ROOT_INO))
                                if key[:8] == u64(ROOT_INO))
            finally:
                meta.close()
            assert files == names
            opens += 1
        assert writer.wait() == 0 and opens > 10
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


def test_replay_stops_at_a_torn_record(tmp_path: Path) -> None:
    """A log cut in the middle of a record (a power loss) gives back the whole records before
    it and nothing after: the changes that come back are a prefix of those answered."""
    kill_log_writer(tmp_path, 50)
    (segment,) = log_segments(tmp_path)
    records = changes_in_log(tmp_path)
    data = bytearray(segment.read_bytes())
    start, end = last_record(bytes(data))
    middle = (start + _HEADER.size + end) // 2
    data[middle:end] = bytes(end - middle)  # the last record torn: its second half not written
    segment.write_bytes(data)
    assert changes_in_log(tmp_path) == records - 1
    meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        names = {name for name, _, _ in meta.namespace.readdir_page(ROOT_INO, 0, 1000)}
        assert b"renamed" not in names  # the rename was the last record
        assert names <= {b"f%d" % n for n in range(50)} and b"f0" in names
        check_store(meta)
    finally:
        meta.close()


def test_snapshots_see_one_moment_while_changes_move_into_lmdb(tmp_path: Path) -> None:
    """A snapshot taken before a change never sees it, and one taken at any time counts each
    change once, also while the committer moves changes into LMDB (counters are deltas)."""
    engine = LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE)

    def add_one(txn: Txn) -> None:
        txn.add("counters", b"test", 1)
        txn.put("settings", b"last", b"%d" % txn.count("counters", b"test"))

    try:
        for done in range(1, 501):
            with engine.snapshot() as before:
                engine.change(add_one)
                assert before.count("counters", b"test") == done - 1
            with engine.snapshot() as after:
                assert after.count("counters", b"test") == done
                assert after.get("settings", b"last") == b"%d" % done
    finally:
        engine.close()
    assert lmdb_applied(tmp_path) == 500  # all of them in LMDB, once
    assert log_segments(tmp_path) == []
    engine = LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE)
    try:
        with engine.snapshot() as txn:
            assert txn.count("counters", b"test") == 500
    finally:
        engine.close()


def test_names_made_and_moved_within_one_commit_group(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores' temporary names, made and renamed away before their commit group reaches
    LMDB, and a name LMDB does hold, removed, made again and removed again in one group: the
    group goes to the LMDB in one transaction, and after a reopen, which reads
    LMDB alone, the names are exactly those left."""
    # one group for them all
    monkeypatch.setattr("kvfs.engines.lmdb_engine.COMMIT_GATHER_SECONDS", 0.5)
    meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        meta.namespace.make(ROOT_INO, b"old", stat.S_IFREG | 0o644, 0, 0)
        meta.engine.sync()
        applied = meta.engine._applied()  # (what LMDB itself holds)
        meta.namespace.rename(ROOT_INO, b"old", ROOT_INO, b"kept", 0)
        meta.namespace.make(ROOT_INO, b"old", stat.S_IFREG | 0o644, 0, 0)
        meta.namespace.rename(ROOT_INO, b"old", ROOT_INO, b"kept again", 0)
        for number in range(3):  # stores: a temporary name, its content, the rename
            made = meta.namespace.make(ROOT_INO, b"f%d.tmp" % number, stat.S_IFREG | 0o644, 0, 0)
            meta.content.commit_content(made.ino, new_blob(meta, made.ino, 4096))
            meta.namespace.rename(ROOT_INO, b"f%d.tmp" % number, ROOT_INO, b"f%d" % number, 0)
        group = meta.engine._active  # the group about to reach LMDB, whole
        assert meta.engine._applied() == applied and group.last_seq - applied >= 12
        assert meta.engine.sync()
        assert meta.engine._applied() == group.last_seq
    finally:
        meta.close()
    meta = MetaStore(LmdbEngine(tmp_path, FAMILIES, DEFAULT_MAP_SIZE))
    try:
        names = {name for name, _, _ in meta.namespace.readdir_page(ROOT_INO, 0, 100)}
        assert names == {b"kept", b"kept again", b"f0", b"f1", b"f2"}
        assert meta.namespace.lookup(ROOT_INO, b"old") is None
        f1 = meta.namespace.lookup(ROOT_INO, b"f1")
        assert f1 is not None and meta.namespace.names(f1.ino) == [(ROOT_INO, b"f1")]
        check_store(meta)
    finally:
        meta.close()


def test_the_record_cache_keeps_what_changed_only_elsewhere() -> None:
    """A write or read is dropped from a host's record cache only if its own record changed
    while it was on its way: not for other records changing meanwhile (16 writers storing
    in one directory), nor for the change's own other records. A directory this host made
    thus stays complete, and new names there are found missing without a round trip."""
    cache = RecordCache()
    cache.enable(True)
    directory = record_key("dentry", u64(7))
    cache.wrote([], cache.changes, [directory])  # made here: complete
    names = [record_key("dentry", u64(7) + b"f%d" % n) for n in range(5000)]
    written = [(name, u64(100 + n) + u64(n)) for n, name in enumerate(names)]
    cache.wrote(written, cache.changes, [])  # one change, many records
    assert all(cache.get(name) == value for name, value in written)
    assert cache.get(record_key("dentry", u64(7) + b"never")) is None  # still complete

    mine, other = names[0], names[1]
    moment = cache.changes  # a change of `mine` on its way ...
    cache.wrote([(other, b"o" * 16)], cache.changes, [])  # ... another commits
    cache.wrote([(mine, b"m" * 16)], moment, [])
    assert cache.get(mine) == b"m" * 16

    read = cache.changes  # a read of `other` on its way while it changes
    cache.wrote([(other, b"p" * 16)], cache.changes, [])
    cache.keep([other], [b"o" * 16], read)
    assert cache.get(other) == b"p" * 16

    moment = cache.changes  # another host changes `mine` before this write lands
    cache.pushed([(mine, b"x" * 16)])
    cache.wrote([(mine, b"m" * 16)], moment, [])
    assert cache.get(mine) is NotCached.MISS  # not known which came last: read again
