"""Soak: many workers on one shared cache for minutes; memory stays flat and
no read is stale.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.soak`.
"""

from __future__ import annotations

import argparse
import array
import bisect
import contextlib
import itertools
import os
import random
import secrets
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import psutil
import pymongo
from pymongo.errors import PyMongoError

from . import _kit as kit
from ._kit import MAX_EXAMPLES, BenchmarkFailed, MiB, Shared, Status
from .coherence import Oracle, Write, applied_time, check_document, check_reads, document
from .workloads import ZIPF_S

SCHEMA = "cqc.soak/1"

#: Read kinds, in the order of ``--mix``'s default weights.
READ_KINDS = ("id", "key", "find", "aggregate", "count")
DEFAULT_MIX = (35, 20, 15, 15, 15)
#: A row's kind as ``coherence.KIND_NAMES`` indexes it (find and aggregate
#: return a group's documents).
ORACLE_KIND = {0: 0, 1: 1, 2: 2, 3: 2}
COUNT_KIND = 4
#: A row's version when the read found the document absent.
ABSENT = -1
#: Shares of the writes to a present document: the rest are deletes.
UPDATE_SHARE = 0.8

#: Row of a read: kind, document (group for a count), version (count),
#: applied time, end (monotonic ns).
ROW = struct.Struct("<biqqq")
#: Row of a write: operation, document, version, operationTime, sent, ack.
WROW = struct.Struct("<biqqqq")
OP_UPDATE, OP_DELETE, OP_INSERT = 0, 1, 2
OP_NAMES = ("update", "delete", "insert")
#: Rows checked at a time after the run.
CHECK_CHUNK = 200_000

#: Per-worker counters in shared memory, published by the worker.
STATS = ("ops", "reads", "writes", "hits", "misses", "bypasses", "errors", "ring_full", "rows")
#: A worker refreshes its manager's counters this often (operations).
SNAPSHOT_EVERY = 64

#: The measured period's verdict needs at least this long and this many samples.
MIN_VERDICT_MINUTES = 2.0
MIN_VERDICT_SAMPLES = 10
WARMUP_CAP_S = 60.0

DEFAULTS = {
    "workers": 8,
    "documents": 6000,
    "groups": 600,
    "pad_bytes": 1024,
    "budget_mib": 4.0,
    "slots": 4096,
    "write_share": 0.10,
    "max_slope": 0.5,
    "warmup_share": 0.2,
}


# -- Slopes and verdicts ---------------------------------------------------------


