"""A cached view acts as the PyMongo collection it wraps, errors included,
whether a read is a miss (cold), a hit (warm) or bypassed: cursors with
PyMongo's cursor surface, arguments checked as PyMongo checks them before
the lookup, sub-collections that are cached views, and equal reads that
share one entry.

Each test runs with both APIs (the ``d`` fixture) and compares with the same
call on a plain PyMongo collection of the driver's client.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable
from typing import Any

import bson
import pytest
from bson.codec_options import CodecOptions, TypeDecoder, TypeRegistry
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.errors import InvalidBSON
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from pymongo.errors import InvalidOperation
from pymongo.read_preferences import ReadPreference

from bson_strict import strict_difference
from support import async_outcome, outcome, ready_collection, served

DOCS = [{"_id": i, "a": i % 3, "s": f"s{i:02d}"} for i in range(12)]
MODES = ["cold", "warm", "bypassed"]


class Items:
    """The seeded collection for one test: its manager, the cached view, a
    view whose reads bypass (a read preference other than primary), and the
    plain PyMongo collection of the same client."""

    def __init__(self, d: Any, cache: Any, view: Any, raw: Any) -> None:
        self.d = d
        self.cache = cache
        self.view = view
        self.bypassed = view.with_options(read_preference=ReadPreference.SECONDARY_PREFERRED)
        self.raw = raw

    def counts(self) -> tuple[int, int, int]:
        snap = self.cache.snapshot()
        return snap.hits, snap.misses, snap.bypass_total

    async def view_for(self, mode: str, read: Callable[[Any], Any]) -> Any:
        """The view to read from in ``mode``: for ``warm``, once ``read(view)``
        (a call of the view that returns documents) is served from the
        cache; for ``cold`` nothing has been read yet."""
        if mode == "warm":
            await self.d.served(self.cache, lambda: self.d.r(read(self.view)))
        return self.bypassed if mode == "bypassed" else self.view

    def check_mode(self, mode: str, before: tuple[int, int, int], what: Any = None) -> None:
        """The reads since ``before`` (from ``counts()``) were served in ``mode``."""
        hits, misses, bypasses = (now - then for now, then in zip(self.counts(), before))
        assert {"cold": misses, "warm": hits, "bypassed": bypasses}[mode] >= 1, (mode, hits, misses, bypasses, what)


@pytest.fixture
async def items(d, client, db_name) -> Items:
    client[db_name]["items"].insert_many(DOCS)
    mongo = d.client()
    cache = d.manager(mongo)
    return Items(d, cache, await d.ready(cache, db_name), mongo[db_name]["items"])


async def all_docs(d: Any, cursor: Any) -> list[Any]:
    """The rest of a cursor's documents, with either API."""
    return await d.r(cursor.to_list(None))


