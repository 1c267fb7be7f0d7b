"""Kernel-side tuning of a FUSE mount that pyfuse3 cannot pass as mount options.

Raising the mount's read_ahead_kb makes the kernel send 1 MiB read requests instead of
128 KiB ones; raising max_background lets more of them be in flight. Both live in sysfs
and need root; without it kvfs runs with the kernel defaults and says so.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from kvfs.fuse.mounts import find_mount

log = logging.getLogger(__name__)

DEFAULT_READ_AHEAD_KB = 16384
DEFAULT_MAX_BACKGROUND = 64
FUSECTL = Path("/sys/fs/fuse/connections")


def tune_mount(mountpoint: Path, read_ahead_kb: int, max_background: int) -> None:
    mount = find_mount(mountpoint)
    if mount is None:
        log.warning("tuning: %s not found in mountinfo", mountpoint)
        return
    _write_setting(Path(f"/sys/class/bdi/{mount.major}:{mount.minor}/read_ahead_kb"),
                   read_ahead_kb)
    if FUSECTL.is_dir() and not any(FUSECTL.iterdir()):
        subprocess.run(["mount", "-t", "fusectl", "none", str(FUSECTL)], check=False,
                       capture_output=True)
    _write_setting(FUSECTL / str(mount.minor) / "max_background", max_background)


def _write_setting(path: Path, value: int) -> None:
    try:
        path.write_text(f"{value}\n")
        log.info("tuning: %s = %d", path, value)
    except OSError as error:
        log.warning("tuning: cannot set %s to %d: %s", path, value, error.strerror)
