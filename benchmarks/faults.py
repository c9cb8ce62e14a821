"""Fault injection: faults of the link, the stream, the server, the owner and
the workers, while a cache serves reads and a writer writes.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.faults`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pymongo
from bson.int64 import Int64
from pymongo.errors import PyMongoError

from . import _kit as kit
from ._proxy import FaultProxy
from .coherence import Oracle, Write, applied_time

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
KiB = 1024


class FaultRunFailed(RuntimeError):
    """The harness itself could not run a scenario."""


@dataclasses.dataclass
class Context:
    server: Any
    proxy: FaultProxy
    admin: pymongo.MongoClient[Any]
    db: str = "faults"
    coll: str = "docs"
    #: Shared scenarios: the owner, its name and options.
    owner: Any = None
    owner_name: str = ""
    owner_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Spawned worker processes (worker_killed).
    workers: list[Any] = dataclasses.field(default_factory=list)
    #: The cached collection the reader reads, and how many documents.
    cached: Any = None
    docs: int = DOCS

    def start_owner(self) -> None:
        self.owner = kit.start_owner(self.owner_name, self.server.uri, **self.owner_options)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    inject: Callable[[Context], None]
    heal: Callable[[Context], None]
    duration_s: float
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


def _kill_owner(ctx: Context) -> None:
    os.kill(ctx.owner.pid, signal.SIGKILL)


def _new_owner(ctx: Context) -> None:
    ctx.start_owner()


def _stop_owner_process(ctx: Context) -> None:
    os.kill(ctx.owner.pid, signal.SIGSTOP)


def _stop_owner_and_fill_ring(ctx: Context) -> None:
    """Stop the owner, then miss at once on queries never read before: their
    admissions (200 KB each) go to this worker's ring, which nobody drains,
    until it is full (before the owner's heartbeat is stale and reads
    bypass)."""
    _stop_owner_process(ctx)
    for k in range(ctx.docs):
        ctx.cached.find_one({"_id": k, "pad": {"$exists": True}})


def _continue_owner(ctx: Context) -> None:
    os.kill(ctx.owner.pid, signal.SIGCONT)


def _spawn_admitting_worker(ctx: Context) -> None:
    runtime_dir = os.environ.get("CQC_RUNTIME_DIR", "")
    proc = kit.spawn(_admitting_worker, ctx.owner_name, ctx.server.uri, ctx.db, ctx.coll, runtime_dir, daemon=True)
    ctx.workers.append(proc)
    deadline = time.monotonic() + 30
    while ctx.owner.snapshot()["attached_workers"] < 2:  # this process and it
        if time.monotonic() > deadline or not proc.is_alive():
            raise FaultRunFailed("the admitting worker did not attach")
        time.sleep(0.05)


def _kill_admitting_workers(ctx: Context) -> None:
    rng = random.Random(len(ctx.workers))
    for round_ in range(3):
        time.sleep(rng.uniform(0.05, 0.3))  # somewhere in its loop of admissions
        proc = ctx.workers[-1]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        if round_ < 2:
            _spawn_admitting_worker(ctx)


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
        Scenario("owner_killed", _kill_owner, _new_owner, 1.0, shared=True),
        Scenario("owner_hung", _stop_owner_process, _continue_owner, 2.0, shared=True),
        Scenario(
            "worker_killed", _kill_admitting_workers, _nothing, 0.0, shared=True, prepare=_spawn_admitting_worker
        ),
        Scenario(
            "ring_full",
            _stop_owner_and_fill_ring,
            _continue_owner,
            1.0,
            shared=True,
            pad_bytes=200 * KiB,
            docs=12,
            max_entry_bytes=256 * KiB,
        ),
        Scenario(
            "arena_full",
            _nothing,
            _nothing,
            2.0,
            shared=True,
            pad_bytes=32 * KiB,
            docs=64,
            budget_bytes=1024 * KiB,
            max_entry_bytes=64 * KiB,
            warm_all=False,
        ),
    )
}


def _admitting_worker(name: str, uri: str, db: str, coll: str, runtime_dir: str) -> None:
    """A spawned worker that admits all the time: queries by version are
    missed after every write (they are validated by the namespace's write
    generation) and admitted again."""
    if runtime_dir:
        os.environ["CQC_RUNTIME_DIR"] = runtime_dir
    from client_query_cache import CacheManager

    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    manager = CacheManager(client, shared=name)
    cached = manager[db][coll]
    rng = random.Random()
    while True:
        k = rng.randrange(DOCS)
        cached.find_one({"_id": k, "version": {"$gte": 0}})
        cached.find({"version": {"$gte": rng.randrange(3)}}).to_list()


# -- The writer ------------------------------------------------------------------


class Writer(threading.Thread):
    """Updates a random document every WRITE_INTERVAL_S; a write whose reply
    was lost is kept as "maybe" (its version may appear, never required)."""

    def __init__(self, uri: str, ctx: Context, docs: int, seed: int) -> None:
        super().__init__(name="fault-writer", daemon=True)
        self._client: pymongo.MongoClient[Any] = pymongo.MongoClient(
            uri, serverSelectionTimeoutMS=500, retryWrites=False
        )
        self._coll = self._client[ctx.db][ctx.coll]
        self._docs = docs
        self._rng = random.Random(seed)
        self.stop = threading.Event()
        self.acked: list[Write] = []
        self.maybe: list[Write] = []

    def run(self) -> None:
        versions = [0] * self._docs
        clock = time.monotonic_ns
        while not self.stop.is_set():
            k = self._rng.randrange(self._docs)
            v = versions[k] = versions[k] + 1
            sent = clock()
            try:
                with self._client.start_session(causal_consistency=False) as s:
                    self._coll.update_one({"_id": k}, {"$set": {"version": v}}, session=s)
                    ot = s.operation_time
                self.acked.append(Write(k, v, (ot.time << 32) | ot.inc, sent, clock()))
            except PyMongoError:
                self.maybe.append(Write(k, v, NEVER, sent, NEVER))
            self.stop.wait(WRITE_INTERVAL_S)

    def close(self) -> None:
        self.stop.set()
        if self.is_alive():
            self.join(10)
        self._client.close()


# -- The reader ------------------------------------------------------------------


class Reader(threading.Thread):
    """Reads random documents by ``_id`` through the cache until stopped and
    records each one: (document, version, applied time before it, start,
    end, hit)."""

    def __init__(self, manager: Any, coll: Any, db: str, docs: int, seed: int) -> None:
        super().__init__(name="fault-reader", daemon=True)
        self._manager, self._coll, self._db, self._docs = manager, coll, db, docs
        self._rng = random.Random(seed + 1)
        self.stop = threading.Event()
        self.rows: list[tuple[int, int, int, int, int, bool]] = []
        self.reads = self.hits = self.pymongo_errors = 0
        self.other_errors: list[str] = []

    def _hits(self) -> int:
        return int(self._manager._engine.native.stats()["hits"])

    def one(self) -> bool | None:
        """One read; True if it was a hit, None if it raised."""
        k = self._rng.randrange(self._docs)
        applied = applied_time(self._manager, self._db)
        h0 = self._hits()
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
        # A re-attach swaps the native cache: its counter starts again.
        hit = self._hits() > h0
        self.hits += hit
        if not isinstance(doc, dict) or doc.get("_id") != k or type(doc.get("version")) is not int:
            self.other_errors.append(f"read of {k} returned {doc!r:.100}")
            return None
        self.rows.append((k, doc["version"], applied, t0, t1, hit))
        return hit

    def run(self) -> None:
        while not self.stop.is_set():
            self.one()
            time.sleep(READ_PAUSE_S)

    def warm(self, timeout: float, every: bool = True) -> None:
        """Before the thread starts: read until two whole passes hit (or
        once each, if not ``every``)."""
        if not every:
            for k in range(self._docs):
                self._hit_read(k)
            return
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all(self._hit_read(k) for k in range(self._docs)) and all(
                self._hit_read(k) for k in range(self._docs)
            ):
                return
            time.sleep(0.02)
        raise FaultRunFailed("the cache did not warm up")

    def _hit_read(self, k: int) -> bool:
        h0 = self._hits()
        self._coll.find_one({"_id": k})
        return self._hits() > h0

    def first_hit_after(self, start_ns: int, timeout: float) -> int | None:
        end = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < end:
            rows = self.rows
            for row in rows[seen:]:
                if row[5] and row[3] >= start_ns:
                    return row[3]
            seen = len(rows)
            time.sleep(0.01)
        return None

    def wait_applied(self, optime: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if applied_time(self._manager, self._db) >= optime:
                time.sleep(0.1)  # and reads after it
                return True
            time.sleep(0.01)
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


# -- One scenario ----------------------------------------------------------------


@contextlib.contextmanager
def _private_runtime_dir() -> Iterator[str]:
    """A fresh runtime directory for a shared scenario's files (spawned
    processes inherit it), removed afterwards."""
    path = tempfile.mkdtemp(prefix="cqc-faults-")
    before = os.environ.get("CQC_RUNTIME_DIR")
    os.environ["CQC_RUNTIME_DIR"] = path
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("CQC_RUNTIME_DIR", None)
        else:
            os.environ["CQC_RUNTIME_DIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def run_scenario(name: str, *, seed: int = 20261204, timeout: float = 30.0) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    with contextlib.ExitStack() as stack:
        if scenario.shared:
            stack.enter_context(_private_runtime_dir())
        return _run(scenario, seed, timeout)


def _run(scenario: Scenario, seed: int, timeout: float) -> dict[str, Any]:
    from client_query_cache import CacheManager

    # The server binds its port before the proxy asks the system for one.
    server = kit.disposable_server(oplog_max_entries=5, extra_args=["--enable-test-commands"])
    try:
        proxy = FaultProxy(server.port).start()
    except BaseException:
        server.close()
        raise
    ctx = Context(server, proxy, pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=2000))
    ctx.owner_name = f"faults-{secrets.token_hex(4)}"
    ctx.owner_options = dict(
        budget_bytes=scenario.budget_bytes,
        slots=1024,
        max_entry_bytes=scenario.max_entry_bytes,
        max_await_time_ms=MAX_AWAIT_MS,
    )
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=300)
    manager: Any = None
    reader: Reader | None = None
    writer = Writer(server.uri, ctx, scenario.docs, seed)
    pad = "p" * scenario.pad_bytes
    try:
        ctx.admin[ctx.db][ctx.coll].insert_many(
            [{"_id": k, "version": 0, **({"pad": pad} if pad else {})} for k in range(scenario.docs)]
        )
        if scenario.shared:
            ctx.start_owner()
            manager = CacheManager(client, shared=ctx.owner_name)
        else:
            if scenario.down_at_start:
                server.stop()
            manager = CacheManager(client, max_await_time_ms=MAX_AWAIT_MS, stream_uri=proxy.uri)
        coll = manager[ctx.db][ctx.coll]
        ctx.cached, ctx.docs = coll, scenario.docs
        reader = Reader(manager, coll, ctx.db, scenario.docs, seed)
        if not scenario.down_at_start:
            coll.find_one({"_id": 0})
            if not manager.wait_ready(timeout, database=ctx.db):
                raise FaultRunFailed("the stream did not become ready")
            reader.warm(timeout, scenario.warm_all)
            if scenario.prepare is not None:
                scenario.prepare(ctx)
            writer.start()
        before = manager.snapshot()
        reader.start()
        if not scenario.down_at_start:
            time.sleep(NORMAL_S)
        injected = time.monotonic_ns()
        scenario.inject(ctx)
        time.sleep(scenario.duration_s)
        healed = time.monotonic_ns()
        scenario.heal(ctx)
        if scenario.down_at_start:
            writer.start()
        recovered = reader.first_hit_after(healed, timeout)
        time.sleep(AFTER_S)
        writer.stop.set()
        writer.join(10)
        last = max((w.optime for w in writer.acked), default=0)
        caught_up = reader.wait_applied(last, timeout)
        reader.stop.set()
        reader.join(10)
        after = manager.snapshot()
        stream = next(s for s in after.streams if s.database == ctx.db)
        attached = ctx.owner.snapshot()["attached_workers"] if scenario.shared else None
        # How long a silent stream (local) or owner (shared) is trusted.
        trust_ms = (
            manager._engine.native.geometry()["heartbeat_timeout_ns"] / 1e6 if scenario.shared else STALL_BOUND_S * 1e3
        )
    finally:
        if reader is not None:
            reader.stop.set()
            if reader.is_alive():
                reader.join(10)
        writer.close()
        for proc in ctx.workers:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if manager is not None:
            manager.close()
        if ctx.owner is not None:
            with contextlib.suppress(Exception):
                os.kill(ctx.owner.pid, signal.SIGCONT)
            with contextlib.suppress(Exception):
                ctx.owner.stop(timeout=10)
        client.close()
        ctx.admin.close()
        proxy.close()
        server.close()
    times = {"injected": injected, "healed": healed, "recovered": recovered, "trust_ms": trust_ms}
    return _result(scenario, reader, writer, before, after, stream, times, caught_up, attached)


def _result(
    scenario: Scenario, reader: Reader, writer: Writer, before: Any, after: Any, stream: Any,
    times: dict[str, Any], caught_up: bool, attached: int | None,
) -> dict[str, Any]:
    """A scenario's figures from its reads, writes and snapshots."""
    injected, healed, recovered, trust_ms = times["injected"], times["healed"], times["recovered"], times["trust_ms"]
    oracle = Oracle(writer.acked + writer.maybe)
    stale, impossible, examples = reader.check(oracle)
    rejected = {
        k: v - before.rejected_admissions.get(k, 0)
        for k, v in after.rejected_admissions.items()
        if v - before.rejected_admissions.get(k, 0)
    }
    return {
        "scenario": scenario.name,
        "mode": "shared" if scenario.shared else "local",
        "fault_seconds": scenario.duration_s,
        "reads": reader.reads,
        "hits": reader.hits,
        "pymongo_errors": reader.pymongo_errors,
        "other_errors": len(reader.other_errors),
        "other_error_examples": reader.other_errors[:MAX_EXAMPLES],
        "stale_reads": stale,
        "impossible_reads": impossible,
        "examples": examples,
        "writes_acked": len(writer.acked),
        "writes_unacknowledged": len(writer.maybe),
        "superseded_max_ms": reader.superseded_max_ms(writer.acked),
        "trust_bound_ms": trust_ms,
        "hits_between_fault_and_recovery": reader.hits_between(injected, recovered or NEVER),
        "recovery_ms": None if recovered is None else max(0, recovered - healed) / 1e6,
        "caught_up": caught_up,
        "rejected_admissions": rejected,
        "evictions": after.evictions - before.evictions if after.evictions >= before.evictions else None,
        "reconnects": stream.reconnects,
        "history_lost": stream.history_lost,
        "stream_state_at_end": stream.state.value,
        "attached_workers_at_end": attached,
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


def print_report(report: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    print(
        f"{'scenario':<21} {'mode':<6} {'reads':>6} {'hits':>6} {'pymongo err':>11} {'other err':>9} {'stale':>5} "
        f"{'superseded ms':>13} {'refused adm.':>12} {'recovery ms':>11}",
        file=out,
    )
    for r in report["scenarios"]:
        rec = "-" if r["recovery_ms"] is None else f"{r['recovery_ms']:.0f}"
        print(
            f"{r['scenario']:<21} {r['mode']:<6} {r['reads']:>6} {r['hits']:>6} {r['pymongo_errors']:>11} "
            f"{r['other_errors']:>9} {r['stale_reads']:>5} {r['superseded_max_ms']:>13.0f} "
            f"{sum(r['rejected_admissions'].values()):>12} {rec:>11}",
            file=out,
        )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("faults", __doc__)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset")
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
        "machine": kit.machine_facts(),
        "params": {"max_await_time_ms": MAX_AWAIT_MS, "stall_bound_s": STALL_BOUND_S, "seed": args.seed},
        "scenarios": results,
        "stale_reads": sum(r["stale_reads"] for r in results),
        "elapsed_seconds": time.perf_counter() - started,
    }
    return kit.conclude(report, checks(report), print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
