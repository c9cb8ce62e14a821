"""The shared cache across processes: one owner (``SharedCache.start``), worker
processes attached with ``CacheManager(client, shared=name)``.

Worker processes are started with the ``spawn`` method and driven through
queues (``Worker.call``), each answer awaited with a timeout so a hang fails
the test instead of blocking it. The test process itself is also used as a
worker where one in-process manager is enough. Every test gets its own
runtime directory (``CQC_RUNTIME_DIR``, inherited by the spawned children)
and its own shared-cache name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import queue
import random
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bson
import pymongo
import pytest

from client_query_cache import (
    BypassReason,
    CacheConfigurationError,
    CacheForkedError,
    CacheManager,
    SharedCache,
    SharedCacheConfig,
    SharedCacheError,
)
from client_query_cache._core.engine import NO_STAMP
from support import DEADLINE_S, TEST_MAX_AWAIT_MS, ready_collection, served, settled, wait_until

#: The bound the issue sets on how long workers keep serving from the arena of
#: an owner that died (its heartbeat timeout is shorter), and the slack a
#: loaded 2-core machine needs on top of it.
HEARTBEAT_BOUND_S = 1.0
SLACK_S = 0.5

#: Longest a test waits for a worker process's answer.
CALL_TIMEOUT_S = 30.0

_SPAWN = multiprocessing.get_context("spawn")

OWNER_UNAVAILABLE = BypassReason.OWNER_UNAVAILABLE.value


# =============================================================================
# Worker processes (top-level functions: the spawn method imports this module)
# =============================================================================


def _snapshot_dict(manager: CacheManager) -> dict[str, Any]:
    snap = manager.snapshot()
    data = dataclasses.asdict(snap)
    data["streams"] = [
        {"database": s.database, "state": s.state.value, "events": s.events} for s in snap.streams
    ]
    data["bypasses"] = dict(snap.bypasses)
    data["rejected_admissions"] = dict(snap.rejected_admissions)
    return data


def _events(manager: CacheManager, db: str) -> int:
    """Change events of ``db`` the owner has applied to the arena (as this
    worker reads them from the arena)."""
    return sum(s.events for s in manager.snapshot().streams if s.database == db)


def _version_loop(manager: CacheManager, db: str, coll_name: str, docs: int, baseline: int, stop: Any) -> dict[str, Any]:
    """Read documents ``0..docs-1`` (field ``version``) until ``stop`` is set.

    The writer's update j (1-based) sets document ``j % docs`` to version j,
    one at a time. So once the owner has applied E events of the run (its
    events counter minus ``baseline``), document d's version is at least the
    largest j <= E with j % docs == d: a read that starts after that and
    returns less is stale."""
    coll = manager[db][coll_name]
    last = [0] * docs
    stale: list[tuple[int, int, int, int]] = []
    backwards: list[tuple[int, int, int]] = []
    reads = 0
    while not stop.is_set():
        for d in range(docs):
            applied = _events(manager, db) - baseline
            bound = applied - ((applied - d) % docs) if applied >= d else 0
            doc = coll.find_one({"_id": d})
            version = doc["version"]
            reads += 1
            if version < bound:
                stale.append((d, version, bound, applied))
            if version < last[d]:
                backwards.append((d, last[d], version))
            last[d] = max(last[d], version)
    snap = manager.snapshot()
    return {
        "reads": reads,
        "stale": stale[:20],
        "stale_count": len(stale),
        "backwards": backwards[:20],
        "backwards_count": len(backwards),
        "hits": snap.hits,
        "misses": snap.misses,
    }


def _worker_command(manager: CacheManager, stop: Any, cmd: tuple[Any, ...]) -> Any:
    op = cmd[0]
    if op == "read":
        _, db, coll, doc_id = cmd
        return manager[db][coll].find_one({"_id": doc_id})
    if op == "snapshot":
        return _snapshot_dict(manager)
    if op == "wait_ready":
        return manager.wait_ready(DEADLINE_S, database=cmd[1])
    if op == "register":
        # Wrap db.coll (which registers it and starts the owner's stream of
        # db) and wait until that stream serves.
        _, db, coll = cmd
        manager[db][coll]
        if not manager.wait_ready(DEADLINE_S, database=db):
            raise AssertionError(f"the stream of {db} did not become ready: {manager.snapshot()!r}")
        return _snapshot_dict(manager)
    if op == "read_until":
        # Read until the result equals `expected`; return the seconds it took.
        _, db, coll, doc_id, expected, timeout = cmd
        coll_ = manager[db][coll]
        start = time.monotonic()
        while True:
            doc = coll_.find_one({"_id": doc_id})
            if doc == expected:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"still read {doc!r}, expected {expected!r}")
            time.sleep(0.005)
    if op == "read_until_owner_lost":
        # Read every 5 ms until a read bypasses because the owner is gone;
        # return CLOCK_MONOTONIC of that read and every distinct result seen.
        _, db, coll, doc_id, timeout = cmd
        coll_ = manager[db][coll]
        start = time.monotonic()
        seen: list[Any] = []
        while time.monotonic() - start < timeout:
            before = manager.snapshot().bypasses.get(OWNER_UNAVAILABLE, 0)
            doc = coll_.find_one({"_id": doc_id})
            if doc not in seen:
                seen.append(doc)
            if manager.snapshot().bypasses.get(OWNER_UNAVAILABLE, 0) > before:
                return {"at": time.monotonic(), "seen": seen}
            time.sleep(0.005)
        raise AssertionError(f"no owner_unavailable bypass within {timeout} s; seen {seen!r}")
    if op == "read_until_hit":
        # Read until a read is a hit; return the distinct results seen.
        _, db, coll, doc_id, timeout = cmd
        coll_ = manager[db][coll]
        start = time.monotonic()
        seen = []
        while time.monotonic() - start < timeout:
            before = manager.snapshot().hits
            doc = coll_.find_one({"_id": doc_id})
            if doc not in seen:
                seen.append(doc)
            if manager.snapshot().hits > before:
                return seen
            time.sleep(0.01)
        raise AssertionError(f"no hit within {timeout} s: {_snapshot_dict(manager)!r}")
    if op == "version_loop":
        _, db, coll, docs, baseline = cmd
        return _version_loop(manager, db, coll, docs, baseline, stop)
    if op == "check_loop":
        # Read documents 0..docs-1 in turn until `stop` is set, checking each
        # against _blob_doc; return the counts and the first wrong results.
        _, db, coll, docs = cmd
        coll_ = manager[db][coll]
        reads, wrong = 0, []
        while not stop.is_set():
            i = reads % docs
            doc = coll_.find_one({"_id": i})
            if doc != _blob_doc(i) and len(wrong) < 5:
                wrong.append((i, doc))
            reads += 1
        return {"reads": reads, "wrong": wrong, **_snapshot_dict(manager)}
    raise ValueError(f"unknown command {cmd!r}")


def _worker_main(uri: str, name: str, commands: Any, results: Any, stop: Any) -> None:
    """A worker process: attach to shared cache ``name``, then run commands
    from ``commands`` and answer each on ``results`` as ("ok", value) or
    ("error", traceback)."""
    try:
        client = pymongo.MongoClient(uri)
        manager = CacheManager(client, shared=name, max_await_time_ms=TEST_MAX_AWAIT_MS)
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready", os.getpid()))
    try:
        while True:
            cmd = commands.get()
            if cmd[0] == "exit":
                break
            try:
                results.put(("ok", _worker_command(manager, stop, cmd)))
            except BaseException:  # noqa: BLE001 - reported to the test
                results.put(("error", traceback.format_exc()))
    finally:
        manager.close()
        client.close()
        results.put(("closed", os.getpid()))


def _blob_doc(i: int) -> dict[str, Any]:
    return {"_id": i, "v": i, "blob": f"{i:05d}" * 400}


def _scribble_main(path: str, seconds: float, seed: int, results: Any) -> None:
    """Another process of the same user: write random bytes over a worker's
    ring file for ``seconds``, as fast as it can, into the header (both the
    producer's and the consumer's fields) and over the records at the start
    of the data area, where a drained ring keeps them."""
    rng = random.Random(seed)
    writes = 0
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                where = rng.random()
                if where < 0.4:
                    offset = rng.randrange(0, 128)
                elif where < 0.9:
                    offset = 128 + rng.randrange(0, 256 * 1024)
                else:
                    offset = rng.randrange(0, size)
                data = rng.randbytes(rng.randint(1, 16))
                os.pwrite(fd, data, min(offset, size - len(data)))
                writes += 1
        finally:
            os.close(fd)
        results.put(("ok", writes))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


def _writer_main(uri: str, db: str, coll: str, docs: int, count: int, pause: float, results: Any) -> None:
    """The writer process: update j (1..count) sets ``version`` of document
    ``j % docs`` to j, each acknowledged before the next."""
    try:
        with pymongo.MongoClient(uri) as client:
            target = client[db][coll]
            for j in range(1, count + 1):
                result = target.update_one({"_id": j % docs}, {"$set": {"version": j}})
                assert result.modified_count == 1, result.raw_result
                if pause:
                    time.sleep(pause)
        results.put(("ok", count))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


# =============================================================================
# Test-side handles
# =============================================================================


class Worker:
    """A spawned worker process and its command queues."""

    def __init__(self, uri: str, name: str, stop: Any) -> None:
        self.commands = _SPAWN.Queue()
        self.results = _SPAWN.Queue()
        self.process = _SPAWN.Process(
            target=_worker_main, args=(uri, name, self.commands, self.results, stop), daemon=True
        )
        self.process.start()
        self.pid = self.process.pid

    def _get(self, what: str, timeout: float) -> tuple[Any, Any]:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"worker {self.pid} did not answer {what} within {timeout:g} s "
                f"(alive: {self.process.is_alive()}, exit code: {self.process.exitcode})"
            ) from None

    def wait_attached(self, timeout: float = 60.0) -> None:
        kind, value = self._get("its start", timeout)
        if kind != "ready":
            raise AssertionError(f"worker {self.pid} could not attach:\n{value}")

    def send(self, *cmd: Any) -> None:
        self.commands.put(cmd)

    def result(self, what: str = "a command", timeout: float = CALL_TIMEOUT_S) -> Any:
        kind, value = self._get(what, timeout)
        if kind != "ok":
            raise AssertionError(f"worker {self.pid} failed {what}:\n{value}")
        return value

    def call(self, *cmd: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        self.send(*cmd)
        return self.result(repr(cmd), timeout)

    def read(self, db: str, coll: str, doc_id: Any) -> Any:
        return self.call("read", db, coll, doc_id)

    def snapshot(self) -> dict[str, Any]:
        return self.call("snapshot")

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self.commands.put(("exit",))
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        for q in (self.commands, self.results):
            q.close()
            q.cancel_join_thread()


class SharedGroup:
    """Owners, spawned workers and in-process managers of one test, all
    stopped at teardown (workers and managers first, then owners)."""

    def __init__(self, uri: str, runtime: Path) -> None:
        self.uri = uri
        self.runtime = runtime
        self.name = f"cqc-{uuid.uuid4().hex[:12]}"
        self.stop_event = _SPAWN.Event()
        self.owners: list[SharedCache] = []
        self.workers: list[Worker] = []
        self.managers: list[CacheManager] = []

    def start_owner(self, name: str | None = None, **options: Any) -> SharedCache:
        options.setdefault("max_await_time_ms", TEST_MAX_AWAIT_MS)
        owner = SharedCache.start(name or self.name, self.uri, **options)
        self.owners.append(owner)
        return owner

    def spawn(self, count: int = 1, name: str | None = None) -> list[Worker]:
        """Start ``count`` worker processes (concurrently) and wait until
        each attached."""
        started = []
        for _ in range(count):
            worker = Worker(self.uri, name or self.name, self.stop_event)
            self.workers.append(worker)
            started.append(worker)
        for worker in started:
            worker.wait_attached()
        return started

    def manager(self, client: pymongo.MongoClient, name: str | None = None) -> CacheManager:
        """An in-process worker manager over ``client``."""
        manager = CacheManager(client, shared=name or self.name, max_await_time_ms=TEST_MAX_AWAIT_MS)
        self.managers.append(manager)
        return manager

    def ring_files(self, pid: int | None = None) -> list[Path]:
        pattern = f"{self.name}.w*.ring" if pid is None else f"{self.name}.w{pid}-*.ring"
        return sorted(self.runtime.glob(pattern))

    def close(self) -> None:
        self.stop_event.set()  # ends any version_loop a failed test left running
        for manager in self.managers:
            with contextlib.suppress(Exception):
                manager.close()
        for worker in self.workers:
            worker.close()
        for owner in self.owners:
            with contextlib.suppress(ProcessLookupError):
                os.kill(owner.pid, signal.SIGCONT)  # a test may have paused it
            os.chmod(self.runtime, 0o700)  # a test may have opened it up
            owner.stop(timeout=10)


@pytest.fixture
def group(server_uri: str, runtime_dir: Path) -> Iterator[SharedGroup]:
    g = SharedGroup(server_uri, runtime_dir)
    try:
        yield g
    finally:
        g.close()


def owner_stream(owner: SharedCache, db: str) -> dict[str, Any]:
    streams = [s for s in owner.snapshot()["streams"] if s["database"] == db]
    assert len(streams) == 1, owner.snapshot()
    return streams[0]


def wait_events(owner: SharedCache, db: str, at_least: int) -> int:
    """Wait until the owner has applied ``at_least`` change events of ``db``."""
    def applied() -> int | None:
        events = owner_stream(owner, db)["events"]
        return events if events >= at_least else None

    return wait_until(applied, what=f"the owner applied {at_least} events of {db}")


def seed(client: pymongo.MongoClient, db: str, coll: str, docs: list[dict[str, Any]]) -> None:
    client[db][coll].insert_many(docs)


# =============================================================================
# Sharing hits and invalidations between workers
# =============================================================================


def test_a_document_admitted_by_one_worker_is_a_hit_in_another(group, client, db_name):
    seed(client, db_name, "items", [{"_id": 1, "v": "one"}])
    owner = group.start_owner()
    a, b = group.spawn(2)
    a.call("register", db_name, "items")
    b.call("register", db_name, "items")
    assert a.read(db_name, "items", 1) == {"_id": 1, "v": "one"}  # miss: A admits
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the owner applied A's admission")

    assert b.read(db_name, "items", 1) == {"_id": 1, "v": "one"}

    snap_a, snap_b = a.snapshot(), b.snapshot()
    assert (snap_a["hits"], snap_a["misses"]) == (0, 1), snap_a
    assert (snap_b["hits"], snap_b["misses"]) == (1, 0), snap_b
    group_snap = owner.snapshot()
    assert group_snap["admissions_accepted"] == 1
    assert group_snap["entries"] == 1


def test_a_write_invalidates_the_document_in_every_worker(group, client, other_client, db_name):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    owner = group.start_owner()
    workers = group.spawn(3)
    for w in workers:
        w.call("register", db_name, "items")
    workers[0].read(db_name, "items", 1)
    workers[0].read(db_name, "items", 2)
    wait_until(lambda: owner.snapshot()["entries"] == 2, what="both documents are admitted")
    for w in workers:
        assert w.read(db_name, "items", 1) == {"_id": 1, "v": 1}
    hits = [w.snapshot()["hits"] for w in workers]
    assert hits[1:] == [1, 1]
    events = owner_stream(owner, db_name)["events"]

    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 10}})
    wait_events(owner, db_name, events + 1)

    # The event is applied: every worker's next read sees the write.
    for w in workers:
        assert w.read(db_name, "items", 1) == {"_id": 1, "v": 10}
    group_snap = owner.snapshot()
    assert group_snap["invalidations"] >= 1
    # The other document's entry survived the write and is still shared
    # (served once the stream has applied what each worker's miss saw).
    for w in workers:
        before = w.snapshot()["hits"]
        wait_until(
            lambda: w.read(db_name, "items", 2) == {"_id": 2, "v": 2} and w.snapshot()["hits"] > before,
            what="the other document is served from the cache",
        )


def test_counts_distinct_and_generic_find_one_are_shared_and_invalidated(
    group, client, other_client, db_name
):
    seed(client, db_name, "items", [{"_id": i, "kind": "ab"[i % 2], "n": i} for i in range(6)])
    owner = group.start_owner()
    manager = group.manager(client)
    coll = manager[db_name]["items"]
    assert manager.wait_ready(DEADLINE_S, database=db_name)
    reads = [
        (lambda: coll.count_documents({"kind": "a"}), 3),
        (lambda: sorted(coll.distinct("n", {"kind": "b"})), [1, 3, 5]),
        (lambda: coll.find_one({"n": {"$gte": 4}}, sort=[("n", -1)]), {"_id": 5, "kind": "b", "n": 5}),
        (lambda: coll.estimated_document_count(), 6),
    ]
    for read, expected in reads:
        assert read() == expected
    wait_until(lambda: owner.snapshot()["entries"] == len(reads), what="the owner applied the admissions")
    settled(manager, db_name)  # each miss may have seen newer documents than the ones before it
    hits = manager.snapshot().hits
    for read, expected in reads:
        assert read() == expected
    assert manager.snapshot().hits == hits + len(reads)

    events = owner_stream(owner, db_name)["events"]
    other_client[db_name].items.insert_one({"_id": 6, "kind": "a", "n": 6})
    wait_events(owner, db_name, events + 1)
    misses = manager.snapshot().misses
    assert coll.count_documents({"kind": "a"}) == 4
    assert sorted(coll.distinct("n", {"kind": "b"})) == [1, 3, 5]
    assert coll.find_one({"n": {"$gte": 4}}, sort=[("n", -1)]) == {"_id": 6, "kind": "a", "n": 6}
    assert coll.estimated_document_count() == 7
    assert manager.snapshot().misses == misses + len(reads)


def test_a_unique_key_entry_admitted_through_the_owner_survives_writes_to_other_documents(
    group, client, other_client, db_name
):
    client[db_name].users.create_index("email", unique=True)
    seed(client, db_name, "users", [{"_id": 1, "email": "a@x"}, {"_id": 2, "email": "b@x"}])
    owner = group.start_owner()
    manager = group.manager(client)
    coll = manager[db_name]["users"]
    assert manager.wait_ready(DEADLINE_S, database=db_name)
    assert coll.find_one({"email": "a@x"}) == {"_id": 1, "email": "a@x"}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the owner applied the admission")

    events = owner_stream(owner, db_name)["events"]
    other_client[db_name].users.update_one({"_id": 2}, {"$set": {"seen": True}})
    wait_events(owner, db_name, events + 1)
    hits = manager.snapshot().hits
    assert coll.find_one({"email": "a@x"}) == {"_id": 1, "email": "a@x"}
    assert manager.snapshot().hits == hits + 1

    other_client[db_name].users.update_one({"_id": 1}, {"$set": {"seen": True}})
    wait_events(owner, db_name, events + 2)
    assert coll.find_one({"email": "a@x"}) == {"_id": 1, "email": "a@x", "seen": True}


def test_group_and_worker_snapshots(group, client, db_name):
    seed(client, db_name, "a", [{"_id": 1, "v": 1}])
    seed(client, db_name, "b", [{"_id": 1, "v": 1}])
    owner = group.start_owner()
    w1, w2, w3 = group.spawn(3)
    wait_until(lambda: owner.snapshot()["attached_workers"] == 3, what="three workers are attached")
    # Three workers, two collections of one database: one stream.
    w1.call("register", db_name, "a")
    w2.call("register", db_name, "b")
    w3.call("register", db_name, "a")
    w1.read(db_name, "a", 1)
    w2.read(db_name, "b", 1)
    w3.read(db_name, "a", 1)
    wait_until(lambda: owner.snapshot()["entries"] >= 2, what="the admissions are applied")
    # What w1 and w3 admitted is served to w2 too, once the stream has
    # applied everything w2's own miss may have seen.
    wait_until(
        lambda: w2.read(db_name, "a", 1) == {"_id": 1, "v": 1} and w2.snapshot()["hits"] >= 2,
        what="w2 has two hits",
    )

    snap = owner.snapshot()
    assert snap["attached_workers"] == 3
    assert snap["active_streams"] == 1
    assert [s["database"] for s in snap["streams"]] == [db_name]
    assert snap["owner_pid"] == owner.pid
    assert snap["owner_uptime_s"] > 0
    # Each worker's snapshot counts its own reads.
    s1, s2 = w1.snapshot(), w2.snapshot()
    assert (s1["hits"], s1["misses"]) == (0, 1)
    assert (s2["hits"], s2["misses"]) == (2, 1)
    assert [s["database"] for s in s2["streams"]] == [db_name]

    w3.close()
    wait_until(lambda: owner.snapshot()["attached_workers"] == 2, what="the closed worker detaches")
    assert owner.snapshot()["active_streams"] == 1


# =============================================================================
# Losing a process
# =============================================================================


def test_after_the_owner_is_killed_workers_bypass_and_a_new_owner_serves_new_managers(
    group, client, other_client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    owner = group.start_owner()
    (worker,) = group.spawn(1)
    local = group.manager(client)
    coll = ready_collection(local, db_name, "items")
    worker.call("register", db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")
    assert worker.read(db_name, "items", 1) == {"_id": 1, "v": 1}
    assert worker.snapshot()["hits"] == 1

    worker.send("read_until_owner_lost", db_name, "items", 1, 10.0)
    killed_at = time.monotonic()
    os.kill(owner.pid, signal.SIGKILL)
    # The test process's manager stops serving within the bound.
    seen = []
    while True:
        before = local.snapshot().bypasses.get(OWNER_UNAVAILABLE, 0)
        seen.append(coll.find_one({"_id": 1}))
        if local.snapshot().bypasses.get(OWNER_UNAVAILABLE, 0) > before:
            local_after = time.monotonic() - killed_at
            break
        assert time.monotonic() - killed_at < 10, "the manager kept serving from a dead owner"
        time.sleep(0.005)
    lost = worker.result("read_until_owner_lost")
    assert local_after <= HEARTBEAT_BOUND_S + SLACK_S, local_after
    assert lost["at"] - killed_at <= HEARTBEAT_BOUND_S + SLACK_S, lost["at"] - killed_at
    assert all(doc == {"_id": 1, "v": 1} for doc in seen)
    assert lost["seen"] == [{"_id": 1, "v": 1}]

    # Nobody invalidates the arena any more: a write must be seen at once.
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
    for _ in range(3):
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
        assert worker.read(db_name, "items", 1) == {"_id": 1, "v": 2}
    assert local.snapshot().bypasses.get(OWNER_UNAVAILABLE, 0) >= 3
    assert worker.snapshot()["bypasses"].get(OWNER_UNAVAILABLE, 0) >= 3
    # A new manager cannot attach to the dead owner (stale socket file).
    with pytest.raises(SharedCacheError):
        CacheManager(client, shared=group.name, max_await_time_ms=TEST_MAX_AWAIT_MS)

    # A new owner under the same name: a new manager attaches and is served.
    new_owner = group.start_owner()
    assert new_owner.pid != owner.pid
    fresh = group.manager(client)
    fresh_coll = ready_collection(fresh, db_name, "items")
    assert fresh_coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    wait_until(lambda: new_owner.snapshot()["entries"] == 1, what="the new owner admits")
    assert fresh_coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    assert fresh.snapshot().hits == 1
    # The old managers never go back to the dead owner's arena.
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 3}})
    wait_until(lambda: fresh_coll.find_one({"_id": 1}) == {"_id": 1, "v": 3}, what="the new owner invalidates")
    for _ in range(3):
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 3}
        assert worker.read(db_name, "items", 1) == {"_id": 1, "v": 3}


def test_workers_of_a_killed_owner_reattach_to_a_new_owner_of_the_same_name(
    group, client, other_client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    owner = group.start_owner()
    (worker,) = group.spawn(1)
    local = group.manager(client)
    coll = ready_collection(local, db_name, "items")
    worker.call("register", db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")
    os.kill(owner.pid, signal.SIGKILL)
    wait_until(
        lambda: coll.find_one({"_id": 1}) and local.snapshot().bypasses.get(OWNER_UNAVAILABLE),
        what="the manager notices the owner is gone",
    )
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})

    new_owner = group.start_owner()
    # Both workers find the new owner by themselves and are served again,
    # never with the dead owner's entry.
    seen = worker.call("read_until_hit", db_name, "items", 1, DEADLINE_S)
    assert seen == [{"_id": 1, "v": 2}]
    hits = local.snapshot().hits
    seen_local = []

    def local_hit() -> bool:
        seen_local.append(coll.find_one({"_id": 1}))
        return local.snapshot().hits > hits

    wait_until(local_hit, what="the in-process manager hits in the new owner's arena")
    assert all(doc == {"_id": 1, "v": 2} for doc in seen_local), seen_local
    snap = new_owner.snapshot()
    assert snap["attached_workers"] == 2
    assert snap["active_streams"] == 1
    # One ring per attached worker: the old rings are gone.
    assert len(group.ring_files()) == 2, group.ring_files()
    # And the new owner's stream invalidates for them.
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 3}})
    worker.call("read_until", db_name, "items", 1, {"_id": 1, "v": 3}, DEADLINE_S)
    wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 3}, what="the write is seen")


def test_a_restarted_owner_is_fresh_and_its_workers_reattach_by_themselves(group, client, other_client, db_name):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    owner = group.start_owner()
    (worker,) = group.spawn(1)
    local = group.manager(client)
    coll = ready_collection(local, db_name, "items")
    worker.call("register", db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")
    old_pid = owner.pid

    owner.restart(timeout=10)
    assert owner.pid != old_pid and not _pid_alive(old_pid)
    assert owner.snapshot()["entries"] == 0  # a fresh arena
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 2}})
    # Both workers find the new owner by themselves and are served from it,
    # never with the old arena's entry.
    assert worker.call("read_until_hit", db_name, "items", 1, DEADLINE_S) == [{"_id": 1, "v": 2}]
    hits = local.snapshot().hits
    seen: list[Any] = []

    def local_hit() -> bool:
        seen.append(coll.find_one({"_id": 1}))
        return local.snapshot().hits > hits

    wait_until(local_hit, what="the in-process manager hits in the new owner's arena")
    assert all(doc == {"_id": 1, "v": 2} for doc in seen), seen
    assert owner.snapshot()["attached_workers"] == 2
    # A handle that did not start its owner cannot restart it.
    with pytest.raises(SharedCacheError, match="cannot restart"):
        SharedCache(owner.name, None, owner.pid).restart()
    assert owner.snapshot()["attached_workers"] == 2


def test_an_owners_max_namespaces_caps_what_all_its_workers_cache(group, client, db_name):
    for name in ("a", "b"):
        seed(client, db_name, name, [{"_id": 1, "c": name}])
    owner = group.start_owner(max_namespaces=1)
    first, second = group.manager(client), group.manager(client)
    a = ready_collection(first, db_name, "a")
    assert a.find_one({"_id": 1}) == {"_id": 1, "c": "a"}
    # The other worker's collection is one too many for the owner.
    b = second[db_name]["b"]
    for _ in range(2):
        assert b.find_one({"_id": 1}) == {"_id": 1, "c": "b"}
    assert second.snapshot().bypasses.get("namespace_limit") == 2, second.snapshot()
    snap = owner.snapshot()
    assert (snap["namespaces"], snap["max_namespaces"]) == (1, 1)
    # The collection within the cap is shared as ever.
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")
    assert served(second, lambda: second[db_name]["a"].find_one({"_id": 1})) == {"_id": 1, "c": "a"}


def test_the_owners_snapshot_reports_each_streams_cost_and_lag_and_workers_defer_to_it(
    group, client, other_client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 0}])
    owner = group.start_owner()
    manager = group.manager(client)
    ready_collection(manager, db_name, "items")
    for _ in range(5):
        other_client[db_name].items.update_one({"_id": 1}, {"$inc": {"v": 1}})
    wait_events(owner, db_name, 5)
    stream = owner_stream(owner, db_name)
    assert stream["invalidations"] >= 5 and stream["event_bytes"] > 0 and stream["getmores"] > 0, stream
    assert stream["lag_samples"] >= 5 and 0 <= stream["lag_p50_ms"] <= stream["lag_max_ms"], stream
    assert stream["last_error"] == ""
    (mine,) = [s for s in manager.snapshot().streams if s.database == db_name]
    assert (mine.getmores, mine.event_bytes, mine.invalidations, mine.lag_p50_ms) == (None, None, None, None)
    assert mine.events >= 5 and mine.behind_client_s is not None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _hits_after_two_reads(manager: CacheManager, coll: Any, doc: dict[str, Any]) -> bool:
    assert coll.find_one({"_id": doc["_id"]}) == doc
    hits = manager.snapshot().hits
    assert coll.find_one({"_id": doc["_id"]}) == doc
    return manager.snapshot().hits > hits


def test_a_hung_owner_never_holds_a_read_and_serving_resumes_when_it_does(group, client, db_name):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    seed(client, db_name, "fresh", [{"_id": 1, "f": 1}])
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")

    os.kill(owner.pid, signal.SIGSTOP)  # it still accepts connections, and answers nothing
    try:
        wait_until(
            lambda: coll.find_one({"_id": 1}) and manager.snapshot().bypasses.get(OWNER_UNAVAILABLE),
            what="the manager notices the owner hangs",
        )
        # Neither a known collection nor one used for the first time waits
        # for the hung owner (re-attaching runs in the background).
        slowest = 0.0
        for name, doc in (("items", {"_id": 1, "v": 1}), ("fresh", {"_id": 1, "f": 1})):
            c = manager[db_name][name]
            for _ in range(5):
                started = time.monotonic()
                assert c.find_one({"_id": 1}) == doc
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.2)
        assert slowest < 1.0, f"a read waited {slowest:.1f} s for the hung owner"
    finally:
        os.kill(owner.pid, signal.SIGCONT)

    wait_until(lambda: _hits_after_two_reads(manager, coll, {"_id": 1, "v": 1}), what="hits again")
    fresh = manager[db_name]["fresh"]
    wait_until(
        lambda: _hits_after_two_reads(manager, fresh, {"_id": 1, "f": 1}),
        what="the collection first used while the owner hung is cached",
    )
    assert owner.snapshot()["attached_workers"] == 1


def test_a_collection_first_used_while_the_owner_is_dead_is_cached_by_the_next_owner(
    group, client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    seed(client, db_name, "later", [{"_id": 1, "l": 1}])
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    os.kill(owner.pid, signal.SIGKILL)
    wait_until(
        lambda: coll.find_one({"_id": 1}) and manager.snapshot().bypasses.get(OWNER_UNAVAILABLE),
        what="the manager notices the owner is gone",
    )
    later = manager[db_name]["later"]
    assert later.find_one({"_id": 1}) == {"_id": 1, "l": 1}  # bypassed: nobody registers it

    group.start_owner()
    # Only the new collection is read from here on: it alone must find the
    # new owner.
    wait_until(
        lambda: _hits_after_two_reads(manager, later, {"_id": 1, "l": 1}),
        what="the collection first used while no owner ran is cached",
    )


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (a small /dev/shm, as containers have) to hold a
    runtime directory; needs the right to mount (root)."""
    where = tmp_path / "shm"
    where.mkdir(mode=0o700)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_an_arena_larger_than_its_filesystem_fails_the_owner_at_start(
    small_tmpfs: Path, server_uri: str, monkeypatch: pytest.MonkeyPatch
):
    # A sparse arena file would start, then die of SIGBUS once its entries
    # outgrow the filesystem; its blocks are reserved at creation instead.
    monkeypatch.setenv("CQC_RUNTIME_DIR", str(small_tmpfs))
    with pytest.raises(SharedCacheError, match="No space left on device"):
        SharedCache.start("small", server_uri, budget_bytes=32 * 1024 * 1024)
    assert not list(small_tmpfs.glob("small.arena")), "the arena file is removed"
    owner = SharedCache.start("fits", server_uri, budget_bytes=4 * 1024 * 1024)
    try:
        assert owner.snapshot()["budget_bytes"] == 4 * 1024 * 1024
    finally:
        owner.stop(timeout=10)


