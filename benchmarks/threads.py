"""Threads benchmark: hits read by 1, 2, 4 and 8 threads (and tasks) of one manager.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.threads`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import bson
import pymongo

from client_query_cache._core.engine import decode_bson

from . import _kit as kit

SCHEMA = "client-query-cache/threads/1"
#: How many threads (sync) or tasks (async) read at once.
COUNTS = (1, 2, 4, 8)
METHOD = {
    "reads": "find_one({'_id': i}) hits of one manager, i drawn at random (seeded per reader); "
    "every result compared with the expected document, every read a hit",
    "sync": "n threads start at a barrier and read until the main thread, asleep for the window, stops them",
    "async": "n tasks on one event loop, each yielding to the loop (asyncio.sleep(0)) after every read",
    "rounds": "every round measures each count and kind (hit, decode) once, in a random order; a ratio is the median "
    "over rounds of its throughput over the same round's one-reader throughput",
    "throughput": "reads completed by all readers in the window / the window's length",
    "control": "the same windows with each read replaced by decoding the document's BSON "
    "(what the interpreter itself loses with n readers), measured in the same rounds",
}
TARGETS = (kit.Target("ratios.*", ">=", 0.9),)


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """What one window of readers did: reads completed, wrong results, seconds."""

    reads: int
    mismatches: int
    elapsed: float


def _expected(uri: str, db: str, docs: int, rng: random.Random) -> tuple[list[bytes], list[Any]]:
    """Insert ``docs`` of the smallest ``make_document`` size (about 1.5 KiB:
    its fixed fields): their BSON, and what a read of each must return."""
    with pymongo.MongoClient(uri) as client:
        coll = client[db]["docs"]
        raws = [bson.encode(kit.make_document(i, rng, 1024)) for i in range(docs)]
        kit.insert_raw(coll, raws)
        return raws, [bson.decode(raw, coll.codec_options) for raw in raws]


def _sync_window(read: Callable[[int], Any], expected: list[Any], n: int, seconds: float, seed: int) -> Window:
    """``n`` threads call ``read(i)`` for ``seconds``."""
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
            bad += read(i) != expected[i]
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
    return Window(sum(reads), sum(mismatches), elapsed)


async def _async_window(
    read: Callable[[int], Any], awaited: bool, expected: list[Any], n: int, seconds: float, seed: int
) -> Window:
    """``n`` tasks call ``read(i)`` (and await it if ``awaited``) for ``seconds``."""
    stop = False
    reads = [0] * n
    mismatches = [0] * n

    async def reader(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        docs = len(expected)
        done = bad = 0
        while not stop:
            i = rng.randrange(docs)
            got = read(i)
            if awaited:
                got = await got
            bad += got != expected[i]
            done += 1
            await asyncio.sleep(0)
        reads[k], mismatches[k] = done, bad

    tasks = [asyncio.ensure_future(reader(k)) for k in range(n)]
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    stop = True
    elapsed = time.perf_counter() - started
    await asyncio.gather(*tasks)
    return Window(sum(reads), sum(mismatches), elapsed)


async def _measure(
    uri: str, db: str, raws: list[bytes], expected: list[Any], is_async: bool, rounds: int, seconds: float, seed: int
) -> dict[str, Any]:
    """Every count of readers of hits, and of decodes (the control), in every
    round on one manager: throughputs in reads per second."""
    async with kit.worker_client(uri, is_async, None) as (client, manager):
        view = manager[db]["docs"]
        codec = client[db]["docs"].codec_options
        await kit.warmed_ready(manager, [lambda i=i: view.find_one({"_id": i}) for i in range(len(expected))], 30)
        await asyncio.sleep(kit.SETTLE_S)
        reads: dict[str, Callable[[int], Any]] = {
            "hit": lambda i: view.find_one({"_id": i}),
            "decode": lambda i: decode_bson(raws[i], codec),
        }
        rng = random.Random(seed)
        throughput: dict[str, dict[int, list[float]]] = {kind: {n: [] for n in COUNTS} for kind in reads}
        before = manager.snapshot()
        hits = bad = 0
        for r in range(rounds):
            for n, kind in rng.sample([(n, kind) for n in COUNTS for kind in reads], len(COUNTS) * len(reads)):
                args = (expected, n, seconds, seed + 1000 * r + n)
                if is_async:
                    w = await _async_window(reads[kind], kind == "hit", *args)
                else:
                    w = _sync_window(reads[kind], *args)
                throughput[kind][n].append(w.reads / w.elapsed)
                hits += w.reads if kind == "hit" else 0
                bad += w.mismatches
        counts = kit.counted(before, manager.snapshot())
    if bad or counts["hits"] != hits or counts["misses"]:
        raise kit.BenchmarkFailed(
            f"{'async' if is_async else 'sync'} verification failed: {bad} mismatching results, "
            f"{counts['hits']} hits and {counts['misses']} misses for {hits} cached reads"
        )
    return {"hits": hits} | {
        f"{kind}_throughput_per_s": {str(n): t for n, t in per.items()} for kind, per in throughput.items()
    }


#: Per API: where its figures are, and the names of its ratios.
NAMES = {
    "sync": "threads_{}_throughput_over_one_thread",
    "async": "async_tasks_{}_throughput_over_one_thread",
}


def _over_one(per: dict[str, list[float]]) -> dict[int, float]:
    """Per count above one: the median over rounds of its throughput over the same round's one reader."""
    return {n: statistics.median(a / b for a, b in zip(per[str(n)], per["1"], strict=True)) for n in COUNTS[1:]}


