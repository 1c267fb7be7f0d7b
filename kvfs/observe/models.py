"""Which model an LMCache file belongs to, from its name alone.

LMCache keys are `model@world_size@worker_id@chunk_hash@dtype`. The `fs` storage plugin names
files `<key>.data` with each "/" of the key written as "-SEP-"; `local_disk` names them
`<key>.pt` with "/" written as "-" (not reversible, so the model is shown as written).
"""

from __future__ import annotations

FS_PLUGIN_SUFFIX = b".data"
LOCAL_DISK_SUFFIX = b".pt"


def model_of(name: bytes) -> str | None:
    """The model of an LMCache chunk file, or None for any other name (temp files too)."""
    if name.endswith(FS_PLUGIN_SUFFIX):
        stem, separator = name[: -len(FS_PLUGIN_SUFFIX)], b"-SEP-"
    elif name.endswith(LOCAL_DISK_SUFFIX):
        stem, separator = name[: -len(LOCAL_DISK_SUFFIX)], None
    else:
        return None
    fields = stem.split(b"@")
    if len(fields) < 5 or not fields[0]:
        return None
    model = fields[0].replace(separator, b"/") if separator else fields[0]
    return model.decode(errors="replace")
