"""Which client wrote or reads a file, from its name alone, for per-client traffic.

The names each client gives its files (and the temporary names it writes them under, then
renames; a store is counted at its close, under the temporary name):
- LMCache: `<model>@<fields…>.data` (`fs` plugin and the 0.5.7 L2 adapter, whose temporary
  name is `<key>.tmp`) or `.pt` (`local_disk`): fields separated by "@".
- vLLM's `fs` tier: `<block hash hex>.bin` in `<model>_<hash>_r<rank>/<hhh>/<hh>_g<group>/`,
  written as `<name>.bin_<random>.tmp`.
- SGLang's HiCache `file` backend: `<page hash hex>_<model>_<rank>_<size>.bin`, flat in one
  directory, written as `.<uuid4 hex>.tmp`.
Everything else counts as "other". The label is one of these four words, never a name.
"""

from __future__ import annotations

import re

CLIENTS = ("lmcache", "vllm", "sglang", "other")

_LMCACHE = re.compile(rb"[^@/]+(@[^@/]*){3,}\.(data|pt|tmp)")
_VLLM = re.compile(rb"[0-9a-f]{16,}\.bin(_[0-9]+\.tmp)?")
_SGLANG = re.compile(rb"[0-9a-f]{16,}_.+\.bin|\.[0-9a-f]{32}\.tmp")


def client_of(name: bytes) -> str:
    if _LMCACHE.fullmatch(name):
        return "lmcache"
    if _VLLM.fullmatch(name):
        return "vllm"
    if _SGLANG.fullmatch(name):
        return "sglang"
    return "other"


class ClientTraffic:
    """Bytes each client stored (committed) and loaded (opened for reading)."""

    def __init__(self) -> None:
        self.stored_bytes = dict.fromkeys(CLIENTS, 0)
        self.loaded_bytes = dict.fromkeys(CLIENTS, 0)

    def stored(self, name: bytes, size: int) -> None:
        self.stored_bytes[client_of(name)] += size

    def loaded(self, name: bytes, size: int) -> None:
        self.loaded_bytes[client_of(name)] += size

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {client: {"stored_bytes": self.stored_bytes[client],
                         "loaded_bytes": self.loaded_bytes[client]} for client in CLIENTS}
