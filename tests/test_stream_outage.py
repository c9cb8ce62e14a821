"""The change stream in trouble: a stopped server, a killed cursor, a hung
getMore, lost history. Whatever happens, no stale document is served once the
stream could have missed a change, and caching resumes afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
from bson.int64 import Int64
from pymongo.errors import ConnectionFailure, ServerSelectionTimeoutError

from client_query_cache import CacheManager, StreamState
from client_query_cache.testing import DisposableServer, external_uri
from support import (
    STALL_BOUND_S,
    STREAM_APP_NAME,
    TEST_MAX_AWAIT_MS,
    event_time,
    ready_collection,
    served,
    stream_of,
    wait_until,
)

needs_local_server = pytest.mark.skipif(
    external_uri() is not None,
    reason="MONGODB_URI is set: these tests stop the server, arm failpoints or read "
    "SecantusDB's currentOp",
)

#: Scheduling slack on a loaded 2-core machine when checking that bound.
SLACK_S = 0.4


def _cache_twice(cache: CacheManager, coll: Any, expected: Any) -> None:
    assert coll.find_one({"_id": 1}) == expected
    hits = cache.snapshot().hits
    assert coll.find_one({"_id": 1}) == expected
    assert cache.snapshot().hits == hits + 1, "the second read was not a hit"


def _unhealthy_bypasses(cache: CacheManager) -> int:
    return cache.snapshot().bypasses.get("stream_unhealthy", 0)


# -- a quiet server --------------------------------------------------------------------


@needs_local_server
@pytest.mark.parametrize("noop_interval_seconds", [0.5, 0.0])
def test_a_quiet_streams_applied_time_moves_with_events_only_on_the_test_server(
    noop_interval_seconds: float,
) -> None:
    # Every hello mints a cluster time and every reply carries the latest as
    # operationTime, so a write's operationTime can lie past its own event.
    # The server's empty batches carry a postBatchResumeToken past it (moved
    # by its no-ops, or minted by the scan itself), but that token can also
    # precede a write still committing: it is not MongoDB's high-water mark,
    # so the applied time stays at the last event's. A quiet database keeps
    # serving its entries through its empty stream rounds (one member).
    with DisposableServer(noop_interval_seconds=noop_interval_seconds) as server:
        client = pymongo.MongoClient(server.uri)
        cache = CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS)
        try:
            client.quiet.items.insert_one({"_id": 0})
            ready_collection(cache, "quiet", "items")
            events = stream_of(cache, "quiet").events
            client.quiet.items.insert_one({"_id": 1})
            wait_until(lambda: stream_of(cache, "quiet").events > events, what="the insert is applied")
            event_time = stream_of(cache, "quiet").applied_time
            client.admin.command("hello")
            with client.start_session(causal_consistency=False) as session:
                client.admin.command("ping", session=session)
                minted = session.operation_time
            assert minted > event_time, "hello minted no cluster time: the premise is gone"
            time.sleep(2.0)
            assert stream_of(cache, "quiet").applied_time == event_time < minted
            coll = cache["quiet"]["items"]
            assert served(cache, lambda: coll.find_one({"_id": 1})) == {"_id": 1}
        finally:
            cache.close()
            client.close()


# -- the server stops and comes back ------------------------------------------------


@needs_local_server
def test_a_stopped_server_makes_reads_bypass_within_the_stall_bound_and_caching_resumes():
    with DisposableServer() as server:  # on-disk storage, its own port
        reader = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=500)
        writer = pymongo.MongoClient(server.uri)
        cache = CacheManager(reader, max_await_time_ms=TEST_MAX_AWAIT_MS)
        try:
            writer.outage.items.insert_one({"_id": 1, "v": 1})
            coll = ready_collection(cache, "outage", "items")
            _cache_twice(cache, coll, {"_id": 1, "v": 1})

            server.stop()
            stopped = time.monotonic()

            # Until the stall bound, a read may still be the cached version
            # (nothing can change while the server is down); then reads bypass
            # and PyMongo reports the outage itself.
            while True:
                started = time.monotonic()
                bypasses = _unhealthy_bypasses(cache)
                try:
                    result: Any = coll.find_one({"_id": 1})
                except ServerSelectionTimeoutError:
                    result = ServerSelectionTimeoutError
                if _unhealthy_bypasses(cache) > bypasses:
                    assert result is ServerSelectionTimeoutError
                    break
                assert result == {"_id": 1, "v": 1}
                assert started - stopped <= STALL_BOUND_S + SLACK_S, "still served after the bound"
                time.sleep(0.02)
            assert started - stopped <= STALL_BOUND_S + SLACK_S
            assert stream_of(cache, "outage").state != StreamState.HEALTHY
            with pytest.raises(ServerSelectionTimeoutError):
                coll.find_one({"_id": 1})
            assert not cache.wait_ready(0, database="outage")

            server.start()
            wait_until(
                lambda: cache.wait_ready(0, database="outage"),
                timeout=30,
                what="the stream serves again after restart",
            )
            written = event_time(writer.outage.items, lambda: writer.outage.items.update_one({"_id": 1}, {"$set": {"v": 2}}))

            # The resumed stream delivers the write; once the cache has applied
            # it, the old version is never served again.
            def applied() -> bool:
                t = stream_of(cache, "outage").applied_time
                return t is not None and t >= written

            wait_until(applied, timeout=30, what="the write after the restart is applied")

            def fresh() -> bool:
                try:
                    doc = coll.find_one({"_id": 1})
                except ConnectionFailure:
                    return False  # the reader is still reconnecting
                assert doc == {"_id": 1, "v": 2}, f"stale read after restart: {doc!r}"
                return True

            wait_until(fresh, timeout=30, what="the reader reconnects")
            _cache_twice(cache, coll, {"_id": 1, "v": 2})
            assert stream_of(cache, "outage").reconnects >= 1
        finally:
            cache.close()
            reader.close()
            writer.close()


# -- the stream's cursor is killed ---------------------------------------------------


def _stream_cursors(client: pymongo.MongoClient, db_name: str) -> dict[int, str]:
    """Ids of the open change-stream cursors that can carry ``db_name``:
    the deployment-wide ones and ``db_name``'s own (SecantusDB lists them as
    idle cursors of "admin.$cmd.aggregate" and "<db>.$cmd.aggregate"), with
    the database each belongs to."""
    namespaces = {"admin.$cmd.aggregate", f"{db_name}.$cmd.aggregate"}
    ops = client.admin.command("currentOp")["inprog"]
    return {
        int(op["cursorId"]): op["ns"].split(".", 1)[0]
        for op in ops
        if op.get("type") == "idleCursor" and op.get("ns") in namespaces and op.get("cursorId")
    }


def _stream_cursor_ids(client: pymongo.MongoClient, db_name: str) -> set[int]:
    return set(_stream_cursors(client, db_name))


@needs_local_server
def test_a_killed_stream_cursor_is_resumed_and_later_writes_invalidate(
    manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(manager, db_name, "items")
    _cache_twice(manager, coll, {"_id": 1, "v": 1})
    # Every deployment-wide stream's cursor is listed under "admin", other
    # caches' too (they resume as this one does): all are killed.
    cursors = wait_until(lambda: _stream_cursors(client, db_name), what="the stream's cursor is listed")
    killed = set(cursors)
    for cursor, owner_db in cursors.items():
        reply = client[owner_db].command("killCursors", "$cmd.aggregate", cursors=[Int64(cursor)])
        assert reply["cursorsKilled"] == [cursor]
    # A write right after the kill, racing the stream's resume.
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})

    wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}, what="the racing write is seen")
    resumed = wait_until(
        lambda: _stream_cursor_ids(client, db_name) - killed, what="the stream opens a new cursor"
    )
    assert resumed
    wait_until(lambda: manager.wait_ready(0, database=db_name), what="the stream serves")
    _cache_twice(manager, coll, {"_id": 1, "v": 2})
    # And the resumed stream goes on delivering.
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 3}})
    wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 3}, what="a later write is seen")


# -- failpoints: a hung getMore, lost history ----------------------------------------


@pytest.fixture(scope="module")
def failpoint_server() -> Iterator[DisposableServer]:
    """A server that accepts configureFailPoint and keeps only 5 oplog entries
    after an explicit prune (it prunes by itself only every 1000 writes)."""
    if external_uri() is not None:
        pytest.skip("MONGODB_URI is set: failpoints are armed on a local server only")
    with DisposableServer(oplog_max_entries=5, extra_args=["--enable-test-commands"]) as server:
        yield server


@pytest.fixture
def fp_client(failpoint_server: DisposableServer) -> Iterator[pymongo.MongoClient]:
    mongo = pymongo.MongoClient(failpoint_server.uri)
    try:
        yield mongo
    finally:
        mongo.admin.command("configureFailPoint", "failCommand", mode="off")
        mongo.close()


def _arm(client: pymongo.MongoClient, mode: Any, **data: Any) -> None:
    """Fail the cache's stream commands only (scoped by application name)."""
    client.admin.command(
        "configureFailPoint", "failCommand", mode=mode, data={"appName": STREAM_APP_NAME, **data}
    )


