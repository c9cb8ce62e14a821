"""Generic find_one, count_documents, estimated_document_count and distinct:
served from the cache when safe, equal to what PyMongo returns, and
invalidated by writes to the collection."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Callable
from typing import Any

import pymongo
import pytest
from bson.binary import Binary, UuidRepresentation
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.son import SON

from client_query_cache import CacheManager
from support import async_ready_collection, outcome, ready_collection, settled, stream_of, wait_until

DOCS = [
    {"_id": 1, "kind": "fruit", "name": "apple", "n": 3, "tags": ["red", "sweet"], "at": {"x": 1}},
    {"_id": 2, "kind": "fruit", "name": "pear", "n": 5, "tags": ["green"], "at": {"x": 2}},
    {"_id": 3, "kind": "veg", "name": "leek", "n": 1, "tags": [], "at": {"x": 1}},
    {"_id": 4, "kind": "veg", "name": "kale", "n": 8, "tags": ["green", "bitter"]},
    {"_id": 5, "kind": "nut", "name": "pecan", "n": 2, "tags": ["sweet"], "at": None},
]

# (method, args, kwargs): reads that must be cached.
CACHED_READS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("find_one", ({"kind": "veg"},), {}),
    ("find_one", ({"kind": "fruit", "n": 5},), {}),
    ("find_one", ({"n": {"$gt": 2, "$lte": 8}},), {"sort": [("n", -1)]}),
    ("find_one", ({"kind": "fruit"},), {"sort": [("n", 1)], "skip": 1}),
    ("find_one", ({"tags": "green"}, {"name": 1, "_id": 0}), {}),
    ("find_one", ({"tags": {"$elemMatch": {"$eq": "sweet"}}},), {"projection": ["name"]}),
    ("find_one", ({"$or": [{"name": "kale"}, {"n": {"$lt": 2}}]},), {"sort": {"name": 1}}),
    ("find_one", ({"$expr": {"$gt": ["$n", {"$add": [1, 6]}]}},), {}),
    ("find_one", ({"at.x": 2},), {}),
    ("find_one", ({"name": {"$regex": "^pe"}},), {"sort": [("name", -1)]}),
    ("find_one", ({"kind": "mineral"},), {}),  # not found is cached too
    ("find_one", (), {}),
    ("find_one", (), {"filter": {"_id": 2}}),  # the filter by name, and an _id
    ("find_one", ({"_id": 3},), {"projection": {"name": 1}}),
    ("find_one", ({"_id": 4}, ["name"]), {}),
    ("find_one", ({"_id": {"$in": [4, 5]}},), {"sort": [("_id", -1)]}),
    ("count_documents", ({},), {}),
    ("count_documents", ({"kind": "fruit"},), {}),
    ("count_documents", ({"n": {"$gte": 2}},), {"skip": 1, "limit": 2}),
    ("count_documents", ({"tags": {"$size": 0}},), {}),
    ("estimated_document_count", (), {}),
    ("distinct", ("kind",), {}),
    ("distinct", ("tags", {"n": {"$gt": 1}}), {}),
    ("distinct", ("at",), {"filter": {"kind": {"$ne": "nut"}}}),
]


def _snap(manager: CacheManager) -> tuple[int, int, int]:
    s = manager.snapshot()
    return s.hits, s.misses, sum(s.bypasses.values())


@pytest.fixture
def items(manager, client, db_name):
    client[db_name].items.insert_many(DOCS)
    return ready_collection(manager, db_name, "items"), client[db_name].items


@pytest.fixture
async def driven_items(d, client, db_name):
    """``items`` for the driver ``d``: (its manager, the cached collection,
    the same collection of the driver's PyMongo client)."""
    client[db_name].items.insert_many(DOCS)
    mongo = d.client()
    cache = d.manager(mongo)
    return cache, await d.ready(cache, db_name), mongo[db_name].items


@pytest.mark.parametrize(("method", "args", "kwargs"), CACHED_READS, ids=lambda v: repr(v)[:40])
async def test_a_cached_read_returns_what_pymongo_returns_and_hits_the_second_time(
    d, driven_items, method, args, kwargs
):
    manager, cached, raw = driven_items
    expected = await d.r(getattr(raw, method)(*args, **kwargs))

    h0, m0, b0 = _snap(manager)
    first = await d.r(getattr(cached, method)(*args, **kwargs))
    h1, m1, b1 = _snap(manager)
    second = await d.r(getattr(cached, method)(*args, **kwargs))
    h2, m2, b2 = _snap(manager)

    assert first == expected and second == expected
    assert type(first) is type(expected) and type(second) is type(expected)
    assert (h1 - h0, m1 - m0, b1 - b0) == (0, 1, 0)  # a miss, admitted
    assert (h2 - h1, m2 - m1, b2 - b1) == (1, 0, 0)  # then a hit
    if isinstance(second, dict):
        assert second is not first  # a fresh object per hit


def test_permutations_of_a_flat_equality_filter_share_one_entry(manager, items):
    cached, _ = items
    assert cached.find_one({"kind": "fruit", "n": 5})["name"] == "pear"
    hits = manager.snapshot().hits
    assert cached.find_one({"n": 5, "kind": "fruit"})["name"] == "pear"
    assert cached.count_documents({"n": 5, "kind": "fruit"}) == 1
    assert cached.count_documents({"kind": "fruit", "n": 5}) == 1
    assert manager.snapshot().hits == hits + 2


def test_reads_that_differ_in_any_keyed_part_do_not_share_an_entry(manager, items):
    cached, raw = items
    reads: list[Callable[[Any], Any]] = [
        lambda c: c.find_one({"kind": "fruit"}),
        lambda c: c.find_one({"kind": "fruit"}, {"name": 1}),
        lambda c: c.find_one({"kind": "fruit"}, sort=[("n", -1)]),
        lambda c: c.find_one({"kind": "fruit"}, sort=[("n", -1)], skip=1),
        lambda c: c.find_one({"kind": "veg"}),
        lambda c: c.find_one({"kind": {"$eq": "fruit"}}),
        lambda c: c.count_documents({"kind": "fruit"}),
        lambda c: c.count_documents({"kind": "fruit"}, limit=1),
        lambda c: c.distinct("name", {"kind": "fruit"}),
        lambda c: c.distinct("n", {"kind": "fruit"}),
        lambda c: (other if c is cached else raw.database.other).count_documents({"kind": "fruit"}),
    ]
    raw.database.other.insert_one({"kind": "fruit"})
    other = manager[raw.database.name]["other"]
    hits = manager.snapshot().hits
    for read in reads:
        assert read(cached) == read(raw)
    assert manager.snapshot().hits == hits  # every one was a miss


def test_a_write_to_any_document_invalidates_non_identity_entries_only(
    manager, items, other_client, db_name
):
    cached, _ = items
    assert cached.count_documents({"kind": "fruit"}) == 2
    assert cached.find_one({"kind": "nut"})["name"] == "pecan"
    assert sorted(cached.distinct("kind")) == ["fruit", "nut", "veg"]
    assert cached.find_one({"_id": 3})["name"] == "leek"
    assert cached.count_documents({"_id": 3}) == 1  # identity filter: depends on _id 3 only

    events = stream_of(manager, db_name).events
    other_client[db_name].items.insert_one({"_id": 6, "kind": "fruit", "name": "fig", "n": 4})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the insert reaches the cache")

    hits = manager.snapshot().hits
    assert cached.find_one({"_id": 3})["name"] == "leek"
    assert cached.count_documents({"_id": 3}) == 1
    assert manager.snapshot().hits == hits + 2  # identity entries survive

    misses = manager.snapshot().misses
    assert cached.count_documents({"kind": "fruit"}) == 3
    assert cached.find_one({"kind": "nut"})["name"] == "pecan"
    assert sorted(cached.distinct("kind")) == ["fruit", "nut", "veg"]
    assert cached.estimated_document_count() == 6
    assert manager.snapshot().misses == misses + 4


def test_a_cached_not_found_is_invalidated_by_an_insert_that_matches(manager, items, other_client, db_name):
    cached, _ = items
    assert cached.find_one({"kind": "mineral"}) is None
    hits = manager.snapshot().hits
    assert cached.find_one({"kind": "mineral"}) is None
    assert manager.snapshot().hits == hits + 1

    other_client[db_name].items.insert_one({"_id": 7, "kind": "mineral", "name": "salt"})
    wait_until(
        lambda: (cached.find_one({"kind": "mineral"}) or {}).get("name") == "salt",
        what="the insert reaches the cache",
    )


def test_count_and_distinct_change_after_update_and_delete(manager, items, other_client, db_name):
    cached, raw = items
    assert sorted(cached.distinct("name", {"kind": "veg"})) == ["kale", "leek"]
    assert cached.count_documents({"n": {"$gt": 2}}) == 3

    # n > 2: apple 3, pear 5, kale 8; then pear 5, onion 9 (leek moved in,
    # kale and apple deleted), so both cached results must change.
    other_client[db_name].items.update_one({"_id": 3}, {"$set": {"n": 9, "name": "onion"}})
    other_client[db_name].items.delete_one({"_id": 4})
    other_client[db_name].items.delete_one({"_id": 1})

    wait_until(lambda: cached.distinct("name", {"kind": "veg"}) == ["onion"], what="the writes reach the cache")
    wait_until(lambda: cached.count_documents({"n": {"$gt": 2}}) == 2, what="the writes reach the cache")
    assert cached.count_documents({"n": {"$gt": 2}}) == raw.count_documents({"n": {"$gt": 2}}) == 2


def test_distinct_values_decode_with_the_readers_codec_options(manager, client, db_name):
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, 6000)
    u = uuid.UUID("12345678-1234-5678-1234-567812345678")
    values = [
        1, Int64(2), 2.5, "s", when, ObjectId("0123456789ab0123456789ab"), {"b": 1, "a": 2},
        [1, [2]], None, True, Binary(b"\x00\x01"), Binary(u.bytes, 4),
    ]  # fmt: skip
    client[db_name].mixed.insert_many([{"_id": i, "v": v} for i, v in enumerate(values)])
    for codec in (
        CodecOptions(),
        CodecOptions(tz_aware=True, uuid_representation=UuidRepresentation.STANDARD),
        CodecOptions(document_class=SON),
    ):
        cached = ready_collection(manager, db_name, "mixed", codec_options=codec)
        raw = client[db_name].get_collection("mixed", codec_options=codec)
        expected = raw.distinct("v")
        miss = cached.distinct("v")
        hit = cached.distinct("v")
        assert miss == expected and hit == expected
        assert [type(x) for x in hit] == [type(x) for x in expected]


