"""``benchmarks.workloads`` at tiny sizes: one mix-matrix cell and two workers
per invalidation path produce a complete ``cqc.workloads/2`` report in which
the oracle judged every read (no stale, backwards or own-write-missing read)
with enough hits; and the latency computation, the judgement and the checks
themselves, on records whose answer is known.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pymongo
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import workloads  # noqa: E402
from benchmarks._kit import write_json  # noqa: E402


# Timing: each path must reach a minimum hit ratio while the writes go on,
# which needs the change stream to keep up; with
# another test's processes beside it (pytest-xdist) that can miss, so it runs
# alone (.ci/pytest-parallel).
@pytest.mark.serial
def test_tiny_run_writes_a_complete_report_that_judges_every_read(
    server_uri: str, runtime_dir: Path, tmp_path: Path
) -> None:
    prefix = f"cqc_test_{uuid.uuid4().hex[:12]}"
    inv_db = f"{prefix}_invalidation"
    writes = 6
    try:
        cells = workloads.run_matrix(
            server_uri, db_prefix=prefix, mixes=("balanced",), sizes=("small",), keys=20, ops=40, seed=7
        )
        invalidation = {
            path: workloads.run_invalidation(
                server_uri, db=inv_db, path=path, workers=2, writes=writes, keys=4, seed=7, timeout=30.0
            )
            for path in workloads.INV_PATHS
        }
    finally:
        with pymongo.MongoClient(server_uri) as client:
            client.drop_database(inv_db)
            leftover = [n for n in client.list_database_names() if n.startswith(prefix)]
    assert leftover == [], "the benchmark must drop its databases"

    params = {"quick": True, "seed": 7, "mixes": ["balanced"], "sizes": ["small"], "keys": 20, "ops": 40}
    report = workloads.build_report(params, cells, invalidation, 1.0)
    out = tmp_path / "report.json"
    write_json(str(out), report)
    loaded = json.loads(out.read_text(encoding="utf-8"))

    assert loaded["schema"] == "cqc.workloads/2"
    assert {"python", "pymongo", "cpus"} <= set(loaded["machine"])
    assert loaded["parameters"]["mixes"] == {"balanced": 0.5}
    assert loaded["parameters"]["sizes"] == {"small": 200}

    [cell] = loaded["cells"]
    assert (cell["mix"], cell["size"], cell["ops"]) == ("balanced", "small", 40)
    assert 180 <= cell["document_bytes_mean"] <= 220  # "small": about 200 B
    assert set(cell["paths"]) == {"direct", "local", "shared"}
    reads = cell["paths"]["direct"]["reads"]
    assert reads + cell["paths"]["direct"]["writes"] == 40
    for path, entry in cell["paths"].items():
        assert entry["reads"] == reads, path  # the same operations on every path
        assert entry["read"]["n"] == reads and entry["read"]["p50_us"] > 0, path
        for key in workloads.VIOLATIONS:
            assert entry[key] == 0, (path, key, entry["examples"])
        if path != "direct":
            # A read the cache did not answer went to MongoDB only because
            # the stream had not applied a write the worker made (the causal
            # floor): counted apart, never as another bypass.
            assert entry["hits"] + entry["misses"] + entry["behind"] == reads, path
            assert entry["bypasses"] == 0, path
            assert workloads.MIN_HIT_RATIO["balanced"] <= entry["hit_ratio"] <= 1, path

    assert set(loaded["invalidation"]) == {"shared", "local"}
    for path, inv in loaded["invalidation"].items():
        assert inv["writes"] == writes and inv["observed_writes"] == writes, path
        assert inv["unobserved_writes"] == 0, path
        assert inv["stale_after_bound"] == 0, (path, inv["stale_after_bound_examples"])
        for key in workloads.VIOLATIONS:
            assert inv[key] == 0, (path, key, inv["examples"])
        assert inv["hit_ratio"] >= workloads.MIN_INV_HIT_RATIO, path
        assert inv["workers"] == 2 and inv["reads"] >= writes * workloads.READS_PER_WRITE, path
        assert 0 <= inv["p50_us"] <= inv["p95_us"] <= inv["p99_us"] <= inv["max_us"], path
        assert inv["lower_max_us"] <= inv["max_us"], path
    assert workloads.checks(loaded) == []


def _worker(reads: list[tuple[int, int, int, int]]) -> dict[str, list[int]]:
    """A worker's result from (key, version, start ms, end ms) in time order."""
    ms = 1_000_000
    return {
        "keys": [r[0] for r in reads],
        "versions": [r[1] for r in reads],
        "starts": [r[2] * ms for r in reads],
        "ends": [r[3] * ms for r in reads],
    }


