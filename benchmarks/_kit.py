"""The benchmarks' kit: documents, quantiles, reports, options, and every process a harness starts.

Only this module starts processes: the disposable server (``server``), shared-cache owners
(``start_owner``, ``owned``), spawned workers (``Pool``, ``spawn``) and commands (``run_command``, ``run_to_end``).
Reference: docs/benchmarks.md, "Harness reference".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue as queue_mod
import random
import secrets
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import bson
import pymongo
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument

MiB = 1024 * 1024
#: The bypass reason of a read inside an ``after()`` block whose token the
#: stream had not applied yet: with the causal floor's refusals
#: (``CacheSnapshot.behind``), the cost of causal reads (``counted``).
BEHIND = "stream_behind"
DIGEST_BYTES = 16
MAX_EXAMPLES = 5
#: The time of what never happened (a lost write's operationTime and acknowledgement).
NEVER = (1 << 63) - 1
#: The owner's geometry of DESIGN.md's benchmark.
OWNER_GEOMETRY = {"arena_bytes": 40 * MiB, "budget_bytes": 32 * MiB, "slots": 16384}
#: What a timing harness waits after its warm-up, before the timed reads: two
#: change-stream rounds (max_await_time_ms 1 s) and a margin. Until a stream
#: round passes the warm-up's misses, a hit of one entry is an observation
#: the floor records (floor.h); after it, hits record nothing. The timed
#: hits are then the steady state's.
SETTLE_S = 2.5


class BenchmarkFailed(RuntimeError):
    """A read returned a wrong document, a process failed, or a wait timed out."""


# -- documents -------------------------------------------------------------------


def make_document(i: int, rng: random.Random, target_bytes: int = 4096) -> dict[str, Any]:
    """A realistic document of about ``target_bytes`` of BSON: scalars of
    several types, a nested document, arrays of values and of subdocuments,
    and a text field sized to reach the target."""
    base = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    doc: dict[str, Any] = {
        "_id": i,
        "ref": ObjectId(),
        "name": f"user-{i:06d}",
        "email": f"user{i}@example.test",
        "age": rng.randint(18, 90),
        "score": rng.random() * 100,
        "active": rng.random() < 0.5,
        "created": base + datetime.timedelta(seconds=rng.randint(0, 10**7)),
        "tags": [f"tag{rng.randint(0, 999)}" for _ in range(12)],
        "address": {
            "street": f"{rng.randint(1, 999)} Main Street",
            "city": rng.choice(["Lyon", "Porto", "Oslo", "Quito", "Perth"]),
            "zip": f"{rng.randint(10000, 99999)}",
            "geo": [rng.uniform(-180, 180), rng.uniform(-90, 90)],
        },
        "history": [
            {
                "at": base + datetime.timedelta(minutes=rng.randint(0, 10**6)),
                "event": rng.choice(["login", "view", "buy", "logout"]),
                "value": rng.random(),
                "count": rng.randint(0, 1000),
            }
            for _ in range(16)
        ],
        "version": 1,
    }
    doc["bio"] = filler(doc, rng, target_bytes)
    return doc


def filler(doc: dict[str, Any], rng: random.Random, target_bytes: int) -> str:
    """Words that bring ``doc`` to about ``target_bytes`` of BSON (a running
    total, not a sum over the words each time round: linear time)."""
    filled = len(bson.encode(doc)) + 12
    words = []
    while filled < target_bytes:
        word = rng.choice(["lorem", "ipsum", "dolor", "sit", "amet", "cache", "mongo"])
        words.append(word)
        filled += len(word) + 1
    return " ".join(words)


def digest(raw: bytes) -> bytes:
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).digest()


def insert_raw(coll: Any, raws: Sequence[bytes], batch: int = 500) -> None:
    for start in range(0, len(raws), batch):
        coll.insert_many([RawBSONDocument(r) for r in raws[start : start + batch]], ordered=False)


class Expected:
    """What a read of a document at a given version must return: the inserted
    document with its ``version`` field set to that version, as the
    collection's codec options decode it (compared by digest of the BSON)."""

    def __init__(self, raws: Sequence[bytes], codec: Any) -> None:
        self._codec = codec
        self._base = [bson.decode(raw, codec) for raw in raws]
        for k, (doc, raw) in enumerate(zip(self._base, raws)):
            if bson.encode(doc, codec_options=codec) != raw:
                raise BenchmarkFailed(f"document {k} does not survive a decode/encode round trip")
        self._digests: dict[tuple[int, int], bytes] = {}

    def digest(self, key: int, version: int) -> bytes:
        if (key, version) not in self._digests:
            doc = {**self._base[key], "version": version}
            self._digests[key, version] = digest(bson.encode(doc, codec_options=self._codec))
        return self._digests[key, version]

    def check(self, got: Any, want: int | None = None) -> tuple[int, int] | str:
        """(document, version) of a read result (of document ``want``, if
        given), or why it is wrong."""
        if got is None:
            return "no document"
        key, version = got.get("_id"), got.get("version")
        if type(key) is not int or not 0 <= key < len(self._base) or want not in (None, key):
            return f"_id {key!r}"
        if type(version) is not int:
            return f"version {version!r}"
        if digest(bson.encode(got, codec_options=self._codec)) != self.digest(key, version):
            return f"content differs from document {key} at version {version}"
        return key, version


