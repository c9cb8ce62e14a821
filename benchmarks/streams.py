"""Streams: what one change-stream follower costs for 1 to 500 databases, and how fast it invalidates.

A cache follows every database it serves on one follower: one native thread
and one connection (a process-local ``CacheManager``'s, or a shared cache's
owner's), with one deployment-wide change stream by default. For each mode
(``local``: a ``CacheManager`` in this process; ``shared``: an owner started
for the run, this process attached to it as a worker) and each count N of
``--dbs``, a run starts from nothing: N new databases, each with a
collection ``t`` of a few documents ``{"_id": k, "v": 0}`` (at least
``MIN_DOCUMENTS``, more where N is small, so that no document is written
twice), a new cache whose follower announces an application name of its own
(``stream_uri`` with ``appName``; the owner's connection string in shared
mode), and dropped databases at its end.

Setup: the documents are inserted by another client; one read of a document
of each database through the cache registers the database (the follower
widens its stream's ``$match``, adding databases in batches); then the run
waits until every database's stream state is healthy (``snapshot()``) and
reads every document, pass after pass, until a whole pass is served from
the cache. Measured, from outside the cache:

* ``stream_threads``: the threads the follower adds: of this process from
  before the manager to after every database serves (local), of the owner's
  process from after the worker attached to after every database serves
  (shared); also after the first database serves;
* ``stream_connections``: the server's connections (``currentOp`` with
  ``$all``) announcing the follower's application name;
* ``served``: the databases whose read of a cached document was a hit;
* idle, for ``--idle-seconds`` without writes: the follower's getMores a
  second (its own count, one figure for all its databases), the server's
  (``serverStatus`` ``opcounters.getmore``: every client's), and the
  follower's CPU in ms a second (local: the CPU-time clocks of the threads
  that appeared with the manager; shared: the owner process's clock);
* memory: VmRSS of this process before the manager and after every
  database serves (local), of the owner from after the worker attached
  (shared);
* invalidation latency, ``--samples`` samples, the databases dealt in a
  seeded random order each round (every database once a round), a document
  each never written before: a read of it must be a hit (checked with the
  hit counter; retried until it is), then another client sets its ``v``,
  and the view's ``find_one`` polls it (``POLL_PAUSE_S`` apart) until it returns the
  new value; the latency is from the write's acknowledgement to the return
  of that read. Every read is checked: before the new value only the
  previous one, then the new one in ``CONFIRM_READS`` more reads; any other
  value is a violation. A sample whose new value is not read within
  ``POLL_TIMEOUT_S`` is a timeout. The follower's CPU over the phase too.

Checks, at every N of each mode: at most ``MAX_THREADS`` stream threads and
``MAX_CONNECTIONS`` stream connections, every database served, no violation,
no timeout, every sampled document cached before its write. A full run also
checks, per mode, the p95 latency at N = ``JUDGED_DATABASES`` (else the
largest N) over the p95 at N = 1
(``ratios.<mode>_p95_over_one_database``, at most ``MAX_P95_RATIO``); a
quick run reports it.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.streams`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import random
import secrets
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pymongo

from . import _kit as kit
from ._kit import MAX_EXAMPLES, MiB, Status

SCHEMA = "cqc.streams/1"
MODES = ("local", "shared")
SCOPES = ("deployment", "database")
FULL = {"dbs": (1, 10, 100, 200, 500), "samples": 400, "idle_seconds": 5.0}
QUICK = {"dbs": (1, 10, 50), "samples": 60, "idle_seconds": 2.0}
#: The arena's namespace table: one collection per database.
MAX_DATABASES = 768
#: Documents of each database at least; more where ``--samples`` needs them.
MIN_DOCUMENTS = 4
#: The product's default wait of a change-stream getMore.
MAX_AWAIT_MS = 1000
#: The cache's budget in both modes: small, so that its arena adds little to the RSS.
BUDGET_BYTES = 8 * MiB
#: A latency sample that has not read its new value after this long is a timeout.
POLL_TIMEOUT_S = 10.0
#: Reads after a sample's first read of the new value, each of which must return it.
CONFIRM_READS = 3
#: The checks.
MAX_THREADS = 4
MAX_CONNECTIONS = 2
MAX_P95_RATIO = 1.5
#: The count the latency ratio is judged at (issue 33's), or the largest
#: count of the run when it has not that one.
JUDGED_DATABASES = 200
#: The pause between two polls of a written document: a tight loop would
#: hold a core of two from the server and the follower it waits for.
POLL_PAUSE_S = 0.0001
#: What a full run is held to (docs/benchmarks.md, "Targets"): a check too.
TARGETS = (kit.Target("ratios.*", "<=", MAX_P95_RATIO),)


# -- the process, seen from /proc ---------------------------------------------------


def threads_of(pid: int) -> set[int]:
    """The thread ids of process ``pid``."""
    return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid``."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        kib = next(line.split()[1] for line in fh if line.startswith("VmRSS:"))
    return int(kib) * 1024


def cpu_ns(clocks: Sequence[int]) -> int:
    """CPU time of the clocks (``clock_getcpuclockid``'s: ``((~id) << 3) | 2`` for a process,
    ``| 6`` for a thread of this one), in ns; a thread that has ended counts nothing."""
    total = 0
    for clock in clocks:
        with contextlib.suppress(OSError):
            total += time.clock_gettime_ns(clock)
    return total


@dataclasses.dataclass(frozen=True, slots=True)
class Before:
    """A process's threads and RSS before the follower."""

    threads: frozenset[int]
    rss: int

    @classmethod
    def of(cls, pid: int) -> Before:
        return cls(frozenset(threads_of(pid)), rss_bytes(pid))