def find_docs(d: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """``find({}, sort=_id, **kwargs)`` read to the end, as a read for view_for."""
    return lambda coll: all_docs(d, coll.find({}, sort=[("_id", 1)], **kwargs))


def aggregate_docs(d: Any) -> Callable[[Any], Any]:
    async def read(coll: Any) -> list[Any]:
        return await all_docs(d, await d.r(coll.aggregate(PIPELINE)))

    return read


PIPELINE = [{"$match": {"a": {"$gte": 0}}}, {"$sort": {"_id": 1}}]


# == cursors =========================================================================


@pytest.mark.parametrize("mode", MODES)
async def test_rewind_after_iteration_returns_the_cursor_and_serves_again(d, items, mode):
    view = await items.view_for(mode, find_docs(d))
    expected = await all_docs(d, items.raw.find({}, sort=[("_id", 1)]))
    before = items.counts()
    cursor = view.find({}, sort=[("_id", 1)])
    assert await all_docs(d, cursor) == expected
    items.check_mode(mode, before)
    assert await d.r(cursor.rewind()) is cursor
    assert await all_docs(d, cursor) == expected
    # Options may be set again once rewound, as PyMongo allows.
    assert await d.r(cursor.rewind()) is cursor
    assert await all_docs(d, cursor.limit(2)) == expected[:2]


@pytest.mark.parametrize("mode", MODES)
async def test_clone_and_copies_are_new_unevaluated_cursors_with_the_same_options(d, items, mode):
    view = await items.view_for(mode, find_docs(d, skip=2))
    expected = await all_docs(d, items.raw.find({}, sort=[("_id", 1)], skip=2))
    cursor = view.find({}, sort=[("_id", 1)]).skip(2)
    before = items.counts()
    assert await all_docs(d, cursor) == expected
    items.check_mode(mode, before)
    for other in (cursor.clone(), copy.copy(cursor), copy.deepcopy(cursor)):
        assert other is not cursor and type(other) is type(cursor)
        assert await all_docs(d, other) == expected
    assert await all_docs(d, cursor) == []  # the original stays exhausted


@pytest.mark.parametrize("mode", MODES)
async def test_cursor_properties_are_pymongos(d, items, mode):
    view = await items.view_for(mode, find_docs(d))
    cursor, raw = view.find({}, sort=[("_id", 1)]), items.raw.find({}, sort=[("_id", 1)])
    for c in (cursor, raw):
        assert (c.cursor_id, c.address, c.alive, c.session, c.retrieved) == (None, None, True, None, 0)
    before = items.counts()
    await all_docs(d, cursor)
    await all_docs(d, raw)
    items.check_mode(mode, before)
    assert (cursor.cursor_id, cursor.alive, cursor.session, cursor.retrieved) == (0, False, None, len(DOCS))
    assert (raw.cursor_id, raw.alive, raw.session, raw.retrieved) == (0, False, None, len(DOCS))
    # A hit reads no server (docs/api.md): its address is None.
    assert cursor.address == (None if mode == "warm" else raw.address)
    # Only what PyMongo's class has: a find cursor has no try_next, and
    # asking does not hand the read to PyMongo.
    fresh = view.find({})
    bypasses = items.cache.snapshot().bypass_total
    assert not hasattr(fresh, "try_next") and not hasattr(items.raw.find({}), "try_next")
    assert items.cache.snapshot().bypass_total == bypasses


@pytest.mark.parametrize("mode", MODES)
async def test_indexing_and_slicing_a_find_cursor_act_as_pymongos(d, items, mode):
    view = await items.view_for(mode, find_docs(d, skip=4, limit=1))  # what cursor[4] reads
    if not d.is_async:  # PyMongo's async cursor refuses every index
        before = items.counts()
        assert view.find({}, sort=[("_id", 1)])[4] == DOCS[4]
        items.check_mode(mode, before)

    async def both(op: Callable[[Any], Any]) -> None:
        def run(coll: Any) -> Any:
            return op(coll.find({}, sort=[("_id", 1)]))

        mine, theirs = await async_outcome(lambda: run(view)), await async_outcome(lambda: run(items.raw))
        if mine[0] == "returned" and hasattr(mine[1], "to_list"):
            mine, theirs = ("returned", await all_docs(d, mine[1])), ("returned", await all_docs(d, theirs[1]))
        assert mine == theirs

    for index in (3, 0, 11, 12, 100, -1, "x", slice(2, 5), slice(5, 5), slice(5, 2), slice(None, 3), slice(8, None),
                  slice(0, 4, 2), slice(-1, 2)):  # fmt: skip
        await both(lambda c, index=index: c[index])
    await both(lambda c: c.skip(3)[1])
    await both(lambda c: c.limit(2)[5])
    await both(lambda c: c.skip(3).limit(1)[1:4])
    if not d.is_async:

        def started(coll: Any) -> Any:
            cursor = coll.find({})
            next(cursor)
            return cursor

        for index in (1, slice(1, 2)):
            with pytest.raises(InvalidOperation):
                started(view)[index]
            with pytest.raises(InvalidOperation):
                started(items.raw)[index]


@pytest.mark.parametrize("mode", MODES)
async def test_an_aggregate_cursor_acts_as_pymongos_command_cursor(d, items, mode):
    view = await items.view_for(mode, aggregate_docs(d))
    expected = DOCS
    before = items.counts()
    cursor = await d.r(view.aggregate(PIPELINE))
    items.check_mode(mode, before)
    raw = await d.r(items.raw.aggregate(PIPELINE))
    # batch_size on a started command cursor returns the cursor; bad sizes
    # raise what PyMongo raises.
    assert cursor.batch_size(5) is cursor and raw.batch_size(5) is raw
    for bad in (-1, "x", None):
        assert outcome(lambda bad=bad: cursor.batch_size(bad)) == outcome(lambda bad=bad: raw.batch_size(bad))
    # try_next: each document, then None at the end, like PyMongo.
    got = [await d.r(cursor.try_next()) for _ in range(len(expected) + 2)]
    assert got == expected + [None, None]
    assert [await d.r(raw.try_next()) for _ in range(len(expected) + 2)] == got
    assert (cursor.cursor_id, cursor.alive, cursor.session) == (0, False, None)
    assert (raw.cursor_id, raw.alive, raw.session) == (0, False, None)
    # A command cursor has none of the find cursor's members.
    for name in ("rewind", "clone", "retrieved"):
        assert hasattr(cursor, name) is hasattr(raw, name) is False
    assert outcome(lambda: cursor[0]) == outcome(lambda: raw[0]) == ("raised", TypeError, None)


@pytest.mark.parametrize("mode", MODES)
async def test_an_empty_slice_reads_nothing(d, items, mode):
    if d.is_async:
        pytest.skip("PyMongo's async cursor has no slicing")
    view = await items.view_for(mode, find_docs(d))
    before = items.counts()
    assert list(view.find({})[5:5]) == list(items.raw.find({})[5:5]) == []
    assert items.counts() == before  # nothing looked up, nothing read
    # A new limit ends the empty slice; its skip stays.
    cursor = view.find({}, sort=[("_id", 1)])[5:5].limit(2)
    assert list(cursor) == list(items.raw.find({}, sort=[("_id", 1)])[5:5].limit(2)) == DOCS[5:7]


# == arguments are checked before the lookup ============================================

#: (bad call, the same call without what is bad): method, args, kwargs, and
#: the good call's kwargs. The bad call must raise what PyMongo raises, cold,
#: once the good one is cached (the same key), and bypassed.
BAD_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any]]] = [
    ("find", ({},), {"batch_size": -1}, {}),
    ("find", ({},), {"batch_size": "x"}, {}),
    ("find", ({},), {"skip": None}, {}),
    ("find", ({},), {"limit": None}, {}),
    ("find", ({},), {"no_cursor_timeout": 0}, {}),
    ("find", ({},), {"max_time_ms": "x"}, {}),
    ("find", ({},), {"max_time_ms": -1}, {}),
    ("find", ({},), {"comment": {1, 2}}, {}),
    ("find_one", ({"a": 1},), {"batch_size": -1}, {}),
    ("find_one", ({"a": 1},), {"limit": "x"}, {}),
    ("find_one", ({"a": 1},), {"max_time_ms": 2**31}, {}),
    ("aggregate", (PIPELINE,), {"batchSize": -1}, {}),
    ("aggregate", (PIPELINE,), {"hint": None}, {}),
    ("aggregate", (PIPELINE,), {"allowDiskUse": None}, {}),
    ("aggregate", (PIPELINE,), {"maxTimeMS": "x"}, {}),
    ("aggregate", (PIPELINE,), {"comment": {1, 2}}, {}),
    ("count_documents", ({},), {"hint": None}, {}),
    ("count_documents", ({},), {"maxTimeMS": -1}, {}),
    ("count_documents", ({},), {"collation": RawBSONDocument(bson.encode({"locale": "en"}))}, {"collation": {"locale": "en"}}),
    ("distinct", ("a",), {"collation": RawBSONDocument(bson.encode({"locale": "en"}))}, {"collation": {"locale": "en"}}),
    ("estimated_document_count", (), {"session": None}, {}),
    ("estimated_document_count", (), {"hint": None}, {}),
]


