"""An AsyncCacheManager's life: ``await close()``, ``async with``, reads after
close, configuration errors shared with CacheManager. Cancellation and
closing while reads are in flight are in test_async_cancellation.py."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pymongo
import pytest

from client_query_cache import (
    AsyncCacheManager,
    CacheClosedError,
    CacheConfigurationError,
    CacheManager,
    StreamState,
)
from support import (
    TEST_MAX_AWAIT_MS,
    async_ready_collection,
    async_wait_until,
    connections_named,
    with_app_name,
)

MiB = 1024 * 1024


async def _seeded(manager: AsyncCacheManager, client: pymongo.MongoClient, db_name: str) -> Any:
    """Insert {_id: 1, v: 1} (sync client), wrap it, read it twice (a hit)."""
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = await async_ready_collection(manager, db_name, "items")
    assert await coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    hits = manager.snapshot().hits
    assert await coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == hits + 1
    return coll


# -- close ----------------------------------------------------------------------


async def test_close_is_idempotent(async_client, client, db_name):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    await _seeded(cache, client, db_name)
    assert not cache.closed

    await cache.close()
    await cache.close()

    assert cache.closed
    assert [s.state for s in cache.snapshot().streams] == [StreamState.CLOSED]


async def test_async_with_closes_the_manager(async_client, client, db_name):
    async with AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS) as cache:
        assert isinstance(cache, AsyncCacheManager)
        coll = await _seeded(cache, client, db_name)
        assert not cache.closed
    assert cache.closed
    assert [s.state for s in cache.snapshot().streams] == [StreamState.CLOSED]
    with pytest.raises(CacheClosedError):
        await coll.find_one({"_id": 1})


async def test_async_with_closes_the_manager_when_the_block_raises(async_client, client, db_name):
    with pytest.raises(KeyError):
        async with AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS) as cache:
            await _seeded(cache, client, db_name)
            raise KeyError("boom")
    assert cache.closed


async def test_close_leaves_the_client_open(async_client, client, db_name):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    await _seeded(cache, client, db_name)
    await cache.close()
    assert await async_client[db_name].items.find_one({"_id": 1}) == {"_id": 1, "v": 1}


_READS: dict[str, Callable[[Any], Awaitable[Any]]] = {
    "find_one_by_id": lambda c: c.find_one({"_id": 1}),
    "find_one_cached_id_type": lambda c: c.find_one({"_id": 1.0}),
    "find_one_by_value": lambda c: c.find_one(1),
    "find_one_not_identity": lambda c: c.find_one({"v": 1}),
    "find_one_with_sort": lambda c: c.find_one({"_id": 1}, sort=[("v", 1)]),
    "find": lambda c: c.find({}).to_list(None),
    "aggregate": lambda c: _aggregate_list(c),
    "count_documents": lambda c: c.count_documents({}),
    "estimated_document_count": lambda c: c.estimated_document_count(),
    "distinct": lambda c: c.distinct("v"),
}


async def _aggregate_list(coll: Any) -> list[Any]:
    cursor = await coll.aggregate([])
    return await cursor.to_list(None)


@pytest.mark.parametrize("read", sorted(_READS))
async def test_a_read_after_close_raises_cache_closed_error(async_client, client, db_name, read):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    coll = await _seeded(cache, client, db_name)
    assert await _READS[read](coll) is not None  # works while open
    await cache.close()
    bypasses = dict(cache.snapshot().bypasses)

    with pytest.raises(CacheClosedError):
        await _READS[read](coll)

    assert dict(cache.snapshot().bypasses) == bypasses  # nothing went to MongoDB


async def test_wrapping_a_new_collection_after_close_raises_cache_closed_error(
    async_client, db_name
):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    await cache.close()
    with pytest.raises(CacheClosedError):
        cache[db_name]["items"]
    with pytest.raises(CacheClosedError):
        cache.get_cached_collection(async_client[db_name]["other"])


async def test_a_snapshot_after_close_still_works_and_shows_the_streams_closed(
    async_client, client, db_name
):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    await _seeded(cache, client, db_name)
    open_snapshot = cache.snapshot()
    assert [s.state for s in open_snapshot.streams] == [StreamState.HEALTHY]

    await cache.close()
    snap = cache.snapshot()

    assert [(s.database, s.state) for s in snap.streams] == [(db_name, StreamState.CLOSED)]
    assert snap.hits == open_snapshot.hits
    assert snap.misses == open_snapshot.misses
    assert snap.admissions == open_snapshot.admissions
    assert snap.budget_bytes == open_snapshot.budget_bytes


async def test_a_snapshot_after_close_keeps_the_stream_counters(
    async_client, client, other_client, db_name
):
    cache = AsyncCacheManager(async_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        coll = await _seeded(cache, client, db_name)
        other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})

        async def updated() -> bool:
            return await coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}

        await async_wait_until(updated, what="the update is seen")
        events = cache.snapshot().streams[0].events
        assert events >= 1
    finally:
        await cache.close()
    assert cache.snapshot().streams[0].events == events


async def test_close_ends_the_change_stream_connections(async_client, client, server_uri, db_name):
    app_name = f"cqc-async-close-{uuid.uuid4().hex[:8]}"
    cache = AsyncCacheManager(
        async_client,
        max_await_time_ms=TEST_MAX_AWAIT_MS,
        stream_uri=with_app_name(server_uri, app_name),
    )
    try:
        await _seeded(cache, client, db_name)
        await async_wait_until(
            lambda: connections_named(client, app_name) > 0, what="the stream connects"
        )
    finally:
        await cache.close()
    await async_wait_until(
        lambda: connections_named(client, app_name) == 0,
        what="the stream's connections are closed",
    )


# -- configuration errors ---------------------------------------------------------


async def test_an_async_manager_given_a_sync_client_raises_a_configuration_error(client):
    with pytest.raises(CacheConfigurationError, match="client") as info:
        AsyncCacheManager(client)
    assert "AsyncMongoClient" in str(info.value)


async def test_a_sync_manager_given_an_async_client_raises_a_configuration_error(async_client):
    with pytest.raises(CacheConfigurationError, match="client") as info:
        CacheManager(async_client)
    assert "MongoClient" in str(info.value) and "AsyncMongoClient" in str(info.value)


@pytest.mark.parametrize(
    "not_a_client",
    [None, "mongodb://127.0.0.1:27017/", object()],
    ids=["none", "uri_string", "object"],
)
async def test_an_async_manager_given_what_is_not_a_client_raises_a_configuration_error(
    not_a_client,
):
    with pytest.raises(CacheConfigurationError, match="client"):
        AsyncCacheManager(not_a_client)


async def test_an_async_database_is_not_accepted_as_the_client(async_client):
    with pytest.raises(CacheConfigurationError, match="client"):
        AsyncCacheManager(async_client["db"])


async def test_a_collection_of_another_async_client_raises_a_configuration_error(
    async_manager, server_uri, db_name
):
    another = pymongo.AsyncMongoClient(server_uri)
    try:
        with pytest.raises(CacheConfigurationError, match="collection"):
            async_manager.get_cached_collection(another[db_name]["items"])
    finally:
        await another.close()


async def test_get_cached_collection_rejects_a_sync_collection(async_manager, client, db_name):
    with pytest.raises(CacheConfigurationError, match="collection"):
        async_manager.get_cached_collection(client[db_name]["items"])


async def test_get_cached_collection_rejects_what_is_not_a_collection(
    async_manager, async_client, db_name
):
    with pytest.raises(CacheConfigurationError, match="collection"):
        async_manager.get_cached_collection(async_client[db_name])


# A few of test_lifecycle.BAD_OPTIONS: both facades validate through one
# CacheConfig, so they reject the same values with the same message.
SHARED_BAD_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("budget_bytes", {"budget_bytes": 1024}),
    ("budget_bytes", {"budget_bytes": True}),
    ("max_entry_bytes", {"budget_bytes": 1 * MiB, "max_entry_bytes": MiB // 4 + 1}),
    ("max_await_time_ms", {"max_await_time_ms": 5}),
    ("slot_count", {"slot_count": 1024.0}),
    ("stream_uri", {"stream_uri": "http://127.0.0.1:27017/"}),
]


@pytest.mark.parametrize(
    ("argument", "options"),
    SHARED_BAD_OPTIONS,
    ids=[f"{name}={opts[name]!r}" for name, opts in SHARED_BAD_OPTIONS],
)
async def test_both_managers_reject_a_bad_option_alike(client, async_client, argument, options):
    with pytest.raises(CacheConfigurationError, match=argument) as async_error:
        AsyncCacheManager(async_client, **options)
    with pytest.raises(CacheConfigurationError, match=argument) as sync_error:
        CacheManager(client, **options)
    assert isinstance(async_error.value, ValueError)
    assert str(async_error.value) == str(sync_error.value)


async def test_the_limits_themselves_are_accepted_by_both_managers(client, async_client):
    limits: dict[str, Any] = dict(
        budget_bytes=64 * 1024, max_entry_bytes=16 * 1024, max_await_time_ms=10, slot_count=64
    )
    async with AsyncCacheManager(async_client, **limits) as small:
        assert small.snapshot().budget_bytes == 64 * 1024
        with CacheManager(client, **limits) as sync_small:
            assert small.config == sync_small.config


@pytest.mark.parametrize("timeout", [-1, "1", True], ids=["negative", "string", "bool"])
async def test_wait_ready_with_a_bad_timeout_raises_a_configuration_error(async_manager, timeout):
    with pytest.raises(CacheConfigurationError, match="timeout"):
        await async_manager.wait_ready(timeout)


async def test_wait_ready_without_streams_for_the_database_returns_false(async_manager, db_name):
    assert await async_manager.wait_ready(0, database=db_name) is False
