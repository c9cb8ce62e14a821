"""Public-API shared-cache benchmark: direct reads, independent caches, one shared cache.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.public_shared_cache`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import gc
import importlib
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bson
import pymongo
from pymongo.read_concern import ReadConcern

from . import _kit as kit
from ._kit import BenchmarkFailed, MiB, Shared, Status, summarize

SCHEMA = "client-query-cache/public-shared-cache/1"

PATHS = ("direct", "independent", "shared")
MODES = ("sync", "async")
WINDOWS = ("hot", "cold")


COLLECTION = "docs"
#: Cold identities start here, far above any hot identity.
COLD_ID_BASE = 10_000_000
#: insert_many batch size during setup.
INSERT_BATCH = 1000
#: Direct-path warm-up: reads per worker that open its connections.
DIRECT_WARM_READS = 64
#: The defaults of the options that a quick run makes smaller.
FULL = {"repetitions": 3, "reads": 2000, "hot": 4096}
QUICK = {"repetitions": 1, "reads": 200, "hot": 256}

MATPLOTLIB_HINT = (
    "matplotlib is needed to write the PNG: install it (pip install 'matplotlib==3.11.2') "
    "or pass --no-png"
)


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of process ``pid`` so far.

    On Linux this reads the process's CPU-time clock (what
    ``clock_getcpuclockid`` returns: ``((~pid) << 3) | 2``) at nanosecond
    resolution; ``psutil.Process.cpu_times`` counts in clock ticks (10 ms),
    too coarse for a hot window of a few hundred milliseconds of CPU. Where
    that clock cannot be read, psutil it is.
    """
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2) / 1e9
    except (OSError, OverflowError, AttributeError):
        import psutil

        times = psutil.Process(pid).cpu_times()
        return float(times.user + times.system)


# -- Worker processes ------------------------------------------------------------
#
# A worker runs one phase (one path, one mode): warm-up, then the hot and the
# cold window. It meets the parent at the barrier (parties = workers + 1):
#
#   warm step A | B | then per window: start | end | release
#
# A: every worker has read the whole hot set once (in its own random order);
#    the shared owner has every hot identity to admit;
# B: the parent saw the owner admit the hot set (shared), every worker may now
#    check that its reads are hits;
# start: the parent samples the owner's CPU, every worker its own, and the
#    measured reads begin;
# end: every worker has sampled its CPU after its last read; the parent
#    samples the owner's CPU, then PSS and cumulative CPU of every process
#    while the workers wait (managers and mappings attached);
# release: the workers report the window on the queue.


@dataclasses.dataclass
class _Checker:
    """Checks a measured read after its stop timestamp: the result, re-encoded
    with the collection's codec options, is the inserted BSON (same fields,
    order, types and values). Counts the mismatches and the thread CPU the
    checks took."""

    codec: Any
    mismatches: int = 0
    cpu_ns: int = 0

    def __call__(self, got: Any, want: bytes) -> None:
        v0 = time.thread_time_ns()
        if got is None or kit.digest(bson.encode(got, codec_options=self.codec)) != want:
            self.mismatches += 1
        self.cpu_ns += time.thread_time_ns() - v0


async def _timed(reader: Any, filters: list[Any], want: list[bytes], check: _Checker, is_async: bool) -> list[int]:
    """The measured reads' times (ns), ``await`` included for an async
    reader; each result checked after its stop timestamp."""
    clock = time.perf_counter_ns
    samples = [0] * len(filters)
    for k, filt in enumerate(filters):
        t0 = clock()
        got = reader.find_one(filt)
        if is_async:
            got = await got
        samples[k] = clock() - t0
        check(got, want[k])
        del got
    return samples


def _counts(independent: bool, before: Any, after: Any) -> dict[str, Any]:
    """A window's cache counters, from the manager's snapshots around it (a direct worker has none).
    Streams: a process-local manager's open ones, counted as the owner counts its own (every state
    but closed and not started)."""
    if before is None:
        return {"hits": 0, "misses": 0, "bypasses": 0, "streams": 0}
    reasons = {k: v - before.bypasses.get(k, 0) for k, v in after.bypasses.items()}
    return {
        "hits": after.hits - before.hits,
        "misses": after.misses - before.misses,
        "bypasses": after.bypass_total - before.bypass_total,
        "bypass_reasons": {k: n for k, n in reasons.items() if n},
        "streams": sum(s.state.value not in ("closed", "not_started") for s in after.streams) if independent else 0,
        "misses_before": before.misses,  # warm-up (and earlier windows)
    }


