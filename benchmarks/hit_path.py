"""Hit-path benchmark: a cached find_one next to its floor and a direct read.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.hit_path`.
"""

from __future__ import annotations

import functools
import asyncio
import gc
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import bson
import pymongo

from client_query_cache import AsyncCacheManager, CacheManager
from client_query_cache._core.engine import decode_bson

from . import _kit as kit
from ._kit import make_document, progress, summarize, warm_until_hits

SCHEMA = "client-query-cache/hit-path/1"


async def _measure_async(
    uri: str, db_name: str, expected: list[Any], raw_by_id: dict[int, bytes], order: list[int]
) -> tuple[list[int], list[int], list[int], int, int]:
    """The async columns: decode, ``await`` cached hit, ``await`` direct read,
    interleaved per sample like the sync ones."""
    client: pymongo.AsyncMongoClient[Any] = pymongo.AsyncMongoClient(uri)
    try:
        coll = client[db_name]["docs"]
        codec = coll.codec_options
        async with AsyncCacheManager(client) as manager:
            cached = manager[db_name]["docs"]
            if not await manager.wait_ready(30):
                raise RuntimeError("the change stream did not become ready")
            deadline = time.monotonic() + 30  # until every document is served
            while True:
                hits = manager.snapshot().hits
                for d in expected:
                    await cached.find_one({"_id": d["_id"]})
                if manager.snapshot().hits - hits == len(expected):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the documents are not all served from the cache after 30 s")
                await asyncio.sleep(0.1)
            for d in expected[:200]:
                decode_bson(raw_by_id[d["_id"]], codec)
                await cached.find_one({"_id": d["_id"]})
                await coll.find_one({"_id": d["_id"]})
            before = manager.snapshot()
            t_decode: list[int] = []
            t_hit: list[int] = []
            t_direct: list[int] = []
            clock = time.perf_counter_ns
            mismatches = 0
            gc.collect()
            for i in order:
                want = expected[i]
                raw = raw_by_id[i]
                filt = {"_id": i}

                t0 = clock()
                a = decode_bson(raw, codec)
                t1 = clock()
                t_decode.append(t1 - t0)
                mismatches += a != want

                t0 = clock()
                b = await cached.find_one(filt)
                t1 = clock()
                t_hit.append(t1 - t0)
                mismatches += b != want

                t0 = clock()
                c = await coll.find_one(filt)
                t1 = clock()
                t_direct.append(t1 - t0)
                mismatches += c != want
            after = manager.snapshot()
    finally:
        await client.close()
    hits = after.hits - before.hits
    if after.misses != before.misses:
        mismatches += 1
    return t_decode, t_hit, t_direct, mismatches, hits


def _interleave(
    order: list[int],
    expected: list[Any],
    raw_by_id: dict[int, bytes],
    ops: list[tuple[str, Callable[[dict[str, Any], bytes], Any]]],
) -> tuple[dict[str, list[int]], int]:
    """Time each op once per sample and check every result after its stop
    timestamp. The order of the ops rotates from sample to sample, so each op
    runs in each position (first after the previous sample, after the
    decode, ...) equally often. Returns samples per op and mismatches."""
    times: dict[str, list[int]] = {name: [] for name, _ in ops}
    clock = time.perf_counter_ns
    mismatches = 0
    rotations = [ops[k:] + ops[:k] for k in range(len(ops))]
    gc.collect()
    for n, i in enumerate(order):
        want = expected[i]
        raw = raw_by_id[i]
        filt = {"_id": i}
        for name, fn in rotations[n % len(ops)]:
            t0 = clock()
            got = fn(filt, raw)
            t1 = clock()
            times[name].append(t1 - t0)
            mismatches += got != want
            del got
    return times, mismatches


def _measure_shared(
    uri: str, db_name: str, expected: list[Any], raw_by_id: dict[int, bytes], order: list[int]
) -> tuple[dict[str, list[int]], int, int]:
    """decode, process-local hit, shared hit, direct read, interleaved; the
    shared cache's owner uses the public benchmark's geometry (32 MiB budget,
    40 MiB arena, 16,384 slots)."""
    name = f"hitpath-{os.getpid()}"
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    coll = client[db_name]["docs"]
    codec = coll.codec_options
    owner = kit.start_owner(name, uri, **kit.OWNER_GEOMETRY)
    try:
        with CacheManager(client) as local, CacheManager(client, shared=name) as shared:
            local_docs = local[db_name]["docs"]
            shared_docs = shared[db_name]["docs"]
            if not (local.wait_ready(30) and shared.wait_ready(30)):
                raise RuntimeError("the change streams did not become ready")
            for d in expected:
                local_docs.find_one({"_id": d["_id"]})
                shared_docs.find_one({"_id": d["_id"]})
            # The owner admits a worker's misses asynchronously, and reads go
            # to MongoDB until the stream has applied what the misses saw.
            for manager, docs_view in ((local, local_docs), (shared, shared_docs)):
                reads = [functools.partial(docs_view.find_one, {"_id": d["_id"]}) for d in expected]
                if not warm_until_hits(manager, reads, 30):
                    raise RuntimeError("the warm-up reads are not all served from the cache after 30 s")
            before = shared.snapshot().hits
            times, mismatches = _interleave(
                order,
                expected,
                raw_by_id,
                [
                    ("decode", lambda f, raw: decode_bson(raw, codec)),
                    ("local_hit", lambda f, raw: local_docs.find_one(f)),
                    ("shared_hit", lambda f, raw: shared_docs.find_one(f)),
                    ("direct", lambda f, raw: coll.find_one(f)),
                ],
            )
            hits = shared.snapshot().hits - before
    finally:
        owner.stop()
        client.close()
    return times, mismatches, hits


