"""Coherence checker: no read is older than the newest write whose invalidation
had been applied before the read started.

Writers (threads of this process, each owning a disjoint share of the
documents, so every document's ``version`` only grows) update documents
``{_id: k, key: "k<k>", group: k % groups, version: v, stamp: "<k>:<v>", pad}``
with ``$set: {version, stamp}`` and record each write's acknowledgement time
and ``operationTime`` (the cluster time of its commit, from its session).
Meanwhile spawned worker processes read the documents through the cache, four
ways in turn: shared (one owner, every worker attached) or process-local (a
``CacheManager`` per worker), each with the sync ``CacheManager`` over
``MongoClient`` and the ``AsyncCacheManager`` over ``AsyncMongoClient`` (two
concurrent reading tasks per async worker). A read is, at random,

  id     ``find_one({"_id": k})``          (an identity entry)
  key    ``find_one({"key": "k<k>"})``     (a unique index: an alias of it)
  group  ``find({"group": g})``            (a query entry; every document
                                            of it is checked)

The oracle. Every change-stream follower publishes the cluster time up to
which the database's writes are reflected in the cache
(``StreamSnapshot.applied_time``; in C ``cqc_db_t.applied_ts``, stored after
the invalidation it covers). A worker reads it right before each read (``A``).
A document read by a read that started with ``A`` must carry at least the
newest version written to it by a write whose ``operationTime`` is at or
before ``A``; an older one is a **stale read** (there must be none). A
document whose content does not match its version, a version that had not
been sent before the read ended, or a ``group`` read with other members fails
the run.

The staleness window of a write: from its acknowledgement to the first time a
worker saw ``applied_time`` at or after its ``operationTime`` (shared: the
earliest worker, as they all read the same arena; process-local: the latest,
as each cache applies the write on its own), clamped at 0 (applied before the
writer saw its acknowledgement). Workers look once per read, so each value is
an upper bound by about one read interval (reported).

    python -m benchmarks.coherence --json out.json   # full (about a minute)
    python -m benchmarks.coherence --quick           # smoke run

Exit status 1 if any check fails (stale reads, wrong documents, a path with no
hits, a write never seen applied). JSON schema ``cqc.coherence/1``; the key
``stale_reads`` is the total over every path.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import contextlib
import dataclasses
import functools
import multiprocessing
import random
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pymongo

from ._common import conclude, machine_facts, quantile
from .workloads import BenchmarkFailed, Status, _start_owner, _stop_owner, _Workers

SCHEMA = "cqc.coherence/1"
PATHS = ("shared", "local")
APIS = ("sync", "async")
KIND_NAMES = ("id", "key", "group")
#: Reading tasks per async worker process.
ASYNC_TASKS = 2
#: Reads after a worker has seen the last write applied.
TAIL_NS = 100_000_000
LOCAL_BUDGET_BYTES = 8 * 1024 * 1024
MAX_EXAMPLES = 5

FULL = {"workers": 4, "writes": 600, "documents": 12, "groups": 3}
QUICK = {"workers": 2, "writes": 60, "documents": 6, "groups": 2}


def _pad(k: int, pad_bytes: int) -> str:
    return (f"{k:04d}" * (pad_bytes // 4 + 1))[:pad_bytes]


def document(k: int, version: int, groups: int, pad_bytes: int) -> dict[str, Any]:
    return {
        "_id": k,
        "key": f"k{k}",
        "group": k % groups,
        "version": version,
        "stamp": f"{k}:{version}",
        "pad": _pad(k, pad_bytes),
    }


def check_document(doc: Any, groups: int, pad_bytes: int) -> tuple[int, int] | str:
    """(document, version) of a returned document, or why it is wrong."""
    if not isinstance(doc, dict):
        return f"not a document: {doc!r:.80}"
    k, version = doc.get("_id"), doc.get("version")
    if type(k) is not int or type(version) is not int:
        return f"bad _id/version: {doc!r:.120}"
    if doc != document(k, version, groups, pad_bytes):
        return f"document {k} at version {version} has other content: {doc!r:.160}"
    return k, version


# ============================================================================
# Workers
# ============================================================================


class _Reads:
    """A worker's records: one row per returned document, the applied-time
    transitions it saw, and the wrong results (with examples)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.docs, self.versions = array.array("i"), array.array("q")
        self.applied, self.starts, self.ends = array.array("q"), array.array("q"), array.array("q")
        self.kinds = array.array("b")
        self.seen_ts, self.seen_at = array.array("q"), array.array("q")
        self.reads = 0
        self.wrong = 0
        self.examples: list[str] = []
        self.group_members = [
            sorted(k for k in range(spec["documents"]) if k % spec["groups"] == g) for g in range(spec["groups"])
        ]

    def saw(self, applied: int, at_ns: int) -> None:
        if not self.seen_ts or applied != self.seen_ts[-1]:
            self.seen_ts.append(applied)
            self.seen_at.append(at_ns)

    def _bad(self, why: str) -> None:
        self.wrong += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(why)

    def record(self, kind: int, target: int, got: list[Any], applied: int, t0: int, t1: int) -> None:
        self.reads += 1
        groups, pad = self.spec["groups"], self.spec["pad_bytes"]
        if kind == 2:
            ids = sorted(d.get("_id") for d in got if isinstance(d, dict))
            if ids != self.group_members[target]:
                self._bad(f"group {target} returned _ids {ids}")
                return
        elif len(got) != 1 or got[0] is None:
            self._bad(f"{KIND_NAMES[kind]} read of document {target} found nothing")
            return
        for doc in got:
            checked = check_document(doc, groups, pad)
            if isinstance(checked, str):
                self._bad(checked)
                continue
            k, version = checked
            if kind != 2 and k != target:
                self._bad(f"{KIND_NAMES[kind]} read of document {target} returned document {k}")
                continue
            self.docs.append(k)
            self.versions.append(version)
            self.applied.append(applied)
            self.starts.append(t0)
            self.ends.append(t1)
            self.kinds.append(kind)

    def result(self, before: Any, after: Any, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": self.spec["index"],
            "reads": self.reads,
            "docs": self.docs,
            "versions": self.versions,
            "applied": self.applied,
            "starts": self.starts,
            "ends": self.ends,
            "kinds": self.kinds,
            "seen_ts": self.seen_ts,
            "seen_at": self.seen_at,
            "wrong": self.wrong,
            "examples": self.examples,
            "hits": after.hits - before.hits,
            "misses": after.misses - before.misses,
            "bypasses": after.bypass_total - before.bypass_total,
            **extra,
        }