def test_a_result_larger_than_max_entry_bytes_is_returned_and_not_cached(make_manager, client, db_name):
    # max_entry_bytes applies to every kind of entry: a distinct result
    # larger than it is returned and not cached, counted as oversize.
    manager = make_manager(max_entry_bytes=4096)
    client[db_name].big.insert_many([{"_id": i, "v": f"value-{i:06d}"} for i in range(500)])
    cached = ready_collection(manager, db_name, "big")
    expected = client[db_name].big.distinct("v")
    assert cached.distinct("v") == expected
    assert cached.distinct("v") == expected
    snap = manager.snapshot()
    assert snap.rejected_admissions.get("oversize", 0) == 2
    assert snap.hits == 0
    assert cached.count_documents({}) == 500
    assert cached.count_documents({}) == 500
    assert manager.snapshot().hits == 1


# -- find and aggregate ----------------------------------------------------------

CURSOR_READS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("find", (), {}),
    ("find", ({"kind": "fruit"},), {"sort": [("n", -1)]}),
    ("find", ({"n": {"$gte": 2}}, {"name": 1}), {"sort": [("n", 1)], "skip": 1, "limit": 2}),
    ("find", ({"kind": "mineral"},), {}),
    ("find", ({"tags": "green"},), {"projection": {"_id": 0, "tags": {"$slice": 1}}}),
    ("aggregate", ([{"$match": {"n": {"$gt": 1}}}, {"$sort": {"n": 1}}, {"$project": {"name": 1}}],), {}),
    ("aggregate", ([{"$group": {"_id": "$kind", "total": {"$sum": "$n"}, "names": {"$push": "$name"}}}, {"$sort": {"_id": 1}}],), {}),
    ("aggregate", ([{"$unwind": "$tags"}, {"$sortByCount": "$tags"}, {"$sort": {"count": -1, "_id": 1}}],), {}),
    ("aggregate", ([{"$facet": {"n": [{"$count": "n"}], "top": [{"$sort": {"n": -1}}, {"$limit": 1}]}}],), {}),
]