def server_getmores(admin: pymongo.MongoClient[Any]) -> int | None:
    """The server's getMore count (every client's), None where ``serverStatus`` has none."""
    return admin.admin.command("serverStatus").get("opcounters", {}).get("getmore")


# -- the cache of a run ----------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Cache:
    """A run's cache: its manager (this process's reads) and, in shared mode, its owner. The
    follower is observed where it runs: the owner's process, or in local mode this process's
    threads that appeared with the manager (``follower_tids``, known once every database serves)."""

    manager: Any
    owner: Any = None
    follower_tids: frozenset[int] = frozenset()

    @property
    def pid(self) -> int:
        return self.owner.pid if self.owner is not None else os.getpid()

    def cpu_ns(self) -> int:
        if self.owner is not None:
            return cpu_ns([((~self.owner.pid) << 3) | 2])
        return cpu_ns([((~tid) << 3) | 6 for tid in self.follower_tids])

    def streams(self) -> list[dict[str, Any]]:
        """The follower's entries, one per database (the owner's snapshot in shared mode)."""
        if self.owner is not None:
            return list(self.owner.snapshot()["streams"])
        keys = ("database", "getmores", "scope", "scope_reason")
        return [{k: getattr(s, k) for k in keys} for s in self.manager.snapshot().streams]

    def getmores(self) -> int:
        """The follower's getMores (every entry carries the same figure)."""
        return int(self.streams()[0]["getmores"])

    def healthy(self, names: Sequence[str]) -> int:
        """How many of the databases ``names`` this process's manager sees on a healthy stream."""
        states = {s.database: s.state.value for s in self.manager.snapshot().streams}
        return sum(states.get(name) == "healthy" for name in names)


@contextlib.contextmanager
def opened(mode: str, client: pymongo.MongoClient[Any], stream_uri: str, scope: str) -> Iterator[Cache]:
    """A new cache of ``mode`` on ``client`` whose follower connects with ``stream_uri``; closed,
    and its owner stopped, when the block ends."""
    from client_query_cache import CacheManager

    if mode == "local":
        options = {"budget_bytes": BUDGET_BYTES, "max_await_time_ms": MAX_AWAIT_MS, "stream_scope": scope}
        with CacheManager(client, stream_uri=stream_uri, **options) as manager:
            yield Cache(manager)
        return
    geometry = {"arena_bytes": None, "budget_bytes": BUDGET_BYTES, "slots": None, "stream_scope": scope}
    with kit.checked_owner(stream_uri, "cqc-streams", **geometry) as owner:
        with CacheManager(client, shared=owner.name) as manager:
            yield Cache(manager, owner)


