"""Threads benchmark: hits read by 1, 2, 4 and 8 threads (and tasks) of one manager.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.threads`.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import threading
import time
from typing import Any

import bson
import pymongo

from . import _kit as kit

SCHEMA = "client-query-cache/threads/1"
#: How many threads (sync) or tasks (async) read at once.
COUNTS = (1, 2, 4, 8)
METHOD = {
    "reads": "find_one({'_id': i}) hits of one manager, i drawn at random (seeded per reader); "
    "every result compared with the expected document, every read a hit",
    "sync": "n threads start at a barrier and read until the main thread, asleep for the window, stops them",
    "async": "n tasks on one event loop, each yielding to the loop (asyncio.sleep(0)) after every read",
    "rounds": "every round measures each count once, in a random order; a count's ratio is the median "
    "over rounds of its throughput over the same round's one-reader throughput",
    "throughput": "reads completed by all readers in the window / the window's length",
}
TARGETS = (kit.Target("ratios.*", ">=", 0.9),)


def _expected(uri: str, db: str, docs: int, rng: random.Random) -> tuple[list[Any], float]:
    """Insert ``docs`` of the smallest ``make_document`` size (about 1.5 KiB:
    its fixed fields); what a read of each must return, and their mean size."""
    with pymongo.MongoClient(uri) as client:
        coll = client[db]["docs"]
        raws = [bson.encode(kit.make_document(i, rng, 1024)) for i in range(docs)]
        kit.insert_raw(coll, raws)
        return [bson.decode(raw, coll.codec_options) for raw in raws], sum(map(len, raws)) / docs


def _sync_window(view: Any, expected: list[Any], n: int, seconds: float, seed: int) -> tuple[int, int, float]:
    """``n`` threads read hits for ``seconds``: (reads, mismatches, elapsed s)."""
    barrier = threading.Barrier(n + 1)
    stop = threading.Event()
    reads = [0] * n
    mismatches = [0] * n

    def reader(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        docs = len(expected)
        done = bad = 0
        barrier.wait()
        while not stop.is_set():
            i = rng.randrange(docs)
            bad += view.find_one({"_id": i}) != expected[i]
            done += 1
        reads[k], mismatches[k] = done, bad

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    elapsed = time.perf_counter() - started
    for t in threads:
        t.join()
    return sum(reads), sum(mismatches), elapsed


async def _async_window(view: Any, expected: list[Any], n: int, seconds: float, seed: int) -> tuple[int, int, float]:
    """``n`` tasks read hits for ``seconds``: (reads, mismatches, elapsed s)."""
    stop = False
    reads = [0] * n
    mismatches = [0] * n

    async def reader(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        docs = len(expected)
        done = bad = 0
        while not stop:
            i = rng.randrange(docs)
            bad += await view.find_one({"_id": i}) != expected[i]
            done += 1
            await asyncio.sleep(0)
        reads[k], mismatches[k] = done, bad

    tasks = [asyncio.ensure_future(reader(k)) for k in range(n)]
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    stop = True
    elapsed = time.perf_counter() - started
    await asyncio.gather(*tasks)
    return sum(reads), sum(mismatches), elapsed


async def _measure(
    uri: str, db: str, expected: list[Any], is_async: bool, rounds: int, seconds: float, seed: int
) -> dict[str, Any]:
    """Every count in every round on one manager: throughputs per count, in reads per second."""
    async with kit.worker_client(uri, is_async, None) as (_client, manager):
        view = manager[db]["docs"]
        await kit.warmed_ready(manager, [lambda i=i: view.find_one({"_id": i}) for i in range(len(expected))], 30)
        rng = random.Random(seed)
        per_count: dict[int, list[float]] = {n: [] for n in COUNTS}
        before = manager.snapshot()
        total = bad = 0
        for r in range(rounds):
            for n in rng.sample(COUNTS, len(COUNTS)):
                window_seed = seed + 1000 * r + n
                if is_async:
                    done, wrong, elapsed = await _async_window(view, expected, n, seconds, window_seed)
                else:
                    done, wrong, elapsed = _sync_window(view, expected, n, seconds, window_seed)
                per_count[n].append(done / elapsed)
                total += done
                bad += wrong
        counts = kit.counted(before, manager.snapshot())
    if bad or counts["hits"] != total or counts["misses"]:
        raise kit.BenchmarkFailed(
            f"{'async' if is_async else 'sync'} verification failed: {bad} mismatching results, "
            f"{counts['hits']} hits and {counts['misses']} misses for {total} reads"
        )
    return {"reads": total, "throughput_per_s": {str(n): t for n, t in per_count.items()}}


def _ratios(results: dict[str, Any]) -> dict[str, float]:
    """Per count above one: the median over rounds of its throughput over the same round's one reader."""
    out = {}
    for api, name in (
        ("sync", "threads_{}_throughput_over_one_thread"),
        ("async", "async_tasks_{}_throughput_over_one_thread"),
    ):
        per = results[api]["throughput_per_s"]
        for n in COUNTS[1:]:
            out[name.format(n)] = statistics.median(a / b for a, b in zip(per[str(n)], per["1"], strict=True))
    return out


def run(uri: str, docs: int, rounds: int, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    db = f"cqc_bench_threads_{int(time.time())}_{rng.randint(0, 10**6)}"
    try:
        expected, size = _expected(uri, db, docs, rng)
        results = {}
        for api, is_async in (("sync", False), ("async", True)):
            kit.progress(f"measuring {api}: {rounds} rounds of {seconds:g} s per count...")
            results[api] = asyncio.run(_measure(uri, db, expected, is_async, rounds, seconds, seed))
    finally:
        with pymongo.MongoClient(uri) as client:
            client.drop_database(db)
    return {
        "schema": SCHEMA,
        "method": METHOD,
        "config": {
            "documents": docs,
            "document_bytes_mean": size,
            "rounds": rounds,
            "window_seconds": seconds,
            "counts": list(COUNTS),
            "seed": seed,
            "switch_interval_s": sys.getswitchinterval(),
            "external_deployment": kit.external(),
        },
        "machine": kit.machine_facts(),
        "results": results,
        "ratios": _ratios(results),
    }


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"threads: {cfg['documents']} documents of ~{cfg['document_bytes_mean']:.0f} B, "
        f"{cfg['rounds']} rounds of {cfg['window_seconds']:g} s per count"
    )
    rows = []
    for api in ("sync", "async"):
        for n, per in report["results"][api]["throughput_per_s"].items():
            median = statistics.median(per)
            rows.append((f"{api} x{n}", median, 1e6 / median))
    kit.table([("readers", "<10"), ("hits/s", ">12.0f"), ("us/hit", ">8.2f")], rows)
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = kit.parser("threads", __doc__, seed=20261205)
    parser.add_argument("--quick", action="store_true", help="shorter windows, fewer rounds (a smoke run)")
    parser.add_argument("--documents", type=int, default=1000)
    args = parser.parse_args(argv)
    rounds, seconds = (3, 0.5) if args.quick else (7, 2.0)
    report = kit.with_server(lambda uri: run(uri, args.documents, rounds, seconds, args.seed))
    if report is None:
        return 1
    report["mode"] = "quick" if args.quick else "full"
    return kit.conclude(report, None, _print, args.json, targets=TARGETS, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