# -- quantiles, counters, managers -----------------------------------------------


def orders(ops: int, samples: int, seed: int | str) -> list[list[int]]:
    """The order of ``ops`` operations in each of ``samples`` interleaved
    samples: a random permutation each (seeded). A fixed or rotating order
    gives some operation a given predecessor more often than the others: a
    direct read, which evicts much of the CPU caches, makes the operation after
    it slower (rotating three, the first two follow it twice and once in three
    samples, the third never)."""
    rng = random.Random(seed)
    return [rng.sample(range(ops), ops) for _ in range(samples)]


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank quantile: the value at index ceil(p/100*n) - 1."""
    n = len(sorted_values)
    if n == 0:
        return float("nan")
    idx = max(0, math.ceil(p / 100.0 * n) - 1)
    return sorted_values[min(idx, n - 1)]


def summarize(samples_ns: Sequence[int]) -> dict[str, float]:
    """p50/p95/p99/mean in microseconds."""
    s = sorted(samples_ns)
    return {
        "n": len(s),
        "p50_us": quantile(s, 50) / 1000.0,
        "p95_us": quantile(s, 95) / 1000.0,
        "p99_us": quantile(s, 99) / 1000.0,
        "mean_us": (sum(s) / len(s) / 1000.0) if s else float("nan"),
    }


def in_ms(samples_ns: Sequence[int]) -> dict[str, float]:
    """n and nearest-rank p50/p95/p99/max, in milliseconds."""
    s = sorted(samples_ns)
    out: dict[str, float] = {"n": len(s)}
    for name, p in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100)):
        out[name] = quantile(s, p) / 1e6
    return out


def counted(before: Any, after: Any, names: Sequence[str] = ("hits", "misses")) -> dict[str, int]:
    """What a manager counted between two snapshots: each of ``names``;
    ``behind``, the reads that went to MongoDB because their entry may be
    older than what the process had seen (the causal floor, counted in
    ``CacheSnapshot.behind``) or than an ``after()`` token (the bypass
    reason ``stream_behind``); and ``bypasses``, for any other reason."""
    out = {name: getattr(after, name) - getattr(before, name) for name in names}
    tokens = after.bypasses.get(BEHIND, 0) - before.bypasses.get(BEHIND, 0)
    out["behind"] = after.behind - before.behind + tokens
    out["bypasses"] = after.bypass_total - before.bypass_total - tokens
    return out


async def warmed(manager: Any, reads: Sequence[Callable[[], Any]], timeout: float, pause: float = 0.1) -> int:
    """Call every read (awaiting an async API's) until a whole pass is served
    from the cache; return the passes it took (0 if ``timeout`` seconds
    passed first). Misses admit on the first pass; a read can go to MongoDB
    for a while longer, until the stream has applied what the process's
    misses saw (the causal floor, up to two stream rounds)."""
    deadline = time.monotonic() + timeout
    passes = 0
    while True:
        passes += 1
        before = manager.snapshot().hits
        for read in reads:
            await resolved(read())
        if manager.snapshot().hits - before == len(reads):
            return passes
        if time.monotonic() > deadline:
            return 0
        await asyncio.sleep(pause)


async def warmed_ready(
    manager: Any, reads: Sequence[Callable[[], Any]], timeout: float, database: str | None = None, *, label: str = ""
) -> int:
    """Wait until the change streams (of ``database``, or all) serve, then
    ``warmed``; the passes it took. Either taking longer than ``timeout``
    seconds fails the benchmark (the message starts with ``label``)."""
    if not await resolved(manager.wait_ready(timeout, database)):
        raise BenchmarkFailed(f"{label}the change stream did not become ready within {timeout:g} s")
    passes = await warmed(manager, reads, timeout)
    if not passes:
        raise BenchmarkFailed(f"{label}the warm-up reads are not all served from the cache after {timeout:g} s")
    return passes


def warm_ready(
    manager: Any, reads: Sequence[Callable[[], Any]], timeout: float, database: str | None = None, *, label: str = ""
) -> int:
    """``warmed_ready`` for the sync API."""
    return asyncio.run(warmed_ready(manager, reads, timeout, database, label=label))


def wait_until(condition: Callable[[], Any], timeout: float, pause: float = 0.01) -> Any:
    """The first true value of ``condition()``, asked every ``pause``
    seconds; None if ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(pause)
    return None


async def resolved(value: Any) -> Any:
    """``value``, awaited if the API that returned it is async: one worker body for both APIs."""
    return await value if asyncio.iscoroutine(value) else value


@contextlib.asynccontextmanager
async def worker_client(
    uri: str, is_async: bool, shared: str | None, *, cached: bool = True, listeners: Sequence[Any] = (), **local: Any
) -> AsyncIterator[tuple[Any, Any]]:
    """A worker's ``MongoClient`` (``AsyncMongoClient`` if ``is_async``) with the command
    ``listeners``, and its cache manager (None unless ``cached``): attached to the owner ``shared``, or
    process-local with ``local``'s options; both are closed when the block ends."""
    import client_query_cache as cqc

    client = (pymongo.AsyncMongoClient if is_async else pymongo.MongoClient)(uri, event_listeners=list(listeners))
    manager: Any = None
    try:
        if cached:
            cls = cqc.AsyncCacheManager if is_async else cqc.CacheManager
            manager = cls(client, shared=shared) if shared else cls(client, **local)
        yield client, manager
    finally:
        if manager is not None:
            await resolved(manager.close())
        await resolved(client.close())


async def registered(manager: Any, coll: Any, db: str, timeout: float, *, label: str = "") -> None:
    """Register ``coll`` with a first read (of ``_id`` 0), which starts the database's change
    stream, and wait until the stream is ready (else fail, the message starting with ``label``)."""
    await resolved(coll.find_one({"_id": 0}))
    if not await resolved(manager.wait_ready(timeout, database=db)):
        raise BenchmarkFailed(f"{label}the change stream did not become ready")


def register(manager: Any, coll: Any, db: str, timeout: float, *, label: str = "") -> None:
    """``registered`` for the sync API."""
    asyncio.run(registered(manager, coll, db, timeout, label=label))


# -- writes ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Write:
    """An update of a document to a version, as the oracle (``benchmarks._oracle``) judges reads against it."""

    key: int
    version: int
    #: (seconds << 32) | increment of the write's operationTime (0: unknown).
    optime: int = 0
    sent_ns: int = 0
    ack_ns: int = 0


def timestamp_int(ts: Any) -> int:
    """A ``bson.Timestamp`` as one comparable integer."""
    return (ts.time << 32) | ts.inc


class Writer:
    """The writer of the checked harnesses: each ``write`` sets a random
    document of ``keys`` to its next ``version`` (and its ``stamp``,
    "key:version", if ``stamp``), in the session given, and records it with
    its operationTime in ``acked``; with ``keep_lost`` a write whose reply
    was lost (a PyMongo error) goes to ``lost`` instead, never acknowledged:
    its version may appear, never required."""

    def __init__(self, coll: Any, keys: Sequence[int], seed: Any, *, first: int = 0, stamp: bool = False) -> None:
        self.coll, self.keys, self.rng, self.stamp = coll, keys, random.Random(seed), stamp
        self.versions = dict.fromkeys(keys, first)
        self.acked: list[Write] = []
        self.lost: list[Write] = []

    def write(self, session: Any, keep_lost: bool = False) -> None:
        k = self.rng.choice(self.keys)
        v = self.versions[k] = self.versions[k] + 1
        update = {"version": v, "stamp": f"{k}:{v}"} if self.stamp else {"version": v}
        sent = time.monotonic_ns()
        try:
            self.coll.update_one({"_id": k}, {"$set": update}, session=session)
        except pymongo.errors.PyMongoError:
            if not keep_lost:
                raise
            self.lost.append(Write(k, v, NEVER, sent, NEVER))
            return
        if session.operation_time is None:
            raise BenchmarkFailed("the server returned no operationTime for a write")
        self.acked.append(Write(k, v, timestamp_int(session.operation_time), sent, time.monotonic_ns()))

    def run(self, stop: Any, interval: float, count: int | None = None, counter: Any = None) -> list[Write]:
        """Write every ``interval`` seconds, in one session, until ``stop``
        is set (or ``count`` writes), counting them in ``counter.value``."""
        with self.coll.database.client.start_session(causal_consistency=False) as session:
            while not stop.is_set() and (count is None or len(self.acked) < count):
                self.write(session)
                if counter is not None:
                    counter.value += 1
                if interval:
                    stop.wait(interval)
        return self.acked


# -- progress, options, reports ---------------------------------------------------


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Status:
    """Progress lines on stderr, with the time since the run started."""

    def __init__(self, quiet: bool = False) -> None:
        self._start = time.monotonic()
        self._quiet = quiet

    def __call__(self, message: str) -> None:
        if not self._quiet:
            progress(f"[{time.monotonic() - self._start:6.1f}s] {message}")


def parser(module: str, doc: str | None, *, json_flag: str = "--json", seed: int = 20261204) -> argparse.ArgumentParser:
    """A harness's parser with the common options: the JSON report's path and the seed."""
    out = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=(doc or "").split("\n")[0])
    out.add_argument(json_flag, metavar="PATH", help="write the JSON report here")
    out.add_argument("--seed", type=int, default=seed)
    return out


