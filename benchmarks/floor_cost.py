"""The causal floor's cost: which reads go to MongoDB because of it, per access pattern.

A process never reads older than it has seen (docs/consistency.md, "Causal
reads"): a lookup whose entry may be older than something the process
already read or written in its scope is refused and read from MongoDB as a
miss (``CacheSnapshot.behind``). This harness measures that share in the
patterns an application makes, with a process-local cache and with a shared
one (one worker, sync):

* ``read_back``: write one document by ``_id`` through the view, read it back;
* ``read_others``: write one document by ``_id``, then read three other
  documents by ``_id`` and a list (``find`` with a limit);
* ``rare_own_writes``: reads of random documents, one own write per 100;
* ``other_writes``: reads of random documents while another client writes
  random ones (about 50 a second);
* ``new_connections``: reads of random documents, no writes, a new client
  connecting (and pinging) every ``--connect-every`` seconds, which the test
  server counts as ticks of its cluster time.

Every read is checked: a read-back returns the version just written, any
other read a version of the right document no older than the last one this
process saw (monotonic). Reported per pattern and mode: reads, hits,
misses, ``behind`` (refused by the floor) and its share; in the patterns
with writes, the read-back's share and the others' share apart.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pymongo

from . import _kit as kit

PATTERNS = ("read_back", "read_others", "rare_own_writes", "other_writes", "new_connections")
MODES = ("local", "shared")

#: Targets of a full run (the floor's cost where nothing makes it necessary).
TARGETS = [
    kit.Target("patterns.read_others.*.others_behind_share", "<=", 0.02),
    kit.Target("patterns.new_connections.*.behind_share", "<=", 0.005),
]


def _docs(count: int) -> list[dict[str, Any]]:
    return [{"_id": i, "n": 0, "pad": "x" * 200} for i in range(count)]


class _Seen:
    """The newest version of each document this process read or wrote."""

    def __init__(self) -> None:
        self.version: dict[int, int] = {}
        self.problems: list[str] = []

    def check(self, pattern: str, doc: Any, _id: int, at_least: int | None = None) -> None:
        if doc is None or doc.get("_id") != _id:
            self.problems.append(f"{pattern}: read of {_id} returned {doc!r}")
            return
        floor = self.version.get(_id, 0) if at_least is None else at_least
        if doc["n"] < floor:
            self.problems.append(f"{pattern}: read of {_id} went back to version {doc['n']} after {floor}")
        self.version[_id] = max(self.version.get(_id, 0), doc["n"])


def _counted(manager: Any, run: Callable[[], dict[str, int]]) -> dict[str, Any]:
    before = manager.snapshot()
    extra = run()
    out = kit.counted(before, manager.snapshot())
    reads = out["hits"] + out["misses"] + out["behind"] + out["bypasses"]
    out.update(reads=reads, behind_share=out["behind"] / reads if reads else 0.0, **extra)
    return out


def _pattern(name: str, coll: Any, raw: Any, other: Any, uri: str, args: Any, seen: _Seen) -> dict[str, int]:
    rng = random.Random(f"{args.seed}-{name}")
    ids = list(range(args.documents))
    extra = {"read_backs": 0, "read_backs_behind": 0, "others": 0, "others_behind": 0}
    manager_snapshot = coll._core.engine.snapshot  # the counters of this manager

    def read(_id: int, counter: str | None = None) -> None:
        before = manager_snapshot().behind
        doc = coll.find_one({"_id": _id})
        seen.check(name, doc, _id)
        if counter is not None:
            extra[counter] += 1
            extra[counter + "_behind"] += manager_snapshot().behind - before

    def write(_id: int) -> None:
        version = seen.version.get(_id, 0) + 1
        coll.update_one({"_id": _id}, {"$set": {"n": version}})
        seen.version[_id] = version

    if name == "read_back":
        for _ in range(args.rounds):
            _id = rng.choice(ids)
            write(_id)
            read(_id, "read_backs")
            time.sleep(args.pause)
    elif name == "read_others":
        for _ in range(args.rounds):
            _id = rng.choice(ids)
            write(_id)
            for other_id in rng.sample([i for i in ids if i != _id], 3):
                read(other_id, "others")
            before = manager_snapshot().behind
            listed = list(coll.find({}, sort=[("_id", 1)], limit=10))
            for doc in listed:
                seen.check(name, doc, doc["_id"])
            extra["others"] += 1
            extra["others_behind"] += manager_snapshot().behind - before
            time.sleep(args.pause)
    elif name == "rare_own_writes":
        for i in range(args.rounds * 5):
            if i % 100 == 99:
                write(rng.choice(ids))
            read(rng.choice(ids))
    elif name == "other_writes":
        stop = threading.Event()

        def writer() -> None:
            wrng = random.Random(f"{args.seed}-writer")
            while not stop.is_set():
                other.update_one({"_id": wrng.choice(ids)}, {"$inc": {"n": 1}})
                time.sleep(0.02)

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            for _ in range(args.rounds * 5):
                read(rng.choice(ids))
                time.sleep(args.pause / 5)
        finally:
            stop.set()
            t.join()
    elif name == "new_connections":
        next_connect = time.monotonic()
        for _ in range(args.rounds * 5):
            if time.monotonic() >= next_connect:
                with pymongo.MongoClient(uri) as fresh:
                    fresh.admin.command("ping")
                next_connect = time.monotonic() + args.connect_every
            read(rng.choice(ids))
            time.sleep(args.pause / 5)
    return extra


def _run_mode(mode: str, uri: str, args: Any, status: kit.Status) -> dict[str, Any]:
    from client_query_cache import CacheManager

    db = kit.new_name("cqc_floor").replace("-", "_")
    seed = pymongo.MongoClient(uri)
    seed[db].items.insert_many(_docs(args.documents))
    client = pymongo.MongoClient(uri)
    other = pymongo.MongoClient(uri)
    results: dict[str, Any] = {}
    problems: list[str] = []
    owner = kit.start_owner(kit.new_name("cqc-floor"), uri, max_await_time_ms=args.max_await_ms) if mode == "shared" else None
    try:
        options = {"max_await_time_ms": args.max_await_ms}
        manager = CacheManager(client, shared=owner.name, **options) if owner else CacheManager(client, **options)
        with manager:
            coll = manager[db]["items"]
            if not manager.wait_ready(30, database=db):
                raise kit.BenchmarkFailed(f"{mode}: the change stream did not become ready")
            for pattern in args.patterns:
                status(f"{mode}: {pattern}")
                for _id in range(args.documents):  # warm: every document cached
                    coll.find_one({"_id": _id})
                time.sleep(2.5 * args.max_await_ms / 1000)
                seen = _Seen()
                seen.version = {d["_id"]: d["n"] for d in seed[db].items.find({}, {"n": 1})}
                results[pattern] = _counted(
                    manager, lambda: _pattern(pattern, coll, coll.raw, other[db].items, uri, args, seen)
                )
                r = results[pattern]
                for key in ("read_backs", "others"):
                    r[f"{key}_behind_share"] = r[f"{key}_behind"] / r[key] if r[key] else 0.0
                problems += seen.problems[: kit.MAX_EXAMPLES]
    finally:
        if owner is not None:
            kit.stop_owner(owner)
        seed.drop_database(db)
        for c in (seed, client, other):
            c.close()
    return {"patterns": results, "problems": problems}


def run(args: Any, uri: str, status: kit.Status) -> dict[str, Any]:
    report: dict[str, Any] = {
        "benchmark": "floor_cost",
        "machine": kit.machine_facts(),
        "settings": {k: getattr(args, k) for k in ("documents", "rounds", "pause", "connect_every", "max_await_ms")},
        "patterns": {p: {} for p in args.patterns},
        "problems": [],
    }
    for mode in args.modes:
        out = _run_mode(mode, uri, args, status)
        for pattern, r in out["patterns"].items():
            report["patterns"][pattern][mode] = r
        report["problems"] += out["problems"]
    return report


def print_report(report: dict[str, Any]) -> None:
    rows = []
    for pattern, modes in report["patterns"].items():
        for mode, r in modes.items():
            rows.append(
                (
                    pattern, mode, r["reads"], r["hits"], r["misses"], r["behind"], f"{r['behind_share']:.3f}",
                    f"{r['read_backs_behind_share']:.3f}" if r["read_backs"] else "-",
                    f"{r['others_behind_share']:.3f}" if r["others"] else "-",
                )
            )  # fmt: skip
    kit.table(
        [
            ("pattern", "<"), ("mode", "<"), ("reads", ">"), ("hits", ">"), ("misses", ">"), ("behind", ">"),
            ("behind share", ">"), ("read-back behind", ">"), ("others behind", ">"),
        ],
        rows,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = kit.parser("floor_cost", __doc__)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--patterns", type=kit.csv(PATTERNS), default=PATTERNS)
    parser.add_argument("--modes", type=kit.csv(MODES), default=MODES)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=None, help="writes (or reads / 5) per pattern")
    parser.add_argument("--pause", type=float, default=0.01, help="seconds between rounds")
    parser.add_argument("--connect-every", type=float, default=2.0)
    parser.add_argument("--max-await-ms", type=int, default=1000)
    args = parser.parse_args(argv)
    kit.defaults(args, {"rounds": 40 if args.quick else 400})
    kit.at_least_one(parser, args, ["documents", "rounds"])
    return kit.checked_main(
        args,
        run,
        lambda report: report["problems"],
        print_report,
        timed=True,
        targets=TARGETS,
        quick=args.quick,
    )


if __name__ == "__main__":
    raise SystemExit(main())
