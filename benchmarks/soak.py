"""Soak: many workers on one shared cache for minutes; memory stays flat and
no read is stale.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.soak`.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import itertools
import math
import os
import random
import secrets
import shutil
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import psutil
import pymongo
from pymongo.errors import PyMongoError

from . import _kit as kit
from . import coherence
from ._kit import MAX_EXAMPLES, BenchmarkFailed, MiB, Shared, Status
from ._oracle import Oracle, Write, applied_time, timestamp_int
from .coherence import ABSENT, document, insert_documents
from .workloads import ZIPF_S

SCHEMA = "cqc.soak/1"
COLL = "docs"

#: Read kinds, in the order of ``--mix``'s default weights: ``coherence``'s
#: first five (id, key, group, aggregate, group count), their codes in rows.
READ_KINDS = ("id", "key", "find", "aggregate", "count")
DEFAULT_MIX = (35, 20, 15, 15, 15)
COUNT_KIND = coherence.GROUP_COUNT
#: Shares of the writes to a present document: the rest are deletes.
UPDATE_SHARE = 0.8

#: Row of a read: kind, document (group for a count), version (count),
#: applied time, end (monotonic ns).
ROW = struct.Struct("<biqqq")
#: Row of a write: operation, document, version, operationTime, sent, ack.
WROW = struct.Struct("<biqqqq")
OP_UPDATE, OP_DELETE, OP_INSERT = 0, 1, 2
OP_NAMES = ("update", "delete", "insert")

#: Per-worker counters in shared memory, published by the worker.
STATS = ("ops", "reads", "writes", "hits", "misses", "bypasses", "errors", "ring_full", "rows")
#: A worker refreshes its manager's counters this often (operations).
SNAPSHOT_EVERY = 64
#: What a sample keeps of the owner's ``SharedCache.snapshot()``.
OWNER_KEYS = (
    "used_bytes", "budget_bytes", "entries", "evictions", "invalidations", "admissions_accepted",
    "admissions_rejected", "admissions_dropped", "attached_workers", "active_streams",
)  # fmt: skip
#: The arena's counters in the report, and the owner's names for them.
COUNTERS = {
    "evictions": "evictions",
    "admissions": "admissions_accepted",
    "invalidations": "invalidations",
    "ring_dropped": "admissions_dropped",
}

#: The measured period's verdict needs at least this long and this many samples.
MIN_VERDICT_MINUTES = 2.0
MIN_VERDICT_SAMPLES = 10
WARMUP_CAP_S = 60.0

#: The run's options with a default: (option, type, default, help).
OPTIONS = (
    ("--workers", int, 8, "worker processes (default %(default)s)"),
    ("--documents", int, 6000, "documents (default %(default)s)"),
    ("--groups", int, 600, "groups (default %(default)s)"),
    ("--pad-bytes", int, 1024, "pad of each document"),
    ("--budget-mib", float, 4.0, "the arena's payload budget"),
    ("--slots", int, 4096, "the arena's slots"),
    ("--write-share", float, 0.10, "share of writes (default %(default)s)"),
    ("--pause-ms", float, 0.0, "pause of a worker after each operation"),
    ("--warmup-share", float, 0.2, "warm-up share (at most 60 s)"),
    ("--max-slope", float, 0.5, "flat: RSS slope at most this MiB/min"),
    ("--timeout", float, 60.0, "seconds any one wait may take"),
)


# -- Slopes and verdicts ---------------------------------------------------------


def slope_per_minute(times_s: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against ``times_s``, per minute (NaN
    for fewer than two samples or a single time)."""
    if len(times_s) != len(values):
        raise ValueError("times and values differ in length")
    try:
        return statistics.linear_regression(times_s, values).slope * 60.0
    except statistics.StatisticsError:
        return float("nan")