def defaults(args: argparse.Namespace, values: dict[str, Any]) -> None:
    """Give each option named in ``values`` that the command line left out (None) its value there."""
    for name, value in values.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def at_least_one(parser_: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    for name in names:
        if getattr(args, name) < 1:
            parser_.error(f"--{name.replace('_', '-')} must be at least 1")


def csv(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An option's type: a comma-separated subset of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        if not items or any(x not in choices for x in items):
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return items

    return parse


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]], indent: str = "") -> None:
    """Print ``rows`` under a header and a rule. A column is (title, format spec),
    for example ("p50 us", ">9.1f"); its title takes the spec's alignment and width."""
    heads = []
    for title, spec in columns:
        align = spec[0] if spec[:1] in ("<", ">", "^") else ">"
        width = "".join(itertools.takewhile(str.isdigit, spec.lstrip("<>^")))
        heads.append(f"{title:{align}{width}}")
    head = " ".join(heads)
    print(indent + head)
    print(indent + "-" * len(head))
    for row in rows:
        print(indent + " ".join(format(value, spec) for value, (_, spec) in zip(row, columns, strict=True)))


class _Dash:
    """A table cell without a figure: "-" in its column's alignment and width."""

    def __format__(self, spec: str) -> str:
        align = spec[0] if spec[:1] in ("<", ">", "^") else ">"
        width = "".join(itertools.takewhile(str.isdigit, spec.lstrip("<>^")))
        return f"{'-':{align}{width}}"


