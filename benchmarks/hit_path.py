"""Hit-path benchmark: a cached find_one next to its floor and a direct read.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks.hit_path`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import random
import sys
import time
from typing import Any

import bson
import pymongo

from client_query_cache import CacheManager
from client_query_cache._core.engine import decode_bson

from . import _kit as kit

SCHEMA = "client-query-cache/hit-path/1"
METHOD = {
    "interleaving": "decode, hit, direct per sample, in a random order drawn per sample "
    "(seeded), random document order",
    "quantiles": "nearest rank: index ceil(p/100*n)-1 of sorted samples",
    "timer": "time.perf_counter_ns around each call",
    "decode": "bson._bson_to_dict(raw, collection.codec_options)",
    "verification": "every sampled result compared with the inserted document "
    "after its stop timestamp; every timed cache read a hit (process-local and shared)",
    "settle": f"{kit.SETTLE_S:g} s between the warm-up and the timed reads (the stream proves the floor)",
    "costs": "the cache's own cost of a hit: its p50 minus the decode's p50 of the same loop",
}
SHARED_METHOD = (
    "a fourth loop interleaves decode, process-local hit, shared hit (this process "
    "attached as a worker to an owner process) and direct read"
)
SCALE_METHOD = (
    "small documents ({_id, n, s}, 37 B) admitted by real misses into one process-local cache, "
    "1,000 then 10,000, 100,000 and 1,000,000 entries (up to --scale); at each size, hits of "
    "documents drawn from the admitted ones interleaved with decoding the same bytes, no direct reads"
)
#: The report's ratios: (numerator, denominator, figure) of ``results``; the
#: shared ones only with ``--shared``.
RATIOS = {
    "hit_over_decode_p50": ("hit", "decode", "p50_us"),
    "hit_over_direct_p50": ("hit", "direct", "p50_us"),
    "hit_over_decode_p95": ("hit", "decode", "p95_us"),
    "hit_over_direct_p95": ("hit", "direct", "p95_us"),
    "async_hit_over_decode_p50": ("async_hit", "async_decode", "p50_us"),
    "async_hit_over_direct_p50": ("async_hit", "async_direct", "p50_us"),
    "shared_hit_over_decode_p50": ("shared_hit", "shared_decode", "p50_us"),
    "shared_over_local_p50": ("shared_hit", "shared_local_hit", "p50_us"),
    "shared_hit_over_direct_p50": ("shared_hit", "shared_direct", "p50_us"),
    **{
        f"{kind}hit_over_decode_p50_after_{what}": (f"{kind}hit_after_{what}", f"{kind}decode_after_{what}", "p50_us")
        for kind in ("", "async_", "shared_")
        for what in ("direct", "other")
    },
}
#: The cache's own cost of a hit, in microseconds: (hit, decode) of ``results``.
COSTS = {
    "hit_minus_decode_p50_us": ("hit", "decode"),
    "async_hit_minus_decode_p50_us": ("async_hit", "async_decode"),
    "shared_hit_minus_decode_p50_us": ("shared_hit", "shared_decode"),
    "shared_local_hit_minus_decode_p50_us": ("shared_local_hit", "shared_decode"),
}
#: What a full run is held to (README's figures; docs/benchmarks.md, "Targets").
TARGETS = (
    kit.Target("ratios.hit_over_direct_p50", "<=", 0.1),
    kit.Target("ratios.async_hit_over_direct_p50", "<=", 0.1),
    kit.Target("ratios.hit_over_decode_p50", "<=", 1.0),
    kit.Target("ratios.async_hit_over_decode_p50", "<=", 1.0),
)
#: ... and with ``--shared``.
SHARED_TARGETS = (
    kit.Target("ratios.shared_hit_over_decode_p50", "<=", 0.75),
    kit.Target("ratios.shared_over_local_p50", ">=", 0.9),
)


def _verify(what: str, mismatches: int, hits: int, misses: int, samples: int) -> None:
    """Every timed result right, every timed cache read a hit."""
    if mismatches or hits != samples or misses:
        raise RuntimeError(
            f"{what}verification failed: {mismatches} mismatching results, "
            f"{hits} hits and {misses} misses for {samples} cached reads"
        )


def _by_id(view: Any, expected: list[Any]) -> list[Any]:
    """A ``find_one`` by ``_id`` of each expected document: the reads that warm ``view``'s cache."""
    return [functools.partial(view.find_one, {"_id": d["_id"]}) for d in expected]