def trend(times_s: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """First, last, lowest and highest value and the fitted slope per minute."""
    ends = (values[0], values[-1], min(values), max(values)) if values else (float("nan"),) * 4
    return {
        "samples": len(times_s),
        "minutes": (times_s[-1] - times_s[0]) / 60.0 if times_s else 0.0,
        **dict(zip(("start", "end", "min", "max"), ends, strict=True)),
        "slope_per_min": slope_per_minute(times_s, values),
    }


def flatness(times_s: Sequence[float], rss_bytes: Sequence[float], max_slope_mib_per_min: float) -> dict[str, Any]:
    """RSS at the first and last sample, the fitted slope in MiB/min and the
    verdict: ``flat`` (slope at most the threshold), ``growing`` or
    ``too_short`` (fewer samples or a shorter span than needed to judge)."""
    t = trend(times_s, [v / MiB for v in rss_bytes])
    slope = t["slope_per_min"]
    if t["samples"] < MIN_VERDICT_SAMPLES or t["minutes"] < MIN_VERDICT_MINUTES or math.isnan(slope):
        verdict = "too_short"
    else:
        verdict = "flat" if slope <= max_slope_mib_per_min else "growing"
    return {
        "samples": t["samples"],
        "minutes": t["minutes"],
        **{f"{k}_mib": t[k] for k in ("start", "end", "min", "max")},
        "slope_mib_per_min": slope,
        "threshold_mib_per_min": max_slope_mib_per_min,
        "verdict": verdict,
    }


def warmup_seconds(duration_s: float, share: float) -> float:
    """The warm-up: ``share`` of the run, at most a minute."""
    return min(WARMUP_CAP_S, duration_s * share)


# -- Workers ---------------------------------------------------------------------


class _Worker:
    """One spawned worker of the soak: its documents, its Zipf picks, its
    reads and writes (rows to its two files) and its counters."""

    def __init__(self, spec: dict[str, Any], manager: Any, reads: BinaryIO, writes: BinaryIO) -> None:
        self.spec, self.manager, self.reads, self.writes = spec, manager, reads, writes
        self.index, self.workers, self.n = spec["index"], spec["workers"], spec["documents"]
        self.groups, self.pad, self.db = spec["groups"], spec["pad_bytes"], spec["db"]
        self.coll = manager[self.db][COLL]
        # Zipf: cumulative weights by rank, and the document at each rank (a
        # seeded order, the same in every worker).
        self.cum = list(itertools.accumulate(1.0 / (r + 1) ** ZIPF_S for r in range(self.n)))
        self.by_rank = list(range(self.n))
        random.Random(f"{spec['seed']}/ranks").shuffle(self.by_rank)
        mine = range(self.index, self.n, self.workers)
        self.versions, self.present = dict.fromkeys(mine, 0), dict.fromkeys(mine, True)
        self.rng = random.Random(f"{spec['seed']}/{self.index}")
        self.mix_cum = list(itertools.accumulate(spec["mix"]))
        self.session: Any = None
        self.by_kind, self.by_op = dict.fromkeys(READ_KINDS, 0), dict.fromkeys(OP_NAMES, 0)
        self.errors = 0
        self.error_examples: list[str] = []
        self.checked = coherence.Reads({**spec, "total": self.n, "deletes": True}, rows=_FileRows(reads))

    def pick(self) -> int:
        return self.by_rank[min(bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1]), self.n - 1)]

    def write(self) -> None:
        """A write to one of this worker's documents: an update or a delete
        of a present one, an insert of an absent one, at the next version."""
        k, workers, raw, session = self.pick(), self.workers, self.coll.raw, self.session
        k = k - k % workers + self.index
        if k >= self.n:
            k -= workers
        v = self.versions[k] + 1
        if self.present[k]:
            op = OP_UPDATE if self.rng.random() < UPDATE_SHARE else OP_DELETE
        else:
            op = OP_INSERT
        sent = time.monotonic_ns()
        if op == OP_UPDATE:
            raw.update_one({"_id": k}, {"$set": {"version": v, "stamp": f"{k}:{v}"}}, session=session)
        elif op == OP_DELETE:
            raw.delete_one({"_id": k}, session=session)
        else:
            raw.insert_one(document(k, v, self.groups, self.pad), session=session)
        ack = time.monotonic_ns()
        if session.operation_time is None:
            raise BenchmarkFailed("the server returned no operationTime for a write")
        self.versions[k] = v
        self.present[k] = op != OP_DELETE
        self.by_op[OP_NAMES[op]] += 1
        self.writes.write(WROW.pack(op, k, v, timestamp_int(session.operation_time), sent, ack))

    def read(self) -> None:
        """One read of a random kind, checked and recorded by
        ``coherence.Reads``: a row per document it returned, and an
        ``ABSENT`` one for each it was asked for and left out."""
        kind = min(bisect.bisect_right(self.mix_cum, self.rng.random() * self.mix_cum[-1]), len(READ_KINDS) - 1)
        k = self.pick()
        target = k % self.groups if kind in coherence.GROUPED else k
        self.by_kind[READ_KINDS[kind]] += 1
        # Through the manager each time: after a re-attach (an owner
        # heartbeat late by 500 ms is enough) a native cache held here
        # would keep the old arena and ring mapped for the rest of the run.
        a = applied_time(self.manager, self.db)
        got = coherence.read(self.coll, kind, target)
        self.checked.record(kind, target, got, 0, a, 0, time.monotonic_ns())

    def counters(self, snap: Any, before: Any) -> dict[str, int]:
        """``STATS``: the manager's counters from ``before`` to ``snap``, and this worker's."""
        reads, writes = sum(self.by_kind.values()), sum(self.by_op.values())
        return {
            "ops": reads + writes, "reads": reads, "writes": writes, "hits": snap.hits - before.hits,
            "misses": snap.misses - before.misses, "bypasses": snap.bypass_total - before.bypass_total,
            "errors": self.errors, "ring_full": snap.rejected_admissions.get("ring_full", 0),
            "rows": self.checked.rows.count,
        }  # fmt: skip

    def loop(self, shared: Shared) -> dict[str, Any]:
        """Operations until the parent's stop, the counters published in
        ``shared.stats``; the worker's figures."""
        base, pause = self.index * len(STATS), self.spec["pause_ms"] / 1000
        before = self.manager.snapshot()
        shared.barrier.wait(self.spec["timeout"])
        ops = 0
        while not shared.stop.value:
            is_write = self.rng.random() < self.spec["write_share"]
            try:
                if is_write:
                    self.write()
                else:
                    self.read()
            except PyMongoError as exc:
                # A failed write may or may not have been applied: the
                # oracle would no longer know this worker's versions.
                if is_write:
                    raise BenchmarkFailed(f"a write failed: {type(exc).__name__}: {exc}") from exc
                self.errors += 1
                if len(self.error_examples) < MAX_EXAMPLES:
                    self.error_examples.append(f"worker {self.index}: a read failed: {type(exc).__name__}: {exc}")
            ops += 1
            if ops % SNAPSHOT_EVERY == 0:
                counters = self.counters(self.manager.snapshot(), before)
                shared.stats[base : base + len(STATS)] = [counters[name] for name in STATS]
            if pause:
                time.sleep(pause)
        after = self.manager.snapshot()
        return {
            **self.counters(after, before),
            "bypasses": dict(after.bypasses),  # by reason, since the manager was created
            "oversize": after.rejected_admissions.get("oversize", 0),
            "by_kind": self.by_kind, "by_op": self.by_op, "index": self.index, "wrong": self.checked.wrong,
            "examples": [f"worker {self.index}: {e}" for e in self.checked.examples],
            "error_examples": self.error_examples,
            "reads_path": self.reads.name, "writes_path": self.writes.name,
        }  # fmt: skip


