"""Eviction: the real cache's miss ratio on read traces, against libCacheSim's policies.

Each trace is replayed through the product (a ``CacheManager`` wrapping a
PyMongo collection, ``find_one({"_id": k})``, sync) and the same trace through
libCacheSim 0.3.5's FIFO, LRU, SIEVE, S3-FIFO, W-TinyLFU and Belady at the
same byte budget and the same object sizes; the figure judged is our object
miss ratio over the better of S3-FIFO and W-TinyLFU.

Traces (``--documents`` documents, ``--reads`` reads each; seeded):

* ``zipf07``, ``zipf09``, ``zipf11``: Zipf reads (alpha 0.7, 0.9, 1.1) over
  the documents, a random rank order each;
* ``scan``: Zipf 0.99 reads, and after every ``4s`` of them a scan of ``s``
  one-time documents (``s`` = documents / 5; an export, a cold range);
* ``shift``: Zipf 0.99, a new random rank order from the middle on;
* ``writes``: Zipf 0.99 reads, and one write per 100 reads (at random
  positions, of a document drawn from the same distribution). A write sets
  the document's ``version`` through a separate plain PyMongo client; the
  cache learns of it from its change stream. libCacheSim has no
  invalidation: there a write makes the document a new object (a new id of
  the same size), so the next read of it misses and the old version's bytes
  stay cached until they are evicted, as a dead entry stays in the arena
  until the payload ring's tail reaches it. The writes are not requests.

Documents are 900-1300 bytes of BSON (``_id``, ``version``, ``name`` and a
body; the size drawn per document from the seed). Object sizes are the
arena's footprint of each entry, measured, not assumed: a calibration reads
64 documents one at a time through a fresh process-local cache and finds the
one per-entry overhead ``o`` for which every read's growth of
``snapshot().used_bytes`` is ``align8(o + len(bson))`` (arena.c: a 64-byte
block header, the key, the value, rounded up to 8); that formula gives every
document's size. The working set of a trace is the sum of the sizes of the
distinct documents it reads; the budgets are 1% and 10% of it (the arena's
minimum, 64 KiB, where that is more: then ``clamped``), rounded up to 64
bytes as the arena rounds. The cache gets ``budget_bytes`` = that budget
(shared: and ``max_entry_bytes`` = the managers' default for it, which the
owner requires) and every other option at its default: the product's
defaults are what is judged. The report gives the slot count that follows
(``CacheManager``'s ``slot_count``, ``SharedCache.start``'s ``slots``) and
the entry cap (3/4 of it), which can bind before the bytes do.

Modes:

* ``local``: one process-local ``CacheManager`` in this process, reads in
  trace order, each write made (and acknowledged) at its position;
* ``shared``: a fresh owner (``SharedCache.start``) per trace and budget and
  ``--workers`` spawned worker processes (the same ones for every run, a
  new ``CacheManager(client, shared=name)`` each run), the trace's reads
  dealt round-robin (read ``i`` to worker ``i % workers``); each worker reads
  its share in order, as fast as it can, so the interleaving between workers
  is close to, not exactly, the trace's. The parent makes the writes, each
  once the workers have completed as many reads as precede it in the trace.

Before the trace a cache registers its collection with one read of a
document that does not exist (the stream is then not ready and the read
bypasses: nothing is cached) and waits for its change stream
(``wait_ready``); the cache starts empty, as libCacheSim's does.

Every read is checked: the result must be the document read, at a version
that was written (never newer than the last write sent, never older than
the version this process read before nor than the version at the run's
start), byte for byte (re-encoded BSON). A wrong document is a failed check.
Reads of a version older than the latest one written are allowed (the cache
follows the stream) and counted (``older_than_latest``).

Our miss ratio is from the cache's own counters (``snapshot()`` before and
after each read): reads not served from the cache / reads, where a read not
served is a miss, a refusal by the causal floor (``behind``) or a bypass (by
reason). Every read not served is also given a cause, by the trace's order:
``compulsory`` (the document's first read), ``after_write`` (the document was
written since its previous read), else ``behind`` (refused by the causal
floor), ``bypass``, or ``other`` (a miss: the entry was evicted, its
admission refused, or another worker's read of it raced this one). The byte
miss ratio weighs each read by its object's size, as libCacheSim's does.

libCacheSim replays an oracleGeneral binary trace written to a temporary
file: libcachesim 0.3.5's in-memory sources generate their own requests (one
object size, its own Zipf), and feeding ``Request`` objects one by one from
Python would be the slow path; the file carries each request's size and
Belady's next-access time, and the C loop replays it. libCacheSim's W-TinyLFU
sizes its window in bytes: a window smaller than an object admits nothing (a
miss ratio of 1.0 at 1% of a 10,000-document working set), so the window is
the larger of 1% (its default) and two of the largest objects; the report
gives it. Extra budgets (``PLOT_FRACTIONS``) are simulated for the figure
only.

Report: for each trace and budget, every policy's object and byte miss
ratios, ours per mode with the counters' breakdown and the arena's
admissions, refusals and evictions, and ``ratios.<trace>_<budget>_<mode>_
miss_over_best``. Target of a full run: every ratio <= 1.03 (a quick run's
traces are too short to judge: reported, not judged). Figure (``--png``,
default next to ``--json``): miss ratio against budget per trace, one line
per policy, our measured points marked.

Reads not served for other reasons than eviction are in every ratio; where
bypasses or the causal floor's refusals pass 1% of a run's reads, a note
says so (a loaded machine makes streams and owners stop serving for a while).

Run: ``python -m benchmarks.eviction [--quick] [--json out.json]``
(``--traces``, ``--budgets``, ``--modes``: a subset). The full run (6 traces,
2 budgets, 2 modes, 50,000 reads each) takes 15-25 minutes on a 2-core
machine, the quick one (4 traces, 10%, 5,000 reads) about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bson
import numpy as np
import pymongo

from . import _kit as kit
from ._kit import MAX_EXAMPLES, BenchmarkFailed, Shared, Status

SCHEMA = "cqc.eviction/1"
COLLECTION = "docs"
MODES = ("local", "shared")
TRACES = ("zipf07", "zipf09", "zipf11", "scan", "shift", "writes")
#: Zipf exponent of each trace.
ALPHA = {"zipf07": 0.7, "zipf09": 0.9, "zipf11": 1.1, "scan": 0.99, "shift": 0.99, "writes": 0.99}
#: Budgets judged, as fractions of each trace's working set.
BUDGETS = {"1pct": 0.01, "10pct": 0.10}
#: Budgets libCacheSim alone simulates, for the figure.
PLOT_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.10, 0.25)
POLICIES = ("FIFO", "LRU", "SIEVE", "S3-FIFO", "W-TinyLFU", "Belady")
#: Our miss ratio is judged against the better of these.
BEST_OF = ("S3-FIFO", "W-TinyLFU")
#: The options a quick run makes smaller (one alpha, one budget).
FULL = {"documents": 10_000, "reads": 50_000, "traces": TRACES, "budgets": tuple(BUDGETS)}
QUICK = {"documents": 2_000, "reads": 5_000, "traces": ("zipf09", "scan", "shift", "writes"), "budgets": ("10pct",)}
#: One write per this many reads in the ``writes`` trace.
READS_PER_WRITE = 100
#: Document sizes (BSON bytes), drawn per document.
DOC_MIN, DOC_MAX = 900, 1300
#: The arena's smallest budget (docs/api.md, ``budget_bytes``), and its rounding.
MIN_BUDGET = 64 * 1024
BUDGET_ALIGN = 64
#: The registration read's ``_id``: no such document.
SENTINEL = -1
#: Documents the calibration reads one at a time.
CALIBRATION_READS = 64
#: Outcomes of a read, as the counters tell them (one byte per read).
HIT, MISS, BEHIND, BYPASS, UNCOUNTED = b"h"[0], b"m"[0], b"b"[0], b"y"[0], b"?"[0]
#: W-TinyLFU's window: at least this share of the cache (libCacheSim's
#: default) and room for this many of the largest objects.
WINDOW_SHARE, WINDOW_OBJECTS = 0.01, 2
PROGRESS_EVERY_S = 15.0
#: A run whose reads not served for other reasons than eviction pass this share is noted.
NOTE_SHARE = 0.01
#: The eviction policy's counters, reported where the snapshots have them.
POLICY_COUNTERS = (
    "live_bytes", "dead_bytes", "promotions", "reinsertions", "forced_evictions", "ghost_hits", "reclaimed",
)  # fmt: skip

#: What a full run is held to (docs/benchmarks.md, "Targets").
TARGETS = (kit.Target("ratios.*", "<=", 1.03),)

LIBCACHESIM_HINT = "libcachesim is needed: pip install 'libcachesim==0.3.5' (the bench extra)"
MATPLOTLIB_HINT = "matplotlib is needed to write the PNG: pip install 'matplotlib==3.11.2', or pass --no-png"


# -- documents ---------------------------------------------------------------------


def doc_size(key: int, seed: int) -> int:
    """The BSON size of document ``key``, from DOC_MIN to DOC_MAX (a hash of the seed and the key)."""
    h = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return DOC_MIN + int.from_bytes(h, "little") % (DOC_MAX - DOC_MIN + 1)


def document(key: int, version: int, seed: int) -> dict[str, Any]:
    """Document ``key`` at ``version``: the same bytes in every process, any version the same size."""
    doc: dict[str, Any] = {"_id": key, "version": version, "name": f"doc-{key:07d}", "body": ""}
    pad = doc_size(key, seed) - len(bson.encode(doc))
    doc["body"] = (f"{key:07d}:" * (pad // 8 + 1))[:pad]
    return doc


def check_read(got: Any, key: int, low: int, high: int, seed: int) -> int | str:
    """The version of a read of ``key`` that returned ``got``, or why it is wrong: it must be
    document ``key`` at a version from ``low`` to ``high``, byte for byte."""
    if got is None:
        return "no document"
    version = got.get("version")
    if got.get("_id") != key or type(version) is not int:
        return f"_id {got.get('_id')!r} version {version!r}"
    if not low <= version <= high:
        return f"version {version} outside [{low}, {high}]"
    if bson.encode(got) != bson.encode(document(key, version, seed)):
        return f"content differs from document {key} at version {version}"
    return version


def _insert(coll: Any, count: int, seed: int, status: Status) -> None:
    for start in range(0, count, 1000):
        status(f"setup: inserting documents {start:,}/{count:,}")
        coll.insert_many([document(k, 0, seed) for k in range(start, min(count, start + 1000))], ordered=False)


# -- traces ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """A trace: the documents read in order, and the writes, each as (the
    number of reads before it, the document written)."""

    name: str
    keys: np.ndarray
    writes: tuple[tuple[int, int], ...] = ()


def _zipf(rng: np.random.Generator, n: int, count: int, alpha: float, perm: np.ndarray) -> np.ndarray:
    """``count`` documents of ``perm`` (rank order) drawn Zipf(``alpha``) by rank."""
    weights = 1.0 / np.arange(1, n + 1) ** alpha
    cum = np.cumsum(weights)
    cum /= cum[-1]
    return perm[np.searchsorted(cum, rng.random(count), side="right").clip(0, n - 1)]


def make_trace(name: str, documents: int, reads: int, seed: int) -> Trace:
    """Trace ``name`` over documents 0..documents-1 (the scan's one-time documents follow them)."""
    rng = np.random.default_rng([seed, TRACES.index(name)])
    alpha, perm = ALPHA[name], rng.permutation(documents)
    if name == "scan":
        scan = max(1, documents // 5)
        parts, cold, left = [], documents, reads
        while left > 0:
            hot = min(left, 4 * scan)
            parts.append(_zipf(rng, documents, hot, alpha, perm))
            n = min(left - hot, scan)
            parts.append(np.arange(cold, cold + n))
            cold, left = cold + n, left - hot - n
        return Trace(name, np.concatenate(parts).astype(np.int64))
    if name == "shift":
        first = _zipf(rng, documents, reads // 2, alpha, perm)
        second = _zipf(rng, documents, reads - reads // 2, alpha, rng.permutation(documents))
        return Trace(name, np.concatenate([first, second]).astype(np.int64))
    keys = _zipf(rng, documents, reads, alpha, perm).astype(np.int64)
    if name != "writes":
        return Trace(name, keys)
    count = reads // READS_PER_WRITE
    at = np.sort(rng.choice(reads, size=count, replace=False))
    written = _zipf(rng, documents, count, alpha, perm)
    return Trace(name, keys, tuple(zip(at.tolist(), written.tolist())))


# -- the arena's footprint ------------------------------------------------------------


def align8(n: int) -> int:
    return (n + 7) // 8 * 8


def _register(manager: Any, coll: Any, db: str, timeout: float, label: str) -> None:
    """Start the database's stream with a read of no document, and wait until it serves."""
    coll.find_one({"_id": SENTINEL})
    if not manager.wait_ready(timeout, database=db):
        raise BenchmarkFailed(f"{label}: the change stream did not become ready within {timeout:g} s")


def calibrate(uri: str, db: str, documents: int, seed: int, timeout: float) -> dict[str, Any]:
    """The per-entry overhead ``o`` of the arena (footprint = align8(o + BSON size)), from the
    growth of ``used_bytes`` as a fresh process-local cache admits documents one at a time."""
    from client_query_cache import CacheManager

    step = max(1, documents // CALIBRATION_READS)
    keys = list(range(0, documents, step))[:CALIBRATION_READS]
    samples = []
    with pymongo.MongoClient(uri) as client, CacheManager(client) as manager:
        coll = manager[db][COLLECTION]
        _register(manager, coll, db, timeout, "calibration")
        for key in keys:
            before = manager.snapshot()
            coll.find_one({"_id": key})
            after = kit.wait_until(lambda: (s := manager.snapshot()).entries > before.entries and s, 5.0)
            if not after or after.entries != before.entries + 1:
                raise BenchmarkFailed(f"calibration: reading document {key} did not admit one entry")
            samples.append((doc_size(key, seed), after.used_bytes - before.used_bytes))
        final = manager.snapshot()
    fits = [o for o in range(4096) if all(align8(o + size) == grew for size, grew in samples)]
    if len(fits) != 1:
        raise BenchmarkFailed(f"calibration: no single per-entry overhead explains {samples[:8]}... ({fits[:8]})")
    return {
        "overhead_bytes": fits[0],
        "reads": len(samples),
        "residues_mod_8": len({size % 8 for size, _ in samples}),
        "used_bytes": final.used_bytes,
        "entries": final.entries,
        "used_per_entry": final.used_bytes / final.entries if final.entries else None,
        "formula": f"align8({fits[0]} + bson_len)",
    }


def footprints(count: int, overhead: int, seed: int) -> np.ndarray:
    """Every document's entry footprint in the arena (bytes)."""
    return np.array([align8(overhead + doc_size(k, seed)) for k in range(count)], dtype=np.int64)


def budget_bytes(fraction: float, working_set: int) -> tuple[int, bool]:
    """The budget for ``fraction`` of ``working_set``: rounded up as the arena rounds, at least the
    arena's minimum; and whether that minimum raised it."""
    want = math.ceil(fraction * working_set / BUDGET_ALIGN) * BUDGET_ALIGN
    return max(want, MIN_BUDGET), want < MIN_BUDGET


# -- libCacheSim ------------------------------------------------------------------------


def object_ids(trace: Trace, first_new: int) -> np.ndarray:
    """Each read's object id for libCacheSim: the document, or after a write of it a new object
    (ids from ``first_new`` on) of the same size."""
    ids = trace.keys.copy()
    if not trace.writes:
        return ids
    current: dict[int, int] = {}
    writes, w, fresh = trace.writes, 0, first_new
    for i, key in enumerate(trace.keys.tolist()):
        while w < len(writes) and writes[w][0] <= i:
            current[writes[w][1]] = fresh
            fresh, w = fresh + 1, w + 1
        ids[i] = current.get(key, key)
    return ids


def _next_access(ids: np.ndarray) -> np.ndarray:
    order = np.argsort(ids, kind="stable")
    nxt = np.full(len(ids), -1, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def write_oracle_general(path: str, ids: np.ndarray, sizes: np.ndarray) -> None:
    """libCacheSim's oracleGeneral records: u32 time, u64 id (+1: no id 0), u32 size, i64 next access."""
    rec = np.zeros(len(ids), dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nx", "<i8")]))
    rec["t"] = np.arange(len(ids)) // 1000 + 1
    rec["id"] = ids + 1
    rec["sz"] = sizes
    rec["nx"] = _next_access(ids)
    rec.tofile(path)


def _window(cache_bytes: int, largest: int) -> float:
    return max(WINDOW_SHARE, math.ceil(100 * WINDOW_OBJECTS * largest / cache_bytes) / 100)


def simulate(ids: np.ndarray, sizes: np.ndarray, budgets: Sequence[int]) -> dict[int, dict[str, Any]]:
    """Every policy's (object, byte) miss ratio at each budget, and W-TinyLFU's window there."""
    import libcachesim as lcs

    classes = {"FIFO": lcs.FIFO, "LRU": lcs.LRU, "SIEVE": lcs.Sieve, "S3-FIFO": lcs.S3FIFO,
               "W-TinyLFU": lcs.WTinyLFU, "Belady": lcs.Belady}  # fmt: skip
    hashpower = max(16, int(len(np.unique(ids))).bit_length() + 1)
    largest = int(sizes.max())
    out: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="cqc-eviction-") as tmp:
        path = os.path.join(tmp, "trace.oracleGeneral.bin")
        write_oracle_general(path, ids, sizes)
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        for budget in budgets:
            row: dict[str, Any] = {"wtinylfu_window": _window(budget, largest)}
            for name in POLICIES:
                extra = {"window_size": row["wtinylfu_window"]} if name == "W-TinyLFU" else {}
                cache = classes[name](budget, hashpower=hashpower, **extra)
                obj, byte = cache.process_trace(reader)
                row[name] = {"obj_miss": obj, "byte_miss": byte, "cache_name": cache.cache_name}
            out[budget] = row
        # Not reader.close(): libcachesim 0.3.5 frees the reader again when the object goes (double free).
        del reader
    return out


# -- one replay ---------------------------------------------------------------------


def outcome(before: Any, after: Any) -> int:
    """What the counters say one read was."""
    if after.hits > before.hits:
        return HIT
    if after.behind > before.behind:
        return BEHIND
    if after.misses > before.misses:
        return MISS
    if after.bypass_total > before.bypass_total:
        return BYPASS
    return UNCOUNTED


def counted(before: Any, after: Any) -> dict[str, Any]:
    """A replay's counters: hits, misses, ``behind`` and bypasses by reason."""
    reasons = {k: v - before.bypasses.get(k, 0) for k, v in after.bypasses.items()}
    return {
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "behind": after.behind - before.behind,
        "bypasses": {k: n for k, n in reasons.items() if n},
    }


class Replay:
    """Reads through one manager, each checked, and classified by the
    counters (the snapshot after each read against the one before it).
    ``low`` holds, per document, the oldest version a read may return
    (raised by each read), ``latest`` the newest version written."""

    __slots__ = ("manager", "coll", "seed", "low", "latest", "last", "checked", "mismatches", "older", "examples")

    def __init__(self, manager: Any, coll: Any, seed: int, low: list[int], latest: Any) -> None:
        self.manager, self.coll, self.seed = manager, coll, seed
        self.low, self.latest = low, latest
        self.last = manager.snapshot()
        self.checked = self.mismatches = self.older = 0
        self.examples: list[str] = []

    def begin(self) -> Any:
        """The counters before the first read."""
        self.last = self.manager.snapshot()
        return self.last

    def read(self, key: int) -> int:
        before, newest = self.last, self.latest[key]
        got = self.coll.find_one({"_id": key})
        self.last = self.manager.snapshot()
        verdict = check_read(got, key, self.low[key], self.latest[key], self.seed)
        self.checked += 1
        if isinstance(verdict, str):
            self.mismatches += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"read of {key}: {verdict}")
        else:
            self.low[key] = verdict
            self.older += verdict < newest
        return outcome(before, self.last)

    def result(self, reads: int, before: Any, seconds: float) -> dict[str, Any]:
        return {
            "reads": reads, "checked": self.checked, "mismatches": self.mismatches,
            "mismatch_examples": self.examples, "older_than_latest": self.older,
            "seconds": seconds, **counted(before, self.last),
        }  # fmt: skip


def _write(coll: Any, key: int, version: int) -> None:
    coll.update_one({"_id": key}, {"$set": {"version": version}})


# -- local mode ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """What every replay of a run shares."""

    args: argparse.Namespace
    uri: str
    db: str
    status: Status
    #: The current version of every document (the writes move it).
    versions: list[int]
    sizes: np.ndarray


def run_local(ctx: Context, trace: Trace, label: str, budget: int) -> dict[str, Any]:
    """The trace through one process-local ``CacheManager`` of ``budget`` bytes, in trace order."""
    from client_query_cache import CacheManager

    args, where = ctx.args, f"local {trace.name} {label}"
    keys, outcomes = trace.keys.tolist(), bytearray(len(trace.keys))
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(pymongo.MongoClient(ctx.uri))
        writer = stack.enter_context(pymongo.MongoClient(ctx.uri))[ctx.db][COLLECTION]
        manager = stack.enter_context(CacheManager(client, budget_bytes=budget))
        coll = manager[ctx.db][COLLECTION]
        _register(manager, coll, ctx.db, args.timeout, where)
        replay = Replay(manager, coll, args.seed, list(ctx.versions), ctx.versions)
        writes, w = trace.writes, 0
        before, started, shown = replay.begin(), time.perf_counter(), time.monotonic()
        for i, key in enumerate(keys):
            while w < len(writes) and writes[w][0] <= i:
                k = writes[w][1]
                ctx.versions[k] += 1
                _write(writer, k, ctx.versions[k])
                w += 1
            outcomes[i] = replay.read(key)
            if time.monotonic() - shown > PROGRESS_EVERY_S:
                ctx.status(f"{where}: {i + 1:,}/{len(keys):,} reads")
                shown = time.monotonic()
        out = replay.result(len(keys), before, time.perf_counter() - started)
    out.update(writes=w, outcomes=bytes(outcomes), arena=_arena_local(replay.last, default_slots(budget, "local")))
    return out


def default_slots(budget: int, mode: str) -> int:
    """The entry table's capacity the product gives ``budget`` by default in ``mode``: the
    ``slots`` default of ``SharedCache.start`` if it has a number, else ``CacheConfig``'s rule
    (rounded up to a power of two)."""
    from client_query_cache import CacheConfig, SharedCache

    if mode == "shared":
        default = inspect.signature(SharedCache.start).parameters["slots"].default
        if isinstance(default, int):
            return default
    config = CacheConfig(budget_bytes=budget, max_entry_bytes=CacheConfig.default_max_entry_bytes(budget))
    return 1 << (config.effective_slot_count - 1).bit_length()


def _arena_local(snap: Any, slots: int) -> dict[str, Any]:
    return {
        "admissions": snap.admissions, "rejected": {k: n for k, n in snap.rejected_admissions.items() if n},
        "dropped": 0,
        "evictions": snap.evictions, "invalidations": snap.invalidations, "entries": snap.entries,
        "used_bytes": snap.used_bytes, "budget_bytes": snap.budget_bytes, "slot_count": slots,
        "entry_cap": slots * 3 // 4,
        "policy": {name: getattr(snap, name) for name in POLICY_COUNTERS if hasattr(snap, name)},
    }  # fmt: skip


# -- shared mode: the workers ----------------------------------------------------------------
#
# The same spawned workers serve every shared run. Per run they meet the
# parent at the barrier (parties = workers + 1):
#
#   up | registered | go | (reads) done | closed
#
# up: the parent started the run's owner; registered: every worker attached a
# manager to it and its stream is ready; go: the reads begin (the parent
# zeroed the read counters and, in the writes trace, started its writer);
# done: every worker finished its share (the parent reads the owner's
# counters); then each worker reports and closes its manager; closed: the
# parent stops the owner.


def _worker(spec: dict[str, Any], shared: Shared) -> dict[str, Any]:
    from client_query_cache import CacheManager

    index, timeout = spec["index"], spec["timeout"]

    def meet() -> None:
        shared.barrier.wait(timeout)

    for n, run in enumerate(spec["runs"]):
        meet()  # up
        with pymongo.MongoClient(spec["uri"]) as client, CacheManager(client, shared=run["owner"]) as manager:
            coll = manager[spec["db"]][COLLECTION]
            _register(manager, coll, spec["db"], timeout, f"worker {index}")
            # The versions at the run's start: the writer starts after "registered".
            replay = Replay(manager, coll, spec["seed"], list(shared.stats), shared.stats)
            meet()  # registered
            meet()  # go
            outcomes = bytearray(len(run["keys"]))
            before, started = replay.begin(), time.perf_counter()
            for i, key in enumerate(run["keys"]):
                outcomes[i] = replay.read(key)
                shared.counters[index] += 1
            result = replay.result(len(run["keys"]), before, time.perf_counter() - started)
            meet()  # done
            shared.put(f"run{n}", index, {**result, "outcomes": bytes(outcomes)})
        meet()  # closed
    return {}


@dataclasses.dataclass(frozen=True, slots=True)
class SharedRun:
    """One shared run: the trace, the budget, the owner's name."""

    trace: Trace
    label: str
    budget: int
    owner: str


def run_shared(ctx: Context, runs: Sequence[SharedRun], done: Callable[[SharedRun, dict[str, Any]], None]) -> None:
    """Every shared run, in order, by the same ``--workers`` workers; ``done`` gets each one's result."""
    args, workers = ctx.args, ctx.args.workers
    specs = [
        {"index": w, "uri": ctx.uri, "db": ctx.db, "seed": args.seed, "timeout": args.timeout,
         "runs": [{"owner": r.owner, "keys": r.trace.keys[w::workers].tolist()} for r in runs]}
        for w in range(workers)
    ]  # fmt: skip
    with kit.Pool(workers, stats=len(ctx.versions), timeout=args.timeout) as pool:
        pool.shared.stats[:] = ctx.versions
        ctx.status(f"shared: starting {workers} workers")
        pool.start(specs, _worker)
        for n, run in enumerate(runs):
            ctx.status(f"shared {run.trace.name} {run.label}: {len(run.trace.keys):,} reads, budget {run.budget:,} B")
            done(run, _shared_run(ctx, pool, n, run))
        pool.collect()


def _shared_run(ctx: Context, pool: Any, n: int, run: SharedRun) -> dict[str, Any]:
    from client_query_cache import CacheConfig

    args, where, reads = ctx.args, f"shared {run.trace.name} {run.label}", len(run.trace.keys)
    max_entry = CacheConfig.default_max_entry_bytes(run.budget)
    options = {"budget_bytes": run.budget, "max_entry_bytes": max_entry, "idle_exit_seconds": 60.0}
    with kit.owned(run.owner, ctx.uri, **options) as owner:
        pool.meet(f"{where}: owner up")
        pool.meet(f"{where}: workers registered")
        for w in range(pool.count):
            pool.shared.counters[w] = 0
        writer = _Writer(ctx, pool, run.trace.writes)
        if run.trace.writes:
            writer.start()
        try:
            started = time.perf_counter()
            pool.meet(f"{where}: go")
            _await_reads(ctx, pool, reads, where)
        finally:
            writer.stop.set()
            if writer.is_alive():
                writer.join(args.timeout)
        if writer.error is not None:
            pool.abort()
            raise BenchmarkFailed(f"{where}: a write failed: {writer.error!r}")
        pool.meet(f"{where}: reads done")
        arena = owner.snapshot()
        results = pool.collect(f"run{n}")
        pool.meet(f"{where}: managers closed")
    slots = default_slots(run.budget, "shared")
    out = _merge(results, pool.count, reads)
    out.update(
        seconds=time.perf_counter() - started,
        writes=writer.done,
        arena={
            "admissions": arena["admissions_accepted"],
            "rejected": {k: n for k, n in arena["admissions_rejected"].items() if n},
            "dropped": arena["admissions_dropped"], "evictions": arena["evictions"],
            "invalidations": arena["invalidations"], "entries": arena["entries"],
            "used_bytes": arena["used_bytes"], "budget_bytes": arena["budget_bytes"], "slot_count": slots,
            "entry_cap": slots * 3 // 4,
            "policy": {name: arena[name] for name in POLICY_COUNTERS if name in arena},
        },
    )  # fmt: skip
    return out


class _Writer(threading.Thread):
    """The shared runs' writer: each write once the workers have completed the reads before it
    in the trace; ``stats`` gets the version before it is sent (a read may return it from then on).
    Its error, if one ends it, is kept for the parent."""

    def __init__(self, ctx: Context, pool: Any, writes: Sequence[tuple[int, int]]) -> None:
        super().__init__(name="writer", daemon=True)
        self.ctx, self.pool, self.writes = ctx, pool, writes
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with pymongo.MongoClient(self.ctx.uri) as client:
                coll = client[self.ctx.db][COLLECTION]
                for pos, key in self.writes:
                    while self.pool.total_reads() < pos:
                        if self.stop.is_set():
                            return
                        time.sleep(0.001)
                    self.ctx.versions[key] += 1
                    self.pool.shared.stats[key] = self.ctx.versions[key]
                    _write(coll, key, self.ctx.versions[key])
                    self.done += 1
        except BaseException as exc:  # reported by the parent
            self.error = exc


def _await_reads(ctx: Context, pool: Any, reads: int, where: str) -> None:
    deadline, shown = time.monotonic() + ctx.args.timeout, time.monotonic()
    while (done := pool.total_reads()) < reads:
        if pool.dead():
            raise BenchmarkFailed(f"{where}: a worker died:\n{pool.errors()}")
        if time.monotonic() > deadline:
            raise BenchmarkFailed(f"{where}: {done:,}/{reads:,} reads after {ctx.args.timeout:g} s")
        if time.monotonic() - shown > PROGRESS_EVERY_S:
            ctx.status(f"{where}: {done:,}/{reads:,} reads")
            shown = time.monotonic()
        time.sleep(0.05)


def _merge(results: Sequence[dict[str, Any]], workers: int, reads: int) -> dict[str, Any]:
    """The workers' results as one replay's: counters summed, outcomes back in trace order."""
    out: dict[str, Any] = {"reads": 0, "checked": 0, "mismatches": 0, "mismatch_examples": [],
                           "older_than_latest": 0, "hits": 0, "misses": 0, "behind": 0, "bypasses": {}}  # fmt: skip
    outcomes = bytearray(reads)
    for w, r in enumerate(results):
        for name in ("reads", "checked", "mismatches", "older_than_latest", "hits", "misses", "behind"):
            out[name] += r[name]
        out["mismatch_examples"] += [f"worker {w}: {e}" for e in r["mismatch_examples"]]
        for reason, count in r["bypasses"].items():
            out["bypasses"][reason] = out["bypasses"].get(reason, 0) + count
        outcomes[w::workers] = r["outcomes"]
    out["mismatch_examples"] = out["mismatch_examples"][:MAX_EXAMPLES]
    out["outcomes"] = bytes(outcomes)
    return out


# -- figures ------------------------------------------------------------------------------


def figures(trace: Trace, out: dict[str, Any], sizes: np.ndarray) -> dict[str, Any]:
    """A replay's miss ratios and the causes of its reads not served, by the trace's order."""
    outcomes = np.frombuffer(out.pop("outcomes"), dtype=np.uint8)
    keys = trace.keys
    served = outcomes == HIT
    weights = sizes[keys]
    first = np.zeros(len(keys), dtype=bool)
    first[np.unique(keys, return_index=True)[1]] = True
    after_write = np.zeros(len(keys), dtype=bool)
    if trace.writes:
        last_read: dict[int, int] = {}
        writes, w = trace.writes, 0
        written_at: dict[int, int] = {}
        for i, key in enumerate(keys.tolist()):
            while w < len(writes) and writes[w][0] <= i:
                written_at[writes[w][1]] = writes[w][0]
                w += 1
            after_write[i] = key in last_read and written_at.get(key, -1) > last_read[key]
            last_read[key] = i
    missed = ~served
    out.update(
        obj_miss=float(missed.mean()),
        byte_miss=float(weights[missed].sum() / weights.sum()),
        outcomes={name: int((outcomes == code).sum()) for name, code in
                  (("hit", HIT), ("miss", MISS), ("behind", BEHIND), ("bypass", BYPASS), ("uncounted", UNCOUNTED))},
        not_served={
            "compulsory": int((missed & first).sum()),
            "after_write": int((missed & ~first & after_write).sum()),
            "behind": int((~first & ~after_write & (outcomes == BEHIND)).sum()),
            "bypass": int((~first & ~after_write & (outcomes == BYPASS)).sum()),
            "other": int((~first & ~after_write & (outcomes == MISS)).sum()),
            "uncounted": int((~first & ~after_write & (outcomes == UNCOUNTED)).sum()),
        },
    )  # fmt: skip
    arena = out["arena"]
    arena["mean_entry_bytes"] = arena["used_bytes"] / arena["entries"] if arena["entries"] else None
    return out


def problems_of(report: dict[str, Any]) -> list[str]:
    """What makes the run's figures wrong: a wrong document, a read unchecked or uncounted, counters
    that do not add up, an arena whose budget is not the one libCacheSim was given."""
    problems: list[str] = []
    for trace, budgets in report["results"].items():
        for label, row in budgets.items():
            for mode in MODES:
                r = row.get(mode)
                if r is None:
                    continue
                where = f"{mode} {trace} {label}"
                if r["mismatches"]:
                    wrong = f"{r['mismatches']} reads returned a wrong document"
                    problems.append(f"{where}: {wrong}: {r['mismatch_examples']}")
                if r["checked"] != r["reads"]:
                    problems.append(f"{where}: {r['checked']} of {r['reads']} reads checked")
                if r["outcomes"]["uncounted"]:
                    problems.append(f"{where}: {r['outcomes']['uncounted']} reads the counters did not count")
                if r["outcomes"]["hit"] != r["hits"]:
                    problems.append(f"{where}: {r['outcomes']['hit']} hits read by read, {r['hits']} in total")
                if r["arena"]["budget_bytes"] != row["budget_bytes"]:
                    got = r["arena"]["budget_bytes"]
                    problems.append(f"{where}: arena budget {got}, expected {row['budget_bytes']}")
    return problems


def notes_of(report: dict[str, Any]) -> list[str]:
    """Reads not served for other reasons than the policy, where they are more than NOTE_SHARE of
    a run's reads (in its ratio all the same): bypasses (a stream or an owner that stopped serving,
    on a loaded machine too) and refusals by the causal floor."""
    notes = []
    for trace, budgets in report["results"].items():
        for label, row in budgets.items():
            for mode in MODES:
                r = row.get(mode)
                if r is None:
                    continue
                reasons = ", ".join(f"{k} {n:,}" for k, n in r["bypasses"].items())
                for what, count, detail in (
                    ("bypassed", sum(r["bypasses"].values()), f" ({reasons})"),
                    ("refused by the causal floor", r["behind"], ""),
                ):
                    if count > NOTE_SHARE * r["reads"]:
                        notes.append(f"{mode} {trace} {label}: {count / r['reads']:.1%} of the reads {what}{detail}")
    return notes


# -- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace, uri: str, status: Status) -> dict[str, Any]:
    started = time.perf_counter()
    traces = [make_trace(name, args.documents, args.reads, args.seed) for name in args.traces]
    total_docs = max([args.documents] + [int(t.keys.max()) + 1 for t in traces])
    db = kit.new_name("cqc_eviction").replace("-", "_")
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    try:
        _insert(client[db][COLLECTION], total_docs, args.seed, status)
        status("calibration: the arena's footprint of an entry")
        calibration = calibrate(uri, db, args.documents, args.seed, args.timeout)
        sizes = footprints(total_docs, calibration["overhead_bytes"], args.seed)
        status(f"calibration: footprint = {calibration['formula']}")
        ctx = Context(args, uri, db, status, [0] * total_docs, sizes)
        report = _report_head(args, calibration, total_docs)
        _simulate_all(ctx, traces, report, status)
        shared_runs = []
        for trace in traces:
            for label in args.budgets:
                row = report["results"][trace.name][label]
                if "local" in args.modes:
                    status(f"local {trace.name} {label}: {len(trace.keys):,} reads, budget {row['budget_bytes']:,} B")
                    row["local"] = figures(trace, run_local(ctx, trace, label, row["budget_bytes"]), sizes)
                    _say(status, "local", trace.name, label, row)
                shared_runs.append(SharedRun(trace, label, row["budget_bytes"], kit.new_name("cqc-evict")))
        if "shared" in args.modes:

            def done(run_: SharedRun, out: dict[str, Any]) -> None:
                row = report["results"][run_.trace.name][run_.label]
                row["shared"] = figures(run_.trace, out, sizes)
                _say(status, "shared", run_.trace.name, run_.label, row)

            run_shared(ctx, shared_runs, done)
    finally:
        status("dropping the benchmark database")
        with contextlib.suppress(Exception):
            client.drop_database(db)
        client.close()
    report["ratios"] = {
        f"{trace}_{label}_{mode}_miss_over_best": row[mode]["obj_miss"] / row["best"]["obj_miss"]
        for trace, budgets in report["results"].items()
        for label, row in budgets.items()
        for mode in MODES
        if mode in row and row["best"]["obj_miss"] > 0
    }
    report["problems"] = problems_of(report)
    report["notes"] = notes_of(report)
    report["elapsed_seconds"] = time.perf_counter() - started
    return report


def _report_head(args: argparse.Namespace, calibration: dict[str, Any], total_docs: int) -> dict[str, Any]:
    from client_query_cache import __version__

    return {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "settings": {
            "documents": args.documents, "documents_inserted": total_docs, "reads": args.reads,
            "traces": list(args.traces), "budgets": {k: BUDGETS[k] for k in args.budgets},
            "modes": list(args.modes), "workers": args.workers, "seed": args.seed, "deal": "round-robin",
            "plot_fractions": list(PLOT_FRACTIONS), "policies": list(POLICIES), "best_of": list(BEST_OF),
            "document_bytes": [DOC_MIN, DOC_MAX], "reads_per_write": READS_PER_WRITE,
            "alpha": {t: ALPHA[t] for t in args.traces}, "libcachesim": _libcachesim_version(),
            "client_query_cache": __version__, "checkout": kit.checkout(),
            "external_deployment": kit.external(),
        },  # fmt: skip
        "machine": {**kit.machine_facts(), "loadavg_at_start": list(os.getloadavg())},
        "calibration": calibration,
        "traces": {},
        "results": {},
        "curves": {},
    }


def _libcachesim_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libcachesim")
    except PackageNotFoundError:
        return None


def _simulate_all(ctx: Context, traces: Sequence[Trace], report: dict[str, Any], status: Status) -> None:
    """libCacheSim at every budget of every trace; the budgets into the report."""
    for trace in traces:
        distinct = np.unique(trace.keys)
        working_set = int(ctx.sizes[distinct].sum())
        ids = object_ids(trace, len(ctx.sizes))
        req_sizes = ctx.sizes[trace.keys]
        budgets = {label: budget_bytes(BUDGETS[label], working_set) for label in ctx.args.budgets}
        plot = {f: max(BUDGET_ALIGN, math.ceil(f * working_set / BUDGET_ALIGN) * BUDGET_ALIGN) for f in PLOT_FRACTIONS}
        status(f"libCacheSim: {trace.name}")
        sims = simulate(ids, req_sizes, sorted({b for b, _ in budgets.values()} | set(plot.values())))
        report["traces"][trace.name] = {
            "alpha": ALPHA[trace.name], "reads": len(trace.keys), "writes": len(trace.writes),
            "distinct_documents": len(distinct), "distinct_objects": len(np.unique(ids)),
            "working_set_bytes": working_set, "mean_object_bytes": working_set / len(distinct),
            "largest_object_bytes": int(req_sizes.max()),
        }  # fmt: skip
        report["curves"][trace.name] = {
            name: [[budget / working_set, sims[budget][name]["obj_miss"]] for budget in sorted(set(plot.values()))]
            for name in POLICIES
        }
        rows = report["results"][trace.name] = {}
        for label, (budget, clamped) in budgets.items():
            sim = sims[budget]
            best = min(BEST_OF, key=lambda name: sim[name]["obj_miss"])
            rows[label] = {
                "fraction": BUDGETS[label], "budget_bytes": budget, "budget_fraction": budget / working_set,
                "clamped": clamped, "wtinylfu_window": sim["wtinylfu_window"],
                "libcachesim": {name: sim[name] for name in POLICIES},
                "best": {"policy": best, "obj_miss": sim[best]["obj_miss"]},
            }  # fmt: skip


def _say(status: Status, mode: str, trace: str, label: str, row: dict[str, Any]) -> None:
    r = row[mode]
    status(
        f"{mode} {trace} {label}: miss {r['obj_miss']:.4f} ({row['best']['policy']} {row['best']['obj_miss']:.4f}, "
        f"FIFO {row['libcachesim']['FIFO']['obj_miss']:.4f}), ratio {r['obj_miss'] / row['best']['obj_miss']:.3f}; "
        f"{r['hits']:,} hits, {r['misses']:,} misses, {r['behind']:,} behind, bypasses {r['bypasses'] or 0}, "
        f"{r['mismatches']} wrong; {r['seconds']:.0f}s"
    )


# -- output -------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    s, c = report["settings"], report["calibration"]
    print(
        f"eviction: {s['documents']:,} documents of {s['document_bytes'][0]}-{s['document_bytes'][1]} B, "
        f"{s['reads']:,} reads per trace, shared with {s['workers']} workers; entry footprint {c['formula']}"
    )
    short = {"S3-FIFO": "S3FIFO", "W-TinyLFU": "WTLFU"}
    columns = [("trace", "<7"), ("budget", "<6"), ("KiB", ">7.0f")] + [(short.get(p, p), ">7.4f") for p in POLICIES]
    columns += [("local", ">7.4f"), ("shared", ">7.4f"), ("loc/best", ">8.3f"), ("shr/best", ">8.3f")]
    rows = []
    for trace, budgets in report["results"].items():
        for label, row in budgets.items():
            ours = [kit.cell(row.get(m, {}).get("obj_miss")) for m in MODES]
            ratios = [kit.cell(report["ratios"].get(f"{trace}_{label}_{m}_miss_over_best")) for m in MODES]
            sims = [row["libcachesim"][p]["obj_miss"] for p in POLICIES]
            rows.append((trace, label, row["budget_bytes"] / 1024, *sims, *ours, *ratios))
    print("object miss ratios (libCacheSim's policies, then ours; best = the better of S3-FIFO and W-TinyLFU):")
    kit.table(columns, rows)
    print("our reads not served by cause (first read, written since, refused by the causal floor, bypassed, other:")
    print("evicted, admission refused or raced), reads of an older version than the latest, and the arena:")
    columns = [("trace", "<7"), ("budget", "<6"), ("mode", "<6"), ("byte miss", ">9.4f"), ("hits", ">7"),
               ("first", ">6"), ("written", ">7"), ("floor", ">6"), ("bypass", ">6"), ("other", ">7"),
               ("older", ">5"), ("admits", ">7"), ("evicts", ">7"), ("refused", ">7"), ("entries", ">7"),
               ("cap", ">6"), ("B/entry", ">7.0f")]  # fmt: skip
    rows = []
    for trace, budgets in report["results"].items():
        for label, row in budgets.items():
            for mode in MODES:
                if mode not in row:
                    continue
                r, a = row[mode], row[mode]["arena"]
                causes = r["not_served"]
                rows.append((
                    trace, label, mode, r["byte_miss"], r["hits"], causes["compulsory"], causes["after_write"],
                    causes["behind"], causes["bypass"], causes["other"], r["older_than_latest"], a["admissions"],
                    a["evictions"], sum(a["rejected"].values()) + a["dropped"], a["entries"], a["entry_cap"],
                    kit.cell(a["mean_entry_bytes"]),
                ))  # fmt: skip
    kit.table(columns, rows)
    for trace, budgets in report["results"].items():
        for label, row in budgets.items():
            for mode in MODES:
                r = row.get(mode)
                details = r and {
                    **{f"bypass:{k}": n for k, n in r["bypasses"].items()},
                    **{f"refused:{k}": n for k, n in r["arena"]["rejected"].items()},
                    **({"ring_full": r["arena"]["dropped"]} if r["arena"]["dropped"] else {}),
                    **{k: n for k, n in r["arena"].get("policy", {}).items() if n},
                }
                if details:
                    print(f"  {mode} {trace} {label}: " + ", ".join(f"{k} {n:,}" for k, n in details.items()))
    if report.get("notes"):
        print("notes (in the ratios all the same):")
        for note in report["notes"]:
            print(f"  {note}")


def plot(path: str, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    cols = min(3, len(names))
    rows_ = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols, 4.2 * rows_), squeeze=False)
    # Local: a ring drawn over shared's square, so that equal figures show both.
    marks = {
        "shared": {"marker": "s", "s": 40, "color": "tab:red"},
        "local": {"marker": "o", "s": 110, "facecolors": "none", "edgecolors": "black", "linewidths": 1.5},
    }
    for ax, name in zip(axes.flat, names):
        for policy in POLICIES:  # in this order whatever the JSON's (sorted) keys: the same colours
            xs, ys = zip(*report["curves"][name][policy])
            ax.plot([100 * x for x in xs], ys, marker=".", label=policy)
        for mode, style in marks.items():
            rows = report["results"][name].values()
            pts = [(row["budget_fraction"], row[mode]["obj_miss"]) for row in rows if mode in row]
            if pts:
                xs, ys = zip(*pts)
                ax.scatter([100 * x for x in xs], ys, zorder=5, label=f"ours ({mode})", **style)
        t = report["traces"][name]
        ax.set_xscale("log")
        ticks = [100 * f for f in PLOT_FRACTIONS]
        ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
        ax.minorticks_off()
        ax.set_title(f"{name} ({t['reads']:,} reads, {t['distinct_documents']:,} documents)", fontsize=9)
        ax.set_xlabel("budget (% of the working set, log scale)")
        ax.set_ylabel("object miss ratio")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("client-query-cache against libCacheSim: miss ratio by budget", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("eviction", __doc__, seed=20261206)
    add = parser.add_argument
    add("--quick", action="store_true", help="4 traces (one alpha), the 10%% budget, 2,000 documents, 5,000 reads")
    add("--traces", type=kit.csv(TRACES), default=None, help=f"comma-separated subset of {', '.join(TRACES)}")
    add("--budgets", type=kit.csv(tuple(BUDGETS)), default=None, help="comma-separated subset of 1pct, 10pct")
    add("--modes", type=kit.csv(MODES), default=MODES)
    add("--documents", type=int, default=None, help="documents read by the Zipf traces (default 10,000, quick 2,000)")
    add("--reads", type=int, default=None, help="reads per trace (default 50,000, quick 5,000)")
    add("--workers", type=int, default=4, help="worker processes of the shared mode (default 4)")
    add("--timeout", type=float, default=900.0, help="seconds any one wait may take (default 900)")
    add("--png", metavar="PATH", help="the figure (default: next to --json, .png)")
    add("--no-png", action="store_true", help="write no figure")
    args = parser.parse_args(argv)
    kit.defaults(args, QUICK if args.quick else FULL)
    kit.at_least_one(parser, args, ("documents", "reads", "workers"))
    if args.png and args.no_png:
        parser.error("--png and --no-png exclude each other")
    if args.no_png:
        args.png = None
    elif args.png is None and args.json:
        args.png = str(Path(args.json).with_suffix(".png"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    needed = [("libcachesim", LIBCACHESIM_HINT)] + ([("matplotlib", MATPLOTLIB_HINT)] if args.png else [])
    for module, hint in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            print(f"error: {hint}", file=sys.stderr)
            return 2
    status = Status()
    report = kit.with_server(lambda uri: run(args, uri, status), status)
    if report is None:
        return 1
    code = kit.conclude(report, report["problems"], print_report, args.json, targets=TARGETS, quick=args.quick)
    if args.png:
        plot(args.png, report)
        print(f"wrote {args.png}")
    print(f"elapsed {report['elapsed_seconds']:.0f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
