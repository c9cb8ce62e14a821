"""Templates of hit entries (csrc/template.h): once an entry was hit in a
process, its next hits copy the template's containers around the same
immutable values instead of building the document again.

What a caller gets must still be exactly PyMongo's objects (type, value and
key order, recursively), and no hit may share with another anything a
caller can change: every dict and list is new, and every value that can be
changed (Regex, DBRef, Code and its scope, Binary) is new too, as the
documents that hold one get no template. Each test runs with both APIs, in
a process-local cache and in a worker of a shared cache, and most with
templates made on an entry's first hit (``_native._template_hits(1)``; the
default, the fourth, has a test of its own).
"""

from __future__ import annotations

import datetime
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import bson
import pytest
from bson.binary import Binary
from bson.code import Code
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp

from bson_strict import assert_strict_equal, strict_difference
from client_query_cache import CacheConfigurationError, SharedCache, _native
from support import TEST_MAX_AWAIT_MS
from test_builder import every_type_documents

#: A document of every value a template shares between hits, nested.
SHAREABLE = {
    "_id": 0,
    "s": "héllo",
    "f": -0.0,
    "nan": float("nan"),
    "i": -7,
    "i64": Int64(-(2**62)),
    "t": True,
    "none": None,
    "oid": ObjectId("0123456789abcdef01234567"),
    "dt": datetime.datetime(1999, 12, 31, 23, 59, 59, 999000),
    "b": b"\x00\x01",
    "dec": Decimal128("-0.0001"),
    "ts": Timestamp(1, 2),
    "min": MinKey(),
    "max": MaxKey(),
    "nested": {"a": [{"b": [[], {}]}, [1, [2, [3.5]]]], "c": {"d": "e"}},
    "list": [1, "x", [None, {"k": [True]}]],
}


