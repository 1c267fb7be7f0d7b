"""Load throughput per model: does loading KV from the pool beat recomputing it?

Loading a prefix only helps if its KV arrives faster than the GPU recomputes it. For each
model (from LMCache's file names, kvfs/observe/models.py; other files count as OTHER) this host
counts the bytes opened for reading and the time during which at least one such file was
open (open to close, overlapping loads counted once): their ratio is the throughput loads
achieved, which `kvfs stat` sets against a break-even per model (`--break-even`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

OTHER = "(other files)"

# Reuse of a prefix pays above these load rates (GB/s), measured on an H200 with prefills of
# 2k-32k tokens (README, "Does reuse pay?"): the upper ends of the measured ranges.
DEFAULT_BREAK_EVEN_GBPS = {"llama-3.1-8b": 4.5, "llama-3.1-70b": 1.3}


@dataclass
class _ModelLoads:
    bytes: int = 0
    busy_seconds: float = 0.0
    open: int = 0
    busy_since: float = 0.0


class LoadMeter:
    def __init__(self) -> None:
        self._models: dict[str, _ModelLoads] = {}

    def opened(self, model: str, size: int) -> None:
        loads = self._models.setdefault(model, _ModelLoads())
        if not loads.open:
            loads.busy_since = time.monotonic()
        loads.open += 1
        loads.bytes += size

    def closed(self, model: str) -> None:
        loads = self._models[model]
        loads.open -= 1
        if not loads.open:
            loads.busy_seconds += time.monotonic() - loads.busy_since

    def as_dict(self) -> dict[str, dict[str, float]]:
        """Per model: bytes loaded and seconds busy loading (open loads count until now)."""
        now = time.monotonic()
        return {model: {"bytes": loads.bytes,
                        "seconds": loads.busy_seconds
                        + (now - loads.busy_since if loads.open else 0.0)}
                for model, loads in self._models.items()}


def break_even(model: str, chosen: dict[str, float]) -> float | None:
    """The load rate (GB/s) above which reusing `model`'s KV pays: the operator's choice for
    it, else the default whose key the model's name contains (the longest), else unknown."""
    if model in chosen:
        return chosen[model]
    lowered = model.lower()
    for table in (chosen, DEFAULT_BREAK_EVEN_GBPS):
        matches = [key for key in table if key.lower() in lowered]
        if matches:
            return table[max(matches, key=len)]
    return None
