"""Sessions, transactions and causal reads (coherence rules 4 and 7), with
the sync and the async API alike.

* A read PyMongo would run in an explicit session (``session=`` or a session
  bound with ``ClientSession.bind()``) bypasses with reason ``session``, is
  never admitted, and does what PyMongo does, errors included; the cache's
  own reads never run in it.
* A process never reads older than it has seen: after a view's write, miss or
  bypass, a hit is served only once the stream has applied everything up to
  that cluster time (``stream_behind`` otherwise), and ``after(token)``
  carries that guarantee to another process.

To make "the stream has not applied it yet" certain rather than likely, the
cache's change stream goes through a proxy that can hold its traffic: while
held, the stream stays healthy (until the stall bound, 2.4 s here) but
applies nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pymongo
from pymongo import ReturnDocument
import pytest
from bson.timestamp import Timestamp
from pymongo.client_session import ClientSession
from pymongo.errors import InvalidOperation, OperationFailure

from benchmarks._proxy import FaultProxy
from client_query_cache import BypassReason, CacheConfigurationError, CacheManager, CausalListener, SharedCache
from client_query_cache.testing import external_uri
from support import (
    DEADLINE_S,
    TEST_MAX_AWAIT_MS,
    Driver,
    bypass_delta,
    ready_collection,
    served,
    settled,
    stream_passed_now,
    wait_until,
)

pytestmark = pytest.mark.skipif(
    not hasattr(ClientSession, "bind"), reason="ClientSession.bind() needs PyMongo 4.17"
)

SESSION = BypassReason.SESSION.value
BEHIND = BypassReason.STREAM_BEHIND.value


@pytest.fixture
def proxy(server_uri: str) -> Iterator[FaultProxy]:
    """A proxy in front of the server for the cache's change stream."""
    if external_uri() is not None:
        pytest.skip("MONGODB_URI is set: the stream proxy fronts a local server only")
    with FaultProxy(urlsplit(server_uri).port or 27017) as p:
        yield p


def _seed(client: pymongo.MongoClient, db_name: str, *docs: dict[str, Any]) -> None:
    client[db_name].items.insert_many(list(docs) or [{"_id": 1, "k": "a", "v": 1}])


def _delta(cache: Any, before: Any) -> dict[str, int]:
    return bypass_delta(dict(before.bypasses), dict(cache.snapshot().bypasses))


@contextlib.contextmanager
def _held(proxy: FaultProxy) -> Iterator[None]:
    """The stream applies nothing inside (and must still be healthy: the
    block has to end within the stall bound)."""
    proxy.holding = True
    start = time.monotonic()
    try:
        yield
    finally:
        proxy.holding = False
    assert time.monotonic() - start < (2 * TEST_MAX_AWAIT_MS + 2000) / 1000, "held past the stall bound"


# -- sessions -------------------------------------------------------------------

READS: list[tuple[str, Callable[[Any], Any]]] = [
    ("find_one", lambda c: c.find_one({"_id": 1})),
    ("find", lambda c: c.find({})),
    ("aggregate", lambda c: c.aggregate([{"$match": {}}])),
    ("count_documents", lambda c: c.count_documents({})),
    ("distinct", lambda c: c.distinct("v")),
]


async def _read(d: Driver, name: str, call: Callable[[Any], Any], coll: Any) -> Any:
    result = call(coll)
    if name in ("find", "aggregate"):
        return await d.docs(result)
    return await d.r(result)


@pytest.mark.parametrize("name,call", READS, ids=[n for n, _ in READS])
async def test_a_read_in_a_bound_session_bypasses_and_admits_nothing(d, client, db_name, name, call):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    raw = mongo[db_name].items
    session = mongo.start_session()
    try:
        before = cache.snapshot()
        async with d.bound(session):
            got = await _read(d, name, call, coll)
            expected = await _read(d, name, call, raw)
        after = cache.snapshot()
    finally:
        await d.r(session.end_session())
    assert got == expected
    assert _delta(cache, before) == {SESSION: 1}
    assert (after.hits, after.misses, after.admissions) == (before.hits, before.misses, before.admissions)


async def test_an_aborted_transactions_write_is_never_cached(d, client, db_name):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    assert await d.r(coll.find_one({"_id": 1})) is not None  # the collection is probed and read
    session = mongo.start_session()
    try:
        async with d.bound(session):
            await d.r(session.start_transaction())
            await d.r(coll.insert_one({"_id": "new-record", "v": 1}))
            inside = await d.r(coll.find_one({"_id": "new-record"}))
            entries = cache.snapshot().entries
            await d.r(session.abort_transaction())
    finally:
        await d.r(session.end_session())
    assert inside == {"_id": "new-record", "v": 1}  # the transaction sees its own write
    assert cache.snapshot().entries == entries
    # Outside, MongoDB has no such document, now and after the stream caught up.
    for _ in range(2):
        assert await d.r(coll.find_one({"_id": "new-record"})) is None
    assert await d.r(cache.wait_ready(DEADLINE_S, database=db_name))
    assert await d.r(coll.find_one({"_id": "new-record"})) is None


