"""Public-API shared-cache benchmark: direct reads, independent caches, one shared cache.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.public_shared_cache`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import importlib
import multiprocessing
import os
import queue as queue_mod
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bson
import pymongo
from bson.raw_bson import RawBSONDocument
from pymongo.read_concern import ReadConcern

from ._common import exit_code, machine_facts, make_document, progress, summarize, write_json

SCHEMA = "client-query-cache/public-shared-cache/1"

PATHS = ("direct", "independent", "shared")
MODES = ("sync", "async")
WINDOWS = ("hot", "cold")

MiB = 1024 * 1024
#: The owner's geometry (the deployment guide's example, DESIGN.md's benchmark).
OWNER_ARENA_BYTES = 40 * MiB
OWNER_BUDGET_BYTES = 32 * MiB
OWNER_SLOTS = 16384

COLLECTION = "docs"
#: Cold identities start here, far above any hot identity.
COLD_ID_BASE = 10_000_000
#: insert_many batch size during setup.
INSERT_BATCH = 1000
#: Direct-path warm-up: reads per worker that open its connections.
DIRECT_WARM_READS = 64
#: A cached worker gives up warming after this many passes over the hot set.
MAX_WARM_PASSES = 50

DIGEST_BYTES = 16

MATPLOTLIB_HINT = (
    "matplotlib is needed to write the PNG: install it (pip install 'matplotlib==3.11.2') "
    "or pass --no-png"
)


def _digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def _active_streams(snapshot: Any) -> int:
    """Streams of a process-local manager that are open (the owner counts
    its own the same way: every state but closed and not started)."""
    return sum(1 for s in snapshot.streams if s.state.value not in ("closed", "not_started"))


def _cpu_seconds(times: Any) -> float:
    return float(times.user + times.system)


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

        return _cpu_seconds(psutil.Process(pid).cpu_times())


# ============================================================================
# Worker processes
# ============================================================================
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
#
# Any failure puts ("error", index, traceback) on the queue and aborts the
# barrier, so the parent fails at once instead of waiting for a timeout.


class _WorkerFailure(RuntimeError):
    pass


def _verify(got: Any, want: bytes, codec: Any) -> bool:
    """The result, re-encoded with the collection's codec options, is the
    inserted BSON (same fields, order, types and values)."""
    if got is None:
        return False
    return _digest(bson.encode(got, codec_options=codec)) == want


def _window_ids(spec: dict[str, Any], window: str) -> tuple[list[int], list[bytes]]:
    if window == "hot":
        ids = spec["hot_order"]
        hot_digests = spec["hot_digests"]
        return ids, [hot_digests[i] for i in ids]
    return spec["cold_ids"], spec["cold_digests"]


def _window_result(
    spec: dict[str, Any],
    window: str,
    samples: list[int],
    mismatches: int,
    verify_ns: int,
    cpu0: int,
    cpu1: int,
    before: Any,
    after: Any,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "samples_ns": samples,
        "mismatches": mismatches,
        "verify_cpu_s": verify_ns / 1e9,
        "cpu_s": (cpu1 - cpu0) / 1e9,
        "hits": 0,
        "misses": 0,
        "bypasses": 0,
        "streams": 0,
    }
    if before is not None and after is not None:
        result["hits"] = after.hits - before.hits
        result["misses"] = after.misses - before.misses
        result["bypasses"] = after.bypass_total - before.bypass_total
        result["bypass_reasons"] = {
            k: v - before.bypasses.get(k, 0) for k, v in after.bypasses.items() if v != before.bypasses.get(k, 0)
        }
        result["streams"] = _active_streams(after) if spec["path"] == "independent" else 0
        result["misses_before"] = before.misses  # warm-up (and earlier windows)
    return result


def _sync_worker(spec: dict[str, Any], barrier: Any, results: Any) -> None:
    from client_query_cache import CacheManager

    timeout = spec["timeout"]
    db, index = spec["db"], spec["index"]
    cpu_clock = time.process_time_ns  # all threads of this process, user + system
    clock = time.perf_counter_ns
    tclock = time.thread_time_ns
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(spec["uri"])
    manager: CacheManager | None = None
    try:
        coll = client[db][COLLECTION]
        codec = coll.codec_options
        if spec["path"] == "direct":
            reader: Any = coll.with_options(read_concern=ReadConcern("majority"))
        else:
            manager = (
                CacheManager(client, shared=spec["shared_name"])
                if spec["path"] == "shared"
                else CacheManager(client)
            )
            reader = manager[db][COLLECTION]
        hot_ids = list(range(spec["hot"]))
        rng = random.Random(spec["warm_seed"])

        # -- warm-up, step A ------------------------------------------------
        if manager is None:
            for i in hot_ids[:DIRECT_WARM_READS]:
                reader.find_one({"_id": i})
        else:
            reader.find_one({"_id": hot_ids[0]})  # registers the namespace, starts its stream
            if not manager.wait_ready(timeout, database=db):
                raise _WorkerFailure("the change stream did not become ready")
            # Every worker reads the whole hot set, in an order of its own, as
            # independent application processes would: nothing splits the
            # work between the workers of the shared path.
            first = hot_ids[:]
            rng.shuffle(first)
            for i in first:
                reader.find_one({"_id": i})
        barrier.wait(timeout)
        barrier.wait(timeout)  # B: the owner admitted the hot set (shared)

        # -- warm-up, step C: until a whole pass over the hot set hits --------
        warm_passes = 0
        if manager is not None:
            while True:
                warm_passes += 1
                order = hot_ids[:]
                rng.shuffle(order)
                h0 = manager.snapshot().hits
                for i in order:
                    reader.find_one({"_id": i})
                if manager.snapshot().hits - h0 == len(order):
                    break
                if warm_passes >= MAX_WARM_PASSES:
                    raise _WorkerFailure(f"hot set still missing after {warm_passes} warm-up passes")
                time.sleep(0.05)

        for window in WINDOWS:
            ids, want = _window_ids(spec, window)
            filters = [{"_id": i} for i in ids]
            samples = [0] * len(ids)
            mismatches = 0
            verify_ns = 0
            before = manager.snapshot() if manager is not None else None
            gc.collect()
            barrier.wait(timeout)  # start
            cpu0 = cpu_clock()
            for k, filt in enumerate(filters):
                t0 = clock()
                got = reader.find_one(filt)
                t1 = clock()
                samples[k] = t1 - t0
                v0 = tclock()
                if not _verify(got, want[k], codec):
                    mismatches += 1
                verify_ns += tclock() - v0
                del got
            cpu1 = cpu_clock()
            after = manager.snapshot() if manager is not None else None
            barrier.wait(timeout)  # end: the parent samples memory and CPU
            barrier.wait(timeout)  # release
            result = _window_result(spec, window, samples, mismatches, verify_ns, cpu0, cpu1, before, after)
            result["warm_passes"] = warm_passes
            results.put(("window", index, window, result))
    finally:
        if manager is not None:
            manager.close()
        client.close()


async def _async_worker(spec: dict[str, Any], barrier: Any, results: Any) -> None:
    from client_query_cache import AsyncCacheManager

    timeout = spec["timeout"]
    db, index = spec["db"], spec["index"]
    cpu_clock = time.process_time_ns  # all threads of this process, user + system
    clock = time.perf_counter_ns
    tclock = time.thread_time_ns

    async def meet() -> None:
        # In a thread: the event loop (PyMongo's monitors) keeps running.
        await asyncio.to_thread(barrier.wait, timeout)

    client: pymongo.AsyncMongoClient[Any] = pymongo.AsyncMongoClient(spec["uri"])
    manager: AsyncCacheManager | None = None
    try:
        coll = client[db][COLLECTION]
        codec = coll.codec_options
        if spec["path"] == "direct":
            reader: Any = coll.with_options(read_concern=ReadConcern("majority"))
        else:
            manager = (
                AsyncCacheManager(client, shared=spec["shared_name"])
                if spec["path"] == "shared"
                else AsyncCacheManager(client)
            )
            reader = manager[db][COLLECTION]
        hot_ids = list(range(spec["hot"]))
        rng = random.Random(spec["warm_seed"])

        if manager is None:
            for i in hot_ids[:DIRECT_WARM_READS]:
                await reader.find_one({"_id": i})
        else:
            await reader.find_one({"_id": hot_ids[0]})
            if not await manager.wait_ready(timeout, database=db):
                raise _WorkerFailure("the change stream did not become ready")
            # Every worker reads the whole hot set, in an order of its own, as
            # independent application processes would: nothing splits the
            # work between the workers of the shared path.
            first = hot_ids[:]
            rng.shuffle(first)
            for i in first:
                await reader.find_one({"_id": i})
        await meet()
        await meet()

        warm_passes = 0
        if manager is not None:
            while True:
                warm_passes += 1
                order = hot_ids[:]
                rng.shuffle(order)
                h0 = manager.snapshot().hits
                for i in order:
                    await reader.find_one({"_id": i})
                if manager.snapshot().hits - h0 == len(order):
                    break
                if warm_passes >= MAX_WARM_PASSES:
                    raise _WorkerFailure(f"hot set still missing after {warm_passes} warm-up passes")
                await asyncio.sleep(0.05)

        for window in WINDOWS:
            ids, want = _window_ids(spec, window)
            filters = [{"_id": i} for i in ids]
            samples = [0] * len(ids)
            mismatches = 0
            verify_ns = 0
            before = manager.snapshot() if manager is not None else None
            gc.collect()
            await meet()  # start
            cpu0 = cpu_clock()
            for k, filt in enumerate(filters):
                t0 = clock()
                got = await reader.find_one(filt)
                t1 = clock()
                samples[k] = t1 - t0
                v0 = tclock()
                if not _verify(got, want[k], codec):
                    mismatches += 1
                verify_ns += tclock() - v0
                del got
            cpu1 = cpu_clock()
            after = manager.snapshot() if manager is not None else None
            await meet()  # end
            await meet()  # release
            result = _window_result(spec, window, samples, mismatches, verify_ns, cpu0, cpu1, before, after)
            result["warm_passes"] = warm_passes
            results.put(("window", index, window, result))
    finally:
        if manager is not None:
            await manager.close()
        await client.close()


def _worker_main(spec: dict[str, Any], barrier: Any, results: Any) -> None:
    """Entry point of a spawned worker."""
    try:
        if spec["mode"] == "sync":
            _sync_worker(spec, barrier, results)
        else:
            asyncio.run(_async_worker(spec, barrier, results))
        results.put(("done", spec["index"], None, None))
    except BaseException:
        results.put(("error", spec["index"], None, traceback.format_exc()))
        with contextlib.suppress(Exception):
            barrier.abort()
        raise SystemExit(1) from None


# ============================================================================
# Progress on stderr
# ============================================================================


class _Progress:
    """One status line on stderr. On a terminal it is redrawn every half
    second with the elapsed time; otherwise each new status is a line, and a
    long wait prints the status again every 30 seconds."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._lock = threading.Lock()
        self._status = ""
        self._since = time.monotonic()
        self._start = time.monotonic()
        self._last_print = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def _line(self) -> str:
        now = time.monotonic()
        return f"[{now - self._start:7.1f}s] {self._status} ({now - self._since:.0f}s)"

    def _draw(self) -> None:
        if self._tty:
            # One row, or the next redraw cannot erase it.
            width = max(20, shutil.get_terminal_size().columns - 1)
            sys.stderr.write("\r\x1b[2K" + self._line()[:width])
            sys.stderr.flush()
        else:
            progress(self._line())
        self._last_print = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if self._status and (self._tty or time.monotonic() - self._last_print >= 30):
                    self._draw()

    def set(self, status: str) -> None:
        with self._lock:
            self._status = status
            self._since = time.monotonic()
            self._draw()

    def note(self, message: str) -> None:
        """A permanent line (a finished step)."""
        with self._lock:
            if self._tty:
                sys.stderr.write("\r\x1b[2K")
            progress(f"[{time.monotonic() - self._start:7.1f}s] {message}")
            if self._tty and self._status:
                self._draw()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            if self._tty:
                sys.stderr.write("\r\x1b[2K")
                sys.stderr.flush()


