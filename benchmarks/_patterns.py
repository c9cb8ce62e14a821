"""The coherence checker's patterns: the interleavings that once broke the
causal promise (docs/consistency.md, "Causal reads"), each run for a while
against writers of another client and judged read by read.

Each pattern runs in this process, through one manager (two in
``cross_worker``) of the path and API asked for, against two databases of its
own. Every write adds one to a document's ``version`` (or sets the next one
of the documents only its actor writes), so versions of a document only
grow, and a watcher of each database's change stream records each version's
cluster time. Every document a read returns is judged:

* stale: older than a version whose change event the manager had applied
  (its database's applied time) before the read started;
* monotonic: older than a version the same manager returned by a read that
  ended before this one started;
* read your writes: older than a version the same manager wrote (through
  the views, or through ``.raw`` with a ``CausalListener``), acknowledged
  before this read started.

Reference: docs/benchmarks.md, ``benchmarks.coherence``, "Patterns".
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pymongo
from pymongo import ReturnDocument

from . import _kit as kit
from ._kit import MAX_EXAMPLES, BenchmarkFailed
from ._oracle import applied_time

#: The patterns, in the order they run; ``cross_worker`` needs a shared cache.
PATTERNS = (
    "multi_batch",
    "same_client",
    "listener_writes",
    "transaction_writes",
    "merge_elsewhere",
    "cross_worker",
    "two_databases",
)
SHARED_ONLY = frozenset({"cross_worker"})
#: Documents per collection: half are written by another client, half
#: (``OWN``) only by the pattern's actor where it writes.
DOCS = 8
OWN = range(0, DOCS // 2)
OTHER = range(DOCS // 2, DOCS)
GROUPS = 2
#: Pause of the other client's writer after each write, and of a reader
#: between the batches of a multi-batch cursor.
WRITE_PAUSE_S = 0.002
BATCH_PAUSE_S = 0.003
LOCAL = {"budget_bytes": 8 * 1024 * 1024, "max_await_time_ms": 200}


# -- the record ------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Read:
    who: int
    ns: str
    doc: int
    version: int
    t0: int
    t1: int
    applied: int


@dataclasses.dataclass(slots=True)
class _Own:
    who: int
    ns: str
    doc: int
    version: int
    ack: int


class Record:
    """Reads and own writes of one pattern run (thread-safe), and wrong
    results."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reads: list[_Read] = []
        self.own: list[_Own] = []
        self.calls = 0
        self.other_writes = 0
        self.wrong: list[str] = []

    def read(self, who: int, ns: str, docs: Sequence[Any], t0: int, t1: int, applied: int, want: Sequence[int]) -> None:
        rows = []
        for d in docs:
            if not isinstance(d, dict) or type(d.get("_id")) is not int or type(d.get("version")) is not int:
                self._bad(f"{ns}: a read returned {d!r:.100}")
                return
            rows.append(_Read(who, ns, d["_id"], d["version"], t0, t1, applied))
        if sorted(r.doc for r in rows) != sorted(want):
            self._bad(f"{ns}: a read of {list(want)} returned documents {[r.doc for r in rows]}")
            return
        with self.lock:
            self.calls += 1
            self.reads.extend(rows)

    def wrote(self, who: int, ns: str, doc: int, version: int, ack: int) -> None:
        with self.lock:
            self.own.append(_Own(who, ns, doc, version, ack))

    def _bad(self, why: str) -> None:
        with self.lock:
            self.wrong.append(why)


class Events:
    """Each version's change-event cluster time, by (namespace, document):
    one watcher thread per database, on a client of its own."""

    def __init__(self, uri: str, dbs: Sequence[str]) -> None:
        self.client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
        self.times: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.streams = [self.client[db].watch(max_await_time_ms=100) for db in dbs]
        self.threads = [threading.Thread(target=self._follow, args=(s,), daemon=True) for s in self.streams]
        for t in self.threads:
            t.start()

    def _follow(self, stream: Any) -> None:
        with contextlib.suppress(Exception):
            while not self.stop.is_set():
                change = stream.try_next()
                if change is None:
                    continue
                ns = f"{change['ns']['db']}.{change['ns'].get('coll')}"
                doc = change.get("documentKey", {}).get("_id")
                version = None
                if change["operationType"] == "update":
                    version = change["updateDescription"]["updatedFields"].get("version")
                elif change["operationType"] in ("insert", "replace"):
                    version = (change.get("fullDocument") or {}).get("version")
                if type(doc) is int and type(version) is int:
                    with self.lock:
                        self.times.setdefault((ns, doc), []).append((kit.timestamp_int(change["clusterTime"]), version))

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in self.streams:
            kit.quietly(s.close)
        self.client.close()


