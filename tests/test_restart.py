"""A kvfs daemon killed under a running engine, and the same mount command run again, as
systemd's unit (examples/kvfs.service) or a Kubernetes DaemonSet does after a crash.

The mount command clears the dead mount itself. While no daemon serves, the engine's lookups
miss and its loads fail; once the new mount is live it hits again; no byte it loads is ever
wrong. Each client's own code runs in a process of its own, loading in a loop.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import pytest
from conftest import daemon_pid, is_mounted, run_mount, wait_dead
from vllm_tier import VLLM_DIR, run_worker

BLOCKS = 8
ERRNO = re.compile(r"\[Errno \d+\] [^:]*")  # in what vLLM's code logs of a failed job
RESTART_DELAY = 1.0  # seconds from the kill to the next mount command (systemd's RestartSec)


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The loop's passes as the engine lived them: clean ones (every block hit and loaded),
    the span of the others, and what vLLM's code logged in them."""
    clean = [p["hits"] == BLOCKS and p["failed"] == 0 for p in passes]
    broken = [p for p, ok in zip(passes, clean, strict=True) if not ok]
    return {"passes": len(passes), "broken": len(broken),
            "broken_from": broken[0]["at"] if broken else None,
            "broken_until": broken[-1]["at"] if broken else None,
            "errors": sorted({found.group(0) for p in broken
                              if (found := ERRNO.search(p["message"]))})}


@pytest.mark.skipif(not VLLM_DIR.is_dir(), reason=f"{VLLM_DIR} is missing: set-up could not "
                    "fetch vLLM's wheel")
def test_vllm_loads_miss_while_kvfs_restarts_and_never_load_wrong_bytes(make_mount) -> None:
    kvfs = make_mount("--capacity", "1G")
    root = kvfs.mountpoint / "vllm"
    assert run_worker("store", root, BLOCKS, seed=3)["failed"] == []
    reports: list[dict[str, Any]] = []
    loop = threading.Thread(target=lambda: reports.append(
        run_worker("load", root, BLOCKS, seed=3, seconds=10)))
    loop.start()
    time.sleep(3)
    os.kill(kvfs.pid, signal.SIGKILL)
    assert wait_dead(kvfs.pid)
    time.sleep(RESTART_DELAY)
    kvfs.mount()  # the command that mounted it, unchanged
    loop.join()

    passes = reports[0]["passes"]
    print(summary(passes))
    assert all(p["mismatched"] == 0 for p in passes), "a load returned wrong bytes"
    assert passes[0]["hits"] == BLOCKS and passes[0]["failed"] == 0
    assert any(p["hits"] < BLOCKS or p["failed"] for p in passes), "the kill went unseen"
    last = passes[-1]
    assert last["hits"] == BLOCKS and last["failed"] == 0, "hits again after the restart"


def test_mount_over_a_dead_kvfs_mount_clears_it(make_mount) -> None:
    kvfs = make_mount()
    (kvfs.mountpoint / "kept").write_bytes(b"committed before the kill")
    os.kill(kvfs.pid, signal.SIGKILL)
    assert wait_dead(kvfs.pid)
    with pytest.raises(OSError) as dead:
        (kvfs.mountpoint / "kept").read_bytes()
    assert dead.value.errno == 107  # ENOTCONN
    result = run_mount(kvfs.mountpoint, kvfs.data)
    assert result.returncode == 0, result.stderr
    kvfs.pid = daemon_pid(kvfs.data)
    assert "cleared the dead kvfs mount" in result.stderr
    assert is_mounted(kvfs.mountpoint)
    assert (kvfs.mountpoint / "kept").read_bytes() == b"committed before the kill"
