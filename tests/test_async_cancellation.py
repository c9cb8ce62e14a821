"""Async reads interrupted: a task cancelled (or timed out) during a miss, and
the manager closed while reads are in flight.

A cancelled miss must admit nothing, leave nothing behind (the next read of
the same _id is an ordinary miss, then a hit, with the current data), and not
disturb the other reads. Closing while reads run must let every read finish
with correct data or raise CacheClosedError, never hang, and leave the
manager closed.

The test hooks are sync and run on the loop's thread, so they never block:
a read is held in flight by a server failpoint (blockConnection on ``find``,
scoped by appName to the test's AsyncMongoClient) or observed and cancelled
from the test's own task.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pymongo
import pytest
from pymongo import monitoring

from client_query_cache import AsyncCacheManager, CacheClosedError, StreamState
from client_query_cache.testing import DisposableServer, external_uri
from support import (
    DEADLINE_S,
    TEST_MAX_AWAIT_MS,
    async_ready_collection,
    async_served,
    async_wait_until,
    stream_of,
)

needs_local_server = pytest.mark.skipif(
    external_uri() is not None,
    reason="MONGODB_URI is set: failpoints are armed on a local server only",
)


async def _cache_twice(manager: AsyncCacheManager, coll: Any, _id: Any, expected: Any) -> None:
    """Read _id twice: the first read is a miss that is admitted, the second a
    hit; both return ``expected``."""
    before = manager.snapshot()
    assert await coll.find_one({"_id": _id}) == expected
    missed = manager.snapshot()
    assert missed.misses == before.misses + 1, "the first read was not a miss"
    assert missed.admissions == before.admissions + 1, "the first read was not admitted"
    assert await coll.find_one({"_id": _id}) == expected
    assert manager.snapshot().hits == missed.hits + 1, "the second read was not a hit"


async def _apply(manager: AsyncCacheManager, db_name: str, write: Any) -> None:
    """Run a sync ``write`` and wait until the manager's stream applied it."""
    events = stream_of(manager, db_name).events
    write()
    await async_wait_until(
        lambda: stream_of(manager, db_name).events > events, what="the stream applies the write"
    )


async def _finish(task: asyncio.Task[Any]) -> None:
    """Wait for a task that was just cancelled; it must not hang."""
    done, _ = await asyncio.wait([task], timeout=DEADLINE_S)
    assert task in done, "the cancelled read did not finish"


# -- cancelling a miss (any server) -----------------------------------------------