def applied_time(manager: Any, db: str) -> int:
    """The database's applied cluster time as one integer ((seconds << 32) |
    increment), read from the manager's current arena (a worker that
    re-attached reads its new owner's; holding an old native cache would
    also keep its arena and ring mapped)."""
    for s in manager._engine.native.streams():
        if s["database"] == db:
            t, i = s["applied_time"]
            return (t << 32) | i
    return 0


def _operations(spec: dict[str, Any]) -> tuple[list[tuple[int, int, Any]], list[tuple[int, int, Any]]]:
    """(warm-up reads, the reads to choose from): (kind, target, filter)."""
    n, groups = spec["documents"], spec["groups"]
    ops = [(0, k, {"_id": k}) for k in range(n)]
    ops += [(1, k, {"key": f"k{k}"}) for k in range(n)]
    ops += [(2, g, {"group": g}) for g in range(groups)]
    return ops, ops


def _make_manager(spec: dict[str, Any], client: Any, cls: Any) -> Any:
    if spec["path"] == "shared":
        return cls(client, shared=spec["shared_name"])
    return cls(client, budget_bytes=LOCAL_BUDGET_BYTES, max_await_time_ms=spec["max_await_ms"])


def _sync_worker(spec: dict[str, Any], counters: Any, stop: Any, final: Any, barrier: Any) -> dict[str, Any]:
    from client_query_cache import CacheManager

    timeout = spec["timeout"]
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(spec["uri"])
    manager: Any = None
    try:
        manager = _make_manager(spec, client, CacheManager)
        coll = manager[spec["db"]][spec["coll"]]
        coll.find_one({"_id": 0})
        if not manager.wait_ready(timeout, database=spec["db"]):
            raise BenchmarkFailed("the change stream did not become ready")
        warm, ops = _operations(spec)

        def read(kind: int, flt: Any) -> list[Any]:
            return [coll.find_one(flt)] if kind < 2 else list(coll.find(flt))

        deadline = time.monotonic() + timeout
        while True:  # until a whole pass hits
            h0 = manager.snapshot().hits
            for kind, _, flt in warm:
                read(kind, flt)
            if manager.snapshot().hits - h0 == len(warm):
                break
            if time.monotonic() > deadline:
                raise BenchmarkFailed(f"worker {spec['index']}: reads still missing after warm-up")
            time.sleep(0.02)
        applied = functools.partial(applied_time, manager, spec["db"])
        rec = _Reads(spec)
        rng = random.Random(spec["seed"])
        clock, pause = time.monotonic_ns, spec["read_pause"]
        before = manager.snapshot()
        barrier.wait(timeout)
        tail_until = 0
        end_by = time.monotonic_ns() + int(spec["run_limit"] * 1e9)
        while True:
            kind, target, flt = rng.choice(ops)
            a = applied()
            t0 = clock()
            got = read(kind, flt)
            t1 = clock()
            rec.saw(a, t0)
            rec.record(kind, target, got, a, t0, t1)
            counters[spec["index"]] = rec.reads
            if stop.value:
                if tail_until:
                    if t1 >= tail_until:
                        break
                elif a >= final[0]:
                    tail_until = t1 + TAIL_NS
            if t1 > end_by:
                return rec.result(before, manager.snapshot(), {"unfinished": True})
            if pause:
                time.sleep(pause)
        return rec.result(before, manager.snapshot(), {"unfinished": False})
    finally:
        if manager is not None:
            manager.close()
        client.close()


