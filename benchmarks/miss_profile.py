"""What a cache miss costs on top of a direct read.

A profiling aid, not a harness with targets: it explains the cold-window
figure of ``benchmarks.public_shared_cache`` (docs/benchmarks.md, "Where a
miss's time goes"). Each of ``--workers`` processes (1: this one; more:
spawned, reading at once, as the benchmark's four workers do) holds one
cached view (process-local, or attached to one owner started with the
benchmark's geometry) and its client's collection at read concern majority.
Each sample is a miss of a document nobody read before
(``view.find_one({"_id": new})``) and a direct read of another new one, in
alternating order, so both see the same machine. Per sample it records the
wall time and the thread's CPU time (``time.thread_time_ns``: the client's
own work, without the server's or the owner's) of both reads, and the CPU
time of a third miss's steps as the facades run them: ``fast_find_one`` (C
lookup, plan, token), ``miss_read`` (PyMongo's read of raw BSON; with the
async API the event loop's other work while it waits is in it too) and
``finish`` (causal floor, admission, the decoded copy). It prints
nearest-rank p50s over every worker's samples.

    python -m benchmarks.miss_profile [--samples 300] [--workers 1] [--paths local,shared] [--modes sync,async]

Uses the disposable server unless MONGODB_URI names a deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import time
from typing import Any

import pymongo
from pymongo.read_concern import ReadConcern

from . import _kit as kit

SERIES = ("miss", "direct", "miss_cpu", "direct_cpu", "diff", "fast_find_one", "miss_read", "finish")


def _p50(values: list[int]) -> float:
    return kit.quantile(sorted(values), 50) / 1e3


async def _measure(spec: dict[str, Any], start: Any) -> dict[str, list[int]]:
    """One worker's samples (ns) of every series, and its misses and bypasses."""
    import client_query_cache as cqc

    is_async = spec["mode"] == "async"
    client: Any = (pymongo.AsyncMongoClient if is_async else pymongo.MongoClient)(spec["uri"])
    manager_cls = cqc.AsyncCacheManager if is_async else cqc.CacheManager
    manager = manager_cls(client, shared=spec["owner"]) if spec["owner"] else manager_cls(client)

    async def r(value: Any) -> Any:
        return await value if is_async else value

    try:
        view = manager[spec["db"]]["c"]
        direct = client[spec["db"]]["c"].with_options(read_concern=ReadConcern("majority"))
        await r(view.find_one({"_id": 0}))  # registers the namespace, probes the collection
        if not await r(manager.wait_ready(60, database=spec["db"])):
            raise RuntimeError("the change stream did not become ready")
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        out: dict[str, list[int]] = {k: [] for k in SERIES}
        core = view._core
        next_id = spec["first_id"]
        for k in range(spec["samples"] + 10):  # the first 10 warm up
            if k == 10:  # every worker starts its samples at once
                if is_async:
                    await asyncio.to_thread(start)
                else:
                    start()
                before = manager.snapshot()
            pair = {}
            for what in ("miss", "direct") if k % 2 else ("direct", "miss"):
                flt = {"_id": next_id}
                next_id += 1
                w0, c0 = wall(), cpu()
                got = await r((view if what == "miss" else direct).find_one(flt))
                pair[what] = (wall() - w0, cpu() - c0)
                assert got is not None and got["_id"] == flt["_id"]
            # The miss's steps, as the facade runs them (no server time in a CPU clock).
            flt = {"_id": next_id}
            next_id += 1
            c0 = cpu()
            step = core.fast_find_one(flt)
            c1 = cpu()
            raw = await r(core.miss_read(step))
            c2 = cpu()
            got = core.finish(step, raw)
            c3 = cpu()
            assert got["_id"] == flt["_id"]
            if k >= 10:
                values = (
                    pair["miss"][0], pair["direct"][0], pair["miss"][1], pair["direct"][1],
                    pair["miss"][0] - pair["direct"][0], c1 - c0, c2 - c1, c3 - c2,
                )  # fmt: skip
                for name, value in zip(SERIES, values):
                    out[name].append(value)
        after = manager.snapshot()
        # 2 misses per sample: the timed one and the steps'; no bypass.
        out["counts"] = [after.misses - before.misses, after.bypass_total - before.bypass_total]
        return out
    finally:
        await r(manager.close())
        await r(client.close())


def _worker(spec: dict[str, Any], barrier: Any, results: Any) -> None:
    """A spawned worker: its samples on the queue (an error's text if it failed)."""
    try:
        results.put(asyncio.run(_measure(spec, lambda: barrier.wait(600))))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        barrier.abort()
        results.put(f"{type(exc).__name__}: {exc}")


def _run(uri: str, db: str, path: str, mode: str, workers: int, samples: int, first_id: int) -> dict[str, float]:
    owner = kit.start_owner(kit.new_name("missprof"), uri, **kit.OWNER_GEOMETRY) if path == "shared" else None
    per_worker = 3 * (samples + 10)
    specs = [
        {"uri": uri, "db": db, "mode": mode, "owner": owner.name if owner else None, "samples": samples,
         "first_id": first_id + w * per_worker}
        for w in range(workers)
    ]  # fmt: skip
    try:
        if workers == 1:
            parts = [asyncio.run(_measure(specs[0], lambda: None))]
        else:
            ctx = kit.context()
            barrier, results = ctx.Barrier(workers), ctx.Queue()
            procs = [kit.spawn(_worker, spec, barrier, results) for spec in specs]
            parts = [results.get(timeout=900) for _ in procs]
            for p in procs:
                p.join(60)
            failed = [p for p in parts if isinstance(p, str)]
            if failed:
                raise RuntimeError(f"a worker failed: {failed[0]}")
    finally:
        if owner is not None:
            kit.stop_owner(owner)
    pooled = {k: [v for part in parts for v in part[k]] for k in SERIES}
    report = {f"{k}_p50_us": _p50(v) for k, v in pooled.items()}
    report["miss_over_direct_p50"] = report["miss_p50_us"] / report["direct_p50_us"]
    report["misses"] = sum(part["counts"][0] for part in parts)
    report["bypasses"] = sum(part["counts"][1] for part in parts)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.miss_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=300, help="samples per worker (default 300)")
    parser.add_argument("--workers", type=int, default=1, help="processes reading at once (default 1)")
    parser.add_argument("--paths", default="local,shared")
    parser.add_argument("--modes", default="sync,async")
    args = parser.parse_args(argv)
    rng = random.Random(20261205)
    per_run = 3 * (args.samples + 10) * args.workers
    runs = [(p, m) for p in args.paths.split(",") for m in args.modes.split(",")]
    with kit.server() as uri:
        setup: Any = pymongo.MongoClient(uri)
        db = f"cqc_miss_profile_{secrets.token_hex(4)}"
        try:
            docs = [kit.make_document(i, rng) for i in range(per_run * len(runs) + 1)]
            for start in range(0, len(docs), 500):
                setup[db]["c"].insert_many(docs[start : start + 500])
            for n, (path, mode) in enumerate(runs):
                report = _run(uri, db, path, mode, args.workers, args.samples, 1 + n * per_run)
                figures = ", ".join(f"{k} {v:.3f}" if k.endswith("_p50") else f"{k} {v:g}" for k, v in report.items())
                print(f"{path} {mode} x{args.workers}: {figures}", flush=True)
        finally:
            setup.drop_database(db)
            setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