class _FileRows:
    """``coherence.Reads``'s rows of a worker, to its file (``ROW``)."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.count = fh, 0

    def add(self, doc: int, version: int, applied: int, start: int, end: int, kind: int, bound: int = 0) -> None:
        self.fh.write(ROW.pack(kind, doc, version, applied, end))
        self.count += 1


def _worker(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A spawned worker (``kit.Pool``'s protocol; the counters are ``shared.stats``)."""
    from client_query_cache import CacheManager

    with contextlib.ExitStack() as stack:
        paths = [os.path.join(spec["dir"], f"w{spec['index']}.{what}") for what in ("reads", "writes")]
        reads, writes = (stack.enter_context(open(path, "wb", buffering=1 << 16)) for path in paths)
        client: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(spec["uri"]))
        manager = stack.enter_context(CacheManager(client, shared=spec["shared_name"]))
        worker = _Worker(spec, manager, reads, writes)
        kit.register(manager, worker.coll, spec["db"], spec["timeout"])
        worker.session = stack.enter_context(client.start_session(causal_consistency=False))
        return worker.loop(shared)


# -- The check after the run -----------------------------------------------------


def _iter_rows(path: str, row: struct.Struct) -> Iterable[tuple[int, ...]]:
    with open(path, "rb") as fh:
        while chunk := fh.read(row.size * 65536):
            if len(chunk) % row.size:
                raise BenchmarkFailed(f"{path}: a truncated row")
            yield from row.iter_unpack(chunk)


