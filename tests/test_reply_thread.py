"""Replies written by the binding's reply thread (vendor/pyfuse3/README.md):
every reply reaches its caller, whether the loop queued it while requests kept coming, or
after it had gone to sleep (a handler resumed after a worker call), and the mount stays exact.

Each client runs in a subprocess with a timeout: a reply left in the queue fails the test
instead of hanging it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import KvfsMount, assert_counters_exact, stats

CLIENT_SECONDS = 60


@pytest.fixture
def threaded(make_mount) -> KvfsMount:
    mount = make_mount("--capacity", "1G")
    assert "replies written by a thread of their own" in (mount.data / "kvfs.log").read_text()
    return mount


def run_client(code: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                            text=True, timeout=CLIENT_SECONDS)
    assert result.returncode == 0, result.stderr
    return result.stdout


SLEEPY_CALLER = """
import os, sys, time
root = sys.argv[1]
for i in range(40):
    fd = os.open(f"{root}/f{i}", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * 4096)
    os.fsync(fd)  # answered after a worker's fdatasync, when the loop may be asleep
    os.close(fd)
    time.sleep(0.003)  # long enough for the loop to stop polling and sleep
    os.mkdir(f"{root}/d{i}")
    time.sleep(0.003)
print(len(os.listdir(root)))
"""

BUSY_CALLERS = """
import os, sys, threading
root, threads, per_thread = sys.argv[1], 16, 60
def store(t):
    for i in range(per_thread):
        directory = f"{root}/{t:02x}/{i % 7:02x}_g0"
        os.makedirs(directory, exist_ok=True)
        final = f"{directory}/{i:04x}.bin"
        if os.path.exists(final):
            continue
        fd = os.open(final + f".{t}.tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, bytes([t, i]) * 2048)
        os.close(fd)
        os.replace(final + f".{t}.tmp", final)
workers = [threading.Thread(target=store, args=(t,)) for t in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
wrong = [(t, i) for t in range(threads) for i in range(per_thread)
         if open(f"{root}/{t:02x}/{i % 7:02x}_g0/{i:04x}.bin", "rb").read()
         != bytes([t, i]) * 2048]
print(len(wrong))
"""


def test_a_reply_made_after_the_loop_slept_reaches_its_caller(threaded: KvfsMount) -> None:
    assert run_client(SLEEPY_CALLER, str(threaded.mountpoint)).strip() == "80"
    assert stats(threaded.mountpoint)["requests"]["fsync"]["count"] == 40
    assert_counters_exact(threaded.mountpoint, threaded.data)


def test_sixteen_busy_callers_get_every_reply(threaded: KvfsMount) -> None:
    assert run_client(BUSY_CALLERS, str(threaded.mountpoint)).strip() == "0"
    assert stats(threaded.mountpoint)["files"] == 16 * 60
    threaded.remount()
    assert_counters_exact(threaded.mountpoint, threaded.data)