async def _async_worker_run(spec: dict[str, Any], counters: Any, stop: Any, final: Any, barrier: Any) -> dict[str, Any]:
    from client_query_cache import AsyncCacheManager

    timeout = spec["timeout"]
    client: pymongo.AsyncMongoClient[Any] = pymongo.AsyncMongoClient(spec["uri"])
    manager: Any = None
    try:
        manager = _make_manager(spec, client, AsyncCacheManager)
        coll = manager[spec["db"]][spec["coll"]]
        await coll.find_one({"_id": 0})
        if not await manager.wait_ready(timeout, database=spec["db"]):
            raise BenchmarkFailed("the change stream did not become ready")
        warm, ops = _operations(spec)

        async def read(kind: int, flt: Any) -> list[Any]:
            return [await coll.find_one(flt)] if kind < 2 else await coll.find(flt).to_list()

        deadline = time.monotonic() + timeout
        while True:
            h0 = manager.snapshot().hits
            for kind, _, flt in warm:
                await read(kind, flt)
            if manager.snapshot().hits - h0 == len(warm):
                break
            if time.monotonic() > deadline:
                raise BenchmarkFailed(f"worker {spec['index']}: reads still missing after warm-up")
            await asyncio.sleep(0.02)
        applied = functools.partial(applied_time, manager, spec["db"])
        rec = _Reads(spec)
        clock, pause = time.monotonic_ns, spec["read_pause"]
        before = manager.snapshot()
        barrier.wait(timeout)
        end_by = time.monotonic_ns() + int(spec["run_limit"] * 1e9)
        unfinished = False

        async def task(n: int) -> None:
            nonlocal unfinished
            rng = random.Random(f"{spec['seed']}/{n}")
            tail_until = 0
            while True:
                kind, target, flt = rng.choice(ops)
                a = applied()
                t0 = clock()
                got = await read(kind, flt)
                t1 = clock()
                rec.saw(a, t0)
                rec.record(kind, target, got, a, t0, t1)
                counters[spec["index"]] = rec.reads
                if stop.value:
                    if tail_until:
                        if t1 >= tail_until:
                            return
                    elif a >= final[0]:
                        tail_until = t1 + TAIL_NS
                if t1 > end_by:
                    unfinished = True
                    return
                await asyncio.sleep(pause)

        await asyncio.gather(*(task(n) for n in range(ASYNC_TASKS)))
        return rec.result(before, manager.snapshot(), {"unfinished": unfinished})
    finally:
        if manager is not None:
            await manager.close()
        await client.close()


def _worker(spec: dict[str, Any], counters: Any, stop: Any, final: Any, pace: Any, barrier: Any) -> dict[str, Any]:
    """A spawned reader (``workloads._Workers``' protocol): sync or async."""
    del pace  # the writers do not pace these workers
    if spec["api"] == "sync":
        return _sync_worker(spec, counters, stop, final, barrier)
    return asyncio.run(_async_worker_run(spec, counters, stop, final, barrier))


# ============================================================================
# Writers
# ============================================================================


@dataclasses.dataclass(frozen=True, slots=True)
class Write:
    doc: int
    version: int
    #: operationTime of the write, (seconds << 32) | increment.
    optime: int
    sent_ns: int
    ack_ns: int