async def test_a_transaction_reads_its_own_writes_past_cached_entries(d, client, db_name):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    for _ in range(2):  # cached
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 1
        assert [x["v"] for x in await d.docs(coll.find({}))] == [1]
        assert [x["v"] for x in await d.docs(coll.aggregate([]))] == [1]
    session = mongo.start_session()
    try:
        async with d.bound(session):
            await d.r(session.start_transaction())
            await d.r(coll.update_one({"_id": 1}, {"$set": {"v": 2}}))
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
            assert [x["v"] for x in await d.docs(coll.find({}))] == [2]
            assert [x["v"] for x in await d.docs(coll.aggregate([]))] == [2]
            await d.r(session.commit_transaction())
    finally:
        await d.r(session.end_session())


async def test_estimated_count_in_a_transaction_raises_what_pymongo_raises(d, client, db_name):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    assert await d.r(coll.estimated_document_count()) == 1
    assert await d.r(coll.estimated_document_count()) == 1  # cached
    outcomes = []
    for target in (coll, mongo[db_name].items):
        session = mongo.start_session()
        try:
            async with d.bound(session):
                await d.r(session.start_transaction())
                try:
                    outcomes.append(("returned", await d.r(target.estimated_document_count())))
                except OperationFailure as exc:
                    outcomes.append(("raised", type(exc), exc.code))
                await d.r(session.abort_transaction())
        finally:
            await d.r(session.end_session())
    assert outcomes[0] == outcomes[1]


async def test_another_clients_bound_session_raises_what_pymongo_raises(d, client, db_name):
    _seed(client, db_name)
    mongo, stranger = d.client(), d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    assert await d.r(coll.find_one({"_id": 1}))  # cached
    session = stranger.start_session()
    try:
        async with d.bound(session):
            for target in (coll, mongo[db_name].items):
                with pytest.raises(InvalidOperation):
                    await d.r(target.find_one({"_id": 1}))
    finally:
        await d.r(session.end_session())


async def test_a_first_read_in_a_bound_transaction_runs_no_probe_in_it(d, client, db_name):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)  # never read before: not probed
    session = mongo.start_session()
    try:
        async with d.bound(session):
            await d.r(session.start_transaction())
            got = await d.r(coll.find_one({"_id": 1}))
            await d.r(session.commit_transaction())
    finally:
        await d.r(session.end_session())
    assert got == {"_id": 1, "k": "a", "v": 1}


async def test_a_cursor_is_bound_by_where_its_first_document_is_fetched(d, client, db_name):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = await d.ready(cache, db_name)
    await d.served(cache, lambda: d.docs(coll.find({})))
    session = mongo.start_session()
    try:
        outside = coll.find({})
        before = cache.snapshot()
        async with d.bound(session):
            assert [x["v"] for x in await d.docs(outside)] == [1]
            inside = coll.find({})
        assert _delta(cache, before) == {SESSION: 1}
        # The session's read went to MongoDB and raised the causal floor to
        # the client's cluster time, which other tests' writes to this server
        # may have moved on: a read right now may be held for the stream.
        await d.served(cache, lambda: d.docs(coll.find({})))
        hits = cache.snapshot().hits
        assert [x["v"] for x in await d.docs(inside)] == [1]  # fetched outside: a hit
        assert cache.snapshot().hits == hits + 1
    finally:
        await d.r(session.end_session())


# -- the causal floor ---------------------------------------------------------------


async def test_a_write_through_the_view_is_read_back_at_once(d, client, db_name, proxy):
    _seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    assert (await d.served(cache, lambda: coll.find_one({"_id": 1})))["v"] == 1
    assert await d.served(cache, lambda: coll.count_documents({"v": 2})) == 0
    with _held(proxy):
        await d.r(coll.update_one({"_id": 1}, {"$set": {"v": 2}}))
        # The write invalidated both entries at once (the stream has applied
        # nothing): each read is a miss, not refused by the floor, and what
        # it read, after the write, is served at once.
        for read, want in ((lambda: coll.find_one({"_id": 1}), {"_id": 1, "k": "a", "v": 2}),
                           (lambda: coll.count_documents({"v": 2}), 1)):  # fmt: skip
            before = cache.snapshot()
            assert await d.r(read()) == want
            assert await d.r(read()) == want
            after = cache.snapshot()
            assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
            assert (after.behind - before.behind, _delta(cache, before)) == (0, {})
    # Once the stream has applied the write, reads are served again.
    hits = cache.snapshot().hits
    deadline = time.monotonic() + DEADLINE_S
    while cache.snapshot().hits == hits:
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
        assert time.monotonic() < deadline, cache.snapshot()


