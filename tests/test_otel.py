"""The OpenTelemetry bridge (client_query_cache.otel) reports the manager's
snapshot: real reads against the test server, collected with the SDK's
InMemoryMetricReader."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from client_query_cache import BypassReason, CacheSnapshot, RejectReason, StreamSnapshot, StreamState
from client_query_cache.otel import INSTRUMENTS, METER_NAME, instrument
from support import DEADLINE_S, ready_collection, stream_of, wait_until

Points = dict[tuple[str, frozenset[tuple[str, Any]]], float]


@pytest.fixture
def otel() -> Any:
    """An SDK MeterProvider with an in-memory reader: (reader, provider)."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield reader, provider
    provider.shutdown()


def collect(reader: InMemoryMetricReader) -> Points:
    """Every data point of one collection: (name, attributes) -> value."""
    points: Points = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            assert scope.scope.name == METER_NAME
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    points[(metric.name, frozenset(point.attributes.items()))] = point.value
    return points


def expected(snapshot: CacheSnapshot, base: dict[str, Any]) -> Points:
    """What the bridge must report for ``snapshot``."""
    b = frozenset(base.items())
    out: Points = {
        ("cqc.hits", b): snapshot.hits,
        ("cqc.misses", b): snapshot.misses,
        ("cqc.admissions", b): snapshot.admissions,
        ("cqc.evictions", b): snapshot.evictions,
        ("cqc.invalidations", b): snapshot.invalidations,
        ("cqc.arena.entries", b): snapshot.entries,
        ("cqc.arena.used_bytes", b): snapshot.used_bytes,
        ("cqc.arena.budget_bytes", b): snapshot.budget_bytes,
    }
    for reason in BypassReason:
        out[("cqc.bypasses", b | {("reason", reason.value)})] = snapshot.bypasses.get(reason.value, 0)
    for reject in RejectReason:
        out[("cqc.rejected_admissions", b | {("reason", reject.value)})] = snapshot.rejected_admissions.get(
            reject.value, 0
        )
    for stream in snapshot.streams:
        db = b | {("database", stream.database)}
        out[("cqc.stream.events", db)] = stream.events
        out[("cqc.stream.reconnects", db)] = stream.reconnects
        out[("cqc.stream.history_lost", db)] = stream.history_lost
        for name, value in (
            ("cqc.stream.getmores", stream.getmores),
            ("cqc.stream.event_bytes", stream.event_bytes),
            ("cqc.stream.invalidations", stream.invalidations),
            ("cqc.stream.behind_client", stream.behind_client_s),
        ):
            if value is not None:
                out[(name, db)] = value
        for quantile, value in (("p50", stream.lag_p50_ms), ("p95", stream.lag_p95_ms), ("max", stream.lag_max_ms)):
            if value is not None:
                out[("cqc.stream.lag", db | {("quantile", quantile)})] = value
        for state in StreamState:
            out[("cqc.stream.state", db | {("state", state.value)})] = 1 if stream.state is state else 0
    return out


def collect_quiet(reader: InMemoryMetricReader, manager: Any) -> tuple[Points, CacheSnapshot]:
    """A collection and the snapshot it must equal: the snapshots taken just
    before and just after agree (no change event landed in between)."""
    for _ in range(50):
        before = manager.snapshot()
        points = collect(reader)
        after = manager.snapshot()
        if before == after:
            return points, after
    raise AssertionError("the cache never stood still for one collection")