@pytest.mark.parametrize(("method", "args", "kwargs"), CURSOR_READS, ids=lambda v: repr(v)[:40])
async def test_a_cursor_read_returns_what_pymongo_returns_and_hits_the_second_time(
    d, driven_items, method, args, kwargs
):
    manager, cached, raw = driven_items
    expected = await d.docs(getattr(raw, method)(*args, **kwargs))

    h0, m0, b0 = _snap(manager)
    first = await d.docs(getattr(cached, method)(*args, **kwargs))  # iterated (sync) or to_list(None)
    h1, m1, b1 = _snap(manager)
    cursor = await d.r(getattr(cached, method)(*args, **kwargs))  # async aggregate is a coroutine
    second = await d.r(cursor.to_list())
    h2, m2, b2 = _snap(manager)

    assert first == expected and second == expected
    assert (h1 - h0, m1 - m0, b1 - b0) == (0, 1, 0)
    assert (h2 - h1, m2 - m1, b2 - b1) == (1, 0, 0)


def test_a_limited_find_is_served_from_the_prefix_of_a_complete_result(manager, items):
    cached, raw = items
    everything = list(cached.find({}, sort=[("n", 1)]))  # miss: admitted without a limit
    hits = manager.snapshot().hits
    assert list(cached.find({}, sort=[("n", 1)], limit=2)) == everything[:2]
    assert list(cached.find({}, sort=[("n", 1)]).limit(3)) == everything[:3]
    assert manager.snapshot().hits == hits + 2

    # A limit larger than the number of matches returned them all: that
    # result is admitted without its limit, and serves every limit.
    assert list(cached.find({"kind": "veg"}, sort=[("n", 1)], limit=10)) == list(
        raw.find({"kind": "veg"}, sort=[("n", 1)])
    )
    snap = manager.snapshot()
    assert len(list(cached.find({"kind": "veg"}, sort=[("n", 1)]))) == 2
    assert len(list(cached.find({"kind": "veg"}, sort=[("n", 1)], limit=1))) == 1
    after = manager.snapshot()
    assert (after.hits - snap.hits, after.misses - snap.misses) == (2, 0)

    # A limit that cut the result is keyed with that limit only.
    assert len(list(cached.find({"kind": "fruit"}, limit=1))) == 1
    snap = manager.snapshot()
    assert len(list(cached.find({"kind": "fruit"}))) == 2
    assert manager.snapshot().misses == snap.misses + 1