async def test_a_write_to_one_document_holds_back_only_what_depends_on_it(d, client, db_name, proxy):
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1}, {"_id": 2, "k": "b", "v": 1})
    mongo = d.client()
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    for _id in (1, 2):
        assert (await d.served(cache, lambda: coll.find_one({"_id": _id})))["v"] == 1
    assert (await d.served(cache, lambda: coll.find_one({"k": "b"})))["v"] == 1
    # The query's miss may have seen a newer document 2 than its identity
    # entry: that one waits for the stream to pass the query.
    assert (await d.served(cache, lambda: coll.find_one({"_id": 2})))["v"] == 1
    with _held(proxy):
        await d.r(coll.update_one({"_id": 1}, {"$set": {"v": 2}}))
        before = cache.snapshot()
        # Another document's identity entry is still served...
        assert (await d.r(coll.find_one({"_id": 2})))["v"] == 1
        assert cache.snapshot().hits == before.hits + 1
        # ...but not the written one's, nor a query of the collection: the
        # write invalidated them at once, so both are misses.
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
        assert (await d.r(coll.find_one({"k": "b"})))["v"] == 1
        after = cache.snapshot()
        assert (after.misses - before.misses, after.behind - before.behind, _delta(cache, before)) == (2, 0, {})


def test_reads_of_other_documents_never_hold_back_a_documents_entry(make_manager, client, db_name):
    # Hundreds of documents read between two stream rounds put some _ids in
    # one of the arena's shared invalidation cells (65,536 per arena: 500
    # _ids share none about 15 times in 100). A read of one document says
    # nothing of another: every entry is served, whatever was read after it.
    # Nothing is written and the stream's rounds are 20 s apart, so the
    # stream covers none of these reads: only the floor's own rule decides.
    # (500 also stays well inside the floor's 512 sets of 8 documents: a
    # ninth in one set would bind the whole collection, refusing more.)
    count = 500
    client[db_name].items.insert_many([{"_id": i, "v": i} for i in range(count)])
    cache = make_manager(max_await_time_ms=20_000)
    coll = ready_collection(cache, db_name, "items")
    for i in range(count):
        assert coll.find_one({"_id": i}) == {"_id": i, "v": i}
    before = cache.snapshot()
    assert before.misses >= count
    for i in range(count):
        assert coll.find_one({"_id": i}) == {"_id": i, "v": i}
    after = cache.snapshot()
    assert (after.hits - before.hits, after.behind - before.behind) == (count, 0), after


async def test_no_read_method_goes_back_behind_a_newer_version_seen(d, client, other_client, db_name, proxy):
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1}, {"_id": 2, "k": "b", "v": 1})
    mongo = d.client()
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    # Cached by _id, as a query and as a count.
    assert (await d.served(cache, lambda: coll.find_one({"_id": 1})))["v"] == 1
    assert [x["v"] for x in await d.served(cache, lambda: d.docs(coll.find({}, sort=[("_id", 1)])))] == [1, 1]
    assert await d.served(cache, lambda: coll.count_documents({})) == 2
    with _held(proxy):
        other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
        other_client[db_name].items.delete_one({"_id": 2})
        # A read the cache misses sees both writes...
        assert (await d.r(coll.find_one({"k": "a"})))["v"] == 2
        # ...so none of the entries cached before may be served now.
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
        assert [x["v"] for x in await d.docs(coll.find({}, sort=[("_id", 1)]))] == [2]
        assert await d.r(coll.count_documents({})) == 1


async def test_a_token_carries_a_write_to_another_process(d, client, db_name, proxy):
    _seed(client, db_name)
    writer = d.manager(d.client())
    reader = d.manager(d.client(), stream_uri=proxy.uri)
    written = await d.ready(writer, db_name)
    coll = await d.ready(reader, db_name)
    assert (await d.served(reader, lambda: coll.find_one({"_id": 1})))["v"] == 1
    with _held(proxy):
        await d.r(written.update_one({"_id": 1}, {"$set": {"v": 2}}))
        token = writer.cluster_time()
        assert isinstance(token, Timestamp)
        # The reader's process has not seen the write: its cache may serve
        # the old version...
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 1
        # ...but not to a request that carries the writer's token.
        before = reader.snapshot()
        with reader.after(token):
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
            assert [x["v"] for x in await d.docs(coll.find({}))] == [2]
        assert _delta(reader, before) == {BEHIND: 2}