def judge(rec: Record, events: Events) -> dict[str, Any]:
    """The three counts (documents judged wrong) and examples."""
    counts = {"stale_reads": 0, "monotonic_violations": 0, "read_your_writes_violations": 0}
    examples: list[str] = []

    def bad(key: str, why: str) -> None:
        counts[key] += 1
        if len(examples) < MAX_EXAMPLES:
            examples.append(why)

    # Applied versions: by event time, the highest version up to it.
    applied: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for key, rows in events.times.items():
        rows.sort()
        top, tops = 0, []
        for _, v in rows:
            top = max(top, v)
            tops.append(top)
        applied[key] = ([t for t, _ in rows], tops)
    # What each manager had returned or written, by end time.
    seen: dict[tuple[int, str, int], tuple[list[int], list[int], list[bool]]] = {}
    marks = [(r.t1, r.version, False, (r.who, r.ns, r.doc)) for r in rec.reads]
    marks += [(w.ack, w.version, True, (w.who, w.ns, w.doc)) for w in rec.own]
    for t, v, own, key in sorted(marks):
        ends, tops, owns = seen.setdefault(key, ([], [], []))
        if not tops or v > tops[-1]:
            ends.append(t), tops.append(v), owns.append(own)
        else:
            ends.append(t), tops.append(tops[-1]), owns.append(owns[-1])
    for r in rec.reads:
        times, tops = applied.get((r.ns, r.doc), ([], []))
        i = bisect.bisect_right(times, r.applied)
        if i and r.version < tops[i - 1]:
            bad("stale_reads", f"{r.ns} document {r.doc}: version {r.version} after version {tops[i - 1]} was applied")
        ends, tops2, owns = seen.get((r.who, r.ns, r.doc), ([], [], []))
        j = bisect.bisect_left(ends, r.t0)
        if j and r.version < tops2[j - 1]:
            key = "read_your_writes_violations" if owns[j - 1] else "monotonic_violations"
            what = "written" if owns[j - 1] else "read"
            bad(key, f"{r.ns} document {r.doc}: version {r.version} after manager {r.who} {what} {tops2[j - 1]}")
    return {**counts, "examples": examples}


# -- actors ------------------------------------------------------------------------


async def _docs(result: Any, pause: float = 0.0) -> list[Any]:
    """A read's documents: a cursor iterated (pausing ``pause`` after every
    second document, a batch of two), a document, or None."""
    if result is None:
        return []
    if isinstance(result, dict):
        return [result]
    out: list[Any] = []
    if hasattr(result, "__aiter__"):
        async for d in result:
            out.append(d)
            if pause and len(out) % 2 == 0:
                await asyncio.sleep(pause)
    else:
        for d in result:
            out.append(d)
            if pause and len(out) % 2 == 0:
                await asyncio.sleep(pause)
    return out


class Run:
    """One pattern on one path and API: its managers, record and clock."""

    def __init__(self, rec: Record, managers: Sequence[Any], dbs: Sequence[str], seconds: float, seed: str) -> None:
        self.rec, self.managers, self.dbs = rec, list(managers), list(dbs)
        self.until = time.monotonic() + seconds
        self.rng = random.Random(seed)
        self.versions: dict[tuple[str, int], int] = {}

    def going(self) -> bool:
        return time.monotonic() < self.until

    def coll(self, who: int, db: str, name: str = "items") -> Any:
        return self.managers[who][db][name]

    async def read(self, who: int, db: str, kind: str, target: int, name: str = "items", pause: float = 0.0) -> None:
        """One view read, recorded: ``id`` (find_one by _id) or ``group``
        (find of a group, in batches of two)."""
        coll = self.coll(who, db, name)
        applied = applied_time(self.managers[who], db)
        t0 = time.monotonic_ns()
        if kind == "id":
            docs = await _docs(await kit.resolved(coll.find_one({"_id": target})))
            want = [target]
        else:
            docs = await _docs(coll.find({"g": target}, batch_size=2), pause)
            want = [k for k in range(DOCS) if k % GROUPS == target]
        self.rec.read(who, f"{db}.{name}", docs, t0, time.monotonic_ns(), applied, want)

    async def reads(self, who: int, db: str, name: str = "items", pause: float = 0.0, n: int = 3) -> None:
        for _ in range(n):
            if self.rng.random() < 0.5:
                await self.read(who, db, "id", self.rng.randrange(DOCS), name)
            else:
                await self.read(who, db, "group", self.rng.randrange(GROUPS), name, pause)

    def next_version(self, ns: str, doc: int) -> int:
        v = self.versions[(ns, doc)] = self.versions.get((ns, doc), 0) + 1
        return v


