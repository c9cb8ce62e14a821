"""Collection-read benchmark: cached against direct for find, aggregate, counts, distinct.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.collection_reads`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
from pymongo.read_concern import ReadConcern

from client_query_cache import CacheManager

from . import _kit as kit
from ._kit import make_document, progress, summarize
from ._oracle import Oracle, Rows, Write, applied_time, hit_fraction, initial_versions, judge

SCHEMA = "client-query-cache/collection-reads/2"
HOT_GROUPS = 16
HOT_BUCKETS = 4
BUCKETS = 20
PHASES = ("hot", "cold", "writer")
#: ``make_document``'s version; the writer sets the next one each time.
INITIAL_VERSION = 1
#: The least share of the writer phase's cached reads (all operations
#: together) that must hit, so that the oracle has hits to judge: every
#: write invalidates every cached read of the collection, so few hit (see
#: docs/benchmarks.md for the figures it was chosen from).
MIN_WRITER_HIT_FRACTION = 0.03
VIOLATIONS = ("stale_reads", "monotonic_violations", "impossible_reads")

#: What a full run is held to (README's figures; docs/benchmarks.md, "Targets"):
#: the worst operation of each phase.
TARGETS = (
    kit.Target("ratios.*.hot_cached_over_direct_p50", "<=", 0.2),
    kit.Target("ratios.*.cold_cached_over_direct_p50", "<=", 1.1),
)
#: The targets by ratio name (``hot_cached_over_direct_p50``, ...).
BOUNDS = {t.figure.rsplit(".", 1)[1]: t.bound for t in TARGETS}

# name -> (method, builder of (args, kwargs) from (group, bucket, extra filter))
Op = Callable[[int, int, dict[str, Any]], tuple[str, tuple[Any, ...], dict[str, Any]]]
OPERATIONS: dict[str, Op] = {
    "find_one": lambda g, b, x: ("find_one", ({"group": g, "age": {"$gte": 18}, **x},), {"sort": [("_id", -1)]}),
    "find_small": lambda g, b, x: ("find", ({"group": g, **x},), {"sort": [("_id", 1)]}),
    "find_large": lambda g, b, x: ("find", ({"bucket": b, **x},), {"sort": [("_id", 1)]}),
    "aggregate": lambda g, b, x: ("aggregate", ([
        {"$match": {"group": g, **x}},
        {"$group": {"_id": "$address.city", "n": {"$sum": 1}, "age": {"$avg": "$age"}}},
        {"$sort": {"_id": 1}},
    ],), {}),
    "count": lambda g, b, x: ("count_documents", ({"bucket": b, "age": {"$gte": 40}, **x},), {}),
    "distinct": lambda g, b, x: ("distinct", ("address.city", {"group": g, **x}), {}),
}  # fmt: skip
COLUMNS = (
    ("operation", "<11"), ("phase", "<7"), ("direct p50", ">10.1f"), ("p95", ">9.1f"), ("cached p50", ">10.1f"),
    ("p95", ">9.1f"), ("ratio", ">7.3f"), ("minus", ">9.1f"), ("target", ">7"), ("hits", ">6"),
)  # fmt: skip


def _call(coll: Any, op: tuple[str, tuple[Any, ...], dict[str, Any]]) -> Any:
    method, args, kwargs = op
    result = getattr(coll, method)(*args, **kwargs)
    return list(result) if method in ("find", "aggregate") else result


def _writer(uri: str, db: str, docs: int, interval: float, stop: Any, count: Any, log: Any) -> None:
    """Set the next ``version`` of one random document every ``interval``
    seconds until ``stop`` (``kit.Writer``); then put every write on ``log``."""
    with pymongo.MongoClient(uri) as client:
        writer = kit.Writer(client[db]["docs"], range(docs), 7, first=INITIAL_VERSION)
        try:
            writer.run(stop, interval, counter=count)
        finally:
            log.put(writer.acked)


class _UnderWrites:
    """Writer phase: the two reads of a sample may straddle a write, which
    changes only documents' ``version``. So the cached result must equal the
    direct one but for the versions (count, distinct and aggregate do not
    depend on them: exactly), and every document a cached find returned is
    judged by the oracle (``benchmarks._oracle``): stale against the applied
    time taken right before the read, monotonic against this process's
    earlier cached reads (the reader does not write: no read-your-writes)."""

    def __init__(self, manager: CacheManager, db: str) -> None:
        self.manager, self.db = manager, db
        self.rows = Rows()

    def before(self) -> tuple[int, int]:
        return applied_time(self.manager, self.db), time.monotonic_ns()

    def differs(self, op_name: str, cached: Any, direct: Any, stamp: tuple[int, int, int]) -> bool:
        if not op_name.startswith("find"):
            return bool(cached != direct)
        cached = [cached] if op_name == "find_one" else cached
        direct = [direct] if op_name == "find_one" else direct
        for doc in cached:
            if doc is not None:
                self.rows.add(doc["_id"], doc["version"], stamp[0], stamp[1], stamp[2], 0)
        return _unversioned(cached) != _unversioned(direct)

    def verdict(self, writes: list[Write], documents: int) -> dict[str, Any]:
        oracle = Oracle([*initial_versions(documents, INITIAL_VERSION), *writes])
        verdict = judge(self.rows, oracle=oracle)
        return {**verdict.counts(), "documents_checked": len(self.rows), "examples": list(verdict.examples)}


def _unversioned(docs: list[Any]) -> list[Any]:
    return [None if d is None else {k: v for k, v in d.items() if k != "version"} for d in docs]


@dataclasses.dataclass
class _Bench:
    """What every phase reads with: the manager, the cached and the direct
    collection, the samples per operation, the seeded choices from the hot set."""

    manager: CacheManager
    cached: Any
    direct: Any
    samples: int
    rng: random.Random
    groups: list[int]
    buckets: list[int]
    #: The cold phase's k of ``{"_id": {"$ne": -k}}``, new for every sample.
    cold: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(1))


def _phase(b: _Bench, name: str, checker: _UnderWrites | None = None) -> tuple[dict[str, Any], list[str]]:
    """Time every operation ``b.samples`` times, cached and direct back to
    back; the cached result must equal the direct one (under writes,
    ``checker`` compares and judges what each sample returned)."""
    clock = time.perf_counter_ns
    results: dict[str, Any] = {}
    problems: list[str] = []
    for op_name, build in OPERATIONS.items():
        ns: tuple[list[int], list[int]] = ([], [])  # cached, direct
        mismatches = 0
        before = b.manager.snapshot()
        gc.collect()
        for n in range(b.samples):
            extra = {"_id": {"$ne": -next(b.cold)}} if name == "cold" else {}
            op = build(b.rng.choice(b.groups), b.rng.choice(b.buckets), extra)
            # The cached and the direct read, in alternating order; for the
            # oracle, the cached read's (applied time, start, end), taken
            # outside the timed region.
            got, stamp = [None, None], (0, 0, 0)
            for which in (0, 1) if n % 2 == 0 else (1, 0):
                applied, start = checker.before() if checker is not None and which == 0 else (0, 0)
                t0 = clock()
                got[which] = _call((b.cached, b.direct)[which], op)
                ns[which].append(clock() - t0)
                if which == 0:
                    stamp = (applied, start, time.monotonic_ns())
            mismatches += checker.differs(op_name, *got, stamp) if checker else got[0] != got[1]
        # Reads sent to MongoDB by the causal floor (the stream had not yet
        # applied what the process had seen) are counted apart, as ``behind``:
        # any other bypass is a problem.
        counts = kit.counted(before, b.manager.snapshot(), ("hits", "misses", "admissions"))
        c, d = summarize(ns[0]), summarize(ns[1])
        r = results[op_name] = {
            "cached": c,
            "direct": d,
            "cached_over_direct_p50": c["p50_us"] / d["p50_us"],
            # The cache's own cost (or saving), which the server's speed does not scale.
            "cached_minus_direct_p50_us": c["p50_us"] - d["p50_us"],
        }
        r.update(counts, mismatches=mismatches)
        hits, misses, admitted = counts["hits"], counts["misses"], counts["admissions"]
        if mismatches:
            problems.append(f"{name}/{op_name}: {mismatches} cached results differ from the direct read")
        if r["bypasses"]:
            problems.append(f"{name}/{op_name}: {r['bypasses']} reads bypassed the cache")
        if name == "hot" and hits != b.samples:
            problems.append(f"hot/{op_name}: {hits} hits for {b.samples} reads")
        if name == "cold" and (misses != b.samples or admitted != b.samples):
            problems.append(f"cold/{op_name}: {misses} misses, {admitted} admissions for {b.samples} reads")
        progress(
            f"  {name:<6} {op_name:<10} cached p50 {c['p50_us']:9.1f} us  direct p50 {d['p50_us']:9.1f} us  "
            f"ratio {r['cached_over_direct_p50']:.3f}  hits {hits}/{b.samples}"
        )
    return results, problems


def _writer_phase(
    uri: str, db_name: str, documents: int, interval: float, b: _Bench, phases: dict[str, Any]
) -> list[str]:
    """The writer phase: another process writes while the samples run; every
    sample is compared and judged (``_UnderWrites``). Fills ``phases``
    (``writer``, ``writer_updates``, ``writer_judgement``); returns the
    problems."""
    progress(f"writer phase: one update every {interval * 1000:.0f} ms from another process")
    ctx = kit.context()
    stop, count, log = ctx.Event(), ctx.Value("l", 0), ctx.Queue()
    writer = kit.spawn(_writer, uri, db_name, documents, interval, stop, count, log)
    checker = _UnderWrites(b.manager, db_name)
    try:
        kit.wait_until(lambda: count.value or not writer.is_alive(), 60)  # the phase starts once writes flow
        started, first = time.perf_counter(), count.value
        phases["writer"], problems = _phase(b, "writer", checker)
        elapsed, updates = time.perf_counter() - started, count.value - first
    finally:
        stop.set()
        done = log.get(timeout=60)  # the writer's log, put when it stops
        writer.join(30)
    phases["writer_updates"] = {"count": updates, "seconds": elapsed}
    if updates == 0:
        problems.append("writer phase: the writer made no update")
    verdict = checker.verdict(done, documents)
    return problems + _judge_writer_phase(phases, verdict, b.samples)


def _judge_writer_phase(phases: dict[str, Any], verdict: dict[str, Any], samples: int) -> list[str]:
    """The oracle's verdict and the hit fraction of the writer phase."""
    reads = samples * len(OPERATIONS)
    hits = sum(phases["writer"][op]["hits"] for op in OPERATIONS)
    fraction = hit_fraction(hits, reads)
    verdict.update(reads=reads, hits=hits, hit_fraction=fraction, min_hit_fraction=MIN_WRITER_HIT_FRACTION)
    phases["writer_judgement"] = verdict
    problems = [f"writer phase: {verdict[key]} {key.replace('_', ' ')}" for key in VIOLATIONS if verdict[key]]
    problems += [f"writer phase: {e}" for e in verdict["examples"] if problems]
    if verdict["hit_fraction"] < MIN_WRITER_HIT_FRACTION:
        problems.append(
            f"writer phase: {hits} of {reads} cached reads hit, under the {MIN_WRITER_HIT_FRACTION:.0%} "
            "the judgement needs to mean anything"
        )
    return problems