class _Reads(Sequence[Callable[[], Any]]):
    """``find_one({"_id": i})`` for each ``i`` of ``ids``, made as a pass
    reaches it: a list of 4,096 bound calls and filters held through the
    warm-up would leave 1-1.5 MiB of each cached worker's heap behind in its
    PSS, memory of the harness that no direct worker has (it reads 64)."""

    def __init__(self, find_one: Callable[[Any], Any], ids: list[int]) -> None:
        self.find_one, self.ids = find_one, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, k: Any) -> Any:
        i = self.ids[k]
        return lambda: self.find_one({"_id": i})


async def _warm(spec: dict[str, Any], manager: Any, reader: Any, meet: Any) -> int:
    """Warm-up steps A, B and C (see the barrier protocol); the passes C took."""
    order = list(range(spec["hot"] if manager is not None else min(spec["hot"], DIRECT_WARM_READS)))
    random.Random(spec["warm_seed"]).shuffle(order)
    reads = _Reads(reader.find_one, order)
    if manager is not None:
        await kit.registered(manager, reader, spec["db"], spec["timeout"])
    # A cached worker reads the whole hot set, in an order of its own, as
    # independent application processes would: nothing splits the work
    # between the workers of the shared path.
    for read in reads:
        await kit.resolved(read())
    await meet()  # A
    await meet()  # B: the owner admitted the hot set (shared)
    if manager is None:
        return 0
    # C: until a whole pass over the hot set hits.
    if not (passes := await kit.warmed(manager, reads, spec["timeout"], 0.05)):
        raise BenchmarkFailed(f"hot set still missing after {spec['timeout']:g} s of warm-up passes")
    return passes


async def _work(spec: dict[str, Any], shared: Shared) -> None:
    """One worker of a phase: warm-up, then the hot and the cold window."""
    is_async, timeout, cached = spec["mode"] == "async", spec["timeout"], spec["path"] != "direct"

    async def meet() -> None:
        if is_async:  # in a thread: the event loop (PyMongo's monitors) keeps running
            await asyncio.to_thread(shared.barrier.wait, timeout)
        else:
            shared.barrier.wait(timeout)

    cpu_clock = time.process_time_ns  # all threads of this process, user + system
    async with kit.worker_client(spec["uri"], is_async, spec["shared_name"], cached=cached) as (client, manager):
        coll = client[spec["db"]][COLLECTION]
        if manager is None:
            reader: Any = coll.with_options(read_concern=ReadConcern("majority"))
        else:
            reader = manager[spec["db"]][COLLECTION]
        warm_passes = await _warm(spec, manager, reader, meet)
        for window in WINDOWS:
            ids, want = spec["windows"][window]
            filters = [{"_id": i} for i in ids]
            check = _Checker(coll.codec_options)
            before = manager.snapshot() if manager is not None else None
            gc.collect()
            await meet()  # start
            cpu0 = cpu_clock()
            samples = await _timed(reader, filters, want, check, is_async)
            cpu1 = cpu_clock()
            after = manager.snapshot() if manager is not None else None
            await meet()  # end: the parent samples memory and CPU
            await meet()  # release
            result = {"samples_ns": samples, "mismatches": check.mismatches, "verify_cpu_s": check.cpu_ns / 1e9}
            result.update(cpu_s=(cpu1 - cpu0) / 1e9, warm_passes=warm_passes)
            result.update(_counts(spec["path"] == "independent", before, after))
            shared.put("window", spec["index"], result)


def _worker(spec: dict[str, Any], shared: Shared) -> None:
    """A spawned worker (``kit.Pool``'s protocol), sync or async."""
    asyncio.run(_work(spec, shared))