def _other_writer(uri: str, dbs: Sequence[str], stop: threading.Event, rec: Record, seed: str) -> threading.Thread:
    """Another client's writes: ``$inc`` of a random document of ``OTHER`` in
    a random one of ``dbs``, until ``stop``."""

    def loop() -> None:
        rng = random.Random(seed)
        with pymongo.MongoClient(uri) as client:
            while not stop.is_set():
                db = rng.choice(list(dbs))
                client[db].items.update_one({"_id": rng.choice(list(OTHER))}, {"$inc": {"version": 1}})
                with rec.lock:
                    rec.other_writes += 1
                time.sleep(WRITE_PAUSE_S)

    thread = threading.Thread(target=loop, name="cqc-pattern-writer", daemon=True)
    thread.start()
    return thread


async def _readers(run: Run, who: int, db: str, pause: float = 0.0) -> None:
    while run.going():
        await run.reads(who, db, pause=pause)


async def multi_batch(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a = run.dbs[0]

    async def group_then_members_then_group() -> None:
        # A find in batches of two with writes landing between them, each of
        # its documents read by _id (newer versions, some), the find again.
        while run.going():
            g = run.rng.randrange(GROUPS)
            await run.read(0, a, "group", g, pause=BATCH_PAUSE_S)
            for k in range(g, DOCS, GROUPS):
                await run.read(0, a, "id", k)
            await run.read(0, a, "group", g, pause=BATCH_PAUSE_S)

    return [group_then_members_then_group, lambda: _readers(run, 0, a, BATCH_PAUSE_S)]


async def same_client(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a, b = run.dbs
    raw = run.coll(0, a).raw

    async def other_db_and_raw() -> None:
        while run.going():
            await run.reads(0, b)
            await kit.resolved(raw.find_one({"_id": run.rng.randrange(DOCS)}))  # not judged: outside the views

    return [lambda: _readers(run, 0, a, BATCH_PAUSE_S), other_db_and_raw]


async def listener_writes(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a = run.dbs[0]
    raw = run.coll(0, a).raw

    async def write_raw_then_read() -> None:
        while run.going():
            doc = run.rng.choice(list(OWN))
            got = await kit.resolved(
                raw.find_one_and_update({"_id": doc}, {"$inc": {"version": 1}}, return_document=ReturnDocument.AFTER)
            )
            run.rec.wrote(0, f"{a}.items", doc, got["version"], time.monotonic_ns())
            await run.read(0, a, "id", doc)
            await run.read(0, a, "group", doc % GROUPS)

    return [write_raw_then_read, lambda: _readers(run, 0, a)]


async def transaction_writes(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a = run.dbs[0]
    view = run.coll(0, a)
    client = run.managers[0].client
    ns = f"{a}.items"

    async def write_in_transaction_then_read() -> None:
        while run.going():
            one, many = run.rng.sample(list(OWN), 2)
            v1, v2 = run.next_version(ns, one), run.next_version(ns, many)
            session = await kit.resolved(client.start_session())
            try:
                await kit.resolved(session.start_transaction())
                await kit.resolved(view.update_one({"_id": one}, {"$set": {"version": v1}}, session=session))
                await kit.resolved(view.update_many({"_id": {"$in": [many]}}, {"$set": {"version": v2}}, session=session))
                await kit.resolved(session.commit_transaction())
            finally:
                await kit.resolved(session.end_session())
            ack = time.monotonic_ns()
            run.rec.wrote(0, ns, one, v1, ack)
            run.rec.wrote(0, ns, many, v2, ack)
            await run.read(0, a, "id", one)
            await run.read(0, a, "group", many % GROUPS)

    return [write_in_transaction_then_read, lambda: _readers(run, 0, a)]


async def merge_elsewhere(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a, b = run.dbs
    source = run.coll(0, a)
    ns = f"{b}.merged"

    async def merge_then_read() -> None:
        while run.going():
            doc = run.rng.choice(list(OWN))
            v = run.next_version(ns, doc)
            pipeline = [
                {"$match": {"_id": doc}},
                {"$project": {"_id": 1, "g": 1, "version": {"$literal": v}}},
                {"$merge": {"into": {"db": b, "coll": "merged"}, "whenMatched": "merge"}},
            ]
            await _docs(await kit.resolved(source.aggregate(pipeline)))
            run.rec.wrote(0, ns, doc, v, time.monotonic_ns())
            await run.read(0, b, "id", doc, "merged")
            await run.read(0, b, "group", doc % GROUPS, "merged")

    async def read_merged() -> None:
        while run.going():
            await run.reads(0, b, "merged")

    return [merge_then_read, read_merged]


async def cross_worker(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a = run.dbs[0]
    return [lambda: _readers(run, 0, a), lambda: _readers(run, 1, a)]


async def two_databases(run: Run) -> list[Callable[[], Awaitable[None]]]:
    a, b = run.dbs

    async def both() -> None:
        while run.going():
            await run.reads(0, a)
            await run.reads(0, b)

    return [both, lambda: _readers(run, 0, b)]


ACTORS = {
    "multi_batch": multi_batch,
    "same_client": same_client,
    "listener_writes": listener_writes,
    "transaction_writes": transaction_writes,
    "merge_elsewhere": merge_elsewhere,
    "cross_worker": cross_worker,
    "two_databases": two_databases,
}


# -- one pattern on one path and API ---------------------------------------------


def _seed(client: pymongo.MongoClient[Any], dbs: Sequence[str]) -> None:
    docs = [{"_id": k, "g": k % GROUPS, "version": 0} for k in range(DOCS)]
    for db in dbs:
        for name in ("items", "merged"):
            client[db][name].drop()
            client[db][name].insert_many(docs)


async def _actors_async(actors: Sequence[Callable[[], Awaitable[None]]]) -> None:
    await asyncio.gather(*(actor() for actor in actors))


def _actors_in_threads(actors: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Each actor in a thread of its own (the sync API: its calls block)."""
    errors: list[BaseException] = []

    def main(actor: Callable[[], Awaitable[None]]) -> None:
        try:
            asyncio.run(actor())  # type: ignore[arg-type]
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(a,), daemon=True) for a in actors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


async def _run(
    pattern: str,
    uri: str,
    path: str,
    owner: str | None,
    dbs: Sequence[str],
    seconds: float,
    timeout: float,
    seed: str,
    is_async: bool,
    cqc: Any,
) -> tuple[Record, list[dict[str, int]]]:
    rec = Record()
    listeners = [cqc.CausalListener()] if pattern == "listener_writes" else []
    client_cls = pymongo.AsyncMongoClient if is_async else pymongo.MongoClient
    manager_cls = cqc.AsyncCacheManager if is_async else cqc.CacheManager
    clients, managers = [], []
    try:
        for _ in range(2 if pattern == "cross_worker" else 1):
            client = client_cls(uri, event_listeners=listeners)
            clients.append(client)
            managers.append(manager_cls(client, shared=owner) if owner else manager_cls(client, **LOCAL))
        for m in managers:
            for db in dbs:
                for name in ("items", "merged"):
                    await kit.resolved(m[db][name].find_one({"_id": 0}))
                if not await kit.resolved(m.wait_ready(timeout, database=db)):
                    raise BenchmarkFailed(f"{pattern} {path}: the change stream of {db} did not become ready")
        before = [m.snapshot() for m in managers]
        run = Run(rec, managers, dbs, seconds, seed)
        actors = await ACTORS[pattern](run)
        stop = threading.Event()
        writer = _other_writer(uri, dbs, stop, rec, seed)
        try:
            if is_async:
                await _actors_async(actors)
            else:
                await asyncio.to_thread(_actors_in_threads, actors)
        finally:
            stop.set()
            writer.join(10)
        counts = [kit.counted(b, m.snapshot()) for b, m in zip(before, managers)]
    finally:
        for m in managers:
            await kit.resolved(m.close())
        for c in clients:
            await kit.resolved(c.close())
    return rec, counts


def run_pattern(
    pattern: str, uri: str, *, path: str, api: str, owner: str | None, db_prefix: str, seconds: float, timeout: float, seed: str
) -> dict[str, Any]:
    """One pattern on one path and API: its figures and judgement."""
    import client_query_cache as cqc

    dbs = [f"{db_prefix}_a", f"{db_prefix}_b"]
    with pymongo.MongoClient(uri) as client:
        _seed(client, dbs)
    events = Events(uri, dbs)
    try:
        rec, counts = asyncio.run(
            _run(pattern, uri, path, owner, dbs, seconds, timeout, f"{seed}/{pattern}/{path}/{api}", api == "async", cqc)
        )
        time.sleep(0.5)  # the watchers see the last writes' events
    finally:
        events.close()
        with pymongo.MongoClient(uri) as client:
            for db in dbs:
                kit.quietly(client.drop_database, db)
    verdict = judge(rec, events)
    return {
        "pattern": pattern,
        "path": path,
        "api": api,
        "reads": rec.calls,
        "documents_checked": len(rec.reads),
        "own_writes": len(rec.own),
        "other_writes": rec.other_writes,
        "hits": sum(c["hits"] for c in counts),
        "misses": sum(c["misses"] for c in counts),
        "behind": sum(c["behind"] for c in counts),
        "wrong_results": len(rec.wrong),
        **{k: verdict[k] for k in ("stale_reads", "monotonic_violations", "read_your_writes_violations")},
        "examples": (rec.wrong + verdict["examples"])[:MAX_EXAMPLES],
    }