def cell(value: Any) -> Any:
    """``value`` as a ``table`` cell: ``None`` or a float that is not finite
    (no figure) prints as "-" whatever the column's format spec."""
    missing = value is None or (isinstance(value, float) and not math.isfinite(value))
    return _Dash() if missing else value


def machine_facts() -> dict[str, Any]:
    """Generic facts only: no host names, users or paths."""
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "pymongo": pymongo.version,
        "os": platform.system(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def write_json(path: str, report: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2, sort_keys=True)
        fh.write("\n")


def exit_code(problems: Sequence[str], headline: str = "CHECKS FAILED:") -> int:
    """Print the failed checks (if any) to stderr; the process exit code."""
    if not problems:
        return 0
    print(headline, file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return 1


@dataclasses.dataclass(frozen=True)
class Target:
    """A figure a full run is held to (docs/benchmarks.md, "Targets"): a dotted
    path into the report, where ``*`` stands for every key at that level (the
    worst of them is judged), and a bound."""

    figure: str
    op: str  # "<=" or ">="
    bound: float


def _values(node: Any, parts: Sequence[str]) -> list[float]:
    if not parts:
        return [float(node)] if isinstance(node, (int, float)) and not isinstance(node, bool) else []
    if not isinstance(node, dict):
        return []
    keys = list(node) if parts[0] == "*" else [parts[0]] if parts[0] in node else []
    return [v for k in keys for v in _values(node[k], parts[1:])]


def verdict(report: dict[str, Any], targets: Sequence[Target], quick: bool) -> dict[str, Any]:
    """The run's one verdict: its checks, then (in a full run) its targets.
    A quick run's figures come from too few samples to judge: it is a smoke
    check, its targets shown but not judged."""
    judged = []
    for t in targets:
        values = _values(report, t.figure.split("."))
        value = (max if t.op == "<=" else min)(values) if values else None
        met = None if quick or value is None else (value <= t.bound if t.op == "<=" else value >= t.bound)
        judged.append({"figure": t.figure, "target": f"{t.op} {t.bound:g}", "value": value, "met": met})
    checks = report.get("checks")
    if checks is not None and not checks["passed"]:
        status = "checks failed"
    elif quick and judged:
        status = "smoke check"
    elif any(j["met"] is not True for j in judged):
        status = "targets missed"
    else:
        status = "passed"
    return {"status": status, "quick": quick, "targets": judged}


def print_verdict(v: dict[str, Any]) -> None:
    if v["targets"]:
        print("targets (judged in a full run):")
        for j in v["targets"]:
            value = "-" if j["value"] is None else f"{j['value']:.4g}"
            met = {True: "met", False: "MISSED", None: "not judged"}[j["met"]]
            print(f"  {j['figure']:<52} {j['target']:<10} {value:>10}  {met}")
    line = {
        "passed": "passed: every check holds" + (" and every target is met" if v["targets"] else ""),
        "checks failed": "FAILED: a check failed (listed on stderr)",
        "targets missed": "targets missed: "
        + ", ".join(j["figure"] for j in v["targets"] if j["met"] is not True),
        "smoke check": "smoke check: a quick run's figures come from too few samples to compare with "
        "the targets or the published figures (run without --quick for those)",
    }[v["status"]]
    print(f"verdict: {line}")


def conclude(
    report: dict[str, Any],
    problems: Sequence[str] | None,
    print_report: Callable[[dict[str, Any]], None],
    json_path: str | None,
    elapsed: bool = False,
    headline: str = "CHECKS FAILED:",
    targets: Sequence[Target] = (),
    quick: bool = False,
) -> int:
    """The end of a benchmark: record the checks in the report (``None``:
    it has none) and the verdict, print them, write the report as JSON if
    asked, and return the exit code (the checks' alone: targets are
    performance figures of a shared machine, reported, never a failure)."""
    if problems is not None:
        report["checks"] = {"passed": not problems, "problems": list(problems)}
    report["verdict"] = verdict(report, targets, quick)
    print_report(report)
    print_verdict(report["verdict"])
    if json_path:
        write_json(json_path, report)
        print(f"wrote {json_path}")
    if elapsed:
        print(f"elapsed {report['elapsed_seconds']:.0f}s")
    return exit_code(problems or (), headline)


def with_server(run: Callable[[str], Any], status: Callable[[str], None] = progress, *, timed: bool = False) -> Any:
    """``run(uri)`` against the disposable server (or ``MONGODB_URI``); None
    (the error printed) if the benchmark failed. ``timed``: the report
    ``run`` returned gets ``elapsed_seconds``, server start included."""
    started = time.perf_counter()
    try:
        status("starting the server (or using MONGODB_URI)")
        with server() as uri:
            report = run(uri)
    except BenchmarkFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    if timed:
        report["elapsed_seconds"] = time.perf_counter() - started
    return report


def checked_main(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace, str, Status], dict[str, Any]],
    checks: Callable[[dict[str, Any]], Sequence[str]],
    print_report: Callable[[dict[str, Any]], None],
    *,
    timed: bool = False,
    **options: Any,
) -> int:
    """A checked harness from its parsed ``args`` to its exit code: ``run(args, uri, status)``
    under ``with_server``, then ``conclude`` with its ``checks`` (and ``options``)."""
    status = Status()
    report = with_server(lambda uri: run(args, uri, status), status, timed=timed)
    if report is None:
        return 1
    return conclude(report, checks(report), print_report, args.json, **options)


