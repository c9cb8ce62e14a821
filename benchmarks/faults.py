"""Fault injection: faults of the link, the stream, the server, the owner and
the workers, while a cache serves reads and a writer writes.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.faults`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import pymongo
from bson.int64 import Int64
from pymongo.errors import PyMongoError

from . import _kit as kit
from ._kit import MAX_EXAMPLES, NEVER, BenchmarkFailed, Status
from ._oracle import Oracle, Rows, Verdict, Write, applied_time, judge
from ._proxy import FaultProxy

SCHEMA = "cqc.faults/1"
DOCS = 8
MAX_AWAIT_MS = 200
STALL_BOUND_S = (2 * MAX_AWAIT_MS + 2000) / 1000
WRITE_INTERVAL_S = 0.010
READ_PAUSE_S = 0.002
NORMAL_S = 0.5
AFTER_S = 0.5
KiB = 1024


class FaultRunFailed(BenchmarkFailed):
    """The harness itself could not run a scenario."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    inject: Callable[[Context], None] | None = None
    heal: Callable[[Context], None] | None = None
    #: The server is down when the manager is created.
    down_at_start: bool = False
    #: A shared cache (owner + this process as a worker) instead of a local one.
    shared: bool = False
    #: Bytes of padding per document.
    pad_bytes: int = 0
    docs: int = DOCS
    budget_bytes: int = 32 * 1024 * KiB
    max_entry_bytes: int = 1024 * KiB
    #: Warm up until every document hits (False: the arena cannot hold them
    #: all; one pass).
    warm_all: bool = True
    #: Called after the warm-up, before the normal period.
    prepare: Callable[[Context], None] | None = None