def test_a_killed_worker_is_detached_and_the_others_are_undisturbed(
    group, client, other_client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    owner = group.start_owner()
    victim, survivor = group.spawn(2)
    wait_until(lambda: owner.snapshot()["attached_workers"] == 2, what="both workers attach")
    victim.call("register", db_name, "items")
    survivor.call("register", db_name, "items")
    assert victim.read(db_name, "items", 1) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the victim's admission is applied")
    assert len(group.ring_files(victim.pid)) == 1
    assert len(group.ring_files(survivor.pid)) == 1

    victim.process.kill()
    victim.process.join(10)
    assert victim.process.exitcode == -signal.SIGKILL

    wait_until(lambda: owner.snapshot()["attached_workers"] == 1, what="the owner detaches the dead worker")
    wait_until(lambda: not group.ring_files(victim.pid), what="the dead worker's ring file is removed")
    assert len(group.ring_files(survivor.pid)) == 1
    assert owner.snapshot()["owner_pid"] == owner.pid  # the owner still answers
    # The survivor keeps hitting what the dead worker admitted, admits more,
    # and sees writes.
    assert survivor.read(db_name, "items", 1) == {"_id": 1, "v": 1}
    assert survivor.snapshot()["hits"] == 1
    assert survivor.read(db_name, "items", 2) == {"_id": 2, "v": 2}
    wait_until(lambda: owner.snapshot()["entries"] == 2, what="the survivor's admission is applied")
    assert survivor.read(db_name, "items", 2) == {"_id": 2, "v": 2}
    assert survivor.snapshot()["hits"] == 2
    other_client[db_name].items.update_one({"_id": 1}, {"$set": {"v": 11}})
    survivor.call("read_until", db_name, "items", 1, {"_id": 1, "v": 11}, DEADLINE_S)
    assert owner_stream(owner, db_name)["state"] == "healthy"
    assert owner.snapshot()["active_streams"] == 1


# =============================================================================
# Ring overflow
# =============================================================================


def test_an_admission_no_ring_could_carry_is_counted_oversize_not_ring_full(group, client, db_name):
    # A filter of 1.5 MiB: with its result, more than half of any worker's
    # ring (2.1 MiB for the default max_entry_bytes), with an idle owner.
    seed(client, db_name, "items", [{"_id": 1, "tag": "t"}])
    group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    big = {"tag": {"$in": ["t"] + [f"x{i:07d}" for i in range(150_000)]}}
    assert len(bson.encode(big)) > 1_500_000
    want = client[db_name]["items"].find_one(big)
    assert want == {"_id": 1, "tag": "t"}
    assert coll.find_one(big) == want
    snap = manager.snapshot()
    assert snap.rejected_admissions.get("oversize") == 1, snap
    assert "ring_full" not in snap.rejected_admissions, snap
    assert coll.find_one(big) == want  # read again from MongoDB, correctly
    assert manager.snapshot().rejected_admissions.get("oversize") == 2


# Timing: the resumed owner must drain the ring within 15 s; with
# another test's processes beside it (pytest-xdist) that can miss, so it runs
# alone (.ci/pytest-parallel).
@pytest.mark.serial
def test_a_full_ring_drops_admissions_and_reads_stay_correct(group, client, db_name):
    # Records of ~900 KB: a worker's ring (two entries of the 1 MiB maximum)
    # holds two of them.
    docs = [{"_id": i, "blob": f"{i:04d}" * 225_000} for i in range(12)]
    seed(client, db_name, "items", docs)
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 0}) == docs[0]
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the first admission is applied")

    os.kill(owner.pid, signal.SIGSTOP)
    try:
        # Miss on distinct documents while the owner drains nothing (quickly:
        # once its heartbeat is older than its timeout, reads bypass and
        # nothing is admitted).
        results = [coll.find_one({"_id": i}) for i in range(1, 12)]
        snap = manager.snapshot()
    finally:
        os.kill(owner.pid, signal.SIGCONT)

    assert results == docs[1:]
    assert snap.rejected_admissions.get("ring_full", 0) > 0, snap
    # The owner resumes: it admits what the ring held, and reads stay correct.
    wait_until(lambda: owner.snapshot()["entries"] > 1, what="the owner drains the ring")
    assert owner.snapshot()["admissions_dropped"] == snap.rejected_admissions["ring_full"]
    for doc in docs:
        assert coll.find_one({"_id": doc["_id"]}) == doc
    wait_until(lambda: manager.snapshot().hits > 0, what="a hit after the owner resumed")
    for doc in docs:
        assert coll.find_one({"_id": doc["_id"]}) == doc