def test_a_cursor_not_read_to_the_end_admits_nothing(manager, items):
    cached, raw = items
    expected = list(raw.find({}, sort=[("_id", 1)]))
    before = manager.snapshot()
    cursor = cached.find({}, sort=[("_id", 1)], batch_size=2)
    assert next(cursor) == expected[0]
    cursor.close()
    with cached.find({}, sort=[("_id", 1)]) as early:
        assert early.to_list(2) == expected[:2]
    del early
    after = manager.snapshot()
    assert (after.misses - before.misses, after.admissions - before.admissions) == (2, 0)

    # Read to its end (batch_size does not change the key), it is admitted.
    assert list(cached.find({}, sort=[("_id", 1)], batch_size=2)) == expected
    assert manager.snapshot().admissions == after.admissions + 1
    assert cached.find({}, sort=[("_id", 1)]).to_list() == expected
    assert manager.snapshot().hits == after.hits + 1


def test_a_write_invalidates_cached_find_and_aggregate_results(manager, items, other_client, db_name):
    cached, raw = items
    pipeline = [{"$group": {"_id": None, "total": {"$sum": "$n"}}}]
    assert list(cached.aggregate(pipeline)) == [{"_id": None, "total": 19}]
    assert [d["_id"] for d in cached.find({"kind": "veg"})] == [3, 4]
    events = stream_of(manager, db_name).events
    other_client[db_name].items.update_one({"_id": 4}, {"$set": {"kind": "fruit", "n": 10}})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the update reaches the cache")
    assert list(cached.aggregate(pipeline)) == [{"_id": None, "total": 21}]
    assert [d["_id"] for d in cached.find({"kind": "veg"})] == [3]
    assert list(cached.aggregate(pipeline)) == list(raw.aggregate(pipeline))