async def test_a_listener_covers_writes_made_outside_the_views(d, client, db_name, proxy):
    _seed(client, db_name)
    mongo = d.client(event_listeners=[CausalListener()])
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    assert (await d.served(cache, lambda: coll.find_one({"_id": 1})))["v"] == 1
    with _held(proxy):
        await d.r(coll.raw.update_one({"_id": 1}, {"$set": {"v": 2}}))
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
        await d.r(mongo[db_name].command("update", "items", updates=[{"q": {"_id": 1}, "u": {"$set": {"v": 3}}}]))
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 3


class _FindGate(pymongo.monitoring.CommandListener):
    """Holds the threads it is armed for right after their ``find`` reply
    was processed (the client's cluster time already advanced), before the
    cache sees the result."""

    def __init__(self) -> None:
        self.gates: dict[str, tuple[threading.Event, threading.Event]] = {}

    def arm(self, thread: threading.Thread) -> tuple[threading.Event, threading.Event]:
        reached, release = threading.Event(), threading.Event()
        self.gates[thread.name] = (reached, release)
        return reached, release

    def started(self, event: Any) -> None:
        pass

    def failed(self, event: Any) -> None:
        pass

    def succeeded(self, event: Any) -> None:
        gate = self.gates.pop(threading.current_thread().name, None) if event.command_name == "find" else None
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(DEADLINE_S)


def test_a_miss_that_ends_after_a_newer_read_is_not_served_ahead_of_the_stream(
    server_uri, client, other_client, db_name, proxy, make_manager
):
    # Two reads of one process overlap: B reads version 1, a write makes
    # version 2, A reads version 2, and B's result reaches the cache only
    # after A's reply advanced the client's cluster time, but before A's
    # result did. A has returned version 2, so B's entry (version 1) must not
    # be served until the stream has applied the write: B's read did not
    # stand for everything the process had observed.
    _seed(client, db_name)
    gate = _FindGate()
    mongo = pymongo.MongoClient(server_uri, event_listeners=[gate])
    try:
        cache = make_manager(client=mongo, stream_uri=proxy.uri)
        coll = ready_collection(cache, db_name, "items")
        got: dict[str, Any] = {}

        def read(name: str, filter: dict[str, Any]) -> None:
            got[name] = coll.find_one(filter)

        b = threading.Thread(target=read, args=("b", {"k": "a"}))
        a = threading.Thread(target=read, args=("a", {"_id": 1}))
        with _held(proxy):
            b_gate = a_gate = None
            try:
                b_gate = gate.arm(b)
                b.start()
                assert b_gate[0].wait(DEADLINE_S)
                other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
                a_gate = gate.arm(a)
                a.start()
                assert a_gate[0].wait(DEADLINE_S)
                b_gate[1].set()
                b.join(DEADLINE_S)
                a_gate[1].set()
                a.join(DEADLINE_S)
            finally:
                for g in (b_gate, a_gate):
                    if g is not None:
                        g[1].set()
            assert got["b"]["v"] == 1 and got["a"]["v"] == 2
            assert coll.find_one({"k": "a"})["v"] == 2
    finally:
        mongo.close()


