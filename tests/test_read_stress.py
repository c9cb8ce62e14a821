"""Lock-free reads under a writer that admits and invalidates all the time.

Reader threads read documents as fast as they can while a writer rewrites
them through the cache's own view: every write invalidates an entry, every
read after it misses and admits again, and the documents are twice the
smallest budget (64 KiB), so admissions evict and the payload rings reuse
their bytes under the readers all the time.
In shared mode the owner process applies the admissions and the
invalidations while the workers' threads read its arena without a lock; in
process-local mode the follower thread invalidates while readers look up
and admit. Each document is large (over 1 KiB: many cache lines, several
arena words) and every field of it is derived from its version, so a copy
torn between two versions, or between an entry and the bytes of another,
shows. Each read is checked:

* whole: every field agrees with the document's version;
* not behind this process's own acknowledged writes (the causal floor);
* not behind what the same thread has already read of that document;

and when the writers stop, every process reads the last version of every
document within the deadline.

This is the stress test of the ARM subset (docs/packaging.md): the memory
orderings of the read path (docs/architecture.md, "Memory ordering") are
what keeps these checks true on a weakly ordered CPU. Under qemu on an
x86-64 host it runs the aarch64 code with the host's ordering, so there it
proves the aarch64 build's logic, not ARM's reorderings.
``CQC_STRESS_SECONDS`` sets how long the readers read (default 3).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
import uuid
from typing import Any

import pymongo

from client_query_cache import CacheManager, SharedCache
from support import DEADLINE_S, TEST_MAX_AWAIT_MS

DOCS = 48
# The smallest budget the cache takes: the documents (about 2.4 KiB each)
# need twice as much.
BUDGET = 64 * 1024
READERS = 3
SECONDS = float(os.environ.get("CQC_STRESS_SECONDS", "3"))
# The writer's pause between two writes: often enough to race the readers,
# seldom enough that entries live long enough to be hit.
WRITE_PAUSE_S = 0.002
_SPAWN = multiprocessing.get_context("spawn")


def body(i: int, v: int) -> dict[str, Any]:
    """Document ``i`` at version ``v``: every field derived from both."""
    return {
        "v": v,
        "tag": f"{i}-{v}",
        "vals": [v] * 32,
        "blob": bytes([(v * 7 + i) % 251]) * 2000,
        "sub": {"v": v, "s": str(v) * 40},
    }


def whole(doc: dict[str, Any]) -> bool:
    i, v = doc["_id"], doc["v"]
    return doc == {"_id": i, **body(i, v)}


def _stress(coll: Any, writes: list[int], seconds: float) -> dict[str, Any]:
    """Run READERS reader threads and one writer thread (writing the
    documents of ``writes`` through ``coll``) for ``seconds``; return the
    counts and every violation seen (at most 20 of each kind)."""
    acked = {i: 0 for i in range(DOCS)}  # this process's acknowledged versions
    stop = threading.Event()
    out: dict[str, Any] = {"reads": 0, "writes": 0, "torn": [], "behind_own_write": [], "backwards": []}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def writer() -> None:
        v = 0
        try:
            while not stop.is_set():
                v += 1
                for i in writes:
                    coll.update_one({"_id": i}, {"$set": body(i, v)})
                    acked[i] = v
                    time.sleep(WRITE_PAUSE_S)
                with lock:
                    out["writes"] += len(writes)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        last = {i: 0 for i in range(DOCS)}
        reads = 0
        try:
            while not stop.is_set():
                i = rng.randrange(DOCS)
                floor = acked[i]
                doc = coll.find_one({"_id": i})
                reads += 1
                problem = None
                if doc is None or not whole(doc):
                    problem = ("torn", (i, doc if doc is None else {k: doc[k] for k in ("_id", "v", "tag")}))
                elif doc["v"] < floor:
                    problem = ("behind_own_write", (i, doc["v"], floor))
                elif doc["v"] < last[i]:
                    problem = ("backwards", (i, doc["v"], last[i]))
                else:
                    last[i] = doc["v"]
                if reads % 16 == 0:
                    time.sleep(0)  # let the writer have the GIL now and then
                if problem:
                    with lock:
                        if len(out[problem[0]]) < 20:
                            out[problem[0]].append(problem[1])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        with lock:
            out["reads"] += reads

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(READERS)]
    if writes:
        threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(DEADLINE_S)
    if errors:
        raise errors[0]
    out["last_written"] = {i: acked[i] for i in writes}
    return out


def _converges(coll: Any, final: dict[int, int]) -> bool:
    """Every document reads as its final version, within the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if all((coll.find_one({"_id": i}) or {}).get("v") == v for i, v in final.items()):
            return True
        time.sleep(0.02)
    return False


