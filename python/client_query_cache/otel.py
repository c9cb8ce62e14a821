"""OpenTelemetry metrics for a cache manager (optional extra).

    pip install 'client-query-cache[otel]'

    from client_query_cache.otel import instrument
    metrics = instrument(manager)          # the global MeterProvider
    metrics = instrument(manager, meter_provider=provider, attributes={"app": "api"})

``instrument`` registers observable instruments whose values are read from
``manager.snapshot()`` whenever a metric reader collects: nothing is counted
twice and nothing runs on the read path. Every collection takes one snapshot
and all instruments report from it, so the values of one collection agree
with each other. Only ``opentelemetry-api`` is imported; the application
chooses the SDK, readers and exporters.

Instruments (meter ``client_query_cache``); every observation also carries
the ``attributes`` given to ``instrument``:

=============================  ==============  ==========================  ==================
name                           kind            attributes                  snapshot field
=============================  ==============  ==========================  ==================
``cqc.hits``                   counter         -                           ``hits``
``cqc.misses``                 counter         -                           ``misses``
``cqc.bypasses``               counter         ``reason``                  ``bypasses``
``cqc.admissions``             counter         -                           ``admissions``
``cqc.rejected_admissions``    counter         ``reason``                  ``rejected_admissions``
``cqc.evictions``              counter         -                           ``evictions``
``cqc.invalidations``          counter         -                           ``invalidations``
``cqc.arena.entries``          gauge           -                           ``entries``
``cqc.arena.used_bytes``       gauge           -                           ``used_bytes``
``cqc.arena.budget_bytes``     gauge           -                           ``budget_bytes``
``cqc.stream.state``           gauge           ``database``, ``state``     ``streams[].state``
``cqc.stream.events``          counter         ``database``                ``streams[].events``
``cqc.stream.reconnects``      counter         ``database``                ``streams[].reconnects``
``cqc.stream.history_lost``    counter         ``database``                ``streams[].history_lost``
``cqc.stream.getmores``        counter         ``database``                ``streams[].getmores``
``cqc.stream.event_bytes``     counter         ``database``                ``streams[].event_bytes``
``cqc.stream.invalidations``   counter         ``database``                ``streams[].invalidations``
``cqc.stream.lag``             gauge           ``database``, ``quantile``  ``streams[].lag_*_ms``
``cqc.stream.behind_client``   gauge           ``database``                ``streams[].behind_client_s``
=============================  ==============  ==========================  ==================

``cqc.bypasses`` and ``cqc.rejected_admissions`` report every
:class:`BypassReason` / :class:`RejectReason` (0 until it happens);
``cqc.stream.state`` reports 1 for a database's current state and 0 for the
other states. ``cqc.stream.getmores`` is the follower's count, the same in
every database's series (one stream carries them all): take one, do not
sum them. ``cqc.stream.lag`` reports the invalidation lag of the
latest events (``quantile`` ``p50``, ``p95``, ``max``, in ms); it and the
stream cost counters report nothing for a shared-cache worker, whose
streams are its owner's. A counter never reports less than it reported before (a
snapshot taken in the middle of a read can be one ahead of the next). See
docs/operations.md for what each value means.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

try:
    from opentelemetry import metrics as _otel_metrics
    from opentelemetry.metrics import CallbackOptions, Observation
except ImportError as exc:  # pragma: no cover - exercised by test_otel in a subprocess
    raise ImportError(
        "client_query_cache.otel needs the OpenTelemetry API: "
        "pip install 'client-query-cache[otel]'"
    ) from exc

from . import __version__
from ._core.errors import CacheError
from ._core.reasons import BypassReason, RejectReason, StreamState
from ._core.snapshot import CacheSnapshot

__all__ = ["instrument", "CacheMetrics", "METER_NAME", "INSTRUMENTS"]

#: The name of the meter the instruments are created on.
METER_NAME = "client_query_cache"

#: name -> (kind, unit, description) of every instrument ``instrument`` creates.
INSTRUMENTS: dict[str, tuple[str, str, str]] = {
    "cqc.hits": ("counter", "{read}", "Reads answered from the cache"),
    "cqc.misses": ("counter", "{read}", "Lookups that found no valid entry"),
    "cqc.bypasses": ("counter", "{read}", "Reads sent to PyMongo unchanged, by reason"),
    "cqc.admissions": ("counter", "{entry}", "Results stored in the arena"),
    "cqc.rejected_admissions": ("counter", "{entry}", "Results not stored, by reason"),
    "cqc.evictions": ("counter", "{entry}", "Entries removed to make room"),
    "cqc.invalidations": ("counter", "{invalidation}", "Invalidations applied from change events"),
    "cqc.arena.entries": ("gauge", "{entry}", "Entries in the arena's table"),
    "cqc.arena.used_bytes": ("gauge", "By", "Payload bytes held by entries"),
    "cqc.arena.budget_bytes": ("gauge", "By", "Payload bytes the arena may hold"),
    "cqc.stream.state": ("gauge", "1", "1 for the change stream's current state, else 0"),
    "cqc.stream.events": ("counter", "{event}", "Change events applied"),
    "cqc.stream.reconnects": ("counter", "{reconnect}", "Times the change stream was reopened after an error"),
    "cqc.stream.history_lost": ("counter", "{drop}", "Times every entry of the database was dropped"),
    "cqc.stream.getmores": ("counter", "{command}", "getMore commands the change stream sent"),
    "cqc.stream.event_bytes": ("counter", "By", "Bytes of the change events received"),
    "cqc.stream.invalidations": ("counter", "{event}", "Change events that invalidated entries"),
    "cqc.stream.lag": ("gauge", "ms", "From a change event's wallTime to its application, latest events"),
    "cqc.stream.behind_client": ("gauge", "s", "Seconds the applied time lies behind the client's cluster time"),
}


class CacheMetrics:
    """The instruments registered for one manager (``instrument`` returns it).

    ``close()`` stops reporting: the instruments stay registered with the
    meter (the OpenTelemetry API cannot remove them) but observe nothing.
    """

    __slots__ = ("_manager", "_attributes", "_lock", "_snapshot", "_seen", "_closed", "_high", "instruments")

    def __init__(self, manager: Any, meter: Any, attributes: Mapping[str, Any] | None = None) -> None:
        if not callable(getattr(manager, "snapshot", None)):
            raise TypeError(
                f"manager must be a CacheManager or AsyncCacheManager, not {type(manager).__name__}"
            )
        if attributes is not None and (
            not isinstance(attributes, Mapping) or not all(isinstance(key, str) for key in attributes)
        ):
            raise TypeError("attributes must be a mapping with str keys, or None")
        self._manager = manager
        self._attributes = dict(attributes or {})
        self._lock = threading.Lock()
        self._snapshot: CacheSnapshot | None = None
        #: Instruments that reported from the current snapshot: the next
        #: callback of one of them takes a new snapshot, so each collection
        #: reads one snapshot, whatever order the SDK calls callbacks in.
        self._seen: set[str] = set()
        self._closed = False
        #: The highest value each counter series has reported: a counter
        #: never reports less (see _monotonic).
        self._high: dict[tuple[str, frozenset[tuple[str, Any]]], float] = {}
        observers: dict[str, Callable[[CacheSnapshot], Iterable[tuple[float, dict[str, Any]]]]] = {
            "cqc.hits": lambda s: [(s.hits, {})],
            "cqc.misses": lambda s: [(s.misses, {})],
            "cqc.bypasses": lambda s: _by_reason(s.bypasses, BypassReason),
            "cqc.admissions": lambda s: [(s.admissions, {})],
            "cqc.rejected_admissions": lambda s: _by_reason(s.rejected_admissions, RejectReason),
            "cqc.evictions": lambda s: [(s.evictions, {})],
            "cqc.invalidations": lambda s: [(s.invalidations, {})],
            "cqc.arena.entries": lambda s: [(s.entries, {})],
            "cqc.arena.used_bytes": lambda s: [(s.used_bytes, {})],
            "cqc.arena.budget_bytes": lambda s: [(s.budget_bytes, {})],
            "cqc.stream.state": _stream_states,
            "cqc.stream.events": lambda s: [(st.events, {"database": st.database}) for st in s.streams],
            "cqc.stream.reconnects": lambda s: [(st.reconnects, {"database": st.database}) for st in s.streams],
            "cqc.stream.history_lost": lambda s: [(st.history_lost, {"database": st.database}) for st in s.streams],
            "cqc.stream.getmores": lambda s: _per_stream(s, "getmores"),
            "cqc.stream.event_bytes": lambda s: _per_stream(s, "event_bytes"),
            "cqc.stream.invalidations": lambda s: _per_stream(s, "invalidations"),
            "cqc.stream.lag": _stream_lag,
            "cqc.stream.behind_client": lambda s: _per_stream(s, "behind_client_s"),
        }
        created = {}
        for name, (kind, unit, description) in INSTRUMENTS.items():
            factory = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            observe = observers[name]
            if kind == "counter":
                observe = self._monotonic(name, observe)
            created[name] = factory(name, callbacks=[self._callback(name, observe)], unit=unit, description=description)
        #: name -> the OpenTelemetry instrument.
        self.instruments = created

    def _callback(
        self, name: str, observe: Callable[[CacheSnapshot], Iterable[tuple[float, dict[str, Any]]]]
    ) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(_options: CallbackOptions) -> list[Observation]:
            snapshot = self._current(name)
            if snapshot is None:
                return []
            base = self._attributes
            return [Observation(value, {**base, **attrs}) for value, attrs in observe(snapshot)]

        return callback

    def _monotonic(
        self, name: str, observe: Callable[[CacheSnapshot], Iterable[tuple[float, dict[str, Any]]]]
    ) -> Callable[[CacheSnapshot], list[tuple[float, dict[str, Any]]]]:
        """A counter's observations, never below what the series reported
        before. A snapshot read while another thread is between two steps of
        one read can count a miss that the next step takes back (a limited
        ``find`` looks up two keys and counts one), or a shared-mode worker's
        hits twice while it re-attaches; a metrics backend would take the
        decrease that follows for a counter reset."""

        def observe_monotonic(snapshot: CacheSnapshot) -> list[tuple[float, dict[str, Any]]]:
            out = []
            with self._lock:
                for value, attrs in observe(snapshot):
                    series = (name, frozenset(attrs.items()))
                    value = max(value, self._high.get(series, value))
                    self._high[series] = value
                    out.append((value, attrs))
            return out

        return observe_monotonic

    def _current(self, name: str) -> CacheSnapshot | None:
        with self._lock:
            if self._closed:
                return None
            if self._snapshot is None or name in self._seen:
                try:
                    self._snapshot = self._manager.snapshot()
                except CacheError:
                    return None  # e.g. a manager inherited across fork(): nothing to report
                self._seen.clear()
            self._seen.add(name)
            return self._snapshot

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop reporting (idempotent)."""
        with self._lock:
            self._closed = True
            self._snapshot = None