# -- checked reads ------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class Reads:
    """The checked reads of a run: how many, the violations (a value the read may not return)
    with a few examples, and the latency samples."""

    count: int = 0
    violations: int = 0
    examples: list[str] = dataclasses.field(default_factory=list)
    samples_ns: list[int] = dataclasses.field(default_factory=list)
    timeouts: int = 0
    uncached: int = 0

    def check(self, view: Any, key: int, doc: Any, allowed: Sequence[int], what: str) -> int | None:
        """``v`` of ``doc``, a read of document ``key`` through ``view``: a violation unless in ``allowed``."""
        got = doc.get("v") if doc is not None and doc.get("_id") == key else None
        self.count += 1
        if got not in allowed:
            self.violations += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{view.full_name} {key}: {what} read {doc!r}, expected v in {list(allowed)}")
        return got


def hit(manager: Any, reads: Reads, view: Any, key: int, allowed: Sequence[int], what: str) -> bool:
    """A checked read of document ``key``: whether the cache served it."""
    before = manager.snapshot().hits
    doc = view.find_one({"_id": key})
    after = manager.snapshot().hits
    reads.check(view, key, doc, allowed, what)
    return after > before


def served(manager: Any, reads: Reads, views: Sequence[Any], timeout: float) -> int:
    """How many databases serve a read of their document 0 from the cache, each asked again
    (every 0.1 s) until it does or ``timeout`` seconds pass."""
    pending = list(views)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [view for view in pending if not hit(manager, reads, view, 0, (0,), "a served read")]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return len(views) - len(pending)


def sample(cache: Cache, reads: Reads, view: Any, writer: Any, key: int, new: int) -> None:
    """One latency sample: document ``key`` (at ``v`` 0) cached, set to ``new`` by ``writer``
    (another client's collection), then polled through ``view`` until it reads ``new``."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while not hit(cache.manager, reads, view, key, (0,), "a cached read"):
        if time.monotonic() > deadline:
            reads.uncached += 1
            return
        time.sleep(0.005)
    writer.update_one({"_id": key}, {"$set": {"v": new}})
    acked = time.monotonic_ns()
    limit = acked + int(POLL_TIMEOUT_S * 1e9)
    while True:
        doc = view.find_one({"_id": key})
        now = time.monotonic_ns()
        if reads.check(view, key, doc, (0, new), "a read after the write") == new:
            break
        if now > limit:
            reads.timeouts += 1
            return
        time.sleep(POLL_PAUSE_S)
    reads.samples_ns.append(now - acked)
    for _ in range(CONFIRM_READS):
        reads.check(view, key, view.find_one({"_id": key}), (new,), "a read after the new value")


def latency(cache: Cache, reads: Reads, views: Sequence[Any], writers: Sequence[Any], samples: int, seed: Any) -> None:
    """``samples`` samples, the databases in a seeded random order each round, round ``r``
    writing each database's document ``r`` (to ``v`` = the sample's number)."""
    rng = random.Random(seed)
    n = len(views)
    order = [(r, i) for r in range(math.ceil(samples / n)) for i in rng.sample(range(n), n)]
    for s, (r, i) in enumerate(order[:samples]):
        sample(cache, reads, views[i], writers[i], r, s + 1)


# -- a run ------------------------------------------------------------------------------


def documents(n: int, samples: int) -> int:
    """Documents per database: enough that no sample writes a document twice."""
    return max(MIN_DOCUMENTS, math.ceil(samples / n))


def serve(cache: Cache, views: Sequence[Any], names: Sequence[str], docs: int, timeout: float) -> dict[str, Any]:
    """Register every database (a read each), wait until each one's stream is healthy, then read
    every document, pass after pass, until a whole pass hits: the seconds of each step, the
    databases healthy and the passes (0: ``timeout`` seconds passed first)."""
    started = time.perf_counter()
    for view in views:
        view.find_one({"_id": 0})
    registered = time.perf_counter()
    kit.wait_until(lambda: cache.healthy(names) == len(names), timeout, pause=0.05)
    ready = time.perf_counter()
    warm = [lambda v=view, k=k: v.find_one({"_id": k}) for view in views for k in range(docs)]
    passes = asyncio.run(kit.warmed(cache.manager, warm, timeout))
    done = time.perf_counter()
    return {
        "seconds": done - started, "register_s": registered - started, "healthy_s": ready - registered,
        "warm_s": done - ready, "healthy": cache.healthy(names), "warm_passes": passes,
    }  # fmt: skip


def cpu_ms_per_s(cache: Cache, before: tuple[int, float]) -> float:
    """The follower's CPU ms a wall second since ``before`` (its ``cpu_ns()`` and monotonic seconds)."""
    return (cache.cpu_ns() - before[0]) / 1e6 / (time.monotonic() - before[1])


