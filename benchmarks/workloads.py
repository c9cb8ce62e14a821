"""Workload benchmark: read/write mixes x document sizes, and invalidation latency.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.workloads`.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import random
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

import bson
import pymongo
from pymongo.read_concern import ReadConcern

from client_query_cache import CacheManager

from . import _kit as kit
from . import coherence
from ._kit import MAX_EXAMPLES, BenchmarkFailed, Status, quantile, summarize
from ._oracle import Oracle, Rows, Write, WriteTimes, applied_time, initial_versions, judge, judge_all

SCHEMA = "cqc.workloads/2"

#: Share of reads among the operations of each mix.
MIXES: dict[str, float] = {"read_heavy": 0.95, "balanced": 0.50, "write_dominant": 0.10}
#: Target BSON bytes of each document size.
SIZES: dict[str, int] = {"small": 200, "medium": 2048, "large": 20480}
#: Paths of the mix matrix (the cached ones after the first), and of the
#: invalidation measurement.
PATHS = ("direct", "local", "shared")
CACHED = PATHS[1:]
INV_PATHS = ("shared", "local")

#: Change-stream getMore wait of every cache (the library's default, and
#: the owners': ``kit.checked_owner``).
MAX_AWAIT_TIME_MS = 1000
#: The local managers get the owner's budget and slot count (DESIGN.md's benchmark).
LOCAL = {"budget_bytes": 32 * kit.MiB, "slot_count": 16384, "max_await_time_ms": MAX_AWAIT_TIME_MS}

#: Zipf exponent of the key distribution (YCSB's "zipfian constant").
ZIPF_S = 0.99
#: Part 2: one write per this many reads (all workers together).
READS_PER_WRITE = 20
#: Part 2: document size, and how many documents the workers read: few, so
#: that each worker reads each of them often (the resolution of the upper
#: bound is the interval between two reads of the same document).
INV_DOC_BYTES = 2048
INV_KEYS = 4
#: Part 2: how long workers keep reading after observing every final version.
TAIL_NS = 200_000_000
#: Part 2: bounds of the pause after each read that paces the workers.
PACE_START_S = 0.0005
PACE_MIN_S = 0.00002
PACE_MAX_S = 0.05
#: Part 1: reads of the direct path before the timed operations.
DIRECT_WARM_READS = 32

#: The oracle's judgements (``benchmarks._oracle``): each must be 0 on
#: every path of every cell and of the invalidation measurement.
VIOLATIONS = ("stale_reads", "monotonic_violations", "read_your_writes_violations")
#: The least share of a cached path's reads that must hit, per mix of the
#: matrix and in the invalidation measurement: under it the judgement covers
#: too few hits to mean anything (docs/benchmarks.md: the figures they were
#: chosen from).
MIN_HIT_RATIO = {"read_heavy": 0.25, "balanced": 0.2, "write_dominant": 0.15}
MIN_INV_HIT_RATIO = 0.5

FULL = {"keys": 1000, "ops": 2000, "writes": 500}
QUICK = {"keys": 100, "ops": 200, "writes": 60}


def sized_document(i: int, rng: random.Random, target_bytes: int) -> dict[str, Any]:
    """``make_document(i, rng, target_bytes)``; when its fixed fields alone
    exceed the target (about 1.4 KiB), the bulkiest of them are dropped and
    the text field is sized again. ``version`` is always kept (writes set it)."""
    doc = kit.make_document(i, rng, target_bytes)
    if len(bson.encode(doc)) <= target_bytes + 16:
        return doc
    for field in ("bio", "history", "tags", "address"):
        doc.pop(field, None)
        if len(bson.encode(doc)) <= target_bytes:
            break
    text = kit.filler(doc, rng, target_bytes)
    if text:
        doc["bio"] = text
    return doc


def _documents(count: int, target_bytes: int, seed: str) -> list[bytes]:
    rng = random.Random(seed)
    return [bson.encode(sized_document(i, rng, target_bytes)) for i in range(count)]


def zipf_keys(n: int, count: int, rng: random.Random, s: float = ZIPF_S) -> list[int]:
    """``count`` keys in ``range(n)``, Zipf-distributed over a random rank order."""
    cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))
    by_rank = list(range(n))
    rng.shuffle(by_rank)
    return [by_rank[r] for r in rng.choices(range(n), cum_weights=cum, k=count)]


def _warm(manager: Any, reader: Any, db: str, keys: int, timeout: float, what: str) -> int:
    """Start the database's stream (the first read registers the namespace)
    and wait until it is ready, then read every key until a whole pass hits;
    return the passes it took."""
    kit.register(manager, reader, db, timeout, label=f"{what}: ")
    reads = [functools.partial(reader.find_one, {"_id": k}) for k in range(keys)]
    return kit.warm_ready(manager, reads, timeout, db, label=f"{what}: ")


# -- Part 1: the mix matrix ------------------------------------------------------


class MatrixPaths:
    """The three paths of the matrix: a client and a database each, the local
    manager and the shared owner with this process attached to it."""

    def __init__(self, uri: str, db_prefix: str, timeout: float) -> None:
        self.timeout = timeout
        self.dbs = {p: f"{db_prefix}_{p}" for p in PATHS}
        self.clients: dict[str, pymongo.MongoClient[Any]] = {}
        self.managers: dict[str, Any] = {}
        #: Each path's writes' operationTime, from its client's commands.
        self.times = {p: WriteTimes() for p in PATHS}
        with contextlib.ExitStack() as stack:
            for p in PATHS:
                self.clients[p] = stack.enter_context(pymongo.MongoClient(uri, event_listeners=[self.times[p]]))
                stack.callback(kit.quietly, self.clients[p].drop_database, self.dbs[p])
            self.owner = stack.enter_context(kit.checked_owner(uri, "cqc-wl-matrix"))
            self.managers["local"] = stack.enter_context(CacheManager(self.clients["local"], **LOCAL))
            self.managers["shared"] = stack.enter_context(CacheManager(self.clients["shared"], shared=self.owner.name))
            self._cleanup = stack.pop_all()

    def raw(self, path: str, coll: str) -> Any:
        return self.clients[path][self.dbs[path]][coll]

    def reader(self, path: str, coll: str) -> Any:
        if path == "direct":
            return self.raw(path, coll).with_options(read_concern=ReadConcern("majority"))
        return self.managers[path][self.dbs[path]][coll]

    def counters(self) -> dict[str, Any]:
        """The cached paths' managers' snapshots, and the owner's."""
        return {**{p: self.managers[p].snapshot() for p in CACHED}, "owner": self.owner.snapshot()}

    def close(self) -> None:
        """Close the managers, stop the owner, drop each path's database and close its client."""
        self._cleanup.close()


