"""The coherence checker (``benchmarks.coherence``): a bounded run of every
path (shared and process-local, sync and async) serves no stale read, no
read older than one its process had already been returned, and no read
older than its process's own write; and the oracle itself, on records whose
answer is known."""

from __future__ import annotations

import array
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import _patterns, coherence  # noqa: E402
from benchmarks._oracle import AT_LEAST, AT_MOST, Rows, WriteTimes, judge  # noqa: E402
from benchmarks.coherence import Oracle, Write, check_reads, staleness_windows  # noqa: E402


# Timing: each path must serve a minimum fraction of its reads as hits while
# the writes go on, which needs the change stream to keep up; with
# another test's processes beside it (pytest-xdist) that can miss, so it runs
# alone (.ci/pytest-parallel).
@pytest.mark.serial
def test_no_path_serves_a_stale_a_backwards_or_an_own_write_missing_read(server_uri: str, runtime_dir: Path) -> None:
    args = coherence._parse(["--quick"])
    report = coherence.run(args, server_uri, coherence.Status(quiet=True))
    problems = coherence.checks(report)
    assert problems == []
    assert report["schema"] == "cqc.coherence/3"
    for key in coherence.VIOLATIONS:
        assert report[key] == 0, key
    assert {(p["path"], p["api"]) for p in report["paths"]} == {
        (path, api) for path in coherence.PATHS for api in coherence.APIS
    }
    for p in report["paths"]:
        # The check means something only if the cache served enough reads
        # while the writes were applied, every write was seen applied, and
        # the workers wrote (and read back) documents of their own.
        assert p["writes"] == args.writes
        assert p["hit_fraction"] >= coherence.MIN_HIT_FRACTION and p["documents_checked"] >= p["reads"]
        assert p["window_ms"]["n"] == args.writes
        assert p["worker_writes"] > 0
    # Every pattern that once broke the causal promise ran on every path and
    # API it applies to, judged documents, and (where it writes) wrote.
    assert sorted((p["pattern"], p["path"], p["api"]) for p in report["patterns"]) == sorted(
        (pattern, path, api)
        for pattern in _patterns.PATTERNS
        for path in coherence.PATHS
        for api in coherence.APIS
        if path == "shared" or pattern not in _patterns.SHARED_ONLY
    )
    for p in report["patterns"]:
        assert p["documents_checked"] > 0 and p["other_writes"] > 0, p
        if p["pattern"] in ("listener_writes", "transaction_writes", "merge_elsewhere"):
            assert p["own_writes"] > 0, p


def _events(times: dict[tuple[str, int], list[tuple[int, int]]]) -> Any:
    return types.SimpleNamespace(times=times)


def test_the_pattern_judge_finds_each_kind_of_wrong_read():
    # Document 1 of "d.c": version 2's event at cluster time 20, version 3's
    # at 30. Manager 0 reads version 3 (ends at t=100), then version 2 (starts
    # at 110): monotonic. It writes version 4 (acknowledged at 200), then
    # reads version 3 (starts at 210): read-your-writes. Manager 1 reads
    # version 2 with the applied time at 30: stale; and version 3 at 40:
    # fine. Manager 1's reads never bind manager 0's, and the reverse.
    rec = _patterns.Record()
    rec.read(0, "d.c", [{"_id": 1, "version": 3}], 90, 100, 0, [1])
    rec.read(0, "d.c", [{"_id": 1, "version": 2}], 110, 120, 0, [1])
    rec.wrote(0, "d.c", 1, 4, 200)
    rec.read(0, "d.c", [{"_id": 1, "version": 3}], 210, 220, 0, [1])
    rec.read(1, "d.c", [{"_id": 1, "version": 2}], 300, 310, 30, [1])
    rec.read(1, "d.c", [{"_id": 1, "version": 3}], 320, 330, 40, [1])
    verdict = _patterns.judge(rec, _events({("d.c", 1): [(30, 3), (20, 2)]}))
    assert (verdict["stale_reads"], verdict["monotonic_violations"], verdict["read_your_writes_violations"]) == (
        1,
        1,
        1,
    ), verdict
    # The same reads in an order that breaks nothing.
    ok = _patterns.Record()
    ok.read(0, "d.c", [{"_id": 1, "version": 2}], 90, 100, 20, [1])
    ok.wrote(0, "d.c", 1, 4, 200)
    ok.read(0, "d.c", [{"_id": 1, "version": 4}], 210, 220, 30, [1])
    ok.read(0, "d.c", [{"_id": 1, "version": 3}], 150, 250, 30, [1])  # began before the write's ack
    verdict = _patterns.judge(ok, _events({("d.c", 1): [(30, 3), (20, 2)]}))
    assert verdict["stale_reads"] + verdict["monotonic_violations"] + verdict["read_your_writes_violations"] == 0
    # A read that returns other documents than asked is a wrong result.
    ok.read(0, "d.c", [{"_id": 2, "version": 1}], 300, 310, 30, [1])
    assert len(ok.wrong) == 1


