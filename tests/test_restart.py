"""A kvfs daemon killed under a running engine, and the same mount command run again, as
systemd's unit (examples/kvfs.service) or a supervisor does after a crash.

The mount's keeper (kvfs/fuse/keeper.py) holds the kernel's connection: the engine's
requests wait for the next daemon, which takes the connection over; loads see no error at
all, and only a store the dead daemon was writing fails. Without a keeper (killed too) the
mount is dead: the engine's lookups miss while no daemon serves, and the mount command
clears the dead mount itself. No byte an engine loads is ever wrong. The client's own code
runs in a process of its own, storing or loading in a loop.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    KvfsMount,
    assert_counters_exact,
    daemon_pid,
    is_mounted,
    keeper_pid,
    run_mount,
    stats,
    wait_dead,
    wait_for,
)
from sglang_hicache import SGLANG_DIR
from sglang_hicache import run_worker as run_sglang
from vllm_tier import VLLM_DIR
from vllm_tier import run_worker as run_vllm

from kvfs.fuse.keeper import socket_path

UNITS = 8  # blocks (vLLM) or pages (SGLang) each pass stores or loads
ERRNO = re.compile(r"\[Errno \d+\] [^:]*")  # in what a client's code logs of a failure
# What vLLM logs first of the store the dead daemon was writing: its write or close failed
# (the handle went with that daemon), or its clean-up found the temp file gone (the new
# daemon's recovery removed the uncommitted file)
IN_FLIGHT_STORE_ERRORS = {"[Errno 107] Transport endpoint is not connected",
                          "[Errno 2] No such file or directory"}
RESTART_DELAY = 1.0  # seconds from the kill to the next mount command (systemd's RestartSec)
CLIENTS = {"vllm": (VLLM_DIR, run_vllm), "sglang": (SGLANG_DIR, run_sglang)}
LOOPS = [pytest.param(client, op, marks=pytest.mark.skipif(
    not CLIENTS[client][0].is_dir(), reason=f"{CLIENTS[client][0]} is missing: set-up could "
    "not fetch the client's wheel")) for client, op in (("vllm", "load"), ("vllm", "store"),
                                                        ("sglang", "load"))]


def broken(passes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The passes that did not store or load every unit."""
    return [p for p in passes if p.get("hits", UNITS) != UNITS or p["failed"]]


