"""The coherence checker (``benchmarks.coherence``): a bounded run of every
path (shared and process-local, sync and async) serves no stale read; and
the oracle itself, on records whose answer is known."""

from __future__ import annotations

import array
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import coherence  # noqa: E402
from benchmarks.coherence import Oracle, Write, check_reads, staleness_windows  # noqa: E402


def test_no_path_serves_a_read_older_than_an_applied_write(server_uri: str, runtime_dir: Path) -> None:
    args = coherence._parse(["--quick"])
    report = coherence.run(args, server_uri, coherence.Status(quiet=True))
    problems = coherence.checks(report)
    assert problems == []
    assert report["stale_reads"] == 0
    assert {(p["path"], p["api"]) for p in report["paths"]} == {
        (path, api) for path in coherence.PATHS for api in coherence.APIS
    }
    for p in report["paths"]:
        # The check means something only if the cache served reads while the
        # writes were applied, and every write was seen applied.
        assert p["writes"] == args.writes
        assert p["hits"] > 0 and p["documents_checked"] >= p["reads"]
        assert p["window_ms"]["n"] == args.writes


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


# -- the applied cluster time it relies on ------------------------------------


def test_applied_time_reaches_each_acknowledged_write_and_never_moves_back(
    manager, client, db_name: str
) -> None:
    from support import ready_collection, stream_of, wait_until

    coll = ready_collection(manager, db_name, "c")
    start = stream_of(manager, db_name).applied_time
    assert start is not None, "a stream that serves knows the time it opened at"
    seen = start
    with client.start_session(causal_consistency=False) as session:
        for v in range(3):
            client[db_name]["c"].update_one({"_id": 1}, {"$set": {"v": v}}, upsert=True, session=session)
            written = session.operation_time
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
