"""``benchmarks.collection_reads`` at a tiny size: every phase and operation is
measured, every hot read hits, every cold read misses and is admitted, the
cached results equal the direct ones, and the report carries the ratios the
issue names."""

from __future__ import annotations

import sys
from pathlib import Path

import pymongo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import collection_reads  # noqa: E402


def test_a_tiny_run_measures_every_operation_in_every_phase(server_uri: str) -> None:
    with pymongo.MongoClient(server_uri) as client:
        before = set(client.list_database_names())
    report = collection_reads.run(server_uri, documents=160, groups=16, samples=4, seed=3, write_interval=0.005)
    with pymongo.MongoClient(server_uri) as client:
        assert set(client.list_database_names()) <= before, "the benchmark must drop its database"

    assert report["checks"] == {"passed": True, "problems": []}
    ops = set(collection_reads.OPERATIONS)
    assert set(report["ratios"]) == ops
    for op in ops:
        ratios = report["ratios"][op]
        for name in ("hot_cached_over_direct_p50", "cold_cached_over_direct_p50", "writer_cached_over_direct_p50"):
            assert ratios[name] > 0, (op, name)
        hot, cold = report["phases"]["hot"][op], report["phases"]["cold"][op]
        assert (hot["hits"], hot["misses"], hot["mismatches"]) == (4, 0, 0), op
        assert (cold["hits"], cold["misses"], cold["admissions"], cold["mismatches"]) == (0, 4, 4, 0), op
    assert report["phases"]["writer_updates"]["count"] > 0
