"""--cpu-latency: while requests flow, no CPU enters an idle state slower to wake than the
limit (the kernel's own counts of idle-state entries say so); once they stop, CPUs sleep again.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from conftest import stats, wait_for

CPUS = Path("/sys/devices/system/cpu")
DEVICE = Path("/dev/cpu_dma_latency")


def slow_idle_states() -> list[Path]:
    """The enabled idle states that take a CPU longer than 0 µs to leave."""
    return [state for state in CPUS.glob("cpu[0-9]*/cpuidle/state[0-9]*")
            if int((state / "latency").read_text()) > 0
            and (state / "disable").read_text().strip() == "0"]


def entries(states: list[Path]) -> int:
    """How often CPUs have entered these idle states, so far."""
    return sum(int((state / "usage").read_text()) for state in states)


class Lookups(threading.Thread):
    """Stats of names that do not exist, one after another: a LOOKUP each, until stopped."""

    def __init__(self, directory: Path) -> None:
        super().__init__(daemon=True)
        self.directory = directory
        self.stopped = threading.Event()

    def run(self) -> None:
        number = 0
        while not self.stopped.is_set():
            number += 1
            assert not os.path.exists(self.directory / f"missing-{number}")
            time.sleep(0.001)  # between requests the CPUs are idle: they would sleep

    def stop(self) -> None:
        self.stopped.set()
        self.join()


def test_cpus_stay_quick_to_wake_while_requests_flow(make_mount) -> None:
    if not DEVICE.exists():
        pytest.skip(f"no {DEVICE} (CONFIG_CPU_IDLE / PM QoS)")
    states = slow_idle_states()
    if not states:
        pytest.skip("no cpuidle states with a wake-up latency on this machine")
    root = make_mount("--capacity", "1G", "--cpu-latency", "0").mountpoint
    lookups = Lookups(root)
    lookups.start()
    try:
        assert wait_for(lambda: stats(root)["cpu_latency_held_seconds"] > 0, timeout=10)
        held_before = entries(states)
        time.sleep(0.5)
        entered_while_held = entries(states) - held_before
        held = stats(root)["cpu_latency_held_seconds"]
    finally:
        lookups.stop()
    assert entered_while_held == 0
    assert held >= 0.4
    # Without requests the limit goes within a second (looking at the mount is a request):
    # idle CPUs sleep again, and the time held stops growing.
    time.sleep(1)
    quiet_before = entries(states)
    assert wait_for(lambda: entries(states) > quiet_before, timeout=5)
    assert stats(root)["cpu_latency_held_seconds"] <= held + 1