class _Run:
    """What every phase of a run shares: the options, the server and the
    database, the phases in order, each worker's cold identities and the
    digests of every inserted document."""

    def __init__(self, args: argparse.Namespace, uri: str, db: str, status: Status) -> None:
        self.workers, self.reads, self.hot = args.workers, args.reads, args.hot
        self.repetitions, self.seed, self.timeout = args.repetitions, args.seed, args.timeout
        self.uri, self.db, self.status = uri, db, status
        self.digests: dict[int, bytes] = {}
        # Each repetition rotates the order of the paths and alternates which mode goes first.
        self.phases = [
            (rep, path, mode)
            for rep in range(args.repetitions)
            for path in PATHS[rep % 3 :] + PATHS[: rep % 3]
            for mode in (MODES if rep % 2 == 0 else MODES[::-1])
        ]
        # Cold identities: a distinct block per (phase, worker), read in a
        # seeded random order; nobody reads any of them before its window.
        self.cold: dict[tuple[int, str, str, int], list[int]] = {}
        for n, (phase, w) in enumerate(itertools.product(self.phases, range(self.workers))):
            ids = list(range(COLD_ID_BASE + n * self.reads, COLD_ID_BASE + (n + 1) * self.reads))
            random.Random(f"{self.seed}/cold/{phase}/{w}").shuffle(ids)
            self.cold[(*phase, w)] = ids
        self.cold_total = len(self.cold) * self.reads

    def hot_order(self, rep: int, mode: str, worker: int) -> list[int]:
        """The measured hot reads: the same sequence for the three paths of a
        repetition and mode, so the paths read the same identities."""
        rng = random.Random(f"{self.seed}/hot/{rep}/{mode}/{worker}")
        return [rng.randrange(self.hot) for _ in range(self.reads)]


def _insert_documents(coll: Any, run: _Run) -> tuple[dict[int, bytes], dict[str, Any]]:
    """Insert the hot identities (0..hot-1) and every cold identity; return
    the digests of their BSON and size statistics. Each document's BSON is
    checked to survive decoding with the collection's codec options and
    encoding again unchanged, so a read's re-encoded result can be compared
    with the inserted bytes."""
    rng = random.Random(run.seed)
    codec = coll.codec_options
    ids = list(range(run.hot)) + list(range(COLD_ID_BASE, COLD_ID_BASE + run.cold_total))
    digests: dict[int, bytes] = {}
    sizes: list[int] = []
    for start in range(0, len(ids), INSERT_BATCH):
        run.status(f"setup: inserting documents {start:,}/{len(ids):,}")
        batch = ids[start : start + INSERT_BATCH]
        raws = [bson.encode(kit.make_document(i, rng)) for i in batch]
        for i, raw in zip(batch, raws):
            if bson.encode(bson.decode(raw, codec), codec_options=codec) != raw:
                raise RuntimeError(f"document {i} does not survive a decode/encode round trip")
            digests[i] = kit.digest(raw)
        sizes += map(len, raws)
        kit.insert_raw(coll, raws, INSERT_BATCH)
    return digests, {
        "document_bytes_mean": sum(sizes) / len(sizes),
        "document_bytes_min": min(sizes),
        "document_bytes_max": max(sizes),
    }