def _by_reason(counts: Mapping[str, int], reasons: type[BypassReason] | type[RejectReason]) -> list[tuple[float, dict[str, Any]]]:
    values = {reason.value: 0 for reason in reasons}
    values.update(counts)
    return [(count, {"reason": reason}) for reason, count in values.items()]


def _per_stream(snapshot: CacheSnapshot, field: str) -> list[tuple[float, dict[str, Any]]]:
    """Each stream's ``field``, where this process knows it (not None)."""
    return [
        (value, {"database": stream.database})
        for stream in snapshot.streams
        if (value := getattr(stream, field)) is not None
    ]


def _stream_lag(snapshot: CacheSnapshot) -> list[tuple[float, dict[str, Any]]]:
    return [
        (value, {"database": stream.database, "quantile": quantile})
        for stream in snapshot.streams
        for quantile, value in (("p50", stream.lag_p50_ms), ("p95", stream.lag_p95_ms), ("max", stream.lag_max_ms))
        if value is not None
    ]


def _stream_states(snapshot: CacheSnapshot) -> list[tuple[float, dict[str, Any]]]:
    return [
        (1 if stream.state is state else 0, {"database": stream.database, "state": state.value})
        for stream in snapshot.streams
        for state in StreamState
    ]


def instrument(
    manager: Any,
    *,
    meter_provider: Any = None,
    attributes: Mapping[str, Any] | None = None,
) -> CacheMetrics:
    """Register the cache's instruments for ``manager`` (a ``CacheManager``
    or ``AsyncCacheManager``) on the meter ``client_query_cache`` of
    ``meter_provider`` (default: the global one, ``metrics.get_meter``).
    ``attributes`` are added to every observation, e.g. to tell several
    managers of one process apart. Returns the :class:`CacheMetrics`.

    Raises ``TypeError`` naming the argument if ``manager`` has no
    ``snapshot()``, ``meter_provider`` no ``get_meter()``, or ``attributes``
    is not a mapping with ``str`` keys."""
    if meter_provider is not None and not callable(getattr(meter_provider, "get_meter", None)):
        raise TypeError(
            f"meter_provider must be an OpenTelemetry MeterProvider or None, not {type(meter_provider).__name__}"
        )
    meter = _otel_metrics.get_meter(METER_NAME, __version__, meter_provider)
    return CacheMetrics(manager, meter, attributes)
