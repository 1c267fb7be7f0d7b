"""What the kernel says is mounted (/proc/self/mountinfo), without touching the mounts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class MountEntry:
    mountpoint: str
    source: str
    fstype: str
    major: int
    minor: int


def mount_entries() -> list[MountEntry]:
    entries = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        tail = fields.index("-")
        major, minor = fields[2].split(":")
        entries.append(MountEntry(_unescape(fields[4]), _unescape(fields[tail + 2]),
                                  fields[tail + 1], int(major), int(minor)))
    return entries


def find_mount(mountpoint: Path) -> MountEntry | None:
    """The topmost mount at `mountpoint`, if any."""
    matches = [entry for entry in mount_entries() if entry.mountpoint == str(mountpoint)]
    return matches[-1] if matches else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for escaped, plain in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(escaped, plain)
    return field
