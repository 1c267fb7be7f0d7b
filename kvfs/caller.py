"""Who makes a request: the calling thread's ids, its process and its groups (read from
/proc on demand). Open files record their opener; the prefetcher tells one process's burst of
lookups from another's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes a request: root (CAP_FSETID: writes keep setuid/setgid) or a user."""

    uid: int
    gid: int
    pid: int  # the calling thread

    def _status(self) -> dict[str, str]:
        """The calling thread's /proc status fields (empty if it is gone)."""
        try:
            lines = Path(f"/proc/{self.pid}/status").read_text().splitlines()
        except OSError:
            return {}
        return dict(line.split(":", 1) for line in lines if ":" in line)

    def process_and_command(self) -> tuple[int, str]:
        """The caller's process (thread group: threads of one process share its opens) and
        the calling thread's command name (`ls`, `python3`; "" if the thread is gone)."""
        status = self._status()
        try:
            process = int(status["Tgid"])
        except (KeyError, ValueError):
            process = self.pid
        return process, status.get("Name", "").strip()

    def process(self) -> int:
        return self.process_and_command()[0]

    def in_group(self, gid: int) -> bool:
        """Asked only when a write may clear setgid: supplementary groups are in /proc."""
        return gid == self.gid or str(gid) in self._status().get("Groups", "").split()