# ============================================================================
# The parent: setup, phases, statistics
# ============================================================================


class _Plan:
    """What every phase reads: hot order and cold identities per worker."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.workers = args.workers
        self.reads = args.reads
        self.hot = args.hot
        self.repetitions = args.repetitions
        self.seed = args.seed
        self.phases: list[tuple[int, str, str]] = []
        for rep in range(args.repetitions):
            paths = PATHS[rep % 3 :] + PATHS[: rep % 3]
            modes = MODES if rep % 2 == 0 else MODES[::-1]
            for path in paths:
                for mode in modes:
                    self.phases.append((rep, path, mode))
        # Cold identities: a distinct block per (phase, worker), read in a
        # seeded random order; nobody reads any of them before its window.
        self.cold: dict[tuple[int, str, str, int], list[int]] = {}
        next_id = COLD_ID_BASE
        for phase in self.phases:
            for w in range(self.workers):
                ids = list(range(next_id, next_id + self.reads))
                next_id += self.reads
                random.Random(f"{self.seed}/cold/{phase}/{w}").shuffle(ids)
                self.cold[(*phase, w)] = ids
        self.cold_total = next_id - COLD_ID_BASE

    def hot_order(self, rep: int, mode: str, worker: int) -> list[int]:
        """The measured hot reads: the same sequence for the three paths of a
        repetition and mode, so the paths read the same identities."""
        rng = random.Random(f"{self.seed}/hot/{rep}/{mode}/{worker}")
        return [rng.randrange(self.hot) for _ in range(self.reads)]


def _insert_documents(
    coll: Any, plan: _Plan, seed: int, status: _Progress
) -> tuple[list[bytes], dict[int, bytes], dict[str, Any]]:
    """Insert the hot identities (0..hot-1) and every cold identity; return
    the digests of their BSON and size statistics. Each document's BSON is
    checked to survive decoding with the collection's codec options and
    encoding again unchanged, so a read's re-encoded result can be compared
    with the inserted bytes."""
    rng = random.Random(seed)
    codec = coll.codec_options
    ids = list(range(plan.hot)) + list(range(COLD_ID_BASE, COLD_ID_BASE + plan.cold_total))
    hot_digests: list[bytes] = []
    cold_digests: dict[int, bytes] = {}
    sizes_sum = 0
    size_min, size_max = 1 << 30, 0
    total = len(ids)
    for start in range(0, total, INSERT_BATCH):
        status.set(f"setup: inserting documents {start:,}/{total:,}")
        batch = []
        for i in ids[start : start + INSERT_BATCH]:
            raw = bson.encode(make_document(i, rng))
            if bson.encode(bson.decode(raw, codec), codec_options=codec) != raw:
                raise RuntimeError(f"document {i} does not survive a decode/encode round trip")
            d = _digest(raw)
            if i < COLD_ID_BASE:
                hot_digests.append(d)
            else:
                cold_digests[i] = d
            sizes_sum += len(raw)
            size_min, size_max = min(size_min, len(raw)), max(size_max, len(raw))
            batch.append(RawBSONDocument(raw))
        coll.insert_many(batch, ordered=False)
    sizes = {"document_bytes_mean": sizes_sum / total, "document_bytes_min": size_min, "document_bytes_max": size_max}
    return hot_digests, cold_digests, sizes


class _PhaseFailed(RuntimeError):
    pass


class _Phase:
    """One path and mode: an owner (shared), spawned workers, two windows."""

    def __init__(
        self,
        ctx: Any,
        uri: str,
        db: str,
        plan: _Plan,
        rep: int,
        path: str,
        mode: str,
        hot_digests: list[bytes],
        cold_digests: dict[int, bytes],
        timeout: float,
        status: _Progress,
        label: str,
    ) -> None:
        self.ctx, self.uri, self.db, self.plan = ctx, uri, db, plan
        self.rep, self.path, self.mode = rep, path, mode
        self.hot_digests, self.cold_digests = hot_digests, cold_digests
        self.timeout = timeout
        self.status = status
        self.label = label
        self.owner: Any = None
        self.procs: list[Any] = []
        self.barrier: Any = None
        self.results: Any = None
        self._watch_stop = threading.Event()
        self.done = 0

    # -- helpers --------------------------------------------------------------

    def _errors(self, wait: float = 2.0) -> str:
        """Why the phase broke: dead processes first, then the workers'
        tracebacks (a worker that only saw the barrier break is one line)."""
        failures, broken = [], []
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                kind, index, _, payload = self.results.get(timeout=0.2)
            except queue_mod.Empty:
                if failures or broken:
                    break
                continue
            except (OSError, ValueError, EOFError):
                break
            if kind == "error":
                if payload.rstrip().endswith("BrokenBarrierError"):
                    broken.append(index)
                else:
                    failures.append(f"worker {index}:\n{payload}")
        lines = [
            f"worker {k} exited with code {p.exitcode}"
            for k, p in enumerate(self.procs)
            if p.exitcode not in (None, 0)
        ]
        if self.owner is not None and not self._owner_alive():
            lines.append("the owner process is gone")
        lines += failures
        if broken:
            lines.append(f"workers {sorted(broken)} stopped at the broken barrier")
        return "\n".join(lines) or f"no worker reported an error (a wait longer than --timeout {self.timeout:g}s?)"

    def _meet(self, what: str) -> None:
        try:
            self.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise _PhaseFailed(f"{self.label}: barrier broken at {what}:\n{self._errors()}") from None

    def _watch(self) -> None:
        """Abort the barrier as soon as a worker or the owner dies, so the
        parent fails now rather than at the barrier's timeout."""
        while not self._watch_stop.wait(0.5):
            dead = any(p.exitcode not in (None, 0) for p in self.procs)
            if dead or (self.owner is not None and not self._owner_alive()):
                with contextlib.suppress(Exception):
                    self.barrier.abort()
                return

    def _owner_alive(self) -> bool:
        import psutil

        try:
            return psutil.Process(self.owner.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _processes(self) -> list[tuple[str, Any]]:
        import psutil

        procs = [(f"worker{k}", psutil.Process(p.pid)) for k, p in enumerate(self.procs)]
        if self.owner is not None:
            procs.append(("owner", psutil.Process(self.owner.pid)))
        return procs

    # -- the phase ------------------------------------------------------------

    def run(self) -> dict[str, dict[str, Any]]:
        from client_query_cache import SharedCache

        plan = self.plan
        watcher = threading.Thread(target=self._watch, name="watch", daemon=True)
        try:
            shared_name = None
            if self.path == "shared":
                shared_name = f"cqc-pubbench-{os.getpid()}-{self.rep}-{self.mode}"
                self.status.set(f"{self.label}: starting the owner")
                self.owner = SharedCache.start(
                    shared_name,
                    self.uri,
                    arena_bytes=OWNER_ARENA_BYTES,
                    budget_bytes=OWNER_BUDGET_BYTES,
                    slots=OWNER_SLOTS,
                )
            self.barrier = self.ctx.Barrier(plan.workers + 1)
            self.results = self.ctx.Queue()
            for w in range(plan.workers):
                cold_ids = plan.cold[(self.rep, self.path, self.mode, w)]
                spec = {
                    "uri": self.uri,
                    "db": self.db,
                    "path": self.path,
                    "mode": self.mode,
                    "index": w,
                    "workers": plan.workers,
                    "hot": plan.hot,
                    "hot_digests": self.hot_digests,
                    "hot_order": plan.hot_order(self.rep, self.mode, w),
                    "cold_ids": cold_ids,
                    "cold_digests": [self.cold_digests[i] for i in cold_ids],
                    "shared_name": shared_name,
                    "timeout": self.timeout,
                    "warm_seed": f"{plan.seed}/warm/{self.rep}/{self.path}/{self.mode}/{w}",
                }
                p = self.ctx.Process(
                    target=_worker_main, args=(spec, self.barrier, self.results), name=f"bench-worker-{w}"
                )
                p.start()
                self.procs.append(p)
            watcher.start()
            self.status.set(f"{self.label}: starting workers, first pass over the hot set")
            self._meet("warm-up (first pass)")
            if self.owner is not None:
                self.status.set(f"{self.label}: waiting for the owner to admit the hot set")
                deadline = time.monotonic() + self.timeout
                while self.owner.snapshot()["entries"] < plan.hot:
                    if time.monotonic() > deadline:
                        with contextlib.suppress(Exception):
                            self.barrier.abort()
                        raise _PhaseFailed(f"{self.label}: the owner did not admit the hot set")
                    time.sleep(0.05)
            self._meet("warm-up (owner admitted)")
            out = {}
            for window in WINDOWS:
                out[window] = self._window(window)
            self.status.set(f"{self.label}: closing")
            while self.done < plan.workers:
                try:
                    kind, index, _, payload = self.results.get(timeout=self.timeout)
                except queue_mod.Empty:
                    raise _PhaseFailed(f"{self.label}: workers did not finish:\n{self._errors()}") from None
                if kind == "error":
                    raise _PhaseFailed(f"{self.label}: worker {index} failed:\n{payload}")
                self.done += kind == "done"
            for p in self.procs:
                p.join(self.timeout)
                if p.exitcode != 0:
                    raise _PhaseFailed(f"{self.label}: worker exited with {p.exitcode}")
            return out
        finally:
            self._watch_stop.set()
            if watcher.is_alive():
                watcher.join(2)
            self._cleanup()

    def _window(self, window: str) -> dict[str, Any]:
        import psutil

        plan = self.plan
        procs = self._processes()
        owner_proc = procs[-1][1] if self.owner is not None else None
        if window == "hot":
            self.status.set(f"{self.label}: hot window, workers checking that every hot read hits")
        else:
            self.status.set(f"{self.label}: cold window, workers at the start barrier")
        self._meet(f"{window} start")
        owner0 = _process_cpu_s(owner_proc.pid) if owner_proc is not None else None
        t0 = time.perf_counter()
        self.status.set(f"{self.label}: {window} window, measuring {plan.workers} x {plan.reads:,} reads")
        self._meet(f"{window} end")
        wall = time.perf_counter() - t0
        owner1 = _process_cpu_s(owner_proc.pid) if owner_proc is not None else None
        # The workers wait at the release barrier: every manager, client and
        # mapping is attached while memory is sampled.
        pss: dict[str, int] = {}
        uss: dict[str, int] = {}
        rss: dict[str, int] = {}
        cumulative: dict[str, float] = {}
        for name, proc in procs:
            try:
                cumulative[name] = _process_cpu_s(proc.pid)
                info = proc.memory_full_info()
            except psutil.Error as exc:
                with contextlib.suppress(Exception):
                    self.barrier.abort()
                raise _PhaseFailed(f"{self.label}: cannot sample {name}: {exc}") from None
            pss[name], uss[name], rss[name] = info.pss, info.uss, info.rss
        owner_snapshot = self.owner.snapshot() if self.owner is not None else None
        self._meet(f"{window} release")
        per_worker: list[dict[str, Any] | None] = [None] * plan.workers
        while any(w is None for w in per_worker):
            try:
                kind, index, got_window, payload = self.results.get(timeout=self.timeout)
            except queue_mod.Empty:
                raise _PhaseFailed(f"{self.label}: no {window} results:\n{self._errors()}") from None
            if kind == "error":
                raise _PhaseFailed(f"{self.label}: worker {index} failed:\n{payload}")
            if kind == "done":  # a worker that already reported its last window
                self.done += 1
                continue
            if kind != "window" or got_window != window or per_worker[index] is not None:
                raise _PhaseFailed(f"{self.label}: unexpected message {kind} {got_window} from worker {index}")
            per_worker[index] = payload
        workers = [w for w in per_worker if w is not None]
        samples = [s for w in workers for s in w["samples_ns"]]
        owner_cpu = owner1 - owner0 if owner0 is not None and owner1 is not None else 0.0
        workers_cpu = sum(w["cpu_s"] for w in workers)
        verify_cpu = sum(w["verify_cpu_s"] for w in workers)
        stat: dict[str, Any] = {
            "repetition": self.rep,
            "path": self.path,
            "mode": self.mode,
            "window": window,
            "latency": summarize(samples),
            "reads": len(samples),
            "hits": sum(w["hits"] for w in workers),
            "misses": sum(w["misses"] for w in workers),
            "bypasses": sum(w["bypasses"] for w in workers),
            "mismatches": sum(w["mismatches"] for w in workers),
            "warm_passes_max": max(w["warm_passes"] for w in workers),
            "misses_before_window": sum(w.get("misses_before", 0) for w in workers),
            "wall_s": wall,
            "cpu_window_s": workers_cpu + owner_cpu,
            "cpu_window_workers_s": workers_cpu,
            "cpu_window_owner_s": owner_cpu,
            "verify_cpu_s": verify_cpu,
            "cpu_reads_s": workers_cpu + owner_cpu - verify_cpu,
            "cpu_total_s": sum(cumulative.values()),
            "cpu_total_owner_s": cumulative.get("owner", 0.0),
            "pss_mib": sum(pss.values()) / MiB,
            "pss_workers_mib": sum(v for k, v in pss.items() if k != "owner") / MiB,
            "pss_owner_mib": pss.get("owner", 0) / MiB,
            "uss_mib": sum(uss.values()) / MiB,
            "rss_mib": sum(rss.values()) / MiB,
            "streams": (
                owner_snapshot["active_streams"]
                if owner_snapshot is not None
                else sum(w["streams"] for w in workers)
            ),
        }
        reasons: dict[str, int] = {}
        for w in workers:
            for k, v in w.get("bypass_reasons", {}).items():
                reasons[k] = reasons.get(k, 0) + v
        if reasons:
            stat["bypass_reasons"] = reasons
        if owner_snapshot is not None:
            stat["owner"] = {
                k: owner_snapshot[k]
                for k in (
                    "entries",
                    "used_bytes",
                    "evictions",
                    "admissions_accepted",
                    "admissions_rejected",
                    "admissions_dropped",
                    "attached_workers",
                    "owner_uptime_s",
                )
                if k in owner_snapshot
            }
        stat["_samples_ns"] = samples  # for the figure; not written to the report
        return stat

    def _cleanup(self) -> None:
        for p in self.procs:
            p.join(0 if p.exitcode is not None else 5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        if self.owner is not None:
            with contextlib.suppress(Exception):
                self.owner.stop()
            # The owner leaves its (empty) lock file behind; the name is this
            # run's own, so nobody else can be using it.
            with contextlib.suppress(Exception):
                from client_query_cache._core.shared import paths_for

                if not self._owner_alive():
                    paths_for(self.owner.name)["lock"].unlink()
        if self.results is not None:
            self.results.close()
            self.results.join_thread()


# -- statistics -----------------------------------------------------------------

#: Window statistics whose median across repetitions the report gives.
MEDIAN_KEYS = (
    "latency.p50_us",
    "latency.p95_us",
    "latency.p99_us",
    "latency.mean_us",
    "reads",
    "hits",
    "misses",
    "misses_before_window",
    "bypasses",
    "wall_s",
    "cpu_window_s",
    "cpu_window_workers_s",
    "cpu_window_owner_s",
    "verify_cpu_s",
    "cpu_reads_s",
    "cpu_total_s",
    "cpu_total_net_s",
    "cpu_total_owner_s",
    "pss_mib",
    "pss_workers_mib",
    "pss_owner_mib",
    "uss_mib",
    "rss_mib",
    "streams",
)


def _get(stat: dict[str, Any], dotted: str) -> float:
    value: Any = stat
    for part in dotted.split("."):
        value = value[part]
    return float(value)


def _medians(windows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for path in PATHS:
        for mode in MODES:
            for window in WINDOWS:
                group = [w for w in windows if (w["path"], w["mode"], w["window"]) == (path, mode, window)]
                if not group:
                    continue
                out.setdefault(path, {}).setdefault(mode, {})[window] = {
                    key.replace("latency.", ""): statistics.median(_get(w, key) for w in group) for key in MEDIAN_KEYS
                }
    return out


def _summary(med: dict[str, Any]) -> dict[str, dict[str, float]]:
    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    out = {}
    for mode in MODES:
        d, i, s = med["direct"][mode], med["independent"][mode], med["shared"][mode]
        out[mode] = {
            "shared_over_direct_hot_p50": ratio(s["hot"]["p50_us"], d["hot"]["p50_us"]),
            "shared_over_independent_hot_p50": ratio(s["hot"]["p50_us"], i["hot"]["p50_us"]),
            "pss_shared_over_independent_hot": ratio(s["hot"]["pss_mib"], i["hot"]["pss_mib"]),
            "cpu_shared_over_independent_total": ratio(s["hot"]["cpu_total_net_s"], i["hot"]["cpu_total_net_s"]),
            "shared_over_direct_cold_p50": ratio(s["cold"]["p50_us"], d["cold"]["p50_us"]),
            # Further ratios, same medians.
            "shared_over_independent_cold_p50": ratio(s["cold"]["p50_us"], i["cold"]["p50_us"]),
            "shared_over_direct_hot_p99": ratio(s["hot"]["p99_us"], d["hot"]["p99_us"]),
            "shared_over_independent_hot_p99": ratio(s["hot"]["p99_us"], i["hot"]["p99_us"]),
            "cpu_shared_over_independent_hot_reads": ratio(s["hot"]["cpu_reads_s"], i["hot"]["cpu_reads_s"]),
            "cpu_shared_over_independent_total_cold": ratio(
                s["cold"]["cpu_total_net_s"], i["cold"]["cpu_total_net_s"]
            ),
            "pss_shared_over_independent_cold": ratio(s["cold"]["pss_mib"], i["cold"]["pss_mib"]),
        }
    return out


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


def _print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"public shared cache: {cfg['workers']} workers, {cfg['hot']:,} hot identities of "
        f"~{cfg['document_bytes_mean']:.0f} B, {cfg['reads']:,} reads per worker per window, "
        f"{cfg['repetitions']} repetition(s); medians across repetitions"
    )
    head = (
        f"{'path':<12} {'window':<6} {'mode':<5} {'p50 us':>9} {'p95 us':>9} {'p99 us':>9} "
        f"{'hits':>7} {'reads':>7} {'CPU s':>7} {'CPU tot':>8} {'PSS MiB':>8} {'streams':>7}"
    )
    print(head)
    print("-" * len(head))
    med = report["medians"]
    for path in PATHS:
        for window in WINDOWS:
            for mode in MODES:
                m = med[path][mode][window]
                print(
                    f"{path:<12} {window:<6} {mode:<5} {m['p50_us']:>9.1f} {m['p95_us']:>9.1f} {m['p99_us']:>9.1f} "
                    f"{m['hits']:>7.0f} {m['reads']:>7.0f} {m['cpu_reads_s']:>7.2f} {m['cpu_total_net_s']:>8.2f} "
                    f"{m['pss_mib']:>8.1f} {m['streams']:>7.0f}"
                )
    print(
        "CPU s: workers + owner during the measured reads (verification excluded); "
        "CPU tot: cumulative from process start (warm-up, owner start-up) to the window's end; "
        "PSS: workers + owner"
    )
    print("summary (ratios of the medians):")
    for mode in MODES:
        s = report["summary"][mode]
        print(f"  {mode}:")
        for key in (
            "shared_over_direct_hot_p50",
            "shared_over_independent_hot_p50",
            "pss_shared_over_independent_hot",
            "cpu_shared_over_independent_total",
            "shared_over_direct_cold_p50",
        ):
            print(f"    {key:<36} {s[key]:.3f}")


def _plot(path: str, windows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"direct": "tab:red", "independent": "tab:blue", "shared": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex="col", sharey=True)
    for row, mode in enumerate(MODES):
        for col, window in enumerate(WINDOWS):
            ax = axes[row][col]
            for p in PATHS:
                samples = sorted(
                    s / 1000.0
                    for w in windows
                    if (w["path"], w["mode"], w["window"]) == (p, mode, window)
                    for s in w["_samples_ns"]
                )
                if not samples:
                    continue
                n = len(samples)
                ys = [(k + 1) / n for k in range(n)]
                med = report["medians"][p][mode][window]
                ax.step(
                    samples,
                    ys,
                    where="post",
                    color=colors[p],
                    label=f"{p} (p50 {med['p50_us']:.0f} us, p99 {med['p99_us']:.0f} us)",
                )
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


def _checkout() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if rev.returncode == 0:
            return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    return None


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


def _run(args: argparse.Namespace, uri: str, status: _Progress) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    plan = _Plan(args)
    rng = random.Random(args.seed)
    db_name = f"cqc_bench_public_{int(time.time())}_{rng.randint(0, 10**6)}"
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    windows: list[dict[str, Any]] = []
    try:
        coll = client[db_name][COLLECTION]
        setup_started = time.perf_counter()
        hot_digests, cold_digests, sizes = _insert_documents(coll, plan, args.seed, status)
        setup_s = time.perf_counter() - setup_started
        status.note(
            f"setup: {plan.hot:,} hot + {plan.cold_total:,} cold documents inserted in {setup_s:.1f}s"
        )
        ctx = multiprocessing.get_context("spawn")
        for n, (rep, path, mode) in enumerate(plan.phases, 1):
            label = f"repetition {rep + 1}/{plan.repetitions}, phase {n}/{len(plan.phases)} {path} {mode}"
            started = time.perf_counter()
            phase = _Phase(
                ctx, uri, db_name, plan, rep, path, mode, hot_digests, cold_digests, args.timeout, status, label
            )
            out = phase.run()
            for order, window in enumerate(WINDOWS):
                stat = out[window]
                stat["phase"] = n
                if stat["mismatches"]:
                    raise RuntimeError(f"{label} {window}: {stat['mismatches']} reads returned a wrong document")
                windows.append(stat)
            # Verification CPU of the measured windows so far, out of the totals.
            verify_so_far = 0.0
            for window in WINDOWS:
                verify_so_far += out[window]["verify_cpu_s"]
                out[window]["cpu_total_net_s"] = out[window]["cpu_total_s"] - verify_so_far
            h, c = out["hot"], out["cold"]
            status.note(
                f"{label}: hot p50 {h['latency']['p50_us']:.1f} us ({h['hits']}/{h['reads']} hits), "
                f"cold p50 {c['latency']['p50_us']:.1f} us ({c['hits']} hits), "
                f"{time.perf_counter() - started:.1f}s"
            )
    finally:
        status.set("dropping the benchmark database")
        with contextlib.suppress(Exception):
            client.drop_database(db_name)
        client.close()

    from client_query_cache import __version__ as cqc_version
    from client_query_cache.testing import external_uri

    medians = _medians(windows)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "mode": "quick" if args.quick else "full",
        "method": METHOD,
        "config": {
            "workers": plan.workers,
            "repetitions": plan.repetitions,
            "reads": plan.reads,
            "hot": plan.hot,
            "cold_identities": plan.cold_total,
            "seed": args.seed,
            "phases": [{"repetition": r, "path": p, "mode": m} for r, p, m in plan.phases],
            "owner": {
                "arena_bytes": OWNER_ARENA_BYTES,
                "budget_bytes": OWNER_BUDGET_BYTES,
                "slots": OWNER_SLOTS,
            },
            "independent_budget_bytes": 64 * MiB,
            "read_concern_direct": "majority",
            "external_deployment": external_uri() is not None,
            "setup_seconds": setup_s,
            "client_query_cache": cqc_version,
            "checkout": _checkout(),
            **sizes,
        },
        "machine": {**machine_facts(), "loadavg_at_start": list(os.getloadavg())},
        "windows": [{k: v for k, v in w.items() if not k.startswith("_")} for w in windows],
        "medians": medians,
        "summary": _summary(medians),
    }
    return report, windows


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.public_shared_cache",
        description=(__doc__ or "").split("\n")[0],
    )
    parser.add_argument("--quick", action="store_true", help="1 repetition, 256 hot identities, 200 reads per window")
    parser.add_argument("--output", metavar="FILE", help="write the JSON report here")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--repetitions", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument(
        "--reads", type=int, default=None, help="measured reads per worker per window (default 2000, quick 200)"
    )
    parser.add_argument("--hot", type=int, default=None, help="hot identities (default 4096, quick 256)")
    parser.add_argument("--seed", type=int, default=20261015)
    parser.add_argument("--png", metavar="PATH", help="latency figure (default: next to --output, .png)")
    parser.add_argument("--no-png", action="store_true", help="write no figure")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds any one wait may take before the run fails (default 900)"
    )
    args = parser.parse_args(argv)
    if args.repetitions is None:
        args.repetitions = 1 if args.quick else 3
    if args.reads is None:
        args.reads = 200 if args.quick else 2000
    if args.hot is None:
        args.hot = 256 if args.quick else 4096
    for name in ("workers", "repetitions", "reads", "hot"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
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

    from client_query_cache.testing import disposable_uri

    started = time.perf_counter()
    status = _Progress()
    try:
        status.set("starting the server (or using MONGODB_URI)")
        with disposable_uri() as uri:
            report, windows = _run(args, uri, status)
            status.set("stopping the server")
    except _PhaseFailed as exc:
        status.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        status.close()
    report["elapsed_seconds"] = time.perf_counter() - started
    problems = _checks(windows, args.workers)
    report["checks"] = {"passed": not problems, "problems": problems}
    _print_table(report)
    if args.output:
        write_json(args.output, report)
        print(f"wrote {args.output}")
    if args.png:
        _plot(args.png, windows, report)
        print(f"wrote {args.png}")
    print(f"elapsed {report['elapsed_seconds']:.0f}s")
    return exit_code(
        problems, "CHECKS FAILED (the figures above are not what this benchmark means to measure):"
    )


if __name__ == "__main__":
    sys.exit(main())
