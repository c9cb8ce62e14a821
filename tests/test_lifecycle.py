"""A manager's life, with the sync and the async API alike (the ``d`` fixture
runs each test with both): close (``close()``, ``with`` / ``async with``),
reads after close, configuration errors; and, for the sync API only, use
after fork(). Cancellation and closing while async reads are in flight are
in test_async_cancellation.py."""

from __future__ import annotations

import os
import select
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pymongo
import pytest

from client_query_cache import (
    AsyncCacheManager,
    CacheClosedError,
    CacheConfigurationError,
    CacheForkedError,
    CacheManager,
    SharedCacheConfig,
    StreamState,
)
from support import Driver, connections_named, ready_collection, served, with_app_name

MiB = 1024 * 1024


async def _seeded(d: Driver, cache: Any, client: pymongo.MongoClient, db_name: str) -> Any:
    """Insert {_id: 1, v: 1} (sync client), wrap it, read it twice (a hit)."""
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = await d.ready(cache, db_name)
    assert await d.r(coll.find_one({"_id": 1})) == {"_id": 1, "v": 1}
    hits = cache.snapshot().hits
    assert await d.r(coll.find_one({"_id": 1})) == {"_id": 1, "v": 1}
    assert cache.snapshot().hits == hits + 1
    return coll


# -- close ----------------------------------------------------------------------


async def test_close_is_idempotent(d, client, db_name):
    cache = d.manager()
    await _seeded(d, cache, client, db_name)
    assert not cache.closed

    await d.r(cache.close())
    await d.r(cache.close())

    assert cache.closed
    assert [s.state for s in cache.snapshot().streams] == [StreamState.CLOSED]


async def test_the_context_manager_closes_the_manager(d, client, db_name):
    async with d.using(d.Manager(d.client(), max_await_time_ms=200)) as cache:
        assert isinstance(cache, d.Manager)
        coll = await _seeded(d, cache, client, db_name)
        assert not cache.closed
    assert cache.closed
    assert [s.state for s in cache.snapshot().streams] == [StreamState.CLOSED]
    with pytest.raises(CacheClosedError):
        await d.r(coll.find_one({"_id": 1}))


async def test_the_context_manager_closes_the_manager_when_the_block_raises(d, client, db_name):
    with pytest.raises(KeyError):
        async with d.using(d.Manager(d.client(), max_await_time_ms=200)) as cache:
            await _seeded(d, cache, client, db_name)
            raise KeyError("boom")
    assert cache.closed


async def test_close_leaves_the_client_open(d, client, db_name):
    mongo = d.client()
    cache = d.manager(mongo)
    await _seeded(d, cache, client, db_name)
    await d.r(cache.close())
    assert await d.r(mongo[db_name].items.find_one({"_id": 1})) == {"_id": 1, "v": 1}


_READS: dict[str, Callable[[Driver, Any], Any]] = {
    "find_one_by_id": lambda d, c: d.r(c.find_one({"_id": 1})),
    "find_one_cached_id_type": lambda d, c: d.r(c.find_one({"_id": 1.0})),
    "find_one_by_value": lambda d, c: d.r(c.find_one(1)),
    "find_one_not_identity": lambda d, c: d.r(c.find_one({"v": 1})),
    "find_one_with_sort": lambda d, c: d.r(c.find_one({"_id": 1}, sort=[("v", 1)])),
    "find": lambda d, c: d.docs(c.find({})),
    "aggregate": lambda d, c: d.docs(c.aggregate([])),
    "count_documents": lambda d, c: d.r(c.count_documents({})),
    "estimated_document_count": lambda d, c: d.r(c.estimated_document_count()),
    "distinct": lambda d, c: d.r(c.distinct("v")),
}


@pytest.mark.parametrize("read", sorted(_READS))
async def test_a_read_after_close_raises_cache_closed_error(d, client, db_name, read):
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await _seeded(d, cache, client, db_name)
    # While open it returns what PyMongo returns.
    assert await _READS[read](d, coll) == await _READS[read](d, mongo[db_name].items)
    await d.r(cache.close())
    bypasses = dict(cache.snapshot().bypasses)

    with pytest.raises(CacheClosedError):
        await _READS[read](d, coll)

    assert dict(cache.snapshot().bypasses) == bypasses  # nothing went to MongoDB


async def test_wrapping_a_new_collection_after_close_raises_cache_closed_error(d, db_name):
    mongo = d.client()
    cache = d.manager(mongo)
    await d.r(cache.close())
    with pytest.raises(CacheClosedError):
        cache[db_name]["items"]
    with pytest.raises(CacheClosedError):
        cache.get_cached_collection(mongo[db_name]["other"])


async def test_a_snapshot_after_close_still_works_and_shows_the_streams_closed(d, client, db_name):
    cache = d.manager()
    await _seeded(d, cache, client, db_name)
    open_snapshot = cache.snapshot()
    assert [s.state for s in open_snapshot.streams] == [StreamState.HEALTHY]

    await d.r(cache.close())
    snap = cache.snapshot()

    assert [(s.database, s.state) for s in snap.streams] == [(db_name, StreamState.CLOSED)]
    assert snap.hits == open_snapshot.hits
    assert snap.misses == open_snapshot.misses
    assert snap.admissions == open_snapshot.admissions
    assert snap.budget_bytes == open_snapshot.budget_bytes