@dataclasses.dataclass
class _Phase:
    """One path and mode: an owner (shared), spawned workers, two windows."""

    run: _Run
    rep: int
    path: str
    mode: str
    label: str
    owner: Any = None
    pool: Any = None

    def _say(self, message: str) -> None:
        self.run.status(f"{self.label}: {message}")

    def _spec(self, w: int) -> dict[str, Any]:
        run = self.run
        ids = {"hot": run.hot_order(self.rep, self.mode, w), "cold": run.cold[(self.rep, self.path, self.mode, w)]}
        return {
            "uri": run.uri, "db": run.db, "path": self.path, "mode": self.mode, "index": w, "hot": run.hot,
            "windows": {window: (ids[window], [run.digests[i] for i in ids[window]]) for window in WINDOWS},
            "shared_name": self.owner.name if self.owner is not None else None, "timeout": run.timeout,
            "warm_seed": f"{run.seed}/warm/{self.rep}/{self.path}/{self.mode}/{w}",
        }  # fmt: skip

    def measure(self) -> dict[str, dict[str, Any]]:
        """The hot and the cold window; every process is ended before this returns or raises."""
        run = self.run
        with contextlib.ExitStack() as stack:
            if self.path == "shared":
                self._say("starting the owner")
                name = f"cqc-pubbench-{os.getpid()}-{self.rep}-{self.mode}"
                self.owner = stack.enter_context(kit.owned(name, run.uri, **kit.OWNER_GEOMETRY))
            self.pool = stack.enter_context(kit.Pool(run.workers, owner=self.owner, timeout=run.timeout))
            self.pool.start([self._spec(w) for w in range(run.workers)], _worker)
            self._say("starting workers, first pass over the hot set")
            self.pool.meet(f"{self.label}: warm-up (first pass)")
            if self.owner is not None:
                self._say("waiting for the owner to admit the hot set")
                if not kit.wait_until(lambda: self.owner.snapshot()["entries"] >= run.hot, run.timeout, 0.05):
                    self.pool.abort()
                    raise BenchmarkFailed(f"{self.label}: the owner did not admit the hot set")
            self.pool.meet(f"{self.label}: warm-up (owner admitted)")
            out = {window: self._window(window) for window in WINDOWS}
            self._say("closing")
            self.pool.collect()
            for p in self.pool.procs:
                if p.exitcode != 0:
                    raise BenchmarkFailed(f"{self.label}: worker exited with {p.exitcode}")
            return out

    def _sample(self) -> dict[str, dict[str, float]]:
        """CPU so far and memory of every worker and the owner, by process."""
        import psutil

        procs = [(f"worker{k}", p.pid) for k, p in enumerate(self.pool.procs)]
        procs += [("owner", self.owner.pid)] if self.owner is not None else []
        out: dict[str, dict[str, float]] = {"pss": {}, "uss": {}, "rss": {}, "cpu": {}}
        for name, pid in procs:
            try:
                out["cpu"][name] = _process_cpu_s(pid)
                info = psutil.Process(pid).memory_full_info()
            except psutil.Error as exc:
                self.pool.abort()
                raise BenchmarkFailed(f"{self.label}: cannot sample {name}: {exc}") from None
            out["pss"][name], out["uss"][name], out["rss"][name] = info.pss, info.uss, info.rss
        return out

    def _window(self, window: str) -> dict[str, Any]:
        run, pool, owner = self.run, self.pool, self.owner
        if window == "hot":
            self._say("hot window, workers checking that every hot read hits")
        else:
            self._say("cold window, workers at the start barrier")
        pool.meet(f"{self.label}: {window} start")
        owner0 = _process_cpu_s(owner.pid) if owner is not None else 0.0
        t0 = time.perf_counter()
        self._say(f"{window} window, measuring {run.workers} x {run.reads:,} reads")
        pool.meet(f"{self.label}: {window} end")
        wall = time.perf_counter() - t0
        owner_cpu = _process_cpu_s(owner.pid) - owner0 if owner is not None else 0.0
        # The workers wait at the release barrier: every manager, client and
        # mapping is attached while memory is sampled.
        sampled = self._sample()
        owner_snapshot = owner.snapshot() if owner is not None else None
        pool.meet(f"{self.label}: {window} release")
        stat = _window_stat(pool.collect("window"), sampled, owner_cpu, owner_snapshot)
        return {"repetition": self.rep, "path": self.path, "mode": self.mode, "window": window, "wall_s": wall, **stat}


#: The owner's counters a window reports.
OWNER_KEYS = (
    "entries", "used_bytes", "evictions", "admissions_accepted", "admissions_rejected", "admissions_dropped",
    "attached_workers", "owner_uptime_s",
)  # fmt: skip


def _window_stat(
    workers: list[dict[str, Any]], sampled: dict[str, dict[str, float]], owner_cpu: float, owner_snapshot: Any
) -> dict[str, Any]:
    """A window's figures from the workers' results and the parent's samples."""
    samples = [s for w in workers for s in w["samples_ns"]]
    workers_cpu = sum(w["cpu_s"] for w in workers)
    verify_cpu = sum(w["verify_cpu_s"] for w in workers)
    pss, cumulative = sampled["pss"], sampled["cpu"]
    stat: dict[str, Any] = {
        "latency": summarize(samples),
        "reads": len(samples),
        **{key: sum(w[key] for w in workers) for key in ("hits", "misses", "bypasses", "mismatches")},
        "warm_passes_max": max(w["warm_passes"] for w in workers),
        "misses_before_window": sum(w.get("misses_before", 0) for w in workers),
        "cpu_window_s": workers_cpu + owner_cpu,
        "cpu_window_workers_s": workers_cpu,
        "cpu_window_owner_s": owner_cpu,
        "verify_cpu_s": verify_cpu,
        "cpu_reads_s": workers_cpu + owner_cpu - verify_cpu,
        "cpu_total_s": sum(cumulative.values()),
        "cpu_total_owner_s": cumulative.get("owner", 0.0),
        "pss_workers_mib": sum(v for k, v in pss.items() if k != "owner") / MiB,
        "pss_owner_mib": pss.get("owner", 0) / MiB,
        **{f"{kind}_mib": sum(sampled[kind].values()) / MiB for kind in ("pss", "uss", "rss")},
        "streams": (
            owner_snapshot["active_streams"] if owner_snapshot is not None else sum(w["streams"] for w in workers)
        ),
    }
    reasons = sum((collections.Counter(w.get("bypass_reasons", {})) for w in workers), collections.Counter())
    if reasons:
        stat["bypass_reasons"] = dict(reasons)
    if owner_snapshot is not None:
        stat["owner"] = {k: owner_snapshot[k] for k in OWNER_KEYS if k in owner_snapshot}
    stat["_samples_ns"] = samples  # for the figure; not written to the report
    return stat


