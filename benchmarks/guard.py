"""Performance guard: the working tree against a base revision, block by block.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.guard`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import functools
import gc
import importlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import bson
import pymongo
from bson.raw_bson import RawBSONDocument

from . import _kit as kit
from ._kit import machine_facts, make_document, progress, quantile, write_json

SCHEMA = "client-query-cache/guard/1"

#: The cases, in the order of the first pair (later pairs rotate it).
CASES = ("hit", "miss", "admission", "invalidation")
#: A stable slowdown of this ratio (work / base) or more fails the guard.
THRESHOLD = 1.15
CONFIDENCE = 0.95
#: Checkout this module belongs to: the working tree the guard builds.
REPO_ROOT = Path(__file__).resolve().parent.parent
#: Files a tree must have for this guard to build and run it.
LAYOUT = (
    "setup.py",
    "python/client_query_cache/__init__.py",
    "python/client_query_cache/synchronous/__init__.py",
)
DOCS = "docs"
#: The invalidation case's collection, and the documents it writes in turn.
INVAL = "inval"
INVAL_DOCS = 16
#: Reads that warm a manager (and its collection probe) before timed misses.
WARM = 20
#: Longest a block may take, in seconds.
BLOCK_TIMEOUT_S = 600.0
#: Longest the invalidation case waits for the cache to drop the old version.
STALE_DEADLINE_NS = 10_000_000_000
_RUN_BLOCK = "--run-block"
METHOD = {
    "blocks": "one child process per side and pair, ABBA order, warm-up pair discarded; "
    "per block and case the nearest-rank median of the per-operation times",
    "comparison": "paired log ratios work/base of the block medians: Hodges-Lehmann "
    "estimate, exact Wilcoxon signed-rank confidence interval",
    "verdict": "slower if the interval is above the threshold, ok if below, else inconclusive",
    "timer": "time.perf_counter_ns around each operation",
}


class GuardError(Exception):
    """The guard cannot measure: bad revision, build failure, failed block."""


# -- The decision: pure functions of the block medians ---------------------------


class Verdict(enum.Enum):
    OK = "ok"
    SLOWER = "slower"
    INCONCLUSIVE = "inconclusive"
    NOT_COMPARABLE = "not comparable"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, slots=True)
class Comparison:
    """One case's comparison of the working tree (work) with the base.

    Ratios are work / base: above 1 the working tree is slower."""

    verdict: Verdict
    #: Median (nearest rank) of work's block medians over base's.
    ratio_of_medians: float
    #: Hodges-Lehmann estimate of the ratio (paired: median of the Walsh
    #: averages of the log ratios per pair).
    estimate: float
    ci_low: float
    ci_high: float
    #: Exact coverage of [ci_low, ci_high] (>= the confidence asked for);
    #: nan when there are too few blocks for an interval.
    coverage: float
    method: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"verdict": self.verdict.value}


def not_measured(verdict: Verdict, reason: str) -> Comparison:
    """A comparison that has no numbers (not comparable, error)."""
    return Comparison(verdict, math.nan, math.nan, math.nan, math.nan, math.nan, "none", reason)


def _signed_rank_counts(n: int) -> list[int]:
    """counts[t]: how many of the 2**n sign patterns give the Wilcoxon
    signed-rank statistic T+ = t (no ties)."""
    counts = [1] + [0] * (n * (n + 1) // 2)
    top = 0
    for k in range(1, n + 1):
        top += k
        for t in range(top, k - 1, -1):
            counts[t] += counts[t - k]
    return counts


def _rank_sum_counts(m: int, n: int) -> list[int]:
    """counts[u]: how many of the C(m+n, m) orderings give the Mann-Whitney
    statistic U = u (no ties)."""
    table: list[list[list[int]]] = [[[1] for _ in range(n + 1)] for _ in range(m + 1)]
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            out = [0] * (i * j + 1)
            for u, c in enumerate(table[i][j - 1]):
                out[u] += c
            for u, c in enumerate(table[i - 1][j]):
                out[u + j] += c
            table[i][j] = out
    return table[m][n]


def _cut(counts: Sequence[int], confidence: float) -> tuple[int, float]:
    """How many order statistics to cut from each end for an exact interval
    of at least ``confidence`` (0 if none is possible), and its coverage."""
    total = sum(counts)
    half_alpha = (1.0 - confidence) / 2.0
    cum = 0
    k = 0
    for c in counts:
        if (cum + c) / total > half_alpha:
            break
        cum += c
        k += 1
    return k, 1.0 - 2.0 * cum / total


def decide(
    base: Sequence[float],
    work: Sequence[float],
    *,
    threshold: float = THRESHOLD,
    confidence: float = CONFIDENCE,
    paired: bool = True,
) -> Comparison:
    """The verdict on work against base from their block medians.

    ``paired``: ``base[i]`` and ``work[i]`` ran next to each other (pair i),
    and the interval is the exact Wilcoxon signed-rank interval of the
    Hodges-Lehmann estimate of the log ratios. Otherwise (any lengths) it
    is the exact Mann-Whitney interval of the shift of the logs. Either way:
    slower if the interval (as a ratio) lies above ``threshold``, ok if it
    lies below, inconclusive if it contains it or cannot be formed.
    """
    if not base or not work:
        raise ValueError("both sides need at least one block median")
    if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in [*base, *work]):
        raise ValueError("block medians must be positive finite numbers")
    if not 0.0 < confidence < 1.0 or threshold <= 0:
        raise ValueError("confidence must be in (0, 1) and threshold positive")
    lb = [math.log(v) for v in base]
    lw = [math.log(v) for v in work]
    ratio = quantile(sorted(work), 50) / quantile(sorted(base), 50)
    if paired:
        if len(base) != len(work):
            raise ValueError("paired block medians need as many base as work blocks")
        d = [w - b for b, w in zip(lb, lw)]
        n = len(d)
        stats = sorted((d[i] + d[j]) / 2.0 for i in range(n) for j in range(i, n))
        k, coverage = _cut(_signed_rank_counts(n), confidence)
        method = "paired: Hodges-Lehmann, Wilcoxon signed-rank interval"
        need = f"{n} pairs"
    else:
        stats = sorted(w - b for w in lw for b in lb)
        k, coverage = _cut(_rank_sum_counts(len(lb), len(lw)), confidence)
        method = "unpaired: Hodges-Lehmann, Mann-Whitney interval"
        need = f"{len(lb)} and {len(lw)} blocks"
    estimate = math.exp(statistics.median(stats))
    if k == 0:
        reason = f"{need} are too few for a {confidence:.0%} interval"
        return Comparison(Verdict.INCONCLUSIVE, ratio, estimate, math.nan, math.nan, math.nan, method, reason)
    low, high = math.exp(stats[k - 1]), math.exp(stats[len(stats) - k])
    span = f"[{low:.3f}, {high:.3f}]"
    if low > threshold:
        verdict, reason = Verdict.SLOWER, f"the whole interval {span} is above {threshold:g}"
    elif high < threshold:
        verdict, reason = Verdict.OK, f"the interval {span} is below {threshold:g}"
    else:
        verdict = Verdict.INCONCLUSIVE
        reason = f"the interval {span} contains {threshold:g}: too noisy to tell"
    return Comparison(verdict, ratio, estimate, low, high, coverage, method, reason)


# -- Building the two sides ------------------------------------------------------


def _git(*args: str, **options: Any) -> Any:
    return kit.run_command(["git", "-C", str(REPO_ROOT), *args], **options)


def resolve_rev(rev: str) -> str:
    """The commit ``rev`` names, as 40 hex digits."""
    proc = _git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if proc.returncode != 0:
        raise GuardError(f"{rev!r} does not name a commit of {REPO_ROOT}")
    return proc.stdout.decode().strip()


def export_rev(sha: str, dest: Path) -> None:
    """Write the tree of commit ``sha`` to ``dest`` (git archive)."""
    dest.mkdir(parents=True)
    with tempfile.TemporaryFile() as fh:
        proc = _git("archive", "--format=tar", sha, stdout=fh)
        if proc.returncode != 0:
            raise GuardError(f"git archive {sha} failed: {proc.stderr.decode().strip()}")
        fh.seek(0)
        with tarfile.open(fileobj=fh) as tar:
            tar.extractall(dest, filter="data")


def export_worktree(dest: Path) -> None:
    """Copy the working tree's tracked and untracked-but-not-ignored files
    (as they are on disk, uncommitted changes included) to ``dest``."""
    proc = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    if proc.returncode != 0:
        raise GuardError(f"git ls-files failed: {proc.stderr.decode().strip()}")
    for name in sorted(set(proc.stdout.decode().split("\0")) - {""}):
        src = REPO_ROOT / name
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)


def check_layout(tree: Path, label: str) -> None:
    missing = [p for p in LAYOUT if not (tree / p).is_file()]
    if not list(tree.glob("csrc/*.c")):
        missing.append("csrc/*.c")
    if missing:
        raise GuardError(
            f"{label} does not have the layout this guard builds (missing: {', '.join(missing)}): "
            "it needs setup.py building client_query_cache._native from csrc/ and the package "
            "in python/client_query_cache"
        )


def build(trees: dict[str, Path], tmp: Path, labels: dict[str, str]) -> dict[str, Path]:
    """``setup.py build`` of every tree at once (two cores, one compiler
    each) into ``tmp/NAME/lib``: the package with its extension, importable
    from there. Returns those lib directories."""
    env = {k: v for k, v in os.environ.items() if k != "CQC_SANITIZE"}  # both plain builds
    libs = {name: tmp / name / "lib" for name in trees}
    cmds = {
        name: (
            [sys.executable, "setup.py", "build", "--build-base", str(tmp / name / "build"), "--build-lib", str(lib)],
            {"cwd": trees[name], "env": env},
        )
        for name, lib in libs.items()
    }
    for name, (status, output) in kit.run_to_end(cmds, BLOCK_TIMEOUT_S).items():
        if status != 0 or not list(libs[name].glob("client_query_cache/_native*.so")):
            tail = "\n".join(output.decode("utf-8", errors="replace").splitlines()[-30:])
            raise GuardError(f"building {labels[name]} failed (status {status}):\n{tail}")
    return libs


# -- One block (runs in a child process, with one side's package on sys.path) ----


class Unavailable(Exception):
    """This tree lacks the API a case needs."""


@dataclasses.dataclass(frozen=True, slots=True)
class BlockContext:
    client: Any
    db_name: str
    ops: dict[str, int]
    ranges: dict[str, list[int]]
    seed: int
    #: Slowdown injection: spin this many times each timed interval again.
    extra: float


def _stretch(t0: int, t1: int, extra: float) -> int:
    """Slowdown injection: spin until ``extra`` times the interval t0..t1
    has passed again after t1; return the new stop timestamp."""
    clock = time.perf_counter_ns
    target = t1 + int((t1 - t0) * extra)
    now = clock()
    while now < target:
        now = clock()
    return now


def _summary(times: list[int], **facts: Any) -> dict[str, Any]:
    s = sorted(times)
    return {"n": len(s), "p50_ns": quantile(s, 50), "p90_ns": quantile(s, 90), "min_ns": s[0], **facts}


def _stored(b: BlockContext, case: str) -> tuple[list[int], dict[int, Any], dict[int, Any]]:
    """The ``_id``s of ``case``'s documents and the stored documents, read
    from the server: as the collection's codec options decode them (what a
    read must return) and as raw BSON with the same options (what a miss reads)."""
    ids = list(range(*b.ranges[case]))
    coll = b.client[b.db_name][INVAL if case == "invalidation" else DOCS]
    codec = coll.codec_options
    raw_coll = coll.with_options(codec_options=codec.with_options(document_class=RawBSONDocument))
    raw = {d["_id"]: d for d in raw_coll.find({"_id": {"$in": ids}})}
    if len(raw) != len(set(ids)):
        raise RuntimeError(f"{len(set(ids)) - len(raw)} documents of {coll.full_name} are missing")
    return ids, {i: bson.decode(d.raw, codec) for i, d in raw.items()}, raw


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"verification failed: {what}")


@contextlib.contextmanager
def _cache(b: BlockContext, coll: str, admit: Sequence[int], expected: dict[int, Any]) -> Iterator[tuple[Any, Any]]:
    """A fresh process-local cache (and its view of ``coll``) whose stream
    is ready, once reading every id of ``admit`` gives a whole pass of hits
    (the first pass admits, and probes the collection)."""
    from client_query_cache import CacheManager

    def read(i: int) -> None:
        if cached.find_one({"_id": i}) != expected[i]:
            raise RuntimeError(f"find_one({{'_id': {i}}}) returned a wrong document")

    with CacheManager(b.client) as manager:
        cached = manager[b.db_name][coll]
        if not manager.wait_ready(30, b.db_name):
            raise RuntimeError(f"the change stream of {b.db_name} did not become ready within 30 s")
        if not asyncio.run(kit.warmed(manager, [functools.partial(read, i) for i in admit], 60, pause=0)):
            raise RuntimeError("warm-up reads were still not all hits after 60 s")
        yield manager, cached


def _timed(
    b: BlockContext,
    manager: Any,
    order: Sequence[int],
    op: Callable[[dict[str, Any]], Any],
    expected: dict[int, Any],
    wrong: str = "wrong documents",
) -> tuple[list[int], Any, Any]:
    """Time ``op({"_id": i})`` for each ``i`` of ``order`` and check every
    result after its stop timestamp; returns the times and the manager's
    snapshots before and after."""
    clock, extra = time.perf_counter_ns, b.extra
    times: list[int] = []
    mismatches = 0
    before = manager.snapshot()
    gc.collect()
    for i in order:
        want = expected[i]
        filt = {"_id": i}
        t0 = clock()
        got = op(filt)
        t1 = clock()
        if extra:
            t1 = _stretch(t0, t1, extra)
        times.append(t1 - t0)
        mismatches += got != want
        del got
    after = manager.snapshot()
    _check(not mismatches, f"{mismatches} {wrong}")
    return times, before, after


def case_hit(b: BlockContext) -> dict[str, Any]:
    ids, expected, _ = _stored(b, "hit")
    n = b.ops["hit"]
    rng = random.Random(b.seed)
    order = [rng.choice(ids) for _ in range(n)]
    with _cache(b, DOCS, ids, expected) as (manager, cached):
        times, before, after = _timed(b, manager, order, cached.find_one, expected)
    hits, misses = after.hits - before.hits, after.misses - before.misses
    _check(hits == n and misses == 0, f"{hits} hits and {misses} misses for {n} reads")
    return _summary(times, documents=len(ids))


def case_miss(b: BlockContext) -> dict[str, Any]:
    ids, expected, _ = _stored(b, "miss")
    warm, timed = ids[:WARM], ids[WARM:]
    random.Random(b.seed).shuffle(timed)
    n = len(timed)
    with _cache(b, DOCS, warm, expected) as (manager, cached):
        times, before, after = _timed(b, manager, timed, cached.find_one, expected)
    misses, hits = after.misses - before.misses, after.hits - before.hits
    admitted = after.admissions - before.admissions
    _check(
        misses == n and hits == 0 and admitted == n,
        f"{misses} misses, {hits} hits, {admitted} admissions for {n} reads",
    )
    return _summary(times)


def case_admission(b: BlockContext) -> dict[str, Any]:
    try:
        from client_query_cache._core.read import Step, StepKind
    except ImportError as exc:
        raise Unavailable(f"no step API in client_query_cache._core.read ({exc})") from None
    if not hasattr(StepKind, "READ"):
        raise Unavailable("client_query_cache._core.read.StepKind has no READ")
    ids, expected, raw = _stored(b, "admission")
    warm_public, warm_steps, timed = ids[:WARM], ids[WARM : 2 * WARM], ids[2 * WARM :]
    random.Random(b.seed).shuffle(timed)
    n = len(timed)
    read_kind = StepKind.READ
    with _cache(b, DOCS, warm_public, expected) as (manager, cached):
        core = getattr(cached, "_core", None)
        fast, finish = getattr(core, "fast_find_one", None), getattr(core, "finish", None)
        if fast is None or finish is None:
            raise Unavailable("CachedCollection has no _core.fast_find_one / _core.finish")

        def admit(filt: dict[str, Any]) -> Any:
            """A miss's READ step, finished with the raw document (None
            without a READ step)."""
            step = fast(filt)
            return finish(step, raw[filt["_id"]]) if type(step) is Step and step.kind is read_kind else None

        for i in warm_steps:
            step = fast({"_id": i})
            _check(type(step) is Step and step.kind is read_kind, "a warm-up miss gave no READ step")
            _check(finish(step, raw[i]) == expected[i], "a warm-up admission returned a wrong document")
        not_read = "wrong documents (or misses without a READ step)"
        times, before, after = _timed(b, manager, timed, admit, expected, not_read)
        wrong = sum(cached.find_one({"_id": i}) != expected[i] for i in timed)
        checked = manager.snapshot()
    misses, admitted = after.misses - before.misses, after.admissions - before.admissions
    later_hits = checked.hits - after.hits
    _check(not wrong, f"{wrong} wrong documents")
    _check(
        misses == n and admitted == n and later_hits == n,
        f"{misses} misses, {admitted} admissions, {later_hits} later hits for {n} admissions",
    )
    return _summary(times)


def case_invalidation(b: BlockContext) -> dict[str, Any]:
    ids, expected, _ = _stored(b, "invalidation")
    n = b.ops["invalidation"]
    start = random.Random(b.seed).randrange(len(ids))
    order = [ids[(start + j) % len(ids)] for j in range(n)]
    clock, extra = time.perf_counter_ns, b.extra
    times: list[int] = []
    stale_reads = 0
    with _cache(b, INVAL, ids, expected) as (manager, cached):
        raw = cached.raw
        find_one = cached.find_one
        before = manager.snapshot()
        gc.collect()
        for i in order:
            filt = {"_id": i}
            old = expected[i]
            version = old["version"]
            new = dict(old, version=version + 1)
            # Untimed: the cache serves the current version as a hit (the
            # read-through after the previous write of i admitted it).
            for _ in range(3):
                hits = manager.snapshot().hits
                _check(find_one(filt) == old, f"document {i} is not its current version before the write")
                if manager.snapshot().hits == hits + 1:
                    break
            else:
                raise RuntimeError(f"document {i} is not cached before the write")
            raw.update_one(filt, {"$set": {"version": version + 1}})
            t0 = clock()
            while True:
                ts = clock()
                got = find_one(filt)
                if got is None or got.get("version") != version:
                    break
                stale_reads += 1
                if ts - t0 > STALE_DEADLINE_NS:
                    raise RuntimeError(f"the cache still served the old version of {i} after 10 s")
            if extra:
                ts = _stretch(t0, ts, extra)
            times.append(ts - t0)
            _check(got == new, f"document {i} after the write is not the written version")
            expected[i] = new
        after = manager.snapshot()
    invalidated = after.invalidations - before.invalidations
    bypassed = after.bypass_total - before.bypass_total
    # The new version must have come through the cache (a miss after an
    # invalidation), not around it.
    _check(invalidated >= n and bypassed == 0, f"{invalidated} invalidations, {bypassed} bypasses for {n} writes")
    return _summary(times, stale_reads=stale_reads)


CASE_FUNCS: dict[str, Callable[[BlockContext], dict[str, Any]]] = {
    "hit": case_hit,
    "miss": case_miss,
    "admission": case_admission,
    "invalidation": case_invalidation,
}


def run_block(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run the cases of one block with this interpreter's package, which must
    be the one in ``cfg["lib"]``."""
    lib = Path(cfg["lib"]).resolve()
    for name in ("client_query_cache", "client_query_cache._native"):
        where = Path(str(importlib.import_module(name).__file__)).resolve()
        if not where.is_relative_to(lib):
            raise RuntimeError(f"{name} was imported from {where}, not from {lib}")
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(cfg["uri"])
    results: dict[str, Any] = {}
    try:
        for case in cfg["cases"]:
            seed = cfg["seed"] * 8 + CASES.index(case)
            ctx = BlockContext(client, cfg["db"], cfg["ops"], cfg["ranges"], seed, cfg["extra"])
            started = time.perf_counter()
            try:
                results[case] = CASE_FUNCS[case](ctx)
            except Unavailable as exc:
                results[case] = {"unavailable": str(exc)}
            except Exception:
                results[case] = {"error": traceback.format_exc(limit=6)}
            results[case]["seconds"] = time.perf_counter() - started
    finally:
        client.close()
    return {"cases": results}