async def test_a_snapshot_after_close_keeps_the_stream_counters(d, client, other_client, db_name):
    cache = d.manager()
    try:
        coll = await _seeded(d, cache, client, db_name)
        other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})

        async def updated() -> bool:
            return await d.r(coll.find_one({"_id": 1})) == {"_id": 1, "v": 2}

        await d.wait_until(updated, what="the update is seen")
        events = cache.snapshot().streams[0].events
        assert events >= 1
    finally:
        await d.r(cache.close())
    assert cache.snapshot().streams[0].events == events


async def test_close_ends_the_change_stream_connections(d, client, server_uri, db_name):
    app_name = f"cqc-close-{d.name}-{uuid.uuid4().hex[:8]}"
    cache = d.manager(stream_uri=with_app_name(server_uri, app_name))
    try:
        await _seeded(d, cache, client, db_name)
        await d.wait_until(lambda: connections_named(client, app_name) > 0, what="the stream connects")
    finally:
        await d.r(cache.close())
    await d.wait_until(
        lambda: connections_named(client, app_name) == 0,
        what="the stream's connections are closed",
    )


# -- configuration errors -------------------------------------------------------


BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("budget_bytes", {"budget_bytes": 1024}),
    ("budget_bytes", {"budget_bytes": 0xF0000000 + 1}),
    ("budget_bytes", {"budget_bytes": "64MiB"}),
    ("budget_bytes", {"budget_bytes": 64.0 * MiB}),
    ("budget_bytes", {"budget_bytes": True}),
    ("max_entry_bytes", {"budget_bytes": 1 * MiB, "max_entry_bytes": MiB // 4 + 1}),
    ("max_entry_bytes", {"max_entry_bytes": 0}),
    ("max_entry_bytes", {"max_entry_bytes": "1MiB"}),
    ("max_await_time_ms", {"max_await_time_ms": 5}),
    ("max_await_time_ms", {"max_await_time_ms": 60_001}),
    ("max_await_time_ms", {"max_await_time_ms": 200.0}),
    ("slot_count", {"slot_count": 10}),
    ("slot_count", {"slot_count": (1 << 26) + 1}),
    ("slot_count", {"slot_count": 1024.0}),
    ("stream_uri", {"stream_uri": "http://127.0.0.1:27017/"}),
    ("stream_uri", {"stream_uri": "127.0.0.1:27017"}),
    ("stream_uri", {"stream_uri": b"mongodb://127.0.0.1:27017/"}),
]
_BAD_OPTION_IDS = [f"{name}={opts[name]!r}" for name, opts in BAD_OPTIONS]


@pytest.mark.parametrize(("argument", "options"), BAD_OPTIONS, ids=_BAD_OPTION_IDS)
async def test_a_bad_option_raises_a_configuration_error_naming_it(d, argument, options):
    with pytest.raises(CacheConfigurationError, match=argument) as info:
        d.Manager(d.client(), **options)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("argument", "options"), BAD_OPTIONS, ids=_BAD_OPTION_IDS)
async def test_both_managers_reject_a_bad_option_alike(client, async_client, argument, options):
    # Both facades validate through one CacheConfig: the same values are
    # rejected with the same message.
    with pytest.raises(CacheConfigurationError, match=argument) as async_error:
        AsyncCacheManager(async_client, **options)
    with pytest.raises(CacheConfigurationError, match=argument) as sync_error:
        CacheManager(client, **options)
    assert str(async_error.value) == str(sync_error.value)


_LIMITS: dict[str, Any] = dict(budget_bytes=64 * 1024, max_entry_bytes=16 * 1024, max_await_time_ms=10, slot_count=64)


async def test_the_limits_themselves_are_accepted(d):
    async with d.using(d.Manager(d.client(), **_LIMITS)) as small:
        assert small.snapshot().budget_bytes == 64 * 1024
    async with d.using(d.Manager(d.client(), max_await_time_ms=60_000, stream_uri="mongodb://127.0.0.1:1/")) as big:
        assert big.config.max_await_time_ms == 60_000


async def test_the_limits_themselves_are_accepted_alike_by_both_managers(client, async_client):
    async with AsyncCacheManager(async_client, **_LIMITS) as small:
        with CacheManager(client, **_LIMITS) as sync_small:
            assert small.config == sync_small.config


async def test_a_small_budget_alone_is_accepted(d):
    async with d.using(d.Manager(d.client(), budget_bytes=256 * 1024)) as cache:
        assert cache.config.max_entry_bytes <= 256 * 1024 // 4


@pytest.mark.parametrize(
    "not_a_client",
    [None, "mongodb://127.0.0.1:27017/", object()],
    ids=["none", "uri_string", "object"],
)
async def test_a_client_that_is_not_a_mongo_client_raises_a_configuration_error(d, not_a_client):
    with pytest.raises(CacheConfigurationError, match="client"):
        d.Manager(not_a_client)