def _ratios(results: dict[str, Any], kind: str) -> dict[str, float]:
    return {
        name.format(n): ratio
        for api, name in NAMES.items()
        for n, ratio in _over_one(results[api][f"{kind}_throughput_per_s"]).items()
    }


def run(uri: str, docs: int, rounds: int, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    db = f"cqc_bench_threads_{int(time.time())}_{rng.randint(0, 10**6)}"
    try:
        raws, expected = _expected(uri, db, docs, rng)
        results = {}
        for api, is_async in (("sync", False), ("async", True)):
            kit.progress(f"measuring {api}: {rounds} rounds of {seconds:g} s per count and kind...")
            results[api] = asyncio.run(_measure(uri, db, raws, expected, is_async, rounds, seconds, seed))
    finally:
        with pymongo.MongoClient(uri) as client:
            client.drop_database(db)
    return {
        "schema": SCHEMA,
        "method": METHOD,
        "config": {
            "documents": docs,
            "document_bytes_mean": sum(map(len, raws)) / docs,
            "rounds": rounds,
            "window_seconds": seconds,
            "counts": list(COUNTS),
            "seed": seed,
            "switch_interval_s": sys.getswitchinterval(),
            "external_deployment": kit.external(),
        },
        "machine": kit.machine_facts(),
        "results": results,
        "ratios": _ratios(results, "hit"),
        "control": {"decode": _ratios(results, "decode")},
    }


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"threads: {cfg['documents']} documents of ~{cfg['document_bytes_mean']:.0f} B, "
        f"{cfg['rounds']} rounds of {cfg['window_seconds']:g} s per count and kind (median over rounds)"
    )
    rows = []
    for api in ("sync", "async"):
        res = report["results"][api]
        for n in map(str, COUNTS):
            hit, decode = (statistics.median(res[f"{kind}_throughput_per_s"][n]) for kind in ("hit", "decode"))
            rows.append((f"{api} x{n}", hit, 1e6 / hit, decode, 1e6 / decode))
    columns = [("readers", "<10"), ("hits/s", ">10.0f"), ("us/hit", ">8.2f")]
    kit.table(columns + [("decodes/s", ">10.0f"), ("us/decode", ">10.2f")], rows)
    for name, value in report["ratios"].items():
        print(f"{name}: {value:.3f}  (decode alone: {report['control']['decode'][name]:.3f})")


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