@dataclasses.dataclass
class Context:
    """What a scenario's faults act on, and how each fault is made and healed."""

    scenario: Scenario
    server: Any
    proxy: FaultProxy
    admin: pymongo.MongoClient[Any]
    db: str = "faults"
    coll: str = "docs"
    #: Shared scenarios: the owner and its name.
    owner: Any = None
    owner_name: str = dataclasses.field(default_factory=lambda: f"faults-{secrets.token_hex(4)}")
    #: Spawned worker processes (worker_killed).
    workers: list[Any] = dataclasses.field(default_factory=list)
    #: The cached collection the reader reads.
    cached: Any = None
    #: Its manager.
    manager: Any = None
    #: ring_full: while the reads that fill the ring ran (and the reader's
    #: beside them), admissions the ring refused, admissions refused for
    #: other reasons, and reads that bypassed; None elsewhere.
    fill: dict[str, int] | None = None

    def start_owner(self) -> None:
        s = self.scenario
        self.owner = kit.start_owner(
            self.owner_name, self.server.uri, budget_bytes=s.budget_bytes, slots=1024,
            max_entry_bytes=s.max_entry_bytes, max_await_time_ms=MAX_AWAIT_MS,
        )  # fmt: skip

    def cut(self) -> None:
        self.proxy.refusing = True
        self.proxy.cut()

    def hold(self) -> None:
        self.proxy.holding = True

    def slow(self) -> None:
        self.proxy.delay = 0.3

    def kill_cursor(self) -> None:
        # The deployment-wide stream's cursor, or the database's own.
        namespaces = {"admin.$cmd.aggregate", f"{self.db}.$cmd.aggregate"}
        idle = [op for op in self.admin.admin.command("currentOp")["inprog"] if op.get("type") == "idleCursor"]
        found = [(op["ns"], Int64(op["cursorId"])) for op in idle if op.get("ns") in namespaces and op.get("cursorId")]
        if not found:
            raise FaultRunFailed("the stream's cursor is not listed by currentOp")
        for ns, cursor in found:
            self.admin[ns.split(".", 1)[0]].command("killCursors", "$cmd.aggregate", cursors=[cursor])

    def lose_history(self) -> None:
        self.cut()
        time.sleep(0.3)  # writes go on meanwhile
        self.admin[self.db].filler.insert_many([{"i": i} for i in range(20)])
        if not self.admin.admin.command("secantusAdmin.pruneOplog")["pruned"]:
            raise FaultRunFailed("the oplog was not pruned")

    def stop_owner(self) -> None:
        os.kill(self.owner.pid, signal.SIGSTOP)

    def continue_owner(self) -> None:
        os.kill(self.owner.pid, signal.SIGCONT)

    def stop_owner_and_fill_ring(self) -> None:
        """Stop the owner, then miss at once on queries never read before: their
        admissions (200 KB each) go to this worker's ring, which nobody drains,
        until it is full (a stale heartbeat makes hits bypass, not these
        misses' admissions). What happened meanwhile is recorded: reads that
        bypass or admissions refused for another reason (an owner starved by
        other work demotes its stream; the stream stops serving between a
        read's capture and its admission) may leave the ring short of full."""
        before = self.manager.snapshot()
        self.stop_owner()
        for k in range(self.scenario.docs):
            self.cached.find_one({"_id": k, "pad": {"$exists": True}})
        after = self.manager.snapshot()
        rejected = {r: n - before.rejected_admissions.get(r, 0) for r, n in after.rejected_admissions.items()}
        self.fill = {
            "ring_full": rejected.pop("ring_full", 0),
            "rejected_otherwise": sum(rejected.values()),
            "bypasses": after.bypass_total - before.bypass_total,
        }

    def spawn_admitting_worker(self) -> None:
        proc = kit.spawn(_admitting_worker, self.owner_name, self.server.uri, self.db, self.coll, daemon=True)
        self.workers.append(proc)
        # Attached when the owner counts two workers: this process and it.
        ok = kit.wait_until(lambda: not proc.is_alive() or self.owner.snapshot()["attached_workers"] >= 2, 30, 0.05)
        if not ok or not proc.is_alive():
            raise FaultRunFailed("the admitting worker did not attach")

    def kill_admitting_workers(self) -> None:
        rng = random.Random(len(self.workers))
        for round_ in range(3):
            time.sleep(rng.uniform(0.05, 0.3))  # somewhere in its loop of admissions
            os.kill(self.workers[-1].pid, signal.SIGKILL)
            self.workers[-1].join(10)
            if round_ < 2:
                self.spawn_admitting_worker()

    def close(self) -> None:
        """End the admitting workers and the owner (continued first, if stopped)."""
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if self.owner is not None:
            with contextlib.suppress(Exception):
                self.continue_owner()
            kit.stop_owner(self.owner, timeout=10)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("cut", 1.0, Context.cut, lambda c: c.proxy.heal()),
        Scenario("stall", 4.0, Context.hold, lambda c: c.proxy.heal()),
        Scenario("slow_link", 3.0, Context.slow, lambda c: c.proxy.heal()),
        Scenario("cursor_killed", 0.0, Context.kill_cursor),
        Scenario("server_restart", 1.0, lambda c: c.server.stop(), lambda c: c.server.start()),
        Scenario("history_lost", 1.0, Context.lose_history, lambda c: c.proxy.heal()),
        Scenario("unreachable_at_start", 1.0, heal=lambda c: c.server.start(), down_at_start=True),
        Scenario("owner_killed", 1.0, lambda c: os.kill(c.owner.pid, signal.SIGKILL), Context.start_owner, shared=True),
        Scenario("owner_hung", 2.0, Context.stop_owner, Context.continue_owner, shared=True),
        Scenario(
            "worker_killed", 0.0, Context.kill_admitting_workers, shared=True, prepare=Context.spawn_admitting_worker
        ),
        Scenario(
            "ring_full", 1.0, Context.stop_owner_and_fill_ring, Context.continue_owner, shared=True,
            pad_bytes=200 * KiB, docs=12, max_entry_bytes=256 * KiB,
        ),
        Scenario(
            "arena_full", 2.0, shared=True, pad_bytes=32 * KiB, docs=64, budget_bytes=1024 * KiB,
            max_entry_bytes=64 * KiB, warm_all=False,
        ),
    )  # fmt: skip
}


def _admitting_worker(name: str, uri: str, db: str, coll: str) -> None:
    """A spawned worker that admits all the time: queries by version are
    missed after every write (they are validated by the namespace's write
    generation) and admitted again."""
    from client_query_cache import CacheManager

    cached = CacheManager(pymongo.MongoClient(uri), shared=name)[db][coll]
    rng = random.Random()
    while True:
        cached.find_one({"_id": rng.randrange(DOCS), "version": {"$gte": 0}})
        cached.find({"version": {"$gte": rng.randrange(3)}}).to_list()