@contextlib.contextmanager
def _two_workers(server_uri: str, proxy: FaultProxy) -> Iterator[tuple[SharedCache, tuple[CacheManager, CacheManager]]]:
    """An owner whose stream goes through ``proxy``, and two workers of it in
    this process. The workers' clients name the proxy as a seed too, so that
    the owner follows their deployment; their reads go to the member the
    server names, not through the proxy."""
    owner = SharedCache.start(f"cqc-{uuid.uuid4().hex[:12]}", proxy.uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    seeds = f"{urlsplit(server_uri).netloc},{urlsplit(proxy.uri).netloc}"
    clients = [pymongo.MongoClient(f"mongodb://{seeds}/") for _ in range(2)]
    managers: list[CacheManager] = []
    try:
        for mongo in clients:
            managers.append(CacheManager(mongo, shared=owner.name, max_await_time_ms=TEST_MAX_AWAIT_MS))
        yield owner, (managers[0], managers[1])
    finally:
        for m in managers:
            m.close()
        for mongo in clients:
            mongo.close()
        owner.stop(timeout=10)


def _probe_admitted(owner: Any, coll: Any, n: int) -> None:
    """Read the absent document 100 + n through ``coll`` (its collection is
    probed, and the "not found" admitted; each worker its own document, so
    that one's entry is no hit for the other) until the owner has accepted
    ``n`` admissions in all. A read that bypassed (the worker's stream not
    yet passing what it read, under load) admits nothing: it is read again,
    but only after the owner had a second to drain an admission in flight."""
    for _ in range(15):
        assert coll.find_one({"_id": 100 + n}) is None
        try:
            wait_until(lambda: owner.snapshot()["admissions_accepted"] >= n, timeout=1, what="admitted")
            return
        except AssertionError:
            continue
    raise AssertionError(f"probe {n} was never admitted: {owner.snapshot()!r}")


def test_a_workers_own_miss_never_serves_another_workers_older_entry(
    server_uri, client, other_client, db_name, proxy, runtime_dir
):
    # Shared cache: worker 1 read version 1; a write makes version 2; worker
    # 2 misses, reads version 2 and queues its admission, but worker 1's
    # admission of version 1 reached the arena first (between worker 2's
    # lookup and its read). Worker 2 has returned version 2: the entry under
    # the key is not the result its own miss admitted, so it must not be
    # served to worker 2 before the stream has applied the write.
    _seed(client, db_name)
    with _two_workers(server_uri, proxy) as (owner, (w1, w2)):
        c1, c2 = (ready_collection(m, db_name, "items") for m in (w1, w2))
        for n, coll in enumerate((c1, c2), start=1):
            _probe_admitted(owner, coll, n)
        accepted = owner.snapshot()["admissions_accepted"]
        held: list[tuple[Any, ...]] = []
        real_admit = w1._engine.admit
        w1._engine.admit = lambda *args, **kwargs: held.append((args, kwargs))
        assert c1.find_one({"_id": 1})["v"] == 1
        w1._engine.admit = real_admit
        [(args, kwargs)] = held

        def admit_worker_1() -> None:
            real_admit(*args, **kwargs)
            wait_until(
                lambda: owner.snapshot()["admissions_accepted"] == accepted + 1,
                what="worker 1's entry is in the arena",
            )

        with _held(proxy):
            other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
            w2._engine.hooks.after_capture = admit_worker_1
            w2._engine.hooks.before_admit = lambda: os.kill(owner.pid, signal.SIGSTOP)
            try:
                assert c2.find_one({"_id": 1})["v"] == 2
                w2._engine.hooks.after_capture = w2._engine.hooks.before_admit = None
                assert c2.find_one({"_id": 1})["v"] == 2
            finally:
                os.kill(owner.pid, signal.SIGCONT)


def test_after_takes_a_timestamp_or_none(manager):
    with manager.after(None):
        pass
    for bad in (5, "1:2", (1, 2)):
        with pytest.raises(CacheConfigurationError, match="token"):
            with manager.after(bad):
                pass


# -- observations beside plain view reads ----------------------------------------


async def test_a_listener_covered_write_is_read_back_right_after_a_miss(d, client, db_name, proxy):
    # The entry is fresh from this process's own miss (no other observation
    # since): the raw write the listener reports must still hold it back.
    _seed(client, db_name, {"_id": 1, "v": 1}, {"_id": 2, "v": 1})
    mongo = d.client(event_listeners=[CausalListener()])
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    for attempt in range(3):
        with _held(proxy):
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == attempt + 1  # a miss: admitted
            await d.r(coll.raw.update_one({"_id": 1}, {"$inc": {"v": 1}}))
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == attempt + 2
        # Let the stream apply it before the next round's miss.
        await asyncio.sleep(3 * TEST_MAX_AWAIT_MS / 1000)


def test_a_listener_covered_write_is_never_read_behind_by_another_thread(server_uri, client, db_name, make_manager):
    # Case 3 as it broke: with a CausalListener, one thread writes through
    # .raw (find_one_and_update, its new version known once it returns);
    # another thread of the process reads the written documents through the
    # view all the time. A read that starts after a write was acknowledged
    # never returns an older version. (d8845f3: 1,637 such reads of 2.3 million
    # in 5 s; 1 or 2 in 2 s under load.)
    _seed(client, db_name, *({"_id": k, "v": 0} for k in range(4)))
    mongo = pymongo.MongoClient(server_uri, event_listeners=[CausalListener()])
    try:
        cache = make_manager(client=mongo)
        coll = ready_collection(cache, db_name, "items")
        acknowledged = {1: 0, 3: 0}
        behind: list[tuple[int, int, int]] = []
        reads = [0]
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                for k in (1, 3):
                    want = acknowledged[k]
                    got = coll.find_one({"_id": k})["v"]
                    reads[0] += 1
                    if got < want:
                        behind.append((k, got, want))

        reader = threading.Thread(target=read)
        reader.start()
        writes = 0
        try:
            until = time.monotonic() + 4.0
            while time.monotonic() < until:
                k = 1 if writes % 2 else 3
                doc = coll.raw.find_one_and_update({"_id": k}, {"$inc": {"v": 1}}, return_document=ReturnDocument.AFTER)
                acknowledged[k] = doc["v"]
                writes += 1
                time.sleep(0.001)
        finally:
            stop.set()
            reader.join(DEADLINE_S)
        assert writes >= 20 and reads[0] >= 100, (writes, reads[0])
        assert behind == [], f"{len(behind)} of {reads[0]} reads behind an acknowledged write: {behind[:5]}"
    finally:
        mongo.close()


async def test_a_context_copied_inside_an_after_block_stays_bound_to_its_token(d, client, db_name, proxy):
    # A task created inside ``with after(token):`` (or a context copied there)
    # carries the token for its life, as every context variable does: its
    # reads after the block has closed are held to the token too, whether or
    # not another after() block happens to be open elsewhere in the process.
    _seed(client, db_name, {"_id": 1, "v": 1}, {"_id": 2, "v": 1})
    writer = d.manager(d.client())
    reader = d.manager(d.client(), stream_uri=proxy.uri)
    written = await d.ready(writer, db_name)
    coll = await d.ready(reader, db_name)
    assert (await d.served(reader, lambda: coll.find_one({"_id": 1})))["v"] == 1
    with _held(proxy):
        await d.r(written.update_one({"_id": 1}, {"$set": {"v": 2}}))
        token = writer.cluster_time()
        go = asyncio.Event()

        async def read_later() -> Any:
            await go.wait()
            return await d.r(coll.find_one({"_id": 1}))

        with reader.after(token):
            if d.is_async:
                task = asyncio.get_running_loop().create_task(read_later())
            else:
                copied = contextvars.copy_context()
        # The block is closed: an unconstrained read still gets the old version...
        assert (await d.r(coll.find_one({"_id": 1})))["v"] == 1
        # ...but not one in the context that carries the token.
        go.set()
        if d.is_async:
            got = await task
        else:
            got = copied.run(lambda: coll.find_one({"_id": 1}))
        assert got["v"] == 2


@pytest.mark.parametrize(
    "stage",
    [
        lambda target: {"$merge": {"into": {"db": target, "coll": "items"}, "whenMatched": "replace"}},
        lambda target: {"$out": {"db": target, "coll": "items"}},
    ],
    ids=["merge", "out"],
)
async def test_a_pipeline_writing_into_another_database_is_read_back(d, client, db_name, proxy, stage):
    target = f"{db_name}_t"
    try:
        client[db_name].items.insert_one({"_id": 1, "v": 2})
        client[target].items.insert_one({"_id": 1, "v": 1})
        mongo = d.client()
        cache = d.manager(mongo, stream_uri=proxy.uri)
        source = await d.ready(cache, db_name)
        written = await d.ready(cache, target)
        assert (await d.served(cache, lambda: written.find_one({"_id": 1})))["v"] == 1
        with _held(proxy):
            assert await d.docs(source.aggregate([{"$match": {}}, stage(target)])) == []
            assert (await d.r(written.find_one({"_id": 1})))["v"] == 2
    finally:
        client.drop_database(target)


@pytest.mark.parametrize("write", ["update_one", "update_many"])
@pytest.mark.parametrize("how", ["argument", "bound"])
async def test_a_views_write_in_a_transaction_is_read_back_after_the_commit(d, client, db_name, proxy, write, how):
    _seed(client, db_name, {"_id": 1, "v": 1}, {"_id": 2, "v": 1})
    mongo = d.client()
    cache = d.manager(mongo, stream_uri=proxy.uri)
    coll = await d.ready(cache, db_name)
    assert (await d.served(cache, lambda: coll.find_one({"_id": 1})))["v"] == 1
    session = mongo.start_session()
    try:
        await d.r(session.start_transaction())
        if how == "argument":
            await d.r(getattr(coll, write)({"_id": 1}, {"$set": {"v": 2}}, session=session))
        else:
            async with d.bound(session):
                await d.r(getattr(coll, write)({"_id": 1}, {"$set": {"v": 2}}))
        # Outside the transaction, before its commit: the old version, also
        # once the stream has gone past the write (which has no event yet).
        await asyncio.sleep(3 * TEST_MAX_AWAIT_MS / 1000)
        for _ in range(3):
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == 1
        with _held(proxy):
            await d.r(session.commit_transaction())
            assert (await d.r(coll.find_one({"_id": 1})))["v"] == 2
            assert [x["v"] for x in await d.docs(coll.find({}, sort=[("_id", 1)]))] == [2, 1]
    finally:
        await d.r(session.end_session())


# -- the patterns that once served an older version --------------------------------


def test_a_find_spanning_batches_is_not_served_past_a_newer_read_of_one_of_its_documents(
    client, other_client, db_name, proxy, make_manager
):
    # A find whose reply spans batches reads document 1 in its first batch;
    # another client's write changes it before the last getMore; the
    # process then reads the new version; the same find again must not
    # return the old one (its entry holds what the first batch saw).
    _seed(client, db_name, *({"_id": i, "v": 1} for i in range(1, 4)))
    cache = make_manager(stream_uri=proxy.uri)
    coll = ready_collection(cache, db_name, "items")
    with _held(proxy):
        cursor = coll.find({}, sort=[("_id", 1)], batch_size=1)
        first = next(cursor)
        other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
        rest = list(cursor)
        assert [first["v"], *(d["v"] for d in rest)] == [1, 1, 1]  # read before the write
        assert coll.find_one({"_id": 1})["v"] == 2  # a newer read
        again = list(coll.find({}, sort=[("_id", 1)], batch_size=1))
        assert again[0] == {"_id": 1, "v": 2}, again


@pytest.mark.parametrize("other", ["view_of_another_database", "raw_read"])
def test_activity_on_the_same_client_during_a_miss_does_not_make_its_entry_newer(
    server_uri, client, other_client, db_name, proxy, make_manager, other
):
    # Thread A's miss of document 1 reads version 1 and is held right after
    # its reply. Meanwhile another client writes version 2 and thread B's
    # read (a view of another database, or .raw) moves the client's cluster
    # time past that write. A's entry then stands for nothing newer than
    # what A read: once the process has read version 2, it must not be
    # served.
    other_db = f"{db_name}_o"
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1})
    client[other_db].items.insert_one({"_id": 1})
    gate = _FindGate()
    mongo = pymongo.MongoClient(server_uri, event_listeners=[gate])
    try:
        cache = make_manager(client=mongo, stream_uri=proxy.uri)
        coll = ready_collection(cache, db_name, "items")
        elsewhere = ready_collection(cache, other_db, "items")
        got: dict[str, Any] = {}
        a = threading.Thread(target=lambda: got.setdefault("a", coll.find_one({"_id": 1})))
        with _held(proxy):
            reached, release = gate.arm(a)
            try:
                a.start()
                assert reached.wait(DEADLINE_S)
                other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
                if other == "raw_read":
                    assert elsewhere.raw.find_one({"_id": 1}) is not None
                else:
                    b = threading.Thread(target=lambda: got.setdefault("b", elsewhere.find_one({"_id": 1})))
                    b.start()
                    b.join(DEADLINE_S)
                    assert got["b"] == {"_id": 1}
            finally:
                release.set()
            a.join(DEADLINE_S)
            assert got["a"]["v"] == 1
            assert coll.find_one({"k": "a"})["v"] == 2  # the process reads version 2
            assert coll.find_one({"_id": 1})["v"] == 2
    finally:
        mongo.close()
        client.drop_database(other_db)


