"""find_one by _id through AsyncCacheManager: the async twins of
test_find_one_cache.py (hits, keys, invalidation, admission, memory bounds,
every bypass reason), plus what only the async facade promises: a hit
completes without suspending the event loop, and ``find`` returns an async
cursor (``async for``, ``to_list``).

Documents are seeded and "another application" writes with the sync clients
(``client``, ``other_client``); reads go through an ``AsyncMongoClient``.
Waiting for the change stream polls with ``asyncio.sleep`` and a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from typing import Any

import pymongo
import pytest
from bson.codec_options import CodecOptions
from bson.decimal128 import Decimal128
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from client_query_cache import AsyncCacheManager, AsyncCachedCollection, AsyncCachedCursor, BypassReason
from support import (
    ARGUMENT_BYPASSES,
    async_outcome,
    async_ready_collection,
    async_wait_until,
    bypass_delta,
    stream_of,
    wait_until,
)


async def _by_id(coll: Any, _id: Any) -> Any:
    return await coll.find_one({"_id": _id})


def _read_is(coll: Any, _id: Any, expected: Any) -> Callable[[], Awaitable[bool]]:
    """A predicate for ``async_wait_until``: reading ``_id`` gives ``expected``."""

    async def check() -> bool:
        return await _by_id(coll, _id) == expected

    return check


async def _cache_twice(manager: AsyncCacheManager, coll: Any, _id: Any, expected: Any) -> None:
    """Read _id twice and check that the second read was a hit."""
    assert await _by_id(coll, _id) == expected
    hits = manager.snapshot().hits
    assert await _by_id(coll, _id) == expected
    assert manager.snapshot().hits == hits + 1, "the second read was not a hit"


# -- hits -----------------------------------------------------------------------


async def test_a_hit_after_a_miss_returns_an_equal_but_independent_object(
    async_manager, client, db_name
):
    stored = {"_id": 1, "name": "one", "tags": ["a", "b"], "nested": {"n": 1}}
    client[db_name].items.insert_one(dict(stored))
    coll = await async_ready_collection(async_manager, db_name, "items")
    assert isinstance(coll, AsyncCachedCollection)
    before = async_manager.snapshot()

    first = await _by_id(coll, 1)  # miss, admitted
    second = await _by_id(coll, 1)  # hit
    first["name"] = "changed"
    first["tags"].append("c")
    first["nested"]["n"] = 2
    third = await _by_id(coll, 1)  # hit

    after = async_manager.snapshot()
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
async def test_a_hit_is_decoded_with_the_reading_collections_codec_options(
    async_manager, client, async_client, db_name, codec_options
):
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123000)
    client[db_name].items.insert_one({"_id": 1, "when": when, "nested": {"n": 1}})
    plain = await async_ready_collection(async_manager, db_name, "items")
    assert await _by_id(plain, 1) == {"_id": 1, "when": when, "nested": {"n": 1}}  # admitted
    special = async_manager[db_name].get_collection("items", codec_options=codec_options)
    direct = async_client[db_name].get_collection("items", codec_options=codec_options)
    hits = async_manager.snapshot().hits

    got = await _by_id(special, 1)

    assert async_manager.snapshot().hits == hits + 1
    expected = await _by_id(direct, 1)
    assert type(got) is type(expected) is codec_options.document_class
    assert got == expected
    if codec_options.document_class is not RawBSONDocument:
        assert type(got["nested"]) is codec_options.document_class
        assert got["when"] == expected["when"]
        assert got["when"].tzinfo == expected["when"].tzinfo
    again = await _by_id(plain, 1)
    assert type(again) is dict and again["when"].tzinfo is None


async def test_projection_is_part_of_the_key(async_manager, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "a": 1, "b": 2})
    coll = await async_ready_collection(async_manager, db_name, "items")
    before = async_manager.snapshot()

    whole = await coll.find_one({"_id": 1})
    part = await coll.find_one({"_id": 1}, {"a": 1})
    after_misses = async_manager.snapshot()
    whole_again = await coll.find_one({"_id": 1})
    part_again = await coll.find_one({"_id": 1}, projection={"a": 1})

    after = async_manager.snapshot()
    assert whole == whole_again == {"_id": 1, "a": 1, "b": 2}
    assert part == part_again == {"_id": 1, "a": 1}
    assert after_misses.admissions == before.admissions + 2
    assert after.hits == after_misses.hits + 2
    assert after.entries == before.entries + 2


async def test_not_found_is_cached_and_invalidated_by_an_insert_of_that_id(
    async_manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": "present"})
    coll = await async_ready_collection(async_manager, db_name, "items")
    before = async_manager.snapshot()

    assert await _by_id(coll, "missing") is None  # miss: "not found" admitted
    assert await _by_id(coll, "missing") is None  # hit
    cached = async_manager.snapshot()
    assert cached.admissions == before.admissions + 1
    assert cached.hits == before.hits + 1

    other_client[db_name].items.insert_one({"_id": "missing", "v": 1})
    await async_wait_until(
        _read_is(coll, "missing", {"_id": "missing", "v": 1}),
        what="the inserted document replaces the cached 'not found'",
    )


_WRITES: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "update": (lambda c: c.update_one({"_id": 1}, {"$set": {"v": 2}}), {"_id": 1, "v": 2}),
    "replace": (lambda c: c.replace_one({"_id": 1}, {"w": "new"}), {"_id": 1, "w": "new"}),
    "delete": (lambda c: c.delete_one({"_id": 1}), None),
}


@pytest.mark.parametrize("write", sorted(_WRITES))
async def test_a_write_by_another_client_invalidates_the_cached_document(
    async_manager, client, other_client, db_name, write
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = await async_ready_collection(async_manager, db_name, "items")
    await _cache_twice(async_manager, coll, 1, {"_id": 1, "v": 1})

    do_write, expected = _WRITES[write]
    do_write(other_client[db_name].items)

    await async_wait_until(_read_is(coll, 1, expected), what=f"the {write} reaches the cache")
    # The new version is cached in its turn.
    await _cache_twice(async_manager, coll, 1, expected)


async def test_an_integral_double_id_is_cached_for_int_reads_and_invalidated_through_the_double(
    async_manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1.0, "v": "first"})
    coll = await async_ready_collection(async_manager, db_name, "items")
    first = await _by_id(coll, 1)
    assert first == {"_id": 1.0, "v": "first"} and type(first["_id"]) is float
    hits = async_manager.snapshot().hits
    assert await _by_id(coll, 1) == {"_id": 1.0, "v": "first"}
    assert async_manager.snapshot().hits == hits + 1

    other_client[db_name].items.update_one({"_id": 1.0}, {"$set": {"v": "second"}})

    await async_wait_until(
        _read_is(coll, 1, {"_id": 1.0, "v": "second"}),
        what="a write to _id 1.0 invalidates the entry read as _id 1",
    )


async def test_find_one_by_value_is_cached_like_an_id_filter(
    async_manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 5, "v": "five"})
    coll = await async_ready_collection(async_manager, db_name, "items")
    before = async_manager.snapshot()

    assert await coll.find_one(5) == {"_id": 5, "v": "five"}  # miss
    assert await coll.find_one(5) == {"_id": 5, "v": "five"}  # hit
    assert await coll.find_one({"_id": 5}) == {"_id": 5, "v": "five"}  # same entry: hit
    after = async_manager.snapshot()
    assert after.admissions == before.admissions + 1
    assert after.hits == before.hits + 2
    assert after.bypass_total == before.bypass_total

    other_client[db_name].items.update_one({"_id": 5}, {"$set": {"v": "cinq"}})

    async def updated() -> bool:
        return await coll.find_one(5) == {"_id": 5, "v": "cinq"}

    await async_wait_until(updated, what="the update is seen")


# -- a hit does not suspend the event loop ----------------------------------------


class _Resume:
    """Hand a coroutine that already yielded once back to the event loop:
    ``await _Resume(coro, first_yield)`` drives it to the end exactly as if it
    had been awaited from the start (the ``yield from`` protocol by hand)."""

    def __init__(self, coro: Any, first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, to_loop = self._coro, self._first
        while True:
            try:
                sent = yield to_loop
            except BaseException as exc:  # noqa: BLE001 - cancellation is passed on
                try:
                    to_loop = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    to_loop = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


# name: (the read, what it returns once cached)
_HITS: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "int_id": (lambda c: c.find_one({"_id": 1}), {"_id": 1, "a": 1, "b": 2}),
    "str_id": (lambda c: c.find_one({"_id": "s"}), {"_id": "s", "a": 3}),
    "by_value": (lambda c: c.find_one(1), {"_id": 1, "a": 1, "b": 2}),
    "with_projection": (lambda c: c.find_one({"_id": 1}, {"a": 1}), {"_id": 1, "a": 1}),
    "float_id": (lambda c: c.find_one({"_id": 1.0}), {"_id": 1, "a": 1, "b": 2}),
    "not_found": (lambda c: c.find_one({"_id": "absent"}), None),
}


@pytest.mark.parametrize("read", sorted(_HITS))
async def test_a_hit_completes_on_the_first_step_and_a_miss_suspends(
    async_manager, client, db_name, read
):
    client[db_name].items.insert_many([{"_id": 1, "a": 1, "b": 2}, {"_id": "s", "a": 3}])
    coll = await async_ready_collection(async_manager, db_name, "items")
    call, expected = _HITS[read]
    before = async_manager.snapshot()

    # The miss: its first step must yield to the loop (it awaits MongoDB).
    miss = call(coll)
    first_yield = miss.send(None)  # raises StopIteration if it completed
    assert await _Resume(miss, first_yield) == expected
    admitted = async_manager.snapshot()
    assert admitted.misses == before.misses + 1
    assert admitted.admissions == before.admissions + 1

    # The hit: one step, no suspension, the document as the coroutine's value.
    hit = call(coll)
    with pytest.raises(StopIteration) as done:
        hit.send(None)
    assert done.value.value == expected
    assert async_manager.snapshot().hits == admitted.hits + 1


# -- find returns an async cursor ------------------------------------------------


async def test_find_returns_an_async_cursor_usable_with_async_for_and_to_list(
    async_manager, client, db_name
):
    docs = [{"_id": i, "v": i * 10} for i in range(5)]
    client[db_name].items.insert_many(docs)
    coll = await async_ready_collection(async_manager, db_name, "items")

    for attempt in ("miss", "hit"):
        before = async_manager.snapshot()
        cursor = coll.find({"_id": {"$gte": 1}}, sort=[("_id", 1)])
        assert isinstance(cursor, AsyncCachedCursor)
        iterated = [doc async for doc in cursor]
        listed = await coll.find({}, {"v": 1}).sort("_id", -1).to_list()
        limited = await coll.find({}).sort("_id", 1).limit(2).to_list(None)

        assert iterated == docs[1:]
        assert listed == docs[::-1]
        assert limited == docs[:2]
        after = async_manager.snapshot()
        assert after.bypasses == before.bypasses
        if attempt == "miss":
            assert (after.misses - before.misses, after.hits - before.hits) == (3, 0)
        else:
            assert (after.misses - before.misses, after.hits - before.hits) == (0, 3)


# -- namespace events -----------------------------------------------------------


async def test_dropping_the_collection_invalidates_its_entries(
    async_manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = await async_ready_collection(async_manager, db_name, "items")
    await _cache_twice(async_manager, coll, 1, {"_id": 1, "v": 1})

    other_client[db_name].drop_collection("items")

    await async_wait_until(_read_is(coll, 1, None), what="the drop reaches the cache")


async def test_dropping_the_database_invalidates_its_entries_and_caching_resumes(
    async_manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    client[db_name].more.insert_one({"_id": 1, "w": 1})
    items = await async_ready_collection(async_manager, db_name, "items")
    more = await async_ready_collection(async_manager, db_name, "more")
    await _cache_twice(async_manager, items, 1, {"_id": 1, "v": 1})
    await _cache_twice(async_manager, more, 1, {"_id": 1, "w": 1})

    other_client.drop_database(db_name)

    async def both_gone() -> bool:
        return await _by_id(items, 1) is None and await _by_id(more, 1) is None

    await async_wait_until(both_gone, what="dropDatabase reaches the cache")
    other_client[db_name].items.insert_one({"_id": 1, "v": "again"})
    await async_wait_until(
        _read_is(items, 1, {"_id": 1, "v": "again"}), what="the new insert is seen"
    )
    await async_wait_until(
        lambda: async_manager.wait_ready(0, database=db_name), what="the stream serves again"
    )
    await _cache_twice(async_manager, items, 1, {"_id": 1, "v": "again"})


async def test_rename_invalidates_the_source_and_the_target(
    async_manager, client, other_client, db_name
):
    client[db_name].src.insert_one({"_id": 1, "v": "from src"})
    client[db_name].dst.insert_one({"_id": 1, "v": "from dst"})
    src = await async_ready_collection(async_manager, db_name, "src")
    dst = await async_ready_collection(async_manager, db_name, "dst")
    await _cache_twice(async_manager, src, 1, {"_id": 1, "v": "from src"})
    await _cache_twice(async_manager, dst, 1, {"_id": 1, "v": "from dst"})

    other_client[db_name].src.rename("dst", dropTarget=True)

    async def renamed() -> bool:
        return await _by_id(src, 1) is None and await _by_id(dst, 1) == {"_id": 1, "v": "from src"}

    await async_wait_until(renamed, what="the rename reaches both namespaces")


# -- admission and memory -------------------------------------------------------


async def test_an_oversized_document_is_returned_but_not_cached(make_async_manager, client, db_name):
    cache = make_async_manager(max_entry_bytes=1024)
    big = {"_id": "big", "payload": "x" * 4096}
    small = {"_id": "small", "payload": "y" * 16}
    client[db_name].items.insert_many([big, small])
    coll = await async_ready_collection(cache, db_name, "items")
    before = cache.snapshot()

    assert await _by_id(coll, "big") == big
    assert await _by_id(coll, "big") == big

    after = cache.snapshot()
    assert after.rejected_admissions.get("oversize", 0) == before.rejected_admissions.get("oversize", 0) + 2
    assert after.entries == before.entries
    assert after.admissions == before.admissions
    assert after.hits == before.hits
    await _cache_twice(cache, coll, "small", small)


async def test_used_bytes_never_exceed_the_budget_while_admitting_more_than_fits(
    make_async_manager, client, db_name
):
    budget = 256 * 1024
    cache = make_async_manager(budget_bytes=budget, max_entry_bytes=budget // 4)
    count, payload = 200, "p" * 4000  # ~800 KiB of documents
    client[db_name].items.insert_many([{"_id": i, "payload": payload} for i in range(count)])
    coll = await async_ready_collection(cache, db_name, "items")
    start = cache.snapshot()
    assert start.budget_bytes == budget

    for i in range(count):
        assert await _by_id(coll, i) == {"_id": i, "payload": payload}
        snap = cache.snapshot()
        assert snap.admissions == start.admissions + i + 1, snap
        assert 0 < snap.used_bytes <= snap.budget_bytes, snap

    assert snap.evictions > 0
    assert (snap.admissions - start.admissions) * len(payload) > 3 * budget
    await _cache_twice(cache, coll, count - 1, {"_id": count - 1, "payload": payload})
    misses = cache.snapshot().misses
    assert await _by_id(coll, 0) == {"_id": 0, "payload": payload}
    assert cache.snapshot().misses == misses + 1
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
async def test_a_write_racing_a_miss_is_not_admitted(
    async_manager, client, other_client, db_name, race
):
    initial, write, racing_result, final = _RACING_WRITES[race]
    client[db_name].items.insert_many(initial)
    coll = await async_ready_collection(async_manager, db_name, "items")
    fired = []

    # The hooks are sync and run on the event loop's thread: the racing write
    # uses a sync client and waits (blocking the loop, not the C stream
    # threads) until the stream has applied it.
    def write_and_wait_for_the_stream() -> None:
        fired.append(True)
        async_manager._engine.hooks.before_admit = None
        events = stream_of(async_manager, db_name).events
        write(other_client[db_name].items)
        wait_until(
            lambda: stream_of(async_manager, db_name).events > events,
            what="the stream applies the racing write",
        )

    async_manager._engine.hooks.before_admit = write_and_wait_for_the_stream
    before = async_manager.snapshot()

    assert await _by_id(coll, 1) == racing_result  # read before the write landed

    after = async_manager.snapshot()
    assert fired == [True]
    assert after.rejected_admissions.get("stale", 0) == before.rejected_admissions.get("stale", 0) + 1
    assert after.admissions == before.admissions
    assert await _by_id(coll, 1) == final
    assert async_manager.snapshot().hits == after.hits  # that was a miss, not a stale hit


# -- bypass reasons -------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    """What a bypass case needs; cleanups run at teardown."""

    client: pymongo.MongoClient
    async_client: pymongo.AsyncMongoClient
    db_name: str
    manager: AsyncCacheManager
    make_manager: Callable[..., AsyncCacheManager]
    stack: contextlib.AsyncExitStack

    def raw(self, name: str = "items", **options: Any) -> Any:
        return self.async_client[self.db_name].get_collection(name, **options)

    async def cached(self, name: str = "items", **options: Any) -> AsyncCachedCollection:
        return await async_ready_collection(self.manager, self.db_name, name, **options)


@pytest.fixture
async def ctx(client, async_client, db_name, async_manager, make_async_manager) -> AsyncIterator[Ctx]:
    client[db_name].items.insert_many(
        [
            {"_id": 1, "v": "one"},
            {"_id": 2, "v": "two"},
            {"_id": {"a": 1}, "v": "document id"},
            {"_id": Decimal128("1.5"), "v": "decimal id"},
        ]
    )
    async with contextlib.AsyncExitStack() as stack:
        yield Ctx(client, async_client, db_name, async_manager, make_async_manager, stack)


Read = Callable[[], Awaitable[Any]]
# A case builds (manager, read through the cache, the same read by PyMongo).
Build = Callable[[Ctx], Awaitable[tuple[AsyncCacheManager, Read, Read]]]


@dataclasses.dataclass(frozen=True)
class Case:
    reason: BypassReason
    variant: str
    build: Build
    #: Cache lookups that miss before the bypass is decided (see the sync suite).
    misses: int = 0

    @property
    def id(self) -> str:
        return f"{self.reason.value}-{self.variant}"


def _read(
    method: str, *args: Any, name: str = "items", options: dict[str, Any] | None = None, **kwargs: Any
) -> Build:
    """The case "await method(*args, **kwargs)" on collection ``name``."""

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
    """The case "(await method(*args, **kwargs)).to_list()" (find or aggregate)."""

    async def build(ctx: Ctx) -> Any:
        cached, raw = await ctx.cached(), ctx.raw()

        async def call(coll: Any) -> Any:
            result = getattr(coll, method)(*args, **kwargs)
            if method != "find":
                result = await result  # aggregate is a coroutine; find is not
            return await result.to_list()

        return ctx.manager, lambda: call(cached), lambda: call(raw)

    return build


async def _namespace_unavailable(ctx: Ctx) -> Any:
    # "db.coll" longer than 255 bytes does not fit the arena's namespace table.
    name = "n" * (256 - len(ctx.db_name))
    cached = ctx.manager[ctx.db_name][name]
    raw = ctx.raw(name)
    return ctx.manager, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


async def _stream_unhealthy(ctx: Ctx) -> Any:
    # The followers connect to a port nothing listens on; the client (so the
    # bypassed read) uses the real server.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cache = ctx.make_manager(stream_uri=f"mongodb://127.0.0.1:{port}/?directConnection=true")
    cached = cache[ctx.db_name]["items"]
    assert not await cache.wait_ready(0.3, database=ctx.db_name)
    raw = ctx.raw()
    return cache, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


async def _view(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return await _find_one({"_id": 1}, name="items_view")(ctx)


async def _system_collection(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return await _find_one({"_id": f"{ctx.db_name}.items_view"}, name="system.views")(ctx)


async def _session(ctx: Ctx) -> Any:
    session = await ctx.stack.enter_async_context(ctx.async_client.start_session())
    cached, raw = await ctx.cached(), ctx.raw()
    return (
        ctx.manager,
        lambda: cached.find_one({"_id": 1}, session=session),
        lambda: raw.find_one({"_id": 1}, session=session),
    )


async def _bound_session(ctx: Ctx) -> Any:
    session = await ctx.stack.enter_async_context(ctx.async_client.start_session())
    cached, raw = await ctx.cached(), ctx.raw()

    async def bound(coll: Any) -> Any:
        async with session.bind(end_session=False):
            return await coll.find_one({"_id": 1})

    return ctx.manager, lambda: bound(cached), lambda: bound(raw)


async def _stream_behind(ctx: Ctx) -> Any:
    cached, raw = await ctx.cached(), ctx.raw()
    ahead = Timestamp(2**32 - 1, 0)  # a token no stream has applied

    async def read() -> Any:
        with ctx.manager.after(ahead):
            return await cached.find_one({"_id": 1})

    return ctx.manager, read, lambda: raw.find_one({"_id": 1})


CASES = [
    Case(BypassReason.NAMESPACE_UNAVAILABLE, "long_name", _namespace_unavailable),
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


#: Reasons only a shared-cache worker can have (as in test_find_one_cache.py);
#: tests/test_shared_cache.py reaches them.
SHARED_ONLY_REASONS = {BypassReason.OWNER_UNAVAILABLE}


def test_every_bypass_reason_has_an_async_case():
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


async def test_attribute_access_on_a_cached_database_returns_a_cached_collection(
    async_manager, client, db_name
):
    client[db_name].items.insert_one({"_id": 1})
    await async_ready_collection(async_manager, db_name, "items")
    coll = async_manager[db_name].items
    assert isinstance(coll, AsyncCachedCollection)
    await _cache_twice(async_manager, coll, 1, {"_id": 1})


async def test_get_cached_collection_wraps_a_collection_of_its_async_client(
    async_manager, async_client, client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = async_manager.get_cached_collection(async_client[db_name]["items"])
    assert isinstance(coll, AsyncCachedCollection)
    assert coll.raw is not None and coll.full_name == f"{db_name}.items"
    assert await async_manager.wait_ready(15, database=db_name)
    await _cache_twice(async_manager, coll, 1, {"_id": 1, "v": 1})