@pytest.mark.parametrize("point", ["before_capture", "after_capture"])
async def test_a_miss_cancelled_in_flight_admits_nothing_and_leaves_no_state(
    async_manager, client, other_client, db_name, point
):
    client[db_name].items.insert_many([{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    coll = await async_ready_collection(async_manager, db_name, "items")
    if point == "after_capture":
        # Probe the collection first, so the next miss's first await is its read.
        await _cache_twice(async_manager, coll, 2, {"_id": 2, "v": 2})
    captured: list[int] = []
    async_manager._engine.hooks.after_capture = lambda: captured.append(1)
    before = async_manager.snapshot()

    task = asyncio.create_task(coll.find_one({"_id": 1}))
    if point == "before_capture":
        # One step: the task looks the key up, misses and suspends in its
        # first await (probing the collection), before any token is taken.
        await asyncio.sleep(0)
        assert captured == []
    else:
        # The task's step that captures the token goes on into the read and
        # suspends there; this task runs right after that step, before any
        # reply can have been processed.
        while not captured:
            assert not task.done(), "the read finished before it was observed"
            await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    await _finish(task)

    assert task.cancelled()
    after = async_manager.snapshot()
    assert after.misses == before.misses + 1  # the lookup happened
    async_manager._engine.hooks.after_capture = None

    # After a change (and the time it takes to reach the cache, in which a
    # read that went on in the background would have finished), nothing was
    # admitted or even offered for admission ...
    await _apply(
        async_manager,
        db_name,
        lambda: other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": "new"}}),
    )
    later = async_manager.snapshot()
    assert later.admissions == before.admissions
    assert later.entries == before.entries
    assert later.rejected_admissions == before.rejected_admissions
    # ... and no state is left behind: the same _id is an ordinary miss with
    # the current data, then a hit.
    await _cache_twice(async_manager, coll, 1, {"_id": 1, "v": "new"})
    # And the manager serves everything else as before.
    if point == "before_capture":
        await _cache_twice(async_manager, coll, 2, {"_id": 2, "v": 2})
    else:
        # Still cached (once the stream has applied what the miss above saw).
        assert await async_served(async_manager, lambda: coll.find_one({"_id": 2})) == {"_id": 2, "v": 2}


async def test_a_miss_cancelled_by_its_own_after_capture_hook_admits_nothing(
    async_manager, client, db_name
):
    # The hook cancels the running task itself: CancelledError is raised at
    # the first await after the token was captured, i.e. as the read starts.
    client[db_name].items.insert_many([{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    coll = await async_ready_collection(async_manager, db_name, "items")
    await _cache_twice(async_manager, coll, 2, {"_id": 2, "v": 2})

    def cancel_me() -> None:
        async_manager._engine.hooks.after_capture = None
        task = asyncio.current_task()
        assert task is not None
        task.cancel()

    async_manager._engine.hooks.after_capture = cancel_me
    before = async_manager.snapshot()

    task = asyncio.create_task(coll.find_one({"_id": 1}))
    await _finish(task)

    assert task.cancelled()
    after = async_manager.snapshot()
    assert after.admissions == before.admissions and after.entries == before.entries
    await _cache_twice(async_manager, coll, 1, {"_id": 1, "v": 1})


# -- cancelling a miss blocked in the server -----------------------------------------


@pytest.fixture(scope="module")
def failpoint_server() -> Iterator[DisposableServer]:
    """A server that accepts configureFailPoint (shared by this module)."""
    if external_uri() is not None:
        pytest.skip("MONGODB_URI is set: failpoints are armed on a local server only")
    with DisposableServer(extra_args=["--enable-test-commands"]) as server:
        yield server


@pytest.fixture
def fp_client(failpoint_server: DisposableServer) -> Iterator[pymongo.MongoClient]:
    """A sync client of the failpoint server, for seeding, writing and arming."""
    mongo = pymongo.MongoClient(failpoint_server.uri)
    try:
        yield mongo
    finally:
        mongo.admin.command("configureFailPoint", "failCommand", mode="off")
        mongo.close()


class _Finds(monitoring.CommandListener, monitoring.ConnectionPoolListener):
    """The ``find`` commands of a client and its closed connections, as
    PyMongo reports them: a read is over for the client once its command
    ended (succeeded, or failed, as a cancelled one does) and no connection
    it could still be answered on is open."""

    def __init__(self) -> None:
        self.running: set[int] = set()  # request ids
        self.ended: list[int] = []
        self.closed_connections = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "find":
            self.running.add(event.request_id)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self._end(event.request_id)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        self._end(event.request_id)

    def _end(self, request_id: int) -> None:
        if request_id in self.running:
            self.running.discard(request_id)
            self.ended.append(request_id)

    def connection_closed(self, event: monitoring.ConnectionClosedEvent) -> None:
        self.closed_connections += 1

    def __getattr__(self, name: str) -> Any:  # the other pool events
        if name.startswith(("pool_", "connection_")):
            return lambda event: None
        raise AttributeError(name)


class Blocked:
    """An AsyncCacheManager over a client whose ``find`` commands can be held
    by the server (the failpoint matches this client's appName only)."""

    def __init__(self, fp_client: pymongo.MongoClient, uri: str) -> None:
        self.fp_client = fp_client
        self.app_name = f"cqc-async-blocked-{uuid.uuid4().hex[:8]}"
        self.db_name = f"cqc_blocked_{uuid.uuid4().hex[:12]}"
        self.finds = _Finds()
        self.reader: pymongo.AsyncMongoClient = pymongo.AsyncMongoClient(
            uri, appName=self.app_name, event_listeners=[self.finds]
        )
        self.manager = AsyncCacheManager(self.reader, max_await_time_ms=TEST_MAX_AWAIT_MS)

    def block_next_find(self, block_ms: int) -> None:
        self.fp_client.admin.command(
            "configureFailPoint",
            "failCommand",
            mode={"times": 1},
            data={
                "failCommands": ["find"],
                "blockConnection": True,
                "blockTimeMS": block_ms,
                "appName": self.app_name,
            },
        )

    async def close(self) -> None:
        await self.manager.close()
        await self.reader.close()
        self.fp_client.drop_database(self.db_name)


@pytest.fixture
async def blocked(fp_client, failpoint_server) -> AsyncIterator[Blocked]:
    b = Blocked(fp_client, failpoint_server.uri)
    try:
        yield b
    finally:
        await b.close()


async def _start_blocked_miss(blocked: Blocked, coll: Any, _id: Any, block_ms: int) -> Any:
    """Start ``find_one({"_id": _id})`` as a task whose MongoDB read the server
    holds for ``block_ms``; return the task once its token is captured."""
    captured: list[int] = []
    blocked.manager._engine.hooks.after_capture = lambda: captured.append(1)
    blocked.block_next_find(block_ms)
    task = asyncio.create_task(coll.find_one({"_id": _id}))
    await async_wait_until(lambda: captured, what="the miss captured its token")
    blocked.manager._engine.hooks.after_capture = None
    await asyncio.sleep(0.05)
    assert not task.done(), "the read was not held by the failpoint"
    return task


@needs_local_server
@pytest.mark.parametrize("how", ["task_cancel", "wait_for_timeout"])
async def test_a_miss_cancelled_while_the_server_holds_its_read_admits_nothing(blocked, how):
    block_ms = 2000
    cache, items = blocked.manager, blocked.fp_client[blocked.db_name].items
    items.insert_many([{"_id": i, "v": i} for i in range(1, 4)])
    coll = await async_ready_collection(cache, blocked.db_name, "items")
    await _cache_twice(cache, coll, 2, {"_id": 2, "v": 2})
    before = cache.snapshot()
    closed_before = blocked.finds.closed_connections
    offered: list[bool] = []
    if how == "task_cancel":
        task = await _start_blocked_miss(blocked, coll, 1, block_ms)
        # While the read is held, hits and other misses are served at once:
        # nothing waits behind the blocked read.
        assert await asyncio.wait_for(coll.find_one({"_id": 2}), 1.0) == {"_id": 2, "v": 2}
        assert await asyncio.wait_for(coll.find_one({"_id": 3}), 1.0) == {"_id": 3, "v": 3}
        # A change while the read is held; the cancelled read must not matter.
        await _apply(cache, blocked.db_name, lambda: items.update_one({"_id": 1}, {"$set": {"v": "new"}}))
        assert not task.done()
        task.cancel()
        await _finish(task)
        assert task.cancelled()
        expected_admissions = before.admissions + 1  # _id 3
    else:
        blocked.block_next_find(block_ms)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(coll.find_one({"_id": 1}), 0.3)
        await _apply(cache, blocked.db_name, lambda: items.update_one({"_id": 1}, {"$set": {"v": "new"}}))
        expected_admissions = before.admissions

    assert cache.snapshot().admissions == expected_admissions
    cache._engine.hooks.before_admit = lambda: offered.append(True)
    # The held read is over for the client: its find ended (PyMongo reports
    # the cancelled command failed) and its connection is closed, so the
    # server's late answer reaches no one. Nothing was admitted or offered
    # for admission, then or since.
    await async_wait_until(
        lambda: not blocked.finds.running and blocked.finds.closed_connections > closed_before,
        what="PyMongo ends the held find and closes its connection",
    )
    cache._engine.hooks.before_admit = None
    assert offered == [], "the cancelled read offered an admission"
    after = cache.snapshot()
    assert after.admissions == expected_admissions
    assert after.rejected_admissions == before.rejected_admissions
    # The same _id is an ordinary miss with the current data, then a hit.
    await _cache_twice(cache, coll, 1, {"_id": 1, "v": "new"})
    # Still cached (once the stream has applied what the miss above saw).
    assert await async_served(cache, lambda: coll.find_one({"_id": 2})) == {"_id": 2, "v": 2}


@needs_local_server
async def test_close_does_not_wait_for_a_read_the_server_holds(blocked):
    cache, items = blocked.manager, blocked.fp_client[blocked.db_name].items
    items.insert_many([{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    coll = await async_ready_collection(cache, blocked.db_name, "items")
    await _cache_twice(cache, coll, 2, {"_id": 2, "v": 2})
    admissions = cache.snapshot().admissions
    task = await _start_blocked_miss(blocked, coll, 1, block_ms=1500)

    await asyncio.wait_for(cache.close(), 1.0)  # well before the read returns
    assert not task.done()
    done, _ = await asyncio.wait([task], timeout=DEADLINE_S)
    assert task in done, "the held read never finished"

    # The read returns its document or reports the close; it admits nothing.
    error = task.exception()
    if error is None:
        assert task.result() == {"_id": 1, "v": 1}
    else:
        assert isinstance(error, CacheClosedError), repr(error)
    assert cache.snapshot().admissions == admissions
    with pytest.raises(CacheClosedError):
        await coll.find_one({"_id": 1})


# -- closing while reads are in flight -----------------------------------------------


async def test_closing_while_many_reads_run_ends_each_with_its_data_or_cache_closed_error(
    async_manager, client, db_name
):
    count = 12
    docs = {i: {"_id": i, "v": f"value {i}", "pad": "x" * 100} for i in range(count)}
    client[db_name].items.insert_many(list(docs.values()))
    coll = await async_ready_collection(async_manager, db_name, "items")
    for i in range(count // 2):  # the first half is cached: those reads are hits
        assert await coll.find_one({"_id": i}) == docs[i]
    completed: collections.Counter[str] = collections.Counter()
    closed_after: collections.Counter[str] = collections.Counter()
    max_rounds = 100_000

    async def reader(kind: str, i: int) -> None:
        """Read until the cache reports it is closed; check every result."""
        for n in range(max_rounds):
            try:
                if kind == "hit":
                    got, expected = await coll.find_one({"_id": i}), docs[i]
                elif kind == "miss":  # a projection never read before: a new key
                    got = await coll.find_one({"_id": i}, {"v": 1, f"absent_{n}": 1})
                    expected = {"_id": i, "v": docs[i]["v"]}
                elif kind == "not_found":  # an _id never read before
                    got, expected = await coll.find_one({"_id": f"absent-{i}-{n}"}), None
                else:  # bypassed to PyMongo
                    got, expected = await coll.find_one({"_id": i}, sort=[("v", 1)]), docs[i]
            except CacheClosedError:
                closed_after[kind] += 1
                return
            assert got == expected, (kind, i, n)
            completed[kind] += 1
            await asyncio.sleep(0)  # a hit never suspends: let the others run
        raise AssertionError(f"{kind} reader {i} never saw the close")

    kinds = {"hit": range(count // 2), "miss": range(count // 2, count),
             "not_found": range(4), "bypass": range(4)}  # fmt: skip
    tasks = [asyncio.create_task(reader(kind, i)) for kind, ids in kinds.items() for i in ids]
    try:
        await async_wait_until(
            lambda: all(completed[kind] >= 10 for kind in kinds) or any(t.done() for t in tasks),
            what="every kind of read has completed a few times",
        )
        assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]

        await asyncio.wait_for(async_manager.close(), DEADLINE_S)

        # Every reader ends (with CacheClosedError) soon after the close;
        # a failed check in a reader is re-raised here.
        await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
    finally:
        for task in tasks:
            task.cancel()
    assert closed_after == {kind: len(ids) for kind, ids in kinds.items()}
    assert async_manager.closed
    assert [s.state for s in async_manager.snapshot().streams] == [StreamState.CLOSED]
    with pytest.raises(CacheClosedError):
        await coll.find_one({"_id": 0})
    with pytest.raises(CacheClosedError):
        await coll.find_one({"_id": count - 1})
    with pytest.raises(CacheClosedError):
        await coll.count_documents({})


async def test_a_second_close_during_a_close_returns_only_once_the_streams_are_stopped(
    async_manager, client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = await async_ready_collection(async_manager, db_name, "items")
    assert await coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}

    first = asyncio.create_task(async_manager.close())
    try:
        await async_wait_until(lambda: async_manager.closed, what="the first close has begun")
        await asyncio.wait_for(async_manager.close(), DEADLINE_S)
        states = [s.state for s in async_manager.snapshot().streams]
    finally:
        await asyncio.wait_for(first, DEADLINE_S)
    assert states == [StreamState.CLOSED]


# -- cancelling at many points ---------------------------------------------------------


def _admitted(manager: AsyncCacheManager, before: Any) -> int:
    after = manager.snapshot()
    return after.admissions - before.admissions + sum(after.rejected_admissions.values()) - sum(
        before.rejected_admissions.values()
    )


@pytest.mark.parametrize("read", ["find_one", "to_list", "aggregate"])
async def test_a_miss_cancelled_at_any_point_raises_cancelled_and_admits_nothing(
    make_async_manager, client, db_name, read
):
    # PyMongo's own read can swallow a cancellation asked while it is in
    # flight and return its result (about one in eight here, on Python
    # 3.11); a cached read must still end cancelled and admit nothing.
    client[db_name].items.insert_many([{"_id": i, "k": i % 3, "pad": "x" * 200} for i in range(300)])
    cache = make_async_manager()
    coll = await async_ready_collection(cache, db_name, "items")
    assert await coll.find_one({"_id": -1}) is None  # the collection is probed
    calls = {
        "find_one": lambda n: coll.find_one({"_id": {"$gte": 0}, "n": {"$ne": n}}),
        "to_list": lambda n: coll.find({"n": {"$ne": n}}).to_list(),
        "aggregate": lambda n: _aggregate_list(coll, n),
    }
    outcomes = collections.Counter()
    for n in range(96):
        before = cache.snapshot()
        task = asyncio.create_task(calls[read](n))
        for _ in range(n % 12):
            await asyncio.sleep(0)
        asked = task.cancel()
        await _finish(task)
        if asked:
            assert task.cancelled(), f"cancelled after {n % 12} steps, the read returned {task.result()!r:.60}"
            assert _admitted(cache, before) == 0, f"cancelled after {n % 12} steps"
            outcomes["cancelled"] += 1
        else:
            outcomes["finished first"] += 1
    assert outcomes["cancelled"] >= 48, outcomes


async def _aggregate_list(coll: Any, n: int) -> list[Any]:
    return await (await coll.aggregate([{"$match": {"n": {"$ne": n}}}])).to_list()


async def test_a_cancelled_close_still_closes(make_async_manager, db_name):
    # From its first step on (a task cancelled before it runs never runs
    # its coroutine at all).
    for steps in range(1, 11):
        cache = make_async_manager()
        coll = await async_ready_collection(cache, db_name, "items")
        task = asyncio.create_task(cache.close())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        await _finish(task)
        await async_wait_until(lambda: cache.closed, what=f"the close cancelled after {steps} steps closes")
        with pytest.raises(CacheClosedError):
            await coll.find_one({"_id": 1})
