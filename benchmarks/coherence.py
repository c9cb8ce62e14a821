"""Coherence checker: no read is older than the newest write whose invalidation
had been applied before the read started.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.coherence`.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import bisect
import concurrent.futures
import contextlib
import dataclasses
import functools
import random
import secrets
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import pymongo

from . import _kit as kit
from . import _patterns
from ._kit import MAX_EXAMPLES, BenchmarkFailed, Shared, Status
from ._oracle import AT_LEAST, AT_MOST, EXACT, Oracle, Rows, Write, WriteTimes, applied_time, hit_fraction, judge_all

SCHEMA = "cqc.coherence/3"
PATHS = ("shared", "local")
APIS = ("sync", "async")
#: Read kinds: a row's ``kinds`` value indexes this. The soak
#: (``benchmarks.soak``) reads the first five, and calls group "find" and
#: group count "count"; this harness the weighted ones below.
KIND_NAMES = ("id", "key", "group", "aggregate", "group count", "distinct", "count")
ID, KEY, GROUP, AGGREGATE, GROUP_COUNT, DISTINCT, COUNT = range(len(KIND_NAMES))
#: The kinds whose target is a group (the others': a document).
GROUPED = (GROUP, AGGREGATE, GROUP_COUNT, DISTINCT)
#: A row's version when a read found the document absent (where documents
#: are deleted: the soak's).
ABSENT = -1
#: How often each kind is chosen: the non-identity reads (group, distinct,
#: count) are invalidated by every write of the collection, so they mostly
#: miss under the writes; a miss right before a hit of an older entry is
#: what breaks monotonic reads.
KIND_WEIGHTS = {ID: 50, KEY: 30, GROUP: 8, DISTINCT: 6, COUNT: 6}
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
LOCAL = {"budget_bytes": 8 * 1024 * 1024, "max_await_time_ms": 200}
PAD_BYTES = 512

FULL = {"workers": 4, "writes": 600, "documents": 12, "groups": 3, "pattern_seconds": 8.0}
QUICK = {"workers": 2, "writes": 60, "documents": 6, "groups": 2, "pattern_seconds": 1.0}


def document(k: int, version: int, groups: int, pad_bytes: int) -> dict[str, Any]:
    return {
        "_id": k,
        "key": f"k{k}",
        "group": k % groups,
        "version": version,
        "stamp": f"{k}:{version}",
        "pad": (f"{k:04d}" * (pad_bytes // 4 + 1))[:pad_bytes],
    }


def insert_documents(coll: Any, count: int, groups: int, pad_bytes: int) -> None:
    """``count`` documents at version 0, 500 at a time, and the indexes of the reads by key and group."""
    for start in range(0, count, 500):
        coll.insert_many([document(k, 0, groups, pad_bytes) for k in range(start, min(count, start + 500))])
    coll.create_index("key", unique=True)
    coll.create_index("group")


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


# -- Checked reads ---------------------------------------------------------------
#
# What a reader reads and how each result is checked and recorded: this
# harness's readers, the invalidation workers of ``benchmarks.workloads``
# (by ``_id`` only, their documents checked by ``kit.Expected``) and the
# soak's workers (``benchmarks.soak``, whose rows go to a file).


def read(coll: Any, kind: int, target: int, floor: int = 0) -> Any:
    """A read of ``kind`` (a coroutine for an async collection; aggregate is
    sync only) of a document, or of a group for the ``GROUPED`` kinds."""
    if kind == ID:
        return coll.find_one({"_id": target})
    if kind == KEY:
        return coll.find_one({"key": f"k{target}"})
    if kind == GROUP:
        return coll.find({"group": target}).to_list()
    if kind == AGGREGATE:
        pipeline = [{"$match": {"group": target}}, {"$sort": {"_id": 1}}, {"$project": {"_id": 1, "version": 1}}]
        return list(coll.aggregate(pipeline))
    if kind == DISTINCT:
        return coll.distinct("stamp", {"group": target})
    if kind == GROUP_COUNT:
        return coll.count_documents({"group": target})
    return coll.count_documents({"_id": target, "version": {"$gte": floor}})


class Reads:
    """A process's checked reads (all its tasks together): one row per
    document a read returned, to ``rows`` (a ``Rows``, or anything with its
    ``add``), its own writes, the highest version of each document it has
    seen (read or written: the floor of its ``count`` reads), the wrong
    results (with examples), and whether it stopped before it saw the
    parent's last write. ``check`` gives (document, version) of a returned
    document, or why it is wrong (default: ``check_document``)."""

    def __init__(self, spec: dict[str, Any], rows: Any = None, check: Callable[[Any], Any] | None = None) -> None:
        self.spec, self.rows = spec, Rows() if rows is None else rows
        groups, pad = spec.get("groups", 0), spec.get("pad_bytes", PAD_BYTES)
        self.check = check or functools.partial(check_document, groups=groups, pad_bytes=pad)
        self.writes: list[Write] = []
        self.reads = self.wrong = 0
        self.examples: list[str] = []
        self.unfinished = False
        self.top = [0] * spec["total"]
        self.members = [list(range(g, spec["total"], groups)) for g in range(groups)]

    def bad(self, why: str) -> None:
        self.wrong += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(why)

    def wrote(self, write: Write) -> None:
        self.writes.append(write)
        self.top[write.key] = max(self.top[write.key], write.version)

    def _checked(self, kind: int, doc: Any) -> tuple[int, int] | str:
        """(document, version) of one returned document (a distinct's is a
        stamp, an aggregate's has only ``_id`` and ``version``), or why it is wrong."""
        if kind == DISTINCT:
            return _stamp(doc)
        if kind != AGGREGATE:
            return self.check(doc)
        if not isinstance(doc, dict) or set(doc) != {"_id", "version"}:
            return f"aggregate returned {doc!r:.120}"
        if type(doc["_id"]) is not int or type(doc["version"]) is not int:
            return f"bad _id/version: {doc!r:.120}"
        return doc["_id"], doc["version"]

    def _versions(self, kind: int, target: int, got: Any, floor: int) -> list[tuple[int, int, int]] | None:
        """(document, version, bound) of each document a read returned,
        and, where documents are deleted (``spec["deletes"]``), an
        ``ABSENT`` row for each it left out; None if the read returned the
        wrong documents. A group count's row is (group, count)."""
        what = f"{KIND_NAMES[kind]} read of {'group' if kind in GROUPED else 'document'} {target}"
        if kind == COUNT and got in (0, 1):
            return [(target, floor, AT_LEAST) if got else (target, floor - 1, AT_MOST)]
        if kind == GROUP_COUNT and type(got) is int:
            return [(target, got, EXACT)]
        if kind == COUNT:
            return self.bad(f"{what} at version >= {floor} returned {got!r:.40}")
        if kind == GROUP_COUNT:
            return self.bad(f"{what} returned {got!r:.80}")
        out = []
        for doc in got if kind in GROUPED else [] if got is None else [got]:
            checked = self._checked(kind, doc)
            if isinstance(checked, str):
                return self.bad(checked)
            out.append((*checked, EXACT))
        ids = [k for k, _, _ in out]
        want = self.members[target] if kind in GROUPED else [target]
        missing = [k for k in want if k not in ids]
        if sorted(ids) != [k for k in want if k in ids] or (missing and not self.spec.get("deletes")):
            return self.bad(f"{what} returned documents {ids}")
        if kind == AGGREGATE and ids != sorted(ids):
            return self.bad(f"{what} is not sorted by _id")
        return out + [(k, ABSENT, EXACT) for k in missing]

    def record(self, kind: int, target: int, got: Any, floor: int, applied: int, t0: int, t1: int) -> None:
        """A read's rows (none if it returned the wrong documents)."""
        self.reads += 1
        for k, version, bound in self._versions(kind, target, got, floor) or ():
            self.rows.add(k, version, applied, t0, t1, kind, bound)
            if bound != AT_MOST and kind != GROUP_COUNT:
                self.top[k] = max(self.top[k], version)

    def caught_up(self, applied: int, final: Any) -> bool:
        """Whether this process has seen the parent's last write: the
        applied time reached it (``final[0]``), or, reading ``"until":
        "versions"``, it read the last version of each document (``final[k]``)."""
        if self.spec.get("until") == "versions":
            return all(self.top[k] >= final[k] for k in range(self.spec["total"]))
        return applied >= final[0]

    def result(self, before: Any, after: Any) -> dict[str, Any]:
        return {
            "index": self.spec["index"],
            "reads": self.reads,
            **self.rows.as_dict(),
            "writes": self.writes,
            "wrong": self.wrong,
            "examples": self.examples,
            **kit.counted(before, after),
            "unfinished": self.unfinished,
        }


def _stamp(text: Any) -> tuple[int, int] | str:
    """(document, version) of a ``stamp`` value, or why it is wrong."""
    k, sep, v = str(text).partition(":")
    if not sep or not k.isdigit() or not v.isdigit():
        return f"bad stamp {text!r:.40}"
    return int(k), int(v)


def _operations(spec: dict[str, Any]) -> list[tuple[int, int]]:
    """Every read a reader warms up with and chooses from: (kind, target)."""
    return [(kind, t) for kind in spec["weights"] for t in range(spec["groups"] if kind in GROUPED else spec["total"])]


class _Plan:
    """What one reading task (a sync worker has one) does next: after a
    write of its own, a read of that document, of a random kind; else a
    write of one of its own documents (``WRITE_SHARE`` of the operations),
    else a random read (its kind by ``spec["weights"]``, then its target).
    With ``spec["rounds"]``, every document by ``_id`` instead, in a
    shuffled order each round (no worker follows a fixed phase of the writer)."""

    def __init__(self, spec: dict[str, Any], task: int, tasks: int) -> None:
        self.rng = random.Random(f"{spec['seed']}/{task}")
        self.ops = _operations(spec)
        self.kinds, self.weights = list(spec["weights"]), list(spec["weights"].values())
        self.groups, self.rounds = spec["groups"], spec.get("rounds", False)
        first = spec.get("documents", 0) + spec["index"] * OWN_DOCS
        self.mine = list(range(first, first + spec.get("own_docs", 0)))[task::tasks]
        self.versions = dict.fromkeys(self.mine, 0)
        self.readback: int | None = None
        self.order: list[int] = []

    def next(self) -> tuple[int, int]:
        """(WRITE, document) or (read kind, target)."""
        if self.rounds:
            if not self.order:
                self.order = list(range(len(self.ops)))
                self.rng.shuffle(self.order)
            return ID, self.order.pop()
        if self.readback is not None:
            doc, self.readback = self.readback, None
            kind = self.rng.choice(self.kinds)
            return kind, (doc % self.groups if kind in GROUPED else doc)
        if self.mine and self.rng.random() < WRITE_SHARE:
            doc = self.rng.choice(self.mine)
            self.readback = doc
            return WRITE, doc
        kind = self.rng.choices(self.kinds, weights=self.weights)[0]
        return self.rng.choice([op for op in self.ops if op[0] == kind])

    def update(self, doc: int) -> tuple[dict[str, Any], dict[str, Any], int]:
        """The filter and update of this task's next write of ``doc``."""
        v = self.versions[doc] = self.versions[doc] + 1
        return {"_id": doc}, {"$set": {"version": v, "stamp": f"{doc}:{v}"}}, v


_Ops = Generator[tuple[Any, ...], tuple[int, int, Any], None]


def _task(rec: Reads, plan: _Plan, shared: Shared, applied: Any, seen: Any) -> _Ops:
    """One reading task's operations, a generator: it yields ``(WRITE,
    document, filter, update, version)`` or ``(kind, target, floor,
    applied)``, and is sent back (start, end, result) of a read. Once the
    parent said stop, it ends ``spec["tail_ns"]`` after it saw the parent's
    last write (``Reads.caught_up``), or, ``spec["timeout"]`` later, unfinished."""
    tail_until = give_up = 0
    while True:
        kind, target = plan.next()
        if kind == WRITE:
            yield (WRITE, target, *plan.update(target))
            continue
        floor, a = rec.top[target], applied()
        t0, t1, got = yield kind, target, floor, a
        rec.record(kind, target, got, floor, a, t0, t1)
        seen(a, t0)
        shared.counters[rec.spec["index"]] = rec.reads
        if not shared.stop.value:
            continue
        if not tail_until and rec.caught_up(a, shared.final):
            tail_until = t1 + rec.spec["tail_ns"]
        give_up = give_up or t1 + int(rec.spec["timeout"] * 1e9)
        if tail_until and t1 >= tail_until:
            return
        if not tail_until and t1 > give_up:
            rec.unfinished = True
            return


async def _perform(task: _Ops, coll: Any, rec: Reads, times: WriteTimes, shared: Shared, is_async: bool) -> None:
    """Run a task's operations on ``coll``; each read is timed around its
    call (and await), and followed by the parent's pause (``shared.pace``)."""
    clock, op = time.monotonic_ns, next(task)
    while True:
        if op[0] == WRITE:
            sent = clock()
            call = coll.update_one(op[2], op[3])
            if is_async:
                await call
            rec.wrote(Write(op[1], op[4], times.take(op[1], op[4]), sent, clock()))
            op = next(task)
            continue
        t0 = clock()
        call = read(coll, *op[:3])
        got = await call if is_async else call
        t1 = clock()
        try:
            op = task.send((t0, t1, got))
        except StopIteration:
            return
        pause = shared.pace.value
        if is_async:
            await asyncio.sleep(pause)
        elif pause:
            time.sleep(pause)


async def _work(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A reader of either API: warm-up until a whole pass over every read
    hits, then one reading task (sync) or ``ASYNC_TASKS`` (async). It
    records the applied-time transitions it saw (``seen_ts``, ``seen_at``)."""
    is_async, timeout, times = spec["api"] == "async", spec["timeout"], WriteTimes()
    options = {"listeners": [times], **spec["local"]}
    async with kit.worker_client(spec["uri"], is_async, spec["shared_name"], **options) as (client, manager):
        coll = manager[spec["db"]][spec["coll"]]
        await kit.registered(manager, coll, spec["db"], timeout)
        warm = [functools.partial(read, coll, kind, target) for kind, target in _operations(spec)]
        if not await kit.warmed(manager, warm, timeout, 0.02):
            raise BenchmarkFailed(f"worker {spec['index']}: reads still missing after warm-up")
        expected = spec.get("raws") and kit.Expected(spec["raws"], client[spec["db"]][spec["coll"]].codec_options)
        rec = Reads(spec, check=expected.check if expected else None)
        seen_ts, seen_at = array.array("q"), array.array("q")

        def seen(applied: int, t0: int) -> None:
            if not seen_ts or applied != seen_ts[-1]:
                seen_ts.append(applied)
                seen_at.append(t0)

        applied = functools.partial(applied_time, manager, spec["db"])
        before = manager.snapshot()
        shared.barrier.wait(timeout)
        tasks = ASYNC_TASKS if is_async else 1
        runs = [_task(rec, _Plan(spec, n, tasks), shared, applied, seen) for n in range(tasks)]
        await asyncio.gather(*(_perform(task, coll, rec, times, shared, is_async) for task in runs))
        return {**rec.result(before, manager.snapshot()), "seen_ts": seen_ts, "seen_at": seen_at}


def _worker(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A spawned reader (``kit.Pool``'s protocol): sync or async."""
    return asyncio.run(_work(spec, shared))


def start_readers(
    stack: contextlib.ExitStack, uri: str, spec: dict[str, Any], *, path: str, workers: int, status: Status,
    label: str, pace: float = 0.0, keys: int = 1,
) -> kit.Pool:  # fmt: skip
    """``workers`` spawned readers of ``spec`` (each with its ``index`` and
    a ``seed`` of its own) on ``path``: for "shared", an owner of the
    benchmark's geometry first. Returns their pool (``keys`` final values)
    once every reader is warm; ``stack`` ends them and the owner."""
    spec = {"tail_ns": TAIL_NS, "local": LOCAL, "weights": KIND_WEIGHTS, **spec, "uri": uri, "shared_name": None}
    if path == "shared":
        status(f"{label}: starting the owner")
        spec["shared_name"] = stack.enter_context(kit.checked_owner(uri, "cqc-readers")).name
    pool = stack.enter_context(kit.Pool(workers, keys=keys, timeout=spec["timeout"]))
    pool.shared.pace.value = pace
    status(f"{label}: starting {workers} workers")
    pool.start([{**spec, "index": n, "seed": f"{spec['seed']}/{n}"} for n in range(workers)], _worker)
    pool.meet(f"{label}: start (workers warm)")
    return pool


# -- Writers ---------------------------------------------------------------------


def write_all(coll: Any, *, writers: int, documents: int, writes: int, interval: float, seed: str) -> list[Write]:
    """``writes`` updates (``kit.Writer``, version and stamp) split over
    ``writers`` threads, each owning the documents ``k`` with ``k % writers
    == its index`` and writing in one session."""

    def one(w: int) -> list[Write]:
        share = writes // writers + (1 if w < writes % writers else 0)
        writer = kit.Writer(coll, range(w, documents, writers), f"{seed}/w{w}", stamp=True)
        return writer.run(threading.Event(), interval, share)

    with concurrent.futures.ThreadPoolExecutor(writers, thread_name_prefix="writer") as threads:
        futures = [threads.submit(one, w) for w in range(writers)]
    errors = [exc for exc in (f.exception() for f in futures) if exc is not None]
    if errors:
        raise BenchmarkFailed(f"a writer failed: {type(errors[0]).__name__}: {errors[0]}")
    return sorted((w for f in futures for w in f.result()), key=lambda w: w.optime)


# -- The oracle ------------------------------------------------------------------


def check_reads(oracle: Oracle, result: dict[str, Any]) -> dict[str, Any]:
    """One worker's rows judged (``_oracle.judge``): stale and impossible
    reads, and, where the rows carry start times, monotonic and
    read-your-writes violations (against ``result["writes"]``, its own)."""
    verdict = judge_all([result], oracle, KIND_NAMES)
    return {**dataclasses.asdict(verdict), "examples": list(verdict.examples)}


def staleness_windows(path: str, writes: Sequence[Write], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per write, acknowledgement to applied (see docs/benchmarks.md)."""
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


def run_path(uri: str, args: argparse.Namespace, *, db: str, path: str, api: str, status: Status) -> dict[str, Any]:
    """Check one path ("shared"/"local") x api ("sync"/"async") with the
    options ``args``; every process is ended and the collection dropped
    before this returns or raises."""
    label, coll_name = f"{path}/{api}", f"docs_{path}_{api}"
    with contextlib.ExitStack() as stack:
        client: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(uri))
        coll = client[db][coll_name]
        stack.callback(kit.quietly, coll.drop)
        total = args.documents + args.workers * OWN_DOCS
        insert_documents(coll, total, args.groups, PAD_BYTES)
        spec = {
            "db": db, "coll": coll_name, "api": api, "documents": args.documents, "total": total,
            "groups": args.groups, "own_docs": OWN_DOCS, "timeout": args.timeout, "seed": f"{args.seed}/{label}",
        }  # fmt: skip
        pool = start_readers(
            stack, uri, spec, path=path, workers=args.workers, status=status, label=label,
            pace=args.read_pause_ms / 1000,
        )  # fmt: skip
        pool.shared.final[0] = (1 << 63) - 1  # set to the last write's time when done
        status(f"{label}: {args.writes} writes by {args.writers} writers")
        started = time.perf_counter()
        log = write_all(
            coll, writers=args.writers, documents=args.documents, writes=args.writes,
            interval=args.write_interval_ms / 1000, seed=f"{args.seed}/{label}",
        )  # fmt: skip
        write_seconds = time.perf_counter() - started
        pool.shared.final[0] = max(w.optime for w in log)
        pool.shared.stop.value = 1
        results = pool.collect(timeout=args.timeout + 30)
    return _path_result(path, api, args, log, write_seconds, results)


def _path_result(
    path: str, api: str, args: argparse.Namespace, log: list[Write], write_seconds: float, results: list[Any]
) -> dict[str, Any]:
    """One path's figures and judgement from the writes and the workers' records."""
    verdict = judge_all(results, Oracle([*log, *(w for r in results for w in r["writes"])]), KIND_NAMES)
    examples = [*verdict.examples, *(e for r in results for e in r["examples"])]
    reads, hits = sum(r["reads"] for r in results), sum(r["hits"] for r in results)
    return {
        "path": path,
        "api": api,
        "workers": args.workers,
        "writers": args.writers,
        "writes": len(log),
        "write_seconds": write_seconds,
        "write_ack_ms": kit.in_ms([w.ack_ns - w.sent_ns for w in log]),
        "reads": reads,
        "documents_checked": sum(len(r["docs"]) for r in results),
        "hits": hits,
        "misses": sum(r["misses"] for r in results),
        "bypasses": sum(r["bypasses"] + r["behind"] for r in results),
        "worker_writes": sum(len(r["writes"]) for r in results),
        "hit_fraction": hit_fraction(hits, reads),
        **verdict.counts(),
        "wrong_results": sum(r["wrong"] for r in results),
        "workers_unfinished": sum(r["unfinished"] for r in results),
        "examples": examples[:MAX_EXAMPLES],
        **staleness_windows(path, log, results),
    }


# -- Report ----------------------------------------------------------------------


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    db = f"cqc_coherence_{secrets.token_hex(6)}"
    try:
        paths = [run_path(uri, args, db=db, path=p, api=a, status=status) for p in args.paths for a in args.apis]
    finally:
        with pymongo.MongoClient(uri) as client:
            client.drop_database(db)
    return build_report(vars(args), paths, run_patterns(uri, args, db, status))


def run_patterns(uri: str, args: argparse.Namespace, db: str, status: Status) -> list[dict[str, Any]]:
    """Each pattern (``benchmarks._patterns``) on each path and API, for
    ``args.pattern_seconds``; a shared path's patterns share one owner."""
    out = []
    for path in args.paths:
        with contextlib.ExitStack() as stack:
            owner = None
            if path == "shared":
                owner = stack.enter_context(kit.checked_owner(uri, "coh-pat", max_await_time_ms=LOCAL["max_await_time_ms"])).name
            for pattern in args.patterns:
                if path != "shared" and pattern in _patterns.SHARED_ONLY:
                    continue
                for api in args.apis:
                    status(f"pattern {pattern}: {path}/{api} for {args.pattern_seconds:g} s")
                    out.append(
                        _patterns.run_pattern(
                            pattern, uri, path=path, api=api, owner=owner, db_prefix=f"{db}_{len(out)}",
                            seconds=args.pattern_seconds, timeout=args.timeout, seed=str(args.seed),
                        )  # fmt: skip
                    )
    return out


def build_report(
    params: dict[str, Any], paths: Sequence[dict[str, Any]], patterns: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    every = [*paths, *patterns]
    return {
        "schema": SCHEMA,
        "machine": kit.machine_facts(),
        "params": params,
        "min_hit_fraction": MIN_HIT_FRACTION,
        "paths": list(paths),
        "patterns": list(patterns),
        **{key: sum(p[key] for p in every) for key in ("reads", "hits", *VIOLATIONS)},
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
    for p in report.get("patterns", ()):
        label = f"pattern {p['pattern']} {p['path']}/{p['api']}"
        problems.extend(f"{label}: {p[key]} {key.replace('_', ' ')}" for key in VIOLATIONS if p[key])
        if p["wrong_results"]:
            problems.append(f"{label}: {p['wrong_results']} wrong results")
        if not p["documents_checked"] or not (p["hits"] or report["params"].get("quick")):
            problems.append(f"{label}: {p['reads']} reads judged, {p['hits']} hits: the pattern checked nothing")
        problems.extend(f"{label}: {e}" for e in p["examples"])
    return problems


#: The printed table: (title, format spec) of each column.
COLUMNS = (
    ("path", "<14"), ("reads", ">7"), ("docs", ">7"), ("hits", ">5.0%"), ("writes", ">6"), ("own", ">5"),
    ("stale", ">5"), ("mono", ">5"), ("ryw", ">5"), ("window p50/p95/p99/max ms", ">27"), ("read gap", ">8.2f"),
)  # fmt: skip


PATTERN_COLUMNS = (
    ("pattern", "<19"), ("path", "<13"), ("reads", ">6"), ("docs", ">6"), ("hits", ">5.0%"), ("behind", ">6"),
    ("own", ">5"), ("other", ">6"), ("stale", ">5"), ("mono", ">5"), ("ryw", ">5"),
)  # fmt: skip


def print_report(report: dict[str, Any]) -> None:
    rows = []
    for p in report["paths"]:
        w = p["window_ms"] or {}
        window = "/".join(f"{w.get(q, float('nan')):.1f}" for q in ("p50", "p95", "p99", "max"))
        rows.append((
            f"{p['path']}/{p['api']}", p["reads"], p["documents_checked"], p["hit_fraction"], p["writes"],
            p["worker_writes"], p["stale_reads"], p["monotonic_violations"], p["read_your_writes_violations"],
            window, kit.cell(p["read_interval_ms_p50"]),
        ))  # fmt: skip
    kit.table(COLUMNS, rows)
    if report.get("patterns"):
        print("patterns (docs/benchmarks.md: each judged read by read):")
        kit.table(
            PATTERN_COLUMNS,
            [
                (
                    p["pattern"], f"{p['path']}/{p['api']}", p["reads"], p["documents_checked"],
                    hit_fraction(p["hits"], p["reads"]), p["behind"], p["own_writes"], p["other_writes"],
                    p["stale_reads"], p["monotonic_violations"], p["read_your_writes_violations"],
                )  # fmt: skip
                for p in report["patterns"]
            ],
        )
    print(
        f"stale_reads {report['stale_reads']}, monotonic_violations {report['monotonic_violations']}, "
        f"read_your_writes_violations {report['read_your_writes_violations']} of {report['reads']} reads "
        f"({report['hits']} hits; at least {MIN_HIT_FRACTION:.0%} per path required)"
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("coherence", __doc__)
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run (2 workers, 60 writes per path)")
    add("--workers", type=int, help=f"reader processes per path (default {FULL['workers']})")
    add("--writes", type=int, help=f"writes per path (default {FULL['writes']})")
    add("--documents", type=int, help=f"documents (default {FULL['documents']})")
    add("--groups", type=int, help=f"groups for find (default {FULL['groups']})")
    add("--writers", type=int, default=2, help="writer threads (default 2)")
    add("--write-interval-ms", type=float, default=4.0, help="pause of a writer after a write")
    add("--read-pause-ms", type=float, default=1.0, help="pause of a reader after a read")
    add("--paths", type=kit.csv(PATHS), default=PATHS, help="comma-separated: shared,local")
    add("--apis", type=kit.csv(APIS), default=APIS, help="comma-separated: sync,async")
    add("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    add(
        "--patterns", type=kit.csv(_patterns.PATTERNS + ("none",)), default=_patterns.PATTERNS,
        help="comma-separated patterns to run after the paths (none: no pattern)",
    )  # fmt: skip
    add("--pattern-seconds", type=float, help=f"seconds each pattern runs per path and API (default {FULL['pattern_seconds']:g})")
    args = parser.parse_args(argv)
    kit.defaults(args, QUICK if args.quick else FULL)
    kit.at_least_one(parser, args, ("workers", "writes", "documents", "groups", "writers"))
    if args.documents < args.writers or args.groups > args.documents:
        parser.error("--documents must be at least --writers and --groups")
    if args.write_interval_ms < 0 or args.read_pause_ms < 0:
        parser.error("pauses must not be negative")
    if args.pattern_seconds <= 0:
        parser.error("--pattern-seconds must be positive")
    args.patterns = tuple(p for p in args.patterns if p != "none")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return kit.checked_main(_parse(argv), run, checks, print_report, timed=True)


if __name__ == "__main__":
    sys.exit(main())