def mutable_parts(obj: Any) -> Iterator[Any]:
    """Every container of a result, and every value of a type a caller can
    change, depth first."""
    if isinstance(obj, (dict, list, Regex, DBRef, Code, Binary)):
        yield obj
    if isinstance(obj, dict):
        for value in obj.values():
            yield from mutable_parts(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from mutable_parts(value)
    elif isinstance(obj, DBRef):
        yield from mutable_parts(obj.id)
        yield from mutable_parts(obj._DBRef__kwargs)
    elif isinstance(obj, Code) and obj.scope is not None:
        yield from mutable_parts(obj.scope)


def mutate_all(obj: Any) -> int:
    """Change every mutable part of a result in place; how many."""
    parts = list(mutable_parts(obj))
    for part in parts:
        if isinstance(part, dict):
            part["mutated"] = True
            first = next(iter(part), None)
            if first is not None and first != "mutated":
                part[first] = "changed"
        elif isinstance(part, list):
            part.append("mutated")
            if len(part) > 1:
                part[0] = "changed"
        elif isinstance(part, Regex):
            part.pattern = "changed"
            part.flags = 0
        elif isinstance(part, Code) and part.scope is not None:
            part.scope["mutated"] = True
        else:  # DBRef, Binary: instances take attributes
            try:
                part.mutated = True
            except AttributeError:
                pass
    return len(parts)


def assert_no_shared_mutable_part(a: Any, b: Any) -> None:
    parts = list(mutable_parts(a))
    ids = {id(p) for p in parts}
    shared = [p for p in mutable_parts(b) if id(p) in ids]
    assert shared == [], f"two hits share {shared!r}"


def containers(tree: Any) -> Iterator[Any]:
    """The dicts and lists of ``tree``, itself first."""
    yield tree
    for v in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(v, (dict, list)):
            yield from containers(v)


def assert_copies_are_fresh(tpl: Any, built: Any) -> None:
    """Copies of the template ``tpl`` of ``built`` equal it, share none of
    its (or the template's) mutable parts, and changing every part of one
    leaves the next unchanged."""
    assert tpl is not None
    for _ in range(2):
        copy = _native._template_copy(tpl)
        assert_strict_equal(copy, built)
        assert_no_shared_mutable_part(copy, built)
        assert_no_shared_mutable_part(copy, tpl[0])
        mutate_all(copy)
    assert_strict_equal(_native._template_copy(tpl), built)


@pytest.fixture
def first_hit() -> Iterator[None]:
    """Templates made on an entry's first hit, for this test."""
    old = _native._template_hits(1)
    try:
        yield
    finally:
        _native._template_hits(old)


@pytest.fixture(params=["local", "shared"])
def where(request: pytest.FixtureRequest, server_uri: str, runtime_dir: Any) -> Iterator[Callable[..., Any]]:
    """How the test's managers are made: process-local, or as workers of a
    shared cache (started here)."""
    if request.param == "local":
        yield lambda d, **options: d.manager(**options)
        return
    name = f"tpl-{uuid.uuid4().hex[:8]}"
    with SharedCache.start(name, server_uri, max_await_time_ms=TEST_MAX_AWAIT_MS):
        yield lambda d, **options: d.manager(shared=name, **options)


READS: list[tuple[str, Callable[[Any, int], Any], bool]] = [
    ("find_one by _id", lambda c, i: c.find_one({"_id": i}), False),
    ("find_one by filter", lambda c, i: c.find_one({"_id": {"$in": [i]}}), False),
    ("find", lambda c, i: c.find({"_id": {"$gte": i}}, sort=[("_id", 1)]), True),
    ("find with a limit", lambda c, i: c.find({"_id": {"$gte": i}}, sort=[("_id", 1)], limit=1), True),
    ("aggregate", lambda c, i: c.aggregate([{"$match": {"_id": i}}]), True),
    ("count_documents", lambda c, i: c.count_documents({"_id": {"$gte": i}}), False),
    ("distinct", lambda c, i: c.distinct("nested.a", {"_id": i}), False),
]


async def test_hits_of_every_type_are_pymongo_s_objects_and_share_nothing_a_caller_can_change(
    d, client, db_name, where, first_hit
) -> None:
    client[db_name].items.insert_one(SHAREABLE)
    client[db_name].items.insert_many([RawBSONDocument(r) for r in every_type_documents()])
    ids = [doc["_id"] for doc in client[db_name].items.find({}, sort=[("_id", 1)])]
    cache = where(d)
    coll = await d.ready(cache, db_name)
    plain = d.client()[db_name].items
    for what, read, cursor in READS:
        for i in ids:

            async def once(view: Any, read: Any = read, cursor: bool = cursor, i: int = i) -> Any:
                return await d.docs(read(view, i)) if cursor else await d.r(read(view, i))

            want = await once(plain)
            await d.served(cache, lambda: once(coll), what=f"{what} of {i} is served")
            # The hit after the first (whose objects became the template),
            # then another: equal to PyMongo's, sharing nothing changeable.
            hits = cache.snapshot().hits
            first = await once(coll)
            second = await once(coll)
            assert cache.snapshot().hits == hits + 2, what
            for got in (first, second):
                assert strict_difference(got, want) is None, f"{what} of {i}: {strict_difference(got, want)}"
            assert_no_shared_mutable_part(first, second)
            # Whatever the caller does to one hit, the next is unchanged.
            mutate_all(first)
            mutate_all(second)
            third = await once(coll)
            assert strict_difference(third, want) is None, f"{what} of {i} after mutation"
    snap = cache.snapshot()
    assert snap.template_hits > 0 and snap.templates > 0 and 0 < snap.template_bytes <= 16 * 2**20


async def test_an_entry_gets_its_template_on_its_fourth_hit(d, client, db_name, where) -> None:
    # By default: the first three hits are built, the fourth keeps its
    # objects as the template, and the hits after it are template hits.
    client[db_name].items.insert_one(SHAREABLE)
    cache = where(d)
    coll = await d.ready(cache, db_name)
    await d.served(cache, lambda: coll.find_one({"_id": 0}))
    hits = 1
    while cache.snapshot().templates == 0:
        assert cache.snapshot().template_hits == 0
        await d.r(coll.find_one({"_id": 0}))
        hits += 1
        assert hits <= 4, cache.snapshot()
    assert hits == 4
    before = cache.snapshot()
    a = await d.r(coll.find_one({"_id": 0}))
    b = await d.r(coll.find_one({"_id": 0}))
    after = cache.snapshot()
    assert after.template_hits == before.template_hits + 2 and after.hits == before.hits + 2
    assert after.templates == 1
    assert a is not b and a["nested"] is not b["nested"] and a["list"][2] is not b["list"][2]
    # Immutable values may be the same objects across hits.
    assert a["s"] is b["s"] and a["dt"] is b["dt"] and a["oid"] is b["oid"]
    assert_strict_equal(a, bson.decode(bson.encode(SHAREABLE)))


async def test_a_template_is_not_served_after_its_entry_changed(d, client, db_name, where, first_hit) -> None:
    # Written by another client between two hits: the stream invalidates the
    # entry, the next read is a miss with the new value, and its next hits
    # are built (then templated) from the new entry.
    client[db_name].items.insert_one({"_id": 1, "v": 1, "sub": {"n": [1]}})
    cache = where(d)
    coll = await d.ready(cache, db_name)
    for expected in range(1, 6):
        await d.served(cache, lambda: coll.find_one({"_id": 1}))
        templated = cache.snapshot().template_hits
        hit = await d.served(cache, lambda: coll.find_one({"_id": 1}))
        assert hit == {"_id": 1, "v": expected, "sub": {"n": [expected]}}
        assert cache.snapshot().template_hits > templated
        client[db_name].items.update_one({"_id": 1}, {"$set": {"v": expected + 1, "sub": {"n": [expected + 1]}}})
        await d.wait_until(
            lambda expected=expected: _read_is(d, coll, expected + 1), what=f"the change to v={expected + 1} is read"
        )
    assert cache.snapshot().templates <= 2


async def _read_is(d: Any, coll: Any, v: int) -> bool:
    doc = await d.r(coll.find_one({"_id": 1}))
    return doc["v"] == v and doc["sub"] == {"n": [v]}


async def test_the_templates_stay_within_their_budget(d, client, db_name, first_hit) -> None:
    client[db_name].items.insert_many([{"_id": i, "pad": "x" * 400, "l": list(range(20))} for i in range(200)])
    budget = 16 * 1024
    cache = d.manager(template_bytes=budget)
    coll = await d.ready(cache, db_name)
    for _ in range(2):
        for i in range(200):
            await d.served(cache, lambda i=i: coll.find_one({"_id": i}))
            await d.r(coll.find_one({"_id": i}))
            assert cache.snapshot().template_bytes <= budget
    snap = cache.snapshot()
    assert 0 < snap.templates < 200 and snap.template_hits > 0
    assert cache._engine.native.stats()["template_evictions"] > 0


async def test_no_templates_when_their_budget_is_zero(d, client, db_name, first_hit) -> None:
    client[db_name].items.insert_one(SHAREABLE)
    cache = d.manager(template_bytes=0)
    coll = await d.ready(cache, db_name)
    await d.served(cache, lambda: coll.find_one({"_id": 0}))
    for _ in range(3):
        assert strict_difference(await d.r(coll.find_one({"_id": 0})), bson.decode(bson.encode(SHAREABLE))) is None
    snap = cache.snapshot()
    assert (snap.template_hits, snap.templates, snap.template_bytes) == (0, 0, 0)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", 1 << 41])
def test_template_bytes_is_checked(client, bad) -> None:
    from client_query_cache import CacheManager

    with pytest.raises(CacheConfigurationError, match="template_bytes"):
        CacheManager(client, template_bytes=bad)


def test_an_owner_keeps_no_templates() -> None:
    # Its constructor takes no budget for them: it serves no reads.
    with pytest.raises(TypeError):
        _native.Cache.owner(
            budget_bytes=1 << 20, slot_count=1024, uri=None, max_await_time_ms=100, arena_path=None,
            closed_error=RuntimeError, forked_error=RuntimeError, template_bytes=1 << 20,
        )  # fmt: skip


def test_templates_of_deep_and_wide_documents() -> None:
    # Nested as deep as a template follows (200 levels below the top, dicts
    # and lists in turn), and wide (thousands of nested containers): each
    # copy rebuilds every level in its place.
    deep: Any = {"leaf": "x", "n": 1.5}
    for level in range(200):
        deep = [level, deep, "s"] if level % 2 else {"k": deep, "i": level}
    wide = {"_id": 1, "rows": [{"i": i, "tags": [str(i), i * 0.5], "at": {"d": i}} for i in range(3000)]}
    # Many fields, nested containers among them (first, inside, last): a
    # dict's copy puts its nested copies where its table holds them, with
    # one-byte, two-byte and (past 65,536 slots) four-byte table indexes.
    broad = [
        {f"f{i}": {"i": i} if i % 7 == 0 else [i] if i % 11 == 0 or i == n - 1 else i for i in range(n)}
        for n in (1, 12, 300, 50_000)
    ]
    for built in (deep, wide, [wide, deep[1]], [], *broad):
        tpl = _native._template(built)
        nodes = list(containers(tpl[0]))
        before = [sys.getrefcount(c) for c in nodes]
        assert_copies_are_fresh(tpl, built)
        # Copies made and dropped hold nothing of the template's.
        assert [sys.getrefcount(c) for c in nodes] == before
    # One level more than that: no template (hits built every time).
    assert _native._template({"k": deep}) is None
    assert _native._template([wide, deep]) is None


def test_what_is_a_template_and_what_its_copies_are() -> None:
    built = bson.decode(bson.encode(SHAREABLE))
    tpl = _native._template(built)
    assert_copies_are_fresh(tpl, built)
    # Anything a caller can change, or a container of another type, makes
    # no template: the document is built on every hit.
    for value in (Regex("a"), DBRef("c", 1), Code("x"), Code("x", {"a": 1}), Binary(b"x", 0x80),
                  Binary(uuid.uuid4().bytes, 4), uuid.uuid4(), bytearray(b"x"), {1, 2}, (1, 2),
                  bson.son.SON(a=1), type("Str", (str,), {})("x")):  # fmt: skip
        assert _native._template({"_id": 1, "v": [{"w": value}]}) is None, value
    assert _native._template("not a container") is None
    # A tuple that no template made is refused, whatever it holds (a
    # capsule of another name: datetime's C API).
    for bogus in ((None, None, b""), ({"a": 1}, ["a"], b""), ([1], ("x", None), b"\x00" * 64),
                  (tpl[0], None), (tpl[0],), (tpl[1], tpl[0]), (tpl[0], datetime.datetime_CAPI),
                  [tpl[0], tpl[1]], (*tpl, None)):  # fmt: skip
        with pytest.raises(TypeError):
            _native._template_copy(bogus)
    # The program holds its own tree: with another tree beside it, a copy
    # is still the template's.
    assert_strict_equal(_native._template_copy(({"other": 1}, tpl[1])), built)