# -- The parent: sides, data, pairs of blocks, report ----------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    label: str  # what was built
    lib: Path
    extra: float


def ops_per_block(ops: int) -> dict[str, int]:
    return {
        "hit": ops,
        "admission": max(10, ops // 2),
        "miss": max(10, ops // 10),
        "invalidation": max(5, ops // 50),
    }


def id_ranges(ops: dict[str, int]) -> dict[str, list[int]]:
    """Disjoint ``_id`` ranges of the docs collection per case (and of the
    inval collection for invalidation)."""
    hit_docs = max(50, min(1000, ops["hit"] // 2))
    miss_end = hit_docs + WARM + ops["miss"]
    return {
        "hit": [0, hit_docs],
        "miss": [hit_docs, miss_end],
        "admission": [miss_end, miss_end + 2 * WARM + ops["admission"]],
        "invalidation": [0, INVAL_DOCS],
    }


def load_data(uri: str, db_name: str, ranges: dict[str, list[int]], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    try:
        total = max(r[1] for k, r in ranges.items() if k != "invalidation")
        docs = [make_document(i, rng) for i in range(total)]
        client[db_name][DOCS].insert_many(docs)
        client[db_name][INVAL].insert_many([make_document(i, rng) for i in range(INVAL_DOCS)])
        # Every document read once, so no block is the first to touch one.
        read = sum(1 for _ in client[db_name][DOCS].find({}, {"_id": 1, "bio": 1}))
        sizes = [len(bson.encode(d)) for d in docs]
    finally:
        client.close()
    return {"documents": total, "read_back": read, "document_bytes_mean": sum(sizes) / len(sizes)}


def run_child(side: Side, cfg: dict[str, Any], workdir: Path, tag: str) -> dict[str, Any]:
    config_path, out_path = workdir / f"{tag}.json", workdir / f"{tag}.out.json"
    write_json(str(config_path), dict(cfg, lib=str(side.lib), extra=side.extra))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CQC_SANITIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(side.lib), str(REPO_ROOT)])
    cmd = [sys.executable, "-m", "benchmarks.guard", _RUN_BLOCK, str(config_path), str(out_path)]
    proc = kit.run_command(cmd, BLOCK_TIMEOUT_S, cwd=workdir, env=env, text=True)
    if proc is None:
        raise GuardError(f"block {tag} did not finish within {BLOCK_TIMEOUT_S:g} s")
    if proc.returncode != 0 or not out_path.exists():
        tail = "\n".join(proc.stderr.splitlines()[-25:])
        raise GuardError(f"block {tag} ({side.label}) failed with status {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text(encoding="utf-8"))
    return result


def measure(
    sides: dict[str, Side], uri: str, db_name: str, args: argparse.Namespace, workdir: Path
) -> tuple[list[dict[str, Any]], dict[str, Comparison]]:
    """Run the warm-up pairs and ``args.blocks`` measured pairs; returns the
    blocks and the cases dropped on the way (the base cannot run them, or
    the working tree fails them) with their comparison."""
    ops = ops_per_block(args.ops)
    cfg = {"uri": uri, "db": db_name, "ops": ops, "ranges": id_ranges(ops)}
    blocks: list[dict[str, Any]] = []
    dropped: dict[str, Comparison] = {}
    for p in range(-args.warmup_pairs, args.blocks):
        rot = p % len(CASES)
        cases = [c for c in CASES[rot:] + CASES[:rot] if c not in dropped]
        if not cases:
            break
        what = "warm-up pair" if p < 0 else f"pair {p + 1}/{args.blocks}"
        for side in ("base", "work") if p % 2 == 0 else ("work", "base"):
            started = time.perf_counter()
            tag = f"{p + args.warmup_pairs:02d}-{side}"
            out = run_child(sides[side], dict(cfg, cases=cases, seed=args.seed + p), workdir, tag)
            wall = time.perf_counter() - started
            blocks.append({"pair": p, "side": side, "cases": out["cases"], "seconds": wall})
            for case in cases:
                r = out["cases"][case]
                if "p50_ns" in r:
                    continue
                # The last line of the traceback; the whole one is in the block's report.
                problem = (r.get("unavailable") or r.get("error") or "?").strip().splitlines()[-1]
                if side == "base":
                    dropped[case] = not_measured(Verdict.NOT_COMPARABLE, f"the base cannot run it: {problem}")
                else:
                    dropped[case] = not_measured(Verdict.ERROR, f"the working tree fails it: {problem}")
            parts = ", ".join(f"{case} {_fmt_ns(out['cases'][case].get('p50_ns', math.nan))}" for case in cases)
            progress(f"[{what}] {side}: {parts} (p50 us; {wall:.1f} s)")
    return blocks, dropped


def _fmt_ns(ns: float) -> str:
    return format(kit.cell(ns / 1000), ".2f")


def _block_medians(blocks: list[dict[str, Any]], case: str, side: str) -> list[Any]:
    """A side's block medians of a case, pair by pair (None where it failed)."""
    mine = [b for b in blocks if b["pair"] >= 0 and b["side"] == side and case in b["cases"]]
    return [b["cases"][case].get("p50_ns") for b in mine]


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"guard: {report['work']['label']} vs base {report['base']['label']}; "
        f"{cfg['pairs']} pairs of blocks (ABBA), threshold {cfg['threshold']:g}, "
        f"{cfg['confidence']:.0%} intervals"
    )
    if cfg["slowdown_injection"] != 1.0:
        print(f"SELF-CHECK: the working-tree side's timed intervals are stretched {cfg['slowdown_injection']:g}x")
    columns = [
        ("case", "<13"), ("ops", ">5"), ("base p50 us", ">12.2f"), ("work p50 us", ">12.2f"), ("work/base", ">9.3f"),
        ("estimate", ">8.3f"), (f"{cfg['confidence']:.0%} interval", ">17"), ("verdict", ""),
    ]  # fmt: skip
    rows = []
    for case, r in report["cases"].items():
        c = r["comparison"]
        span = f"[{c['ci_low']:.3f}, {c['ci_high']:.3f}]" if math.isfinite(c["ci_low"]) else "-"
        rows.append((
            case, cfg["ops"][case], kit.cell(r["base_p50_ns"] / 1000), kit.cell(r["work_p50_ns"] / 1000),
            kit.cell(c["ratio_of_medians"]), kit.cell(c["estimate"]), span, c["verdict"],
        ))  # fmt: skip
    kit.table(columns, rows)
    for case, r in report["cases"].items():
        c = r["comparison"]
        if c["verdict"] != Verdict.OK.value:
            print(f"  {case}: {c['verdict']}: {c['reason'].splitlines()[0]}")
    print(f"result: {report['result']} (exit {report['exit_status']}); {report['seconds']['total']:.0f} s")


def exit_status(comparisons: dict[str, Comparison]) -> int:
    verdicts = {c.verdict for c in comparisons.values()}
    if Verdict.SLOWER in verdicts:
        return 1
    if Verdict.ERROR in verdicts:
        return 2
    return 0


def _describe_worktree() -> str:
    head = _git("rev-parse", "--short", "HEAD").stdout.decode().strip()
    dirty = _git("status", "--porcelain", "--untracked-files=normal").stdout.strip()
    return f"working tree (HEAD {head}{' + uncommitted changes' if dirty else ''})"


def _guard(args: argparse.Namespace, tmp: Path, report: dict[str, Any]) -> int:
    timings: dict[str, float] = {}
    t = time.perf_counter()
    shas: dict[str, str] = {}
    labels: dict[str, str] = {}
    for name, rev in (("base", args.base_rev), ("work", args.work_rev)):
        if name == "base" or rev:
            shas[name] = resolve_rev(rev)
            export_rev(shas[name], tmp / f"{name}-src")
            labels[name] = f"{rev} ({shas[name][:12]})"
        else:
            export_worktree(tmp / f"{name}-src")
            labels[name] = _describe_worktree()
        check_layout(tmp / f"{name}-src", f"BASE_REV {labels[name]}" if name == "base" else labels[name])
    progress("building both sides (setup.py build, out of place)...")
    libs = build({name: tmp / f"{name}-src" for name in labels}, tmp, labels)
    timings["build"] = time.perf_counter() - t
    sides = {
        "base": Side(labels["base"], libs["base"], 0.0),
        "work": Side(labels["work"], libs["work"], args.slowdown_injection - 1.0),
    }
    report["base"] = {"label": labels["base"], "commit": shas["base"]}
    head = None if args.work_rev else resolve_rev("HEAD")
    report["work"] = {"label": labels["work"], "commit": shas.get("work"), "head": head}

    progress("starting the server (or using MONGODB_URI)...")
    with kit.server() as uri:
        rng = random.Random(args.seed)
        db_name = f"cqc_guard_{int(time.time())}_{rng.randint(0, 10**6)}"
        try:
            t = time.perf_counter()
            report["data"] = load_data(uri, db_name, id_ranges(ops_per_block(args.ops)), args.seed)
            timings["data"] = time.perf_counter() - t
            t = time.perf_counter()
            workdir = tmp / "blocks"
            workdir.mkdir()
            blocks, dropped = measure(sides, uri, db_name, args, workdir)
            timings["blocks"] = time.perf_counter() - t
        finally:
            client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
            try:
                client.drop_database(db_name)
            except pymongo.errors.PyMongoError as exc:  # do not hide the error that got here
                progress(f"could not drop {db_name}: {exc}")
            finally:
                client.close()
    report["blocks"] = blocks
    report["cases"] = {}
    comparisons: dict[str, Comparison] = {}
    for case in CASES:
        medians = {side: _block_medians(blocks, case, side) for side in ("base", "work")}
        comparisons[case] = dropped.get(case) or decide(
            medians["base"], medians["work"], threshold=args.threshold, confidence=args.confidence
        )
        report["cases"][case] = {
            "comparison": comparisons[case].as_dict(),
            **{f"{side}_p50_ns": quantile(sorted(m for m in ms if m is not None), 50) for side, ms in medians.items()},
            **{f"{side}_block_p50_ns": ms for side, ms in medians.items()},
        }
    report["seconds"] = timings
    status = exit_status(comparisons)
    verdicts = {c.verdict for c in comparisons.values()}
    report["result"] = (
        "slower" if status == 1 else "error" if status == 2
        else "inconclusive" if verdicts & {Verdict.INCONCLUSIVE, Verdict.NOT_COMPARABLE} else "ok"
    )  # fmt: skip
    report["exit_status"] = status
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_RUN_BLOCK]:  # a block: its config and result files
        with open(argv[1], encoding="utf-8") as fh:
            write_json(argv[2], run_block(json.load(fh)))
        return 0
    parser = kit.parser("guard", __doc__, seed=20261203)
    parser.add_argument("base_rev", metavar="BASE_REV", help="the revision to compare the working tree with")
    parser.add_argument("--quick", action="store_true", help="6 pairs, 500 hit reads per block (a smoke run)")
    parser.add_argument("--blocks", type=int, default=None, help="measured pairs of blocks (default 12, quick 6)")
    parser.add_argument(
        "--ops", type=int, default=None,
        help="hit reads per block (default 2000, quick 500); admission ops/2, miss ops/10, invalidation ops/50",
    )  # fmt: skip
    parser.add_argument("--work-rev", metavar="REV", help="build REV instead of the working tree")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="work/base ratio that fails (1.15)")
    parser.add_argument("--confidence", type=float, default=CONFIDENCE, help="of the intervals (0.95)")
    parser.add_argument(
        "--slowdown-injection", type=float, default=1.0, metavar="F",
        help="self-check: stretch every timed interval of the working-tree side F times",
    )  # fmt: skip
    parser.add_argument("--warmup-pairs", type=int, default=1, help="discarded pairs before measuring (1)")
    args = parser.parse_args(argv)
    args.blocks = args.blocks if args.blocks is not None else (6 if args.quick else 12)
    args.ops = args.ops if args.ops is not None else (500 if args.quick else 2000)
    if args.blocks < 1 or args.ops < 10 or args.warmup_pairs < 0:
        parser.error("--blocks must be >= 1, --ops >= 10, --warmup-pairs >= 0")
    if args.slowdown_injection < 1.0 or not 0.0 < args.confidence < 1.0 or args.threshold <= 1.0:
        parser.error("--slowdown-injection must be >= 1, --confidence in (0, 1), --threshold > 1")

    started = time.perf_counter()
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "method": METHOD,
        "config": {
            "base_rev": args.base_rev,
            "work_rev": args.work_rev,
            "pairs": args.blocks,
            "warmup_pairs": args.warmup_pairs,
            "ops": ops_per_block(args.ops),
            "threshold": args.threshold,
            "confidence": args.confidence,
            "slowdown_injection": args.slowdown_injection,
            "seed": args.seed,
            "external_deployment": bool(os.environ.get("MONGODB_URI")),
        },
        "machine": machine_facts(),
    }
    try:
        with tempfile.TemporaryDirectory(prefix="cqc-guard-") as tmp:
            status = _guard(args, Path(tmp), report)
    except GuardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        report["error"] = str(exc)
        status = 2
    except Exception as exc:  # exit status 1 means "slower": anything else is 2
        traceback.print_exc()
        report["error"] = repr(exc)
        status = 2
    report["seconds"] = dict(report.get("seconds", {}), total=time.perf_counter() - started)
    if "result" in report:
        _print(report)
        for case, r in report["cases"].items():
            v = r["comparison"]["verdict"]
            if v in (Verdict.INCONCLUSIVE.value, Verdict.NOT_COMPARABLE.value):
                print(f"warning: {case}: {v}", file=sys.stderr)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