async def _measure_async(
    uri: str, db_name: str, expected: list[Any], raw_by_id: dict[int, bytes], order: list[int], seed: int
) -> dict[str, list[int]]:
    """The async columns: decode, ``await`` cached hit, ``await`` direct read,
    interleaved per sample in a random order like the sync ones."""
    async with kit.worker_client(uri, True, None) as (client, manager):
        coll, cached = client[db_name]["docs"], manager[db_name]["docs"]
        codec = coll.codec_options
        await kit.warmed_ready(manager, _by_id(cached, expected), 30)
        for d in expected[:200]:
            decode_bson(raw_by_id[d["_id"]], codec)
            await cached.find_one({"_id": d["_id"]})
            await coll.find_one({"_id": d["_id"]})
        await asyncio.sleep(kit.SETTLE_S)
        before = manager.snapshot()
        # (name, call, awaited): the decode is not awaited; its result is the document.
        ops = [
            ("async_decode", lambda f, raw: decode_bson(raw, codec), False),
            ("async_hit", lambda f, raw: cached.find_one(f), True),
            ("async_direct", lambda f, raw: coll.find_one(f), True),
        ]
        times = _by_predecessor([name for name, _, _ in ops])
        clock = time.perf_counter_ns
        mismatches = 0
        prev = ""
        gc.collect()
        for i, perm in zip(order, kit.orders(len(ops), len(order), seed), strict=True):
            want = expected[i]
            raw = raw_by_id[i]
            filt = {"_id": i}
            for k in perm:
                name, fn, awaited = ops[k]
                t0 = clock()
                got = fn(filt, raw)
                if awaited:
                    got = await got
                t1 = clock()
                _record(times, name, prev, t1 - t0)
                prev = name
                mismatches += got != want
                del got
        counts = kit.counted(before, manager.snapshot())
    _verify("async ", mismatches, counts["hits"], counts["misses"], len(order))
    return times


def _interleave(
    coll: Any,
    views: dict[str, Any],
    order: list[int],
    expected: Any,
    raw_by_id: Any,
    seed: int,
    prefix: str = "",
    direct: bool = True,
) -> tuple[dict[str, list[int]], int]:
    """Time the decode, a ``find_one`` through each cached view of ``coll``
    and (if ``direct``) a direct ``find_one`` once per sample, in a random
    order per sample (``kit.orders``), and check every result after its stop
    timestamp. Returns samples per op (named with ``prefix``) and mismatches."""
    codec = coll.codec_options
    ops = [("decode", lambda f, raw: decode_bson(raw, codec))]
    ops += [(name, lambda f, raw, view=view: view.find_one(f)) for name, view in views.items()]
    if direct:
        ops.append(("direct", lambda f, raw: coll.find_one(f)))
    times = _by_predecessor([name for name, _ in ops])
    clock = time.perf_counter_ns
    mismatches = 0
    prev = ""
    gc.collect()
    for i, perm in zip(order, kit.orders(len(ops), len(order), seed), strict=True):
        want = expected[i]
        raw = raw_by_id[i]
        filt = {"_id": i}
        for k in perm:
            name, fn = ops[k]
            t0 = clock()
            got = fn(filt, raw)
            t1 = clock()
            _record(times, name, prev, t1 - t0)
            prev = name
            mismatches += got != want
            del got
    return {prefix + name: t for name, t in times.items()}, mismatches


