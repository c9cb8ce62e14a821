"""Coherence checker: no read is older than the newest write whose invalidation
had been applied before the read started.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.coherence`.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import contextlib
import functools
import random
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pymongo

from . import _kit as kit
from ._kit import MAX_EXAMPLES, BenchmarkFailed, Shared, Status
from ._oracle import AT_LEAST, AT_MOST, EXACT, Oracle, Rows, Write, WriteTimes, applied_time, judge

SCHEMA = "cqc.coherence/2"
PATHS = ("shared", "local")
APIS = ("sync", "async")
#: Read kinds (a row's ``kinds`` value indexes this; ``soak`` uses 0-2 too).
KIND_NAMES = ("id", "key", "group", "distinct", "count")
ID, KEY, GROUP, DISTINCT, COUNT = range(len(KIND_NAMES))
#: How often each kind is chosen: the non-identity reads (group, distinct,
#: count) are invalidated by every write of the collection, so they mostly
#: miss under the writes; a miss right before a hit of an older entry is
#: what breaks monotonic reads.
KIND_WEIGHTS = (50, 30, 8, 6, 6)
#: A planned operation that is a worker's write of its own document.
WRITE = -1
#: Documents each worker writes itself, and the share of a task's
#: operations that are such writes (each followed by a read of it).
OWN_DOCS = 2
WRITE_SHARE = 0.05
#: The least share of each path's reads served from the cache: under it the
#: judgement covers too few hits to mean anything (see docs/benchmarks.md
#: for the figures it was chosen from).
MIN_HIT_FRACTION = 0.05
#: The judgement's counters, per path and in total.
VIOLATIONS = ("stale_reads", "monotonic_violations", "read_your_writes_violations")
#: Reading tasks per async worker process.
ASYNC_TASKS = 2
#: Reads after a worker has seen the last write applied.
TAIL_NS = 100_000_000
LOCAL_BUDGET_BYTES = 8 * 1024 * 1024

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


# -- Workers ---------------------------------------------------------------------


class _Reads:
    """A worker process's records (all its tasks together): one row per
    returned document, its own writes, the applied-time transitions it saw,
    the highest version of each document it has seen (read or written: the
    floor of its ``count`` reads) and the wrong results (with examples)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.rows = Rows()
        self.writes: list[Write] = []
        self.seen_ts, self.seen_at = array.array("q"), array.array("q")
        self.reads = 0
        self.wrong = 0
        self.examples: list[str] = []
        total = spec["documents"] + len(spec["own_all"])
        self.top = [0] * total
        self.group_members = [sorted(k for k in range(total) if k % spec["groups"] == g) for g in range(spec["groups"])]

    def saw(self, applied: int, at_ns: int) -> None:
        if not self.seen_ts or applied != self.seen_ts[-1]:
            self.seen_ts.append(applied)
            self.seen_at.append(at_ns)

    def _bad(self, why: str) -> None:
        self.wrong += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(why)

    def wrote(self, write: Write) -> None:
        self.writes.append(write)
        self.top[write.doc] = max(self.top[write.doc], write.version)

    def _versions(self, kind: int, target: int, got: Any, floor: int) -> list[tuple[int, int, int]] | None:
        """(document, version, bound) of each document a read returned, or
        None if the read returned the wrong documents."""
        if kind == COUNT:
            if got in (0, 1):
                return [(target, floor, AT_LEAST) if got else (target, floor - 1, AT_MOST)]
            self._bad(f"count of document {target} at version >= {floor} returned {got!r:.40}")
            return None
        if kind == DISTINCT:
            got = [_stamp(s) for s in got]
        elif kind < GROUP:
            if got is None:
                self._bad(f"{KIND_NAMES[kind]} read of document {target} found nothing")
                return None
            got = [got]
        out = []
        for doc in got:
            checked = check_document(doc, self.spec["groups"], self.spec["pad_bytes"]) if kind != DISTINCT else doc
            if isinstance(checked, str):
                self._bad(checked)
                return None
            out.append((*checked, EXACT))
        ids = sorted(k for k, _, _ in out)
        want = self.group_members[target] if kind >= GROUP else [target]
        if ids != want:
            self._bad(f"{KIND_NAMES[kind]} read of {target} returned documents {ids}")
            return None
        return out

    def record(self, kind: int, target: int, got: Any, floor: int, applied: int, t0: int, t1: int) -> None:
        self.reads += 1
        self.saw(applied, t0)
        found = self._versions(kind, target, got, floor)
        for k, version, bound in found or ():
            self.rows.add(k, version, applied, t0, t1, kind, bound)
            if bound != AT_MOST:
                self.top[k] = max(self.top[k], version)

    def result(self, before: Any, after: Any, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": self.spec["index"],
            "reads": self.reads,
            **self.rows.as_dict(),
            "writes": self.writes,
            "seen_ts": self.seen_ts,
            "seen_at": self.seen_at,
            "wrong": self.wrong,
            "examples": self.examples,
            "hits": after.hits - before.hits,
            "misses": after.misses - before.misses,
            "bypasses": after.bypass_total - before.bypass_total,
            **extra,
        }


