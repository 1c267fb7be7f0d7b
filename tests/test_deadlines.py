"""No request waits forever: with the metadata server stopped mid-run (SIGSTOP: connections
are accepted and never answered), every request a client makes answers within the mount's
--deadline, with EIO or from what the kernel and the host already hold, never with a wrong
byte, and the misses are counted. Once the server answers again, everything works again and
nothing was lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import drop_caches, stats, wait_for
from test_shared import assert_pool_counters_exact

DEADLINE = 2.0  # seconds (--deadline); the mounts' default is longer
# A request that has not answered by then hangs: the deadline, twice over, and a loaded
# machine's scheduling. (A bound on hangs, not a measure of speed.)
HANG_BOUND = 3 * DEADLINE + 5

# Each step is one system call a client makes; the child prints, per step, the errno it got
# (0: it succeeded), what a read returned (as hex), and the seconds it took.
STEPS = r"""
import json, os, sys, time
root, results = sys.argv[1], {}
def step(name, call):
    started = time.monotonic()
    try:
        value = call()
        outcome = 0
    except OSError as error:
        value, outcome = None, error.errno
    results[name] = [outcome, value.hex() if isinstance(value, bytes) else None,
                     time.monotonic() - started]
def read(path):
    with open(path, "rb") as file:
        return file.read()
def create(path):
    with open(path, "wb") as file:
        file.write(b"made while the metadata server was stopped")
step("stat_new_name", lambda: os.stat(os.path.join(root, "never-made")) and None)
step("create", lambda: create(os.path.join(root, "new")))
step("read_stored", lambda: read(os.path.join(root, "stored")))
step("listdir", lambda: sorted(os.listdir(root)) and None)
step("unlink", lambda: os.unlink(os.path.join(root, "doomed")))
step("mkdir", lambda: os.mkdir(os.path.join(root, "dir")))
print(json.dumps(results))
"""


def client_steps(root: Path) -> dict[str, list]:
    """Run STEPS in a client process; a step that hangs fails the test (no answer within
    HANG_BOUND per step)."""
    done = subprocess.run([sys.executable, "-c", STEPS, str(root)], capture_output=True,
                          text=True, timeout=HANG_BOUND * 6 + 10)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_stalled_metadata_server_costs_eio_within_the_deadline(shared_pool,
                                                                 redis_server) -> None:
    first, second = shared_pool(2, "--capacity", "256M", "--deadline", str(DEADLINE))
    stored = os.urandom(1 << 20)
    (first.mountpoint / "stored").write_bytes(stored)
    (first.mountpoint / "doomed").write_bytes(b"doomed")
    before = stats(second.mountpoint)
    assert before["metadata_reachable"] is True
    assert redis_server.process is not None
    drop_caches()
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        for host in (first, second):
            results = client_steps(host.mountpoint)
            for name, (outcome, value, seconds) in results.items():
                assert seconds < HANG_BOUND, (host.mountpoint, name, seconds)
                assert outcome in (0, 5), (name, os.strerror(outcome))  # success or EIO
                if name == "read_stored" and outcome == 0:
                    assert bytes.fromhex(value) == stored  # never a wrong byte
            assert results["create"][0] == 5 and results["mkdir"][0] == 5
            # The stats answer while the server is stopped, and count what failed.
            shown = stats(host.mountpoint)
            assert shown["metadata_reachable"] is False
            assert shown["metadata_timeouts"] + shown["metadata_unreachable"] > 0
        assert stats(second.mountpoint)["metadata_timeouts"] > before["metadata_timeouts"]
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    # Back: every host serves the pool again, and what was stored before is whole.
    for host in (first, second):
        assert wait_for(lambda h=host: _read(h.mountpoint / "stored") == stored, 30)
        assert stats(host.mountpoint)["metadata_reachable"] is True
    (second.mountpoint / "after").write_bytes(b"after")
    assert wait_for(lambda: _read(first.mountpoint / "after") == b"after", 20)
    # A step answered EIO either did not happen or happened whole (an unlink or create whose
    # commit Redis ran before the answer was lost): no half state, the counters agree.
    for name in ("new", "doomed"):
        assert _read(first.mountpoint / name) == _read(second.mountpoint / name)
    for host in (first, second):
        shown = stats(host.mountpoint)
        assert shown["handler_errors"] == 0
        assert shown["sessions_reaped"] == 0  # a stalled server declares nobody dead
    assert_pool_counters_exact(first)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None