def _path(**counts: int) -> dict[str, object]:
    """A path entry that passes every check, with ``counts`` changed."""
    entry: dict[str, object] = {
        "path": "shared", "api": "sync", "reads": 100, "hits": 50, "hit_fraction": 0.5,
        "stale_reads": 0, "monotonic_violations": 0, "read_your_writes_violations": 0,
        "impossible_reads": 0, "wrong_results": 0, "workers_unfinished": 0, "window_ms": {"n": 1}, "examples": [],
    }  # fmt: skip
    entry.update(counts)
    return entry


def test_checks_fail_on_each_violation_and_on_too_few_hits() -> None:
    assert coherence.checks(coherence.build_report({}, [_path()])) == []
    for key in coherence.VIOLATIONS:
        report = coherence.build_report({}, [_path(**{key: 2})])
        assert report[key] == 2
        assert coherence.checks(report) == [f"shared/sync: 2 {key.replace('_', ' ')}"]
    low = coherence.MIN_HIT_FRACTION / 2
    [problem] = coherence.checks(coherence.build_report({}, [_path(hits=int(100 * low), hit_fraction=low)]))
    assert "reads hit" in problem


# -- the oracle -----------------------------------------------------------------


def _write(doc: int, version: int, optime: int, sent: int = 0, ack: int = 0) -> Write:
    return Write(doc, version, optime, sent, ack)


def _rows(index: int, rows: list[tuple[int, int, int, int]]) -> dict[str, object]:
    """A worker result with rows (document, version, applied, end)."""
    return {
        "index": index,
        "docs": array.array("i", [r[0] for r in rows]),
        "versions": array.array("q", [r[1] for r in rows]),
        "applied": array.array("q", [r[2] for r in rows]),
        "ends": array.array("q", [r[3] for r in rows]),
        "kinds": array.array("b", [0] * len(rows)),
    }


def test_oracle_requires_the_newest_version_applied_before_the_read() -> None:
    oracle = Oracle([_write(1, 1, 100), _write(1, 2, 200), _write(2, 1, 150)])
    assert oracle.required(1, 99) == 0
    assert oracle.required(1, 100) == 1
    assert oracle.required(1, 199) == 1
    assert oracle.required(1, 200) == 2
    assert oracle.required(2, 149) == 0 and oracle.required(2, 1 << 62) == 1
    assert oracle.required(3, 1 << 62) == 0


def test_check_reads_counts_stale_and_impossible_reads() -> None:
    oracle = Oracle([_write(1, 1, 100, sent=10), _write(1, 2, 200, sent=20)])
    fine = _rows(0, [(1, 0, 99, 50), (1, 1, 150, 50), (1, 2, 150, 50), (1, 2, 250, 50)])
    assert check_reads(oracle, fine)["stale"] == 0
    assert check_reads(oracle, fine)["impossible"] == 0
    bad = _rows(3, [(1, 1, 200, 50), (1, 0, 250, 50), (1, 3, 250, 50), (1, 2, 250, 15)])
    result = check_reads(oracle, bad)
    assert result["stale"] == 2
    assert result["impossible"] == 2  # version 3 never written; version 2 read before it was sent
    assert "version 2 had been applied" in result["examples"][0]


def test_staleness_window_takes_the_earliest_shared_and_latest_local_observer() -> None:
    writes = [_write(1, 1, 100, ack=1_000_000)]
    seen = [
        {"seen_ts": array.array("q", [50, 100]), "seen_at": array.array("q", [0, 3_000_000]), "starts": [0, 1]},
        {"seen_ts": array.array("q", [50, 120]), "seen_at": array.array("q", [0, 5_000_000]), "starts": [0, 1]},
    ]
    assert staleness_windows("shared", writes, seen)["window_ms"]["p50"] == pytest.approx(2.0)
    assert staleness_windows("local", writes, seen)["window_ms"]["p50"] == pytest.approx(4.0)
    early = [{"seen_ts": array.array("q", [100]), "seen_at": array.array("q", [500_000]), "starts": [0]}]
    out = staleness_windows("shared", writes, early)
    assert out["window_ms"]["max"] == 0 and out["applied_before_ack"] == 1
    never = [{"seen_ts": array.array("q", [50]), "seen_at": array.array("q", [0]), "starts": [0]}]
    assert staleness_windows("local", writes, never)["window_ms"] is None