class _Cell:
    """One cell's operations on the three paths and what they returned: per
    path the timings, the rows the oracle judges (each read's document,
    version, applied time, start and end) and the path's own writes (with
    their operationTime)."""

    def __init__(self, paths: MatrixPaths, coll_name: str, raws: list[bytes]) -> None:
        self.paths = paths
        self.readers = {p: paths.reader(p, coll_name) for p in PATHS}
        # Writes go through the path's collection: for the cached paths the
        # cached view's update_one (a read-your-writes floor must cover it).
        self.writers = {p: (paths.raw(p, coll_name) if p == "direct" else self.readers[p]) for p in PATHS}
        self.expected = kit.Expected(raws, paths.raw("direct", coll_name).codec_options)
        self.current = {p: [1] * len(raws) for p in PATHS}
        self.read_ns: dict[str, list[int]] = {p: [] for p in PATHS}
        self.write_ns: dict[str, list[int]] = {p: [] for p in PATHS}
        self.rows = {p: Rows() for p in PATHS}
        self.writes: dict[str, list[Write]] = {p: [] for p in PATHS}
        self.wrong: list[str] = []

    def read(self, p: str, key: int, j: int) -> None:
        clock = time.perf_counter_ns
        manager = self.paths.managers.get(p)
        applied = applied_time(manager, self.paths.dbs[p]) if manager is not None else 0
        t0 = clock()
        got = self.readers[p].find_one({"_id": key})
        t1 = clock()
        self.read_ns[p].append(t1 - t0)
        checked = self.expected.check(got, key)
        if not isinstance(checked, str) and checked[1] > self.current[p][key]:
            checked = f"version {checked[1]} is newer than the last write ({self.current[p][key]})"
        if isinstance(checked, str):
            self.wrong.append(f"{p} read of {key} at operation {j}: {checked}")
        else:
            self.rows[p].add(key, checked[1], applied, t0, t1, 0)

    def write(self, p: str, key: int, version: int, j: int) -> None:
        clock = time.perf_counter_ns
        t0 = clock()
        result = self.writers[p].update_one({"_id": key}, {"$set": {"version": version}})
        t1 = clock()
        self.write_ns[p].append(t1 - t0)
        if result.matched_count != 1:
            self.wrong.append(f"{p} write of {key} at operation {j} matched {result.matched_count} documents")
            return
        self.current[p][key] = version
        self.writes[p].append(Write(key, version, self.paths.times[p].take(key, version), t0, t1))

    def run(
        self, where: str, plan: list[tuple[bool, int]], orders: list[list[int]], status: Status
    ) -> tuple[float, dict[str, Any]]:
        """Warm the paths, run the plan interleaved over them (operation j in
        the path order ``orders[j]``, see ``kit.orders``), verify; the wall
        time and each path's figures."""
        keys, timeout = len(self.current["direct"]), self.paths.timeout
        status(f"{where}: warming up")
        warm_passes = {
            p: _warm(self.paths.managers[p], self.readers[p], self.paths.dbs[p], keys, timeout, f"{where} {p}")
            for p in CACHED
        }
        for k in range(min(keys, DIRECT_WARM_READS)):
            self.readers["direct"].find_one({"_id": k})
        for p in PATHS:  # opens the write path; matches nothing, so no change event
            self.writers[p].update_one({"_id": -1}, {"$set": {"version": 0}})
        before = self.paths.counters()

        status(f"{where}: {len(plan)} operations x 3 paths")
        gc.collect()
        started = time.perf_counter()
        for j, ((is_read, key), order) in enumerate(zip(plan, orders, strict=True)):
            for p in (PATHS[k] for k in order):
                if is_read:
                    self.read(p, key, j)
                else:
                    self.write(p, key, j + 2, j)
        wall = time.perf_counter() - started
        after = self.paths.counters()
        if self.wrong:
            examples = "\n  ".join(self.wrong[:MAX_EXAMPLES])
            raise BenchmarkFailed(f"{where}: {len(self.wrong)} wrong results, e.g.:\n  {examples}")
        return wall, {p: self.figures(p, before, after, warm_passes) for p in PATHS}

    def figures(self, p: str, before: dict[str, Any], after: dict[str, Any], warm: dict[str, int]) -> dict[str, Any]:
        """One path's figures and judgement: stale (cached paths: the direct
        path has no applied time), monotonic and read-your-writes."""
        reads = len(self.read_ns[p])
        writes = self.writes[p]
        oracle = None if p == "direct" else Oracle([*initial_versions(len(self.current[p])), *writes])
        verdict = judge(self.rows[p], oracle=oracle, own_writes=writes, label=f"{p}: ")
        entry: dict[str, Any] = {
            "reads": reads,
            "writes": len(self.write_ns[p]),
            "read": summarize(self.read_ns[p]),
            "write": summarize(self.write_ns[p]),
            **verdict.counts(),
            "examples": list(verdict.examples),
        }
        if p == "direct":
            return entry
        b, a = before[p], after[p]
        entry.update(kit.counted(b, a), warm_passes=warm[p])
        entry["hit_ratio"] = entry["hits"] / reads if reads else float("nan")
        direct_p50 = summarize(self.read_ns["direct"])["p50_us"]
        entry["read_p50_over_direct"] = entry["read"]["p50_us"] / direct_p50 if reads else float("nan")
        # The local manager invalidates and evicts itself; the shared path's owner does.
        if p == "local":
            entry.update(invalidations=a.invalidations - b.invalidations, evictions=a.evictions - b.evictions)
        else:
            entry.update({k: after["owner"][k] - before["owner"][k] for k in ("invalidations", "evictions")})
        return entry