def _by_predecessor(names: list[str]) -> dict[str, list[int]]:
    """Each op's samples, and those of every op but the direct read split by
    what ran just before it: the direct read (``<op>_after_direct``), whose
    network round trip and PyMongo code evict much of the CPU caches (and
    warm PyMongo's decoder), or another op (``<op>_after_other``)."""
    split = [f"{name}_after_{what}" for name in names if not name.endswith("direct") for what in ("direct", "other")]
    return {name: [] for name in names + split}


def _record(times: dict[str, list[int]], name: str, prev: str, ns: int) -> None:
    times[name].append(ns)
    if not name.endswith("direct"):
        times[f"{name}_after_{'direct' if prev.endswith('direct') else 'other'}"].append(ns)


def _measure_shared(
    uri: str, db_name: str, expected: list[Any], raw_by_id: dict[int, bytes], order: list[int], seed: int
) -> dict[str, list[int]]:
    """decode, process-local hit, shared hit, direct read, interleaved; the
    shared cache's owner uses the public benchmark's geometry (32 MiB budget,
    40 MiB arena, 16,384 slots)."""
    with kit.owned(kit.new_name("hitpath"), uri, **kit.OWNER_GEOMETRY) as owner, pymongo.MongoClient(uri) as client:
        coll = client[db_name]["docs"]
        with CacheManager(client) as local, CacheManager(client, shared=owner.name) as shared:
            local_docs, shared_docs = local[db_name]["docs"], shared[db_name]["docs"]
            # The owner admits a worker's misses asynchronously, and reads go
            # to MongoDB until the stream has applied what the misses saw.
            for manager, view in ((local, local_docs), (shared, shared_docs)):
                kit.warm_ready(manager, _by_id(view, expected), 30)
            time.sleep(kit.SETTLE_S)
            before = (local.snapshot(), shared.snapshot())
            views = {"local_hit": local_docs, "hit": shared_docs}
            times, mismatches = _interleave(coll, views, order, expected, raw_by_id, seed, "shared_")
            for what, manager, then in (("shared ", shared, before[1]), ("shared phase local ", local, before[0])):
                counts = kit.counted(then, manager.snapshot())
                _verify(what, mismatches, counts["hits"], counts["misses"], len(order))
    return times


def _scale_sizes(most: int) -> list[int]:
    """1,000, 10,000, ... up to ``most`` (which ends the list)."""
    sizes = [n for n in (10**k for k in range(3, 7)) if n < most]
    return sizes + [most]


def _measure_scale(uri: str, db_name: str, most: int, samples: int, seed: int) -> dict[str, Any]:
    """Hit latency as the cache fills with small entries: at each size, hits
    of documents drawn from the admitted ones, interleaved with decoding the
    same bytes. The entries are admitted by real misses (16 threads)."""
    rng = random.Random(seed)
    with pymongo.MongoClient(uri, maxPoolSize=32) as client:
        coll = client[db_name]["small"]
        raws = [bson.encode({"_id": i, "n": i, "s": f"v{i:07d}"}) for i in range(most)]
        kit.progress(f"scale: inserting {most} small documents...")
        kit.insert_raw(coll, raws, batch=10_000)
        # Room for every entry with the table at most half full.
        slots = max(1024, 1 << (2 * most - 1).bit_length())
        sizes: dict[str, Any] = {}
        with CacheManager(client, budget_bytes=min(0xF0000000, 512 * most + 64 * 2**20), slot_count=slots) as manager:
            view = manager[db_name]["small"]
            kit.register(manager, view, db_name, 30, label="scale: ")
            filled = 0
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for size in _scale_sizes(most):
                    kit.progress(f"scale: admitting documents {filled}..{size - 1}...")
                    for _ in pool.map(lambda i: view.find_one({"_id": i}), range(filled, size), chunksize=256):
                        pass
                    filled = size
                    order = [rng.randrange(size) for _ in range(samples)]
                    sizes[str(size)] = _scale_step(manager, view, coll, raws, size, order, seed + size)
    first, last = sizes[str(_scale_sizes(most)[0])], sizes[str(most)]
    return {
        "sizes": sizes,
        "hit_p50_last_over_first": last["hit"]["p50_us"] / first["hit"]["p50_us"],
        "decode_p50_last_over_first": last["decode"]["p50_us"] / first["decode"]["p50_us"],
    }


