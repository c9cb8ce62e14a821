"""Helpers shared by the cache suites (imported as ``support``).

Invalidation is asynchronous (a write reaches the cache through the change
stream), so tests wait for an observable condition with a deadline instead of
sleeping a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from client_query_cache import CachedCollection, CacheManager, StreamSnapshot

T = TypeVar("T")

#: Longest a test waits for something the change stream delivers in
#: milliseconds when all is well: generous for a loaded 2-core machine.
DEADLINE_S = 15.0

#: Managers in tests wait this long for change events, so a stream that makes
#: no progress stops serving after 2 * 200 + 2000 ms (see CacheConfig).
TEST_MAX_AWAIT_MS = 200
#: That bound in seconds.
STALL_BOUND_S = (2 * TEST_MAX_AWAIT_MS + 2000) / 1000

#: The stream application name the C followers announce (stream.c).
STREAM_APP_NAME = "client-query-cache-stream"


def wait_until(
    predicate: Callable[[], T], *, timeout: float = DEADLINE_S, interval: float = 0.01, what: str
) -> T:
    """Call ``predicate`` until it returns something truthy and return that;
    fail the test with ``what`` when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(interval)


def stream_of(manager: CacheManager, database: str) -> StreamSnapshot:
    """The snapshot of ``database``'s change stream (it must exist)."""
    streams = [s for s in manager.snapshot().streams if s.database == database]
    assert len(streams) == 1, f"expected one stream for {database!r}, got {streams!r}"
    return streams[0]


def ready_collection(
    manager: CacheManager, db_name: str, coll_name: str, **options: Any
) -> CachedCollection:
    """Wrap ``db_name.coll_name`` and wait until its database's stream serves."""
    coll = manager[db_name].get_collection(coll_name, **options)
    assert manager.wait_ready(DEADLINE_S, database=db_name), (
        f"the change stream of {db_name!r} did not become ready: {manager.snapshot()!r}"
    )
    return coll


def bypass_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per-reason increase of the bypass counters between two snapshots."""
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a read did, comparable between the cache and PyMongo: its result,
    or the class (and server error code) of what it raised."""
    try:
        return ("returned", call())
    except Exception as exc:  # noqa: BLE001 - comparing behaviours
        return ("raised", type(exc), getattr(exc, "code", None))
