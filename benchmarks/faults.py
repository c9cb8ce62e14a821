"""Fault injection: faults of the link, the stream and the server while a
cache serves reads and a writer writes; every read checked for staleness.

Each scenario gets a disposable server of its own (on-disk storage, a fixed
port, an oplog of 5 entries after an explicit prune) and a ``FaultProxy``
between the cache's change stream and the server (``stream_uri=``), while the
cache's reads and the writer go to the server directly. One process-local
``CacheManager`` (``max_await_time_ms`` 200, so the stall bound is 2.4 s)
reads 8 documents by ``_id`` in a loop; a writer thread updates them every
10 ms with a growing ``version``. The oracle is that of
``benchmarks.coherence``: before each read the cache's applied cluster time is
read, and a read must not return an older version than the newest write at or
before it. A write whose acknowledgement was lost (the server went away) may
appear or not, but no version that was never sent may.

The scenarios (timeline: warm up, 0.5 s of normal service, the fault, the
heal, then reads until the cache serves a hit again and 0.5 s more):

  cut             every stream connection is cut and new ones refused, 1 s
  stall           the link holds all traffic, connections open, 4 s
                  (longer than the stall bound)
  slow_link       every chunk of the link waits 300 ms, 3 s
  cursor_killed   the stream's cursor is killed by another client
  server_restart  the server stops and starts again on the same port with
                  the same storage after 1 s (reads fail meanwhile: PyMongo's
                  own errors)
  history_lost    the link is cut, the writes go on and the oplog is pruned,
                  so the stream cannot resume; 1 s
  unreachable_at_start  the server is down when the manager is created and
                  comes up 1 s later

Per scenario: reads, hits, reads that raised PyMongo's errors, any other
exception (must be none), stale reads (must be 0), the longest time a read
returned a version after a newer one had been acknowledged ("superseded"; up
to the stall bound while a stalled stream is not yet detected, by design),
and the recovery time: from the heal to the first hit.

    python -m benchmarks.faults [--json out.json] [--scenarios cut,stall]

Exit status 1 if a check fails. Needs a local server (not MONGODB_URI).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pymongo
from bson.int64 import Int64
from pymongo.errors import PyMongoError

from ._common import exit_code, machine_facts, write_json
from ._proxy import FaultProxy
from .coherence import Oracle, Write

SCHEMA = "cqc.faults/1"
DOCS = 8
MAX_AWAIT_MS = 200
STALL_BOUND_S = (2 * MAX_AWAIT_MS + 2000) / 1000
WRITE_INTERVAL_S = 0.010
READ_PAUSE_S = 0.002
NORMAL_S = 0.5
AFTER_S = 0.5
NEVER = (1 << 63) - 1
MAX_EXAMPLES = 5


class FaultRunFailed(RuntimeError):
    """The harness itself could not run a scenario."""


@dataclasses.dataclass
class Context:
    server: Any
    proxy: FaultProxy
    admin: pymongo.MongoClient[Any]
    db: str = "faults"
    coll: str = "docs"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Context], None]
    heal: Callable[[Context], None]
    duration_s: float
    #: The server is down when the manager is created.
    down_at_start: bool = False


def _cut(ctx: Context) -> None:
    ctx.proxy.refusing = True
    ctx.proxy.cut()


def _hold(ctx: Context) -> None:
    ctx.proxy.holding = True


def _slow(ctx: Context) -> None:
    ctx.proxy.delay = 0.3


def _heal_proxy(ctx: Context) -> None:
    ctx.proxy.heal()


def _kill_cursor(ctx: Context) -> None:
    ns = f"{ctx.db}.$cmd.aggregate"
    ops = ctx.admin.admin.command("currentOp")["inprog"]
    ids = [
        Int64(op["cursorId"])
        for op in ops
        if op.get("type") == "idleCursor" and op.get("ns") == ns and op.get("cursorId")
    ]
    if not ids:
        raise FaultRunFailed("the stream's cursor is not listed by currentOp")
    ctx.admin[ctx.db].command("killCursors", "$cmd.aggregate", cursors=ids)


def _stop_server(ctx: Context) -> None:
    ctx.server.stop()


def _start_server(ctx: Context) -> None:
    ctx.server.start()


def _lose_history(ctx: Context) -> None:
    _cut(ctx)
    time.sleep(0.3)  # writes go on meanwhile
    ctx.admin[ctx.db].filler.insert_many([{"i": i} for i in range(20)])
    if not ctx.admin.admin.command("secantusAdmin.pruneOplog")["pruned"]:
        raise FaultRunFailed("the oplog was not pruned")


def _nothing(ctx: Context) -> None:
    del ctx


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("cut", _cut, _heal_proxy, 1.0),
        Scenario("stall", _hold, _heal_proxy, 4.0),
        Scenario("slow_link", _slow, _heal_proxy, 3.0),
        Scenario("cursor_killed", _kill_cursor, _nothing, 0.0),
        Scenario("server_restart", _stop_server, _start_server, 1.0),
        Scenario("history_lost", _lose_history, _heal_proxy, 1.0),
        Scenario("unreachable_at_start", _nothing, _start_server, 1.0, down_at_start=True),
    )
}


# ============================================================================
# The writer
# ============================================================================


class Writer(threading.Thread):
    """Updates a random document every WRITE_INTERVAL_S; a write whose reply
    was lost is kept as "maybe" (its version may appear, never required)."""

    def __init__(self, uri: str, ctx: Context, seed: int) -> None:
        super().__init__(name="fault-writer", daemon=True)
        self._client: pymongo.MongoClient[Any] = pymongo.MongoClient(
            uri, serverSelectionTimeoutMS=500, retryWrites=False
        )
        self._coll = self._client[ctx.db][ctx.coll]
        self._rng = random.Random(seed)
        self.stop = threading.Event()
        self.acked: list[Write] = []
        self.maybe: list[Write] = []
        self.failed = 0

    def run(self) -> None:
        versions = [0] * DOCS
        clock = time.monotonic_ns
        while not self.stop.is_set():
            k = self._rng.randrange(DOCS)
            v = versions[k] = versions[k] + 1
            sent = clock()
            try:
                with self._client.start_session(causal_consistency=False) as s:
                    self._coll.update_one({"_id": k}, {"$set": {"version": v}}, session=s)
                    ot = s.operation_time
                self.acked.append(Write(k, v, (ot.time << 32) | ot.inc, sent, clock()))
            except PyMongoError:
                self.failed += 1
                self.maybe.append(Write(k, v, NEVER, sent, NEVER))
            self.stop.wait(WRITE_INTERVAL_S)

    def close(self) -> None:
        self.stop.set()
        if self.is_alive():
            self.join(10)
        self._client.close()


# ============================================================================
# One scenario
# ============================================================================


def _applied(manager: Any, db: str) -> int:
    for s in manager._engine.native.streams():
        if s["database"] == db:
            t, i = s["applied_time"]
            return (t << 32) | i
    return 0


def run_scenario(name: str, *, seed: int = 20261204, timeout: float = 30.0) -> dict[str, Any]:
    from client_query_cache import CacheManager
    from client_query_cache.testing import DisposableServer

    scenario = SCENARIOS[name]
    server = DisposableServer(oplog_max_entries=5, extra_args=["--enable-test-commands"])
    proxy = FaultProxy(server.port).start()
    ctx = Context(server, proxy, pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=2000))
    reader: pymongo.MongoClient[Any] = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=300)
    manager: Any = None
    writer: Writer | None = None
    try:
        server.start()
        ctx.admin[ctx.db][ctx.coll].insert_many([{"_id": k, "version": 0} for k in range(DOCS)])
        if scenario.down_at_start:
            server.stop()
        manager = CacheManager(reader, max_await_time_ms=MAX_AWAIT_MS, stream_uri=proxy.uri)
        coll = manager[ctx.db][ctx.coll]
        state = _Reads(manager, coll, ctx.db, seed)
        if scenario.down_at_start:
            # The manager exists; reads raise PyMongo's errors until the
            # server is up. The fault is "on" from here.
            injected = time.monotonic_ns()
            state.read_for(scenario.duration_s)
        else:
            if not manager.wait_ready(timeout, database=ctx.db):
                raise FaultRunFailed("the stream did not become ready")
            state.warm(timeout)
        writer = Writer(server.uri, ctx, seed)
        if not scenario.down_at_start:
            writer.start()
            state.read_for(NORMAL_S)
            injected = time.monotonic_ns()
            scenario.inject(ctx)
            state.read_for(scenario.duration_s)
        healed = time.monotonic_ns()
        scenario.heal(ctx)
        if scenario.down_at_start:
            writer.start()
        recovered = state.read_until_hit(timeout)
        state.read_for(AFTER_S)
        writer.stop.set()
        writer.join(10)
        last = max((w.optime for w in writer.acked), default=0)
        caught_up = state.read_until_applied(last, timeout)
        stream = next(s for s in manager.snapshot().streams if s.database == ctx.db)
    finally:
        if writer is not None:
            writer.close()
        if manager is not None:
            manager.close()
        reader.close()
        ctx.admin.close()
        proxy.close()
        server.close()
    oracle = Oracle(writer.acked + writer.maybe)
    stale, impossible, examples = state.check(oracle)
    return {
        "scenario": name,
        "fault_seconds": scenario.duration_s,
        "reads": state.reads,
        "hits": state.hits,
        "pymongo_errors": state.pymongo_errors,
        "other_errors": len(state.other_errors),
        "other_error_examples": state.other_errors[:MAX_EXAMPLES],
        "stale_reads": stale,
        "impossible_reads": impossible,
        "examples": examples,
        "writes_acked": len(writer.acked),
        "writes_unacknowledged": len(writer.maybe),
        "superseded_max_ms": state.superseded_max_ms(writer.acked),
        "hits_between_fault_and_recovery": state.hits_between(injected, recovered or NEVER),
        "recovery_ms": None if recovered is None else max(0, recovered - healed) / 1e6,
        "caught_up": caught_up,
        "reconnects": stream.reconnects,
        "history_lost": stream.history_lost,
        "stream_state_at_end": stream.state.value,
    }


class _Reads:
    """The read loop and its records."""

    def __init__(self, manager: Any, coll: Any, db: str, seed: int) -> None:
        self._manager, self._coll, self._db = manager, coll, db
        self._stats = manager._engine.native.stats
        self._rng = random.Random(seed + 1)
        self.rows: list[tuple[int, int, int, int, int, bool]] = []  # doc, version, applied, t0, t1, hit
        self.reads = self.hits = self.pymongo_errors = 0
        self.other_errors: list[str] = []

    def one(self) -> bool | None:
        """One read; True if it was a hit, None if it raised."""
        k = self._rng.randrange(DOCS)
        applied = _applied(self._manager, self._db)
        h0 = self._stats()["hits"]
        t0 = time.monotonic_ns()
        try:
            doc = self._coll.find_one({"_id": k})
        except PyMongoError:
            self.pymongo_errors += 1
            return None
        except Exception as exc:  # noqa: BLE001 - counted: the cache must raise nothing else
            self.other_errors.append(f"{type(exc).__name__}: {exc}")
            return None
        finally:
            self.reads += 1
        t1 = time.monotonic_ns()
        hit = self._stats()["hits"] > h0
        self.hits += hit
        if not isinstance(doc, dict) or doc.get("_id") != k or type(doc.get("version")) is not int:
            self.other_errors.append(f"read of {k} returned {doc!r:.100}")
            return None
        self.rows.append((k, doc["version"], applied, t0, t1, hit))
        return hit

    def read_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.one()
            time.sleep(READ_PAUSE_S)

    def warm(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self._read_doc(k) for k in range(DOCS)) and all(self._read_doc(k) for k in range(DOCS)):
                return
            time.sleep(0.02)
        raise FaultRunFailed("the cache did not warm up")

    def _read_doc(self, k: int) -> bool:
        h0 = self._stats()["hits"]
        self._coll.find_one({"_id": k})
        return self._stats()["hits"] > h0

    def read_until_hit(self, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.one():
                return self.rows[-1][3]
            time.sleep(READ_PAUSE_S)
        return None

    def read_until_applied(self, optime: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.one()
            if _applied(self._manager, self._db) >= optime:
                for _ in range(3 * DOCS):  # and reads after it
                    self.one()
                return True
            time.sleep(READ_PAUSE_S)
        return False

    def hits_between(self, start_ns: int, end_ns: int) -> int:
        return sum(1 for r in self.rows if r[5] and start_ns <= r[3] < end_ns)

    def check(self, oracle: Oracle) -> tuple[int, int, list[str]]:
        stale = impossible = 0
        examples: list[str] = []
        for k, v, applied, _t0, t1, hit in self.rows:
            need = oracle.required(k, applied)
            if v < need:
                stale += 1
                if len(examples) < MAX_EXAMPLES:
                    examples.append(f"document {k}: version {v} read ({'hit' if hit else 'miss'}), {need} applied")
            why = oracle.impossible(k, v, t1)
            if why:
                impossible += 1
                if len(examples) < MAX_EXAMPLES:
                    examples.append(why)
        return stale, impossible, examples

    def superseded_max_ms(self, acked: Sequence[Write]) -> float:
        """The longest a read returned a version after a newer one of the
        same document had been acknowledged (0 if never)."""
        acks: dict[int, list[tuple[int, int]]] = {}
        for w in sorted(acked, key=lambda w: w.ack_ns):
            acks.setdefault(w.doc, []).append((w.ack_ns, w.version))
        worst = 0
        for k, v, _applied, t0, _t1, _hit in self.rows:
            for ack_ns, version in acks.get(k, ()):
                if ack_ns >= t0:
                    break
                if version > v:
                    worst = max(worst, t0 - ack_ns)
                    break
        return worst / 1e6


# ============================================================================
# Report
# ============================================================================


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


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    print(
        f"{'scenario':<21} {'reads':>6} {'hits':>6} {'pymongo err':>11} {'other err':>9} {'stale':>5} "
        f"{'superseded ms':>13} {'recovery ms':>11}",
        file=out,
    )
    for r in report["scenarios"]:
        rec = "-" if r["recovery_ms"] is None else f"{r['recovery_ms']:.0f}"
        print(
            f"{r['scenario']:<21} {r['reads']:>6} {r['hits']:>6} {r['pymongo_errors']:>11} {r['other_errors']:>9} "
            f"{r['stale_reads']:>5} {r['superseded_max_ms']:>13.0f} {rec:>11}",
            file=out,
        )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the JSON report here")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
    parser.add_argument("--seed", type=int, default=20261204)
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown or not args.scenarios:
        parser.error(f"--scenarios: choose from {', '.join(SCENARIOS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from client_query_cache.testing import external_uri

    if external_uri() is not None:
        print("error: the fault scenarios stop and break a local server; unset MONGODB_URI", file=sys.stderr)
        return 1
    started = time.perf_counter()
    results = []
    for name in args.scenarios:
        print(f"[{time.perf_counter() - started:6.1f}s] {name}", file=sys.stderr)
        try:
            results.append(run_scenario(name, seed=args.seed))
        except FaultRunFailed as exc:
            print(f"error: {name}: {exc}", file=sys.stderr)
            return 1
    report = {
        "schema": SCHEMA,
        "machine": machine_facts(),
        "params": {"max_await_time_ms": MAX_AWAIT_MS, "stall_bound_s": STALL_BOUND_S, "seed": args.seed},
        "scenarios": results,
        "stale_reads": sum(r["stale_reads"] for r in results),
        "elapsed_seconds": time.perf_counter() - started,
    }
    problems = checks(report)
    report["checks"] = {"passed": not problems, "problems": problems}
    print_report(report)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())