# -- processes: the server, owners, commands -------------------------------------


@contextlib.contextmanager
def server() -> Iterator[str]:
    """The disposable server's URI (or ``MONGODB_URI``'s) while the block runs."""
    from client_query_cache.testing import disposable_uri

    with disposable_uri() as uri:
        yield uri


def disposable_server(**options: Any) -> Any:
    """A started ``DisposableServer`` of its own (``stop()``/``start()``/``close()``)."""
    from client_query_cache.testing import DisposableServer

    srv = DisposableServer(**options)
    try:
        srv.start()
    except BaseException:
        srv.close()
        raise
    return srv


def external() -> bool:
    from client_query_cache.testing import external_uri

    return external_uri() is not None


def with_app_name(uri: str, app_name: str) -> str:
    """``uri`` with its appName option set to ``app_name``."""
    parts = urlsplit(uri)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k.lower() != "appname"]
    query.append(("appName", app_name))
    return urlunsplit(parts._replace(query=urlencode(query)))


def connections_named(client: pymongo.MongoClient[Any], app_name: str) -> int:
    """How many of the server's operations and connections (currentOp with
    $all) announce the application name ``app_name``."""
    ops = client.admin.command({"currentOp": 1, "$all": True})["inprog"]
    return sum(
        1
        for op in ops
        if op.get("appName") == app_name
        or (op.get("clientMetadata") or {}).get("application", {}).get("name") == app_name
    )