async def test_a_client_of_the_other_api_raises_a_configuration_error_naming_both(d, client, async_client):
    other = client if d.is_async else async_client
    wanted, given = d.Client.__name__, type(other).__name__
    with pytest.raises(CacheConfigurationError, match=rf"client.*\b{wanted}\b.*\b{given}\b"):
        d.Manager(other)


async def test_a_database_is_not_accepted_as_the_client(d):
    with pytest.raises(CacheConfigurationError, match="client"):
        d.Manager(d.client()["db"])


async def test_a_collection_of_another_client_raises_a_configuration_error(d, db_name):
    cache = d.manager()
    another = d.client()
    with pytest.raises(CacheConfigurationError, match="collection"):
        cache.get_cached_collection(another[db_name]["items"])


async def test_get_cached_collection_rejects_a_collection_of_the_other_api(d, client, async_client, db_name):
    cache = d.manager()
    other = client if d.is_async else async_client
    with pytest.raises(CacheConfigurationError, match="collection"):
        cache.get_cached_collection(other[db_name]["items"])


async def test_get_cached_collection_rejects_what_is_not_a_collection(d, db_name):
    mongo = d.client()
    cache = d.manager(mongo)
    with pytest.raises(CacheConfigurationError, match="collection"):
        cache.get_cached_collection(mongo[db_name])


@pytest.mark.parametrize("timeout", [-1, "1", True], ids=["negative", "string", "bool"])
async def test_wait_ready_with_a_bad_timeout_raises_a_configuration_error(d, timeout):
    cache = d.manager()
    with pytest.raises(CacheConfigurationError, match="timeout"):
        await d.r(cache.wait_ready(timeout))


async def test_wait_ready_without_streams_for_the_database_returns_false(d, db_name):
    cache = d.manager()
    assert await d.r(cache.wait_ready(0, database=db_name)) is False


async def test_wait_ready_after_close_raises_cache_closed(d, db_name):
    cache = d.manager()
    await d.ready(cache, db_name)
    await d.r(cache.close())
    for database in (None, db_name):
        with pytest.raises(CacheClosedError):
            await d.r(cache.wait_ready(1, database=database))


# -- fork (sync API only) -------------------------------------------------------


_CHILD_STEPS: dict[str, Callable[[CacheManager, Any], Any]] = {
    "find_one_by_id": lambda m, c: c.find_one({"_id": 1}),
    "find_one_bypassed": lambda m, c: c.find_one({"_id": 1}, sort=[("v", 1)]),
    "find": lambda m, c: list(c.find({})),
    "snapshot": lambda m, c: m.snapshot(),
}


def _run_in_child(cache: CacheManager, coll: Any) -> dict[str, str]:
    """Fork; in the child, try every step and report the class of what each
    raised (or "returned") through a pipe; return that report."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_fd)
            report = []
            for name, step in _CHILD_STEPS.items():
                try:
                    step(cache, coll)
                    report.append(f"{name}=returned")
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    report.append(f"{name}={type(exc).__name__}")
            os.write(write_fd, ";".join(report).encode())
        finally:
            os._exit(0)

    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], 0.1)
            if ready:
                chunk = os.read(read_fd, 4096)
                if not chunk:
                    break
                chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child did not finish within 30 s")
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return dict(item.split("=", 1) for item in b"".join(chunks).decode().split(";"))


def test_a_manager_used_in_a_forked_child_raises_cache_forked_error(manager, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}  # admitted
    hits = manager.snapshot().hits
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == hits + 1

    report = _run_in_child(manager, coll)

    assert report == {name: "CacheForkedError" for name in _CHILD_STEPS}
    # The parent's manager is untouched and keeps serving hits.
    hits = manager.snapshot().hits
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == hits + 1
    assert issubclass(CacheForkedError, RuntimeError)


# -- max_namespaces ------------------------------------------------------------


def test_collections_past_max_namespaces_bypass_with_their_reason(make_manager, client, db_name):
    for name in ("a", "b", "c"):
        client[db_name][name].insert_one({"_id": 1, "c": name})
    cache = make_manager(max_namespaces=2)
    assert cache.config.max_namespaces == 2
    a, b = (ready_collection(cache, db_name, n) for n in ("a", "b"))
    c = cache[db_name]["c"]
    for _ in range(3):
        assert c.find_one({"_id": 1}) == {"_id": 1, "c": "c"}  # PyMongo's, every time
    snap = cache.snapshot()
    assert snap.bypasses.get("namespace_limit") == 3, snap
    # The two first are cached as ever.
    for coll, name in ((a, "a"), (b, "b")):
        assert served(cache, lambda coll=coll: coll.find_one({"_id": 1})) == {"_id": 1, "c": name}


@pytest.mark.parametrize("bad", [0, 769, True, 1.5, "2"])
def test_max_namespaces_out_of_range_is_a_configuration_error(client, bad):
    with pytest.raises(CacheConfigurationError, match="max_namespaces"):
        CacheManager(client, max_namespaces=bad)
    with pytest.raises(CacheConfigurationError, match="max_namespaces"):
        SharedCacheConfig("n", max_namespaces=bad)