def _run(uri: str, docs: int, samples: int, seed: int, shared: bool) -> dict[str, Any]:
    rng = random.Random(seed)
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    db_name = f"cqc_bench_hit_{int(time.time())}_{rng.randint(0, 10**6)}"
    coll = client[db_name]["docs"]
    setup_started = time.perf_counter()
    try:
        expected = [make_document(i, rng) for i in range(docs)]
        coll.insert_many(expected)
        sizes = [len(bson.encode(d)) for d in expected]
        raw_by_id = {d["_id"]: bson.encode(d) for d in expected}
        codec = coll.codec_options
        # What a read must return: the stored document as this collection's
        # codec options decode it (naive UTC datetimes by default).
        expected = [bson.decode(raw_by_id[d["_id"]], codec) for d in expected]

        with CacheManager(client) as manager:
            cached = manager[db_name]["docs"]
            if not manager.wait_ready(30):
                raise RuntimeError("the change stream did not become ready")
            # Warm-up: admit every document (until all are served), then
            # exercise all three paths.
            reads = [functools.partial(cached.find_one, {"_id": d["_id"]}) for d in expected]
            if not warm_until_hits(manager, reads, 30):
                raise RuntimeError("the documents are not all served from the cache after 30 s")
            for d in expected[: min(200, docs)]:
                decode_bson(raw_by_id[d["_id"]], codec)
                cached.find_one({"_id": d["_id"]})
                coll.find_one({"_id": d["_id"]})
            before = manager.snapshot()
            setup_seconds = time.perf_counter() - setup_started

            order = [rng.randrange(docs) for _ in range(samples)]
            times, mismatches = _interleave(
                order,
                expected,
                raw_by_id,
                [
                    ("decode", lambda f, raw: decode_bson(raw, codec)),
                    ("hit", lambda f, raw: cached.find_one(f)),
                    ("direct", lambda f, raw: coll.find_one(f)),
                ],
            )
            t_decode, t_hit, t_direct = times["decode"], times["hit"], times["direct"]
            after = manager.snapshot()
        progress("measuring the async columns...")
        a_decode, a_hit, a_direct, a_mismatches, a_hits = asyncio.run(
            _measure_async(uri, db_name, expected, raw_by_id, order)
        )
        if a_mismatches or a_hits != samples:
            raise RuntimeError(
                f"async verification failed: {a_mismatches} mismatches, {a_hits} hits for {samples} reads"
            )
        shared_times: dict[str, list[int]] = {}
        if shared:
            progress("measuring the shared cache...")
            shared_times, s_mismatches, s_hits = _measure_shared(uri, db_name, expected, raw_by_id, order)
            if s_mismatches or s_hits != samples:
                raise RuntimeError(
                    f"shared verification failed: {s_mismatches} mismatches, {s_hits} shared hits "
                    f"for {samples} reads"
                )
    finally:
        client.drop_database(db_name)
        client.close()

    return _report(docs, samples, seed, sizes, setup_seconds, (t_decode, t_hit, t_direct, mismatches),
                   (a_decode, a_hit, a_direct), shared_times, after.hits - before.hits, after.misses - before.misses)