def idle(cache: Cache, admin: pymongo.MongoClient[Any], seconds: float) -> dict[str, Any]:
    """``seconds`` without writes: the follower's and the server's getMores a second (None where
    the server counts none), the follower's CPU."""
    getmores, server = cache.getmores(), server_getmores(admin)
    cpu = (cache.cpu_ns(), time.monotonic())
    time.sleep(seconds)
    cpu_rate, wall = cpu_ms_per_s(cache, cpu), time.monotonic() - cpu[1]
    server_after = server_getmores(admin)
    return {
        "seconds": wall,
        "getmores_per_s": (cache.getmores() - getmores) / wall,
        "server_getmores_per_s": None if server is None or server_after is None else (server_after - server) / wall,
        "cpu_ms_per_s": cpu_rate,
    }


def follower_pipeline(names: Sequence[str]) -> list[dict[str, Any]]:
    """The deployment-wide stream's pipeline over the databases ``names``, as the follower
    builds it (csrc/stream.c, ``make_pipeline``)."""
    match = {"$or": [{"ns.db": {"$in": list(names)}}, {"operationType": "rename"}, {"ns": {"$exists": False}}]}
    fields = ("operationType", "ns", "documentKey", "clusterTime", "wallTime", "to")
    return [{"$match": match}, {"$project": dict.fromkeys(fields, 1)}]


def server_delivery(uri: str, admin: Any, names: Sequence[str], samples: int, seed: str) -> dict[str, Any]:
    """The control: how fast the server alone delivers an event to a plain PyMongo
    deployment-wide stream with the follower's pipeline over ``names``, from an insert's
    acknowledgement to the event's arrival in the thread waiting on the stream, 0 when it
    arrived first (the databases dealt at random, ``POLL_PAUSE_S`` between two looks)."""
    arrived: dict[tuple[str, str], int] = {}
    stop = threading.Event()
    latencies: list[int] = []
    with pymongo.MongoClient(uri) as watcher:
        stream = watcher.watch(follower_pipeline(names), max_await_time_ms=MAX_AWAIT_MS)

        def wait_for_events() -> None:
            while not stop.is_set():
                change = stream.try_next()
                if change is not None:
                    arrived[(change["ns"]["db"], change["documentKey"]["_id"])] = time.monotonic_ns()

        thread = threading.Thread(target=wait_for_events, name="cqc-streams-control", daemon=True)
        thread.start()
        try:
            rng = random.Random(seed)
            for i in range(samples):
                key = (names[rng.randrange(len(names))], f"control-{i}")
                admin[key[0]].control.insert_one({"_id": key[1]})
                acked = time.monotonic_ns()
                limit = acked + int(POLL_TIMEOUT_S * 1e9)
                while key not in arrived and time.monotonic_ns() < limit:
                    time.sleep(POLL_PAUSE_S)
                if key in arrived:
                    # The watching thread can take the event before this one
                    # has returned from the insert (a loaded machine): it
                    # was delivered by the acknowledgement, 0.
                    latencies.append(max(0, arrived[key] - acked))
        finally:
            stop.set()
            thread.join(POLL_TIMEOUT_S)
            stream.close()
    return {**kit.in_ms(latencies), "samples": samples, "lost": samples - len(latencies)}