# =============================================================================
# A ring overwritten by another process
# =============================================================================


def test_a_worker_whose_ring_another_process_overwrites_keeps_answering_and_so_do_the_others(
    group, client, other_client, db_name
):
    # Documents of 2 KB and a 64 KiB budget: the workers' reads keep missing
    # and admitting while the ring is overwritten.
    docs = 64
    seed(client, db_name, "items", [_blob_doc(i) for i in range(docs)])
    owner = group.start_owner(budget_bytes=64 * 1024, max_entry_bytes=16 * 1024)
    victim, survivor = group.spawn(2)
    for w in (victim, survivor):
        w.call("register", db_name, "items")
    (ring,) = group.ring_files(victim.pid)

    for w in (victim, survivor):
        w.send("check_loop", db_name, "items", docs)
    results = _SPAWN.Queue()
    scribbler = _SPAWN.Process(target=_scribble_main, args=(str(ring), 6.0, 16, results), daemon=True)
    scribbler.start()
    try:
        kind, writes = results.get(timeout=120)
        assert kind == "ok", writes
        group.stop_event.set()
        outcomes = {name: w.result("check_loop", timeout=60) for name, w in
                    (("victim", victim), ("survivor", survivor))}
    finally:
        group.stop_event.set()
        scribbler.join(30)
        if scribbler.is_alive():
            scribbler.kill()
            scribbler.join(10)
        results.close()
        results.cancel_join_thread()
    group.stop_event.clear()

    # Both workers answered every read with the right document; the victim
    # noticed its header was not its own, dropped and counted admissions.
    assert writes > 10_000, writes
    for name, out in outcomes.items():
        assert out["wrong"] == [], (name, out)
        assert out["reads"] > docs, (name, out)
    assert outcomes["victim"]["rejected_admissions"].get("ring_damaged", 0) > 0, outcomes["victim"]
    assert victim.process.is_alive() and survivor.process.is_alive()

    # The owner still serves: both workers attached, the stream healthy,
    # writes invalidate everywhere, and the victim's ring works again.
    snap = owner.snapshot()
    assert snap["attached_workers"] == 2, snap
    # Starved of CPU by the scribbler and the workers' loops, the owner may
    # have demoted its stream (a freeze past the heartbeat timeout, or a
    # silence past the stall bound): it serves again once it caught up.
    wait_until(lambda: owner_stream(owner, db_name)["state"] == "healthy", what="the owner's stream is healthy")
    other_client[db_name].items.update_one({"_id": 3}, {"$set": {"v": -3}})
    expected = {**_blob_doc(3), "v": -3}
    for w in (victim, survivor):
        w.call("read_until", db_name, "items", 3, expected, DEADLINE_S)
    # Only the victim reads this one: its hit is its own admission.
    new = {"_id": "after", "v": 1}
    other_client[db_name].items.insert_one(new)
    assert victim.call("read_until_hit", db_name, "items", "after", DEADLINE_S) == [new]
    for w in (victim, survivor):
        for i in range(docs):
            expect = expected if i == 3 else _blob_doc(i)
            assert w.read(db_name, "items", i) == expect