async def call(d: Any, coll: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``coll.method(*args, **kwargs)`` with either API; a cursor read to the end."""
    result = await d.r(getattr(coll, method)(*args, **kwargs))
    return await all_docs(d, result) if method in ("find", "aggregate") else result


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "good"), BAD_CALLS, ids=[f"{m}-{sorted(k)[0]}={k[sorted(k)[0]]!r}"[:48] for m, _, k, _ in BAD_CALLS]
)
async def test_a_bad_argument_raises_what_pymongo_raises_cold_warm_and_bypassed(d, items, method, args, kwargs, good):
    expected = await async_outcome(lambda: call(d, items.raw, method, args, kwargs))
    assert expected[0] == "raised", expected
    assert await async_outcome(lambda: call(d, items.view, method, args, kwargs)) == expected  # cold
    await items.d.served(items.cache, lambda: call(d, items.view, method, args, good))
    assert await async_outcome(lambda: call(d, items.view, method, args, kwargs)) == expected  # warm
    assert await async_outcome(lambda: call(d, items.bypassed, method, args, kwargs)) == expected


async def test_good_arguments_of_odd_shapes_are_still_served_from_the_cache(d, items):
    # What PyMongo accepts, the cache serves: a bool is an int to PyMongo,
    # a Collation object is a collation, None is no max_time_ms.
    from pymongo.collation import Collation

    for method, args, kwargs in [
        ("find", ({},), {"skip": False, "batch_size": 0, "max_time_ms": None}),
        ("find", ({},), {"collation": Collation("en"), "comment": "c"}),
        ("find_one", ({"a": 1},), {"no_cursor_timeout": False, "hint": None, "max_time_ms": 1000}),
        ("aggregate", (PIPELINE,), {"batchSize": 0, "allowDiskUse": True, "maxTimeMS": 0}),
        ("count_documents", ({},), {"collation": Collation("en"), "maxTimeMS": 2**31 - 1}),
        ("distinct", ("a",), {"hint": None}),
    ]:
        expected = await call(d, items.raw, method, args, kwargs)
        assert await items.d.served(items.cache, lambda: call(d, items.view, method, args, kwargs)) == expected


#: find_one's arguments in the forms PyMongo takes (and two it refuses): the
#: filter positional, by keyword, as a bare _id value or omitted, with a
#: projection either way, and keywords whatever their names.
FIND_ONE_FORMS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    (({"_id": 3},), {}),
    ((3,), {}),
    ((), {"filter": {"_id": 3}}),
    (({"_id": 3}, {"s": 1}), {}),
    (({"_id": 3},), {"projection": {"a": 0}}),
    (({"_id": 3},), {"step": 1}),
    (({"_id": 3},), {"filter": {"_id": 4}}),
    ((None,), {}),
]


@pytest.mark.parametrize(("args", "kwargs"), FIND_ONE_FORMS, ids=[f"{a!r}-{sorted(k)}" for a, k in FIND_ONE_FORMS])
async def test_find_one_takes_its_arguments_as_pymongo_does_cold_and_warm(d, items, args, kwargs):
    expected = await async_outcome(lambda: items.raw.find_one(*args, **kwargs))
    assert await async_outcome(lambda: items.view.find_one(*args, **kwargs)) == expected  # cold
    assert await async_outcome(lambda: items.view.find_one(*args, **kwargs)) == expected  # warm, if cacheable


async def test_find_one_has_pymongos_signature(d, items):
    def shape(method: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]

    assert shape(items.view.find_one) == shape(items.raw.find_one)
    assert inspect.iscoroutinefunction(items.view.find_one) == inspect.iscoroutinefunction(items.raw.find_one)


def test_a_sync_hit_by_id_runs_no_python_function(manager, client, db_name):
    # The sync facade answers find_one({"_id": int|str|ObjectId}) hits in
    # C: a profiler sees no Python call between the call and its return.
    ids = [3, "s", bson.ObjectId()]
    client[db_name]["items"].insert_many([{"_id": _id, "n": 1} for _id in ids])
    view = ready_collection(manager, db_name, "items")
    for _id in ids:
        served(manager, lambda _id=_id: view.find_one({"_id": _id}))
        events: list[tuple[str, str]] = []
        hits = manager.snapshot().hits
        sys.setprofile(lambda frame, event, arg: events.append((event, frame.f_code.co_name)))
        try:
            doc = view.find_one({"_id": _id})
        finally:
            sys.setprofile(None)
        assert doc == {"_id": _id, "n": 1}
        assert manager.snapshot().hits == hits + 1
        assert [name for event, name in events if event == "call"] == []


def test_the_fast_path_checks_the_namespace_index_it_is_given(manager, client, db_name):
    # CoreBase keeps the indexes in 64 bits: one past 32 bits meets the
    # lookup's range check, never another namespace's entries.
    client[db_name]["items"].insert_one({"_id": 1, "n": 1})
    view = ready_collection(manager, db_name, "items")
    served(manager, lambda: view.find_one({"_id": 1}))
    view._core.ns_idx += 1 << 32
    with pytest.raises(ValueError, match="out of range"):
        view.find_one({"_id": 1})
    with pytest.raises(OverflowError):
        view._core.db_idx = -1


# == sub-collections ===================================================================


async def test_sub_collections_by_attribute_and_by_item_are_cached_views(d, items, client, db_name):
    client[db_name]["items.chunks"].insert_many([{"_id": i, "n": i} for i in range(3)])
    for sub in (items.view.chunks, items.view["chunks"]):
        assert type(sub) is d.Collection
        assert sub.full_name == f"{db_name}.items.chunks"
        assert await items.d.served(items.cache, lambda sub=sub: sub.count_documents({})) == 3
    assert type(items.view["chunks"]["x"]) is d.Collection
    with pytest.raises(AttributeError):
        items.view._chunks  # PyMongo's rule: private names are not collections


# == equal reads share one entry ========================================================


async def test_an_omitted_skip_or_limit_and_zero_share_one_entry(d, items):
    reads = [
        ("count_documents", ({"a": 1},), {}, {"skip": 0}),
        ("find", ({"a": 1},), {}, {"skip": 0, "limit": 0}),
        ("find_one", ({"a": 1},), {}, {"skip": 0, "limit": 0}),
    ]
    for method, args, plain, zeros in reads:
        await items.d.served(items.cache, lambda: call(d, items.view, method, args, plain))
        hits = items.cache.snapshot().hits
        entries = items.cache.snapshot().entries
        assert await call(d, items.view, method, args, zeros) == await call(d, items.raw, method, args, zeros)
        assert items.cache.snapshot().hits == hits + 1, (method, zeros)
        assert items.cache.snapshot().entries == entries


# == documents as PyMongo's cursors decode them ==========================================

#: Stored documents whose type depends on how a read decodes them. PyMongo's
#: cursors decode each document of a reply as an element of its batch array,
#: where "$ref" and "$id" make a DBRef (its "$ref" a str, its "$db" absent or
#: a str); a top-level decoder (bson.decode) leaves them documents.
REF_DOCS = [
    {"_id": 100, "$ref": "items", "$id": 1},
    {"_id": 101, "$ref": "items", "$id": 2, "$db": "other", "x": [1]},
    {"_id": 102, "$ref": 5, "$id": 1},
    {"_id": 103, "$ref": "items", "$id": 1, "$db": 7},
]


def document_reads(d: Any, i: int | None) -> list[tuple[str, Callable[[Any], Any]]]:
    """find_one, find and aggregate of the document ``{"_id": i}`` as reads
    for view_for; for ``i`` None, a find of REF_DOCS and DECIMAL_DOCS."""
    if i is None:
        return [("find of all", lambda coll: all_docs(d, coll.find({"_id": {"$gte": 100}}, sort=[("_id", 1)])))]

    async def aggregate(coll: Any) -> list[Any]:
        return await all_docs(d, await d.r(coll.aggregate([{"$match": {"_id": i}}])))

    return [
        ("find_one", lambda coll: d.r(coll.find_one({"_id": i}))),
        ("find_one by filter", lambda coll: d.r(coll.find_one({"_id": i, "$comment": "by filter"}))),
        ("find", lambda coll: all_docs(d, coll.find({"_id": i}))),
        ("aggregate", aggregate),
    ]


DECIMAL_DOCS = [{"_id": 200, "d": Decimal128("1.5")}, {"_id": 201, "n": {"d": Decimal128("2")}}]


@pytest.fixture
async def odd_items(d, client, db_name) -> Items:
    """Items seeded with REF_DOCS and DECIMAL_DOCS too, before the manager."""
    client[db_name]["items"].insert_many(DOCS + REF_DOCS + DECIMAL_DOCS)
    mongo = d.client()
    cache = d.manager(mongo)
    return Items(d, cache, await d.ready(cache, db_name), mongo[db_name]["items"])


@pytest.mark.parametrize("document_class", [dict, SON], ids=["dict", "SON"])
@pytest.mark.parametrize("mode", MODES)
async def test_a_document_with_ref_and_id_is_what_pymongo_returns(d, odd_items, mode, document_class):
    # The type of a result must not depend on whether the cache served it:
    # a DBRef where PyMongo returns one, a document where it returns one.
    items = odd_items
    codec = CodecOptions(document_class=document_class)
    items.view = items.view.with_options(codec_options=codec)
    items.bypassed = items.bypassed.with_options(codec_options=codec)
    raw = items.raw.with_options(codec_options=codec)
    for i in [doc["_id"] for doc in REF_DOCS] + [None]:
        for what, read in document_reads(d, i):
            view = await items.view_for(mode, read)
            before = items.counts()
            got = await read(view)
            items.check_mode(mode, before, (what, i))
            want = await read(raw)
            assert type(got) is type(want) and repr(got) == repr(want), (what, i, got, want)
            if document_class is dict:
                assert strict_difference(got, want) is None, (what, i, got, want)
    dbref = await d.r(items.view.find_one({"_id": 100}))
    assert type(dbref) is DBRef and dbref == DBRef("items", 1, _id=100)


class _RefusesDecimals(TypeDecoder):
    """A TypeRegistry decoder that raises on every Decimal128."""

    bson_type = Decimal128

    def transform_bson(self, value: Any) -> Any:
        raise ValueError(f"refused: {value}")


@pytest.mark.parametrize("mode", MODES)
async def test_a_type_decoder_s_error_is_raised_as_pymongo_raises_it(d, odd_items, mode):
    # On a top-level field as on a nested one, PyMongo's cursors raise
    # InvalidBSON with the decoder's message (the document is an element of
    # the reply's batch); so do the cache's miss and hit.
    items = odd_items
    codec = CodecOptions(type_registry=TypeRegistry([_RefusesDecimals()]))
    raw = items.raw.with_options(codec_options=codec)
    refusing = items.view.with_options(codec_options=codec)
    for i in (200, 201):
        for what, read in document_reads(d, i):
            # Warmed through the default codec options: the same entry.
            view = await items.view_for(mode, read)
            view = refusing if mode != "bypassed" else view.with_options(codec_options=codec)
            before = items.counts()
            with pytest.raises(InvalidBSON) as ours:
                await read(view)
            items.check_mode(mode, before)
            with pytest.raises(InvalidBSON) as theirs:
                await read(raw)
            assert str(ours.value) == str(theirs.value) == ("refused: 1.5" if i == 200 else "refused: 2"), what
