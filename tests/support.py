"""Helpers shared by the cache suites (imported as ``support``).

Invalidation is asynchronous (a write reaches the cache through the change
stream), so tests wait for an observable condition with a deadline instead of
sleeping a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pymongo

from client_query_cache import (
    AsyncCacheManager,
    AsyncCachedCollection,
    BypassReason,
    CachedCollection,
    CacheManager,
    StreamSnapshot,
)

# The stream's application name, as the benchmarks set and count it.
from benchmarks._kit import connections_named, with_app_name  # noqa: F401 (for the tests)

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


async def async_wait_until(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = DEADLINE_S,
    interval: float = 0.01,
    what: str,
) -> T:
    """``wait_until`` for async tests: ``predicate`` may return an awaitable
    (e.g. ``lambda: coll.find_one(...)`` wrapped in a coroutine function),
    and the wait yields to the event loop with ``asyncio.sleep``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        await asyncio.sleep(interval)


def stream_passed_now(manager: CacheManager | AsyncCacheManager, database: str) -> Callable[[], bool]:
    """A predicate: whether ``database``'s stream has covered everything the
    process observed until now (a stream round that began later came back
    empty, or the stream applied up to the client's cluster time now), so
    that the causal floor refuses no entry for what was read before."""
    engine = manager._engine
    token = (engine.client_time(), time.monotonic_ns())
    return lambda: engine.after_allows(engine._db_idx[database], token)


def event_time(coll: Any, write: Callable[[], Any]) -> Any:
    """Make one write to ``coll`` (a PyMongo collection) and return the
    cluster time of its change event, which the cache's applied time reaches
    once it has applied it. (The write's operationTime can lie past it: the
    test server mints cluster times for hellos and empty stream batches.)"""
    with coll.watch(max_await_time_ms=200) as stream:
        write()
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            change = stream.try_next()
            if change is not None:
                return change["clusterTime"]
    raise AssertionError(f"no change event of {coll.full_name} within {DEADLINE_S:g} s")


def settled(manager: CacheManager, database: str) -> None:
    """Wait until ``database``'s stream has covered everything the process
    observed until now: each of a burst of misses in one collection may have
    seen newer documents than the ones before it, so until then only the
    last one's entry is served (the causal floor)."""
    wait_until(stream_passed_now(manager, database), what=f"the stream of {database!r} passes what was read")


def stream_of(manager: CacheManager | AsyncCacheManager, database: str) -> StreamSnapshot:
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


async def async_ready_collection(
    manager: AsyncCacheManager, db_name: str, coll_name: str, **options: Any
) -> AsyncCachedCollection:
    """Wrap ``db_name.coll_name`` and wait (without blocking the loop) until
    its database's stream serves."""
    coll = manager[db_name].get_collection(coll_name, **options)
    assert await manager.wait_ready(DEADLINE_S, database=db_name), (
        f"the change stream of {db_name!r} did not become ready: {manager.snapshot()!r}"
    )
    return coll


def served(manager: CacheManager, read: Callable[[], T], *, what: str = "the read is served from the cache") -> T:
    """Repeat ``read`` until the cache serves it (a hit) and return that
    result. A read can go to MongoDB first (``stream_behind``) while the
    stream has not applied everything the process already observed."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        hits = manager.snapshot().hits
        result = read()
        if manager.snapshot().hits > hits:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {DEADLINE_S:g} s waiting until {what}: {manager.snapshot()!r}")
        time.sleep(0.01)


async def async_served(
    manager: AsyncCacheManager, read: Callable[[], Awaitable[T]], *, what: str = "the read is served from the cache"
) -> T:
    """``served`` for the async API (``read`` returns an awaitable)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        hits = manager.snapshot().hits
        result = await read()
        if manager.snapshot().hits > hits:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {DEADLINE_S:g} s waiting until {what}: {manager.snapshot()!r}")
        await asyncio.sleep(0.01)


# -- one test, both APIs --------------------------------------------------------


async def resolve(x: Any) -> Any:
    """``x`` itself, or what it gives when awaited: the value of a call of
    either API."""
    return await x if inspect.isawaitable(x) else x


