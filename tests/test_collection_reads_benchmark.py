"""``benchmarks.collection_reads`` at a tiny size: every phase and operation is
measured, every hot read hits, every cold read misses and is admitted, the
cached results equal the direct ones, the writer phase's finds pass the
oracle with enough hits, and the report carries the ratios the issue names;
and the writer phase's judgement itself, on results whose answer is known."""

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
    report = collection_reads.run(server_uri, documents=160, groups=16, samples=20, seed=3, write_interval=0.01)
    with pymongo.MongoClient(server_uri) as client:
        assert set(client.list_database_names()) <= before, "the benchmark must drop its database"

    assert report["checks"] == {"passed": True, "problems": []}
    ops = set(collection_reads.OPERATIONS)
    assert set(report["ratios"]) == ops
    for op in ops:
        ratios = report["ratios"][op]
        for phase in ("hot", "cold", "writer"):
            # Each ratio is the phase's own cached p50 over its direct p50,
            # both measured (a positive time), not a value from elsewhere.
            measured = report["phases"][phase][op]
            cached_p50, direct_p50 = measured["cached"]["p50_us"], measured["direct"]["p50_us"]
            assert cached_p50 > 0 and direct_p50 > 0, (op, phase, measured)
            assert ratios[f"{phase}_cached_over_direct_p50"] == cached_p50 / direct_p50, (op, phase)
        hot, cold = report["phases"]["hot"][op], report["phases"]["cold"][op]
        assert (hot["hits"], hot["misses"], hot["mismatches"]) == (20, 0, 0), op
        assert (cold["hits"], cold["misses"], cold["admissions"], cold["mismatches"]) == (0, 20, 20, 0), op
    assert report["phases"]["writer_updates"]["count"] > 0
    judged = report["phases"]["writer_judgement"]
    assert judged["documents_checked"] > 0
    assert judged["stale_reads"] == judged["monotonic_violations"] == judged["impossible_reads"] == 0
    assert judged["hit_fraction"] >= collection_reads.MIN_WRITER_HIT_FRACTION


def test_the_writer_phase_fails_on_a_stale_or_backwards_find_and_on_too_few_hits() -> None:
    from benchmarks._oracle import Rows, Write


    checker = collection_reads._UnderWrites.__new__(collection_reads._UnderWrites)
    checker.rows = Rows()
    doc = {"_id": 3, "group": 0, "version": 2}
    # Version 2 read with the applied time past version 3's write: stale;
    # then version 2 again after version 3 was read: backwards as well.
    assert not checker.differs("find_small", [doc], [{**doc, "version": 3}], (200, 10, 20))
    assert not checker.differs("find_one", {**doc, "version": 3}, {**doc, "version": 3}, (200, 30, 40))
    assert not checker.differs("find_one", doc, doc, (200, 50, 60))
    assert checker.differs("find_one", doc, {**doc, "group": 1}, (200, 70, 80))  # not just the version
    assert checker.differs("count", 3, 4, (0, 0, 0))
    writes = [Write(3, 2, 100, 1, 2), Write(3, 3, 200, 3, 4)]
    verdict = checker.verdict(writes, documents=5)
    assert (verdict["stale_reads"], verdict["monotonic_violations"], verdict["impossible_reads"]) == (3, 2, 0)

    samples = 10
    phases = {"writer": {op: {"hits": 1} for op in collection_reads.OPERATIONS}}
    problems = collection_reads._judge_writer_phase(phases, dict(verdict), samples)
    assert problems[:2] == ["writer phase: 3 stale reads", "writer phase: 2 monotonic violations"]
    clean = {**verdict, "stale_reads": 0, "monotonic_violations": 0, "examples": []}
    assert collection_reads._judge_writer_phase(phases, dict(clean), samples) == []
    phases = {"writer": {op: {"hits": 0} for op in collection_reads.OPERATIONS}}
    [problem] = collection_reads._judge_writer_phase(phases, dict(clean), samples)
    assert "0 of 60 cached reads hit" in problem