def measure(args: argparse.Namespace, uri: str, mode: str, n: int, status: Status) -> dict[str, Any]:
    """One run: N new databases, a new cache, its figures; the databases dropped at the end."""
    tag = secrets.token_hex(4)
    names = [f"cqc_streams_{tag}_{i}" for i in range(n)]
    docs = documents(n, args.samples)
    app = f"cqc-streams-{tag}"
    with pymongo.MongoClient(uri) as admin, pymongo.MongoClient(uri) as client:
        started = time.perf_counter()
        try:
            for name in names:
                admin[name].t.insert_many([{"_id": k, "v": 0} for k in range(docs)])
            client.admin.command("ping")  # the client's own threads and connections first
            status(f"{mode} x{n}: {n * docs:,} documents inserted in {time.perf_counter() - started:.1f}s")
            out = {"databases": n, "documents_per_database": docs, "insert_s": time.perf_counter() - started}
            before = Before.of(os.getpid())
            with opened(mode, client, kit.with_app_name(uri, app), args.scope) as cache:
                out |= follow(args, cache, admin, names, app, before, status)
            out["connections_after_close"] = kit.connections_named(admin, app)
            if mode == args.modes[0]:
                status(f"control: {args.samples} events to a plain stream with the same pipeline")
                out["server_delivery"] = server_delivery(uri, admin, names, args.samples, f"{args.seed}-{n}")
            return out
        finally:
            for name in names:
                with contextlib.suppress(pymongo.errors.PyMongoError):
                    admin.drop_database(name)


def follow(
    args: argparse.Namespace, cache: Cache, admin: Any, names: Sequence[str], app: str, before: Before, status: Status
) -> dict[str, Any]:
    """The figures of one cache; ``before`` is this process's before the manager (shared mode
    takes the owner's instead, before the first read)."""
    if cache.owner is not None:
        before = Before.of(cache.pid)
    views = [cache.manager[name].t for name in names]
    docs, timeout = documents(len(names), args.samples), 60.0 + 0.2 * len(names)
    setup_first = serve(cache, views[:1], names[:1], docs, timeout)
    first = (threads_of(cache.pid) - before.threads, kit.connections_named(admin, app))
    setup = serve(cache, views, names, docs, timeout)
    added, rss = threads_of(cache.pid) - before.threads, rss_bytes(cache.pid)
    connections = kit.connections_named(admin, app)
    if cache.owner is None:
        cache.follower_tids = frozenset(added)
    reads = Reads()
    out: dict[str, Any] = {
        "stream_threads_first": len(first[0]),
        "stream_threads": len(added),
        "thread_names": sorted(thread_name(cache.pid, tid) for tid in added),
        "stream_connections_first": first[1],
        "stream_connections": connections,
        "setup_first": setup_first,
        "setup": setup,
        "rss": {"before_bytes": before.rss, "after_bytes": rss, "growth_bytes": rss - before.rss},
        "served": served(cache.manager, reads, views, timeout),
    }
    streams = [s for s in cache.streams() if s["database"] in set(names)]
    out["scope"] = sorted({str(s["scope"]) for s in streams})
    out["scope_reason"] = sorted({str(s["scope_reason"]) for s in streams})
    status(f"{len(names)} databases served: {out['served']}; idle for {args.idle_seconds:g}s")
    out["idle"] = idle(cache, admin, args.idle_seconds)
    status(f"{args.samples} latency samples")
    writers = [admin[name].t for name in names]
    cpu = (cache.cpu_ns(), time.monotonic())
    latency(cache, reads, views, writers, args.samples, f"{args.seed}-{len(names)}")
    out["latency"] = {
        **kit.in_ms(reads.samples_ns),
        "cpu_ms_per_s": cpu_ms_per_s(cache, cpu),
        "samples": args.samples,
        "reads_checked": reads.count,
        "violations": reads.violations,
        "violation_examples": reads.examples,
        "timeouts": reads.timeouts,
        "uncached": reads.uncached,
    }
    return out


