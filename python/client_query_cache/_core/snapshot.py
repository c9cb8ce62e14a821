"""Immutable snapshots of a manager's counters and stream states."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from bson.timestamp import Timestamp

from .reasons import StreamState

__all__ = ["CacheSnapshot", "StreamSnapshot"]


@dataclasses.dataclass(frozen=True, slots=True)
class StreamSnapshot:
    """One database's change-stream follower."""

    database: str
    state: StreamState
    #: Change events applied to the arena.
    events: int
    #: Errors after which the stream was reopened.
    reconnects: int
    #: Times every entry of the database was dropped because the stream's
    #: history could not be resumed.
    history_lost: int
    #: The last error, without credentials ("" if none).
    last_error: str
    #: The cluster time up to which every write to the database is reflected
    #: in the cache (the last change event applied, or the time a stream
    #: opened afresh had caught up from); None until the first is known.
    applied_time: Timestamp | None = None
    #: What the stream costs, counted by the process that follows it (None
    #: in a shared-cache worker: see the owner's snapshot): getMore commands
    #: sent, bytes of change events received, events that invalidated
    #: entries.
    getmores: int | None = None
    event_bytes: int | None = None
    invalidations: int | None = None
    #: Invalidation lag, from an event's wallTime to its application in the
    #: arena, over the latest ``lag_samples`` events (at most 256), in ms
    #: (None in a worker, or before the first event).
    lag_samples: int | None = None
    lag_p50_ms: float | None = None
    lag_p95_ms: float | None = None
    lag_max_ms: float | None = None
    #: Seconds the applied time lies behind the newest cluster time this
    #: process's client has seen (0 when caught up; None before the applied
    #: time is known). Writes of the last that many seconds may not be
    #: reflected in the cache yet; a quiet database's stays put on the test
    #: server until its next event.
    behind_client_s: int | None = None
    #: The change stream carrying the database: ``"deployment"`` (one
    #: deployment-wide stream carries every database of the cache) or
    #: ``"database"`` (a stream of its own), and why that scope:
    #: ``""`` for the default, else the reason (asked for with
    #: ``stream_scope="database"``, or the deployment's refusal of a
    #: deployment-wide stream, with the server's error). None in a
    #: shared-cache worker (see the owner's snapshot) or before the database's
    #: first read starts the follower.
    scope: str | None = None
    scope_reason: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """Counters of one manager at one moment."""

    hits: int
    misses: int
    bypasses: Mapping[str, int]
    admissions: int
    rejected_admissions: Mapping[str, int]
    evictions: int
    invalidations: int
    used_bytes: int
    budget_bytes: int
    entries: int
    streams: tuple[StreamSnapshot, ...]
    #: Lookups that found an entry the causal floor refused (it may be older
    #: than what this process has already seen): the read went to MongoDB as
    #: a miss, not counted in ``misses``.
    behind: int = 0
    #: Payload bytes of entries a lookup could serve, and the rest of the
    #: payload rings' bytes: entries invalidated or replaced but not yet
    #: reclaimed, conflict markers, padding (docs/architecture.md, eviction).
    live_bytes: int = 0
    dead_bytes: int = 0
    #: The eviction policy's work (S3-FIFO): entries hit often enough in the
    #: small ring copied to the main ring, main-ring entries hit since their
    #: last move copied to its head, entries evicted though hit because the
    #: copy allowance was spent, keys admitted straight to the main ring
    #: because they had been evicted from the small ring recently, and
    #: invalidated entries reclaimed (not counted in ``evictions``).
    promotions: int = 0
    reinsertions: int = 0
    forced_evictions: int = 0
    ghost_hits: int = 0
    reclaimed: int = 0
    #: This process's templates of the entries it hits (docs/api.md): hits
    #: served from one (counted in ``hits`` too), templates kept and their
    #: estimated size (at most the manager's ``template_bytes``).
    template_hits: int = 0
    templates: int = 0
    template_bytes: int = 0

    @property
    def bypass_total(self) -> int:
        return sum(self.bypasses.values())