def _report(
    docs: int, samples: int, seed: int, sizes: list[int], setup_seconds: float, sync: tuple[Any, ...],
    asyncs: tuple[Any, ...], shared_times: dict[str, list[int]], timed_hits: int, timed_misses: int,
) -> dict[str, Any]:
    """The figures, after the checks that the timed reads were right and hits."""
    t_decode, t_hit, t_direct, mismatches = sync
    a_decode, a_hit, a_direct = asyncs
    if mismatches or timed_hits != samples or timed_misses:
        raise RuntimeError(
            f"verification failed: {mismatches} mismatching results, "
            f"{timed_hits} hits and {timed_misses} misses for {samples} cached reads"
        )
    decode, hit, direct = summarize(t_decode), summarize(t_hit), summarize(t_direct)
    adecode, ahit, adirect = summarize(a_decode), summarize(a_hit), summarize(a_direct)
    report = {
        "schema": SCHEMA,
        "method": {
            "interleaving": "decode, hit, direct per sample, their order rotating from "
            "sample to sample (async: fixed order), random document order",
            "quantiles": "nearest rank: index ceil(p/100*n)-1 of sorted samples",
            "timer": "time.perf_counter_ns around each call",
            "decode": "bson._bson_to_dict(raw, collection.codec_options)",
            "verification": "every sampled result compared with the inserted document "
            "after its stop timestamp; every timed cache read a hit",
        },
        "config": {
            "documents": docs,
            "samples": samples,
            "seed": seed,
            "document_bytes_mean": sum(sizes) / len(sizes),
            "document_bytes_min": min(sizes),
            "document_bytes_max": max(sizes),
            "external_deployment": kit.external(),
        },
        "machine": kit.machine_facts(),
        "setup_seconds": setup_seconds,
        "results": {
            "decode": decode,
            "hit": hit,
            "direct": direct,
            "async_decode": adecode,
            "async_hit": ahit,
            "async_direct": adirect,
        },
        "ratios": {
            "hit_over_decode_p50": hit["p50_us"] / decode["p50_us"],
            "hit_over_direct_p50": hit["p50_us"] / direct["p50_us"],
            "hit_over_decode_p95": hit["p95_us"] / decode["p95_us"],
            "hit_over_direct_p95": hit["p95_us"] / direct["p95_us"],
            "async_hit_over_decode_p50": ahit["p50_us"] / adecode["p50_us"],
            "async_hit_over_direct_p50": ahit["p50_us"] / adirect["p50_us"],
        },
        "verification": {
            "checked_reads": 6 * samples,
            "mismatches": mismatches,
            "timed_hits": timed_hits,
            "timed_misses": timed_misses,
        },
    }
    if shared_times:
        sh = {f"shared_{k}" if not k.startswith("shared") else k: summarize(v) for k, v in shared_times.items()}
        report["results"].update(sh)
        report["ratios"]["shared_hit_over_decode_p50"] = sh["shared_hit"]["p50_us"] / sh["shared_decode"]["p50_us"]
        report["ratios"]["shared_over_local_p50"] = sh["shared_hit"]["p50_us"] / sh["shared_local_hit"]["p50_us"]
        report["ratios"]["shared_hit_over_direct_p50"] = sh["shared_hit"]["p50_us"] / sh["shared_direct"]["p50_us"]
        report["method"]["shared"] = (
            "a fourth loop interleaves decode, process-local hit, shared hit (this process "
            "attached as a worker to an owner process) and direct read"
        )
    return report


def _print(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"hit path: {cfg['documents']} documents of ~{cfg['document_bytes_mean']:.0f} B, "
        f"{cfg['samples']} interleaved samples per operation"
    )
    print(f"{'operation':<14} {'p50 us':>10} {'p95 us':>10} {'p99 us':>10}")
    for name in report["results"]:
        r = report["results"][name]
        print(f"{name:<14} {r['p50_us']:>10.2f} {r['p95_us']:>10.2f} {r['p99_us']:>10.2f}")
    ratios = report["ratios"]
    print(f"hit/decode p50: {ratios['hit_over_decode_p50']:.3f}")
    print(f"hit/direct p50: {ratios['hit_over_direct_p50']:.4f}")
    print(f"async hit/decode p50: {ratios['async_hit_over_decode_p50']:.3f}")
    print(f"async hit/direct p50: {ratios['async_hit_over_direct_p50']:.4f}")
    if "shared_over_local_p50" in ratios:
        print(f"shared hit/decode p50: {ratios['shared_hit_over_decode_p50']:.3f}")
        print(f"shared/local hit p50: {ratios['shared_over_local_p50']:.3f}")


#: What a full run is held to (README's figures; docs/benchmarks.md, "Targets").
TARGETS = (
    kit.Target("ratios.hit_over_direct_p50", "<=", 0.1),
    kit.Target("ratios.async_hit_over_direct_p50", "<=", 0.1),
    kit.Target("ratios.hit_over_decode_p50", "<=", 1.3),
    kit.Target("ratios.async_hit_over_decode_p50", "<=", 1.3),
)


def main(argv: list[str] | None = None) -> int:
    parser = kit.parser("hit_path", __doc__, seed=20261203)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--shared", action="store_true", help="also measure a shared-cache hit (starts an owner)")
    args = parser.parse_args(argv)
    samples = args.samples or (2000 if args.quick else 20000)
    progress("starting the server (or using MONGODB_URI)...")
    with kit.server() as uri:
        progress(f"measuring {samples} samples...")
        report = _run(uri, args.documents, samples, args.seed, args.shared)
    report["mode"] = "quick" if args.quick else "full"
    return kit.conclude(report, None, _print, args.json, targets=TARGETS, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
