"""The eviction policy (S3-FIFO, docs/architecture.md), checked from outside:
what stays cached when more is read than the budget holds.

* Entries read again and again survive a scan of documents read once, which
  first-in-first-out eviction lets push them out.
* Entries of a collection that is written as fast as it is read die where
  they were admitted and are reclaimed there; another collection's hot
  entries stay.
* ``snapshot()`` tells live bytes from dead ones.
* A worker that writes anything into its access map (the memory its hits
  mark, at the end of its ring segment) can make eviction choose worse,
  and nothing else: every read stays exact and the owner keeps serving.

Each runs process-local and shared (an owner and an in-process worker).
"""

from __future__ import annotations

import mmap
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from client_query_cache import CacheManager, SharedCache
from support import TEST_MAX_AWAIT_MS, ready_collection, served, wait_until

BUDGET = 256 * 1024
PAYLOAD = 2000  # about 2.1 KiB an entry: some 110 fit the budget
SLOTS = 1024


@pytest.fixture(params=["local", "shared"])
def cache(request: pytest.FixtureRequest, client: pymongo.MongoClient, server_uri: str,
          runtime_dir: Path) -> Iterator[tuple[CacheManager, Callable[[], dict[str, Any]], str]]:
    """A manager with a 256 KiB budget, a function returning the writer's
    counters (the manager's snapshot, or the owner's), and the mode."""
    if request.param == "local":
        manager = CacheManager(client, budget_bytes=BUDGET, max_await_time_ms=TEST_MAX_AWAIT_MS)
        try:
            yield manager, lambda: _fields(manager.snapshot()), "local"
        finally:
            manager.close()
        return
    name = f"cqc-{uuid.uuid4().hex[:12]}"
    owner = SharedCache.start(name, server_uri, budget_bytes=BUDGET, slots=SLOTS,
                              max_entry_bytes=BUDGET // 4, max_await_time_ms=TEST_MAX_AWAIT_MS)
    manager = CacheManager(client, shared=name, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        yield manager, owner.snapshot, "shared"
    finally:
        manager.close()
        owner.stop(timeout=10)


def _fields(snap: Any) -> dict[str, Any]:
    return {name: getattr(snap, name) for name in (
        "entries", "used_bytes", "live_bytes", "dead_bytes", "evictions", "promotions",
        "reinsertions", "reclaimed", "admissions")} | {"admissions_accepted": snap.admissions}


def _docs(start: int, count: int) -> list[dict[str, Any]]:
    return [{"_id": i, "p": f"{i:08d}" + "p" * PAYLOAD} for i in range(start, start + count)]


def _read_all(coll: Any, docs: list[dict[str, Any]], times: int = 1) -> None:
    for doc in docs:
        for _ in range(times):
            assert coll.find_one({"_id": doc["_id"]}) == doc


def _settle(counters: Callable[[], dict[str, Any]], manager: CacheManager) -> None:
    """Wait until the writer's admissions stop moving: a worker's go through
    its ring, which the owner drains every 10 ms at most."""
    seen: list[int] = []

    def still() -> bool:
        seen.append(counters()["admissions_accepted"])
        time.sleep(0.03)
        return len(seen) >= 4 and seen[-1] == seen[-2] == seen[-3] == seen[-4]

    wait_until(still, what="the admissions are applied")


def _read_hot(coll: Any, counters: Callable[[], dict[str, Any]], docs: list[dict[str, Any]]) -> None:
    """Read each document, wait until its admission is applied (a worker's
    goes through its ring), then read it twice more: two hits."""
    for doc in docs:
        before = counters()["admissions_accepted"]
        _read_all(coll, [doc])
        wait_until(lambda: counters()["admissions_accepted"] > before, what="the admission is applied")
        _read_all(coll, [doc], times=2)


def _hits_of(manager: CacheManager, coll: Any, docs: list[dict[str, Any]]) -> int:
    before = manager.snapshot().hits
    _read_all(coll, docs)
    return manager.snapshot().hits - before


def test_entries_read_again_survive_a_scan_of_documents_read_once(cache, client, db_name):
    manager, counters, mode = cache
    cold, hot, scan = _docs(0, 300), _docs(1000, 30), _docs(2000, 600)
    client[db_name].items.insert_many(cold + hot + scan)
    coll = ready_collection(manager, db_name, "items")

    _read_all(coll, cold)  # fills the cache with entries nobody reads again
    _settle(counters, manager)
    _read_hot(coll, counters, hot)  # each read three times: a miss, then two hits
    _read_all(coll, scan)  # twice the budget of documents read once
    _settle(counters, manager)

    hits = _hits_of(manager, coll, hot)
    after = counters()
    # First in, first out keeps none of them: every scanned document was
    # admitted after them, and the scan alone is twice the budget.
    assert hits >= 27, (mode, hits, {k: v for k, v in after.items() if k != "streams"})
    assert after["promotions"] > 0 and after["evictions"] > 0, after


def test_a_written_collection_does_not_push_out_another_collections_hot_entries(cache, client, server_uri, db_name):
    manager, counters, mode = cache
    # The written collection in a database of its own, so that the causal
    # floor never holds back the hot collection's hits for its writes.
    written_db = f"{db_name}_w"
    hot, churn = _docs(0, 30), _docs(1000, 200)
    client[db_name].hot.insert_many(hot)
    client[written_db].churn.insert_many(churn)
    hot_coll = ready_collection(manager, db_name, "hot")
    churn_coll = ready_collection(manager, written_db, "churn")
    # Another client writes: its writes reach this cache through the change
    # stream, so a read may return a document's previous version until then.
    writer = pymongo.MongoClient(server_uri)
    raw = writer[written_db].churn
    versions: dict[int, set[int | None]] = {doc["_id"]: {None} for doc in churn}
    try:
        _read_hot(hot_coll, counters, hot)
        _settle(counters, manager)
        rng = random.Random(33)
        hot_misses = 0
        for step in range(900):  # about seven budgets of entries that die young
            doc = churn[rng.randrange(len(churn))]
            got = churn_coll.find_one({"_id": doc["_id"]})
            assert got is not None and got["p"] == doc["p"] and got.get("n") in versions[doc["_id"]], got
            if step % 2:
                versions[doc["_id"]].add(step)
                raw.update_one({"_id": doc["_id"]}, {"$set": {"n": step}})
            # The hot collection is read on, a document every step.
            hot_misses += 1 - _hits_of(manager, hot_coll, [hot[step % len(hot)]])
        after = counters()
        # First in, first out evicts a hot entry once about a budget of
        # churn has been admitted after it: there a quarter of these reads
        # miss.
        assert hot_misses <= 900 // 20, (mode, hot_misses, {k: v for k, v in after.items() if k != "streams"})
        assert after["reclaimed"] > 0, after
    finally:
        writer.close()
        client.drop_database(written_db)


def test_snapshot_tells_live_bytes_from_dead_ones(cache, client, db_name):
    manager, counters, mode = cache
    docs = _docs(0, 60)
    client[db_name].items.insert_many(docs)
    coll = ready_collection(manager, db_name, "items")
    _read_all(coll, docs)
    _settle(counters, manager)
    held = counters()
    assert held["live_bytes"] == held["used_bytes"] > 60 * PAYLOAD, held
    assert held["dead_bytes"] < 4096, held  # the ring's padding at most

    client[db_name].items.update_many({}, {"$set": {"x": 1}})
    dead = wait_until(lambda: (c := counters())["live_bytes"] == 0 and c,
                      what="every entry is invalidated")
    # Invalidation is O(1): the bytes stay until a tail reaches them.
    assert dead["dead_bytes"] >= held["live_bytes"], (mode, dead)
    assert dead["used_bytes"] == held["used_bytes"], dead
    if mode == "local":
        snap = manager.snapshot()
        assert snap.live_bytes == 0 and snap.dead_bytes == dead["dead_bytes"], snap


def test_a_scribbled_access_map_costs_hit_ratio_only(client, server_uri, runtime_dir, db_name):
    name = f"cqc-{uuid.uuid4().hex[:12]}"
    owner = SharedCache.start(name, server_uri, budget_bytes=BUDGET, slots=SLOTS,
                              max_entry_bytes=BUDGET // 4, max_await_time_ms=TEST_MAX_AWAIT_MS)
    manager = CacheManager(client, shared=name, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        docs = _docs(0, 400)
        client[db_name].items.insert_many(docs)
        coll = ready_collection(manager, db_name, "items")
        (ring,) = runtime_dir.glob(f"{name}.w{os.getpid()}-*.ring")
        rng = random.Random(7)
        with open(ring, "r+b") as f, mmap.mmap(f.fileno(), 0) as seg:
            map_off = len(seg) - SLOTS * 4  # the access map closes the segment (ring.h)
            for rounds in range(20):
                # Every cell: random values, then "hit three times" for the
                # block generations the owner hands out around now.
                for cell in range(SLOTS):
                    value = rng.getrandbits(32) if rounds % 2 else ((rounds * 97 + cell) << 2) | 3
                    seg[map_off + 4 * cell:map_off + 4 * cell + 4] = value.to_bytes(4, "little")
                for doc in rng.sample(docs, 60):
                    assert coll.find_one({"_id": doc["_id"]}) == doc
        _settle(owner.snapshot, manager)
        snap = owner.snapshot()
        assert snap["admissions_accepted"] > 0 and snap["used_bytes"] <= BUDGET, snap
        # The owner still admits and serves: a document read again becomes a
        # hit once its admission is applied.
        assert served(manager, lambda: coll.find_one({"_id": docs[0]["_id"]})) == docs[0]
    finally:
        manager.close()
        owner.stop(timeout=10)