class Checker:
    """The oracle of ``benchmarks._oracle`` over every write of the run,
    extended to reads that found a document absent and to counts."""

    def __init__(self, writes: Sequence[tuple[int, int, int, int, int, int]], documents: int, groups: int) -> None:
        self.oracle = Oracle([Write(k, v, ot, sent, ack) for _, k, v, ot, sent, ack in writes])
        by_sent = sorted(writes, key=lambda w: w[4])
        #: Per document, its deletions (sent, version) in the order sent.
        self.deletions: dict[int, list[tuple[int, int]]] = {}
        for op, k, v, _, sent, _ in by_sent:
            if op == OP_DELETE:
                self.deletions.setdefault(k, []).append((sent, v))
        self.deletion_versions = {(k, v) for k, dels in self.deletions.items() for _, v in dels}
        # Group sizes over cluster time (time, size): the initial size, then
        # +1/-1 at the operationTime of each insert/delete.
        self.group_sizes = [[(-1, len(range(g, documents, groups)))] for g in range(groups)]
        for op, k, _, ot, _, _ in sorted(writes, key=lambda w: w[3]):
            if op != OP_UPDATE:
                sizes = self.group_sizes[k % groups]
                sizes.append((ot, sizes[-1][1] + (1 if op == OP_INSERT else -1)))
        self.sent_order = [w[4] for w in by_sent]
        # The smallest operationTime among the writes sent at or after each position.
        self.min_ot_from = list(itertools.accumulate(reversed([w[3] for w in by_sent]), min, initial=1 << 63))[::-1]

    def absent_version(self, doc: int, end_ns: int) -> int | None:
        """The version of the newest deletion of ``doc`` sent before
        ``end_ns``; None if none was."""
        deletions = self.deletions.get(doc, [])
        n = bisect.bisect_right(deletions, end_ns, key=lambda d: d[0])
        return deletions[n - 1][1] if n else None

    def valid_counts(self, group: int, applied: int, end_ns: int) -> set[int]:
        """The group's sizes at the cluster times from ``applied`` up to (not
        including) the first write sent after the read ended."""
        upto = self.min_ot_from[bisect.bisect_right(self.sent_order, end_ns)]
        sizes = self.group_sizes[group]
        n = bisect.bisect_right(sizes, applied, key=lambda s: s[0]) - 1
        return {size for at, size in sizes[n:] if at < upto} | {sizes[n][1]}

    def check_worker(self, index: int, path: str) -> dict[str, Any]:
        """One worker's rows: a count must be a valid one, a document found
        absent must have had a deletion sent, and a version read must be at
        least the one applied before the read and one sent before it ended."""
        found = dict.fromkeys(("rows", "counts_checked", "stale", "impossible", "wrong"), 0)
        examples: list[str] = []

        def bad(which: str, why: str) -> None:
            found[which] += 1
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"worker {index}: {why}")

        for kind, doc, version, a, end in _iter_rows(path, ROW):
            found["rows"] += 1
            name = READ_KINDS[kind]
            if kind == COUNT_KIND:
                found["counts_checked"] += 1
                valid = self.valid_counts(doc, a, end)
                if version not in valid:
                    bad("stale", f"count of group {doc} returned {version}; possible: {sorted(valid)}")
                continue
            read = self.absent_version(doc, end) if version == ABSENT else version
            if read is None:
                bad("wrong", f"{name} read found document {doc} absent, but no deletion had been sent")
                continue
            if (doc, version) in self.deletion_versions:
                bad("wrong", f"{name} read returned document {doc} at version {version}, its deletion's")
                continue
            said = f"{name} read returned document {doc} at version {read}"
            if read < (need := self.oracle.required(doc, a)):
                bad("stale", f"{said}, but version {need} had been applied before it started")
            if why := self.oracle.impossible(doc, read, end):
                bad("impossible", f"{said}, {why}")
        return {**found, "examples": examples}


