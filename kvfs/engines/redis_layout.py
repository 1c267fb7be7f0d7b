"""The Redis engine's layout: its keys, its commit script, and the format of the
announcements hosts send each other (kvfs/engines/redis_engine.py uses them).

Keys, all under one hash tag
(`{kvfs}`, so that a Redis Cluster keeps them on one node):

    {kvfs}:<family>:<key>              a record (string)
    {kvfs}:<family>/<partition>        sorted set of the keys of one partition, for scans:
                                       dirlist, links, xattr, held, holding: one set per
                                       inode, blob or session (the keys' first 8 bytes, in
                                       hex); recency: 16 sets by key hash; pins, doomed,
                                       pending, sessions: one set each
    {kvfs}:<family>                    hash of integers (counters, models): HINCRBY deltas
    {kvfs}:beat:<session>              a host's heartbeat; expires unless renewed
    {kvfs}:settings:pool               the pool's identity, also in the volume's DATA/pool-id:
                                       every commit checks it (POOL_KEY)

Every member of a sorted set has score 0, so that ZRANGEBYLEX walks keys in byte order.
Families without a set (inode, dentry, blob, symlink, settings) are scanned only by fsck,
with SCAN.
"""

from __future__ import annotations

import struct
import zlib
from typing import cast

PREFIX = b"{kvfs}:"
PARTITIONED = frozenset({"dirlist", "links", "xattr", "held", "holding"})  # by 8-byte prefix
INDEXED = {"recency": 16, "pins": 1, "doomed": 1, "pending": 1, "sessions": 1}  # -> set count
COUNTERS = frozenset({"counters", "models"})
PAGE = 512
DEFAULT_DEADLINE = 6.0  # seconds a request may wait on Redis, for a worker included (--deadline)
# Channel of a pool's announcements, per database: Redis delivers a PUBLISH to subscribers on
# every database of the server, and pools in two databases of one server share inode numbers.
CHANGES_CHANNEL = PREFIX + b"changes:%d"
# Families kernels cache -> code in a message (capitals: the message carries the values;
# hosts of one pool run one kvfs version).
ANNOUNCED = {"dentry": b"D", "inode": b"I"}
_FAMILY_OF_CODE = {code: family for family, code in ANNOUNCED.items()}
_DENTRY_PREFIX_LENGTH = len(PREFIX + b"dentry:") + 8  # a dentry record's family and parent
_KEY_LENGTH = struct.Struct(">H")
_VALUE_LENGTH = struct.Struct(">I")
REMOVED = 0xFFFFFFFF  # a value length: the record was removed
ENGINE_ID_BYTES = 8
POOL_KEY = PREFIX + b"settings:pool"
# A change, applied only if every record it read still holds what it read; returns 1
# (applied), else minus the number of the first read that differs (-1 where a change checks
# the pool's identity, its first read, and Redis holds another pool or none). ARGV: how many
# records it read, what each held ("" if absent, else "=" + value), then per write: op, key
# index among KEYS (0: none), a, b. KEYS: the records it read, then one per write. Its
# announcement, if any, is its last write ('P').
COMMIT_SCRIPT = """
local read = tonumber(ARGV[1])
for i = 1, read do
  local held, now = ARGV[1 + i], redis.call('GET', KEYS[i])
  if held == '' then
    if now then return -i end
  elseif now ~= string.sub(held, 2) then
    return -i
  end
end
for w = read + 2, #ARGV, 4 do
  local op, key, a, b = ARGV[w], KEYS[tonumber(ARGV[w + 1])], ARGV[w + 2], ARGV[w + 3]
  if op == 'S' then redis.call('SET', key, a)
  elseif op == 'D' then redis.call('DEL', key)
  elseif op == 'Z' then redis.call('ZADD', key, 0, a)
  elseif op == 'R' then redis.call('ZREM', key, a)
  elseif op == 'I' then redis.call('HINCRBY', key, a, b)
  elseif op == 'H' then redis.call('HDEL', key, a)
  elseif op == 'P' then redis.call('PUBLISH', a, b)
  end
end
return 1
"""
# HINCRBY of KEYS[2]'s field ARGV[2] by ARGV[3], only in the pool ARGV[1] (KEYS[1] holds it;
# ARGV[1] empty: in any): false otherwise.
ALLOCATE_SCRIPT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
return redis.call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])
"""
# A claim on the pool's room (Engine.claim): HINCRBY of KEYS[2]'s field ARGV[2] by ARGV[3] if
# the field used_bytes plus every claim:* field plus ARGV[3] is at most the capacity (KEYS[3],
# a big-endian u64), or ARGV[3] <= 0; only in the pool ARGV[1] (as ALLOCATE_SCRIPT) and, with
# ARGV[4] = '1', while the session's live mark KEYS[4] is there (else {-1, 0, 0}). Returns
# {granted, capacity, committed and claimed before}.
CLAIM_SCRIPT = """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[4]) == 0 then return {-1, 0, 0} end
local counters, held = redis.call('HGETALL', KEYS[2]), 0
for i = 1, #counters, 2 do
  local name = counters[i]
  if name == 'used_bytes' or string.sub(name, 1, 6) == 'claim:' then
    held = held + tonumber(counters[i + 1])
  end