def test_latency_bounds_and_stale_reads_are_computed_across_workers() -> None:
    ms = 1_000_000
    writes = [
        workloads.Write(key=0, version=2, sent_ns=90 * ms, ack_ns=100 * ms),
        workloads.Write(key=1, version=3, sent_ns=190 * ms, ack_ns=200 * ms),
        workloads.Write(key=0, version=4, sent_ns=290 * ms, ack_ns=300 * ms),
    ]
    results = [
        _worker([(0, 1, 101, 102), (0, 2, 102, 103), (1, 1, 197, 198), (1, 3, 198, 199), (0, 2, 301, 302), (0, 4, 302, 305)]),
        # Skips version 2 of key 0, and reads it after version 4 (backwards,
        # and after every worker had read version 4: stale after the bound).
        _worker([(1, 1, 201, 202), (1, 3, 203, 204), (0, 1, 303, 304), (0, 4, 304, 310), (0, 2, 320, 321)]),
    ]
    out = workloads.invalidation_latencies(writes, results)
    # Upper bounds (the last worker's first read of the version, from the
    # acknowledgement): 310-100, 204-200, 310-300 ms.
    assert (out["p50_us"], out["max_us"]) == (10_000.0, 210_000.0)
    # Lower bounds (the latest start of an older read): 303-100, 201-200, 320-300 ms.
    assert (out["lower_p50_us"], out["lower_max_us"]) == (20_000.0, 203_000.0)
    assert out["observed_writes"] == 3 and out["unobserved_writes"] == 0
    assert out["stale_after_bound"] == 1
    assert out["stale_after_bound_examples"] == [
        {"worker": 1, "key": 0, "write_version": 4, "read_version": 2, "read_start_after_bound_us": 10_000}
    ]

    never = workloads.Write(key=1, version=9, sent_ns=400 * ms, ack_ns=401 * ms)
    out = workloads.invalidation_latencies([*writes, never], results)
    assert out["unobserved_writes"] == 1 and out["observed_writes"] == 3


def test_the_oracle_judges_invalidation_reads_stale_and_backwards() -> None:
    ms = 1_000_000
    writes = [
        workloads.Write(key=0, version=2, sent_ns=90 * ms, ack_ns=100 * ms, optime=1000),
        workloads.Write(key=0, version=3, sent_ns=190 * ms, ack_ns=200 * ms, optime=2000),
    ]
    fine = {**_worker([(0, 1, 10, 11), (0, 2, 101, 102), (0, 3, 201, 202)]), "applied": [0, 1000, 2000], "index": 0}
    assert workloads.judge_invalidation(writes, [fine], keys=1)["stale_reads"] == 0
    # Version 3 read, then version 2: backwards. Version 2 read although
    # version 3's write (optime 2000) had been applied: stale.
    bad = {**_worker([(0, 3, 201, 202), (0, 2, 203, 204)]), "applied": [1500, 1500], "index": 1}
    stale = {**_worker([(0, 2, 205, 206)]), "applied": [2000], "index": 2}
    out = workloads.judge_invalidation(writes, [bad, stale], keys=1)
    assert (out["stale_reads"], out["monotonic_violations"], out["read_your_writes_violations"]) == (1, 1, 0)
    assert any("already read version 3" in e for e in out["examples"])


def _report(cell_entry: dict[str, object], inv_entry: dict[str, object], mix: str = "balanced") -> dict[str, object]:
    paths = {p: dict(cell_entry) for p in workloads.PATHS}
    return {"cells": [{"mix": mix, "size": "small", "paths": paths}], "invalidation": {"shared": inv_entry}}


def test_checks_fail_on_every_violation_and_on_too_few_hits() -> None:
    clean = {
        "stale_reads": 0, "monotonic_violations": 0, "read_your_writes_violations": 0, "examples": [],
        "hit_ratio": 0.9, "bypasses": 0,
    }  # fmt: skip
    inv = {**clean, "stale_after_bound": 0, "unobserved_writes": 0}
    assert workloads.checks(_report(clean, inv)) == []
    for key in workloads.VIOLATIONS:
        problems = workloads.checks(_report({**clean, key: 1, "examples": ["e.g."]}, inv))
        assert len([p for p in problems if key.replace("_", " ") in p]) == 3, (key, problems)  # every path
        problems = workloads.checks(_report(clean, {**inv, key: 2}))
        assert problems == [f"invalidation/shared: 2 {key.replace('_', ' ')}"], key
    for mix, floor in workloads.MIN_HIT_RATIO.items():
        problems = workloads.checks(_report({**clean, "hit_ratio": floor * 0.9}, inv, mix))
        assert [p.split(":")[0] for p in problems] == [f"{mix}/small local", f"{mix}/small shared"], mix
    problems = workloads.checks(_report(clean, {**inv, "hit_ratio": workloads.MIN_INV_HIT_RATIO * 0.9}))
    assert len(problems) == 1 and "hit" in problems[0]
