"""A manager's life: configuration errors, close, and use after fork()."""

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
    CacheClosedError,
    CacheConfigurationError,
    CacheForkedError,
    CacheManager,
    StreamState,
)
from support import connections_named, ready_collection, wait_until, with_app_name

MiB = 1024 * 1024


def _seeded(manager: CacheManager, client: pymongo.MongoClient, db_name: str) -> Any:
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits >= 1
    return coll


# -- close ----------------------------------------------------------------------


def test_close_is_idempotent(client, db_name):
    cache = CacheManager(client, max_await_time_ms=200)
    _seeded(cache, client, db_name)
    assert not cache.closed

    cache.close()
    cache.close()

    assert cache.closed
    assert [s.state for s in cache.snapshot().streams] == [StreamState.CLOSED]


def test_the_context_manager_closes_the_manager(client, db_name):
    with CacheManager(client, max_await_time_ms=200) as cache:
        coll = _seeded(cache, client, db_name)
        assert not cache.closed
    assert cache.closed
    with pytest.raises(CacheClosedError):
        coll.find_one({"_id": 1})


def test_the_context_manager_closes_the_manager_when_the_block_raises(client, db_name):
    with pytest.raises(KeyError):
        with CacheManager(client, max_await_time_ms=200) as cache:
            _seeded(cache, client, db_name)
            raise KeyError("boom")
    assert cache.closed


_READS: dict[str, Callable[[Any], Any]] = {
    "find_one_by_id": lambda c: c.find_one({"_id": 1}),
    "find_one_cached_id_type": lambda c: c.find_one({"_id": 1.0}),
    "find_one_by_value": lambda c: c.find_one(1),
    "find_one_not_identity": lambda c: c.find_one({"v": 1}),
    "find_one_with_sort": lambda c: c.find_one({"_id": 1}, sort=[("v", 1)]),
    "find": lambda c: list(c.find({})),
    "aggregate": lambda c: list(c.aggregate([])),
    "count_documents": lambda c: c.count_documents({}),
    "estimated_document_count": lambda c: c.estimated_document_count(),
    "distinct": lambda c: c.distinct("v"),
}


@pytest.mark.parametrize("read", sorted(_READS))
def test_a_read_after_close_raises_cache_closed_error(client, db_name, read):
    cache = CacheManager(client, max_await_time_ms=200)
    coll = _seeded(cache, client, db_name)
    assert _READS[read](coll) is not None  # works while open
    cache.close()
    bypasses = dict(cache.snapshot().bypasses)

    with pytest.raises(CacheClosedError):
        _READS[read](coll)

    assert dict(cache.snapshot().bypasses) == bypasses  # nothing went to MongoDB


def test_wrapping_a_new_collection_after_close_raises_cache_closed_error(client, db_name):
    cache = CacheManager(client, max_await_time_ms=200)
    cache.close()
    with pytest.raises(CacheClosedError):
        cache[db_name]["items"]
    with pytest.raises(CacheClosedError):
        cache.get_cached_collection(client[db_name]["other"])


def test_a_snapshot_after_close_still_works_and_shows_the_streams_closed(client, db_name):
    cache = CacheManager(client, max_await_time_ms=200)
    _seeded(cache, client, db_name)
    open_snapshot = cache.snapshot()
    assert [s.state for s in open_snapshot.streams] == [StreamState.HEALTHY]

    cache.close()
    snap = cache.snapshot()

    assert [(s.database, s.state) for s in snap.streams] == [(db_name, StreamState.CLOSED)]
    assert snap.hits == open_snapshot.hits
    assert snap.misses == open_snapshot.misses
    assert snap.admissions == open_snapshot.admissions
    assert snap.budget_bytes == open_snapshot.budget_bytes