def _judged(rows: list[tuple[int, int, int, int]], own: list[Write] = (), bounds: list[int] = ()) -> object:
    """Rows (document, version, start, end) of one process, judged without
    the applied-time oracle."""
    out = Rows()
    for n, (doc, version, start, end) in enumerate(rows):
        out.add(doc, version, 0, start, end, 0, bounds[n] if bounds else 0)
    return judge(out, own_writes=list(own))


def test_a_read_older_than_an_earlier_completed_read_of_the_process_is_a_monotonic_violation() -> None:
    # Version 5 was returned by a read that ended at 20: a read starting
    # after it must not return 4; one that started before it ended may.
    verdict = _judged([(1, 5, 10, 20), (1, 4, 15, 25), (1, 4, 21, 22), (2, 1, 30, 31), (1, 5, 40, 41)])
    assert (verdict.monotonic, verdict.read_your_writes, verdict.stale) == (1, 0, 0)
    assert "had already read version 5" in verdict.examples[0]
    assert _judged([(1, 4, 10, 20), (1, 5, 21, 22), (1, 6, 23, 24)]).monotonic == 0


def test_a_read_older_than_the_process_own_acknowledged_write_breaks_read_your_writes() -> None:
    own = [Write(1, 3, 0, 5, 10)]  # acknowledged at 10
    verdict = _judged([(1, 2, 9, 12), (1, 2, 11, 12), (1, 3, 13, 14), (2, 0, 15, 16)], own)
    assert (verdict.read_your_writes, verdict.monotonic) == (1, 0)
    assert "had written version 3" in verdict.examples[0]


def test_count_rows_bound_the_version_from_one_side() -> None:
    # A count of 1 on version >= 5 says "at least 5": later reads must not go
    # below it; a count of 0 says "at most 4" and is judged like a read of 4.
    verdict = _judged([(1, 5, 10, 20), (1, 3, 21, 22)], bounds=[AT_LEAST, 0])
    assert verdict.monotonic == 1
    verdict = _judged([(1, 5, 10, 20), (1, 4, 21, 22), (1, 4, 23, 24)], bounds=[0, AT_MOST, 0])
    assert verdict.monotonic == 2
    assert _judged([(1, 4, 10, 20), (1, 2, 21, 22)], bounds=[AT_MOST, 0]).monotonic == 0  # "at most" is not seen
    oracle = Oracle([_write(1, 5, 100, sent=1)])
    rows = Rows()
    rows.add(1, 4, 100, 10, 20, 4, AT_MOST)  # count 0 after version 5 was applied: stale, not impossible
    rows.add(1, 9, 100, 30, 40, 4, AT_LEAST)  # "at least 9": judges nothing
    verdict = judge(rows, oracle=oracle)
    assert (verdict.stale, verdict.impossible) == (1, 0)


def test_write_times_gives_each_update_its_operation_time(server_uri: str, db_name: str) -> None:
    import pymongo

    times = WriteTimes()
    with pymongo.MongoClient(server_uri, event_listeners=[times]) as c:
        coll = c[db_name]["w"]
        coll.insert_one({"_id": 1, "version": 0})
        with c.start_session(causal_consistency=False) as session:
            coll.update_one({"_id": 1}, {"$set": {"version": 1}}, session=session)
            ot = session.operation_time
        assert times.take(1, 1) == (ot.time << 32) | ot.inc
        coll.update_one({"_id": 1}, {"$set": {"version": 2}})
        coll.update_one({"_id": 2}, {"$set": {"version": 1}})  # matches nothing: no time
        assert times.take(1, 2) > (ot.time << 32) | ot.inc
        with pytest.raises(KeyError):
            times.take(2, 1)


# -- the applied cluster time it relies on ------------------------------------


def test_applied_time_reaches_each_acknowledged_write_and_never_moves_back(
    manager, client, db_name: str
) -> None:
    from support import event_time, ready_collection, stream_of, wait_until

    coll = ready_collection(manager, db_name, "c")
    start = stream_of(manager, db_name).applied_time
    assert start is not None, "a stream that serves knows the time it opened at"
    seen = start
    with client.start_session(causal_consistency=False) as session:
        for v in range(3):
            written = event_time(
                client[db_name]["c"],
                lambda v=v: client[db_name]["c"].update_one({"_id": 1}, {"$set": {"v": v}}, upsert=True, session=session),
            )
            assert written > start
            # Reading the entry proves nothing yet; the applied time must
            # reach the write's own cluster time once its event is applied.
            now = wait_until(
                lambda w=written: (t := stream_of(manager, db_name).applied_time) is not None and t >= w and t,
                what=f"the applied time reaches {written}",
            )
            assert now >= seen
            seen = now
            assert coll.find_one({"_id": 1})["v"] == v