def run_cell(
    paths: MatrixPaths, mix: str, size: str, *, keys: int, ops: int, seed: int, status: Status
) -> dict[str, Any]:
    """One mix and size: insert, warm, run the interleaved operations, verify."""
    coll_name = f"{mix}_{size}"
    raws = _documents(keys, SIZES[size], f"{seed}/docs/{mix}/{size}")
    rng = random.Random(f"{seed}/ops/{mix}/{size}")
    plan = [(rng.random() < MIXES[mix], k) for k in zipf_keys(keys, ops, rng)]

    status(f"{mix}/{size}: inserting {keys} documents of ~{sum(map(len, raws)) // keys} B into 3 databases")
    for p in PATHS:
        kit.insert_raw(paths.raw(p, coll_name), raws)
    try:
        orders = kit.orders(len(PATHS), len(plan), f"{seed}/order/{mix}/{size}")
        wall, figures = _Cell(paths, coll_name, raws).run(f"{mix}/{size}", plan, orders, status)
    finally:
        # Dropped at once: the next cells do not share a budget with this one.
        for p in PATHS:
            with contextlib.suppress(Exception):
                paths.raw(p, coll_name).drop()
    sizes = [len(r) for r in raws]
    return {
        "mix": mix,
        "read_fraction": MIXES[mix],
        "size": size,
        "target_bytes": SIZES[size],
        "document_bytes_mean": sum(sizes) / len(sizes),
        "document_bytes_max": max(sizes),
        "keys": len(raws),
        "distinct_keys_used": len({k for _, k in plan}),
        "ops": len(plan),
        "wall_s": wall,
        "paths": figures,
    }


def run_matrix(
    uri: str,
    *,
    db_prefix: str,
    mixes: Sequence[str] = tuple(MIXES),
    sizes: Sequence[str] = tuple(SIZES),
    keys: int,
    ops: int,
    seed: int,
    timeout: float = 120.0,
    status: Status | None = None,
) -> list[dict[str, Any]]:
    """Every (mix, size) cell; the owner is stopped and the databases dropped
    before this returns or raises."""
    status = status or Status(quiet=True)
    status("mix matrix: starting the shared owner and the local manager")
    cells = []
    with contextlib.closing(MatrixPaths(uri, db_prefix, timeout)) as paths:
        for mix, size in itertools.product(mixes, sizes):
            cell = run_cell(paths, mix, size, keys=keys, ops=ops, seed=seed, status=status)
            cells.append(cell)
            d, lo, sh = (cell["paths"][p] for p in PATHS)
            status(
                f"{mix}/{size}: read p50 direct {d['read']['p50_us']:.0f} us, local "
                f"{lo['read']['p50_us']:.0f} us ({lo['hit_ratio']:.0%} hits), shared "
                f"{sh['read']['p50_us']:.0f} us ({sh['hit_ratio']:.0%} hits), {cell['wall_s']:.1f}s"
            )
    return cells