def _stamp(text: Any) -> tuple[int, int] | str:
    """(document, version) of a ``stamp`` value, or why it is wrong."""
    k, sep, v = str(text).partition(":")
    if not sep or not k.isdigit() or not v.isdigit():
        return f"bad stamp {text!r:.40}"
    return int(k), int(v)


def _request(kind: int, target: int, floor: int) -> tuple[str, tuple[Any, ...]]:
    """The collection method and arguments of a read."""
    if kind == ID:
        return "find_one", ({"_id": target},)
    if kind == KEY:
        return "find_one", ({"key": f"k{target}"},)
    if kind == GROUP:
        return "find", ({"group": target},)
    if kind == DISTINCT:
        return "distinct", ("stamp", {"group": target})
    return "count_documents", ({"_id": target, "version": {"$gte": floor}},)


def _operations(spec: dict[str, Any]) -> list[tuple[int, int]]:
    """Every read a worker warms up with and chooses from: (kind, target)."""
    total, groups = spec["documents"] + len(spec["own_all"]), spec["groups"]
    ops = [(kind, k) for kind in (ID, KEY, COUNT) for k in range(total)]
    return ops + [(kind, g) for kind in (GROUP, DISTINCT) for g in range(groups)]


def _choose(rng: random.Random, ops: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """A read: its kind by ``KIND_WEIGHTS``, then its target."""
    kind = rng.choices(range(len(KIND_NAMES)), weights=KIND_WEIGHTS)[0]
    return rng.choice([op for op in ops if op[0] == kind])


def _readback(doc: int, groups: int, rng: random.Random) -> tuple[int, int]:
    """A read, of a random kind, that returns ``doc`` (after writing it)."""
    kind = rng.choice((ID, KEY, GROUP, DISTINCT, COUNT))
    return kind, (doc % groups if kind in (GROUP, DISTINCT) else doc)


class _Plan:
    """What one reading task (a sync worker has one) does next: after a
    write of its own, a read of that document; else a write of one of its
    own documents (``WRITE_SHARE`` of the operations), else a random read."""

    def __init__(self, spec: dict[str, Any], task: int, tasks: int) -> None:
        self.rng = random.Random(f"{spec['seed']}/{task}")
        self.ops = _operations(spec)
        self.groups = spec["groups"]
        self.mine = spec["own"][task::tasks]
        self.versions = dict.fromkeys(self.mine, 0)
        self.readback: int | None = None

    def next(self) -> tuple[int, int]:
        """(WRITE, document) or (read kind, target)."""
        if self.readback is not None:
            doc, self.readback = self.readback, None
            return _readback(doc, self.groups, self.rng)
        if self.mine and self.rng.random() < WRITE_SHARE:
            doc = self.rng.choice(self.mine)
            self.readback = doc
            return WRITE, doc
        return _choose(self.rng, self.ops)

    def update(self, doc: int) -> tuple[dict[str, Any], dict[str, Any], int]:
        """The filter and update of this task's next write of ``doc``."""
        v = self.versions[doc] = self.versions[doc] + 1
        return {"_id": doc}, {"$set": {"version": v, "stamp": f"{doc}:{v}"}}, v


class _Ending:
    """When a task stops: after the parent's last write was seen applied,
    ``TAIL_NS`` more; or at the run limit (unfinished)."""

    def __init__(self, spec: dict[str, Any], stop: Any, final: Any) -> None:
        self.stop, self.final = stop, final
        self.end_by = time.monotonic_ns() + int(spec["run_limit"] * 1e9)
        self.unfinished = False

    def task(self) -> Any:
        tail_until = 0

        def done(applied: int, t1: int) -> bool:
            nonlocal tail_until
            if self.stop.value:
                if tail_until:
                    if t1 >= tail_until:
                        return True
                elif applied >= self.final[0]:
                    tail_until = t1 + TAIL_NS
            if t1 > self.end_by:
                self.unfinished = True
                return True
            return False

        return done


def _read(coll: Any, kind: int, target: int, floor: int) -> Any:
    """A read (a coroutine for an async collection)."""
    method, args = _request(kind, target, floor)
    got = getattr(coll, method)(*args)
    return got.to_list() if method == "find" else got


async def _done(value: Any) -> Any:
    """``value``, awaited if the API is async: one worker body for both."""
    return await value if asyncio.iscoroutine(value) else value


def _task(rec: _Reads, plan: _Plan, done: Any, applied: Any, counters: Any) -> Any:
    """One reading task's operations, a generator: it yields ``(WRITE,
    document, filter, update, version)`` or ``(kind, target, floor,
    applied)``, and is sent back (start, end, result) of a read."""
    index = rec.spec["index"]
    while True:
        kind, target = plan.next()
        if kind == WRITE:
            yield (WRITE, target, *plan.update(target))
            continue
        floor, a = rec.top[target], applied()
        t0, t1, got = yield kind, target, floor, a
        rec.record(kind, target, got, floor, a, t0, t1)
        counters[index] = rec.reads
        if done(a, t1):
            return


def _run_sync(task: Any, coll: Any, rec: _Reads, times: WriteTimes, pause: float) -> None:
    clock, op = time.monotonic_ns, next(task)
    while True:
        if op[0] == WRITE:
            sent = clock()
            coll.update_one(op[2], op[3])
            rec.wrote(Write(op[1], op[4], times.take(op[1], op[4]), sent, clock()))
            op = next(task)
            continue
        t0 = clock()
        got = _read(coll, *op[:3])
        t1 = clock()
        try:
            op = task.send((t0, t1, got))
        except StopIteration:
            return
        if pause:
            time.sleep(pause)


async def _run_async(task: Any, coll: Any, rec: _Reads, times: WriteTimes, pause: float) -> None:
    clock, op = time.monotonic_ns, next(task)
    while True:
        if op[0] == WRITE:
            sent = clock()
            await coll.update_one(op[2], op[3])
            rec.wrote(Write(op[1], op[4], times.take(op[1], op[4]), sent, clock()))
            op = next(task)
            continue
        t0 = clock()
        got = await _read(coll, *op[:3])
        t1 = clock()
        try:
            op = task.send((t0, t1, got))
        except StopIteration:
            return
        await asyncio.sleep(pause)


async def _work(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A worker of either API: the setup awaits what the async API returns,
    the reads run in ``_run_sync`` or in ``ASYNC_TASKS`` tasks of ``_run_async``."""
    import client_query_cache as cqc

    is_async, timeout = spec["api"] == "async", spec["timeout"]
    times = WriteTimes()
    client = (pymongo.AsyncMongoClient if is_async else pymongo.MongoClient)(spec["uri"], event_listeners=[times])
    manager: Any = None
    try:
        cls = cqc.AsyncCacheManager if is_async else cqc.CacheManager
        manager = kit.manager_for(cls, client, spec["shared_name"], budget_bytes=LOCAL_BUDGET_BYTES,
                                  max_await_time_ms=spec["max_await_ms"])  # fmt: skip
        coll = manager[spec["db"]][spec["coll"]]
        await _done(coll.find_one({"_id": 0}))
        if not await _done(manager.wait_ready(timeout, database=spec["db"])):
            raise BenchmarkFailed("the change stream did not become ready")
        warm, deadline = _operations(spec), time.monotonic() + timeout
        while True:  # until a whole pass hits
            h0 = manager.snapshot().hits
            for kind, target in warm:
                await _done(_read(coll, kind, target, 0))
            if manager.snapshot().hits - h0 == len(warm):
                break
            if time.monotonic() > deadline:
                raise BenchmarkFailed(f"worker {spec['index']}: reads still missing after warm-up")
            await asyncio.sleep(0.02)
        rec, applied = _Reads(spec), functools.partial(applied_time, manager, spec["db"])
        before = manager.snapshot()
        shared.barrier.wait(timeout)
        ending = _Ending(spec, shared.stop, shared.final)
        tasks = ASYNC_TASKS if is_async else 1
        runs = [_task(rec, _Plan(spec, n, tasks), ending.task(), applied, shared.counters) for n in range(tasks)]
        if is_async:
            await asyncio.gather(*(_run_async(t, coll, rec, times, spec["read_pause"]) for t in runs))
        else:
            _run_sync(runs[0], coll, rec, times, spec["read_pause"])
        return rec.result(before, manager.snapshot(), {"unfinished": ending.unfinished})
    finally:
        if manager is not None:
            await _done(manager.close())
        await _done(client.close())


def _worker(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A spawned reader (``kit.Pool``'s protocol): sync or async."""
    return asyncio.run(_work(spec, shared))


# -- Writers ---------------------------------------------------------------------


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


# -- The oracle ------------------------------------------------------------------


def check_reads(oracle: Oracle, result: dict[str, Any]) -> dict[str, Any]:
    """One worker's rows judged (``_oracle.judge``): stale and impossible
    reads, and, where the rows carry start times, monotonic and
    read-your-writes violations (against ``result["writes"]``, its own)."""
    verdict = judge(
        result,
        oracle=oracle,
        own_writes=result.get("writes", ()),
        label=f"worker {result['index']}: ",
        kind_names=KIND_NAMES,
    )
    return {
        "stale": verdict.stale,
        "impossible": verdict.impossible,
        "monotonic": verdict.monotonic,
        "read_your_writes": verdict.read_your_writes,
        "examples": list(verdict.examples),
    }


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
        "window_ms": kit.in_ms(windows) if windows else None,
        "applied_before_ack": before_ack,
        "unobserved_by_a_worker": unobserved,
        "read_interval_ms_p50": kit.in_ms(intervals)["p50"] if intervals else None,
    }


# -- One path --------------------------------------------------------------------


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
    pool: kit.Pool | None = None
    try:
        coll = client[db][coll_name]
        own = [list(range(documents + n * OWN_DOCS, documents + (n + 1) * OWN_DOCS)) for n in range(workers)]
        total = documents + workers * OWN_DOCS
        coll.insert_many([document(k, 0, groups, pad_bytes) for k in range(total)])
        coll.create_index("key", unique=True)
        coll.create_index("group")
        shared_name = None
        if path == "shared":
            status(f"{label}: starting the owner")
            geometry = {**kit.OWNER_GEOMETRY, "max_await_time_ms": 1000, "idle_exit_seconds": 60.0}
            owner = kit.start_owner(f"cqc-coh-{secrets.token_hex(4)}", uri, **geometry)
            shared_name = owner.name
        pool = kit.Pool(workers, timeout=timeout)
        pool.shared.final[0] = (1 << 63) - 1  # set to the last write's time when done
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
                    "own": own[n],
                    "own_all": [k for mine in own for k in mine],
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
            _worker,
        )
        pool.meet(f"{label}: start (workers warm)")
        status(f"{label}: {writes} writes by {writers} writers")
        started = time.perf_counter()
        log = write_all(
            coll, writers=writers, documents=documents, writes=writes, interval=write_interval, seed=f"{seed}/{label}"
        )
        write_seconds = time.perf_counter() - started
        pool.shared.final[0] = max(w.optime for w in log)
        pool.shared.stop.value = 1
        results = pool.collect(timeout=timeout + 30)
    finally:
        if pool is not None:
            pool.close()
        if owner is not None:
            kit.stop_owner(owner)
        with contextlib.suppress(Exception):
            client[db].drop_collection(coll_name)
        client.close()
    return _path_result(path, api, workers, writers, log, write_seconds, results)