def check_run(results: Sequence[dict[str, Any]], documents: int, groups: int) -> dict[str, Any]:
    writes = [w for r in results for w in _iter_rows(r["writes_path"], WROW)]
    checker = Checker(writes, documents, groups)
    per = [checker.check_worker(r["index"], r["reads_path"]) for r in results]
    examples = [e for p in per for e in p["examples"]] + [e for r in results for e in r["examples"]]
    return {
        "writes_logged": len(writes),
        "rows_checked": sum(p["rows"] for p in per),
        "counts_checked": sum(p["counts_checked"] for p in per),
        "stale_reads": sum(p["stale"] for p in per),
        "impossible_reads": sum(p["impossible"] for p in per),
        "wrong_results": sum(p["wrong"] for p in per) + sum(r["wrong"] for r in results),
        "examples": examples[:MAX_EXAMPLES],
    }


# -- The run ---------------------------------------------------------------------


def _rss(proc: psutil.Process) -> int | None:
    try:
        return int(proc.memory_info().rss)
    except psutil.Error:
        return None


@dataclasses.dataclass
class Sampler:
    """The parent's samples: the RSS of each process, the owner's snapshot
    and the workers' counters (``stats``); an owner that cannot be asked is
    an error and an empty snapshot."""

    owner: Any
    procs: dict[str, psutil.Process]
    stats: Any
    t0: float = dataclasses.field(default_factory=time.monotonic)
    samples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)

    def __call__(self) -> None:
        at = time.monotonic() - self.t0
        rss = {name: _rss(p) for name, p in self.procs.items()}
        try:
            snap = self.owner.snapshot()
            owner = {k: snap.get(k) for k in OWNER_KEYS}
        except Exception as exc:  # reported, and a failed check
            owner = {}
            self.errors.append(f"owner snapshot at {at:.1f}s: {type(exc).__name__}: {exc}")
        values = list(self.stats)
        workers = [dict(zip(STATS, values[n : n + len(STATS)], strict=True)) for n in range(0, len(values), len(STATS))]
        self.samples.append({"t": at, "rss": rss, "owner": owner, "workers": workers})