async def test_another_tasks_activity_during_a_miss_does_not_make_its_entry_newer(
    server_uri, client, other_client, db_name, proxy, monkeypatch
):
    # The asyncio form of the test above: task A's miss of document 1 has
    # read version 1 and waits, its reply processed, before the cache sees
    # its result; meanwhile another client writes version 2 and task B, on
    # the same client, reads a view of another database, which moves the
    # client's cluster time past that write. Once the process has read
    # version 2, A's entry must not be served.
    from client_query_cache import AsyncCacheManager
    from client_query_cache._core.read import CollectionCore

    other_db = f"{db_name}_o"
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1})
    client[other_db].items.insert_one({"_id": 1})
    mongo: pymongo.AsyncMongoClient = pymongo.AsyncMongoClient(server_uri)
    cache = AsyncCacheManager(mongo, stream_uri=proxy.uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        coll, elsewhere = cache[db_name].items, cache[other_db].items
        for c, name in ((coll, db_name), (elsewhere, other_db)):
            assert await c.find_one({"_id": 0}) is None
            assert await cache.wait_ready(DEADLINE_S, database=name)
        reached, release = asyncio.Event(), asyncio.Event()
        real = CollectionCore.miss_read
        gated: list[Any] = []

        def miss_read(core: Any, step: Any) -> Any:
            read = real(core, step)
            if gated or core.ns.db != db_name or step.plan.filter_bytes is None:
                return read
            gated.append(step)

            async def held() -> Any:
                result = await read
                reached.set()
                await release.wait()
                return result

            return held()

        monkeypatch.setattr(CollectionCore, "miss_read", miss_read)
        with _held(proxy):
            a = asyncio.create_task(coll.find_one({"_id": 1}))
            await asyncio.wait_for(reached.wait(), DEADLINE_S)
            other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
            assert await elsewhere.find_one({"_id": 1}) == {"_id": 1}  # task B
            release.set()
            assert (await a)["v"] == 1
            assert (await coll.find_one({"k": "a"}))["v"] == 2  # the process reads version 2
            assert (await coll.find_one({"_id": 1}))["v"] == 2
    finally:
        await cache.close()
        await mongo.close()
        client.drop_database(other_db)


def test_a_hit_on_another_workers_newer_entry_holds_back_an_older_own_entry(
    server_uri, client, other_client, db_name, proxy, runtime_dir
):
    # Shared cache: worker A cached a query's result (version 1 of document
    # 1); a write makes version 2; worker B reads it by _id and admits it;
    # worker A is served B's entry (version 2) from the arena. A hit is an
    # observation: A's older query entry must not be served to A afterwards.
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1})
    with _two_workers(server_uri, proxy) as (owner, (a, b)):
        ca, cb = (ready_collection(m, db_name, "items") for m in (a, b))
        assert ca.find_one({"k": "a"})["v"] == 1
        wait_until(lambda: owner.snapshot()["admissions_accepted"] == 1, what="A's entry is in the arena")
        wait_until(stream_passed_now(a, db_name), what="A's stream passes its read")
        assert served(a, lambda: ca.find_one({"k": "a"}))["v"] == 1
        with _held(proxy):
            other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
            assert cb.find_one({"_id": 1})["v"] == 2
            wait_until(lambda: owner.snapshot()["admissions_accepted"] == 2, what="B's entry is in the arena")
            hits = a.snapshot().hits
            assert ca.find_one({"_id": 1})["v"] == 2
            assert a.snapshot().hits == hits + 1  # B's entry, served to A
            assert ca.find_one({"k": "a"})["v"] == 2