def test_a_cursor_option_the_cache_does_not_model_hands_the_read_to_pymongo(manager, items):
    cached, raw = items
    before = manager.snapshot()
    got = list(cached.find({"kind": "fruit"}).hint([("_id", 1)]))
    assert got == list(raw.find({"kind": "fruit"}).hint([("_id", 1)]))
    after = manager.snapshot()
    assert dict(after.bypasses) == {**before.bypasses, "unsupported_option": before.bypasses.get("unsupported_option", 0) + 1}
    started = cached.find({})
    next(started)
    with pytest.raises(pymongo.errors.InvalidOperation):
        started.limit(1)


def test_a_find_result_larger_than_max_entry_bytes_is_returned_and_not_cached(make_manager, client, db_name):
    manager = make_manager(max_entry_bytes=4096)
    client[db_name].big.insert_many([{"_id": i, "pad": "x" * 100} for i in range(100)])
    cached = ready_collection(manager, db_name, "big")
    expected = list(client[db_name].big.find({}, sort=[("_id", 1)]))
    assert list(cached.find({}, sort=[("_id", 1)])) == expected
    assert list(cached.find({}, sort=[("_id", 1)])) == expected
    snap = manager.snapshot()
    assert snap.rejected_admissions.get("oversize", 0) == 2 and snap.hits == 0


async def test_an_async_find_hit_never_suspends(async_manager, client, db_name):
    # A hit's documents come without a suspension: the coroutine finishes
    # on its first step. (That find and aggregate are cached through the
    # async facade is tested with both APIs above.)
    client[db_name].items.insert_many(DOCS)
    cached = await async_ready_collection(async_manager, db_name, "items")

    async def read_all() -> list[Any]:
        return [d async for d in cached.find({"kind": "fruit"}, sort=[("n", -1)])]

    expected = await read_all()  # miss, admitted
    assert expected == list(client[db_name].items.find({"kind": "fruit"}, sort=[("n", -1)]))
    hits = async_manager.snapshot().hits
    coro = read_all()
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    assert done.value.value == expected
    assert async_manager.snapshot().hits == hits + 1
    await asyncio.sleep(0)


# -- namespace events ---------------------------------------------------------------

NS_READS: list[Callable[[Any], Any]] = [
    lambda c: c.count_documents({"k": 1}),
    lambda c: sorted(c.distinct("v")),
    lambda c: c.find({}, sort=[("_id", 1)]).to_list(),
    lambda c: list(c.aggregate([{"$group": {"_id": None, "n": {"$sum": 1}}}])),
    lambda c: c.find_one({"k": 1}, sort=[("_id", -1)]),
    lambda c: c.estimated_document_count(),
]


def _state(coll: Any) -> list[Any]:
    return [outcome(lambda: read(coll)) for read in NS_READS]


@pytest.mark.parametrize("event", ["drop", "rename", "drop_database"])
def test_namespace_events_invalidate_every_kind_of_entry(manager, client, other_client, db_name, event):
    raw = client[db_name]
    raw.src.insert_many([{"_id": i, "k": 1, "v": f"s{i}"} for i in range(3)])
    raw.dst.insert_many([{"_id": i, "k": 1, "v": f"d{i}"} for i in range(2)])
    src, dst = ready_collection(manager, db_name, "src"), ready_collection(manager, db_name, "dst")
    for coll in (src, dst):
        assert _state(coll) == _state(raw[coll.name])  # misses, admitted
    settled(manager, db_name)  # each later miss may have seen newer documents than the ones before
    hits = manager.snapshot().hits
    assert _state(src) != _state(dst)
    assert manager.snapshot().hits == hits + 2 * len(NS_READS)  # all cached

    writer = other_client[db_name]
    if event == "drop":
        writer.drop_collection("src")
    elif event == "rename":
        writer.src.rename("dst", dropTarget=True)  # both the source and the target change
    else:
        other_client.drop_database(db_name)

    wait_until(
        lambda: _state(src) == _state(raw.src) and _state(dst) == _state(raw.dst),
        what=f"the {event} reaches every entry",
    )


# -- find_one by the fields of a unique index ----------------------------------------