@needs_local_server
def test_a_hung_stream_stops_serving_within_the_stall_bound(fp_client, make_manager):
    cache = make_manager(client=fp_client)
    fp_client.hung.items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(cache, "hung", "items")
    _cache_twice(cache, coll, {"_id": 1, "v": 1})
    block_s = 6.0

    # The stream's next getMore hangs for block_s: the socket stays open, so
    # only the stall bound can tell readers that the stream is behind. A write
    # elsewhere in the database makes the in-flight getMore return; the one
    # after it is the blocked one.
    for attempt in range(3):
        _arm(fp_client, {"times": 1}, failCommands=["getMore"], blockConnection=True,
             blockTimeMS=int(block_s * 1000))  # fmt: skip
        events = stream_of(cache, "hung").events
        probed = time.monotonic()
        fp_client.hung.probe.insert_one({"_id": attempt})
        wait_until(lambda: stream_of(cache, "hung").events > events, what="the probe is applied")
        last_progress = time.monotonic()
        if last_progress - probed < block_s / 2:
            break
        # Armed between two getMores: the blocked one carried the probe and
        # the failpoint is spent. Arm again.
    else:
        pytest.fail("the probe event was never delivered ahead of the blocked getMore")
    fp_client.hung.items.update_one({"_id": 1}, {"$set": {"v": 2}})
    bypasses = _unhealthy_bypasses(cache)

    wait_until(
        lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 2},
        timeout=30,
        what="the update is served",
    )
    seen = time.monotonic() - last_progress
    assert seen <= STALL_BOUND_S + SLACK_S, seen
    assert seen < block_s  # not merely because the blocked getMore returned
    assert _unhealthy_bypasses(cache) > bypasses
    # Once the blocked getMore returns, the stream catches up and serves again.
    wait_until(
        lambda: stream_of(cache, "hung").state == StreamState.HEALTHY
        and cache.wait_ready(0, database="hung"),
        timeout=30,
        what="the stream serves again",
    )
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    _cache_twice(cache, coll, {"_id": 1, "v": 2})