def _path_result(
    path: str, api: str, workers: int, writers: int, log: list[Write], write_seconds: float, results: list[Any]
) -> dict[str, Any]:
    """One path's figures and judgement from the writes and the workers' records."""
    oracle = Oracle([*log, *(w for r in results for w in r["writes"])])
    checked = [check_reads(oracle, r) for r in results]
    examples = [e for c in checked for e in c["examples"]] + [e for r in results for e in r["examples"]]
    reads, hits = sum(r["reads"] for r in results), sum(r["hits"] for r in results)
    return {
        "path": path,
        "api": api,
        "workers": workers,
        "writers": writers,
        "writes": len(log),
        "write_seconds": write_seconds,
        "write_ack_ms": kit.in_ms([w.ack_ns - w.sent_ns for w in log]),
        "reads": reads,
        "documents_checked": sum(len(r["docs"]) for r in results),
        "hits": hits,
        "misses": sum(r["misses"] for r in results),
        "bypasses": sum(r["bypasses"] for r in results),
        "worker_writes": sum(len(r["writes"]) for r in results),
        "hit_fraction": hits / reads if reads else 0.0,
        "stale_reads": sum(c["stale"] for c in checked),
        "monotonic_violations": sum(c["monotonic"] for c in checked),
        "read_your_writes_violations": sum(c["read_your_writes"] for c in checked),
        "impossible_reads": sum(c["impossible"] for c in checked),
        "wrong_results": sum(r["wrong"] for r in results),
        "workers_unfinished": sum(1 for r in results if r["unfinished"]),
        "examples": examples[:MAX_EXAMPLES],
        **staleness_windows(path, log, results),
    }