def _writer(
    coll: Any, docs: Sequence[int], count: int, interval: float, seed: str, out: list[Write], errors: list[str]
) -> None:
    rng = random.Random(seed)
    versions = dict.fromkeys(docs, 0)
    clock = time.monotonic_ns
    try:
        with coll.database.client.start_session(causal_consistency=False) as session:
            for _ in range(count):
                k = rng.choice(docs)
                v = versions[k] + 1
                sent = clock()
                coll.update_one({"_id": k}, {"$set": {"version": v, "stamp": f"{k}:{v}"}}, session=session)
                ack = clock()
                ot = session.operation_time
                if ot is None:
                    raise BenchmarkFailed("the server returned no operationTime for a write")
                versions[k] = v
                out.append(Write(k, v, (ot.time << 32) | ot.inc, sent, ack))
                if interval:
                    time.sleep(interval)
    except BaseException as exc:  # reported by the caller
        errors.append(f"{type(exc).__name__}: {exc}")


def write_all(coll: Any, *, writers: int, documents: int, writes: int, interval: float, seed: str) -> list[Write]:
    """``writes`` updates split over ``writers`` threads, each owning the
    documents ``k`` with ``k % writers == its index``."""
    outs: list[list[Write]] = [[] for _ in range(writers)]
    errors: list[str] = []
    threads = []
    for w in range(writers):
        docs = [k for k in range(documents) if k % writers == w]
        share = writes // writers + (1 if w < writes % writers else 0)
        t = threading.Thread(
            target=_writer, args=(coll, docs, share, interval, f"{seed}/w{w}", outs[w], errors), name=f"writer-{w}"
        )
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if errors:
        raise BenchmarkFailed(f"a writer failed: {errors[0]}")
    return sorted((w for out in outs for w in out), key=lambda w: w.optime)


# ============================================================================
# The oracle
# ============================================================================


class Oracle:
    """What each read must return, from the writes' operation times."""

    def __init__(self, writes: Sequence[Write]) -> None:
        self._times: dict[int, list[int]] = {}
        self._versions: dict[int, list[int]] = {}
        self._sent: dict[tuple[int, int], int] = {}
        for w in sorted(writes, key=lambda w: w.optime):
            self._times.setdefault(w.doc, []).append(w.optime)
            self._versions.setdefault(w.doc, []).append(w.version)
            self._sent[(w.doc, w.version)] = w.sent_ns

    def required(self, doc: int, applied: int) -> int:
        """The newest version of ``doc`` written at or before ``applied``."""
        times = self._times.get(doc)
        if not times:
            return 0
        n = bisect.bisect_right(times, applied)
        return self._versions[doc][n - 1] if n else 0

    def impossible(self, doc: int, version: int, end_ns: int) -> str | None:
        """Why a version cannot have been read by a read ending at end_ns."""
        if version == 0:
            return None
        sent = self._sent.get((doc, version))
        if sent is None:
            return f"document {doc} at version {version} was never written"
        if sent > end_ns:
            return f"document {doc} at version {version} was read before its write was sent"
        return None


def check_reads(oracle: Oracle, result: dict[str, Any]) -> dict[str, Any]:
    """Stale and impossible reads among one worker's rows."""
    stale, impossible, examples = 0, 0, []
    docs, versions, applied, ends = result["docs"], result["versions"], result["applied"], result["ends"]
    for n in range(len(docs)):
        k, v = docs[n], versions[n]
        need = oracle.required(k, applied[n])
        if v < need:
            stale += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(
                    f"worker {result['index']}: {KIND_NAMES[result['kinds'][n]]} read returned document {k} "
                    f"at version {v}, but version {need} had been applied before it started"
                )
        why = oracle.impossible(k, v, ends[n])
        if why:
            impossible += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"worker {result['index']}: {why}")
    return {"stale": stale, "impossible": impossible, "examples": examples}