# -- Part 2: invalidation latency (worker processes) -----------------------------


def _write_loop(
    coll: Any, workers: kit.Pool, writes: int, keys: int, seed: int, timeout: float, times: WriteTimes, paced: bool
) -> tuple[list[Write], int, list[float]]:
    """One write each time the workers completed ``READS_PER_WRITE`` reads
    since the previous write was sent; return the writes with their
    acknowledgement times, the reads the workers made from the first write's
    wait to the last write's acknowledgement, and the pause after each write.

    Paced, the writer also sets the pause every worker sleeps after each
    read, so that the workers make about ``READS_PER_WRITE`` reads per write
    instead of outrunning the writer: it lengthens the pause when more reads
    than that came between two writes, and shortens it when the writer had
    to wait for them."""
    rng = random.Random(f"{seed}/writes")
    done: list[Write] = []
    pauses: list[float] = []
    clock = time.monotonic_ns
    pause = PACE_START_S if paced else 0.0
    pace = workers.shared.pace
    pace.value = pause
    mark = first = workers.total_reads()
    for n in range(writes):
        deadline = time.monotonic() + timeout
        polls = 0
        waited = clock()
        while workers.total_reads() - mark < READS_PER_WRITE:
            time.sleep(0.0001)
            polls += 1
            if polls % 2000 == 0:
                if workers.dead():
                    raise BenchmarkFailed(f"a worker died during the writes:\n{workers.errors()}")
                if time.monotonic() > deadline:
                    raise BenchmarkFailed(f"workers stopped reading (write {n}):\n{workers.errors()}")
        key, version = rng.randrange(keys), n + 2
        now_reads = workers.total_reads()
        between, mark = now_reads - mark, now_reads
        sent = clock()
        result = coll.update_one({"_id": key}, {"$set": {"version": version}})
        ack = clock()
        if result.matched_count != 1:
            raise BenchmarkFailed(f"write {n} matched {result.matched_count} documents")
        done.append(Write(key, version, times.take(key, version), sent, ack))
        if paced and n:
            if between > READS_PER_WRITE * 1.1:
                pause = min(PACE_MAX_S, max(pause, PACE_MIN_S) * min(2.0, between / READS_PER_WRITE))
            elif sent - waited > (ack - sent) // 4:
                pause = pause * 0.8 if pause > PACE_MIN_S else 0.0
            pace.value = pause
        pauses.append(pause)
    pace.value = 0.0
    return done, workers.total_reads() - first, pauses


@dataclasses.dataclass(slots=True)
class _KeyReads:
    """One worker's reads of one document, in time order, with the running
    maximum of the versions (first read of a version or newer: a bisection)
    and the suffix minimum (last read of an older version: a bisection)."""

    starts: list[int] = dataclasses.field(default_factory=list)
    ends: list[int] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    prefix_max: list[int] = dataclasses.field(default_factory=list)
    suffix_min: list[int] = dataclasses.field(default_factory=list)

    def first_at_least(self, version: int) -> int:
        """Index of the first read that returned ``version`` or newer (len if none)."""
        return bisect.bisect_left(self.prefix_max, version)

    def last_older(self, version: int) -> int:
        """Index of the last read that returned an older version (-1 if none)."""
        return bisect.bisect_left(self.suffix_min, version) - 1


def _key_reads(result: dict[str, Any]) -> dict[int, _KeyReads]:
    per_key: dict[int, _KeyReads] = collections.defaultdict(_KeyReads)
    for k, v, t0, t1 in zip(result["keys"], result["versions"], result["starts"], result["ends"]):
        kr = per_key[k]
        kr.starts.append(t0)
        kr.ends.append(t1)
        kr.versions.append(v)
    for kr in per_key.values():
        kr.prefix_max = list(itertools.accumulate(kr.versions, max))
        kr.suffix_min = list(itertools.accumulate(reversed(kr.versions), min))[::-1]
    return per_key


