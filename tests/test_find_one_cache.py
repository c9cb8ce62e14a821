"""find_one by _id through the cache, with the sync and the async API alike
(the ``d`` fixture runs each test with both): hits, keys, invalidation,
admission, memory bounds, and every reason a read bypasses the cache.

What only the async facade promises (a hit never suspends the event loop,
``find`` returns an async cursor) is in test_async_find_one_cache.py.
Documents are seeded, and "another application" writes, with the sync
clients (``client``, ``other_client``); reads go through the driver's client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import bson
import pymongo
import pytest
from bson.binary import UuidRepresentation
from bson.codec_options import CodecOptions, TypeRegistry
from bson.decimal128 import Decimal128
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from client_query_cache import BypassReason
from client_query_cache._core.classify import ReadPlan, classify_find_one, classify_id
from client_query_cache._core.engine import NO_STAMP
from support import ARGUMENT_BYPASSES, Driver, async_outcome, bypass_delta, stream_of, stream_passed_now, wait_until


async def _by_id(d: Driver, coll: Any, _id: Any) -> Any:
    return await d.r(coll.find_one({"_id": _id}))


def _read_is(d: Driver, coll: Any, _id: Any, expected: Any) -> Callable[[], Awaitable[bool]]:
    """A predicate for ``d.wait_until``: reading ``_id`` gives ``expected``."""

    async def check() -> bool:
        return await _by_id(d, coll, _id) == expected

    return check


async def _cache_twice(d: Driver, cache: Any, coll: Any, _id: Any, expected: Any) -> None:
    """Read _id twice and check that the second read was a hit: once the
    stream has passed what the process saw (another client's writes, read
    by a miss before, may otherwise invalidate the entry between the two
    reads when their events come in late)."""
    assert await _by_id(d, coll, _id) == expected
    await d.wait_until(stream_passed_now(cache, coll.database.name), what="the stream passes what was read")
    assert await _by_id(d, coll, _id) == expected
    hits = cache.snapshot().hits
    assert await _by_id(d, coll, _id) == expected
    assert cache.snapshot().hits == hits + 1, "the second read was not a hit"


# -- hits -----------------------------------------------------------------------


async def test_a_hit_after_a_miss_returns_an_equal_but_independent_object(d, client, db_name):
    stored = {"_id": 1, "name": "one", "tags": ["a", "b"], "nested": {"n": 1}}
    client[db_name].items.insert_one(dict(stored))
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    assert isinstance(coll, d.Collection)
    before = cache.snapshot()

    first = await _by_id(d, coll, 1)  # miss, admitted
    second = await _by_id(d, coll, 1)  # hit
    first["name"] = "changed"
    first["tags"].append("c")
    first["nested"]["n"] = 2
    third = await _by_id(d, coll, 1)  # hit

    after = cache.snapshot()
    assert after.misses == before.misses + 1
    assert after.admissions == before.admissions + 1
    assert after.hits == before.hits + 2
    assert second == stored and third == stored
    assert second is not third
    assert second["tags"] is not third["tags"]
    assert second["nested"] is not third["nested"]


@pytest.mark.parametrize(
    "codec_options",
    [
        CodecOptions(document_class=SON),
        CodecOptions(tz_aware=True, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        CodecOptions(document_class=RawBSONDocument),
    ],
    ids=["son", "tz_aware", "raw_bson"],
)
async def test_a_hit_is_decoded_with_the_reading_collections_codec_options(d, client, db_name, codec_options):
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123000)
    client[db_name].items.insert_one({"_id": 1, "when": when, "nested": {"n": 1}})
    mongo = d.client()
    cache = d.manager(mongo)
    plain = await d.ready(cache, db_name)
    assert await _by_id(d, plain, 1) == {"_id": 1, "when": when, "nested": {"n": 1}}  # admitted
    special = cache[db_name].get_collection("items", codec_options=codec_options)
    direct = mongo[db_name].get_collection("items", codec_options=codec_options)
    hits = cache.snapshot().hits

    got = await _by_id(d, special, 1)

    assert cache.snapshot().hits == hits + 1
    expected = await _by_id(d, direct, 1)
    assert type(got) is type(expected) is codec_options.document_class
    assert got == expected
    if codec_options.document_class is not RawBSONDocument:
        assert type(got["nested"]) is codec_options.document_class
        assert got["when"] == expected["when"]
        assert got["when"].tzinfo == expected["when"].tzinfo
    # The entry itself is unchanged: the default collection still gets a dict.
    again = await _by_id(d, plain, 1)
    assert type(again) is dict and again["when"].tzinfo is None


async def test_projection_is_part_of_the_key(d, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "a": 1, "b": 2})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    before = cache.snapshot()

    whole = await d.r(coll.find_one({"_id": 1}))
    part = await d.r(coll.find_one({"_id": 1}, {"a": 1}))
    after_misses = cache.snapshot()
    # Each is served from an entry of its own (the first may wait for the
    # stream to pass the second's read: it may have seen a newer document).
    whole_again = await d.served(cache, lambda: coll.find_one({"_id": 1}))
    part_again = await d.served(cache, lambda: coll.find_one({"_id": 1}, projection={"a": 1}))

    after = cache.snapshot()
    assert whole == whole_again == {"_id": 1, "a": 1, "b": 2}
    assert part == part_again == {"_id": 1, "a": 1}
    assert after_misses.admissions == before.admissions + 2
    assert after.entries == before.entries + 2


async def test_not_found_is_cached_and_invalidated_by_an_insert_of_that_id(d, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": "present"})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    before = cache.snapshot()

    assert await _by_id(d, coll, "missing") is None  # miss: "not found" admitted
    assert await _by_id(d, coll, "missing") is None  # hit
    cached = cache.snapshot()
    assert cached.admissions == before.admissions + 1
    assert cached.hits == before.hits + 1

    other_client[db_name].items.insert_one({"_id": "missing", "v": 1})
    await d.wait_until(
        _read_is(d, coll, "missing", {"_id": "missing", "v": 1}),
        what="the inserted document replaces the cached 'not found'",
    )


_WRITES: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "update": (lambda c: c.update_one({"_id": 1}, {"$set": {"v": 2}}), {"_id": 1, "v": 2}),
    "replace": (lambda c: c.replace_one({"_id": 1}, {"w": "new"}), {"_id": 1, "w": "new"}),
    "delete": (lambda c: c.delete_one({"_id": 1}), None),
}


@pytest.mark.parametrize("write", sorted(_WRITES))
async def test_a_write_by_another_client_invalidates_the_cached_document(d, client, other_client, db_name, write):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    await _cache_twice(d, cache, coll, 1, {"_id": 1, "v": 1})  # it really was cached

    do_write, expected = _WRITES[write]
    do_write(other_client[db_name].items)

    await d.wait_until(_read_is(d, coll, 1, expected), what=f"the {write} reaches the cache")
    # The new version is cached in its turn.
    await _cache_twice(d, cache, coll, 1, expected)


async def test_an_integral_double_id_is_cached_for_int_reads_and_invalidated_through_the_double(
    d, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1.0, "v": "first"})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    first = await _by_id(d, coll, 1)
    assert first == {"_id": 1.0, "v": "first"} and type(first["_id"]) is float
    hits = cache.snapshot().hits
    assert await _by_id(d, coll, 1) == {"_id": 1.0, "v": "first"}
    assert cache.snapshot().hits == hits + 1

    other_client[db_name].items.update_one({"_id": 1.0}, {"$set": {"v": "second"}})

    await d.wait_until(
        _read_is(d, coll, 1, {"_id": 1.0, "v": "second"}),
        what="a write to _id 1.0 invalidates the entry read as _id 1",
    )


async def test_find_one_by_value_is_cached_like_an_id_filter(d, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": 5, "v": "five"})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    before = cache.snapshot()

    assert await d.r(coll.find_one(5)) == {"_id": 5, "v": "five"}  # miss
    assert await d.r(coll.find_one(5)) == {"_id": 5, "v": "five"}  # hit
    assert await d.r(coll.find_one({"_id": 5})) == {"_id": 5, "v": "five"}  # same entry: hit
    after = cache.snapshot()
    assert after.admissions == before.admissions + 1
    assert after.hits == before.hits + 2
    assert after.bypass_total == before.bypass_total

    other_client[db_name].items.update_one({"_id": 5}, {"$set": {"v": "cinq"}})

    async def updated() -> bool:
        return await d.r(coll.find_one(5)) == {"_id": 5, "v": "cinq"}

    await d.wait_until(updated, what="the update is seen")


#: _id values of every type the C fast path encodes itself, at the edges of
#: their encodings (int32 and int64, multi-byte UTF-8).
FAST_IDS = [0, -1, 2**31 - 1, 2**31, -(2**63), 2**63 - 1, "", "id-\u00e9\u20ac\U0001d11e", "x" * 300, ObjectId()]


@pytest.mark.parametrize(
    "codec_options",
    [
        CodecOptions(),
        CodecOptions(tz_aware=True, uuid_representation=UuidRepresentation.STANDARD, document_class=SON),
        CodecOptions(type_registry=TypeRegistry(fallback_encoder=lambda value: str(value))),
    ],
    ids=["default", "tz_uuid_son", "fallback_encoder"],
)
def test_the_fast_paths_miss_plan_is_the_plan_classification_gives(codec_options):
    for value in FAST_IDS:
        fast = classify_id(value, codec_options)
        classified = classify_find_one({"_id": value}, (), {}, codec_options)
        assert type(fast) is type(classified) is ReadPlan, value
        for slot in ReadPlan.__slots__:
            assert getattr(fast, slot) == getattr(classified, slot), (value, slot)
        assert type(fast.args[0]) is dict and type(fast.args[0]["_id"]) is type(value)


async def test_a_miss_on_the_fast_path_and_a_classified_read_share_one_entry(d, client, db_name):
    # find_one(filter, None) is classified (it has an argument); find_one(filter)
    # takes the C fast path. Each admits what the other then hits.
    client[db_name].items.insert_many([{"_id": v, "v": i} for i, v in enumerate(FAST_IDS)])
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    for i, value in enumerate(FAST_IDS):
        first, second = (coll.find_one, lambda f: coll.find_one(f, None))[:: 1 if i % 2 else -1]
        before = cache.snapshot()
        assert await d.r(first({"_id": value})) == {"_id": value, "v": i}
        middle = cache.snapshot()
        # Served from the entry the first read admitted: no miss, no admission.
        assert await d.served(cache, lambda: second({"_id": value})) == {"_id": value, "v": i}
        after = cache.snapshot()
        assert (middle.misses, middle.admissions) == (before.misses + 1, before.admissions + 1), value
        assert (after.misses, after.admissions) == (middle.misses, middle.admissions), value


# -- namespace events -----------------------------------------------------------


async def test_dropping_the_collection_invalidates_its_entries(d, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    await _cache_twice(d, cache, coll, 1, {"_id": 1, "v": 1})

    other_client[db_name].drop_collection("items")

    await d.wait_until(_read_is(d, coll, 1, None), what="the drop reaches the cache")


async def test_dropping_the_database_invalidates_its_entries_and_caching_resumes(d, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    client[db_name].more.insert_one({"_id": 1, "w": 1})
    cache = d.manager()
    items = await d.ready(cache, db_name, "items")
    more = await d.ready(cache, db_name, "more")
    await _cache_twice(d, cache, items, 1, {"_id": 1, "v": 1})
    await _cache_twice(d, cache, more, 1, {"_id": 1, "w": 1})

    other_client.drop_database(db_name)

    async def both_gone() -> bool:
        return await _by_id(d, items, 1) is None and await _by_id(d, more, 1) is None

    await d.wait_until(both_gone, what="dropDatabase reaches the cache")
    # The stream goes on after the database's invalidate event.
    other_client[db_name].items.insert_one({"_id": 1, "v": "again"})
    await d.wait_until(_read_is(d, items, 1, {"_id": 1, "v": "again"}), what="the new insert is seen")
    await d.wait_until(lambda: cache.wait_ready(0, database=db_name), what="the stream serves again")
    await _cache_twice(d, cache, items, 1, {"_id": 1, "v": "again"})


async def test_rename_invalidates_the_source_and_the_target(d, client, other_client, db_name):
    client[db_name].src.insert_one({"_id": 1, "v": "from src"})
    client[db_name].dst.insert_one({"_id": 1, "v": "from dst"})
    cache = d.manager()
    src = await d.ready(cache, db_name, "src")
    dst = await d.ready(cache, db_name, "dst")
    await _cache_twice(d, cache, src, 1, {"_id": 1, "v": "from src"})
    await _cache_twice(d, cache, dst, 1, {"_id": 1, "v": "from dst"})

    other_client[db_name].src.rename("dst", dropTarget=True)

    async def renamed() -> bool:
        return await _by_id(d, src, 1) is None and await _by_id(d, dst, 1) == {"_id": 1, "v": "from src"}

    await d.wait_until(renamed, what="the rename reaches both namespaces")


async def test_a_collection_created_after_a_missing_read_is_cached(d, other_client, db_name):
    cache = d.manager()
    coll = await d.ready(cache, db_name, "later")
    before = cache.snapshot()
    assert await _by_id(d, coll, 1) is None
    assert cache.snapshot().bypasses.get("missing_collection", 0) == (
        before.bypasses.get("missing_collection", 0) + 1
    )

    other_client[db_name].later.insert_one({"_id": 1, "v": 1})

    await d.wait_until(_read_is(d, coll, 1, {"_id": 1, "v": 1}), what="the new collection is read")
    await _cache_twice(d, cache, coll, 1, {"_id": 1, "v": 1})


async def test_a_collection_recreated_with_a_collation_is_read_under_it(d, client, other_client, db_name):
    client[db_name].items.insert_many([{"_id": "a", "v": "simple"}, {"_id": "z", "v": 0}])
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    await _cache_twice(d, cache, coll, "a", {"_id": "a", "v": "simple"})

    other_client[db_name].drop_collection("items")
    ci = other_client[db_name].create_collection("items", collation={"locale": "en", "strength": 2})
    ci.insert_many([{"_id": "a", "v": "collated"}, {"_id": "z", "v": 0}])

    await d.wait_until(_read_is(d, coll, "a", {"_id": "a", "v": "collated"}), what="the new collection is read")
    # That read saw the new collection's inserts; until the stream has
    # applied them too, each one's event still invalidates the entry (a
    # collated identity entry is validated by its namespace), and a slow run
    # saw the second read below miss for it.
    await d.wait_until(stream_passed_now(cache, db_name), what="the stream passes the new collection's inserts")
    await _cache_twice(d, cache, coll, "a", {"_id": "a", "v": "collated"})
    # Under a collation {"_id": "a"} may match other documents: its entry is
    # validated by the namespace, and a write to another document reaches it.
    events = stream_of(cache, db_name).events
    ci.update_one({"_id": "z"}, {"$set": {"v": 1}})
    await d.wait_until(lambda: stream_of(cache, db_name).events > events, what="the update reaches the cache")
    misses = cache.snapshot().misses
    assert await _by_id(d, coll, "a") == {"_id": "a", "v": "collated"}
    assert cache.snapshot().misses == misses + 1


# -- admission and memory -------------------------------------------------------


async def test_an_oversized_document_is_returned_but_not_cached(d, client, db_name):
    cache = d.manager(max_entry_bytes=1024)
    big = {"_id": "big", "payload": "x" * 4096}
    small = {"_id": "small", "payload": "y" * 16}
    client[db_name].items.insert_many([big, small])
    coll = await d.ready(cache, db_name)
    before = cache.snapshot()

    assert await _by_id(d, coll, "big") == big
    assert await _by_id(d, coll, "big") == big

    after = cache.snapshot()
    assert after.rejected_admissions.get("oversize", 0) == before.rejected_admissions.get("oversize", 0) + 2
    assert after.entries == before.entries
    assert after.admissions == before.admissions
    assert after.hits == before.hits
    # A document under the limit is cached by the same manager.
    await _cache_twice(d, cache, coll, "small", small)


async def test_used_bytes_never_exceed_the_budget_while_admitting_more_than_fits(d, client, db_name):
    budget = 256 * 1024
    cache = d.manager(budget_bytes=budget, max_entry_bytes=budget // 4)
    count, payload = 200, "p" * 4000  # ~800 KiB of documents
    client[db_name].items.insert_many([{"_id": i, "payload": payload} for i in range(count)])
    coll = await d.ready(cache, db_name)
    start = cache.snapshot()
    assert start.budget_bytes == budget

    for i in range(count):
        assert await _by_id(d, coll, i) == {"_id": i, "payload": payload}
        snap = cache.snapshot()
        assert snap.admissions == start.admissions + i + 1, snap
        assert 0 < snap.used_bytes <= snap.budget_bytes, snap

    assert snap.evictions > 0
    assert (snap.admissions - start.admissions) * len(payload) > 3 * budget
    # At most a budget's worth of them is still cached: the others were
    # evicted and are read again from MongoDB, correctly.
    misses = cache.snapshot().misses
    for i in range(count):
        assert await _by_id(d, coll, i) == {"_id": i, "payload": payload}
    assert cache.snapshot().misses - misses >= count - budget // len(payload)
    assert cache.snapshot().used_bytes <= budget


_RACING_WRITES = {
    # name: (initial documents, write, result of the racing read, final result)
    "update": (
        [{"_id": 1, "v": "old"}],
        lambda c: c.update_one({"_id": 1}, {"$set": {"v": "new"}}),
        {"_id": 1, "v": "old"},
        {"_id": 1, "v": "new"},
    ),
    "insert_over_not_found": (
        [{"_id": "other"}],
        lambda c: c.insert_one({"_id": 1, "v": "new"}),
        None,
        {"_id": 1, "v": "new"},
    ),
}


@pytest.mark.parametrize("race", sorted(_RACING_WRITES))
async def test_a_write_racing_a_miss_is_not_admitted(d, client, other_client, db_name, race):
    initial, write, racing_result, final = _RACING_WRITES[race]
    client[db_name].items.insert_many(initial)
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    fired = []

    # The hooks are sync and run on the reading thread (the event loop's, for
    # the async API): the racing write uses a sync client and waits, blocking
    # that thread but not the C stream threads, until the stream applied it.
    def write_and_wait_for_the_stream() -> None:
        fired.append(True)
        cache._engine.hooks.before_admit = None
        events = stream_of(cache, db_name).events
        write(other_client[db_name].items)
        wait_until(
            lambda: stream_of(cache, db_name).events > events,
            what="the stream applies the racing write",
        )

    cache._engine.hooks.before_admit = write_and_wait_for_the_stream
    before = cache.snapshot()

    assert await _by_id(d, coll, 1) == racing_result  # read before the write landed

    after = cache.snapshot()
    assert fired == [True]
    assert after.rejected_admissions.get("stale", 0) == before.rejected_admissions.get("stale", 0) + 1
    assert after.admissions == before.admissions
    assert await _by_id(d, coll, 1) == final
    assert cache.snapshot().hits == after.hits  # that was a miss, not a stale hit


def _hold_back_one_admission(cache: Any) -> list[tuple[Any, bytes, bytes | None, Any]]:
    """Make the next miss record (plan, token, BSON result, stamp)
    instead of admitting. Admitted again with that stamp, an entry is served
    as the miss's own would be (the read it came from; without it, a read
    must wait for the stream to cover that read: the causal floor)."""
    engine = cache._engine
    held: list[tuple[Any, bytes, bytes | None, Any]] = []
    real_admit = engine.admit

    def hold(plan: Any, token: bytes, value: bytes | None, rebind: bool = False, stamp: Any = NO_STAMP) -> None:
        assert not rebind  # a find_one by _id
        held.append((plan, token, value, stamp))
        engine.admit = real_admit  # only this one

    engine.admit = hold
    return held


@pytest.mark.parametrize("older_first", [True, False], ids=["older-first", "newer-first"])
async def test_reads_under_one_generation_with_different_results_are_never_served(
    d, client, other_client, db_name, older_first
):
    # Misses captured under the same generations that read different bytes
    # straddle a write whose event is not applied yet. Whatever the order of
    # their admissions, none may be served: serving the older after the newer
    # was returned would read backwards. A third admission under the same
    # generations (either version) is refused too, until the write's event
    # moves them on.
    client[db_name].items.insert_one({"_id": 1, "v": "old"})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    held = _hold_back_one_admission(cache)
    assert await _by_id(d, coll, 1) == {"_id": 1, "v": "old"}
    ((plan, token, older, floor),) = held
    newer = bson.encode({"_id": 1, "v": "new"})
    before = cache.snapshot()

    for raw in (older, newer, older, newer) if older_first else (newer, older, newer, older):
        cache._engine.admit(plan, token, raw, stamp=floor)

    after = cache.snapshot()
    assert after.admissions == before.admissions + 1
    assert after.rejected_admissions.get("conflict", 0) == before.rejected_admissions.get("conflict", 0) + 3
    # The server still holds "old" (the "new" read was simulated): reads go
    # to it, and their admissions are refused as well.
    assert await _by_id(d, coll, 1) == {"_id": 1, "v": "old"}
    assert await _by_id(d, coll, 1) == {"_id": 1, "v": "old"}
    snap = cache.snapshot()
    assert snap.misses == after.misses + 2
    assert snap.hits == after.hits
    assert snap.rejected_admissions["conflict"] == after.rejected_admissions["conflict"] + 2

    # Once a write's event moves the generation on, the document is cached
    # again. (Reads go to the server until then, so seeing "newest" does not
    # mean the event has arrived: wait for the event itself.)
    events = stream_of(cache, db_name).events
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": "newest"}})
    await d.wait_until(lambda: stream_of(cache, db_name).events > events, what="the update reaches the cache")
    await _cache_twice(d, cache, coll, 1, {"_id": 1, "v": "newest"})


async def test_the_same_result_admitted_twice_under_one_generation_stays_cached(d, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": "old"})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    held = _hold_back_one_admission(cache)
    assert await _by_id(d, coll, 1) == {"_id": 1, "v": "old"}
    ((plan, token, value, floor),) = held

    cache._engine.admit(plan, token, value, stamp=floor)
    cache._engine.admit(plan, token, bytes(value), stamp=floor)

    snap = cache.snapshot()
    assert snap.rejected_admissions.get("conflict", 0) == 0
    assert await _by_id(d, coll, 1) == {"_id": 1, "v": "old"}
    assert cache.snapshot().hits == snap.hits + 1


async def test_admitting_a_cached_result_again_evicts_nothing(d, client, db_name):
    # Workers that miss one document before its first admission lands each
    # send it: the copies that follow must not push the cache's other
    # entries out, however many there are.
    budget = 256 * 1024
    cache = d.manager(budget_bytes=budget, max_entry_bytes=budget // 4)
    count, payload = 40, "p" * 4000  # ~160 KiB: all fit
    client[db_name].items.insert_many([{"_id": i, "payload": payload} for i in range(count)])
    coll = await d.ready(cache, db_name)
    held = _hold_back_one_admission(cache)
    assert await _by_id(d, coll, 0) == {"_id": 0, "payload": payload}
    ((plan, token, value, floor),) = held
    cache._engine.admit(plan, token, value, stamp=floor)
    for i in range(1, count):
        assert await _by_id(d, coll, i) == {"_id": i, "payload": payload}
    before = cache.snapshot()
    assert before.entries == count and before.evictions == 0, before

    again = 3 * budget // len(payload)  # three budgets' worth of copies
    for _ in range(again):
        cache._engine.admit(plan, token, bytes(value), stamp=floor)

    after = cache.snapshot()
    assert after.admissions == before.admissions + again
    assert (after.evictions, after.entries, after.used_bytes) == (0, count, before.used_bytes), after
    for i in range(count):
        assert await _by_id(d, coll, i) == {"_id": i, "payload": payload}
    assert cache.snapshot().hits == after.hits + count


# -- bypass reasons -------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    """What a bypass case needs; cleanups run at teardown."""

    d: Driver
    mongo: Any  # the driver's client, which the manager wraps
    client: pymongo.MongoClient  # a sync client, for setup
    db_name: str
    manager: Any
    stack: contextlib.AsyncExitStack

    def raw(self, name: str = "items", **options: Any) -> Any:
        return self.mongo[self.db_name].get_collection(name, **options)

    async def cached(self, name: str = "items", **options: Any) -> Any:
        return await self.d.ready(self.manager, self.db_name, name, **options)


@pytest.fixture
async def ctx(d, client, db_name) -> AsyncIterator[Ctx]:
    client[db_name].items.insert_many(
        [
            {"_id": 1, "v": "one"},
            {"_id": 2, "v": "two"},
            {"_id": {"a": 1}, "v": "document id"},
            {"_id": Decimal128("1.5"), "v": "decimal id"},
        ]
    )
    mongo = d.client()
    async with contextlib.AsyncExitStack() as stack:
        yield Ctx(d, mongo, client, db_name, d.manager(mongo), stack)


Read = Callable[[], Any]
# A case builds (manager, read through the cache, the same read by PyMongo);
# a read returns its result, or (async API) an awaitable that gives it.
Build = Callable[[Ctx], Awaitable[tuple[Any, Read, Read]]]


@dataclasses.dataclass(frozen=True)
class Case:
    reason: BypassReason
    variant: str
    build: Build
    #: Cache lookups that miss before the bypass is decided: only reads that
    #: must ask the server what the collection is look the key up first.
    misses: int = 0

    @property
    def id(self) -> str:
        return f"{self.reason.value}-{self.variant}"


def _read(
    method: str, *args: Any, name: str = "items", options: dict[str, Any] | None = None, **kwargs: Any
) -> Build:
    """The case "method(*args, **kwargs)" on collection ``name``."""

    async def build(ctx: Ctx) -> Any:
        cached = await ctx.cached(name, **(options or {}))
        raw = ctx.raw(name, **(options or {}))
        return (
            ctx.manager,
            lambda: getattr(cached, method)(*args, **kwargs),
            lambda: getattr(raw, method)(*args, **kwargs),
        )

    return build


def _find_one(*args: Any, **kwargs: Any) -> Build:
    return _read("find_one", *args, **kwargs)


def _cursor(method: str, *args: Any, **kwargs: Any) -> Build:
    """The case "every document of method(*args, **kwargs)" (find or aggregate)."""

    async def build(ctx: Ctx) -> Any:
        cached, raw = await ctx.cached(), ctx.raw()

        async def call(coll: Any) -> Any:
            return await ctx.d.docs(getattr(coll, method)(*args, **kwargs))

        return ctx.manager, lambda: call(cached), lambda: call(raw)

    return build


async def _namespace_unavailable(ctx: Ctx) -> Any:
    # "db.coll" longer than 255 bytes does not fit the arena's namespace table.
    name = "n" * (256 - len(ctx.db_name))
    cached = ctx.manager[ctx.db_name][name]
    raw = ctx.raw(name)
    return ctx.manager, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


async def _namespace_limit(ctx: Ctx) -> Any:
    # A manager that caches one collection: a second one's reads are PyMongo's.
    cache = ctx.d.manager(ctx.mongo, max_namespaces=1)
    await ctx.d.ready(cache, ctx.db_name, "first")
    cached = cache[ctx.db_name]["items"]
    raw = ctx.raw()
    return cache, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


async def _stream_unhealthy(ctx: Ctx) -> Any:
    # The followers connect to a port nothing listens on, while the client
    # (and so every miss and bypass) reads the real server: the stream never
    # becomes healthy.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cache = ctx.d.manager(ctx.mongo, stream_uri=f"mongodb://127.0.0.1:{port}/?directConnection=true")
    cached = cache[ctx.db_name]["items"]
    assert not await ctx.d.r(cache.wait_ready(0.3, database=ctx.db_name))
    raw = ctx.raw()
    return cache, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


async def _view(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return await _find_one({"_id": 1}, name="items_view")(ctx)


async def _system_collection(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return await _find_one({"_id": f"{ctx.db_name}.items_view"}, name="system.views")(ctx)


async def _session(ctx: Ctx) -> Any:
    session = await ctx.stack.enter_async_context(ctx.d.using(ctx.mongo.start_session()))
    cached, raw = await ctx.cached(), ctx.raw()
    return (
        ctx.manager,
        lambda: cached.find_one({"_id": 1}, session=session),
        lambda: raw.find_one({"_id": 1}, session=session),
    )


async def _bound_session(ctx: Ctx) -> Any:
    session = await ctx.stack.enter_async_context(ctx.d.using(ctx.mongo.start_session()))
    cached, raw = await ctx.cached(), ctx.raw()

    async def bound(coll: Any) -> Any:
        async with ctx.d.bound(session):
            return await ctx.d.r(coll.find_one({"_id": 1}))

    return ctx.manager, lambda: bound(cached), lambda: bound(raw)


async def _stream_behind(ctx: Ctx) -> Any:
    cached, raw = await ctx.cached(), ctx.raw()
    ahead = Timestamp(2**32 - 1, 0)  # a token no stream has applied

    async def read() -> Any:
        with ctx.manager.after(ahead):
            return await ctx.d.r(cached.find_one({"_id": 1}))

    return ctx.manager, read, lambda: raw.find_one({"_id": 1})


CASES = [
    Case(BypassReason.NAMESPACE_UNAVAILABLE, "long_name", _namespace_unavailable),
    Case(BypassReason.NAMESPACE_LIMIT, "second_collection", _namespace_limit),
    Case(BypassReason.STREAM_UNHEALTHY, "unreachable_stream", _stream_unhealthy),
    Case(BypassReason.MISSING_COLLECTION, "absent", _find_one({"_id": 1}, name="absent"), misses=1),
    Case(BypassReason.UNSUPPORTED_COLLECTION, "view", _view, misses=1),
    Case(BypassReason.UNSUPPORTED_COLLECTION, "system", _system_collection),
    Case(
        BypassReason.READ_PREFERENCE,
        "secondary_preferred",
        _find_one({"_id": 1}, options={"read_preference": ReadPreference.SECONDARY_PREFERRED}),
    ),
    Case(
        BypassReason.READ_CONCERN,
        "local",
        _find_one({"_id": 1}, options={"read_concern": ReadConcern("local")}),
    ),
    Case(BypassReason.SESSION, "explicit", _session),
    Case(BypassReason.SESSION, "bound", _bound_session),
    Case(BypassReason.STREAM_BEHIND, "future_token", _stream_behind),
] + [
    Case(reason, variant, (_cursor if method in ("find", "aggregate") else _read)(method, *args, **kwargs))
    for reason, variant, method, args, kwargs in ARGUMENT_BYPASSES
]


#: Reasons only a shared-cache worker can have; tests/test_shared_cache.py
#: reaches them.
SHARED_ONLY_REASONS = {BypassReason.OWNER_UNAVAILABLE}


def test_every_bypass_reason_has_a_case():
    # One list of cases serves both APIs (the next test runs each with both).
    assert {case.reason for case in CASES} == set(BypassReason) - SHARED_ONLY_REASONS


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
async def test_a_bypassed_read_counts_its_reason_and_behaves_like_pymongo(ctx, case):
    cache, through_cache, direct = await case.build(ctx)
    before = cache.snapshot()

    got = await async_outcome(through_cache)

    after = cache.snapshot()
    expected = await async_outcome(direct)
    assert bypass_delta(dict(before.bypasses), dict(after.bypasses)) == {case.reason.value: 1}
    assert after.admissions == before.admissions
    assert after.hits == before.hits
    assert after.misses == before.misses + case.misses
    assert got == expected


# -- wrapping -------------------------------------------------------------------


async def test_attribute_access_on_a_cached_database_returns_a_cached_collection(d, client, db_name):
    client[db_name].items.insert_one({"_id": 1})
    cache = d.manager()
    await d.ready(cache, db_name)
    coll = cache[db_name].items
    assert isinstance(coll, d.Collection)
    await _cache_twice(d, cache, coll, 1, {"_id": 1})


async def test_get_cached_collection_wraps_a_collection_of_its_client(d, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    mongo = d.client()
    cache = d.manager(mongo)
    coll = cache.get_cached_collection(mongo[db_name]["items"])
    assert isinstance(coll, d.Collection)
    assert coll.raw == mongo[db_name]["items"]
    assert coll.full_name == f"{db_name}.items"
    assert await d.r(cache.wait_ready(15, database=db_name))
    await _cache_twice(d, cache, coll, 1, {"_id": 1, "v": 1})
