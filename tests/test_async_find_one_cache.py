"""What only the async facade promises for find_one and find (the behaviours
both facades share are tested once, with each API, in test_find_one_cache.py):
a hit completes without suspending the event loop, and ``find`` returns an
async cursor (``async for``, ``to_list``).

Documents are seeded with the sync ``client``; reads go through an
``AsyncMongoClient``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import pytest

from client_query_cache import AsyncCachedCursor
from support import async_ready_collection, async_wait_until, stream_passed_now


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
        if attempt == "hit":
            # Each miss read the collection after the ones before it: their
            # entries wait for the stream to pass the last one (the floor).
            await async_wait_until(stream_passed_now(async_manager, db_name), what="the stream passes the misses")
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
