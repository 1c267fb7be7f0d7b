"""Quick wake-ups while requests flow (`--cpu-latency`): the kernel's CPU latency QoS.

Every FUSE request wakes two threads: the daemon's when the request arrives and the caller's
when it is answered. A CPU waiting in a deep idle state (in a VM: halted) takes tens of µs to
wake, and on the 2-vCPU VM of docs/benchmarks.md that was most of a store's time. While
requests flow, kvfs asks the kernel to keep every CPU's wake-up latency under a limit, by
holding /dev/cpu_dma_latency open with the limit written to it (what tuned's
latency-performance profile does); 0 µs keeps idle CPUs polling. After `QUIET_SECONDS`
without a request kvfs closes it, and CPUs sleep as deep as they like again. The price is
power: while the limit holds, idle CPUs spin instead of sleeping.
"""

from __future__ import annotations

import logging
import os
import struct

import trio

from kvfs.stats import Stats

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"
CHECK_SECONDS = 0.05  # how often the request count is looked at
QUIET_SECONDS = 0.25  # the limit goes after this long without a request


class CpuLatency:
    def __init__(self, limit_us: int, stats: Stats, device: str = DEVICE) -> None:
        self.limit_us = limit_us
        self.stats = stats
        self.device = device
        self._fd: int | None = None

    async def run(self) -> None:
        """Hold the limit while the daemon answers requests; drop it when they stop."""
        log.info("--cpu-latency: CPUs kept under %d µs of wake-up while requests flow",
                 self.limit_us)
        seen = self.stats.requests.answered()
        last_request = held_since = 0.0
        while True:
            answered, now = self.stats.requests.answered(), trio.current_time()
            if answered != seen:
                seen, last_request = answered, now
                if self._fd is None:
                    if not self._hold():
                        return  # (warned) CPUs sleep as usual
                    held_since = now
            elif self._fd is not None and now - last_request >= QUIET_SECONDS:
                self._release()
            if self._fd is not None:
                self.stats.cpu_latency_held_seconds += now - held_since
                held_since = now
            await trio.sleep(CHECK_SECONDS)

    def _hold(self) -> bool:
        try:
            fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as error:
            log.warning("--cpu-latency: cannot open %s (%s); CPUs sleep as usual",
                        self.device, error.strerror)
            return False
        try:
            os.write(fd, struct.pack("=i", self.limit_us))
        except OSError as error:
            os.close(fd)
            log.warning("--cpu-latency: %s refused %d µs (%s); CPUs sleep as usual",
                        self.device, self.limit_us, error.strerror)
            return False
        self._fd = fd
        return True

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the kernel drops the request with its last descriptor
            self._fd = None

    def close(self) -> None:
        self._release()