def _scale_step(
    manager: Any, view: Any, coll: Any, raws: list[bytes], size: int, order: list[int], seed: int
) -> dict[str, Any]:
    """One size of the scale phase, documents 0..size-1 admitted: hits of
    ``order`` interleaved with decoding, every hit checked."""
    if manager.snapshot().entries < size:
        raise kit.BenchmarkFailed(f"scale: {manager.snapshot().entries} entries for {size} documents")
    kit.warm_ready(manager, _by_id(view, [{"_id": i} for i in order[:1000]]), 60)
    expected = {i: bson.decode(raws[i], coll.codec_options) for i in order}
    time.sleep(kit.SETTLE_S)
    before = manager.snapshot()
    times, mismatches = _interleave(coll, {"hit": view}, order, expected, raws, seed, direct=False)
    counts = kit.counted(before, manager.snapshot())
    _verify(f"scale, {size} documents: ", mismatches, counts["hits"], counts["misses"], len(order))
    return {name: kit.summarize(t) for name, t in times.items()} | {"entries": manager.snapshot().entries}


def _run(uri: str, docs: int, samples: int, seed: int, shared: bool, scale: int) -> dict[str, Any]:
    kit.progress(f"measuring {samples} samples...")
    rng = random.Random(seed)
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(uri)
    db_name = f"cqc_bench_hit_{int(time.time())}_{rng.randint(0, 10**6)}"
    coll = client[db_name]["docs"]
    setup_started = time.perf_counter()
    try:
        inserted = [kit.make_document(i, rng) for i in range(docs)]
        coll.insert_many(inserted)
        sizes = [len(bson.encode(d)) for d in inserted]
        raw_by_id = {d["_id"]: bson.encode(d) for d in inserted}
        codec = coll.codec_options
        # What a read must return: the stored document as this collection's
        # codec options decode it (naive UTC datetimes by default).
        expected = [bson.decode(raw_by_id[d["_id"]], codec) for d in inserted]
        with CacheManager(client) as manager:
            cached = manager[db_name]["docs"]
            # Warm-up: admit every document (until all are served), then
            # exercise all three paths.
            kit.warm_ready(manager, _by_id(cached, expected), 30)
            for d in expected[:200]:
                decode_bson(raw_by_id[d["_id"]], codec)
                cached.find_one({"_id": d["_id"]})
                coll.find_one({"_id": d["_id"]})
            time.sleep(kit.SETTLE_S)
            before = manager.snapshot()
            setup_seconds = time.perf_counter() - setup_started
            order = [rng.randrange(docs) for _ in range(samples)]
            times, mismatches = _interleave(coll, {"hit": cached}, order, expected, raw_by_id, seed)
            counts = kit.counted(before, manager.snapshot())
        verification = {
            "checked_reads": 6 * samples,
            "mismatches": mismatches,
            "timed_hits": counts["hits"],
            "timed_misses": counts["misses"],
        }
        _verify("", mismatches, verification["timed_hits"], verification["timed_misses"], samples)
        kit.progress("measuring the async columns...")
        times |= asyncio.run(_measure_async(uri, db_name, expected, raw_by_id, order, seed + 1))
        if shared:
            kit.progress("measuring the shared cache...")
            times |= _measure_shared(uri, db_name, expected, raw_by_id, order, seed + 2)
        scaled = _measure_scale(uri, db_name, scale, min(samples, 5000), seed + 3) if scale else None
    finally:
        client.drop_database(db_name)
        client.close()
    results = {name: kit.summarize(t) for name, t in times.items()}
    ratios = {name: results[a][q] / results[b][q] for name, (a, b, q) in RATIOS.items() if a in results}
    if scaled:
        ratios[f"scale_hit_{scale}_over_1000_entries_p50"] = scaled["hit_p50_last_over_first"]
    return {
        "schema": SCHEMA,
        "method": METHOD | ({"shared": SHARED_METHOD} if shared else {}) | ({"scale": SCALE_METHOD} if scale else {}),
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
        "results": results,
        "ratios": ratios,
        "costs_us": {
            name: results[a]["p50_us"] - results[b]["p50_us"] for name, (a, b) in COSTS.items() if a in results
        },
        "verification": verification,
    } | ({"scale": scaled} if scaled else {})