# -- The writer and the reader ---------------------------------------------------


class _Loop(threading.Thread):
    """A daemon thread that runs until ``close()``."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.stop = threading.Event()

    def close(self) -> None:
        self.stop.set()
        if self.is_alive():
            self.join(10)


class Writer(_Loop):
    """Updates a random document every WRITE_INTERVAL_S (``kit.Writer``),
    each write in a session of its own; a write whose reply was lost is
    kept as "maybe" (its version may appear, never required)."""

    def __init__(self, uri: str, ctx: Context, seed: int) -> None:
        super().__init__("fault-writer")
        self.client: pymongo.MongoClient[Any] = pymongo.MongoClient(
            uri, serverSelectionTimeoutMS=500, retryWrites=False
        )
        self.writer = kit.Writer(self.client[ctx.db][ctx.coll], range(ctx.scenario.docs), seed)
        self.acked, self.maybe = self.writer.acked, self.writer.lost

    def run(self) -> None:
        while not self.stop.is_set():
            with self.client.start_session(causal_consistency=False) as session:
                self.writer.write(session, keep_lost=True)
            self.stop.wait(WRITE_INTERVAL_S)

    def close(self) -> None:
        super().close()
        self.client.close()


class Reader(_Loop):
    """Reads random documents by ``_id`` through the cache until stopped and
    records each one (``rows``; its kind: 1 for a hit, 0 for a miss)."""

    def __init__(self, manager: Any, ctx: Context, seed: int) -> None:
        super().__init__("fault-reader")
        self.manager, self.coll, self.db, self.docs = manager, ctx.cached, ctx.db, ctx.scenario.docs
        self.rng = random.Random(seed + 1)
        self.rows = Rows()
        self.reads = self.hits = self.pymongo_errors = 0
        self.other_errors: list[str] = []

    def _hits(self) -> int:
        return int(self.manager._engine.native.stats()["hits"])

    def run(self) -> None:
        while not self.stop.is_set():
            self.one()
            time.sleep(READ_PAUSE_S)

    def one(self) -> None:
        """One read, recorded if it returned a document."""
        k = self.rng.randrange(self.docs)
        applied = applied_time(self.manager, self.db)
        h0 = self._hits()
        start = time.monotonic_ns()
        self.reads += 1
        try:
            doc = self.coll.find_one({"_id": k})
        except PyMongoError:
            self.pymongo_errors += 1
            return
        except Exception as exc:  # noqa: BLE001 - counted: the cache must raise nothing else
            self.other_errors.append(f"{type(exc).__name__}: {exc}")
            return
        end = time.monotonic_ns()
        # A re-attach swaps the native cache: its counter starts again.
        hit = self._hits() > h0
        self.hits += hit
        if not isinstance(doc, dict) or doc.get("_id") != k or type(doc.get("version")) is not int:
            self.other_errors.append(f"read of {k} returned {doc!r:.100}")
        else:
            self.rows.add(k, doc["version"], applied, start, end, hit)

    def hit_starts(self) -> Iterator[int]:
        """The start of each read that hit, in order."""
        return (t for t, hit in zip(self.rows.starts, self.rows.kinds) if hit)

    def _hit_read(self, k: int) -> bool:
        h0 = self._hits()
        self.coll.find_one({"_id": k})
        return self._hits() > h0

    def warm(self, timeout: float, every: bool) -> None:
        """Before the thread starts: read until two whole passes hit (or
        once each, if not ``every``)."""
        if not every:
            for k in range(self.docs):
                self._hit_read(k)
            return
        two_passes = [*range(self.docs)] * 2
        if not kit.wait_until(lambda: all(self._hit_read(k) for k in two_passes), timeout, 0.02):
            raise FaultRunFailed("the cache did not warm up")

    def check(self, oracle: Oracle) -> Verdict:
        """Stale and impossible reads (an example says whether the read was a hit)."""
        unordered = {**self.rows.as_dict(), "starts": None}  # no monotonic judgement
        return judge(unordered, oracle=oracle, kind_names=("miss", "hit"))

    def superseded_max_ms(self, acked: Sequence[Write]) -> float:
        """The longest a read returned a version after a newer one of the
        same document had been acknowledged (0 if never)."""
        acks: dict[int, list[Write]] = {}
        for w in sorted(acked, key=lambda w: w.ack_ns):
            acks.setdefault(w.key, []).append(w)
        worst = 0
        for doc, version, start in zip(self.rows.docs, self.rows.versions, self.rows.starts):
            acked_before = itertools.takewhile(lambda w: w.ack_ns < start, acks.get(doc, ()))  # noqa: B023
            newer = next((w for w in acked_before if w.version > version), None)
            if newer is not None:
                worst = max(worst, start - newer.ack_ns)
        return worst / 1e6


# -- One scenario ----------------------------------------------------------------


def run_scenario(name: str, *, seed: int = 20261204, timeout: float = 30.0) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    with contextlib.ExitStack() as stack:
        if scenario.shared:
            # A fresh runtime directory for the shared cache's files (spawned
            # processes inherit it), removed afterwards.
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="cqc-faults-", ignore_cleanup_errors=True))
            stack.enter_context(mock.patch.dict(os.environ, {"CQC_RUNTIME_DIR": path}))
        return _run(scenario, seed, timeout)


def _run(scenario: Scenario, seed: int, timeout: float) -> dict[str, Any]:
    from client_query_cache import CacheManager

    with contextlib.ExitStack() as stack:
        # The server binds its port before the proxy asks the system for one.
        server = kit.disposable_server(oplog_max_entries=5, extra_args=["--enable-test-commands"])
        stack.callback(server.close)
        proxy = stack.enter_context(FaultProxy(server.port))
        uri = server.uri
        admin: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(uri, serverSelectionTimeoutMS=2000))
        client: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(uri, serverSelectionTimeoutMS=300))
        ctx = Context(scenario, server, proxy, admin)
        stack.callback(ctx.close)
        pad = {"pad": "p" * scenario.pad_bytes} if scenario.pad_bytes else {}
        admin[ctx.db][ctx.coll].insert_many([{"_id": k, "version": 0, **pad} for k in range(scenario.docs)])
        if scenario.shared:
            ctx.start_owner()
            manager = stack.enter_context(CacheManager(client, shared=ctx.owner_name))
        else:
            if scenario.down_at_start:
                server.stop()
            manager = stack.enter_context(CacheManager(client, max_await_time_ms=MAX_AWAIT_MS, stream_uri=proxy.uri))
        ctx.manager, ctx.cached = manager, manager[ctx.db][ctx.coll]
        writer, reader = Writer(uri, ctx, seed), Reader(manager, ctx, seed)
        stack.callback(writer.close)
        stack.callback(reader.close)
        if not scenario.down_at_start:
            kit.register(manager, ctx.cached, ctx.db, timeout)
            reader.warm(timeout, scenario.warm_all)
            if scenario.prepare is not None:
                scenario.prepare(ctx)
            writer.start()
        before = manager.snapshot()
        reader.start()
        if not scenario.down_at_start:
            time.sleep(NORMAL_S)
        injected = time.monotonic_ns()
        if scenario.inject is not None:
            scenario.inject(ctx)
        time.sleep(scenario.duration_s)
        healed = time.monotonic_ns()
        if scenario.heal is not None:
            scenario.heal(ctx)
        if scenario.down_at_start:
            writer.start()
        recovered = kit.wait_until(lambda: next((t for t in reader.hit_starts() if t >= healed), None), timeout)
        time.sleep(AFTER_S)
        writer.close()
        last = max((w.optime for w in writer.acked), default=0)
        if caught_up := bool(kit.wait_until(lambda: applied_time(manager, ctx.db) >= last, timeout)):
            time.sleep(0.1)  # and reads after it
        reader.close()
        after = manager.snapshot()
        stream = next(s for s in after.streams if s.database == ctx.db)
        attached = ctx.owner.snapshot()["attached_workers"] if scenario.shared else None
        # How long a silent stream (local) or owner (shared) is trusted.
        trust_ms = (
            manager._engine.native.geometry()["heartbeat_timeout_ns"] / 1e6 if scenario.shared else STALL_BOUND_S * 1e3
        )
    rejected = {k: v - before.rejected_admissions.get(k, 0) for k, v in after.rejected_admissions.items()}
    verdict = reader.check(Oracle(writer.acked + writer.maybe))
    return {
        "scenario": scenario.name,
        "mode": "shared" if scenario.shared else "local",
        "fault_seconds": scenario.duration_s,
        "reads": reader.reads,
        "hits": reader.hits,
        "pymongo_errors": reader.pymongo_errors,
        "other_errors": len(reader.other_errors),
        "other_error_examples": reader.other_errors[:MAX_EXAMPLES],
        "stale_reads": verdict.stale,
        "impossible_reads": verdict.impossible,
        "examples": list(verdict.examples),
        "writes_acked": len(writer.acked),
        "writes_unacknowledged": len(writer.maybe),
        "superseded_max_ms": reader.superseded_max_ms(writer.acked),
        "trust_bound_ms": trust_ms,
        "hits_between_fault_and_recovery": sum(injected <= t < (recovered or NEVER) for t in reader.hit_starts()),
        "recovery_ms": None if recovered is None else max(0, recovered - healed) / 1e6,
        "caught_up": caught_up,
        "rejected_admissions": {k: n for k, n in rejected.items() if n},
        "evictions": after.evictions - before.evictions if after.evictions >= before.evictions else None,
        "reconnects": stream.reconnects,
        "history_lost": stream.history_lost,
        "stream_state_at_end": stream.state.value,
        "attached_workers_at_end": attached,
        "ring_fill": ctx.fill,
    }


# -- Report ----------------------------------------------------------------------


def checks(report: dict[str, Any]) -> list[str]:
    problems = []
    for r in report["scenarios"]:
        name = r["scenario"]
        if r["stale_reads"] or r["impossible_reads"]:
            problems.append(f"{name}: {r['stale_reads']} stale and {r['impossible_reads']} impossible reads")
        if r["other_errors"]:
            problems.append(f"{name}: the cache raised {r['other_error_examples']}")
        if r["recovery_ms"] is None:
            problems.append(f"{name}: caching did not resume")
        if not r["caught_up"]:
            problems.append(f"{name}: the last write was never applied")
        problems.extend(f"{name}: {e}" for e in r["examples"])
    return problems


def print_report(report: dict[str, Any]) -> None:
    kit.table(
        [("scenario", "<21"), ("mode", "<6"), ("reads", ">6"), ("hits", ">6"), ("pymongo err", ">11"),
         ("other err", ">9"), ("stale", ">5"), ("superseded ms", ">13.0f"), ("refused adm.", ">12"),
         ("recovery ms", ">11.0f")],
        [(r["scenario"], r["mode"], r["reads"], r["hits"], r["pymongo_errors"], r["other_errors"], r["stale_reads"],
          r["superseded_max_ms"], sum(r["rejected_admissions"].values()), kit.cell(r["recovery_ms"]))
         for r in report["scenarios"]],
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = kit.parser("faults", __doc__)
    parser.add_argument(
        "--scenarios", type=kit.csv(tuple(SCENARIOS)), default=tuple(SCENARIOS), help="comma-separated subset"
    )
    args = parser.parse_args(argv)
    if kit.external():
        print("error: the fault scenarios stop and break a local server; unset MONGODB_URI", file=sys.stderr)
        return 1
    status, started = Status(), time.monotonic()
    results = []
    for name in args.scenarios:
        status(name)
        try:
            results.append(run_scenario(name, seed=args.seed))
        except BenchmarkFailed as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
    report = {
        "schema": SCHEMA,
        "machine": kit.machine_facts(),
        "params": {"max_await_time_ms": MAX_AWAIT_MS, "stall_bound_s": STALL_BOUND_S, "seed": args.seed},
        "scenarios": results,
        "stale_reads": sum(r["stale_reads"] for r in results),
        "elapsed_seconds": time.monotonic() - started,
    }
    return kit.conclude(report, checks(report), print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
