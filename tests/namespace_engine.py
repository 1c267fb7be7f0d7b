"""An engine's view of kvfs from a mount namespace of its own: run under `unshare --mount
--propagation slave`, it answers one JSON request per line of stdin with one JSON line.

    {"op": "write", "path": P, "hex": H}      -> {"ok": true}
    {"op": "read", "path": P}                 -> {"hex": H} | {"errno": E}
    {"op": "exists", "path": P}               -> {"exists": bool}
    {"op": "open", "path": P}                 -> {"fd": N} | {"errno": E}
    {"op": "pread", "fd": N, "size": S}       -> {"hex": H} | {"errno": E}
    {"op": "close", "fd": N}                  -> {"ok": true} | {"errno": E}
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def answer(request: dict[str, Any]) -> dict[str, Any]:
    op, path = request["op"], request.get("path", "")
    try:
        if op == "write":
            with open(path, "wb") as out:
                out.write(bytes.fromhex(request["hex"]))
            return {"ok": True}
        if op == "read":
            with open(path, "rb") as source:
                return {"hex": source.read().hex()}
        if op == "exists":
            return {"exists": os.path.exists(path)}
        if op == "open":
            return {"fd": os.open(path, os.O_RDONLY)}
        if op == "pread":
            return {"hex": os.pread(request["fd"], request["size"], 0).hex()}
        if op == "close":
            os.close(request["fd"])
            return {"ok": True}
    except OSError as error:
        return {"errno": error.errno}
    raise ValueError(f"unknown op {op!r}")


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