# -- statistics -----------------------------------------------------------------

#: Window statistics whose median across repetitions the report gives (the
#: latency quantiles by their own names).
MEDIAN_KEYS = (
    "p50_us", "p95_us", "p99_us", "mean_us", "reads", "hits", "misses", "misses_before_window", "bypasses", "wall_s",
    "cpu_window_s", "cpu_window_workers_s", "cpu_window_owner_s", "verify_cpu_s", "cpu_reads_s", "cpu_total_s",
    "cpu_total_net_s", "cpu_total_owner_s", "pss_mib", "pss_workers_mib", "pss_owner_mib", "uss_mib", "rss_mib",
    "streams",
)  # fmt: skip

#: The summary: ratios of medians, the shared path's over another path's
#: (name, other path, window, median).
RATIOS = (
    ("shared_over_direct_hot_p50", "direct", "hot", "p50_us"),
    ("shared_over_independent_hot_p50", "independent", "hot", "p50_us"),
    ("pss_shared_over_independent_hot", "independent", "hot", "pss_mib"),
    ("cpu_shared_over_independent_total", "independent", "hot", "cpu_total_net_s"),
    ("shared_over_direct_cold_p50", "direct", "cold", "p50_us"),
    ("shared_over_independent_cold_p50", "independent", "cold", "p50_us"),
    ("shared_over_direct_hot_p99", "direct", "hot", "p99_us"),
    ("shared_over_independent_hot_p99", "independent", "hot", "p99_us"),
    ("cpu_shared_over_independent_hot_reads", "independent", "hot", "cpu_reads_s"),
    ("cpu_shared_over_independent_total_cold", "independent", "cold", "cpu_total_net_s"),
    ("pss_shared_over_independent_cold", "independent", "cold", "pss_mib"),
)


