"""The hosts of a shared pool (kvfs/pool/sessions.py): their sessions, the blobs each holds open,
and the boot a mount runs in."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvfs.engines.interface import CLAIM_PREFIX, Txn
from kvfs.meta.core import MetaCore
from kvfs.meta.schema import LIVE_SESSION, u64


@runtime_checkable
class OwnRecords(Protocol):
    """A shared engine told which records this host alone writes (kvfs/engines/redis_engine.py):
    changes read them from memory, their commits still check them."""

    def own(self, family: str, key: bytes, value: bytes) -> None: ...


class Pool:
    """Sessions and holds of the hosts that mount the volume."""

    def __init__(self, core: MetaCore) -> None:
        self.core = core
        self.engine = core.engine

    def register_session(self, session: bytes, record: bytes) -> None:
        """A new session: its record, and the mark that its staging directory is its own
        (`LIVE_SESSION`, which its content commits check)."""
        def change(txn: Txn) -> None:
            txn.put("sessions", session, record)
            txn.put("settings", LIVE_SESSION + session, b"1")
        self.core.change(change)
        if isinstance(self.engine, OwnRecords):
            self.engine.own("settings", LIVE_SESSION + session, b"1")

    def update_session(self, session: bytes, record: bytes) -> bool:
        """Replace a session's record; False (nothing written) if a reaper claimed it."""
        def change(txn: Txn) -> bool:
            if txn.get("sessions", session) is None:
                return False
            txn.put("sessions", session, record)
            return True
        return self.core.change(change)

    def sessions(self) -> dict[bytes, bytes]:
        with self.engine.snapshot() as txn:
            return {bytes(key): bytes(value) for key, value in txn.scan("sessions")}

    def end_session(self, session: bytes) -> bool:
        """Remove a session and its holds; False if it was gone (another host claimed it)."""
        def change(txn: Txn) -> bool:
            if not txn.delete("sessions", session):
                return False
            txn.discard("settings", LIVE_SESSION + session)
            txn.discard("counters", CLAIM_PREFIX + session)
            for blob in self.core.suffixes(txn, "holding", session):
                txn.discard("holding", session + blob)
                txn.discard("held", blob + session)
            return True
        return self.core.change(change)

    def claim(self, amount: int) -> tuple[bool, int, int]:
        """Claim `amount` more bytes of the pool's room for this mount's writers (negative:
        give back); (granted, capacity, committed and claimed bytes before). ESTALE where
        a reaper ended this mount's session (its claim went with it)."""
        session = self.core.session
        return self.engine.claim(session, amount,
                                 LIVE_SESSION + session if self.engine.shared else None)

    def add_claim(self, amount: int) -> None:
        """Add to this mount's claim whatever the room left (what its writers staged already)."""
        def change(txn: Txn) -> None:
            txn.add("counters", CLAIM_PREFIX + self.core.session, amount)
        self.core.change(change)

    def end_claim(self) -> None:
        """This mount's writers hold no room."""
        def change(txn: Txn) -> None:
            txn.discard("counters", CLAIM_PREFIX + self.core.session)
        self.core.change(change)

    def drop_claims(self, live: set[bytes]) -> int:
        """End the claims of sessions not in `live` (a crash left them, or a give-back that
        reached Redis after the reaper); how many."""
        with self.engine.snapshot() as txn:
            stray = [key for key in txn.counts("counters") if key.startswith(CLAIM_PREFIX)
                     and key[len(CLAIM_PREFIX):] not in live]

        def change(txn: Txn) -> None:
            for key in stray:
                txn.discard("counters", key)
        if stray:
            self.core.change(change)
        return len(stray)

    def drop_holds(self, session: bytes) -> None:
        """Remove every hold `session` has (a session that ended: its record is gone)."""
        def change(txn: Txn) -> None:
            for blob in self.core.suffixes(txn, "holding", session):
                txn.discard("holding", session + blob)
                txn.discard("held", blob + session)
        self.core.change(change)

    def hold(self, blob_id: int, session: bytes) -> None:
        self.core.change(lambda txn: self.core.record_hold(txn, blob_id, session))

    def release(self, blob_id: int, session: bytes) -> None:
        self.release_many([blob_id], session)

    def release_many(self, blob_ids: list[int], session: bytes) -> None:
        def change(txn: Txn) -> None:
            for blob_id in blob_ids:
                txn.discard("held", u64(blob_id) + session)
                txn.discard("holding", session + u64(blob_id))
        self.core.change(change)

    def holders(self, blob_id: int) -> list[bytes]:
        """Sessions that hold `blob_id` open."""
        with self.engine.snapshot() as txn:
            return self.core.holders(txn, blob_id)

    def swap_boot(self, boot: bytes) -> bytes | None:
        """Record the boot this mount runs in; returns the one recorded before."""
        def change(txn: Txn) -> bytes | None:
            before = txn.get("settings", b"boot")
            txn.put("settings", b"boot", boot)
            return None if before is None else bytes(before)
        return self.core.change(change)
