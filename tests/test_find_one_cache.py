"""find_one by _id through the cache: hits, keys, invalidation, admission,
memory bounds, and every reason a read bypasses the cache."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
from collections.abc import Callable, Iterator
from typing import Any

import bson
import pymongo
import pytest
from bson.codec_options import CodecOptions
from bson.decimal128 import Decimal128
from bson.raw_bson import RawBSONDocument
from bson.son import SON
from bson.timestamp import Timestamp
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from client_query_cache import BypassReason, CachedCollection, CacheManager
from support import ARGUMENT_BYPASSES, bypass_delta, outcome, ready_collection, stream_of, wait_until


def _by_id(coll: Any, _id: Any) -> Any:
    return coll.find_one({"_id": _id})


# -- hits -----------------------------------------------------------------------


def test_a_hit_after_a_miss_returns_an_equal_but_independent_object(manager, client, db_name):
    stored = {"_id": 1, "name": "one", "tags": ["a", "b"], "nested": {"n": 1}}
    client[db_name].items.insert_one(dict(stored))
    coll = ready_collection(manager, db_name, "items")
    before = manager.snapshot()

    first = _by_id(coll, 1)  # miss, admitted
    second = _by_id(coll, 1)  # hit
    first["name"] = "changed"
    first["tags"].append("c")
    first["nested"]["n"] = 2
    third = _by_id(coll, 1)  # hit

    after = manager.snapshot()
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
def test_a_hit_is_decoded_with_the_reading_collections_codec_options(
    manager, client, db_name, codec_options
):
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123000)
    client[db_name].items.insert_one({"_id": 1, "when": when, "nested": {"n": 1}})
    plain = ready_collection(manager, db_name, "items")
    assert _by_id(plain, 1) == {"_id": 1, "when": when, "nested": {"n": 1}}  # admitted
    special = manager[db_name].get_collection("items", codec_options=codec_options)
    direct = client[db_name].get_collection("items", codec_options=codec_options)
    hits = manager.snapshot().hits

    got = _by_id(special, 1)

    assert manager.snapshot().hits == hits + 1
    expected = _by_id(direct, 1)
    assert type(got) is type(expected) is codec_options.document_class
    assert got == expected
    if codec_options.document_class is not RawBSONDocument:
        assert type(got["nested"]) is codec_options.document_class
        assert got["when"] == expected["when"]
        assert got["when"].tzinfo == expected["when"].tzinfo
    # The entry itself is unchanged: the default collection still gets a dict.
    again = _by_id(plain, 1)
    assert type(again) is dict and again["when"].tzinfo is None


def test_projection_is_part_of_the_key(manager, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "a": 1, "b": 2})
    coll = ready_collection(manager, db_name, "items")
    before = manager.snapshot()

    whole = coll.find_one({"_id": 1})
    part = coll.find_one({"_id": 1}, {"a": 1})
    after_misses = manager.snapshot()
    whole_again = coll.find_one({"_id": 1})
    part_again = coll.find_one({"_id": 1}, projection={"a": 1})

    after = manager.snapshot()
    assert whole == whole_again == {"_id": 1, "a": 1, "b": 2}
    assert part == part_again == {"_id": 1, "a": 1}
    assert after_misses.admissions == before.admissions + 2
    assert after.hits == after_misses.hits + 2
    assert after.entries == before.entries + 2


def test_not_found_is_cached_and_invalidated_by_an_insert_of_that_id(
    manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": "present"})
    coll = ready_collection(manager, db_name, "items")
    before = manager.snapshot()

    assert _by_id(coll, "missing") is None  # miss: "not found" admitted
    assert _by_id(coll, "missing") is None  # hit
    cached = manager.snapshot()
    assert cached.admissions == before.admissions + 1
    assert cached.hits == before.hits + 1

    other_client[db_name].items.insert_one({"_id": "missing", "v": 1})
    wait_until(
        lambda: _by_id(coll, "missing") == {"_id": "missing", "v": 1},
        what="the inserted document replaces the cached 'not found'",
    )


_WRITES: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "update": (lambda c: c.update_one({"_id": 1}, {"$set": {"v": 2}}), {"_id": 1, "v": 2}),
    "replace": (lambda c: c.replace_one({"_id": 1}, {"w": "new"}), {"_id": 1, "w": "new"}),
    "delete": (lambda c: c.delete_one({"_id": 1}), None),
}


@pytest.mark.parametrize("write", sorted(_WRITES))
def test_a_write_by_another_client_invalidates_the_cached_document(
    manager, client, other_client, db_name, write
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(manager, db_name, "items")
    assert _by_id(coll, 1) == {"_id": 1, "v": 1}
    hits = manager.snapshot().hits
    assert _by_id(coll, 1) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == hits + 1  # it really was cached

    do_write, expected = _WRITES[write]
    do_write(other_client[db_name].items)

    wait_until(lambda: _by_id(coll, 1) == expected, what=f"the {write} reaches the cache")
    # The new version is cached in its turn.
    assert _by_id(coll, 1) == expected
    hits = manager.snapshot().hits
    assert _by_id(coll, 1) == expected
    assert manager.snapshot().hits == hits + 1


def test_an_integral_double_id_is_cached_for_int_reads_and_invalidated_through_the_double(
    manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1.0, "v": "first"})
    coll = ready_collection(manager, db_name, "items")
    first = _by_id(coll, 1)
    assert first == {"_id": 1.0, "v": "first"} and type(first["_id"]) is float
    hits = manager.snapshot().hits
    assert _by_id(coll, 1) == {"_id": 1.0, "v": "first"}
    assert manager.snapshot().hits == hits + 1

    other_client[db_name].items.update_one({"_id": 1.0}, {"$set": {"v": "second"}})

    wait_until(
        lambda: _by_id(coll, 1) == {"_id": 1.0, "v": "second"},
        what="a write to _id 1.0 invalidates the entry read as _id 1",
    )


def test_find_one_by_value_is_cached_like_an_id_filter(manager, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": 5, "v": "five"})
    coll = ready_collection(manager, db_name, "items")
    before = manager.snapshot()

    assert coll.find_one(5) == {"_id": 5, "v": "five"}  # miss
    assert coll.find_one(5) == {"_id": 5, "v": "five"}  # hit
    assert coll.find_one({"_id": 5}) == {"_id": 5, "v": "five"}  # same entry: hit
    after = manager.snapshot()
    assert after.admissions == before.admissions + 1
    assert after.hits == before.hits + 2
    assert after.bypass_total == before.bypass_total

    other_client[db_name].items.update_one({"_id": 5}, {"$set": {"v": "cinq"}})
    wait_until(lambda: coll.find_one(5) == {"_id": 5, "v": "cinq"}, what="the update is seen")


# -- namespace events -----------------------------------------------------------


def _cache_twice(manager: CacheManager, coll: CachedCollection, _id: Any, expected: Any) -> None:
    """Read _id twice and check that the second read was a hit."""
    assert _by_id(coll, _id) == expected
    hits = manager.snapshot().hits
    assert _by_id(coll, _id) == expected
    assert manager.snapshot().hits == hits + 1


def test_dropping_the_collection_invalidates_its_entries(manager, client, other_client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    coll = ready_collection(manager, db_name, "items")
    _cache_twice(manager, coll, 1, {"_id": 1, "v": 1})

    other_client[db_name].drop_collection("items")

    wait_until(lambda: _by_id(coll, 1) is None, what="the drop reaches the cache")


def test_dropping_the_database_invalidates_its_entries_and_caching_resumes(
    manager, client, other_client, db_name
):
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    client[db_name].more.insert_one({"_id": 1, "w": 1})
    items = ready_collection(manager, db_name, "items")
    more = ready_collection(manager, db_name, "more")
    _cache_twice(manager, items, 1, {"_id": 1, "v": 1})
    _cache_twice(manager, more, 1, {"_id": 1, "w": 1})

    other_client.drop_database(db_name)

    wait_until(
        lambda: _by_id(items, 1) is None and _by_id(more, 1) is None,
        what="dropDatabase reaches the cache",
    )
    # The stream goes on after the database's invalidate event.
    other_client[db_name].items.insert_one({"_id": 1, "v": "again"})
    wait_until(lambda: _by_id(items, 1) == {"_id": 1, "v": "again"}, what="the new insert is seen")
    wait_until(lambda: manager.wait_ready(0, database=db_name), what="the stream serves again")
    _cache_twice(manager, items, 1, {"_id": 1, "v": "again"})


def test_rename_invalidates_the_source_and_the_target(manager, client, other_client, db_name):
    client[db_name].src.insert_one({"_id": 1, "v": "from src"})
    client[db_name].dst.insert_one({"_id": 1, "v": "from dst"})
    src = ready_collection(manager, db_name, "src")
    dst = ready_collection(manager, db_name, "dst")
    _cache_twice(manager, src, 1, {"_id": 1, "v": "from src"})
    _cache_twice(manager, dst, 1, {"_id": 1, "v": "from dst"})

    other_client[db_name].src.rename("dst", dropTarget=True)

    wait_until(
        lambda: _by_id(src, 1) is None and _by_id(dst, 1) == {"_id": 1, "v": "from src"},
        what="the rename reaches both namespaces",
    )


def test_a_collection_created_after_a_missing_read_is_cached(manager, client, other_client, db_name):
    coll = ready_collection(manager, db_name, "later")
    before = manager.snapshot()
    assert _by_id(coll, 1) is None
    assert manager.snapshot().bypasses.get("missing_collection", 0) == (
        before.bypasses.get("missing_collection", 0) + 1
    )

    other_client[db_name].later.insert_one({"_id": 1, "v": 1})

    wait_until(lambda: _by_id(coll, 1) == {"_id": 1, "v": 1}, what="the new collection is read")
    _cache_twice(manager, coll, 1, {"_id": 1, "v": 1})


def test_a_collection_recreated_with_a_collation_is_read_under_it(manager, client, other_client, db_name):
    client[db_name].items.insert_many([{"_id": "a", "v": "simple"}, {"_id": "z", "v": 0}])
    coll = ready_collection(manager, db_name, "items")
    _cache_twice(manager, coll, "a", {"_id": "a", "v": "simple"})

    other_client[db_name].drop_collection("items")
    ci = other_client[db_name].create_collection("items", collation={"locale": "en", "strength": 2})
    ci.insert_many([{"_id": "a", "v": "collated"}, {"_id": "z", "v": 0}])

    wait_until(lambda: _by_id(coll, "a") == {"_id": "a", "v": "collated"}, what="the new collection is read")
    _cache_twice(manager, coll, "a", {"_id": "a", "v": "collated"})
    # Under a collation {"_id": "a"} may match other documents: its entry is
    # validated by the namespace, and a write to another document reaches it.
    events = stream_of(manager, db_name).events
    ci.update_one({"_id": "z"}, {"$set": {"v": 1}})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the update reaches the cache")
    misses = manager.snapshot().misses
    assert _by_id(coll, "a") == {"_id": "a", "v": "collated"}
    assert manager.snapshot().misses == misses + 1


# -- admission and memory -------------------------------------------------------


def test_an_oversized_document_is_returned_but_not_cached(make_manager, client, db_name):
    cache = make_manager(max_entry_bytes=1024)
    big = {"_id": "big", "payload": "x" * 4096}
    small = {"_id": "small", "payload": "y" * 16}
    client[db_name].items.insert_many([big, small])
    coll = ready_collection(cache, db_name, "items")
    before = cache.snapshot()

    assert _by_id(coll, "big") == big
    assert _by_id(coll, "big") == big

    after = cache.snapshot()
    assert after.rejected_admissions.get("oversize", 0) == before.rejected_admissions.get("oversize", 0) + 2
    assert after.entries == before.entries
    assert after.admissions == before.admissions
    assert after.hits == before.hits
    # A document under the limit is cached by the same manager.
    _cache_twice(cache, coll, "small", small)


def test_used_bytes_never_exceed_the_budget_while_admitting_more_than_fits(
    make_manager, client, db_name
):
    budget = 256 * 1024
    cache = make_manager(budget_bytes=budget, max_entry_bytes=budget // 4)
    count, payload = 200, "p" * 4000  # ~800 KiB of documents
    client[db_name].items.insert_many([{"_id": i, "payload": payload} for i in range(count)])
    coll = ready_collection(cache, db_name, "items")
    start = cache.snapshot()
    assert start.budget_bytes == budget

    for i in range(count):
        assert _by_id(coll, i) == {"_id": i, "payload": payload}
        snap = cache.snapshot()
        assert snap.admissions == start.admissions + i + 1, snap
        assert 0 < snap.used_bytes <= snap.budget_bytes, snap

    assert snap.evictions > 0
    assert (snap.admissions - start.admissions) * len(payload) > 3 * budget
    # The most recent document is still cached; the first one was evicted and
    # is read again from MongoDB, correctly.
    _cache_twice(cache, coll, count - 1, {"_id": count - 1, "payload": payload})
    misses = cache.snapshot().misses
    assert _by_id(coll, 0) == {"_id": 0, "payload": payload}
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
def test_a_write_racing_a_miss_is_not_admitted(manager, client, other_client, db_name, race):
    initial, write, racing_result, final = _RACING_WRITES[race]
    client[db_name].items.insert_many(initial)
    coll = ready_collection(manager, db_name, "items")
    fired = []

    def write_and_wait_for_the_stream() -> None:
        fired.append(True)
        manager._engine.hooks.before_admit = None
        events = stream_of(manager, db_name).events
        write(other_client[db_name].items)
        wait_until(
            lambda: stream_of(manager, db_name).events > events,
            what="the stream applies the racing write",
        )

    manager._engine.hooks.before_admit = write_and_wait_for_the_stream
    before = manager.snapshot()

    assert _by_id(coll, 1) == racing_result  # read before the write landed

    after = manager.snapshot()
    assert fired == [True]
    assert after.rejected_admissions.get("stale", 0) == before.rejected_admissions.get("stale", 0) + 1
    assert after.admissions == before.admissions
    assert _by_id(coll, 1) == final
    assert manager.snapshot().hits == after.hits  # that was a miss, not a stale hit


def _hold_back_one_admission(manager: CacheManager) -> list[tuple[Any, bytes, bytes | None]]:
    """Make the next miss record (plan, token, BSON result) instead of admitting."""
    engine = manager._engine
    held: list[tuple[Any, bytes, bytes | None]] = []
    real_admit = engine.admit

    def hold(plan: Any, token: bytes, value: bytes | None, rebind: bool = False, memo_floor: int = 0) -> None:
        held.append((plan, token, value))
        engine.admit = real_admit  # only this one

    engine.admit = hold
    return held


@pytest.mark.parametrize("older_first", [True, False], ids=["older-first", "newer-first"])
def test_reads_under_one_generation_with_different_results_are_never_served(
    manager, client, other_client, db_name, older_first
):
    # Misses captured under the same generations that read different bytes
    # straddle a write whose event is not applied yet. Whatever the order of
    # their admissions, none may be served: serving the older after the newer
    # was returned would read backwards. A third admission under the same
    # generations (either version) is refused too, until the write's event
    # moves them on.
    client[db_name].items.insert_one({"_id": 1, "v": "old"})
    coll = ready_collection(manager, db_name, "items")
    held = _hold_back_one_admission(manager)
    assert _by_id(coll, 1) == {"_id": 1, "v": "old"}
    ((plan, token, older),) = held
    newer = bson.encode({"_id": 1, "v": "new"})
    before = manager.snapshot()

    for raw in (older, newer, older, newer) if older_first else (newer, older, newer, older):
        manager._engine.admit(plan, token, raw)

    after = manager.snapshot()
    assert after.admissions == before.admissions + 1
    assert after.rejected_admissions.get("conflict", 0) == before.rejected_admissions.get("conflict", 0) + 3
    # The server still holds "old" (the "new" read was simulated): reads go
    # to it, and their admissions are refused as well.
    assert _by_id(coll, 1) == {"_id": 1, "v": "old"}
    assert _by_id(coll, 1) == {"_id": 1, "v": "old"}
    snap = manager.snapshot()
    assert snap.misses == after.misses + 2
    assert snap.hits == after.hits
    assert snap.rejected_admissions["conflict"] == after.rejected_admissions["conflict"] + 2

    # Once a write's event moves the generation on, the document is cached
    # again. (Reads go to the server until then, so seeing "newest" does not
    # mean the event has arrived: wait for the event itself.)
    events = stream_of(manager, db_name).events
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": "newest"}})
    wait_until(lambda: stream_of(manager, db_name).events > events, what="the update reaches the cache")
    _cache_twice(manager, coll, 1, {"_id": 1, "v": "newest"})


def test_the_same_result_admitted_twice_under_one_generation_stays_cached(manager, client, db_name):
    client[db_name].items.insert_one({"_id": 1, "v": "old"})
    coll = ready_collection(manager, db_name, "items")
    held = _hold_back_one_admission(manager)
    assert _by_id(coll, 1) == {"_id": 1, "v": "old"}
    ((plan, token, value),) = held

    manager._engine.admit(plan, token, value)
    manager._engine.admit(plan, token, bytes(value))

    snap = manager.snapshot()
    assert snap.rejected_admissions.get("conflict", 0) == 0
    assert _by_id(coll, 1) == {"_id": 1, "v": "old"}
    assert manager.snapshot().hits == snap.hits + 1


# -- bypass reasons -------------------------------------------------------------


@dataclasses.dataclass
class Ctx:
    """What a bypass case needs; cleanups run at teardown."""

    client: pymongo.MongoClient
    db_name: str
    manager: CacheManager
    make_manager: Callable[..., CacheManager]
    stack: contextlib.ExitStack

    def raw(self, name: str = "items", **options: Any) -> Any:
        return self.client[self.db_name].get_collection(name, **options)

    def cached(self, name: str = "items", **options: Any) -> CachedCollection:
        return ready_collection(self.manager, self.db_name, name, **options)


@pytest.fixture
def ctx(client, db_name, manager, make_manager) -> Iterator[Ctx]:
    client[db_name].items.insert_many(
        [
            {"_id": 1, "v": "one"},
            {"_id": 2, "v": "two"},
            {"_id": {"a": 1}, "v": "document id"},
            {"_id": Decimal128("1.5"), "v": "decimal id"},
        ]
    )
    with contextlib.ExitStack() as stack:
        yield Ctx(client, db_name, manager, make_manager, stack)


# A case builds (manager, read through the cache, the same read by PyMongo).
Build = Callable[[Ctx], tuple[CacheManager, Callable[[], Any], Callable[[], Any]]]


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

    def build(ctx: Ctx) -> Any:
        cached = ctx.cached(name, **(options or {}))
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
    """The case "list(method(*args, **kwargs))" (find or aggregate)."""

    def build(ctx: Ctx) -> Any:
        cached, raw = ctx.cached(), ctx.raw()

        def call(coll: Any) -> Any:
            return list(getattr(coll, method)(*args, **kwargs))

        return ctx.manager, lambda: call(cached), lambda: call(raw)

    return build


def _namespace_unavailable(ctx: Ctx) -> Any:
    # "db.coll" longer than 255 bytes does not fit the arena's namespace table.
    name = "n" * (256 - len(ctx.db_name))
    cached = ctx.manager[ctx.db_name][name]
    raw = ctx.raw(name)
    return ctx.manager, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


def _stream_unhealthy(ctx: Ctx) -> Any:
    # The followers connect to a port nothing listens on, while the client
    # (and so every miss and bypass) reads the real server: the stream never
    # becomes healthy.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cache = ctx.make_manager(stream_uri=f"mongodb://127.0.0.1:{port}/?directConnection=true")
    cached = cache[ctx.db_name]["items"]
    assert not cache.wait_ready(0.3, database=ctx.db_name)
    raw = ctx.raw()
    return cache, lambda: cached.find_one({"_id": 1}), lambda: raw.find_one({"_id": 1})


def _view(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return _find_one({"_id": 1}, name="items_view")(ctx)


def _system_collection(ctx: Ctx) -> Any:
    ctx.client[ctx.db_name].command("create", "items_view", viewOn="items", pipeline=[])
    return _find_one({"_id": f"{ctx.db_name}.items_view"}, name="system.views")(ctx)


def _session(ctx: Ctx) -> Any:
    session = ctx.stack.enter_context(ctx.client.start_session())
    cached, raw = ctx.cached(), ctx.raw()
    return (
        ctx.manager,
        lambda: cached.find_one({"_id": 1}, session=session),
        lambda: raw.find_one({"_id": 1}, session=session),
    )


def _bound_session(ctx: Ctx) -> Any:
    session = ctx.stack.enter_context(ctx.client.start_session())
    cached, raw = ctx.cached(), ctx.raw()

    def bound(coll: Any) -> Any:
        with session.bind(end_session=False):
            return coll.find_one({"_id": 1})

    return ctx.manager, lambda: bound(cached), lambda: bound(raw)


def _stream_behind(ctx: Ctx) -> Any:
    cached, raw = ctx.cached(), ctx.raw()
    ahead = Timestamp(2**32 - 1, 0)  # a token no stream has applied

    def read() -> Any:
        with ctx.manager.after(ahead):
            return cached.find_one({"_id": 1})

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


#: Reasons only a shared-cache worker can have; tests/test_shared_cache.py
#: reaches them.
SHARED_ONLY_REASONS = {BypassReason.OWNER_UNAVAILABLE}


def test_every_bypass_reason_has_a_case():
    assert {case.reason for case in CASES} == set(BypassReason) - SHARED_ONLY_REASONS


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_a_bypassed_read_counts_its_reason_and_behaves_like_pymongo(ctx, case):
    cache, through_cache, direct = case.build(ctx)
    before = cache.snapshot()

    got = outcome(through_cache)

    after = cache.snapshot()
    expected = outcome(direct)
    assert bypass_delta(dict(before.bypasses), dict(after.bypasses)) == {case.reason.value: 1}
    assert after.admissions == before.admissions
    assert after.hits == before.hits
    assert after.misses == before.misses + case.misses
    assert got == expected


def test_attribute_access_on_a_cached_database_returns_a_cached_collection(manager, client, db_name):
    client[db_name].items.insert_one({"_id": 1})
    ready_collection(manager, db_name, "items")
    coll = manager[db_name].items
    assert isinstance(coll, CachedCollection)
    assert _by_id(coll, 1) == {"_id": 1}
    hits = manager.snapshot().hits
    assert _by_id(coll, 1) == {"_id": 1}
    assert manager.snapshot().hits == hits + 1