@needs_local_server
def test_lost_history_drops_the_databases_entries_before_caching_resumes(fp_client, make_manager):
    cache = make_manager(client=fp_client)
    fp_client.history.items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(cache, "history", "items")
    _cache_twice(cache, coll, {"_id": 1, "v": 1})
    before = stream_of(cache, "history")

    # Cut the stream off (its commands lose their connection) ...
    _arm(fp_client, "alwaysOn", failCommands=["getMore", "aggregate"], closeConnection=True)
    try:
        wait_until(
            lambda: stream_of(cache, "history").state != StreamState.HEALTHY,
            what="the stream notices it is cut off",
        )
        # ... change the cached document and push its history out of the oplog.
        fp_client.history.items.update_one({"_id": 1}, {"$set": {"v": 2}})
        fp_client.history.filler.insert_many([{"i": i} for i in range(20)])
        assert fp_client.admin.command("secantusAdmin.pruneOplog")["pruned"] > 0
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}  # bypassed
    finally:
        _arm(fp_client, "off")

    # The resume is refused (ChangeStreamHistoryLost); the stream starts
    # afresh after dropping every entry of the database.
    wait_until(
        lambda: stream_of(cache, "history").history_lost > before.history_lost
        and cache.wait_ready(0, database="history"),
        timeout=30,
        what="the stream reports lost history and serves again",
    )
    after = stream_of(cache, "history")
    assert after.history_lost == before.history_lost + 1
    assert "286" in after.last_error
    hits = cache.snapshot().hits
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    assert cache.snapshot().hits == hits  # a miss: the old entry is gone
    _cache_twice(cache, coll, {"_id": 1, "v": 2})


@needs_local_server
def test_lost_history_drops_every_database_the_stream_carried(fp_client, make_manager):
    # One deployment-wide stream carries both databases: when it cannot
    # resume, a write to either may be in the gap, so both lose their
    # entries, including the one nobody wrote to.
    cache = make_manager(client=fp_client)
    names = ("history_a", "history_b")
    colls = []
    for name in names:
        fp_client[name].items.replace_one({"_id": 1}, {"_id": 1, "v": 1}, upsert=True)
        colls.append(ready_collection(cache, name, "items"))
        _cache_twice(cache, colls[-1], {"_id": 1, "v": 1})
    before = {name: stream_of(cache, name).history_lost for name in names}

    _arm(fp_client, "alwaysOn", failCommands=["getMore", "aggregate"], closeConnection=True)
    try:
        wait_until(
            lambda: all(stream_of(cache, name).state != StreamState.HEALTHY for name in names),
            what="the stream notices it is cut off",
        )
        fp_client.history_a.items.update_one({"_id": 1}, {"$set": {"v": 2}})
        fp_client.history_a.filler.insert_many([{"i": i} for i in range(20)])
        assert fp_client.admin.command("secantusAdmin.pruneOplog")["pruned"] > 0
    finally:
        _arm(fp_client, "off")

    wait_until(
        lambda: all(
            stream_of(cache, name).history_lost == before[name] + 1 and cache.wait_ready(0, database=name)
            for name in names
        ),
        timeout=30,
        what="both databases report lost history and serve again",
    )
    for coll, want in zip(colls, ({"_id": 1, "v": 2}, {"_id": 1, "v": 1})):
        hits = cache.snapshot().hits
        assert coll.find_one({"_id": 1}) == want
        assert cache.snapshot().hits == hits  # a miss: the old entry is gone
        _cache_twice(cache, coll, want)