# -- Report ----------------------------------------------------------------------


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
        "machine": kit.machine_facts(),
        "params": params,
        "min_hit_fraction": MIN_HIT_FRACTION,
        "paths": list(paths),
        "reads": sum(p["reads"] for p in paths),
        "hits": sum(p["hits"] for p in paths),
        **{key: sum(p[key] for p in paths) for key in VIOLATIONS},
    }


def checks(report: dict[str, Any]) -> list[str]:
    problems = []
    for p in report["paths"]:
        label = f"{p['path']}/{p['api']}"
        problems.extend(f"{label}: {p[key]} {key.replace('_', ' ')}" for key in VIOLATIONS if p[key])
        if p["impossible_reads"] or p["wrong_results"]:
            problems.append(f"{label}: {p['impossible_reads'] + p['wrong_results']} wrong results")
        if p["hit_fraction"] < MIN_HIT_FRACTION:
            problems.append(
                f"{label}: {p['hits']} of {p['reads']} reads hit ({p['hit_fraction']:.0%}), under the "
                f"{MIN_HIT_FRACTION:.0%} the judgement needs to mean anything"
            )
        if p["workers_unfinished"]:
            problems.append(f"{label}: {p['workers_unfinished']} workers never saw the last write applied")
        if p["window_ms"] is None:
            problems.append(f"{label}: no write was seen applied")
        problems.extend(f"{label}: {e}" for e in p["examples"])
    return problems


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    head = (
        f"{'path':<14} {'reads':>7} {'docs':>7} {'hits':>5} {'writes':>6} {'own':>5} {'stale':>5} {'mono':>5} "
        f"{'ryw':>5} {'window p50/p95/p99/max ms':>27} {'read gap':>8}"
    )
    print(head, file=out)
    for p in report["paths"]:
        w = p["window_ms"] or {}
        window = "/".join(f"{w.get(q, float('nan')):.1f}" for q in ("p50", "p95", "p99", "max"))
        gap = p["read_interval_ms_p50"]
        print(
            f"{p['path'] + '/' + p['api']:<14} {p['reads']:>7} {p['documents_checked']:>7} "
            f"{p['hit_fraction']:>5.0%} {p['writes']:>6} {p['worker_writes']:>5} {p['stale_reads']:>5} "
            f"{p['monotonic_violations']:>5} {p['read_your_writes_violations']:>5} {window:>27} "
            f"{gap if gap is None else round(gap, 2):>8}",
            file=out,
        )
    print(
        f"stale_reads {report['stale_reads']}, monotonic_violations {report['monotonic_violations']}, "
        f"read_your_writes_violations {report['read_your_writes_violations']} of {report['reads']} reads "
        f"({report['hits']} hits; at least {MIN_HIT_FRACTION:.0%} per path required)",
        file=out,
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("coherence", __doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run (2 workers, 60 writes per path)")
    parser.add_argument("--workers", type=int, help=f"reader processes per path (default {FULL['workers']})")
    parser.add_argument("--writes", type=int, help=f"writes per path (default {FULL['writes']})")
    parser.add_argument("--documents", type=int, help=f"documents (default {FULL['documents']})")
    parser.add_argument("--groups", type=int, help=f"groups for find (default {FULL['groups']})")
    parser.add_argument("--writers", type=int, default=2, help="writer threads (default 2)")
    parser.add_argument("--write-interval-ms", type=float, default=4.0, help="pause of a writer after a write")
    parser.add_argument("--read-pause-ms", type=float, default=1.0, help="pause of a reader after a read")
    parser.add_argument("--paths", type=kit.csv(PATHS), default=PATHS, help="comma-separated: shared,local")
    parser.add_argument("--apis", type=kit.csv(APIS), default=APIS, help="comma-separated: sync,async")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    kit.at_least_one(parser, args, ("workers", "writes", "documents", "groups", "writers"))
    if args.documents < args.writers or args.groups > args.documents:
        parser.error("--documents must be at least --writers and --groups")
    if args.write_interval_ms < 0 or args.read_pause_ms < 0:
        parser.error("pauses must not be negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    status = Status()
    started = time.perf_counter()
    report = kit.with_server(lambda uri: run(args, uri, status), status)
    if report is None:
        return 1
    report["elapsed_seconds"] = time.perf_counter() - started
    return kit.conclude(report, checks(report), print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