# =============================================================================
# Refusals
# =============================================================================


def test_a_worker_refuses_an_arena_without_a_heartbeat_timeout(tmp_path):
    # Every owner writes its timeout before it publishes the arena's magic;
    # an arena that has none would be served from with no liveness check.
    from bson.objectid import ObjectId

    from client_query_cache import CacheClosedError
    from client_query_cache import _native
    from client_query_cache._core.engine import decode_bson

    errors = dict(closed_error=CacheClosedError, forked_error=CacheForkedError)
    arena = tmp_path / "t.arena"
    owner = _native.Cache.owner(budget_bytes=64 * 1024, slot_count=64, uri=None, max_await_time_ms=1000,
                                arena_path=str(arena), heartbeat_timeout_ms=0, **errors)
    try:
        with pytest.raises(ValueError, match="no heartbeat timeout"):
            _native.Cache.worker(arena_path=str(arena), segment_path=str(tmp_path / "w.ring"),
                                 ring_bytes=1 << 20, decode=decode_bson, objectid_type=ObjectId, **errors)
    finally:
        owner.close()


@pytest.mark.parametrize(
    "name",
    ["", "a/b", "..", ".", "x" * 65, "sp ace", "é", "a\nb", 7, b"bytes", ".hidden", "-x", "_x"],
    ids=repr,
)
def test_a_bad_name_is_refused_with_a_configuration_error(client, runtime_dir, server_uri, name):
    with pytest.raises(CacheConfigurationError, match="name"):
        CacheManager(client, shared=name)
    with pytest.raises(CacheConfigurationError, match="name"):
        SharedCache.start(name, server_uri)
    assert list(runtime_dir.iterdir()) == []