def new_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


def start_owner(name: str, uri: str, **options: Any) -> Any:
    """``SharedCache.start(name, uri, **options)``: an owner process."""
    from client_query_cache import SharedCache

    return SharedCache.start(name, uri, **options)


def stop_owner(owner: Any, timeout: float | None = None) -> None:
    """Stop the owner and remove the (empty) lock file it leaves behind; the
    name is this run's own, so nobody else uses it."""
    with contextlib.suppress(Exception):
        owner.stop(**({} if timeout is None else {"timeout": timeout}))
    with contextlib.suppress(Exception):
        from client_query_cache._core.shared import paths_for

        if not process_alive(owner.pid):
            os.unlink(paths_for(owner.name)["lock"])  # a str path


def checked_owner(uri: str, prefix: str, **options: Any) -> contextlib.AbstractContextManager[Any]:
    """``owned``: an owner of DESIGN.md's geometry (``options`` change it)
    whose streams wait up to 1 s per getMore, and that exits a minute after
    its last worker detached if its harness died without stopping it."""
    geometry = {**OWNER_GEOMETRY, "max_await_time_ms": 1000, "idle_exit_seconds": 60.0, **options}
    return owned(new_name(prefix), uri, **geometry)


@contextlib.contextmanager
def owned(name: str, uri: str, **options: Any) -> Iterator[Any]:
    """An owner (``start_owner``) while the block runs, stopped (``stop_owner``) when it ends."""
    owner = start_owner(name, uri, **options)
    try:
        yield owner
    finally:
        stop_owner(owner)