@pytest.fixture
def users(manager, client, db_name):
    raw = client[db_name].users
    raw.create_index("email", unique=True)
    raw.create_index([("org", 1), ("login", 1)], unique=True)
    raw.create_index("team")  # not unique
    raw.insert_many(
        [
            {"_id": 1, "email": "a@x", "org": "o1", "login": "ann", "team": "red", "n": 0},
            {"_id": 2, "email": "b@x", "org": "o1", "login": "bob", "team": "red", "n": 0},
        ]
    )
    return ready_collection(manager, db_name, "users"), raw


def _apply(manager: CacheManager, db_name: str, write: Callable[[], Any]) -> None:
    events = stream_of(manager, db_name).events
    write()
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the write reaches the cache")


def test_a_find_one_by_a_unique_key_survives_writes_to_other_documents(manager, users, other_client, db_name):
    cached, raw = users
    by_email = {"email": "a@x"}
    by_login = {"login": "ann", "org": "o1"}  # the compound index, fields in another order
    by_team = {"team": "red"}  # not unique: any write to the collection invalidates it
    for f in (by_email, by_login, by_team):
        assert cached.find_one(f) == raw.find_one(f)

    _apply(manager, db_name, lambda: other_client[db_name].users.update_one({"_id": 2}, {"$inc": {"n": 1}}))
    _apply(manager, db_name, lambda: other_client[db_name].users.insert_one({"_id": 3, "email": "c@x", "org": "o2", "login": "cy"}))

    before = manager.snapshot()
    assert cached.find_one(by_email)["_id"] == 1
    assert cached.find_one(by_login)["_id"] == 1
    assert cached.find_one(by_team) == raw.find_one(by_team)
    after = manager.snapshot()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)

    # A write to the document itself invalidates its unique-key entries.
    _apply(manager, db_name, lambda: other_client[db_name].users.update_one({"_id": 1}, {"$set": {"n": 5}}))
    assert cached.find_one(by_email)["n"] == 5
    assert cached.find_one(by_login)["n"] == 5
    assert manager.snapshot().misses == after.misses + 2


def test_a_unique_key_that_matched_nothing_is_invalidated_by_any_insert(manager, users, other_client, db_name):
    cached, _ = users
    assert cached.find_one({"email": "z@x"}) is None
    assert cached.find_one({"email": "z@x"}) is None  # cached "not found"
    _apply(manager, db_name, lambda: other_client[db_name].users.insert_one({"_id": 9, "email": "z@x", "org": "o9", "login": "z"}))
    assert cached.find_one({"email": "z@x"})["_id"] == 9


def test_a_unique_key_read_whose_projection_drops_the_id_is_not_an_alias(manager, users, other_client, db_name):
    cached, _ = users
    assert cached.find_one({"email": "a@x"}, {"_id": 0, "login": 1}) == {"login": "ann"}
    _apply(manager, db_name, lambda: other_client[db_name].users.update_one({"_id": 2}, {"$inc": {"n": 1}}))
    misses = manager.snapshot().misses
    assert cached.find_one({"email": "a@x"}, {"_id": 0, "login": 1}) == {"login": "ann"}
    assert manager.snapshot().misses == misses + 1


def test_only_unique_indexes_that_find_one_document_by_equality_qualify():
    from bson.int64 import Int64

    from client_query_cache._core.engine import unique_field_sets

    specs = [
        {"key": {"_id": 1}, "name": "_id_"},
        {"key": {"email": 1}, "unique": True},
        {"key": {"a": -1, "b": Int64(1)}, "unique": True},
        {"key": {"p": 1}, "unique": True, "partialFilterExpression": {"p": {"$exists": True}}},
        {"key": {"s": 1}, "unique": True, "sparse": True},
        {"key": {"h": "hashed"}, "unique": True},
        {"key": {"c": 1}, "unique": True, "collation": {"locale": "fr"}},
        {"key": {"d": 1}, "unique": True, "collation": {"locale": "simple"}},
        {"key": {"t": 1}},
    ]
    assert unique_field_sets(specs) == {frozenset({"email"}), frozenset({"a", "b"}), frozenset({"d"})}


# -- collations ---------------------------------------------------------------------
#
# The disposable server accepts collations but compares strings bytewise
# whatever they say, so these tests compare with PyMongo's answers and check
# the validation by its mechanism: under a collation even {"_id": v} is
# validated by the namespace's write generation (a write to any document
# reaches it), because the collation may match documents whose _id differs
# from v.