def test_a_snapshot_after_close_keeps_the_stream_counters(client, other_client, db_name):
    cache = CacheManager(client, max_await_time_ms=200)
    try:
        coll = _seeded(cache, client, db_name)
        other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
        wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}, what="the update is seen")
        events = cache.snapshot().streams[0].events
        assert events >= 1
    finally:
        cache.close()
    assert cache.snapshot().streams[0].events == events


def test_close_ends_the_change_stream_connections(client, server_uri, db_name):
    app_name = f"cqc-close-{uuid.uuid4().hex[:8]}"
    cache = CacheManager(
        client, max_await_time_ms=200, stream_uri=with_app_name(server_uri, app_name)
    )
    try:
        _seeded(cache, client, db_name)
        wait_until(lambda: connections_named(client, app_name) > 0, what="the stream connects")
    finally:
        cache.close()
    wait_until(
        lambda: connections_named(client, app_name) == 0,
        what="the stream's connections are closed",
    )


# -- configuration errors ---------------------------------------------------------


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


@pytest.mark.parametrize(
    ("argument", "options"),
    BAD_OPTIONS,
    ids=[f"{name}={opts[name]!r}" for name, opts in BAD_OPTIONS],
)
def test_a_bad_option_raises_a_configuration_error_naming_it(client, argument, options):
    with pytest.raises(CacheConfigurationError, match=argument) as info:
        CacheManager(client, **options)
    assert isinstance(info.value, ValueError)


def test_the_limits_themselves_are_accepted(client):
    with CacheManager(
        client,
        budget_bytes=64 * 1024,
        max_entry_bytes=16 * 1024,
        max_await_time_ms=10,
        slot_count=64,
    ) as small:
        assert small.snapshot().budget_bytes == 64 * 1024
    with CacheManager(client, max_await_time_ms=60_000, stream_uri="mongodb://127.0.0.1:1/") as big:
        assert big.config.max_await_time_ms == 60_000


def test_a_small_budget_alone_is_accepted(client):
    with CacheManager(client, budget_bytes=256 * 1024) as cache:
        assert cache.config.max_entry_bytes <= 256 * 1024 // 4


@pytest.mark.parametrize(
    "not_a_client",
    [None, "mongodb://127.0.0.1:27017/", object()],
    ids=["none", "uri_string", "object"],
)
def test_a_client_that_is_not_a_mongo_client_raises_a_configuration_error(not_a_client):
    with pytest.raises(CacheConfigurationError, match="client"):
        CacheManager(not_a_client)


def test_a_database_is_not_accepted_as_the_client(client):
    with pytest.raises(CacheConfigurationError, match="client"):
        CacheManager(client["db"])


def test_a_collection_of_another_client_raises_a_configuration_error(manager, server_uri, db_name):
    with pymongo.MongoClient(server_uri) as another:
        with pytest.raises(CacheConfigurationError, match="collection"):
            manager.get_cached_collection(another[db_name]["items"])


def test_get_cached_collection_rejects_what_is_not_a_collection(manager, client, db_name):
    with pytest.raises(CacheConfigurationError, match="collection"):
        manager.get_cached_collection(client[db_name])


def test_get_cached_collection_accepts_a_collection_of_its_client(manager, client, db_name):
    coll = manager.get_cached_collection(client[db_name]["items"])
    assert coll.raw == client[db_name]["items"]
    assert coll.full_name == f"{db_name}.items"


@pytest.mark.parametrize("timeout", [-1, "1", True], ids=["negative", "string", "bool"])
def test_wait_ready_with_a_bad_timeout_raises_a_configuration_error(manager, timeout):
    with pytest.raises(CacheConfigurationError, match="timeout"):
        manager.wait_ready(timeout)


# -- fork -------------------------------------------------------------------------


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
    coll = _seeded(manager, client, db_name)

    report = _run_in_child(manager, coll)

    assert report == {name: "CacheForkedError" for name in _CHILD_STEPS}
    # The parent's manager is untouched and keeps serving hits.
    hits = manager.snapshot().hits
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == hits + 1
    assert issubclass(CacheForkedError, RuntimeError)