def slope_per_minute(times_s: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against ``times_s``, per minute."""
    n = len(times_s)
    if n != len(values):
        raise ValueError("times and values differ in length")
    if n < 2:
        return float("nan")
    mt = sum(times_s) / n
    mv = sum(values) / n
    sxx = sum((t - mt) ** 2 for t in times_s)
    if sxx == 0:
        return float("nan")
    sxy = sum((t - mt) * (v - mv) for t, v in zip(times_s, values))
    return sxy / sxx * 60.0


def trend(times_s: Sequence[float], values: Sequence[float]) -> dict[str, Any]:
    """First, last, lowest and highest value and the fitted slope per minute."""
    nan = float("nan")
    return {
        "samples": len(times_s),
        "minutes": (times_s[-1] - times_s[0]) / 60.0 if times_s else 0.0,
        "start": values[0] if values else nan,
        "end": values[-1] if values else nan,
        "min": min(values) if values else nan,
        "max": max(values) if values else nan,
        "slope_per_min": slope_per_minute(times_s, values),
    }


def flatness(
    times_s: Sequence[float],
    rss_bytes: Sequence[float],
    max_slope_mib_per_min: float,
    min_minutes: float = MIN_VERDICT_MINUTES,
    min_samples: int = MIN_VERDICT_SAMPLES,
) -> dict[str, Any]:
    """RSS at the first and last sample, the fitted slope in MiB/min and the
    verdict: ``flat`` (slope at most the threshold), ``growing`` or
    ``too_short`` (fewer samples or a shorter span than needed to judge)."""
    t = trend(times_s, [v / MiB for v in rss_bytes])
    slope = t["slope_per_min"]
    if t["samples"] < min_samples or t["minutes"] < min_minutes or slope != slope:
        verdict = "too_short"
    else:
        verdict = "flat" if slope <= max_slope_mib_per_min else "growing"
    return {
        "samples": t["samples"],
        "minutes": t["minutes"],
        "start_mib": t["start"],
        "end_mib": t["end"],
        "min_mib": t["min"],
        "max_mib": t["max"],
        "slope_mib_per_min": slope,
        "threshold_mib_per_min": max_slope_mib_per_min,
        "verdict": verdict,
    }


def warmup_seconds(duration_s: float, share: float) -> float:
    """The warm-up: ``share`` of the run, at most a minute."""
    return min(WARMUP_CAP_S, duration_s * share)


# -- Workers ---------------------------------------------------------------------


def zipf_table(n: int, seed: str, s: float = ZIPF_S) -> tuple[list[float], list[int]]:
    """Cumulative weights by rank and the document at each rank (a seeded
    order, the same in every worker)."""
    cum = list(itertools.accumulate(1.0 / (r + 1) ** s for r in range(n)))
    by_rank = list(range(n))
    random.Random(seed).shuffle(by_rank)
    return cum, by_rank


class _Files:
    """A worker's read rows and write rows, appended to files."""

    def __init__(self, directory: str, index: int) -> None:
        self.reads_path = os.path.join(directory, f"w{index}.reads")
        self.writes_path = os.path.join(directory, f"w{index}.writes")
        self.reads = open(self.reads_path, "wb", buffering=1 << 16)  # noqa: SIM115
        self.writes = open(self.writes_path, "wb", buffering=1 << 16)  # noqa: SIM115
        self.rows = 0

    def row(self, kind: int, doc: int, version: int, applied: int, end: int) -> None:
        self.reads.write(ROW.pack(kind, doc, version, applied, end))
        self.rows += 1

    def close(self) -> None:
        self.reads.close()
        self.writes.close()


class _Worker:
    """One spawned worker of the soak: its documents, its Zipf picks, its
    reads and writes (rows to ``_Files``) and its counters."""

    def __init__(self, spec: dict[str, Any], manager: Any, files: _Files) -> None:
        self.spec, self.manager, self.files = spec, manager, files
        self.index, self.workers, self.n = spec["index"], spec["workers"], spec["documents"]
        self.groups, self.pad, self.db = spec["groups"], spec["pad_bytes"], spec["db"]
        self.coll = manager[spec["db"]][spec["coll"]]
        self.cum, self.by_rank = zipf_table(self.n, spec["zipf_seed"])
        self.members = [list(range(g, self.n, self.groups)) for g in range(self.groups)]
        mine = [k for k in range(self.n) if k % self.workers == self.index]
        self.versions, self.present = dict.fromkeys(mine, 0), dict.fromkeys(mine, True)
        self.rng = random.Random(spec["seed"])
        self.mix_cum = list(itertools.accumulate(spec["mix"]))
        self.session: Any = None
        self.examples: list[str] = []
        self.wrong = 0
        self.counts = dict.fromkeys(READ_KINDS, 0)
        self.op_counts = dict.fromkeys(OP_NAMES, 0)

    def applied(self) -> int:
        # Through the manager each time: after a re-attach (an owner
        # heartbeat late by 500 ms is enough) a native cache held here
        # would keep the old arena and ring mapped for the rest of the run.
        return applied_time(self.manager, self.db)

    def bad(self, why: str) -> None:
        self.wrong += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"worker {self.index}: {why}")

    def pick(self) -> int:
        return self.by_rank[min(bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1]), self.n - 1)]

    def write(self) -> None:
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
        ot = session.operation_time
        if ot is None:
            raise BenchmarkFailed("the server returned no operationTime for a write")
        self.versions[k] = v
        self.present[k] = op != OP_DELETE
        self.op_counts[OP_NAMES[op]] += 1
        self.files.writes.write(WROW.pack(op, k, v, (ot.time << 32) | ot.inc, sent, ack))

    def _member(self, doc: Any, full: bool) -> tuple[int, int] | str:
        if full:
            return check_document(doc, self.groups, self.pad)
        if isinstance(doc, dict) and set(doc) == {"_id", "version"}:
            if type(doc["_id"]) is not int or type(doc["version"]) is not int:
                return f"bad _id/version: {doc!r:.120}"
            return doc["_id"], doc["version"]
        return f"aggregate returned {doc!r:.120}"

    def group_rows(self, kind: int, g: int, got: list[Any], a: int, end: int, full: bool) -> None:
        seen: set[int] = set()
        for doc in got:
            checked = self._member(doc, full)
            if isinstance(checked, str):
                self.bad(checked)
                continue
            k, v = checked
            if k % self.groups != g or k in seen:
                self.bad(f"{READ_KINDS[kind]} of group {g} returned document {k} (again or not a member)")
                continue
            seen.add(k)
            self.files.row(kind, k, v, a, end)
        if kind == 3 and [d.get("_id") for d in got if isinstance(d, dict)] != sorted(seen):
            self.bad(f"aggregate of group {g} is not sorted by _id")
        for k in self.members[g]:
            if k not in seen:
                self.files.row(kind, k, ABSENT, a, end)

    def _query(self, kind: int, k: int, g: int) -> Any:
        coll = self.coll
        if kind == 0:
            return coll.find_one({"_id": k})
        if kind == 1:
            return coll.find_one({"key": f"k{k}"})
        if kind == 2:
            return list(coll.find({"group": g}))
        if kind == 3:
            pipeline = [{"$match": {"group": g}}, {"$sort": {"_id": 1}}, {"$project": {"_id": 1, "version": 1}}]
            return list(coll.aggregate(pipeline))
        return coll.count_documents({"group": g})

    def read(self) -> None:
        kind = bisect.bisect_right(self.mix_cum, self.rng.random() * self.mix_cum[-1])
        kind = min(kind, len(READ_KINDS) - 1)
        k = self.pick()
        g = k % self.groups
        self.counts[READ_KINDS[kind]] += 1
        a = self.applied()
        got = self._query(kind, k, g)
        end = time.monotonic_ns()
        if kind < 2:
            if got is None:
                self.files.row(kind, k, ABSENT, a, end)
                return
            checked = check_document(got, self.groups, self.pad)
            if isinstance(checked, str):
                self.bad(checked)
            elif checked[0] != k:
                self.bad(f"{READ_KINDS[kind]} read of document {k} returned document {checked[0]}")
            else:
                self.files.row(kind, k, checked[1], a, end)
        elif kind < COUNT_KIND:
            self.group_rows(kind, g, got, a, end, full=kind == 2)
        elif type(got) is not int:
            self.bad(f"count of group {g} returned {got!r:.80}")
        else:
            self.files.row(kind, g, got, a, end)

    def loop(self, shared: Shared) -> dict[str, Any]:
        """Operations until the parent's stop; the counters in ``shared.stats``."""
        stats, base, index = shared.stats, self.index * len(STATS), self.index
        manager, files, pause = self.manager, self.files, self.spec["pause"]
        before = manager.snapshot()
        shared.barrier.wait(self.spec["timeout"])
        ops = reads = writes = errors = 0
        error_examples: list[str] = []
        while not shared.stop.value:
            is_write = self.rng.random() < self.spec["write_share"]
            if is_write:
                try:
                    self.write()
                except PyMongoError as exc:
                    # A failed write may or may not have been applied: the
                    # oracle would no longer know this worker's versions.
                    stats[base + STATS.index("errors")] = errors + 1
                    raise BenchmarkFailed(f"a write failed: {type(exc).__name__}: {exc}") from exc
            else:
                try:
                    self.read()
                except PyMongoError as exc:
                    errors += 1
                    if len(error_examples) < MAX_EXAMPLES:
                        error_examples.append(f"worker {index}: a read failed: {type(exc).__name__}: {exc}")
            ops += 1
            writes += is_write
            reads += not is_write
            if ops % SNAPSHOT_EVERY == 0:
                snap = manager.snapshot()
                stats[base : base + len(STATS)] = (
                    ops, reads, writes, snap.hits - before.hits, snap.misses - before.misses,
                    snap.bypass_total - before.bypass_total, errors, snap.rejected_admissions.get("ring_full", 0),
                    files.rows,
                )  # fmt: skip
            if pause:
                time.sleep(pause)
        after = manager.snapshot()
        return {
            "index": index, "ops": ops, "reads": reads, "writes": writes, "by_kind": self.counts,
            "by_op": self.op_counts, "hits": after.hits - before.hits, "misses": after.misses - before.misses,
            "bypasses": dict(after.bypasses), "ring_full": after.rejected_admissions.get("ring_full", 0),
            "oversize": after.rejected_admissions.get("oversize", 0), "wrong": self.wrong,
            "examples": self.examples, "errors": errors, "error_examples": error_examples, "rows": files.rows,
            "reads_path": files.reads_path, "writes_path": files.writes_path,
        }  # fmt: skip