def run(uri: str, documents: int, groups: int, samples: int, seed: int, write_interval: float) -> dict[str, Any]:
    rng = random.Random(seed)
    db_name = f"cqc_bench_{uuid.uuid4().hex[:12]}"
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    problems: list[str] = []
    phases: dict[str, Any] = {}
    try:
        coll = client[db_name]["docs"]
        progress(f"inserting {documents} documents...")
        coll.insert_many(
            [{**make_document(i, rng, 1024), "group": i % groups, "bucket": i % BUCKETS} for i in range(documents)]
        )
        # Indexes on the filtered fields, as an application would have them
        # (without them every read scans the collection on the server).
        coll.create_index("group")
        coll.create_index("bucket")
        direct = coll.with_options(read_concern=ReadConcern("majority"))
        hot_groups = rng.sample(range(groups), min(HOT_GROUPS, groups))
        hot_buckets = rng.sample(range(BUCKETS), HOT_BUCKETS)
        with CacheManager(client) as manager:
            bench = _Bench(manager, manager[db_name]["docs"], direct, samples, rng, hot_groups, hot_buckets)
            progress("warming up...")
            hot = [build(g, b, {}) for build in OPERATIONS.values() for g in hot_groups for b in hot_buckets]
            for op in hot:
                _call(direct, op)
            kit.warm_ready(manager, [functools.partial(_call, bench.cached, op) for op in hot], 30, db_name)
            for phase in ("hot", "cold"):
                progress(f"{phase} phase: {samples} samples per operation")
                phases[phase], found = _phase(bench, phase)
                problems += found
            problems += _writer_phase(uri, db_name, documents, write_interval, bench, phases)
    finally:
        client.drop_database(db_name)
        client.close()
    ratios = {
        op: {
            **{f"{ph}_cached_over_direct_p50": phases[ph][op]["cached_over_direct_p50"] for ph in PHASES},
            "writer_hit_rate": phases["writer"][op]["hits"] / samples,
        }
        for op in OPERATIONS
    }
    return {
        "schema": SCHEMA,
        "config": {
            "documents": documents, "groups": groups, "buckets": BUCKETS, "hot_groups": HOT_GROUPS,
            "hot_buckets": HOT_BUCKETS, "samples": samples, "seed": seed, "write_interval_s": write_interval,
        },  # fmt: skip
        "machine": kit.machine_facts(),
        "phases": phases,
        "ratios": ratios,
        "targets": dict(BOUNDS),
        "checks": {"passed": not problems, "problems": problems},
    }


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"collection reads: {cfg['documents']} documents of ~1 KiB, {cfg['samples']} samples per "
        f"operation and phase, cached and direct back to back; latencies in us (nearest rank); "
        f"minus: cached p50 minus direct p50"
    )
    rows = []
    for phase in PHASES:
        bound = BOUNDS.get(f"{phase}_cached_over_direct_p50")
        for op, r in report["phases"][phase].items():
            ratio, c, d = r["cached_over_direct_p50"], r["cached"], r["direct"]
            mark = "" if bound is None else f"<= {bound:.2f}" + (" MISSED" if ratio > bound else "")
            minus = r["cached_minus_direct_p50_us"]
            rows.append((op, phase, d["p50_us"], d["p95_us"], c["p50_us"], c["p95_us"], ratio, minus, mark, r["hits"]))
    kit.table(COLUMNS, rows)
    w, j = report["phases"]["writer_updates"], report["phases"]["writer_judgement"]
    print(f"writer: {w['count']} updates in {w['seconds']:.1f} s during the writer phase")
    print(
        f"writer phase judged: {j['documents_checked']} documents of cached finds; stale_reads {j['stale_reads']}, "
        f"monotonic_violations {j['monotonic_violations']}, impossible_reads {j['impossible_reads']}; "
        f"{j['hits']} of {j['reads']} cached reads hit (at least {j['min_hit_fraction']:.0%} required)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = kit.parser("collection_reads", __doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run (fewer documents and samples)")
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--write-interval-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    documents = args.documents or (1000 if args.quick else 2000)
    samples = args.samples or (40 if args.quick else 400)
    groups = max(HOT_GROUPS, documents // 20)
    report = kit.with_server(
        lambda uri: run(uri, documents, groups, samples, args.seed, args.write_interval_ms / 1000), timed=True
    )
    if report is None:
        return 1
    report["mode"] = "quick" if args.quick else "full"
    problems = report["checks"]["problems"]
    return kit.conclude(report, problems, _print, args.json, elapsed=True, targets=TARGETS, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
