"""Counters of one replica's KV-event stream, kept by the tracker, the planner and the
transport alike (plain numbers: router/metrics.py exports them)."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class StreamStats:
    """Counters of one replica's event stream (plain numbers; metrics are exported elsewhere)."""

    batches: int = 0
    events_applied: int = 0
    events_ignored: int = 0
    duplicates: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    clears: int = 0
    decode_errors: int = 0
    index_errors: int = 0
    rekey_misses: int = 0
    rekey_unsupported: int = 0
    probes: int = 0
    # rekey_mode "auto": None until a root block was compared, then "agree" or "differ".
    key_check: str | None = None
    disconnects: int = 0
    last_seq: int | None = None
    last_event_ts: float | None = None
    last_received_at: float | None = None

    def lag_s(self, now: float | None = None) -> float | None:
        """Seconds between the newest applied batch's replica timestamp and now."""
        if self.last_event_ts is None:
            return None
        return (time.time() if now is None else now) - self.last_event_ts