@contextlib.contextmanager
def _collection(client: pymongo.MongoClient[Any], db: str, args: argparse.Namespace) -> Iterator[None]:
    """The soak's documents, in a database of their own dropped afterwards."""
    try:
        insert_documents(client[db][COLL], args.documents, args.groups, args.pad_bytes)
        yield
    finally:
        with contextlib.suppress(Exception):
            client.drop_database(db)


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    """The soak and its report (without ``checks``); every process is ended
    and the database dropped before this returns or raises."""
    db = f"cqc_soak_{secrets.token_hex(6)}"
    duration = args.minutes * 60.0
    interval = args.sample_seconds or min(5.0, max(0.5, duration / 40))
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="cqc-soak-")
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        client: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(uri))
        status(f"inserting {args.documents} documents")
        stack.enter_context(_collection(client, db, args))
        budget = int(args.budget_mib * MiB)
        status(f"starting the owner ({budget / MiB:.1f} MiB budget, {args.slots} slots)")
        geometry = {
            "budget_bytes": budget, "slots": args.slots, "max_entry_bytes": min(MiB, budget // 4),
            "max_await_time_ms": 1000, "idle_exit_seconds": 60.0,
        }  # fmt: skip
        owner = stack.enter_context(kit.owned(kit.new_name("cqc-soak"), uri, **geometry))
        pool = stack.enter_context(kit.Pool(args.workers, stats=args.workers * len(STATS), timeout=args.timeout))
        status(f"starting {args.workers} workers")
        spec = {**vars(args), "uri": uri, "db": db, "shared_name": owner.name, "dir": workdir}
        pool.start([{**spec, "index": n} for n in range(args.workers)], _worker)
        pool.meet("start (workers attached)")
        procs = {"parent": psutil.Process(), "owner": psutil.Process(owner.pid)}
        procs.update((f"worker{n}", psutil.Process(p.pid)) for n, p in enumerate(pool.procs))
        sampler = Sampler(owner, procs, pool.shared.stats)
        status(f"running for {args.minutes:g} min, sampling every {interval:g} s")
        deadline, next_note = sampler.t0 + duration, sampler.t0 + 60
        for k in itertools.count(1):
            sampler()
            if time.monotonic() >= next_note:
                status(f"{sum(w['ops'] for w in sampler.samples[-1]['workers'])} operations")
                next_note += 60
            due = min(sampler.t0 + k * interval, deadline)
            while (now := time.monotonic()) < due:
                time.sleep(min(0.5, due - now))
                if pool.dead():
                    raise BenchmarkFailed(f"a worker died:\n{pool.errors()}")
            if due == deadline:
                break
        sampler()  # the last, while every worker is still attached
        pool.shared.stop.value = 1
        elapsed = time.monotonic() - sampler.t0
        status("collecting the workers' results")
        results = pool.collect(timeout=args.timeout + 30)
        streams = owner.snapshot().get("streams") or []
        status("checking every read against the oracle")
        checked = check_run(results, args.documents, args.groups)
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    return build_report({**params, "sample_seconds": interval}, sampler, results, checked, streams, elapsed)


# -- The report ------------------------------------------------------------------


def arena_figures(samples: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]], slots: int) -> dict[str, Any]:
    """The arena's figures from the owner's snapshots, over the run and over
    the ``measured`` period ({} without a snapshot)."""
    owners = [s["owner"] for s in samples if s["owner"]]
    if not owners:
        return {}
    last = owners[-1]
    timed = [s for s in measured if s["owner"]]
    return {
        "budget_bytes": owners[0]["budget_bytes"],
        "slots": slots,
        "used_bytes_max": max(o["used_bytes"] for o in owners),
        "used_bytes_end": last["used_bytes"],
        "entries_max": max(o["entries"] for o in owners),
        "entries_end": last["entries"],
        **{name: last[key] for name, key in COUNTERS.items()},
        "rejections": last["admissions_rejected"],
        "attached_workers_min": min(o["attached_workers"] for o in owners),
        "measured": {
            **{name: last[key] - timed[0]["owner"][key] for name, key in COUNTERS.items()},
            "used_mib": trend([s["t"] for s in timed], [s["owner"]["used_bytes"] / MiB for s in timed]),
            "entries": trend([s["t"] for s in timed], [s["owner"]["entries"] for s in timed]),
        }
        if timed
        else None,
    }


def build_report(
    params: dict[str, Any], sampler: Sampler, results: Sequence[dict[str, Any]], checked: dict[str, Any],
    streams: Sequence[dict[str, Any]], elapsed_s: float,
) -> dict[str, Any]:  # fmt: skip
    samples = sampler.samples
    warmup = warmup_seconds(elapsed_s, params["warmup_share"])
    measured = [s for s in samples if s["t"] >= warmup]
    processes = {}
    for name in samples[0]["rss"] if samples else ():
        pts = [(s["t"], s["rss"][name]) for s in measured if s["rss"].get(name) is not None]
        if len(pts) < 2:
            processes[name] = {"samples": len(pts), "verdict": "too_short"}
        else:
            processes[name] = flatness([t for t, _ in pts], [v for _, v in pts], params["max_slope"])
    return {
        "schema": SCHEMA,
        "machine": kit.machine_facts(),
        "params": params,
        "elapsed_s": elapsed_s,
        "warmup_s": warmup,
        "samples": len(samples),
        "processes": processes,
        "arena": arena_figures(samples, measured, params["slots"]),
        "streams": list(streams),
        "throughput": throughput(samples),
        "totals": totals(results),
        "oracle": checked,
        "stale_reads": checked["stale_reads"],
        "errors": sum(r["errors"] for r in results),
        "error_examples": [e for r in results for e in r["error_examples"]][:MAX_EXAMPLES],
        "sample_errors": sampler.errors,
        "series": samples,
    }