def summary(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The loop's passes as the engine lived them: how many were broken, the longest pass,
    the span of the broken ones and the errors the client's code logged."""
    failed = broken(passes)
    starts = [p["at"] for p in passes]
    return {"passes": len(passes), "broken": len(failed),
            "longest_pass_s": round(max(b - a for a, b in zip(starts, starts[1:],
                                                             strict=False)), 3),
            "broken_from": failed[0]["at"] if failed else None,
            "broken_until": failed[-1]["at"] if failed else None,
            "errors": sorted({found.group(0) for p in failed
                              if (found := ERRNO.search(p["message"]))})}


def loop_while(kvfs: KvfsMount, client: str, op: str, fault: Any) -> list[dict[str, Any]]:
    """The client's own code stores UNITS units, then stores or loads them in a loop in a
    process of its own while `fault()` runs (a second into the loop); the loop's passes. Then, in
    another process, every unit loads exact: nothing the loop did left a broken file."""
    root = kvfs.mountpoint / client
    run = CLIENTS[client][1]
    assert run("store", root, UNITS, seed=3)["failed"] == []
    reports: list[dict[str, Any]] = []
    opened = opens(kvfs)
    loop = threading.Thread(target=lambda: reports.append(
        run(op, root, UNITS, seed=3, seconds=10)))
    loop.start()
    assert wait_for(lambda: opens(kvfs) > opened + UNITS, 30), "the loop started"
    time.sleep(1)
    fault()
    loop.join()
    passes = reports[0]["passes"]
    print(client, op, summary(passes))
    assert all(p.get("mismatched", 0) == 0 for p in passes), "a load returned wrong bytes"
    assert not broken(passes[:1]) and not broken(passes[-1:]), "clean before and after"
    after = run("load", root, UNITS, seed=3)
    assert (after["hits"], after["failed"], after["mismatched"]) == (UNITS, [], [])
    return passes


def opens(kvfs: KvfsMount) -> int:
    """Opens the mount served so far: a client's loop has started once they grow."""
    shown = stats(kvfs.mountpoint)
    return sum(shown[key] for key in ("opens_passthrough", "opens_daemon",
                                      "write_opens_passthrough", "write_opens_daemon"))


def kill_and_mount_again(kvfs: KvfsMount, *also: int) -> None:
    for pid in (kvfs.pid, *also):
        os.kill(pid, signal.SIGKILL)
    assert wait_dead(kvfs.pid)
    time.sleep(RESTART_DELAY)
    kvfs.mount()  # the command that mounted it, unchanged


@pytest.mark.parametrize(("client", "op"), LOOPS)
def test_engines_wait_through_a_restart_without_an_error(make_mount, client: str,
                                                         op: str) -> None:
    kvfs = make_mount("--capacity", "1G")
    passes = loop_while(kvfs, client, op, lambda: kill_and_mount_again(kvfs))
    if op == "load":
        assert broken(passes) == []
    else:  # a store the dead daemon was writing fails (its handle is gone), and only it
        assert len(broken(passes)) <= 1, summary(passes)
        assert set(summary(passes)["errors"]) <= IN_FLIGHT_STORE_ERRORS, summary(passes)
    assert summary(passes)["longest_pass_s"] >= RESTART_DELAY, "the engine waited"
    assert "took over" in (kvfs.data / "kvfs.log").read_text()
    assert_counters_exact(kvfs.mountpoint, kvfs.data)  # (what the dead daemon left, counted)


@pytest.mark.skipif(not VLLM_DIR.is_dir(), reason=f"{VLLM_DIR} is missing: set-up could "
                    "not fetch vLLM's wheel")
def test_vllm_loads_fail_while_a_dead_mount_waits_then_hit_again(make_mount) -> None:
    """The keeper killed with the daemon: no one holds the connection."""
    kvfs = make_mount("--capacity", "1G")
    keeper = keeper_pid(kvfs.mountpoint)
    passes = loop_while(kvfs, "vllm", "load", lambda: kill_and_mount_again(kvfs, keeper))
    assert broken(passes), "the kill went unseen"


def test_a_file_the_dead_daemon_opened_closes_without_an_error(make_mount) -> None:
    """The kernel releases a handle the dead daemon handed out to the daemon that took the
    mount over, which answers it as gone (not an unexpected error, counted and logged)."""
    kvfs = make_mount("--capacity", "1G")
    (kvfs.mountpoint / "kept").write_bytes(b"kept")
    fd = os.open(kvfs.mountpoint / "kept", os.O_RDONLY)
    kill_and_mount_again(kvfs)
    os.close(fd)
    assert wait_for(lambda: "release" in stats(kvfs.mountpoint)["requests"], 10)
    assert stats(kvfs.mountpoint)["handler_errors"] == 0
    assert (kvfs.mountpoint / "kept").read_bytes() == b"kept"


def test_a_file_the_dead_daemon_gave_a_fresh_kernel_inode_opens_after_a_takeover(
        make_mount) -> None:
    """A writer beside a reader gets the file a fresh kernel inode (an alias); after a
    takeover the kernel opens the alias the dead daemon named, which the next daemon refuses
    (ESTALE), and retries once, on what a lookup names now: that must open, though the
    kernel inode of the file's own number holds the reader's pages from before."""
    kvfs = make_mount("--capacity", "1G")
    page = kvfs.mountpoint / "page"
    page.write_bytes(b"first")
    with open(page, "rb") as reader:
        assert reader.read() == b"first"
        page.write_bytes(b"second")  # (its open beside the reader renews the kernel inode)
        assert page.read_bytes() == b"second"  # the name now leads to the alias
        kill_and_mount_again(kvfs)
        assert page.read_bytes() == b"second"
    assert stats(kvfs.mountpoint)["handler_errors"] == 0


def test_mount_over_a_dead_kvfs_mount_clears_it(make_mount) -> None:
    kvfs = make_mount()
    (kvfs.mountpoint / "kept").write_bytes(b"committed before the kill")
    os.kill(keeper_pid(kvfs.mountpoint), signal.SIGKILL)
    os.kill(kvfs.pid, signal.SIGKILL)
    assert wait_dead(kvfs.pid)
    with pytest.raises(OSError) as dead:
        (kvfs.mountpoint / "kept").read_bytes()
    assert dead.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    result = run_mount(kvfs.mountpoint, kvfs.data)
    assert result.returncode == 0, result.stderr
    kvfs.pid = daemon_pid(kvfs.data)
    assert "cleared the dead kvfs mount" in result.stderr
    assert (kvfs.mountpoint / "kept").read_bytes() == b"committed before the kill"


def test_mount_after_a_dead_mount_goes_over_what_engines_wrote_beneath(make_mount,
                                                                      tmp_path: Path) -> None:
    """Engines that store while no kvfs serves the path (its dead mount cleared, the new one
    not yet there) write into the bare directory: the mount command mounts over it rather
    than refuse, which would leave them writing on the disk underneath."""
    kvfs = make_mount()
    beneath = tmp_path / "beneath"  # the mountpoint's parent without the mounts on it
    beneath.mkdir()
    subprocess.run(["mount", "--bind", str(kvfs.mountpoint.parent), str(beneath)], check=True)
    try:
        os.kill(keeper_pid(kvfs.mountpoint), signal.SIGKILL)
        os.kill(kvfs.pid, signal.SIGKILL)
        assert wait_dead(kvfs.pid)
        (beneath / kvfs.mountpoint.name / "vllm").mkdir()  # an engine's store, meanwhile
        result = run_mount(kvfs.mountpoint, kvfs.data)
        assert result.returncode == 0, result.stderr
        kvfs.pid = daemon_pid(kvfs.data)
        assert "hidden under the new mount" in (kvfs.data / "kvfs.log").read_text() + \
            result.stderr
        assert os.listdir(kvfs.mountpoint) == [], "the new mount shows the pool, not the disk"
    finally:
        subprocess.run(["umount", str(beneath)], check=False)


def test_without_a_next_daemon_waiting_requests_fail_after_the_wait(make_mount) -> None:
    """The wait has a deadline: then the keeper lets go, requests fail, and the next mount
    clears the dead mount."""
    kvfs = make_mount("--takeover-wait", "2")
    (kvfs.mountpoint / "kept").write_bytes(b"kept")
    os.kill(kvfs.pid, signal.SIGKILL)
    assert wait_dead(kvfs.pid)
    started = time.monotonic()
    with pytest.raises(OSError) as gone:
        (kvfs.mountpoint / "kept").read_bytes()
    waited = time.monotonic() - started
    assert gone.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    assert 1 <= waited < 10, waited
    kvfs.mount()
    assert (kvfs.mountpoint / "kept").read_bytes() == b"kept"


def test_a_second_mount_beside_a_live_daemon_is_refused(kvfs: KvfsMount) -> None:
    """The keeper hands the connection to no one while its daemon serves."""
    result = run_mount(kvfs.mountpoint, kvfs.data)
    assert result.returncode == 1
    assert "already mounted" in result.stderr
    assert is_mounted(kvfs.mountpoint)
    (kvfs.mountpoint / "still").write_bytes(b"served")
    assert (kvfs.mountpoint / "still").read_bytes() == b"served"


def test_unmount_ends_the_keeper(make_mount) -> None:
    kvfs = make_mount()
    keeper = keeper_pid(kvfs.mountpoint)
    kvfs.unmount()
    assert wait_dead(keeper)
    assert not socket_path(kvfs.mountpoint.resolve()).exists()