def _counts(manager: CacheManager) -> tuple[int, int]:
    snap = manager.snapshot()
    return snap.hits, snap.evictions


def _seed(client: pymongo.MongoClient, db: str) -> None:
    client[db].docs.insert_many([{"_id": i, **body(i, 0)} for i in range(DOCS)])


def test_reader_threads_beside_an_admitting_and_invalidating_writer_read_whole_fresh_documents(
    client: pymongo.MongoClient, db_name: str
) -> None:
    _seed(client, db_name)
    with CacheManager(client, budget_bytes=BUDGET, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        coll = manager[db_name].docs
        assert manager.wait_ready(DEADLINE_S, database=db_name)
        hits, evictions = _counts(manager)
        out = _stress(coll, list(range(DOCS)), SECONDS)
        hits, evictions = (after - before for after, before in zip(_counts(manager), (hits, evictions)))
        assert _converges(coll, out["last_written"]), manager.snapshot()
    assert (out["torn"], out["behind_own_write"], out["backwards"]) == ([], [], []), out
    # The check means something only if the readers hit entries that the
    # writer kept invalidating and admissions kept evicting.
    assert out["writes"] >= DOCS and out["reads"] >= 100, out
    assert 50 <= hits < out["reads"] and evictions >= 50, (hits, evictions, out)


def _shared_worker(
    name: str, uri: str, db: str, writes: list[int], seconds: float, go: Any, finals: Any, results: Any
) -> None:
    """A worker process: attach, wait for ``go``, stress, report; then wait
    for the final versions of every document and report whether its reads
    converge to them."""
    try:
        client = pymongo.MongoClient(uri)
        try:
            with CacheManager(client, shared=name) as manager:
                coll = manager[db].docs
                if not manager.wait_ready(DEADLINE_S, database=db):
                    raise AssertionError(f"not ready: {manager.snapshot()!r}")
                results.put(("ready", None))
                if not go.wait(DEADLINE_S * 2):
                    raise AssertionError("no go")
                hits, evictions = _counts(manager)
                out = _stress(coll, writes, seconds)
                out["hits"] = _counts(manager)[0] - hits
                out["evictions"] = _counts(manager)[1] - evictions
                results.put(("stressed", out))
                final = finals.get(timeout=DEADLINE_S * 2)
                results.put(("converged", _converges(coll, final)))
        finally:
            client.close()
    except BaseException as exc:  # noqa: BLE001
        results.put(("error", repr(exc)))


def test_reader_threads_of_two_workers_beside_the_owners_admissions_and_invalidations_read_whole_fresh_documents(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Any
) -> None:
    _seed(client, db_name)
    name = f"stress-{uuid.uuid4().hex[:8]}"
    workers = 2
    with SharedCache.start(
        name, server_uri, budget_bytes=BUDGET, max_entry_bytes=BUDGET // 4, max_await_time_ms=TEST_MAX_AWAIT_MS
    ):
        go = _SPAWN.Event()
        results = [_SPAWN.Queue() for _ in range(workers)]
        finals = [_SPAWN.Queue() for _ in range(workers)]
        # Worker w writes the documents i with i % workers == w: each reads
        # its own writes (checked against its floor) and the other's.
        procs = [
            _SPAWN.Process(
                target=_shared_worker,
                args=(name, server_uri, db_name, [i for i in range(DOCS) if i % workers == w], SECONDS,
                      go, finals[w], results[w]),
                daemon=True,
            )
            for w in range(workers)
        ]  # fmt: skip
        for p in procs:
            p.start()
        try:
            for q in results:
                kind, value = q.get(timeout=DEADLINE_S * 4)
                assert kind == "ready", value
            go.set()
            outs = []
            for q in results:
                kind, value = q.get(timeout=SECONDS + DEADLINE_S * 2)
                assert kind == "stressed", value
                outs.append(value)
            final = {i: outs[i % workers]["last_written"][i] for i in range(DOCS)}
            for q in finals:
                q.put(final)
            for q in results:
                kind, value = q.get(timeout=DEADLINE_S * 2)
                assert (kind, value) == ("converged", True), value
        finally:
            for p in procs:
                p.join(DEADLINE_S)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    for out in outs:
        assert (out["torn"], out["behind_own_write"], out["backwards"]) == ([], [], []), out
        assert out["writes"] >= DOCS // workers and out["reads"] >= 100, out
        assert 50 <= out["hits"] < out["reads"] and out["evictions"] >= 50, out


def test_the_wholeness_check_catches_a_document_of_two_versions() -> None:
    doc = {"_id": 1, **body(1, 5)}
    assert whole(doc)
    mixed = dict(doc, blob=body(1, 6)["blob"])
    assert not whole(mixed)
    assert not whole(dict(doc, vals=[5] * 31 + [6]))