CI = {"locale": "en", "strength": 2}  # case-insensitive


def test_an_explicit_collation_is_keyed_and_never_validated_by_an_identity(manager, client, other_client, db_name):
    client[db_name].items.insert_many([{"_id": "a", "v": 1}, {"_id": "B", "v": 2}, {"_id": "c", "v": 3}])
    cached = ready_collection(manager, db_name, "items")
    raw = client[db_name].items
    reads: list[Callable[[Any], Any]] = [
        lambda c: c.find_one({"_id": "a"}, collation=CI),
        lambda c: c.count_documents({"_id": {"$gte": "b"}}, collation=CI),
        lambda c: sorted(c.distinct("v", {"_id": {"$in": ["A", "b"]}}, collation=CI)),
        lambda c: c.find({"_id": {"$lt": "C"}}, sort=[("_id", 1)], collation=CI).to_list(),
        lambda c: list(c.aggregate([{"$match": {"_id": "C"}}], collation=CI)),
    ]
    expected = [read(raw) for read in reads]
    assert [read(cached) for read in reads] == expected
    assert cached.find_one({"_id": "a"}) == raw.find_one({"_id": "a"})  # its own key: a miss
    settled(manager, db_name)
    snap = manager.snapshot()
    assert [read(cached) for read in reads] == expected
    assert cached.find_one({"_id": "a"}) == raw.find_one({"_id": "a"})
    after = manager.snapshot()
    assert (after.hits - snap.hits, after.misses - snap.misses) == (len(reads) + 1, 0)

    # A write to another document: the identity entry of "a" survives, the
    # collated {"_id": "a"} does not.
    events = stream_of(manager, db_name).events
    other_client[db_name].items.update_one({"_id": "c"}, {"$set": {"v": 30}})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the update reaches the cache")
    hits, misses = manager.snapshot().hits, manager.snapshot().misses
    assert cached.find_one({"_id": "a"}) == raw.find_one({"_id": "a"})
    assert cached.find_one({"_id": "a"}, collation=CI) == raw.find_one({"_id": "a"}, collation=CI)
    final = manager.snapshot()
    assert (final.hits - hits, final.misses - misses) == (1, 1)
    assert [read(cached) for read in reads] == [read(raw) for read in reads]


def test_a_collection_with_a_default_collation_is_cached_under_it(manager, client, other_client, db_name):
    raw = client[db_name].create_collection("ci", collation=CI)
    raw.insert_many([{"_id": "A", "v": 1}, {"_id": "b", "v": 2}])
    cached = ready_collection(manager, db_name, "ci")
    for attempt in range(2):
        assert cached.find_one({"_id": "A"}) == raw.find_one({"_id": "A"})
        assert cached.count_documents({"_id": "b"}) == raw.count_documents({"_id": "b"})
        if not attempt:
            settled(manager, db_name)
    snap = manager.snapshot()
    assert (snap.hits, snap.misses, dict(snap.bypasses)) == (2, 2, {})  # one lookup counted per read

    # Read under the collection's collation, {"_id": "A"} is validated by the
    # namespace: a write to "b" reaches it.
    events = stream_of(manager, db_name).events
    other_client[db_name].ci.update_one({"_id": "b"}, {"$set": {"v": 20}})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the update reaches the cache")
    assert cached.find_one({"_id": "A"}) == raw.find_one({"_id": "A"})
    assert manager.snapshot().misses == snap.misses + 1


def test_indexes_that_cannot_be_listed_only_disable_unique_key_aliases(manager, client, db_name, monkeypatch):
    # e.g. a user without the listIndexes privilege: the read is still
    # served and cached, as a plain namespace-validated entry.
    from pymongo.collection import Collection

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise pymongo.errors.OperationFailure("not authorized", code=13)

    monkeypatch.setattr(Collection, "list_indexes", refuse)
    raw = client[db_name].users
    raw.insert_one({"_id": 1, "email": "a@x"})
    cached = ready_collection(manager, db_name, "users")
    assert cached.find_one({"email": "a@x"}) == {"_id": 1, "email": "a@x"}
    assert cached.find_one({"email": "a@x"}) == {"_id": 1, "email": "a@x"}
    snap = manager.snapshot()
    assert (snap.hits, snap.misses, dict(snap.bypasses)) == (1, 1, {})