def thread_name(pid: int, tid: int) -> str:
    """A thread's name (``comm``), "?" if it has ended."""
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    from client_query_cache import __version__

    report: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "settings": {
            "dbs": list(args.dbs), "modes": list(args.modes), "scope": args.scope, "samples": args.samples,
            "idle_seconds": args.idle_seconds, "seed": args.seed, "max_await_time_ms": MAX_AWAIT_MS,
            "budget_bytes": BUDGET_BYTES, "min_documents": MIN_DOCUMENTS, "poll_timeout_s": POLL_TIMEOUT_S,
            "confirm_reads": CONFIRM_READS, "judged_databases": JUDGED_DATABASES if JUDGED_DATABASES in args.dbs else max(args.dbs),
            "client_query_cache": __version__, "checkout": kit.checkout(), "external_deployment": kit.external(),
        },  # fmt: skip
        "machine": {**kit.machine_facts(), "loadavg_at_start": list(os.getloadavg())},
        "results": {mode: {} for mode in args.modes},
    }
    for mode in args.modes:
        for n in args.dbs:
            status(f"{mode}: {n} databases")
            row = report["results"][mode][str(n)] = measure(args, uri, mode, n, status)
            lat = row["latency"]
            status(
                f"{mode} x{n}: {row['stream_threads']} threads, {row['stream_connections']} connections, "
                f"latency p50 {lat['p50']:.2f} ms p95 {lat['p95']:.2f} ms, {lat['violations']} violations"
            )
    report["ratios"] = ratios(report)
    report["server_p95_over_one_database"] = control_ratio(report)
    return report


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """Per mode with a run at one database: the p95 latency at the judged count over that run's."""
    judged = str(report["settings"]["judged_databases"])
    out = {}
    for mode, rows in report["results"].items():
        if "1" in rows and rows["1"]["latency"]["p95"] > 0:
            out[f"{mode}_p95_over_one_database"] = rows[judged]["latency"]["p95"] / rows["1"]["latency"]["p95"]
    return out


def control_ratio(report: dict[str, Any]) -> float | None:
    """The control's p95 at the judged count over its p95 at one database: what the server's
    own delivery adds (not a target)."""
    judged = str(report["settings"]["judged_databases"])
    rows = report["results"][report["settings"]["modes"][0]]
    if "1" not in rows or judged not in rows:
        return None
    one, many = rows["1"]["server_delivery"], rows[judged]["server_delivery"]
    return many["p95"] / one["p95"] if one["n"] and many["n"] and one["p95"] > 0 else None


def problems_of(report: dict[str, Any]) -> list[str]:
    """The checks: at every count, the follower's threads and connections, every database
    served, every read allowed, every sample cached and read back in time; in a full run the
    p95 latency ratios too."""
    problems = []
    for mode, rows in report["results"].items():
        for n, r in rows.items():
            where, lat = f"{mode} with {n} databases", r["latency"]
            if r["stream_threads"] > MAX_THREADS:
                problems.append(f"{where}: the follower added {r['stream_threads']} threads (at most {MAX_THREADS})")
            if r["stream_connections"] > MAX_CONNECTIONS:
                conns = r["stream_connections"]
                problems.append(f"{where}: {conns} stream connections (at most {MAX_CONNECTIONS})")
            if r["served"] < r["databases"]:
                problems.append(f"{where}: {r['databases'] - r['served']} databases never served a hit")
            if lat["violations"]:
                wrong = f"{lat['violations']} reads returned what they may not"
                problems.append(f"{where}: {wrong}: {lat['violation_examples']}")
            if lat["timeouts"]:
                problems.append(f"{where}: {lat['timeouts']} writes not read back within {POLL_TIMEOUT_S:g}s")
            if lat["uncached"]:
                problems.append(f"{where}: {lat['uncached']} sampled documents never served from the cache")
    if report["mode"] == "full":
        for name, value in report["ratios"].items():
            if value > MAX_P95_RATIO:
                problems.append(f"{name} = {value:.2f} (at most {MAX_P95_RATIO:g})")
    return problems