# -- a stream the server refuses to start ------------------------------------


def _state_after_start(cache: CacheManager, db: str) -> Any:
    """The database's stream once it left not_started/connecting."""

    def settled() -> Any:
        streams = [s for s in cache.snapshot().streams if s.database == db]
        if streams and streams[0].state not in (StreamState.NOT_STARTED, StreamState.CONNECTING):
            return streams[0]
        return None

    return wait_until(settled, what=f"the stream of {db} started or was refused")


@pytest.mark.skipif(external_uri() is not None, reason="MONGODB_URI is set: the test creates a user")
def test_a_stream_refused_for_its_password_is_startup_failed_and_retried(client, server_uri, db_name):
    user, password = f"cqc_{db_name[-8:]}", "right-password"
    client.admin.command("createUser", user, pwd=password, roles=["root"])
    wrong = "wrong-password-31337"
    cache = CacheManager(
        client, stream_uri=server_uri.replace("mongodb://", f"mongodb://{user}:{wrong}@", 1), max_await_time_ms=200
    )
    try:
        client[db_name].items.insert_one({"_id": 1})
        coll = cache[db_name].items
        for _ in range(3):  # reads are PyMongo's meanwhile, right and never cached
            assert coll.find_one({"_id": 1}) == {"_id": 1}
        stream = _state_after_start(cache, db_name)
        assert stream.state is StreamState.STARTUP_FAILED, stream
        assert "authentication failed" in stream.last_error.lower() and wrong not in stream.last_error
        # Retried with back-off (1 s, then 2 s), and still reported as refused.
        first = stream.reconnects
        wait_until(lambda: _state_after_start(cache, db_name).reconnects > first, what="a second attempt")
        assert _state_after_start(cache, db_name).state is StreamState.STARTUP_FAILED
        snap = cache.snapshot()
        assert snap.hits == 0 and snap.bypasses.get("stream_unhealthy", 0) >= 3, snap
    finally:
        cache.close()
        client.admin.command("dropUser", user)


@pytest.mark.skipif(external_uri() is not None, reason="MONGODB_URI is set: the test starts its own server")
def test_a_standalone_server_makes_the_stream_startup_failed_with_its_reason():
    with DisposableServer(extra_args=["--standalone"]) as server, pymongo.MongoClient(server.uri) as mongo:
        cache = CacheManager(mongo, max_await_time_ms=200)
        try:
            mongo.d.items.insert_one({"_id": 1})
            assert cache["d"].items.find_one({"_id": 1}) == {"_id": 1}
            stream = _state_after_start(cache, "d")
            assert stream.state is StreamState.STARTUP_FAILED, stream
            assert "only supported on replica sets" in stream.last_error, stream.last_error
        finally:
            cache.close()


# -- what a stream costs, and how far behind it is -----------------------------


def test_a_streams_snapshot_counts_its_cost_and_its_invalidation_lag(make_manager, client, other_client, db_name):
    client[db_name].items.insert_many([{"_id": i, "v": 0} for i in range(5)])
    cache = make_manager()
    ready_collection(cache, db_name, "items")
    before = stream_of(cache, db_name)
    assert before.getmores is not None and before.event_bytes is not None and before.invalidations is not None
    writes = 20
    for i in range(writes):
        other_client[db_name].items.update_one({"_id": i % 5}, {"$inc": {"v": 1}})
        # Another collection of the database: an event, not an invalidation here.
        other_client[db_name].elsewhere.insert_one({"i": i})
    wait_until(lambda: stream_of(cache, db_name).events >= before.events + 2 * writes, what="the events applied")
    after = stream_of(cache, db_name)
    assert after.invalidations - before.invalidations == writes, (before, after)
    assert after.event_bytes - before.event_bytes >= 2 * writes * 100, (before, after)
    assert after.getmores > before.getmores
    assert after.lag_samples is not None and after.lag_samples >= min(2 * writes, 256)
    assert 0 <= after.lag_p50_ms <= after.lag_p95_ms <= after.lag_max_ms < 10_000, after
    # Idle, the stream keeps asking (one getMore a round, max_await_time_ms
    # apart) and its applied time stays within a round or two of the client's.
    idle = stream_of(cache, db_name).getmores
    wait_until(lambda: stream_of(cache, db_name).getmores >= idle + 2, what="two more rounds")
    assert stream_of(cache, db_name).behind_client_s is not None