@pytest.mark.parametrize("suffix", [".start", ".starting", ".lock", ".arena", ".sock", ".w1-0a0b0c0d"])
def test_another_caches_name_never_holds_this_caches_files(client, group, db_name, suffix):
    # An owner running under NAME + suffix, where the suffix is the start of
    # one of NAME's own file names: NAME's owner still starts (its start lock
    # and files are its own) and serves.
    other = group.start_owner(group.name + suffix)
    config = SharedCacheConfig(group.name, start_owner=True, max_await_time_ms=TEST_MAX_AWAIT_MS)
    outcome: list[Any] = []

    def attach() -> None:
        try:
            outcome.append(CacheManager(client, shared=config))
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    thread = threading.Thread(target=attach, daemon=True)
    thread.start()
    thread.join(30)
    assert outcome, "attaching blocked on another cache's file"
    manager = outcome[0]
    assert isinstance(manager, CacheManager), manager
    group.managers.append(manager)
    names = {p.name for p in group.runtime.iterdir()}
    assert f"{group.name}.arena" in names and f"{group.name}{suffix}.arena" in names
    os.kill(other.pid, 0)  # the other owner runs on, undisturbed
    seed(client, db_name, "items", [{"_id": 1}])
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1}
    wait_until(lambda: coll.find_one({"_id": 1}) == {"_id": 1} and manager.snapshot().hits >= 1, what="a hit")