class Driver:
    """One API (sync or async) for a test written once and run with both (the
    ``d`` fixture): ``await d.r(call)`` resolves a call of either API, and the
    attributes name the driver's PyMongo client and cache classes.

    Managers and clients made with ``client()`` and ``manager()`` are closed
    at teardown. Documents are seeded, and "another application" writes, with
    the sync fixtures (``client``, ``other_client``) whatever the driver."""

    def __init__(self, name: str, server_uri: str) -> None:
        assert name in ("sync", "async"), name
        self.name = name
        self.is_async = name == "async"
        self.uri = server_uri
        self.Client: type = pymongo.AsyncMongoClient if self.is_async else pymongo.MongoClient
        self.Manager: type = AsyncCacheManager if self.is_async else CacheManager
        self.Collection: type = AsyncCachedCollection if self.is_async else CachedCollection
        self.managers: list[Any] = []
        self.clients: list[Any] = []

    def __repr__(self) -> str:
        return f"Driver({self.name!r})"

    r = staticmethod(resolve)

    def client(self, **options: Any) -> Any:
        """A new PyMongo client of this driver, closed at teardown."""
        mongo = self.Client(self.uri, **options)
        self.clients.append(mongo)
        return mongo

    def manager(self, client: Any = None, **options: Any) -> Any:
        """A manager of this driver over ``client`` (a new client if none) with
        the test settings, closed at teardown."""
        options.setdefault("max_await_time_ms", TEST_MAX_AWAIT_MS)
        cache = self.Manager(self.client() if client is None else client, **options)
        self.managers.append(cache)
        return cache

    async def ready(self, cache: Any, db: str, coll: str = "items", **options: Any) -> Any:
        """Wrap ``db.coll`` (registering it starts its stream) and wait until
        its database's stream serves."""
        view = cache[db].get_collection(coll, **options)
        assert await resolve(cache.wait_ready(DEADLINE_S, database=db)), (
            f"the change stream of {db!r} did not become ready: {cache.snapshot()!r}"
        )
        return view

    async def served(
        self, cache: Any, read: Callable[[], Any], *, what: str = "the read is served from the cache"
    ) -> Any:
        """Repeat ``read`` until the cache serves it (a miss admits, and a
        floor the stream has not reached yet makes a read bypass); its
        result."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            hits = cache.snapshot().hits
            result = await resolve(read())
            if cache.snapshot().hits > hits:
                return result
            if time.monotonic() >= deadline:
                raise AssertionError(f"timed out after {DEADLINE_S:g} s waiting until {what}: {cache.snapshot()!r}")
            await asyncio.sleep(0.01)

    async def wait_until(self, predicate: Callable[[], Any], *, timeout: float = DEADLINE_S, what: str) -> Any:
        """``wait_until`` for either API: ``predicate`` may return an
        awaitable (an ``async def`` predicate, or a call of the async API)."""
        return await async_wait_until(predicate, timeout=timeout, what=what)

    async def docs(self, cursor: Any) -> list[Any]:
        """Every document of a find or aggregate cursor (``aggregate`` of the
        async API is a coroutine that gives the cursor)."""
        cursor = await resolve(cursor)
        if self.is_async:
            return await cursor.to_list(None)
        return list(cursor)

    @contextlib.asynccontextmanager
    async def using(self, cm: Any) -> AsyncIterator[Any]:
        """Enter ``cm`` with ``with`` (sync) or ``async with`` (async)."""
        if self.is_async:
            async with cm as entered:
                yield entered
        else:
            with cm as entered:
                yield entered

    def bound(self, session: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        """``session.bind()``, entered (the session is not ended on exit)."""
        return self.using(session.bind(end_session=False))

    async def close(self) -> None:
        for cache in self.managers:
            await resolve(cache.close())
        for mongo in self.clients:
            await resolve(mongo.close())


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


async def async_outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """``outcome`` of a read of either API (``call()`` may return an
    awaitable: what it gives is the result)."""
    try:
        return ("returned", await resolve(call()))
    except Exception as exc:  # noqa: BLE001 - comparing behaviours
        return ("raised", type(exc), getattr(exc, "code", None))


#: Reads that bypass because of their own arguments, shared by the sync and
#: async bypass tests: (reason, variant, method, args, kwargs). find and
#: aggregate results are compared as lists.
ARGUMENT_BYPASSES: list[tuple[BypassReason, str, str, tuple[Any, ...], dict[str, Any]]] = [
    (BypassReason.UNSUPPORTED_OPTION, "hint", "find_one", ({"v": "one"},), {"hint": [("_id", 1)]}),
    (BypassReason.UNSUPPORTED_OPTION, "estimated_collation", "estimated_document_count", (), {"collation": {"locale": "en"}}),
    (BypassReason.UNSUPPORTED_OPTION, "two_positional", "find_one", ({"_id": 1}, None, 0), {}),
    (BypassReason.UNSUPPORTED_OPTION, "count_hint", "count_documents", ({},), {"hint": "_id_"}),
    (BypassReason.UNSUPPORTED_OPTION, "distinct_hint", "distinct", ("v",), {"hint": "_id_"}),
    (BypassReason.UNSUPPORTED_OPTION, "aggregate_hint", "aggregate", ([{"$match": {"v": "one"}}],), {"hint": "_id_"}),
    (BypassReason.UNSUPPORTED_OPTION, "estimated_extra", "estimated_document_count", (), {"query": {"v": "one"}}),
    (BypassReason.UNSUPPORTED_OPTION, "find_hint", "find", ({"v": "one"},), {"hint": [("_id", 1)]}),
    (BypassReason.UNSUPPORTED_OPTION, "find_negative_limit", "find", ({},), {"limit": -1}),
    (BypassReason.UNKNOWN_OPTION, "bogus_keyword", "find_one", ({"_id": 1},), {"bogus": 1}),
    (BypassReason.NONDETERMINISTIC, "meta_projection", "find_one", ({"_id": 1}, {"score": {"$meta": "textScore"}}), {}),
    (BypassReason.NONDETERMINISTIC, "where", "find_one", ({"$where": "this.v == 'one'"},), {}),
    (BypassReason.NONDETERMINISTIC, "now", "count_documents", ({"$expr": {"$lt": ["$ts", "$$NOW"]}},), {}),
    (BypassReason.NONDETERMINISTIC, "rand", "distinct", ("v", {"$expr": {"$lt": [{"$rand": {}}, 2]}}), {}),
    (BypassReason.NONDETERMINISTIC, "find_text", "find", ({"$text": {"$search": "one"}},), {}),
    (
        BypassReason.NONDETERMINISTIC,
        "sample",
        "aggregate",
        ([{"$sample": {"size": 1}}, {"$project": {"_id": 0, "x": {"$literal": 1}}}],),
        {},
    ),
    (BypassReason.UNKNOWN_OPERATOR, "near", "find_one", ({"loc": {"$near": [0, 0]}},), {}),
    (BypassReason.UNKNOWN_OPERATOR, "json_schema", "count_documents", ({"$jsonSchema": {"required": ["v"]}},), {}),
    (BypassReason.UNKNOWN_OPERATOR, "unknown_stage", "aggregate", ([{"$documents": [{"x": 1}]}],), {}),
    (
        BypassReason.OTHER_COLLECTION,
        "lookup",
        "aggregate",
        ([{"$match": {"_id": 1}}, {"$lookup": {"from": "other", "localField": "v", "foreignField": "v", "as": "o"}}],),
        {},
    ),
    (BypassReason.WRITE_STAGE, "out", "aggregate", ([{"$match": {"_id": 1}}, {"$out": "copy"}],), {}),
    (BypassReason.UNENCODABLE, "int_over_64_bits", "find_one", ({"_id": 2**70},), {}),
    (BypassReason.UNENCODABLE, "projection_not_a_mapping", "find_one", ({"_id": 1}, 5), {}),
    (BypassReason.UNENCODABLE, "distinct_key_not_a_string", "distinct", (5,), {}),
]