def quietly(call: Callable[..., Any], *args: Any) -> None:
    """``call(*args)``, any exception ignored: a cleanup that must not hide the error that got there."""
    with contextlib.suppress(Exception):
        call(*args)


def process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def spawn(target: Callable[..., Any], *args: Any, daemon: bool = False) -> Any:
    """A started process (multiprocessing spawn) running ``target(*args)``."""
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=daemon)
    proc.start()
    return proc


def context() -> Any:
    """The spawn context, for the shared values a ``spawn``'s target takes."""
    return multiprocessing.get_context("spawn")


def run_command(cmd: Sequence[str], timeout: float | None = None, **options: Any) -> Any:
    """``cmd`` run to its end, stdin closed and its output captured
    (``options`` change that); None if it ran longer than ``timeout`` seconds."""
    std = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    try:
        return subprocess.run(list(cmd), timeout=timeout, **{**std, **options})
    except subprocess.TimeoutExpired:
        return None


def run_to_end(cmds: dict[str, tuple[Sequence[str], dict[str, Any]]], timeout: float) -> dict[str, Any]:
    """Run the commands of ``cmds`` (by name: the command and its Popen
    options) at once, stdin closed and stderr merged into stdout; by name,
    each one's (exit status, output), killed after ``timeout`` seconds."""
    pipes = {"stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    procs = {name: subprocess.Popen(list(cmd), **pipes, **options) for name, (cmd, options) in cmds.items()}
    out = {}
    for name, proc in procs.items():
        try:
            output = proc.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
        out[name] = (proc.returncode, output)
    return out


def checkout() -> str | None:
    """The short commit of this checkout, ``+dirty`` with uncommitted changes."""
    root = str(Path(__file__).resolve().parent.parent)
    with contextlib.suppress(OSError):
        rev = run_command(["git", "-C", root, "rev-parse", "--short", "HEAD"], 10, text=True)
        dirty = run_command(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"], 10, text=True)
        if rev is not None and dirty is not None and rev.returncode == 0:
            return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    return None


# -- the worker pool --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Shared:
    """What a pool's workers share with the parent: per-worker ``counters``,
    ``final`` values, the ``stop`` flag, the ``pace`` (seconds to sleep after
    a read), free ``stats``, the start ``barrier`` and the ``results`` queue."""

    counters: Any
    final: Any
    stop: Any
    pace: Any
    stats: Any
    barrier: Any
    results: Any

    def put(self, kind: str, index: int, payload: Any) -> None:
        self.results.put((kind, index, payload))


def _entry(work: Callable[[dict[str, Any], Shared], Any], spec: dict[str, Any], shared: Shared) -> None:
    """A spawned worker: ``work``'s result, or its traceback, on the queue; a
    failure also breaks the barrier so the parent stops waiting."""
    try:
        shared.put("result", spec["index"], work(spec, shared))
    except BaseException:
        shared.put("error", spec["index"], traceback.format_exc())
        with contextlib.suppress(Exception):
            shared.barrier.abort()
        raise SystemExit(1) from None


class Pool:
    """Spawned workers sharing a ``Shared``; ``close()`` ends every one of
    them. A watcher breaks the barrier as soon as a worker (or the ``owner``
    watched) dies, so the parent fails at once instead of at a timeout."""

    def __init__(self, count: int, *, keys: int = 1, stats: int = 1, owner: Any = None, timeout: float = 120.0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.count, self.owner, self.timeout = count, owner, timeout
        self.shared = Shared(
            ctx.RawArray("q", count), ctx.RawArray("q", keys), ctx.RawValue("i", 0), ctx.RawValue("d", 0.0),
            ctx.RawArray("q", stats), ctx.Barrier(count + 1), ctx.Queue(),
        )  # fmt: skip
        self.procs: list[Any] = []
        self._stash: list[tuple[str, int, Any]] = []
        self._watch_stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="watch", daemon=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, specs: Sequence[dict[str, Any]], work: Callable[[dict[str, Any], Shared], Any]) -> None:
        """Spawn one process per spec running ``work(spec, shared)`` (a
        module-level function), whose result or traceback the queue gets."""
        ctx = multiprocessing.get_context("spawn")
        for spec in specs:
            p = ctx.Process(target=_entry, args=(work, spec, self.shared), name=f"bench-worker-{spec['index']}")
            p.start()
            self.procs.append(p)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._watch_stop.wait(0.25):
            if self.dead() or (self.owner is not None and not process_alive(self.owner.pid)):
                with contextlib.suppress(Exception):
                    self.shared.barrier.abort()
                return

    def dead(self) -> list[int]:
        return [k for k, p in enumerate(self.procs) if p.exitcode not in (None, 0)]

    def total_reads(self) -> int:
        return sum(self.shared.counters)

    def errors(self, wait: float = 2.0) -> str:
        """Why the workers broke: dead processes first, then their
        tracebacks (a worker that only saw the barrier break is one line)."""
        failures, broken = [], []
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                kind, index, payload = self.shared.results.get(timeout=0.2)
            except queue_mod.Empty:
                if failures or broken:
                    break
                continue
            except (OSError, ValueError, EOFError):
                break
            if kind == "error" and payload.rstrip().endswith("BrokenBarrierError"):
                broken.append(index)
            elif kind == "error":
                failures.append(f"worker {index}:\n{payload}")
        lines = [f"worker {k} exited with code {self.procs[k].exitcode}" for k in self.dead()]
        if self.owner is not None and not process_alive(self.owner.pid):
            lines.append("the owner process is gone")
        lines += failures
        if broken:
            lines.append(f"workers {sorted(broken)} stopped at the broken barrier")
        return "\n".join(lines) or f"no worker reported an error (a wait longer than --timeout {self.timeout:g}s?)"

    def meet(self, what: str) -> None:
        try:
            self.shared.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise BenchmarkFailed(f"barrier broken at {what}:\n{self.errors()}") from None

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.shared.barrier.abort()

    def collect(self, kind: str = "result", timeout: float | None = None) -> list[Any]:
        """One message of ``kind`` from every worker, in worker order (others
        are kept for a later call); after the results, the workers are joined."""
        out: list[Any] = [None] * self.count
        got = [False] * self.count
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pending, self._stash = self._stash, []
        while not all(got):
            if pending:
                kind_, index, payload = pending.pop(0)
            else:
                try:
                    kind_, index, payload = self.shared.results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue_mod.Empty:
                    raise BenchmarkFailed(f"workers did not report:\n{self.errors()}") from None
            if kind_ == "error":
                raise BenchmarkFailed(f"worker {index} failed:\n{payload}")
            if kind_ != kind or got[index]:
                self._stash.append((kind_, index, payload))
                continue
            out[index], got[index] = payload, True
        self._stash += pending
        if kind == "result":
            for p in self.procs:
                p.join(self.timeout)
        return out

    def close(self) -> None:
        self.shared.stop.value = 1
        self._watch_stop.set()
        if self._watcher.is_alive():
            self._watcher.join(2)
        self.abort()
        for p in self.procs:
            p.join(0 if p.exitcode is not None else 10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.shared.results.close()
        self.shared.results.join_thread()