def invalidation_latencies(writes: Sequence[Write], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per write: the upper bound (the last worker's first read of that
    version or a newer one, from the acknowledgement), the lower bound (the
    latest start of a read, by any worker, that still returned an older
    version) and the reads that returned an older version although they
    started after the upper bound; their quantiles and counts.

    ``results`` are the workers' reads: parallel sequences ``keys``,
    ``versions``, ``starts``, ``ends`` (monotonic ns), in each worker's order."""
    workers = [_key_reads(r) for r in results]
    empty = _KeyReads()
    upper: list[int] = []
    lower: list[int] = []
    bound_read_ns: list[int] = []
    unobserved = before_ack = stale_after = 0
    stale_examples: list[dict[str, int]] = []
    for w in writes:
        reads = [per_key.get(w.key, empty) for per_key in workers]
        firsts = [kr.first_at_least(w.version) for kr in reads]
        if any(i == len(kr.versions) for i, kr in zip(firsts, reads)):
            unobserved += 1
            continue
        ends = [kr.ends[i] for i, kr in zip(firsts, reads)]
        bound = max(ends)
        n = ends.index(bound)  # the last worker to observe the write: its read's duration
        bound_read_ns.append(bound - reads[n].starts[firsts[n]])
        olds = [kr.starts[j] for kr in reads if (j := kr.last_older(w.version)) >= 0]
        up = max(0, bound - w.ack_ns)
        upper.append(up)
        lower.append(max(0, max(olds) - w.ack_ns) if olds else 0)
        before_ack += up == 0
        for index, kr in enumerate(reads):
            for m in range(bisect.bisect_right(kr.starts, bound), kr.last_older(w.version) + 1):
                if kr.versions[m] < w.version:
                    stale_after += 1
                    if len(stale_examples) < MAX_EXAMPLES:
                        stale_examples.append({
                            "worker": index, "key": w.key, "write_version": w.version, "read_version": kr.versions[m],
                            "read_start_after_bound_us": (kr.starts[m] - bound) // 1000,
                        })  # fmt: skip
    window = (writes[0].sent_ns, writes[-1].ack_ns) if writes else (0, 0)
    gaps = [
        b - a
        for per_key in workers
        for kr in per_key.values()
        for a, b in zip(kr.starts, kr.starts[1:])
        if window[0] <= a and b <= window[1]
    ]
    out: dict[str, Any] = {
        "writes": len(writes),
        "observed_writes": len(upper),
        "unobserved_writes": unobserved,
        "observed_before_ack": before_ack,
        "stale_after_bound": stale_after,
        "stale_after_bound_examples": stale_examples,
        # How often a worker read the same document while the writes ran:
        # the resolution of the upper bound, which also includes the read
        # that returned the new version (its duration: bound_read_us).
        "same_document_read_interval_us": summarize(gaps),
        "bound_read_us": summarize(bound_read_ns),
    }
    for name, values in (("", sorted(upper)), ("lower_", sorted(lower))):
        for p in (50, 95, 99):
            out[f"{name}p{p}_us"] = quantile(values, p) / 1000.0
        out[f"{name}max_us"] = values[-1] / 1000.0 if values else float("nan")
    return out


def judge_invalidation(writes: Sequence[Write], results: Sequence[dict[str, Any]], keys: int) -> dict[str, Any]:
    """Every worker's reads judged by the oracle: stale against the applied
    time, monotonic within the worker (the workers do not write, so there is
    no read-your-writes to judge)."""
    verdict = judge_all([{**r, "docs": r["keys"]} for r in results], Oracle([*initial_versions(keys), *writes]))
    return {**verdict.counts(), "examples": list(verdict.examples)}


def run_invalidation(
    uri: str,
    *,
    db: str,
    path: str,
    workers: int,
    writes: int,
    keys: int,
    seed: int,
    paced: bool = True,
    timeout: float = 120.0,
    status: Status | None = None,
) -> dict[str, Any]:
    """Part 2 for one path ("shared" or "local"): start the owner (shared) and
    the workers (``coherence``'s readers, by ``_id`` in rounds), write,
    collect, compute; every process is ended before this returns or raises.
    The collection is dropped afterwards."""
    if path not in INV_PATHS:
        raise ValueError(f"path must be one of {INV_PATHS}")
    status = status or Status(quiet=True)
    label, coll_name = f"invalidation/{path}", f"invalidation_{path}"
    raws = _documents(keys, INV_DOC_BYTES, f"{seed}/inv/{path}")
    times = WriteTimes()
    with contextlib.ExitStack() as stack:
        client: pymongo.MongoClient[Any] = stack.enter_context(pymongo.MongoClient(uri, event_listeners=[times]))
        coll = client[db][coll_name]
        stack.callback(kit.quietly, coll.drop)
        kit.insert_raw(coll, raws)
        spec = {
            "db": db, "coll": coll_name, "api": "sync", "total": keys, "groups": 0, "raws": raws, "timeout": timeout,
            "seed": f"{seed}/inv/{path}", "weights": {coherence.ID: 1}, "rounds": True, "until": "versions",
            "tail_ns": TAIL_NS, "local": LOCAL,
        }  # fmt: skip
        pool = coherence.start_readers(
            stack, uri, spec, path=path, workers=workers, status=status, label=label, keys=keys
        )
        coll.update_one({"_id": -1}, {"$set": {"version": 0}})  # opens the write path; no event
        status(f"{label}: {writes} writes, one per {READS_PER_WRITE} reads")
        started = time.perf_counter()
        done, reads_while_writing, pauses = _write_loop(coll, pool, writes, keys, seed, timeout, times, paced)
        for k in range(keys):
            pool.shared.final[k] = max((w.version for w in done if w.key == k), default=1)
        pool.shared.stop.value = 1
        status(f"{label}: waiting for every worker to observe the final versions")
        results = [{**r, "keys": r["docs"]} for r in pool.collect(timeout=timeout + 30)]
        wall = time.perf_counter() - started

    mismatches = [m for r in results for m in r["examples"]]
    if mismatches:
        raise BenchmarkFailed(f"{label}: wrong documents read, e.g.:\n  " + "\n  ".join(mismatches))
    out = {**invalidation_latencies(done, results), **judge_invalidation(done, results, keys)}
    out.update({name: sum(r[name] for r in results) for name in ("reads", "hits", "misses", "bypasses", "behind")})
    out.update(
        {
            "keys": keys,
            "document_bytes_mean": sum(map(len, raws)) / keys,
            "reads_while_writing": reads_while_writing,
            "reads_per_write": reads_while_writing / len(done) if done else float("nan"),
            "hit_ratio": out["hits"] / out["reads"] if out["reads"] else float("nan"),
            "workers_unobserved_at_exit": sum(bool(r["unfinished"]) for r in results),
            "write_ack": summarize([w.ack_ns - w.sent_ns for w in done]),
            "pause_after_read_us": summarize([int(p * 1e9) for p in pauses]) if pauses else {},
            "write_phase_s": (done[-1].ack_ns - done[0].sent_ns) / 1e9 if done else 0.0,
            "workers": workers,
            "wall_s": wall,
            "paced": paced,
        }
    )
    status(
        f"invalidation/{path}: p50 {out['p50_us']:.0f} us, p99 {out['p99_us']:.0f} us, "
        f"max {out['max_us']:.0f} us over {out['observed_writes']} writes; "
        f"{out['stale_after_bound']} stale after the bound"
    )
    return out


# -- The report ------------------------------------------------------------------

METHOD = {
    "matrix": "one process; per cell, identical documents in one database per path; the same seeded operation "
    "sequence runs on the three paths interleaved operation by operation (their order a random permutation "
    "per operation, seeded); reads find_one({'_id': k}), writes update_one({'_id': k}, {'$set': {'version': v}}); "
    "keys Zipf(0.99)-distributed "
    "over the cell's documents; cached paths warmed until a whole pass hits; each cell's collections are "
    "dropped after it",
    "direct": "Collection.with_options(read_concern=ReadConcern('majority')).find_one",
    "local": "CacheManager(client, budget_bytes=32 MiB, slot_count=16384)",
    "shared": "SharedCache.start(arena_bytes=40 MiB, budget_bytes=32 MiB, slots=16384) and "
    "CacheManager(client, shared=name)",
    "timer": "perf_counter_ns immediately around each find_one / update_one",
    "verification": "every read after its stop timestamp: BSON equal to the inserted document at the version it "
    "carries (digest), version not newer than the path's last acknowledged write (else the run fails); then "
    "benchmarks._oracle judges every read: stale_reads (older than the newest write at or before the applied "
    "time taken right before the read; cached paths), monotonic_violations (older than an earlier read of the "
    "path), read_your_writes_violations (older than the path's own acknowledged write); all must be 0, and "
    "each cached path must hit at least min_hit_ratio[mix] of its reads",
    "hits": "difference of the manager's snapshot across the timed operations",
    "invalidation": "spawned workers read a few documents in a loop (shuffled order each round), recording "
    "every read (key, version, start, end; time.monotonic_ns, one clock for the host); the parent writes one "
    "document with an increasing version each time the workers completed reads_per_write reads since its "
    "previous write, and (paced) adjusts a pause every worker sleeps after each read so that about that many "
    "reads come between two writes; per write: upper bound = the latest, over the workers, end of a worker's "
    "first read returning that version or newer, minus the write's acknowledgement (update_one returned); "
    "lower bound = the latest start of any worker's read still returning an older version, minus the "
    "acknowledgement; both clamped at 0; stale_after_bound = reads returning an older version that started "
    "after the upper bound; stale_reads and monotonic_violations as in the matrix, per worker; all must be "
    "0, and the workers must hit at least min_invalidation_hit_ratio of their reads",
    "quantiles": "nearest rank: index ceil(p/100*n)-1 of the sorted samples",
}
MATRIX_COLUMNS = (
    ("mix", "<15"), ("size", "<7"), ("path", "<7"), ("reads", ">6"), ("writes", ">6"), ("rd p50", ">8.1f"),
    ("rd p95", ">8.1f"), ("rd p99", ">8.1f"), ("wr p50", ">8.1f"), ("hits", ">6.0%"), ("stale", ">5"), ("mono", ">5"),
    ("ryw", ">5"), ("p50/direct", ">10.3f"),
)  # fmt: skip
INVALIDATION_COLUMNS = (
    ("path", "<7"), ("writes", ">6"), ("rd/wr", ">6.1f"), ("p50", ">8.0f"), ("p95", ">8.0f"), ("p99", ">8.0f"),
    ("max", ">8.0f"), ("low p50", ">8.0f"), ("low p99", ">8.0f"), ("gap p50", ">8.0f"), ("ack p50", ">8.0f"),
    ("hits", ">6.0%"), ("stale after", ">11"), ("stale", ">5"), ("mono", ">5"), ("unobserved", ">10"),
)  # fmt: skip


def build_report(
    args: dict[str, Any], cells: list[dict[str, Any]], invalidation: dict[str, Any], elapsed: float
) -> dict[str, Any]:
    from client_query_cache import __version__ as cqc_version

    return {
        "schema": SCHEMA,
        "mode": "quick" if args.get("quick") else "full",
        "method": METHOD,
        "machine": {**kit.machine_facts(), "loadavg_at_end": list(os.getloadavg())},
        "parameters": {
            **args,
            "mixes": {m: MIXES[m] for m in args["mixes"]},
            "sizes": {s: SIZES[s] for s in args["sizes"]},
            "zipf_s": ZIPF_S,
            "reads_per_write": READS_PER_WRITE,
            "invalidation_document_bytes": INV_DOC_BYTES,
            "owner": dict(kit.OWNER_GEOMETRY),
            "local": {k: LOCAL[k] for k in ("budget_bytes", "slot_count")},
            "max_await_time_ms": MAX_AWAIT_TIME_MS,
            "min_hit_ratio": MIN_HIT_RATIO,
            "min_invalidation_hit_ratio": MIN_INV_HIT_RATIO,
            "read_concern_direct": "majority",
            "external_deployment": kit.external(),
            "client_query_cache": cqc_version,
        },
        "cells": cells,
        "invalidation": invalidation,
        "elapsed_seconds": elapsed,
    }


def _judged(where: str, entry: dict[str, Any], min_hit_ratio: float | None) -> list[str]:
    """A path's judgement: every violation, and too few hits to mean anything."""
    problems = [f"{where}: {entry[key]} {key.replace('_', ' ')}" for key in VIOLATIONS if entry[key]]
    problems.extend(f"{where}: {e}" for e in entry["examples"] if problems)
    if min_hit_ratio is not None and not entry["hit_ratio"] >= min_hit_ratio:
        problems.append(
            f"{where}: {entry['hit_ratio']:.0%} of the reads hit, under the {min_hit_ratio:.0%} "
            "the judgement needs to mean anything"
        )
    if entry.get("bypasses"):
        problems.append(f"{where}: {entry['bypasses']} bypasses")
    return problems


def checks(report: dict[str, Any]) -> list[str]:
    """What makes the figures meaningless or shows a coherence failure."""
    problems = []
    for cell in report["cells"]:
        for p in PATHS:
            floor = MIN_HIT_RATIO[cell["mix"]] if p != "direct" else None
            problems += _judged(f"{cell['mix']}/{cell['size']} {p}", cell["paths"][p], floor)
    for path, inv in report["invalidation"].items():
        problems += _judged(f"invalidation/{path}", inv, MIN_INV_HIT_RATIO)
        if inv["stale_after_bound"]:
            problems.append(f"invalidation/{path}: {inv['stale_after_bound']} stale reads after the bound")
        if inv["unobserved_writes"]:
            problems.append(f"invalidation/{path}: {inv['unobserved_writes']} writes never observed by every worker")
    return problems


def print_tables(report: dict[str, Any]) -> None:
    par, cells, inv = report["parameters"], report["cells"], report["invalidation"]
    if cells:
        print(
            f"mix matrix: {par['keys']} documents per cell, {par['ops']} operations per cell and path, "
            f"Zipf({par['zipf_s']}) keys; latencies in us (nearest rank)"
        )
        kit.table(MATRIX_COLUMNS, [_matrix_row(cell, p) for cell in cells for p in PATHS])
        sizes = ", ".join(f"{c['size']} ~{c['document_bytes_mean']:.0f} B" for c in cells[: len(par["sizes"])])
        floors = ", ".join(f"{MIN_HIT_RATIO[m]:.0%} {m}" for m in par["mixes"])
        print(
            f"document sizes: {sizes}. hits: share of the path's reads that hit (at least {floors}). stale: older "
            "than a write the cache had applied before the read; mono: older than an earlier read of the path; "
            "ryw: older than the path's own acknowledged write (all must be 0)."
        )
    if not inv:
        return
    if cells:
        print()
    first = next(iter(inv.values()))
    print(
        f"invalidation latency: {first['workers']} workers reading {first['keys']} documents of "
        f"~{first['document_bytes_mean']:.0f} B, one update per >= {par['reads_per_write']} reads; "
        "from the write's acknowledgement until every worker serves the new version (us)"
    )
    kit.table(INVALIDATION_COLUMNS, [_invalidation_row(path, e) for path, e in inv.items()])
    print(
        "p50..max: upper bound (end of each worker's first read of the new version; the last worker counts); "
        "low: lower bound (start of the last read, by any worker, that still returned an older version); "
        "gap: interval between a worker's reads of the same document (the upper bound's resolution); "
        "ack: update_one round trip; "
        "stale after: older versions read after the upper bound; stale: older than a write the cache had "
        f"applied before the read; mono: older than the same worker had read before (all must be 0; hits at "
        f"least {MIN_INV_HIT_RATIO:.0%})."
    )


def _matrix_row(cell: dict[str, Any], p: str) -> tuple[Any, ...]:
    e = cell["paths"][p]
    hits, ratio = kit.cell(e.get("hit_ratio")), kit.cell(e.get("read_p50_over_direct"))
    read = [e["read"][f"p{q}_us"] for q in (50, 95, 99)]
    violations = [e[key] for key in VIOLATIONS]
    return (cell["mix"], cell["size"], p, e["reads"], e["writes"], *read, e["write"]["p50_us"], hits, *violations,
            ratio)  # fmt: skip


def _invalidation_row(path: str, e: dict[str, Any]) -> tuple[Any, ...]:
    upper = [e[f"{q}_us"] for q in ("p50", "p95", "p99", "max", "lower_p50", "lower_p99")]
    gap, ack = e["same_document_read_interval_us"]["p50_us"], e["write_ack"]["p50_us"]
    counts = [e[key] for key in ("stale_after_bound", "stale_reads", "monotonic_violations", "unobserved_writes")]
    return (path, e["observed_writes"], e["reads_per_write"], *upper, gap, ack, e["hit_ratio"], *counts)


# -- main ------------------------------------------------------------------------


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    started = time.perf_counter()
    db_prefix = f"cqc_bench_{secrets.token_hex(4)}"
    cells: list[dict[str, Any]] = []
    if not args.skip_matrix:
        cells = run_matrix(
            uri, db_prefix=db_prefix, mixes=args.mixes, sizes=args.sizes, keys=args.keys, ops=args.ops,
            seed=args.seed, timeout=args.timeout, status=status,
        )  # fmt: skip
    invalidation: dict[str, Any] = {}
    inv_db = f"{db_prefix}_invalidation"
    try:
        for path in args.inv_paths:
            invalidation[path] = run_invalidation(
                uri, db=inv_db, path=path, workers=args.workers, writes=args.writes, keys=args.inv_keys,
                seed=args.seed, paced=not args.free_running, timeout=args.timeout, status=status,
            )  # fmt: skip
    finally:
        with pymongo.MongoClient(uri) as client:
            client.drop_database(inv_db)
    params = {
        "quick": args.quick, "seed": args.seed, "mixes": list(args.mixes), "sizes": list(args.sizes),
        "keys": args.keys, "ops": args.ops, "workers": args.workers, "writes": args.writes,
        "invalidation_keys": args.inv_keys, "invalidation_paths": list(args.inv_paths),
        "invalidation_paced": not args.free_running, "database_prefix": db_prefix,
    }  # fmt: skip
    return build_report(params, cells, invalidation, time.perf_counter() - started)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("workloads", __doc__, seed=20261203)
    add = parser.add_argument
    add("--quick", action="store_true", help=f"smoke run: {QUICK['keys']} documents, {QUICK['ops']} operations "
        f"per cell, {QUICK['writes']} invalidation writes")  # fmt: skip
    add("--workers", type=int, default=4, help="invalidation worker processes (default 4)")
    add("--keys", type=int, default=None, help=f"documents per matrix cell (default {FULL['keys']})")
    add("--ops", type=int, default=None, help=f"operations per cell and path (default {FULL['ops']})")
    add("--writes", type=int, default=None, help=f"invalidation writes per path (default {FULL['writes']})")
    add("--inv-keys", type=int, default=INV_KEYS, help=f"documents the invalidation workers read (default {INV_KEYS})")
    add("--mixes", type=kit.csv(tuple(MIXES)), default=tuple(MIXES), help="comma-separated subset")
    add("--sizes", type=kit.csv(tuple(SIZES)), default=tuple(SIZES), help="comma-separated subset")
    add("--inv-paths", type=kit.csv(INV_PATHS), default=INV_PATHS, help="invalidation paths (default shared,local)")
    add("--free-running", action="store_true",
        help="invalidation workers read without pausing (the writer cannot keep up: more reads per write)")  # fmt: skip
    add("--skip-matrix", action="store_true", help="run only the invalidation measurement")
    add("--timeout", type=float, default=120.0, help="seconds any one wait may take (default 120)")
    args = parser.parse_args(argv)
    kit.defaults(args, QUICK if args.quick else FULL)
    kit.at_least_one(parser, args, ("workers", "keys", "ops", "writes", "inv_keys"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return kit.checked_main(_parse(argv), run, checks, print_tables, timed=True, elapsed=True)


if __name__ == "__main__":
    sys.exit(main())