def staleness_windows(path: str, writes: Sequence[Write], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per write, acknowledgement to applied (see the module docstring)."""
    windows: list[int] = []
    before_ack = unobserved = 0
    for w in writes:
        seen = []
        for r in results:
            n = bisect.bisect_left(r["seen_ts"], w.optime)
            if n < len(r["seen_ts"]):
                seen.append(r["seen_at"][n])
        if len(seen) < len(results):
            unobserved += 1
            if path == "local" or not seen:
                continue
        at = min(seen) if path == "shared" else max(seen)
        if at < w.ack_ns:
            before_ack += 1
        windows.append(max(0, at - w.ack_ns))
    intervals = []
    for r in results:
        starts = sorted(r["starts"])
        intervals.extend(b - a for a, b in zip(starts, starts[1:]) if b > a)
    return {
        "window_ms": _ms(windows) if windows else None,
        "applied_before_ack": before_ack,
        "unobserved_by_a_worker": unobserved,
        "read_interval_ms_p50": _ms(intervals)["p50"] if intervals else None,
    }


def _ms(samples_ns: Sequence[int]) -> dict[str, float]:
    """n and nearest-rank p50/p95/p99/max, in milliseconds."""
    s = sorted(samples_ns)
    out: dict[str, float] = {"n": len(s)}
    for name, p in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100)):
        out[name] = quantile(s, p) / 1e6
    return out


# ============================================================================
# One path
# ============================================================================


def run_path(
    uri: str,
    *,
    db: str,
    path: str,
    api: str,
    workers: int,
    writes: int,
    documents: int,
    groups: int,
    writers: int = 2,
    pad_bytes: int = 512,
    write_interval: float = 0.004,
    read_pause: float = 0.001,
    max_await_ms: int = 200,
    seed: int = 20261204,
    timeout: float = 60.0,
    status: Status | None = None,
) -> dict[str, Any]:
    """Check one path ("shared"/"local") x api ("sync"/"async"); every process
    is ended and the collection dropped before this returns or raises."""
    if path not in PATHS or api not in APIS:
        raise ValueError(f"path must be one of {PATHS} and api one of {APIS}")
    status = status or Status(quiet=True)
    label = f"{path}/{api}"
    coll_name = f"docs_{path}_{api}"
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    owner: Any = None
    pool: _Workers | None = None
    try:
        coll = client[db][coll_name]
        coll.insert_many([document(k, 0, groups, pad_bytes) for k in range(documents)])
        coll.create_index("key", unique=True)
        coll.create_index("group")
        shared_name = None
        if path == "shared":
            status(f"{label}: starting the owner")
            owner = _start_owner(f"cqc-coh-{secrets.token_hex(4)}", uri)
            shared_name = owner.name
        pool = _Workers(multiprocessing.get_context("spawn"), workers, 1)
        pool.final[0] = (1 << 63) - 1  # set to the last write's time when done
        status(f"{label}: starting {workers} workers")
        pool.start(
            [
                {
                    "uri": uri,
                    "db": db,
                    "coll": coll_name,
                    "path": path,
                    "api": api,
                    "index": n,
                    "documents": documents,
                    "groups": groups,
                    "pad_bytes": pad_bytes,
                    "shared_name": shared_name,
                    "max_await_ms": max_await_ms,
                    "read_pause": read_pause,
                    "timeout": timeout,
                    "run_limit": timeout + writes * (write_interval + 0.5),
                    "seed": f"{seed}/{label}/{n}",
                }
                for n in range(workers)
            ],
            work=_worker,
        )
        pool.meet(timeout, f"{label}: start (workers warm)")
        status(f"{label}: {writes} writes by {writers} writers")
        started = time.perf_counter()
        log = write_all(
            coll, writers=writers, documents=documents, writes=writes, interval=write_interval, seed=f"{seed}/{label}"
        )
        write_seconds = time.perf_counter() - started
        pool.final[0] = max(w.optime for w in log)
        pool.stop.value = 1
        results = pool.collect(timeout + 30)
    finally:
        if pool is not None:
            pool.close()
        if owner is not None:
            _stop_owner(owner)
        with contextlib.suppress(Exception):
            client[db].drop_collection(coll_name)
        client.close()
    oracle = Oracle(log)
    checked = [check_reads(oracle, r) for r in results]
    examples = [e for c in checked for e in c["examples"]] + [e for r in results for e in r["examples"]]
    return {
        "path": path,
        "api": api,
        "workers": workers,
        "writers": writers,
        "writes": len(log),
        "write_seconds": write_seconds,
        "write_ack_ms": _ms([w.ack_ns - w.sent_ns for w in log]),
        "reads": sum(r["reads"] for r in results),
        "documents_checked": sum(len(r["docs"]) for r in results),
        "hits": sum(r["hits"] for r in results),
        "misses": sum(r["misses"] for r in results),
        "bypasses": sum(r["bypasses"] for r in results),
        "stale_reads": sum(c["stale"] for c in checked),
        "impossible_reads": sum(c["impossible"] for c in checked),
        "wrong_results": sum(r["wrong"] for r in results),
        "workers_unfinished": sum(1 for r in results if r["unfinished"]),
        "examples": examples[:MAX_EXAMPLES],
        **staleness_windows(path, log, results),
    }


# ============================================================================
# Report
# ============================================================================


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    db = f"cqc_coherence_{secrets.token_hex(6)}"
    paths = []
    try:
        for path in args.paths:
            for api in args.apis:
                paths.append(
                    run_path(
                        uri,
                        db=db,
                        path=path,
                        api=api,
                        workers=args.workers,
                        writes=args.writes,
                        documents=args.documents,
                        groups=args.groups,
                        writers=args.writers,
                        write_interval=args.write_interval_ms / 1000,
                        read_pause=args.read_pause_ms / 1000,
                        seed=args.seed,
                        timeout=args.timeout,
                        status=status,
                    )
                )
    finally:
        with pymongo.MongoClient(uri) as client:
            client.drop_database(db)
    return build_report(vars(args), paths)


def build_report(params: dict[str, Any], paths: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "machine": machine_facts(),
        "params": params,
        "paths": list(paths),
        "reads": sum(p["reads"] for p in paths),
        "hits": sum(p["hits"] for p in paths),
        "stale_reads": sum(p["stale_reads"] for p in paths),
    }


def checks(report: dict[str, Any]) -> list[str]:
    problems = []
    for p in report["paths"]:
        label = f"{p['path']}/{p['api']}"
        if p["stale_reads"]:
            problems.append(f"{label}: {p['stale_reads']} stale reads")
        if p["impossible_reads"] or p["wrong_results"]:
            problems.append(f"{label}: {p['impossible_reads'] + p['wrong_results']} wrong results")
        if not p["hits"]:
            problems.append(f"{label}: no read was served from the cache (nothing was checked)")
        if p["workers_unfinished"]:
            problems.append(f"{label}: {p['workers_unfinished']} workers never saw the last write applied")
        if p["window_ms"] is None:
            problems.append(f"{label}: no write was seen applied")
        problems.extend(f"{label}: {e}" for e in p["examples"])
    return problems


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    head = (
        f"{'path':<14} {'reads':>7} {'docs':>7} {'hits':>7} {'writes':>6} {'stale':>5} "
        f"{'window p50/p95/p99/max ms':>27} {'read gap':>8}"
    )
    print(head, file=out)
    for p in report["paths"]:
        w = p["window_ms"] or {}
        window = "/".join(f"{w.get(q, float('nan')):.1f}" for q in ("p50", "p95", "p99", "max"))
        gap = p["read_interval_ms_p50"]
        print(
            f"{p['path'] + '/' + p['api']:<14} {p['reads']:>7} {p['documents_checked']:>7} {p['hits']:>7} "
            f"{p['writes']:>6} {p['stale_reads']:>5} {window:>27} {gap if gap is None else round(gap, 2):>8}",
            file=out,
        )
    print(f"stale_reads {report['stale_reads']} of {report['reads']} reads ({report['hits']} hits)", file=out)


def _csv(choices: Sequence[str]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if not items or any(x not in choices for x in items):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return items

    return parse


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.coherence", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (2 workers, 60 writes per path)")
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here")
    parser.add_argument("--workers", type=int, help=f"reader processes per path (default {FULL['workers']})")
    parser.add_argument("--writes", type=int, help=f"writes per path (default {FULL['writes']})")
    parser.add_argument("--documents", type=int, help=f"documents (default {FULL['documents']})")
    parser.add_argument("--groups", type=int, help=f"groups for find (default {FULL['groups']})")
    parser.add_argument("--writers", type=int, default=2, help="writer threads (default 2)")
    parser.add_argument("--write-interval-ms", type=float, default=4.0, help="pause of a writer after a write")
    parser.add_argument("--read-pause-ms", type=float, default=1.0, help="pause of a reader after a read")
    parser.add_argument("--paths", type=_csv(PATHS), default=PATHS, help="comma-separated: shared,local")
    parser.add_argument("--apis", type=_csv(APIS), default=APIS, help="comma-separated: sync,async")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("workers", "writes", "documents", "groups", "writers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.documents < args.writers or args.groups > args.documents:
        parser.error("--documents must be at least --writers and --groups")
    if args.write_interval_ms < 0 or args.read_pause_ms < 0:
        parser.error("pauses must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from client_query_cache.testing import disposable_uri

    status = Status()
    started = time.perf_counter()
    try:
        status("starting the server (or using MONGODB_URI)")
        with disposable_uri() as uri:
            report = run(args, uri, status)
    except BenchmarkFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report["elapsed_seconds"] = time.perf_counter() - started
    return conclude(report, checks(report), print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