#: The printed ratios: (label, ratio, cost printed next to it).
LINES = (
    ("hit/decode p50", "hit_over_decode_p50", "hit_minus_decode_p50_us"),
    ("hit/direct p50", "hit_over_direct_p50", "hit_minus_decode_p50_us"),
    ("async hit/decode p50", "async_hit_over_decode_p50", "async_hit_minus_decode_p50_us"),
    ("async hit/direct p50", "async_hit_over_direct_p50", "async_hit_minus_decode_p50_us"),
    ("shared hit/decode p50", "shared_hit_over_decode_p50", "shared_hit_minus_decode_p50_us"),
    ("shared/local hit p50", "shared_over_local_p50", None),
)


def _print(report: dict[str, Any]) -> None:
    cfg, ratios = report["config"], report["ratios"]
    print(
        f"hit path: {cfg['documents']} documents of ~{cfg['document_bytes_mean']:.0f} B, "
        f"{cfg['samples']} interleaved samples per operation"
    )
    columns = [("operation", "<14"), ("p50 us", ">10.2f"), ("p95 us", ">10.2f"), ("p99 us", ">10.2f")]
    kit.table(columns, [(name, r["p50_us"], r["p95_us"], r["p99_us"]) for name, r in report["results"].items()])
    costs = report["costs_us"]
    for label, ratio, cost in LINES:
        if ratio in ratios:
            extra = f"  (the cache's own cost: {costs[cost]:+.2f} us)" if cost else ""
            print(f"{label}: {ratios[ratio]:.4g}{extra}")
    after = [(k, v) for k, v in ratios.items() if "_after_" in k]
    if after:
        shown = ", ".join(f"{k.replace('hit_over_decode_p50_', '')} {v:.3g}" for k, v in after)
        print(f"hit/decode p50 by the op just before: {shown}")
    if "scale" in report:
        print("scale: hits as the cache fills with small entries (no direct reads between)")
        rows = [
            (size, r["entries"], r["decode"]["p50_us"], r["hit"]["p50_us"], r["hit"]["p99_us"])
            for size, r in report["scale"]["sizes"].items()
        ]
        columns = [("documents", "<10"), ("entries", ">9"), ("decode p50", ">11.2f")]
        kit.table(columns + [("hit p50", ">9.2f"), ("hit p99", ">9.2f")], rows)
        name = next(k for k in ratios if k.startswith("scale_"))
        print(f"{name}: {ratios[name]:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = kit.parser("hit_path", __doc__, seed=20261203)
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--shared", action="store_true", help="also measure a shared-cache hit (starts an owner)")
    parser.add_argument(
        "--scale",
        type=int,
        nargs="?",
        const=1_000_000,
        default=0,
        metavar="ENTRIES",
        help="also measure hits as the cache fills with small entries, from 1,000 to ENTRIES (default 1,000,000)",
    )
    args = parser.parse_args(argv)
    if args.scale and args.scale < 1000:
        parser.error("--scale needs at least 1000 entries")
    samples = args.samples or (2000 if args.quick else 20000)
    report = kit.with_server(lambda uri: _run(uri, args.documents, samples, args.seed, args.shared, args.scale))
    if report is None:
        return 1
    report["mode"] = "quick" if args.quick else "full"
    targets = TARGETS + (SHARED_TARGETS if args.shared else ())
    return kit.conclude(report, None, _print, args.json, targets=targets, quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