def test_attaching_without_a_running_owner_fails(client, group):
    with pytest.raises(SharedCacheError, match=group.name):
        CacheManager(client, shared=group.name)
    assert list(group.runtime.iterdir()) == []


def test_attaching_when_the_runtime_dir_does_not_exist_fails(client, monkeypatch, tmp_path):
    monkeypatch.setenv("CQC_RUNTIME_DIR", str(tmp_path / "missing"))
    with pytest.raises(SharedCacheError, match="does not exist"):
        CacheManager(client, shared="anything")
    assert not (tmp_path / "missing").exists()


def test_a_runtime_dir_accessible_to_others_is_refused(group, client):
    group.start_owner()
    group.runtime.chmod(0o755)
    try:
        with pytest.raises(SharedCacheError, match="0700") as info:
            CacheManager(client, shared=group.name)
        assert str(group.runtime) in str(info.value)
        with pytest.raises(SharedCacheError, match="0700"):
            SharedCache.start(f"{group.name}-2", group.uri, ready_timeout=30)
    finally:
        group.runtime.chmod(0o700)
    assert group.ring_files() == []
    # Closed up again, the same directory is accepted.
    group.manager(client)


def test_an_arena_file_accessible_to_others_is_refused(group, client):
    owner = group.start_owner()
    arena = group.runtime / f"{group.name}.arena"
    assert stat.S_IMODE(arena.stat().st_mode) == 0o600
    arena.chmod(0o644)
    try:
        with pytest.raises((SharedCacheError, PermissionError), match="private file") as info:
            CacheManager(client, shared=group.name)
        assert str(arena) in str(info.value)
    finally:
        arena.chmod(0o600)
    assert group.ring_files() == []
    assert owner.snapshot()["attached_workers"] == 0
    group.manager(client)
    assert owner.snapshot()["attached_workers"] == 1


def test_a_refused_arena_leaves_no_control_connection_open(group, client):
    group.start_owner()
    arena = group.runtime / f"{group.name}.arena"
    arena.chmod(0o644)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(PermissionError):
                CacheManager(client, shared=group.name)
            gc.collect()  # the traceback is gone: a leaked socket is collected now
    finally:
        arena.chmod(0o600)
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_a_worker_of_another_deployment_is_refused(group, client, server_uri):
    owner = group.start_owner()
    query = server_uri.split("?", 1)[1] if "?" in server_uri else ""
    elsewhere = pymongo.MongoClient(f"mongodb://127.0.0.1:9/?{query}", connect=False)
    try:
        with pytest.raises(SharedCacheError, match="deployments"):
            CacheManager(elsewhere, shared=group.name)
    finally:
        elsewhere.close()
    assert group.ring_files() == []
    assert owner.snapshot()["attached_workers"] == 0


def test_a_second_owner_with_the_same_name_fails_and_the_first_keeps_serving(
    group, client, db_name
):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}])
    first = group.start_owner()
    arena = group.runtime / f"{group.name}.arena"
    inode = arena.stat().st_ino

    with pytest.raises(SharedCacheError, match="already running"):
        SharedCache.start(group.name, group.uri, ready_timeout=30)

    assert arena.stat().st_ino == inode
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: first.snapshot()["entries"] == 1, what="the first owner admits")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == 1
    assert first.snapshot()["owner_pid"] == first.pid


# =============================================================================
# fork()
# =============================================================================