end
local raw, capacity = redis.call('GET', KEYS[3]), 0
if raw then
  for i = 1, 8 do capacity = capacity * 256 + string.byte(raw, i) end
end
local amount = tonumber(ARGV[3])
local granted = amount <= 0 or held + amount <= capacity
if granted and amount ~= 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], amount) end
return {granted and 1 or 0, capacity, held}
"""
# A name's entry, then the inode its value starts with: one round trip (keys share {kvfs}).
LOOKUP_SCRIPT = """
local entry = redis.call('GET', KEYS[1])
if not entry then return {false, false} end
return {entry, redis.call('GET', ARGV[1] .. string.sub(entry, 1, 8))}
"""


# The client is made without decode_responses (redis-py's default: False), so every reply
# is bytes; redis-py's annotations cover both settings (bytes | str). Replies are narrowed
# here, once, for the type checker (casts: nothing changes at run time).


def reply(reply: bytes | str | None) -> bytes | None:
    return cast("bytes | None", reply)


def replies(replies: list[bytes | str | None]) -> list[bytes | None]:
    return cast("list[bytes | None]", replies)


def keys_of(replies: list[bytes | str]) -> list[bytes]:
    return cast("list[bytes]", replies)


def record_key(family: str, key: bytes) -> bytes:
    return PREFIX + family.encode() + b":" + key


def partition_key(family: str, key: bytes) -> bytes:
    """The sorted set of a PARTITIONED family that indexes `key`."""
    return PREFIX + family.encode() + b"/" + key[:8].hex().encode()


def set_key(family: str, key: bytes) -> bytes | None:
    """The sorted set that indexes `key` of `family`, if the family has sets."""
    if family in PARTITIONED:
        return partition_key(family, key)
    shards = INDEXED.get(family)
    if shards is None:
        return None
    shard = zlib.crc32(key) % shards if shards > 1 else 0
    return PREFIX + family.encode() + b"/" + str(shard).encode()


def set_keys(family: str, start: bytes) -> list[bytes]:
    """The sets a scan of `family` from `start` walks."""
    if family in PARTITIONED:
        return [partition_key(family, start.ljust(8, b"\0"))]
    return [PREFIX + family.encode() + b"/" + str(shard).encode()
            for shard in range(INDEXED[family])]


def counter_key(family: str) -> bytes:
    return PREFIX + family.encode()


ScriptCall = tuple[list[bytes], list[bytes | int]]  # COMMIT_SCRIPT's keys and arguments


def complete_prefix(record: bytes) -> bytes:
    """The prefix a record of a directory's entries shares with its siblings (`known_empty`):
    the family's and the parent's 8 bytes."""
    return record[:_DENTRY_PREFIX_LENGTH]


def announcement(engine_id: bytes, changed: list[tuple[str, bytes, bytes | None]]) -> bytes:
    """The message that tells other hosts which records a change wrote, and what (None:
    removed): per record its family's code, the key and the value, each with its length."""
    return engine_id + b"".join(
        ANNOUNCED[family] + _KEY_LENGTH.pack(len(key)) + key
        + (_VALUE_LENGTH.pack(REMOVED) if value is None
           else _VALUE_LENGTH.pack(len(value)) + value)
        for family, key, value in changed)


def announced(message: bytes) -> tuple[bytes, list[tuple[str, bytes, bytes | None]]]:
    """(engine id, [(family, key, value)]) of an announcement."""
    changed: list[tuple[str, bytes, bytes | None]] = []
    at = ENGINE_ID_BYTES
    while at < len(message):
        family = _FAMILY_OF_CODE[message[at:at + 1]]
        (length,) = _KEY_LENGTH.unpack_from(message, at + 1)
        at += 1 + _KEY_LENGTH.size
        key = message[at:at + length]
        (size,) = _VALUE_LENGTH.unpack_from(message, at + length)
        at += length + _VALUE_LENGTH.size
        if size == REMOVED:
            changed.append((family, key, None))
        else:
            changed.append((family, key, message[at:at + size]))
            at += size
        if at > len(message):
            raise struct.error("an announcement cut short")
    return message[:ENGINE_ID_BYTES], changed
