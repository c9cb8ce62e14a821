"""Helpers shared by the benchmarks: documents, quantiles, reports."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import bson
import pymongo
from bson.objectid import ObjectId

__all__ = ["make_document", "quantile", "summarize", "machine_facts", "write_json", "bypass_split", "warm_until_hits"]

#: The bypass reason of a read that went to MongoDB because the stream had
#: not yet applied what the process had already seen (the causal floor): the
#: cost of that guarantee, counted apart from every other bypass.
BEHIND = "stream_behind"


def warm_until_hits(manager: Any, reads: Sequence[Callable[[], Any]], timeout: float, pause: float = 0.1) -> int:
    """Call every read until a whole pass is served from the cache; return
    the passes it took (0 if ``timeout`` seconds passed first). Misses admit
    on the first pass; a read can go to MongoDB for a while longer, until
    the stream has applied what the process's misses saw (the causal floor,
    up to two stream rounds)."""
    deadline = time.monotonic() + timeout
    passes = 0
    while True:
        passes += 1
        before = manager.snapshot().hits
        for read in reads:
            read()
        if manager.snapshot().hits - before == len(reads):
            return passes
        if time.monotonic() > deadline:
            return 0
        time.sleep(pause)


def bypass_split(before: Any, after: Any) -> tuple[int, int]:
    """Between two snapshots: (bypasses for any reason but the causal floor,
    bypasses for the causal floor)."""
    behind = after.bypasses.get(BEHIND, 0) - before.bypasses.get(BEHIND, 0)
    return after.bypass_total - before.bypass_total - behind, behind


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
    size = len(bson.encode(doc))
    words = []
    # A running total (not a sum over the words each time round): the same
    # words, in linear instead of quadratic time.
    filled = size + 12
    while filled < target_bytes:
        word = rng.choice(["lorem", "ipsum", "dolor", "sit", "amet", "cache", "mongo"])
        words.append(word)
        filled += len(word) + 1
    doc["bio"] = " ".join(words)
    return doc


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


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def exit_code(problems: Sequence[str], headline: str = "CHECKS FAILED:") -> int:
    """Print the failed checks (if any) to stderr; the process exit code."""
    if not problems:
        return 0
    print(headline, file=sys.stderr)
    for p in problems:
        print(f"  {p}", file=sys.stderr)
    return 1


def conclude(
    report: dict[str, Any],
    problems: Sequence[str],
    print_report: Callable[[dict[str, Any]], None],
    json_path: str | None,
) -> int:
    """The end of a checked benchmark: record the checks in the report,
    print it, write it as JSON if asked, and return the exit code."""
    report["checks"] = {"passed": not problems, "problems": list(problems)}
    print_report(report)
    if json_path:
        write_json(json_path, report)
        print(f"wrote {json_path}")
    return exit_code(problems)