def test_a_workers_read_is_served_from_another_workers_entry_of_the_same_result(
    server_uri, client, db_name, proxy, runtime_dir
):
    # Shared cache: worker A's miss of document 1 is in flight (held right
    # after its reply) when worker B misses it too, reads the same version
    # and its entry reaches the arena first; A's identical admission leaves
    # B's entry. A then reads document 1 again: the entry holds exactly what
    # A's own read returned, so it is served (no write in between can make it
    # older than what A saw), without waiting for the stream.
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1})
    gate = _FindGate()
    owner = SharedCache.start(f"cqc-{uuid.uuid4().hex[:12]}", proxy.uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    seeds = f"{urlsplit(server_uri).netloc},{urlsplit(proxy.uri).netloc}"
    clients = [pymongo.MongoClient(f"mongodb://{seeds}/", event_listeners=[gate]), pymongo.MongoClient(f"mongodb://{seeds}/")]
    managers = [CacheManager(c, shared=owner.name, max_await_time_ms=TEST_MAX_AWAIT_MS) for c in clients]
    try:
        a, b = managers
        ca, cb = (ready_collection(m, db_name, "items") for m in managers)
        # Each worker's own probe: a probe of one document by both could be
        # a floor refusal for the second (the first's entry, its stream not
        # yet past what the second read, under load), which admits nothing.
        for n, coll in enumerate((ca, cb), start=1):
            _probe_admitted(owner, coll, n)
        wait_until(stream_passed_now(a, db_name), what="A's stream passes the probes")
        got: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.setdefault("a", ca.find_one({"_id": 1})))
        with _held(proxy):
            reached, release = gate.arm(reader)
            try:
                reader.start()
                assert reached.wait(DEADLINE_S)
                assert cb.find_one({"_id": 1})["v"] == 1
                wait_until(lambda: owner.snapshot()["admissions_accepted"] == 3, what="B's entry is in the arena")
            finally:
                release.set()
            reader.join(DEADLINE_S)
            assert got["a"]["v"] == 1
            wait_until(lambda: owner.snapshot()["admissions_accepted"] == 4, what="A's admission is applied")
            hits = a.snapshot().hits
            assert ca.find_one({"_id": 1})["v"] == 1
            assert a.snapshot().hits == hits + 1
    finally:
        for m in managers:
            m.close()
        for c in clients:
            c.close()
        owner.stop(timeout=10)