def _medians(windows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Per path, mode and window: the median across repetitions of each ``MEDIAN_KEYS`` statistic."""

    def medians(path: str, mode: str, window: str) -> dict[str, float]:
        group = [{**w, **w["latency"]} for w in windows if (w["path"], w["mode"], w["window"]) == (path, mode, window)]
        return {key: statistics.median(float(w[key]) for w in group) for key in MEDIAN_KEYS}

    return {path: {mode: {w: medians(path, mode, w) for w in WINDOWS} for mode in MODES} for path in PATHS}


def _summary(med: dict[str, Any]) -> dict[str, dict[str, float]]:
    def ratio(mode: str, other: str, window: str, key: str) -> float:
        shared, below = med["shared"][mode][window][key], med[other][mode][window][key]
        return shared / below if below else float("nan")

    return {mode: {name: ratio(mode, *of) for name, *of in RATIOS} for mode in MODES}


def _costs(med: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Beside each latency ratio, the shared path's latency minus the other
    path's, in microseconds (``shared_over_direct_cold_p50`` gives
    ``shared_minus_direct_cold_p50_us``: what a shared miss adds to a read).
    A slow server makes every "over direct" ratio look small; the difference
    does not depend on it."""
    return {
        mode: {
            name.replace("_over_", "_minus_") + "_us": med["shared"][mode][window][key] - med[other][mode][window][key]
            for name, other, window, key in RATIOS
            if key.endswith("_us")
        }
        for mode in MODES
    }


def _checks(windows: list[dict[str, Any]], workers: int) -> list[str]:
    """What makes a window's figures meaningless (verification is checked
    separately and is fatal)."""
    problems = []
    for w in windows:
        where = f"repetition {w['repetition']} {w['path']} {w['mode']} {w['window']}"
        if w["path"] != "direct" and w["window"] == "hot" and w["hits"] != w["reads"]:
            problems.append(f"{where}: {w['hits']} hits for {w['reads']} hot reads")
        if w["window"] == "cold" and w["hits"] != 0:
            problems.append(f"{where}: {w['hits']} hits in a cold window")
        if w["bypasses"]:
            problems.append(f"{where}: {w['bypasses']} bypasses {w.get('bypass_reasons', {})}")
        expected_streams = {"direct": 0, "independent": workers, "shared": 1}[w["path"]]
        if w["streams"] != expected_streams:
            problems.append(f"{where}: {w['streams']} active streams, expected {expected_streams}")
    return problems


# -- output -----------------------------------------------------------------------

#: The printed table's medians: (title, format spec, median).
FIGURES = (
    ("p50 us", ">9.1f", "p50_us"),
    ("p95 us", ">9.1f", "p95_us"),
    ("p99 us", ">9.1f", "p99_us"),
    ("hits", ">7.0f", "hits"),
    ("reads", ">7.0f", "reads"),
    ("CPU s", ">7.2f", "cpu_reads_s"),
    ("CPU tot", ">8.2f", "cpu_total_net_s"),
    ("PSS MiB", ">8.1f", "pss_mib"),
    ("streams", ">7.0f", "streams"),
)


def _print_table(report: dict[str, Any]) -> None:
    cfg, med = report["config"], report["medians"]
    print(
        f"public shared cache: {cfg['workers']} workers, {cfg['hot']:,} hot identities of "
        f"~{cfg['document_bytes_mean']:.0f} B, {cfg['reads']:,} reads per worker per window, "
        f"{cfg['repetitions']} repetition(s); medians across repetitions"
    )
    columns = [("path", "<12"), ("window", "<6"), ("mode", "<5"), *((title, spec) for title, spec, _ in FIGURES)]
    rows = [(p, w, m, *(med[p][m][w][key] for *_, key in FIGURES)) for p in PATHS for w in WINDOWS for m in MODES]
    kit.table(columns, rows)
    print(
        "CPU s: workers + owner during the measured reads (verification excluded); "
        "CPU tot: cumulative from process start (warm-up, owner start-up) to the window's end; "
        "PSS: workers + owner"
    )
    print("summary (ratios of the medians):")
    for mode in MODES:
        print(f"  {mode}:")
        for name, *_ in RATIOS:
            cost = report["costs_us"][mode].get(name.replace("_over_", "_minus_") + "_us")
            extra = "" if cost is None else f"  (shared minus the other: {cost:+.1f} us)"
            print(f"    {name:<40} {report['summary'][mode][name]:.3f}{extra}")


#: What a full run is held to (README's figures; docs/benchmarks.md, "Targets").
TARGETS = tuple(
    kit.Target(f"summary.{mode}.{figure}", op, bound)
    for mode in MODES
    for figure, op, bound in (
        ("shared_over_direct_hot_p50", "<=", 0.05),
        ("shared_over_independent_hot_p50", "<=", 1.1),
        ("pss_shared_over_independent_hot", "<=", 0.8),
    )
)


def _plot(path: str, windows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"direct": "tab:red", "independent": "tab:blue", "shared": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex="col", sharey=True)
    for (row, mode), (col, window) in itertools.product(enumerate(MODES), enumerate(WINDOWS)):
        ax = axes[row][col]
        for p in PATHS:
            group = [w for w in windows if (w["path"], w["mode"], w["window"]) == (p, mode, window)]
            samples = sorted(s / 1000.0 for w in group for s in w["_samples_ns"])
            if not samples:
                continue
            med = report["medians"][p][mode][window]
            label = f"{p} (p50 {med['p50_us']:.0f} us, p99 {med['p99_us']:.0f} us)"
            ecdf = [(k + 1) / len(samples) for k in range(len(samples))]
            ax.step(samples, ecdf, where="post", color=colors[p], label=label)
        ax.set_xscale("log")
        ax.set_title(f"{mode}, {window} window")
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
        ax.legend(loc="lower right", fontsize=8)
        if row == 1:
            ax.set_xlabel("find_one latency (us, log scale)")
        if col == 0:
            ax.set_ylabel("fraction of reads (ECDF)")
    cfg = report["config"]
    fig.suptitle(
        f"find_one by _id, {cfg['workers']} workers, {cfg['reads']:,} reads/worker/window, "
        f"{cfg['repetitions']} repetition(s) pooled; medians of window p50/p99 in the legends",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


METHOD = {
    "paths": "direct: Collection.with_options(read_concern=ReadConcern('majority')).find_one at the primary; "
    "independent: a process-local CacheManager/AsyncCacheManager per worker (default 64 MiB budget); "
    "shared: one owner started with SharedCache.start(arena_bytes=40 MiB, budget_bytes=32 MiB, slots=16384) "
    "and CacheManager/AsyncCacheManager(client, shared=name) in each worker",
    "processes": "a phase (path x mode) spawns fresh workers (multiprocessing spawn context) and, for shared, "
    "a fresh owner; it runs the hot window, then the cold window in the same processes. Each repetition "
    "rotates the order of the three paths (and alternates sync/async first).",
    "warm_up": "cached paths: each worker registers the collection, waits for its change stream, reads the "
    "whole hot set once in a random order of its own (the workers do not split the hot set between them: "
    "in the shared path some of these reads hit what another worker's miss admitted), then - after the "
    "parent saw the owner's entries reach the hot set (shared) - repeats whole passes over the hot set "
    "until a pass is all hits; direct: a few reads open the connections. All outside the measured window.",
    "windows": "hot: after a start barrier, each worker reads random hot identities (seeded; the same sequence "
    "for the three paths); cold: each worker reads identities outside the hot set that no process read "
    "before (a distinct seeded block per repetition, path, mode and worker). Reads are sequential in "
    "each worker; async workers await each read.",
    "timer": "time.perf_counter_ns immediately around each find_one (await included)",
    "quantiles": "nearest rank over all workers' samples of a window: index ceil(p/100*n)-1 of the sorted "
    "samples; medians across repetitions are statistics.median of each window statistic",
    "verification": "every measured read, after its stop timestamp: the result re-encoded with the "
    "collection's codec options must equal the inserted BSON (compared by BLAKE2b-128 digest); at setup "
    "every inserted document's BSON was checked to decode with those codec options and re-encode unchanged, "
    "so this is the comparison with the inserted document as the collection decodes it. Digests rather "
    "than decoded documents are kept so the workers' memory is not inflated by ~14 KiB of Python objects "
    "per expected document. A mismatch fails the run.",
    "hits": "difference of each worker's manager snapshot (hits, misses, bypasses) across the window, summed",
    "cpu_window": "user+system CPU of all threads of each worker, read by the worker itself "
    "(time.process_time_ns) right after the start barrier and right after its last read, plus the owner's, "
    "read by the parent right after the start barrier and right after the end barrier (the owner's "
    "process CPU-time clock, clock_gettime on ((~pid) << 3) | 2: the figure psutil's cpu_times gives, at "
    "nanosecond instead of 10 ms resolution). cpu_reads_s subtracts the workers' verification CPU (thread "
    "CPU time around each check); cpu_window_s keeps it.",
    "cpu_total": "cumulative user+system CPU of the workers and the owner from their start (interpreter start "
    "and imports, connections, warm-up, owner start-up, the earlier window) to the window's end, read by the "
    "parent from the same process CPU clocks while the workers wait at the barrier; cpu_total_net_s "
    "subtracts the verification CPU of the measured windows so far. The summary's cpu ratio uses "
    "cpu_total_net_s of the hot window.",
    "memory": "PSS (psutil memory_full_info) of every worker and the owner, summed, sampled by the parent after "
    "the window while the workers wait at a barrier with their clients, managers and arena mappings attached",
    "streams": "active change streams: independent, the streams of each worker's snapshot that are neither "
    "closed nor not started, summed; shared, the owner's active_streams; direct, none",
    "excluded": "the database server and the harness parent are in no CPU or memory figure",
}


def _phases(run: _Run) -> list[dict[str, Any]]:
    """Every phase's two windows (a wrong document fails the run)."""
    windows: list[dict[str, Any]] = []
    for n, (rep, path, mode) in enumerate(run.phases, 1):
        label = f"repetition {rep + 1}/{run.repetitions}, phase {n}/{len(run.phases)} {path} {mode}"
        started = time.perf_counter()
        out = _Phase(run, rep, path, mode, label).measure()
        verify_so_far = 0.0  # of the measured windows so far, out of the totals
        for window in WINDOWS:
            stat = out[window]
            if stat["mismatches"]:
                raise RuntimeError(f"{label} {window}: {stat['mismatches']} reads returned a wrong document")
            verify_so_far += stat["verify_cpu_s"]
            stat.update(phase=n, cpu_total_net_s=stat["cpu_total_s"] - verify_so_far)
            windows.append(stat)
        h, c = out["hot"], out["cold"]
        run.status(
            f"{label}: hot p50 {h['latency']['p50_us']:.1f} us ({h['hits']}/{h['reads']} hits), "
            f"cold p50 {c['latency']['p50_us']:.1f} us ({c['hits']} hits), {time.perf_counter() - started:.1f}s"
        )
    return windows


def _run(args: argparse.Namespace, uri: str, status: Status) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    db_name = f"cqc_bench_public_{int(time.time())}_{random.Random(args.seed).randint(0, 10**6)}"
    run = _Run(args, uri, db_name, status)
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    try:
        setup_started = time.perf_counter()
        run.digests, sizes = _insert_documents(client[db_name][COLLECTION], run)
        setup_s = time.perf_counter() - setup_started
        status(f"setup: {run.hot:,} hot + {run.cold_total:,} cold documents inserted in {setup_s:.1f}s")
        windows = _phases(run)
    finally:
        status("dropping the benchmark database")
        with contextlib.suppress(Exception):
            client.drop_database(db_name)
        client.close()

    from client_query_cache import __version__ as cqc_version

    medians = _medians(windows)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "method": METHOD,
        "config": {
            "workers": run.workers, "repetitions": run.repetitions, "reads": run.reads, "hot": run.hot,
            "cold_identities": run.cold_total, "seed": run.seed,
            "phases": [{"repetition": r, "path": p, "mode": m} for r, p, m in run.phases],
            "owner": dict(kit.OWNER_GEOMETRY), "independent_budget_bytes": 64 * MiB,
            "read_concern_direct": "majority", "external_deployment": kit.external(), "setup_seconds": setup_s,
            "client_query_cache": cqc_version, "checkout": kit.checkout(), **sizes,
        },  # fmt: skip
        "machine": {**kit.machine_facts(), "loadavg_at_start": list(os.getloadavg())},
        "windows": [{k: v for k, v in w.items() if not k.startswith("_")} for w in windows],
        "medians": medians,
        "summary": _summary(medians),
        "costs_us": _costs(medians),
    }
    return report, windows


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = kit.parser("public_shared_cache", __doc__, json_flag="--output", seed=20261015)
    add = parser.add_argument
    add("--quick", action="store_true", help="1 repetition, 256 hot identities, 200 reads per window")
    add("--workers", type=int, default=4, help="worker processes (default 4)")
    add("--repetitions", type=int, default=None, help="default 3 (quick: 1)")
    add("--reads", type=int, default=None, help="measured reads per worker per window (default 2000, quick 200)")
    add("--hot", type=int, default=None, help="hot identities (default 4096, quick 256)")
    add("--png", metavar="PATH", help="latency figure (default: next to --output, .png)")
    add("--no-png", action="store_true", help="write no figure")
    add("--timeout", type=float, default=900.0, help="seconds any one wait may take before the run fails (default 900)")
    args = parser.parse_args(argv)
    kit.defaults(args, QUICK if args.quick else FULL)
    kit.at_least_one(parser, args, ("workers", "repetitions", "reads", "hot"))
    if args.hot >= COLD_ID_BASE:
        parser.error(f"--hot must be below {COLD_ID_BASE}")
    if args.png and args.no_png:
        parser.error("--png and --no-png exclude each other")
    if args.no_png:
        args.png = None
    elif args.png is None and args.output:
        args.png = str(Path(args.output).with_suffix(".png"))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    # Checked before the long run, not after it.
    needed = [("psutil", "psutil is needed (pip install psutil, or the package's test extra)")]
    if args.png:
        needed.append(("matplotlib", MATPLOTLIB_HINT))
    for module, hint in needed:
        try:
            importlib.import_module(module)
        except ImportError:
            print(f"error: {hint}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    status = Status()
    got = kit.with_server(lambda uri: _run(args, uri, status), status)
    if got is None:
        return 1
    report, windows = got
    report["elapsed_seconds"] = time.perf_counter() - started
    problems = _checks(windows, args.workers)
    headline = "CHECKS FAILED (the figures above are not what this benchmark means to measure):"
    code = kit.conclude(
        report, problems, _print_table, args.output, headline=headline, targets=TARGETS, quick=args.quick
    )
    if args.png:
        _plot(args.png, windows, report)
        print(f"wrote {args.png}")
    print(f"elapsed {report['elapsed_seconds']:.0f}s")
    return code


if __name__ == "__main__":
    sys.exit(main())