def print_report(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"streams: scope {s['scope']}, {s['samples']} latency samples per run, idle {s['idle_seconds']:g}s, "
        f"max_await_time_ms {s['max_await_time_ms']}; thr/conn: the follower's threads and connections "
        "(after the first database, after all); cpu: the follower's ms a second (local: its threads; "
        "shared: the owner process); rss: this process (local) or the owner (shared), growth and after"
    )
    columns = [
        ("mode", "<6"), ("dbs", ">4"), ("thr@1", ">5"), ("thr", ">3"), ("conn@1", ">6"), ("conn", ">4"),
        ("served", ">6"), ("scope", "<10"), ("gm/s", ">5.2f"), ("srv gm/s", ">8.2f"), ("idle cpu", ">8.2f"),
        ("lat cpu", ">7.2f"), ("rss+ MiB", ">8.1f"), ("rss MiB", ">7.1f"), ("p50 ms", ">7.2f"),
        ("p95 ms", ">7.2f"), ("max ms", ">7.2f"), ("n", ">4"), ("reads", ">7"), ("viol", ">4"), ("t/o", ">3"),
        ("setup s", ">7.1f"),
    ]  # fmt: skip
    rows = []
    for mode, runs in report["results"].items():
        for n, r in runs.items():
            lat, idle_, rss = r["latency"], r["idle"], r["rss"]
            rows.append((
                mode, int(n), r["stream_threads_first"], r["stream_threads"], r["stream_connections_first"],
                r["stream_connections"], r["served"], ",".join(r["scope"]), kit.cell(idle_["getmores_per_s"]),
                kit.cell(idle_["server_getmores_per_s"]), idle_["cpu_ms_per_s"], lat["cpu_ms_per_s"],
                rss["growth_bytes"] / MiB, rss["after_bytes"] / MiB, kit.cell(lat["p50"]), kit.cell(lat["p95"]),
                kit.cell(lat["max"]), lat["n"], lat["reads_checked"], lat["violations"], lat["timeouts"],
                r["insert_s"] + r["setup_first"]["seconds"] + r["setup"]["seconds"],
            ))  # fmt: skip
    kit.table(columns, rows)
    for mode, runs in report["results"].items():
        for n, r in runs.items():
            reasons = [reason for reason in r["scope_reason"] if reason]
            if reasons:
                print(f"  {mode} x{n} scope reason: {'; '.join(reasons)}")
    for name, value in report["ratios"].items():
        print(f"{name} (at {s['judged_databases']} databases): {value:.2f}")
    controls = [(int(n), r["server_delivery"]) for n, r in report["results"][s["modes"][0]].items()]
    print("control, the server alone (a plain stream with the same pipeline, insert acknowledged to event received):")
    for n, c in controls:
        print(f"  {n:>4} databases: p50 {c['p50']:.2f} ms, p95 {c['p95']:.2f} ms, {c['lost']} lost")
    if report["server_p95_over_one_database"] is not None:
        ratio = report["server_p95_over_one_database"]
        print(f"server_p95_over_one_database (at {s['judged_databases']} databases, not a target): {ratio:.2f}")


def _counts(text: str) -> tuple[int, ...]:
    """``--dbs``: a comma-separated list of database counts, each from 1 to the arena's limit."""
    try:
        counts = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("a comma-separated list of whole numbers") from None
    if not counts or counts[0] < 1 or counts[-1] > MAX_DATABASES:
        raise argparse.ArgumentTypeError(f"each count from 1 to {MAX_DATABASES}")
    return counts


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("streams", __doc__, seed=20261207)
    add = parser.add_argument
    add("--quick", action="store_true", help="1, 10 and 50 databases, 60 samples, 2 s idle (a smoke run)")
    add("--dbs", type=_counts, help="comma-separated database counts (default 1,10,100,200,500; quick 1,10,50)")
    add("--modes", type=kit.csv(MODES), default=MODES, help="comma-separated: local,shared")
    add("--scope", choices=SCOPES, default="deployment", help="the caches' stream_scope (default deployment)")
    add("--samples", type=int, help="latency samples per run (default 400, quick 60)")
    add("--idle-seconds", type=float, help="the idle window (default 5, quick 2)")
    args = parser.parse_args(argv)
    kit.defaults(args, QUICK if args.quick else FULL)
    kit.at_least_one(parser, args, ("samples",))
    if args.idle_seconds <= 0:
        parser.error("--idle-seconds must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # The latency ratio needs a run at one database.
    targets = TARGETS if 1 in args.dbs else ()
    return kit.checked_main(
        args, run, problems_of, print_report, timed=True, elapsed=True, targets=targets, quick=args.quick
    )


if __name__ == "__main__":
    sys.exit(main())