def test_a_workers_read_back_of_its_own_write_is_a_miss_while_the_stream_lags(
    server_uri, client, db_name, proxy, runtime_dir
):
    # Shared cache, the owner's stream held: worker 1 writes document 1
    # through its view. The arena's entries of the document and of a query
    # of the collection are invalid for worker 1 from its write on: its next
    # reads of them are misses that read the write, not floor refusals.
    _seed(client, db_name, {"_id": 1, "k": "a", "v": 1}, {"_id": 2, "k": "b", "v": 1})
    with _two_workers(server_uri, proxy) as (owner, (w1, w2)):
        c1, c2 = (ready_collection(m, db_name, "items") for m in (w1, w2))
        assert c1.find_one({"_id": 1})["v"] == 1 and c1.count_documents({"v": 2}) == 0
        wait_until(lambda: owner.snapshot()["entries"] == 2, what="worker 1's entries are in the arena")
        for m, coll in ((w1, c1), (w2, c2)):
            settled(m, db_name)
            assert served(m, lambda coll=coll: coll.find_one({"_id": 1}))["v"] == 1
        with _held(proxy):
            c1.update_one({"_id": 1}, {"$set": {"v": 2}})
            before = w1.snapshot()
            assert c1.find_one({"_id": 1})["v"] == 2
            assert c1.count_documents({"v": 2}) == 1
            after = w1.snapshot()
            assert (after.misses - before.misses, after.behind - before.behind, _delta(w1, before)) == (2, 0, {})