def test_exported_values_equal_the_snapshot_and_follow_hits_and_misses(
    manager: Any, client: Any, db_name: str, otel: Any
) -> None:
    reader, provider = otel
    client[db_name]["items"].insert_many([{"_id": i, "v": f"value {i}"} for i in range(3)])
    coll = ready_collection(manager, db_name, "items")
    attrs = {"service": "test"}
    instrument(manager, meter_provider=provider, attributes=attrs)

    points, snap0 = collect_quiet(reader, manager)
    assert points == expected(snap0, attrs)
    assert points[("cqc.stream.state", frozenset({**attrs, "database": db_name, "state": "healthy"}.items()))] == 1

    # A miss: counted, admitted, one more entry holding bytes.
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": "value 1"}
    points, snap1 = collect_quiet(reader, manager)
    assert points == expected(snap1, attrs)
    key = frozenset(attrs.items())
    assert points[("cqc.misses", key)] == snap0.misses + 1
    assert points[("cqc.hits", key)] == snap0.hits
    assert points[("cqc.admissions", key)] == snap0.admissions + 1
    assert points[("cqc.arena.entries", key)] == snap0.entries + 1
    assert points[("cqc.arena.used_bytes", key)] > snap0.used_bytes

    # Two hits and a bypass with its reason.
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": "value 1"}
    assert coll.find_one(1) == {"_id": 1, "v": "value 1"}
    assert coll.find_one({"_id": 2}, hint=[("_id", 1)]) == {"_id": 2, "v": "value 2"}
    points, snap2 = collect_quiet(reader, manager)
    assert points == expected(snap2, attrs)
    assert points[("cqc.hits", key)] == snap1.hits + 2
    assert points[("cqc.misses", key)] == snap1.misses
    hint = ("cqc.bypasses", key | {("reason", BypassReason.UNSUPPORTED_OPTION.value)})
    assert points[hint] == snap1.bypasses.get("unsupported_option", 0) + 1

    # A write: its change event invalidates, and the next read misses again.
    events = stream_of(manager, db_name).events
    client[db_name]["items"].update_one({"_id": 1}, {"$set": {"v": "changed"}})
    wait_until(lambda: stream_of(manager, db_name).events > events, timeout=DEADLINE_S, what="the update's event")
    assert wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": "changed"}, what="the new version")
    points, snap3 = collect_quiet(reader, manager)
    assert points == expected(snap3, attrs)
    assert points[("cqc.invalidations", key)] > snap2.invalidations
    assert points[("cqc.stream.events", key | {("database", db_name)})] > events
    assert points[("cqc.misses", key)] > snap2.misses


class _CountingManager:
    """A manager stand-in that counts snapshots."""

    def __init__(self, snapshot: CacheSnapshot) -> None:
        self.value = snapshot
        self.calls = 0

    def snapshot(self) -> CacheSnapshot:
        self.calls += 1
        return self.value


def _snapshot(hits: int) -> CacheSnapshot:
    return CacheSnapshot(
        hits=hits, misses=0, bypasses={}, admissions=0, rejected_admissions={}, evictions=0,
        invalidations=0, used_bytes=0, budget_bytes=1 << 20, entries=0,
        streams=(
            StreamSnapshot(
                "app", StreamState.HEALTHY, 0, 0, 0, "", getmores=3, event_bytes=512, invalidations=2,
                lag_samples=2, lag_p50_ms=1.5, lag_p95_ms=2.5, lag_max_ms=2.5, behind_client_s=0,
            ),
        ),
    )  # fmt: skip


def test_one_collection_takes_one_snapshot_and_close_stops_reporting(otel: Any) -> None:
    reader, provider = otel
    fake = _CountingManager(_snapshot(hits=5))
    metrics = instrument(fake, meter_provider=provider)
    assert collect(reader)[("cqc.hits", frozenset())] == 5
    assert fake.calls == 1
    fake.value = _snapshot(hits=9)
    assert collect(reader)[("cqc.hits", frozenset())] == 9
    assert fake.calls == 2
    assert set(INSTRUMENTS) == {name for name, _ in collect(reader)}
    metrics.close()
    calls = fake.calls
    assert not any(name.startswith("cqc.") for name, _ in collect(reader))
    assert fake.calls == calls


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


def test_import_without_opentelemetry_names_the_extra() -> None:
    result = _run(
        """
        import sys
        sys.modules["opentelemetry"] = None  # as if not installed
        import client_query_cache.otel
        """
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "pip install 'client-query-cache[otel]'" in result.stderr


def test_only_the_api_is_needed() -> None:
    result = _run(
        """
        import sys
        sys.modules["opentelemetry.sdk"] = None  # the SDK is the application's choice
        import pymongo
        from client_query_cache import CacheManager
        from client_query_cache.otel import instrument
        manager = CacheManager(pymongo.MongoClient("mongodb://127.0.0.1:1/", connect=False))
        metrics = instrument(manager)  # the global (no-op) provider
        print(sorted(metrics.instruments) == sorted(%r))
        manager.close()
        """
        % sorted(INSTRUMENTS)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_a_counter_never_reports_less_than_before_and_a_gauge_follows(otel: Any) -> None:
    reader, provider = otel
    fake = _CountingManager(_snapshot(hits=9))
    instrument(fake, meter_provider=provider)
    assert collect(reader)[("cqc.hits", frozenset())] == 9
    # A snapshot taken between two steps of one read can count one more than
    # the next: the counter holds its value instead of going back.
    fake.value = dataclasses.replace(_snapshot(hits=8), used_bytes=100)
    points = collect(reader)
    assert points[("cqc.hits", frozenset())] == 9
    assert points[("cqc.arena.used_bytes", frozenset())] == 100
    fake.value = dataclasses.replace(_snapshot(hits=10), used_bytes=50)
    points = collect(reader)
    assert points[("cqc.hits", frozenset())] == 10
    assert points[("cqc.arena.used_bytes", frozenset())] == 50