def _in_forked_child(manager: CacheManager, coll: Any) -> dict[str, str]:
    """Fork; in the child, read, snapshot and close, and report the class of
    what each raised (or "returned") through a pipe."""
    steps = {
        "find_one": lambda: coll.find_one({"_id": 1}),
        "find_one_other": lambda: coll.find_one({"_id": 2}),
        "snapshot": manager.snapshot,
        "close": manager.close,
    }
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            os.close(read_fd)
            report = []
            for name, step in steps.items():
                try:
                    step()
                    report.append(f"{name}=returned")
                except BaseException as exc:  # noqa: BLE001 - reported to the parent
                    report.append(f"{name}={type(exc).__name__}")
            os.write(write_fd, ";".join(report).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + CALL_TIMEOUT_S
    try:
        while True:
            assert time.monotonic() < deadline, "the forked child did not finish"
            ready, _, _ = select.select([read_fd], [], [], 0.1)
            if ready:
                chunk = os.read(read_fd, 4096)
                if not chunk:
                    break
                chunks.append(chunk)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return dict(item.split("=", 1) for item in b"".join(chunks).decode().split(";"))


def test_a_shared_manager_used_in_a_forked_child_raises_cache_forked_error(group, client, db_name):
    seed(client, db_name, "items", [{"_id": 1, "v": 1}, {"_id": 2, "v": 2}])
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    wait_until(lambda: owner.snapshot()["entries"] == 1, what="the admission is applied")

    report = _in_forked_child(manager, coll)

    assert report == {
        "find_one": "CacheForkedError",
        "find_one_other": "CacheForkedError",
        "snapshot": "CacheForkedError",
        "close": "returned",
    }
    assert issubclass(CacheForkedError, RuntimeError)
    # The parent is undisturbed: still attached, still hitting and admitting.
    assert not manager.closed
    assert owner.snapshot()["attached_workers"] == 1
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    assert manager.snapshot().hits == 1
    assert coll.find_one({"_id": 2}) == {"_id": 2, "v": 2}
    wait_until(lambda: owner.snapshot()["entries"] == 2, what="the parent's admission is applied")
    assert coll.find_one({"_id": 2}) == {"_id": 2, "v": 2}
    assert manager.snapshot().hits == 2


def test_closing_a_forked_copy_leaves_the_parents_ring_file(group, client, db_name):
    group.start_owner()
    manager = group.manager(client)
    (ring,) = group.ring_files(os.getpid())

    report = _in_forked_child(manager, manager[db_name]["items"])

    assert report["close"] == "returned"
    assert ring.exists()


# =============================================================================
# Concurrent writes across processes
# =============================================================================


def test_concurrent_writes_across_processes_never_produce_a_stale_read(group, client, db_name):
    docs, updates = 4, 300
    seed(client, db_name, "items", [{"_id": d, "version": 0} for d in range(docs)])
    owner = group.start_owner()
    readers = group.spawn(3)
    for r in readers:
        r.call("register", db_name, "items")
    # Every event before this one is applied once this one is: the baseline.
    before = owner_stream(owner, db_name)["events"]
    client[db_name].items.insert_one({"_id": "sentinel"})
    baseline = wait_events(owner, db_name, before + 1)

    for r in readers:
        r.send("version_loop", db_name, "items", docs, baseline)
    writer_results = _SPAWN.Queue()
    writer = _SPAWN.Process(
        target=_writer_main,
        args=(group.uri, db_name, "items", docs, updates, 0.003, writer_results),
        daemon=True,
    )
    writer.start()
    try:
        kind, value = writer_results.get(timeout=120)
        assert kind == "ok", value
        wait_events(owner, db_name, baseline + updates)
        time.sleep(0.2)  # the readers read a while after the last event
        group.stop_event.set()
        outcomes = [r.result("version_loop", timeout=60) for r in readers]
    finally:
        group.stop_event.set()
        writer.join(30)
        if writer.is_alive():
            writer.kill()
            writer.join(10)
        writer_results.close()
        writer_results.cancel_join_thread()

    # A read never returns less than the applied events guarantee. (A
    # version going backwards is allowed by the guarantee: a miss may read a
    # write from MongoDB before its event is applied, then hit an entry
    # another worker admitted before that write; the loops count it.)
    for out in outcomes:
        assert out["stale_count"] == 0, out
    assert all(out["reads"] > docs for out in outcomes), outcomes
    assert sum(out["hits"] for out in outcomes) > 0, outcomes
    # Every event applied: each worker's next read returns the final version.
    final = {d: max(j for j in range(1, updates + 1) if j % docs == d) for d in range(docs)}
    for r in readers:
        for d in range(docs):
            assert r.read(db_name, "items", d) == {"_id": d, "version": final[d]}


def test_the_owner_process_imports_neither_pymongo_nor_the_facades():
    # The owner's private memory is overhead the shared cache must earn back:
    # not PyMongo, and not the Python layers of json, socket, signal and
    # threading either (with the enum and re modules they pull in, 2 MiB).
    heavy = ("pymongo", "bson", "json", "socket", "signal", "threading", "enum", "re", "typing", "pathlib")
    code = (
        "import sys, client_query_cache.owner\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r}"
        " or m.startswith(('client_query_cache.synchronous', 'client_query_cache.asynchronous')))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _control_exchange(sock_path: str, payload: bytes) -> list[Any]:
    """Send ``payload`` on a new control connection; the JSON replies the
    owner sent before it closed the connection. An owner that hangs up with
    bytes of ours still unread (a line over the limit, or what followed the
    line it refused) closes with a reset: this side's send or receive then
    fails with EPIPE or ECONNRESET, which ends the exchange as a close
    does. A timeout fails the test."""
    import socket

    data = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(DEADLINE_S)
        sock.connect(sock_path)
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                data += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    return [json.loads(line) for line in data.splitlines()]


def test_the_owner_answers_each_json_request_and_hangs_up_on_anything_else(runtime_dir, server_uri):
    from client_query_cache._core.shared import paths_for

    owner = SharedCache.start("wire", server_uri, ready_timeout=30)
    try:
        sock_path = paths_for("wire")["sock"]
        # Strings with escapes and non-ASCII text come back as they were sent.
        odd = 'caf\u00e9 \u2603 "quoted" back\\slash \U0001f600'
        replies = _control_exchange(
            sock_path,
            b'  {"op": "info"}\r\n' + json.dumps({"op": odd}).encode() + b"\n" + b'{"op": "info"}',
        )
        assert [r["ok"] for r in replies] == [True, False, True]
        assert replies[0]["ring_bytes"] > replies[0]["max_entry_bytes"] > 0
        assert replies[1]["error"] == f"unknown request {odd!r}"
        # Not a JSON object: the owner answers nothing more on that connection.
        for bad in (
            b"[1, 2]\n",
            b'{"op": "info"} {"op": "info"}\n',
            b'{"op": NaN}\n',
            b'{"op": "\xff"}\n',
            b"{" + b" " * (1 << 20) + b"}\n",
            b'{"op": "info"\n',
            b'{"op": "x\n',
            b"{\n",
        ):
            assert _control_exchange(sock_path, bad + b'{"op": "info"}\n') == [], bad[:40]
        assert owner.snapshot()["owner_pid"] == owner.pid
    finally:
        owner.stop()


@pytest.mark.parametrize(
    "reply",
    [b"not json\n", b"[1, 2]\n", b'{"ok": true}\n', b'{"ok": true, "snapshot": [1]}\n', b""],
    ids=["text", "array", "no-snapshot", "snapshot-not-an-object", "hang-up"],
)
def test_an_owner_reply_that_is_no_control_message_is_a_shared_cache_error(runtime_dir, reply):
    # Something answers on the owner's socket (this user's, so trusted to
    # connect to) with what no owner sends: snapshot() raises
    # SharedCacheError, and stop() returns (there is nothing it can stop).
    import socket as socket_module

    from client_query_cache._core.shared import paths_for

    name = f"fake-{uuid.uuid4().hex[:8]}"
    listener = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    listener.bind(paths_for(name, create=True)["sock"])
    listener.listen(4)
    listener.settimeout(0.1)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with conn:
                conn.makefile("rb").readline()
                conn.sendall(reply)

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    try:
        fake = SharedCache(name, None, os.getpid())
        with pytest.raises(SharedCacheError, match="the owner"):
            fake.snapshot()
        fake.stop(timeout=1)
    finally:
        stop.set()
        listener.close()
        server.join(5)


#: Lines that are no control message: not an object, two values, NaN, bad
#: UTF-8, truncated objects and strings.
NOT_MESSAGES = [
    b"[1, 2]",
    b'{"op": "info"} {"op": "info"}',
    b'{"op": NaN}',
    b'{"op": "\xff"}',
    b'{"op": "info"',
    b'{"op": "x',
    b'{"op"',
    b"{",
    b"",
]


def test_a_line_that_is_no_message_is_a_value_error_where_json_is_not_imported():
    # The owner does not import json: its decoder must still say ValueError,
    # which the owner answers by hanging up, for each line (CPython 3.12 and
    # later import json.decoder for the error; 3.11 does not).
    code = (
        "import sys\n"
        "from client_query_cache._core.shared import decode_message\n"
        "assert 'json.decoder' not in sys.modules\n"
        f"for line in {NOT_MESSAGES!r}:\n"
        "    try:\n"
        "        decode_message(line)\n"
        "    except ValueError:\n"
        "        continue\n"
        "    raise AssertionError(line)\n"
        "print(decode_message(b' {\"op\": \"info\", \"n\": [1, 2.5, null, true]}\\r\\n'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'op': 'info', 'n': [1, 2.5, None, True]}"


def test_the_package_still_exports_its_public_names_lazily():
    code = (
        "import sys, client_query_cache as c\n"
        "assert 'pymongo' not in sys.modules\n"
        "from client_query_cache import CacheManager, AsyncCacheManager, SharedCache\n"
        "assert CacheManager.__name__ == 'CacheManager'\n"
        "assert all(getattr(c, n) is not None for n in c.__all__)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_credentials_appear_neither_on_the_command_line_nor_in_snapshots_or_errors(
    runtime_dir, server_uri
):
    secret = "s3cr3t-pw-7f1e"
    uri = server_uri.replace("mongodb://", f"mongodb://cqcuser:{secret}@", 1)
    owner = SharedCache.start("creds", uri, ready_timeout=30)
    try:
        cmdline = Path(f"/proc/{owner.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{owner.pid}/environ").read_bytes()
        assert secret.encode() not in cmdline
        assert secret.encode() not in environ
        assert secret not in repr(owner.snapshot())
    finally:
        owner.stop()
    # A connection string the parser refuses: its message must not quote it.
    with pytest.raises(CacheConfigurationError) as info:
        SharedCache.start("creds", f"mongodb://cqcuser:{secret}@host:notaport/")
    assert secret not in str(info.value)


def _mapping_rss_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path``."""
    rss, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields[0]) > 8 and ":" not in fields[0]:
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1]) * 1024
    return rss


# Timing: the owner must keep up with the reads; with another test's
# processes beside it (pytest-xdist) that can miss, so it runs alone
# (.ci/pytest-parallel).
@pytest.mark.serial
def test_a_drained_ring_keeps_few_pages_resident_in_the_worker(group, client, db_name):
    # 2.8 MiB of admissions through a 2.1 MiB ring that the owner keeps
    # drained: the producer wraps early, so few of the ring's pages are ever
    # touched by the worker (its RSS and PSS), although the file's blocks are
    # all reserved at creation (a full tmpfs fails the attach, not a write).
    # The reads go in batches of 50 (200 KiB), each applied before the next:
    # an owner starved of CPU for longer than the ring's room would let it
    # fill (a full ring drops admissions, and the worker touches all of it),
    # and this is about the worker's pages, not the owner's pace.
    docs = [{"_id": i, "blob": "x" * 4000} for i in range(700)]
    seed(client, db_name, "items", docs)
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    (ring,) = group.ring_files(os.getpid())
    for start in range(0, len(docs), 50):
        for doc in docs[start : start + 50]:
            assert coll.find_one({"_id": doc["_id"]}) == doc
        applied = min(start + 50, len(docs))
        try:
            wait_until(lambda: owner.snapshot()["entries"] == applied, what=f"admissions 0..{applied - 1} are applied")
        except AssertionError as e:
            raise AssertionError(f"{e}: {owner.snapshot()!r}") from None
    assert owner.snapshot()["admissions_dropped"] == 0
    info = ring.stat()
    assert info.st_size > 2 * 1024 * 1024
    assert info.st_blocks * 512 >= info.st_size, "the ring's blocks are reserved"
    resident = _mapping_rss_bytes(ring)
    assert 0 < resident < 1024 * 1024, resident


def test_the_owner_writes_a_result_it_already_holds_only_once(group, client, db_name):
    # Workers that miss one document before its first admission lands each
    # push it. Here one worker pushes the same result three budgets' worth
    # of times: the owner keeps the entry it has, so nothing else is evicted.
    budget, payload = 256 * 1024, "p" * 4000
    docs = [{"_id": i, "payload": payload} for i in range(40)]  # ~160 KiB: all fit
    seed(client, db_name, "items", docs)
    owner = group.start_owner(budget_bytes=budget, max_entry_bytes=budget // 4)
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    engine, held = manager._engine, []
    real_admit = engine.admit

    def hold(plan: Any, token: bytes, value: bytes | None, rebind: bool = False, stamp: Any = NO_STAMP) -> None:
        held.append((plan, token, value, stamp))
        engine.admit = real_admit  # only this one

    engine.admit = hold
    assert coll.find_one({"_id": 0}) == docs[0]
    ((plan, token, value, stamp),) = held
    engine.admit(plan, token, value, stamp=stamp)
    for doc in docs[1:]:
        assert coll.find_one({"_id": doc["_id"]}) == doc
    wait_until(lambda: owner.snapshot()["entries"] == len(docs), what="every admission is applied")
    before = owner.snapshot()
    assert before["evictions"] == 0, before

    again = 3 * budget // len(payload)
    for start in range(0, again, 20):  # well within a ring's room for a burst (ring.h)
        count = min(20, again - start)
        for _ in range(count):
            engine.admit(plan, token, bytes(value), stamp=stamp)
        accepted = before["admissions_accepted"] + start + count
        wait_until(lambda: owner.snapshot()["admissions_accepted"] == accepted, what="the copies are applied")

    after = owner.snapshot()
    assert (after["evictions"], after["entries"], after["used_bytes"]) == (0, len(docs), before["used_bytes"]), after
    hits = manager.snapshot().hits
    for doc in docs:
        assert coll.find_one({"_id": doc["_id"]}) == doc
    assert manager.snapshot().hits == hits + len(docs)


def _voluntary_switches(pid: int) -> int:
    """How often the threads of process ``pid`` have gone to sleep so far
    (each sleep ends in a wake-up)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text(encoding="utf-8").splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


def test_the_owner_stops_polling_every_millisecond_soon_after_admissions_stop(group, client, db_name):
    # The drain thread looks again 1 ms after a pass that admitted records
    # and waits twice as long after each empty one, up to 10 ms: in the
    # second that follows the last admission the owner's threads wake about
    # a hundred times, not a thousand (each wake-up, on a busy host, is a
    # preemption of some worker's read).
    docs = [{"_id": i, "v": i} for i in range(50)]
    seed(client, db_name, "items", docs)
    owner = group.start_owner()
    manager = group.manager(client)
    coll = ready_collection(manager, db_name, "items")
    for doc in docs:
        assert coll.find_one({"_id": doc["_id"]}) == doc
    wait_until(lambda: owner.snapshot()["entries"] == len(docs), what="every admission is applied")
    time.sleep(0.05)
    before = _voluntary_switches(owner.pid)
    time.sleep(1.0)
    woke = _voluntary_switches(owner.pid) - before
    assert 0 < woke < 400, woke
