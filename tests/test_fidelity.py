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
from collections.abc import Callable
from typing import Any

import bson
import pytest
from bson.raw_bson import RawBSONDocument
from pymongo.errors import InvalidOperation
from pymongo.read_preferences import ReadPreference

from support import async_outcome, outcome

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

    def check_mode(self, mode: str, before: tuple[int, int, int]) -> None:
        """The reads since ``before`` (from ``counts()``) were served in ``mode``."""
        hits, misses, bypasses = (now - then for now, then in zip(self.counts(), before))
        assert {"cold": misses, "warm": hits, "bypassed": bypasses}[mode] >= 1, (mode, hits, misses, bypasses)


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