def _worker(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    """A spawned worker (``kit.Pool``'s protocol; the counters are ``shared.stats``)."""
    from client_query_cache import CacheManager

    client: pymongo.MongoClient[Any] = pymongo.MongoClient(spec["uri"])
    manager: Any = None
    files = _Files(spec["dir"], spec["index"])
    try:
        manager = CacheManager(client, shared=spec["shared_name"])
        worker = _Worker(spec, manager, files)
        worker.coll.find_one({"_id": 0})
        if not manager.wait_ready(spec["timeout"], database=spec["db"]):
            raise BenchmarkFailed("the change stream did not become ready")
        worker.session = client.start_session(causal_consistency=False)
        result = worker.loop(shared)
        worker.session.end_session()
        return result
    finally:
        files.close()
        if manager is not None:
            manager.close()
        client.close()


# -- The check after the run -----------------------------------------------------


def _iter_rows(path: str, row: struct.Struct) -> Iterable[tuple[int, ...]]:
    with open(path, "rb") as fh:
        while chunk := fh.read(row.size * 65536):
            if len(chunk) % row.size:
                raise BenchmarkFailed(f"{path}: a truncated row")
            yield from row.iter_unpack(chunk)


class Checker:
    """The oracle of ``benchmarks.coherence`` over every write of the run,
    extended to reads that found a document absent and to counts."""

    def __init__(self, writes: Sequence[tuple[int, int, int, int, int, int]], documents: int, groups: int) -> None:
        self.oracle = Oracle([Write(k, v, ot, sent, ack) for _, k, v, ot, sent, ack in writes])
        self.deletions: dict[int, tuple[list[int], list[int]]] = {}
        self.deletion_versions: set[tuple[int, int]] = set()
        for op, k, v, _, sent, _ in sorted(writes, key=lambda w: w[4]):
            if op == OP_DELETE:
                sents, vs = self.deletions.setdefault(k, ([], []))
                sents.append(sent)
                vs.append(v)
                self.deletion_versions.add((k, v))
        # Group sizes over cluster time: the initial size, then +1/-1 at the
        # operationTime of each insert/delete.
        self.group_size0 = [len(range(g, documents, groups)) for g in range(groups)]
        self.group_times: list[list[int]] = [[] for _ in range(groups)]
        self.group_sizes: list[list[int]] = [[] for _ in range(groups)]
        size = list(self.group_size0)
        for op, k, _, ot, _, _ in sorted(writes, key=lambda w: w[3]):
            if op == OP_UPDATE:
                continue
            g = k % groups
            size[g] += 1 if op == OP_INSERT else -1
            self.group_times[g].append(ot)
            self.group_sizes[g].append(size[g])
        by_sent = sorted(writes, key=lambda w: w[4])
        self.sent_order = [w[4] for w in by_sent]
        # The smallest operationTime among the writes sent at or after each position.
        self.min_ot_from = [0] * (len(by_sent) + 1)
        self.min_ot_from[-1] = 1 << 63
        for i in range(len(by_sent) - 1, -1, -1):
            self.min_ot_from[i] = min(by_sent[i][3], self.min_ot_from[i + 1])

    def absent_version(self, doc: int, end_ns: int) -> int | None:
        """The version of the newest deletion of ``doc`` sent before
        ``end_ns``; None if none was."""
        sents, vs = self.deletions.get(doc, ((), ()))
        n = bisect.bisect_right(sents, end_ns)
        return vs[n - 1] if n else None

    def valid_counts(self, group: int, applied: int, end_ns: int) -> set[int]:
        """The group's sizes at the cluster times from ``applied`` up to (not
        including) the first write sent after the read ended."""
        upto = self.min_ot_from[bisect.bisect_right(self.sent_order, end_ns)]
        times, sizes = self.group_times[group], self.group_sizes[group]
        n = bisect.bisect_right(times, applied)
        out = {sizes[n - 1] if n else self.group_size0[group]}
        while n < len(times) and times[n] < upto:
            out.add(sizes[n])
            n += 1
        return out

    def check_worker(self, index: int, path: str) -> dict[str, Any]:
        stale = impossible = wrong = rows = counts = 0
        examples: list[str] = []

        def note(why: str) -> None:
            if len(examples) < MAX_EXAMPLES:
                examples.append(f"worker {index}: {why}")

        rows_iter = iter(_iter_rows(path, ROW))
        while True:
            chunk = list(itertools.islice(rows_iter, CHECK_CHUNK))
            if not chunk:
                break
            rows += len(chunk)
            docs, versions = array.array("i"), array.array("q")
            applied, ends, kinds = array.array("q"), array.array("q"), array.array("b")
            for kind, doc, version, a, end in chunk:
                if kind == COUNT_KIND:
                    counts += 1
                    valid = self.valid_counts(doc, a, end)
                    if version not in valid:
                        stale += 1
                        note(f"count of group {doc} returned {version}; possible: {sorted(valid)}")
                    continue
                if version == ABSENT:
                    found = self.absent_version(doc, end)
                    if found is None:
                        wrong += 1
                        note(f"{READ_KINDS[kind]} read found document {doc} absent, but no deletion had been sent")
                        continue
                    version = found
                elif (doc, version) in self.deletion_versions:
                    wrong += 1
                    note(f"{READ_KINDS[kind]} read returned document {doc} at version {version}, its deletion's")
                    continue
                docs.append(doc)
                versions.append(version)
                applied.append(a)
                ends.append(end)
                kinds.append(ORACLE_KIND[kind])
            result = {
                "index": index, "docs": docs, "versions": versions, "applied": applied, "ends": ends, "kinds": kinds
            }
            checked = check_reads(self.oracle, result)
            stale += checked["stale"]
            impossible += checked["impossible"]
            for e in checked["examples"]:
                note(e)
        return {
            "rows": rows,
            "counts_checked": counts,
            "stale": stale,
            "impossible": impossible,
            "wrong": wrong,
            "examples": examples,
        }


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


# -- Sampling --------------------------------------------------------------------


def _rss(proc: psutil.Process | None) -> int | None:
    if proc is None:
        return None
    try:
        return int(proc.memory_info().rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _owner_view(snap: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "used_bytes",
        "budget_bytes",
        "entries",
        "evictions",
        "invalidations",
        "admissions_accepted",
        "admissions_rejected",
        "admissions_dropped",
        "attached_workers",
        "active_streams",
        "streams",
    )
    return {k: snap.get(k) for k in keys}


class Sampler:
    """Samples taken by a thread of the parent every ``interval`` seconds."""

    def __init__(self, owner: Any, procs: Sequence[Any], stats: Any, workers: int, interval: float) -> None:
        self.owner = owner
        self.interval = interval
        self.workers = workers
        self.stats = stats
        self.procs = {"parent": psutil.Process(), "owner": psutil.Process(owner.pid)}
        for n, p in enumerate(procs):
            self.procs[f"worker{n}"] = psutil.Process(p.pid)
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def sample(self) -> dict[str, Any]:
        at = time.monotonic() - self.t0
        rss = {name: _rss(p) for name, p in self.procs.items()}
        try:
            owner: dict[str, Any] | None = _owner_view(self.owner.snapshot())
        except Exception as exc:  # reported, and a failed check
            owner = None
            self.errors.append(f"owner snapshot at {at:.1f}s: {type(exc).__name__}: {exc}")
        width = len(STATS)
        values = list(self.stats)
        workers = [dict(zip(STATS, values[n * width : (n + 1) * width])) for n in range(self.workers)]
        s = {"t": at, "rss": rss, "owner": owner, "workers": workers}
        self.samples.append(s)
        return s

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.sample()
        self._thread.start()

    def _run(self) -> None:
        k = 1
        while not self._stop.wait(max(0.0, self.t0 + k * self.interval - time.monotonic())):
            self.sample()
            k += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()


# -- The run ---------------------------------------------------------------------


def _insert_documents(coll: Any, documents: int, groups: int, pad: int) -> None:
    batch = 500
    for start in range(0, documents, batch):
        coll.insert_many([document(k, 0, groups, pad) for k in range(start, min(documents, start + batch))])
    coll.create_index("key", unique=True)
    coll.create_index("group")


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    """The soak and its report (without ``checks``); every process is ended
    and the database dropped before this returns or raises."""
    db = f"cqc_soak_{secrets.token_hex(6)}"
    coll_name = "docs"
    duration = args.minutes * 60.0
    interval = args.sample_seconds or min(5.0, max(0.5, duration / 40))
    workdir = tempfile.mkdtemp(prefix="cqc-soak-")
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    owner: Any = None
    pool: kit.Pool | None = None
    sampler: Sampler | None = None
    try:
        status(f"inserting {args.documents} documents")
        _insert_documents(client[db][coll_name], args.documents, args.groups, args.pad_bytes)
        budget = int(args.budget_mib * MiB)
        status(f"starting the owner ({budget / MiB:.1f} MiB budget, {args.slots} slots)")
        owner = kit.start_owner(
            kit.new_name("cqc-soak"), uri, budget_bytes=budget, slots=args.slots,
            max_entry_bytes=min(MiB, budget // 4), max_await_time_ms=1000, idle_exit_seconds=60.0,
        )  # fmt: skip
        pool = kit.Pool(args.workers, stats=args.workers * len(STATS), timeout=args.timeout)
        status(f"starting {args.workers} workers")
        pool.start(
            [
                {
                    "uri": uri,
                    "db": db,
                    "coll": coll_name,
                    "shared_name": owner.name,
                    "index": n,
                    "workers": args.workers,
                    "documents": args.documents,
                    "groups": args.groups,
                    "pad_bytes": args.pad_bytes,
                    "mix": list(args.mix),
                    "write_share": args.write_share,
                    "pause": args.pause_ms / 1000,
                    "zipf_seed": f"{args.seed}/ranks",
                    "seed": f"{args.seed}/{n}",
                    "dir": workdir,
                    "timeout": args.timeout,
                }
                for n in range(args.workers)
            ],
            _worker,
        )
        pool.meet("start (workers attached)")
        sampler = Sampler(owner, pool.procs, pool.shared.stats, args.workers, interval)
        sampler.start()
        status(f"running for {args.minutes:g} min, sampling every {interval:g} s")
        deadline = time.monotonic() + duration
        next_note = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if pool.dead():
                raise BenchmarkFailed(f"a worker died:\n{pool.errors()}")
            if time.monotonic() >= next_note and sampler.samples:
                last = sampler.samples[-1]
                status(f"{sum(w['ops'] for w in last['workers'])} operations")
                next_note += 60
        sampler.stop()  # the last sample while every worker is still attached
        pool.shared.stop.value = 1
        elapsed = time.monotonic() - sampler.t0
        status("collecting the workers' results")
        results = pool.collect(timeout=args.timeout + 30)
        final_streams = _owner_view(owner.snapshot())["streams"]
        status("checking every read against the oracle")
        checked = check_run(results, args.documents, args.groups)
    finally:
        if sampler is not None and sampler._thread.is_alive():
            sampler.stop()
        if pool is not None:
            pool.close()
        if owner is not None:
            kit.stop_owner(owner)
        with contextlib.suppress(Exception):
            client.drop_database(db)
        client.close()
        shutil.rmtree(workdir, ignore_errors=True)
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    params["sample_seconds"] = interval
    return build_report(params, sampler.samples, sampler.errors, results, checked, final_streams, elapsed)


def build_report(
    params: dict[str, Any],
    samples: Sequence[dict[str, Any]],
    sample_errors: Sequence[str],
    results: Sequence[dict[str, Any]],
    checked: dict[str, Any],
    final_streams: Sequence[dict[str, Any]] | None,
    elapsed_s: float,
) -> dict[str, Any]:
    warmup = warmup_seconds(elapsed_s, params["warmup_share"])
    measured = [s for s in samples if s["t"] >= warmup]
    processes = {}
    for name in samples[0]["rss"] if samples else ():
        pts = [(s["t"], s["rss"][name]) for s in measured if s["rss"].get(name) is not None]
        if len(pts) < 2:
            processes[name] = {"samples": len(pts), "verdict": "too_short"}
            continue
        processes[name] = flatness([t for t, _ in pts], [v for _, v in pts], params["max_slope"])
    owners = [s["owner"] for s in samples if s["owner"] is not None]
    first = next((s["owner"] for s in measured if s["owner"] is not None), None)
    last = owners[-1] if owners else None
    arena: dict[str, Any] = {}
    if owners:
        arena = {
            "budget_bytes": owners[0]["budget_bytes"],
            "slots": params["slots"],
            "used_bytes_max": max(o["used_bytes"] for o in owners),
            "used_bytes_end": last["used_bytes"],
            "entries_max": max(o["entries"] for o in owners),
            "entries_end": last["entries"],
            "evictions": last["evictions"],
            "admissions": last["admissions_accepted"],
            "rejections": last["admissions_rejected"],
            "ring_dropped": last["admissions_dropped"],
            "invalidations": last["invalidations"],
            "attached_workers_min": min(o["attached_workers"] for o in owners),
            "measured": None,
        }
        if first is not None:
            arena["measured"] = {
                "evictions": last["evictions"] - first["evictions"],
                "admissions": last["admissions_accepted"] - first["admissions_accepted"],
                "invalidations": last["invalidations"] - first["invalidations"],
                "ring_dropped": last["admissions_dropped"] - first["admissions_dropped"],
                "used_mib": trend(
                    [s["t"] for s in measured if s["owner"]],
                    [s["owner"]["used_bytes"] / MiB for s in measured if s["owner"]],
                ),
                "entries": trend(
                    [s["t"] for s in measured if s["owner"]], [s["owner"]["entries"] for s in measured if s["owner"]]
                ),
            }
    return {
        "schema": SCHEMA,
        "machine": kit.machine_facts(),
        "params": params,
        "elapsed_s": elapsed_s,
        "warmup_s": warmup,
        "samples": len(samples),
        "processes": processes,
        "arena": arena,
        "streams": list(final_streams or []),
        "throughput": throughput(samples),
        "totals": totals(results),
        "oracle": checked,
        "stale_reads": checked["stale_reads"],
        "errors": sum(r["errors"] for r in results),
        "error_examples": [e for r in results for e in r["error_examples"]][:MAX_EXAMPLES],
        "sample_errors": list(sample_errors),
        "series": [
            {
                "t": s["t"],
                "rss": s["rss"],
                "owner": {k: v for k, v in (s["owner"] or {}).items() if k != "streams"},
                "workers": s["workers"],
            }
            for s in samples
        ],
    }


def throughput(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Operations, reads, writes and hits in each minute of the run, from the
    workers' counters at the last sample of each minute (the last row may be
    a partial minute)."""
    out: list[dict[str, Any]] = []
    start = samples[0] if samples else None
    for i in range(1, len(samples)):
        s = samples[i]
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
    by_kind = {k: sum(r["by_kind"][k] for r in results) for k in READ_KINDS}
    by_op = {k: sum(r["by_op"][k] for r in results) for k in OP_NAMES}
    bypasses: dict[str, int] = {}
    for r in results:
        for reason, n in r["bypasses"].items():
            bypasses[reason] = bypasses.get(reason, 0) + n
    return {
        "ops": sum(r["ops"] for r in results),
        "reads": sum(r["reads"] for r in results),
        "writes": sum(r["writes"] for r in results),
        "reads_by_kind": by_kind,
        "writes_by_op": by_op,
        "hits": sum(r["hits"] for r in results),
        "misses": sum(r["misses"] for r in results),
        "bypasses": bypasses,
        "ring_full": sum(r["ring_full"] for r in results),
        "oversize": sum(r["oversize"] for r in results),
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
    out = out or sys.stdout
    p = report["params"]
    print(
        f"soak: {p['workers']} workers, {report['elapsed_s'] / 60:.2f} min, warm-up {report['warmup_s']:.0f} s, "
        f"{report['samples']} samples",
        file=out,
    )
    head = f"{'process':<10} {'start MiB':>10} {'end MiB':>9} {'max MiB':>9} {'slope MiB/min':>14} {'verdict':>10}"
    print(head, file=out)
    for name, r in report["processes"].items():
        if "slope_mib_per_min" not in r:
            print(f"{name:<10} {'-':>10} {'-':>9} {'-':>9} {'-':>14} {r['verdict']:>10}", file=out)
            continue
        print(
            f"{name:<10} {r['start_mib']:>10.1f} {r['end_mib']:>9.1f} {r['max_mib']:>9.1f} "
            f"{r['slope_mib_per_min']:>14.3f} {r['verdict']:>10}",
            file=out,
        )
    print(f"flat: slope <= {p['max_slope']} MiB/min over the measured period", file=out)
    a = report["arena"]
    if a:
        print(
            f"arena: used max {a['used_bytes_max'] / MiB:.2f} / budget {a['budget_bytes'] / MiB:.2f} MiB, "
            f"entries max {a['entries_max']} / {a['slots']} slots, evictions {a['evictions']}, "
            f"admissions {a['admissions']}, rejections {a['rejections']}, ring dropped {a['ring_dropped']}, "
            f"invalidations {a['invalidations']}",
            file=out,
        )
        m = a["measured"]
        if m:
            u, e = m["used_mib"], m["entries"]
            print(
                f"arena over the measured period: used MiB {u['start']:.2f} -> {u['end']:.2f} "
                f"(min {u['min']:.2f}, max {u['max']:.2f}, slope {u['slope_per_min']:.3f}/min), "
                f"entries {e['start']} -> {e['end']} (min {e['min']}, max {e['max']}, "
                f"slope {e['slope_per_min']:.1f}/min), evictions {m['evictions']}, admissions {m['admissions']}",
                file=out,
            )
    for s in report["streams"]:
        print(f"stream {s['database']}: {s['state']}, events {s['events']}, reconnects {s['reconnects']}", file=out)
    print(f"{'minute':>6} {'seconds':>8} {'ops':>8} {'reads':>8} {'writes':>7} {'hits':>8} {'ops/min':>9}", file=out)
    for r in report["throughput"]:
        print(
            f"{r['minute']:>6} {r['seconds']:>8.1f} {r['ops']:>8} {r['reads']:>8} {r['writes']:>7} "
            f"{r['hits']:>8} {r['ops_per_min']:>9.0f}",
            file=out,
        )
    t, o = report["totals"], report["oracle"]
    print(
        f"reads {t['reads']} ({t['reads_by_kind']}), writes {t['writes']} ({t['writes_by_op']}), "
        f"hits {t['hits']}, misses {t['misses']}, bypasses {t['bypasses']}",
        file=out,
    )
    print(
        f"checked {o['rows_checked']} rows ({o['counts_checked']} counts) against {o['writes_logged']} writes: "
        f"stale_reads {o['stale_reads']}, impossible {o['impossible_reads']}, wrong {o['wrong_results']}, "
        f"errors {report['errors']}",
        file=out,
    )


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    d = DEFAULTS
    parser = kit.parser("soak", __doc__)
    parser.add_argument("--minutes", type=float, required=True, help="length of the run (a fraction is allowed)")
    parser.add_argument("--workers", type=int, default=d["workers"], help=f"worker processes (default {d['workers']})")
    parser.add_argument("--documents", type=int, default=d["documents"], help=f"documents (default {d['documents']})")
    parser.add_argument("--groups", type=int, default=d["groups"], help=f"groups (default {d['groups']})")
    parser.add_argument("--pad-bytes", type=int, default=d["pad_bytes"], help="pad of each document")
    parser.add_argument("--budget-mib", type=float, default=d["budget_mib"], help="the arena's payload budget")
    parser.add_argument("--slots", type=int, default=d["slots"], help="the arena's slots")
    parser.add_argument("--write-share", type=float, default=d["write_share"], help="share of writes (default 0.1)")
    parser.add_argument(
        "--mix", type=lambda s: tuple(int(x) for x in s.split(",")), default=DEFAULT_MIX,
        help=f"weights of the read kinds {','.join(READ_KINDS)} (default {','.join(map(str, DEFAULT_MIX))})",
    )
    parser.add_argument("--pause-ms", type=float, default=0.0, help="pause of a worker after each operation")
    parser.add_argument("--sample-seconds", type=float, help="sampling interval (default: min(5, run / 40), >= 0.5)")
    parser.add_argument("--warmup-share", type=float, default=d["warmup_share"], help="warm-up share (at most 60 s)")
    parser.add_argument("--max-slope", type=float, default=d["max_slope"], help="flat: RSS slope at most this MiB/min")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
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
    args = _parse(argv)
    status = Status()
    report = kit.with_server(lambda uri: run(args, uri, status), status)
    if report is None:
        return 1
    return kit.conclude(report, checks(report), print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