def throughput(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operations, reads, writes and hits in each minute of the run, from the
    workers' counters at the last sample of each minute (the last row may be
    a partial minute)."""
    out: list[dict[str, Any]] = []
    start = samples[0] if samples else None
    for i, s in enumerate(samples[1:], 1):
        minute = len(out) + 1
        if i + 1 < len(samples) and samples[i + 1]["t"] <= minute * 60:
            continue
        row: dict[str, Any] = {"minute": minute, "seconds": s["t"] - start["t"]}
        for key in ("ops", "reads", "writes", "hits", "misses"):
            row[key] = sum(w[key] for w in s["workers"]) - sum(w[key] for w in start["workers"])
        row["ops_per_min"] = row["ops"] / row["seconds"] * 60 if row["seconds"] > 0 else float("nan")
        out.append(row)
        start = s
    return out


def totals(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    bypasses: collections.Counter[str] = collections.Counter()
    for r in results:
        bypasses.update(r["bypasses"])
    summed = ("ops", "reads", "writes", "hits", "misses", "ring_full", "oversize")
    return {
        **{k: sum(r[k] for r in results) for k in summed},
        "reads_by_kind": {k: sum(r["by_kind"][k] for r in results) for k in READ_KINDS},
        "writes_by_op": {k: sum(r["by_op"][k] for r in results) for k in OP_NAMES},
        "bypasses": dict(bypasses),
    }


def checks(report: dict[str, Any]) -> list[str]:
    problems = []
    o = report["oracle"]
    if o["stale_reads"]:
        problems.append(f"{o['stale_reads']} stale reads")
    if o["impossible_reads"] or o["wrong_results"]:
        problems.append(f"{o['impossible_reads'] + o['wrong_results']} wrong results")
    problems.extend(o["examples"])
    if report["errors"]:
        problems.append(f"{report['errors']} reads failed")
        problems.extend(report["error_examples"])
    problems.extend(report["sample_errors"][:MAX_EXAMPLES])
    t = report["totals"]
    if not t["hits"]:
        problems.append("no read was served from the cache")
    if not t["writes"]:
        problems.append("no write was made")
    a = report["arena"]
    if not a:
        problems.append("no snapshot of the owner")
    else:
        if a["used_bytes_max"] > a["budget_bytes"]:
            problems.append(f"arena used {a['used_bytes_max']} bytes, over its budget of {a['budget_bytes']}")
        if a["entries_max"] > a["slots"]:
            problems.append(f"arena held {a['entries_max']} entries, more than its {a['slots']} slots")
        if not a["evictions"]:
            problems.append("no eviction: the documents fit in the arena")
        if a["attached_workers_min"] != report["params"]["workers"]:
            problems.append(f"only {a['attached_workers_min']} workers attached at some sample")
    for s in report["streams"]:
        if s["state"] != "healthy" or s["history_lost"]:
            problems.append(f"stream of {s['database']}: {s['state']}, history lost {s['history_lost']} times")
    for name, p in report["processes"].items():
        if p["verdict"] == "growing":
            problems.append(
                f"{name}: RSS grew {p['slope_mib_per_min']:.3f} MiB/min (threshold {p['threshold_mib_per_min']})"
            )
    return problems


def print_report(report: dict[str, Any], out: Any = None) -> None:
    p, a, t, o = report["params"], report["arena"], report["totals"], report["oracle"]
    with contextlib.redirect_stdout(out or sys.stdout):
        print(
            f"soak: {p['workers']} workers, {report['elapsed_s'] / 60:.2f} min, warm-up {report['warmup_s']:.0f} s, "
            f"{report['samples']} samples"
        )
        kit.table(
            [("process", "<10"), ("start MiB", ">10.1f"), ("end MiB", ">9.1f"), ("max MiB", ">9.1f"),
             ("slope MiB/min", ">14.3f"), ("verdict", ">10")],
            [(name, *(kit.cell(r.get(k)) for k in ("start_mib", "end_mib", "max_mib", "slope_mib_per_min")),
              r["verdict"]) for name, r in report["processes"].items()],
        )  # fmt: skip
        print(f"flat: slope <= {p['max_slope']} MiB/min over the measured period")
        if a:
            print(
                f"arena: used max {a['used_bytes_max'] / MiB:.2f} / budget {a['budget_bytes'] / MiB:.2f} MiB, "
                f"entries max {a['entries_max']} / {a['slots']} slots, evictions {a['evictions']}, "
                f"admissions {a['admissions']}, rejections {a['rejections']}, ring dropped {a['ring_dropped']}, "
                f"invalidations {a['invalidations']}"
            )
        if a and a["measured"]:
            m, u, e = a["measured"], a["measured"]["used_mib"], a["measured"]["entries"]
            print(
                f"arena over the measured period: used MiB {u['start']:.2f} -> {u['end']:.2f} "
                f"(min {u['min']:.2f}, max {u['max']:.2f}, slope {u['slope_per_min']:.3f}/min), "
                f"entries {e['start']} -> {e['end']} (min {e['min']}, max {e['max']}, "
                f"slope {e['slope_per_min']:.1f}/min), evictions {m['evictions']}, admissions {m['admissions']}"
            )
        for s in report["streams"]:
            print(f"stream {s['database']}: {s['state']}, events {s['events']}, reconnects {s['reconnects']}")
        kit.table(
            [("minute", ">6"), ("seconds", ">8.1f"), ("ops", ">8"), ("reads", ">8"), ("writes", ">7"), ("hits", ">8"),
             ("ops/min", ">9.0f")],
            [[r[k] for k in ("minute", "seconds", "ops", "reads", "writes", "hits", "ops_per_min")]
             for r in report["throughput"]],
        )  # fmt: skip
        print(
            f"reads {t['reads']} ({t['reads_by_kind']}), writes {t['writes']} ({t['writes_by_op']}), "
            f"hits {t['hits']}, misses {t['misses']}, bypasses {t['bypasses']}"
        )
        print(
            f"checked {o['rows_checked']} rows ({o['counts_checked']} counts) against {o['writes_logged']} writes: "
            f"stale_reads {o['stale_reads']}, impossible {o['impossible_reads']}, wrong {o['wrong_results']}, "
            f"errors {report['errors']}"
        )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("soak", __doc__)
    parser.add_argument("--minutes", type=float, required=True, help="length of the run (a fraction is allowed)")
    for option, type_, default, help_ in OPTIONS:
        parser.add_argument(option, type=type_, default=default, help=help_)
    parser.add_argument(
        "--mix", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_MIX,
        help=f"weights of the read kinds {','.join(READ_KINDS)} (default {','.join(map(str, DEFAULT_MIX))})",
    )  # fmt: skip
    parser.add_argument("--sample-seconds", type=float, help="sampling interval (default: min(5, run / 40), >= 0.5)")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be positive")
    kit.at_least_one(parser, args, ("workers", "documents", "groups", "slots"))
    if args.groups > args.documents or args.documents < args.workers:
        parser.error("--documents must be at least --groups and --workers")
    if not 0 <= args.write_share < 1:
        parser.error("--write-share must be in [0, 1)")
    if len(args.mix) != len(READ_KINDS) or min(args.mix) < 0 or not sum(args.mix):
        parser.error(f"--mix takes {len(READ_KINDS)} non-negative weights")
    if not 0 <= args.warmup_share < 1:
        parser.error("--warmup-share must be in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return kit.checked_main(_parse(argv), run, checks, print_report)


if __name__ == "__main__":
    sys.exit(main())
