"""The soak (``benchmarks.soak``): a bounded run with two workers produces a
complete ``cqc.soak/1`` report without stale reads; and the pieces whose
answer is known: the RSS slope and its verdict, the per-minute throughput,
and the checks of absent documents and counts added to the coherence oracle.

A run this short cannot show whether memory is flat, so the bounded run only
checks that the figures exist, are sane and get no verdict."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import soak  # noqa: E402
from benchmarks._kit import write_json  # noqa: E402
from benchmarks.soak import ABSENT, COUNT_KIND, OP_DELETE, OP_INSERT, OP_UPDATE, ROW, Checker  # noqa: E402

MiB = 1024 * 1024


def test_short_soak_reports_every_process_and_no_stale_read(
    server_uri: str, runtime_dir: Path, tmp_path: Path
) -> None:
    args = soak._parse(
        ["--minutes", "0.3", "--workers", "2", "--documents", "2000", "--groups", "200",
         "--budget-mib", "1", "--slots", "2048"]
    )
    report = soak.run(args, server_uri, soak.Status(quiet=True))
    out = tmp_path / "soak.json"
    write_json(str(out), report)
    report = json.loads(out.read_text(encoding="utf-8"))

    assert report["schema"] == "cqc.soak/1"
    assert 17 <= report["elapsed_s"] <= 25
    assert report["warmup_s"] == pytest.approx(0.2 * report["elapsed_s"])
    assert set(report["processes"]) == {"parent", "owner", "worker0", "worker1"}
    for name, p in report["processes"].items():
        # Too short to judge, but every figure is there and plausible.
        assert p["verdict"] == "too_short", name
        assert p["samples"] >= 10, name
        assert 5 < p["start_mib"] < 1000 and 5 < p["end_mib"] < 1000, name
        assert p["min_mib"] <= min(p["start_mib"], p["end_mib"]) <= p["max_mib"], name
        assert math.isfinite(p["slope_mib_per_min"]), name

    a = report["arena"]
    assert a["budget_bytes"] == MiB and a["slots"] == 2048
    assert 0 < a["used_bytes_max"] <= a["budget_bytes"]
    assert 0 < a["entries_max"] <= a["slots"]
    assert a["evictions"] > 0, "2,000 documents of 1 KiB must not fit a 1 MiB budget"
    assert a["admissions"] > 0 and a["attached_workers_min"] == 2
    assert a["measured"]["evictions"] > 0
    used, entries = a["measured"]["used_mib"], a["measured"]["entries"]
    assert 0 < used["min"] <= used["max"] <= 1.0 and math.isfinite(used["slope_per_min"])
    assert 0 < entries["min"] <= entries["max"] <= a["entries_max"]
    [stream] = report["streams"]
    assert stream["state"] == "healthy" and stream["history_lost"] == 0

    t = report["totals"]
    assert all(n > 0 for n in t["reads_by_kind"].values()), t["reads_by_kind"]
    assert all(n > 0 for n in t["writes_by_op"].values()), t["writes_by_op"]
    assert t["reads"] + t["writes"] == t["ops"] and t["hits"] > 0
    assert 0.05 < t["writes"] / t["ops"] < 0.15  # --write-share 0.1
    [minute] = report["throughput"]  # 18 s: one partial minute
    assert minute["minute"] == 1 and 0 < minute["ops"] <= t["ops"] and minute["ops_per_min"] > 0

    o = report["oracle"]
    assert o["writes_logged"] == t["writes"]
    assert o["rows_checked"] >= t["reads"] - t["reads_by_kind"]["count"]
    assert o["counts_checked"] == t["reads_by_kind"]["count"]
    assert report["stale_reads"] == 0 and o["impossible_reads"] == 0 and o["wrong_results"] == 0, o["examples"]
    assert report["errors"] == 0 and report["sample_errors"] == []
    assert soak.checks(report) == []
    assert len(report["series"]) == report["samples"]
    text = io.StringIO()
    soak.print_report(report, text)
    lines = text.getvalue().splitlines()
    for name in report["processes"]:
        assert any(line.startswith(name) and line.endswith("too_short") for line in lines), name
    assert "stale_reads 0, impossible 0, wrong 0, errors 0" in lines[-1]


# -- slopes and verdicts ----------------------------------------------------------


def test_slope_is_the_least_squares_fit_per_minute() -> None:
    times = [5.0 * n for n in range(25)]  # two minutes
    assert soak.slope_per_minute(times, [100 + 0.5 * t / 60 for t in times]) == pytest.approx(0.5)
    assert soak.slope_per_minute(times, [7.0] * 25) == pytest.approx(0.0)
    # Alternating noise around a flat line does not tilt the fit much; a
    # single spike in the middle does not tilt it at all.
    noisy = [50 + (1 if n % 2 else -1) for n in range(25)]
    assert abs(soak.slope_per_minute(times, noisy)) < 0.1
    spike = [50.0] * 25
    spike[12] = 80.0
    assert soak.slope_per_minute(times, spike) == pytest.approx(0.0)
    assert math.isnan(soak.slope_per_minute([1.0], [1.0]))
    with pytest.raises(ValueError):
        soak.slope_per_minute([1.0, 2.0], [1.0])


def test_trend_gives_the_ends_the_extremes_and_the_slope() -> None:
    t = soak.trend([0.0, 30.0, 60.0, 90.0], [10, 40, 20, 40])
    assert (t["start"], t["end"], t["min"], t["max"]) == (10, 40, 10, 40)
    assert t["samples"] == 4 and t["minutes"] == pytest.approx(1.5)
    assert t["slope_per_min"] == pytest.approx(14.0)  # least squares: 1050 / 4500 per second
    empty = soak.trend([], [])
    assert empty["samples"] == 0 and math.isnan(empty["start"]) and math.isnan(empty["slope_per_min"])


def test_flatness_verdict_against_the_threshold() -> None:
    times = [10.0 * n for n in range(31)]  # five minutes

    def rss(slope_mib_per_min: float) -> list[float]:
        return [(200 + slope_mib_per_min * t / 60) * MiB for t in times]

    flat = soak.flatness(times, rss(0.4), 0.5)
    assert flat["verdict"] == "flat"
    assert flat["slope_mib_per_min"] == pytest.approx(0.4)
    assert flat["start_mib"] == pytest.approx(200) and flat["end_mib"] == pytest.approx(202)
    assert flat["minutes"] == pytest.approx(5)
    assert soak.flatness(times, rss(0.6), 0.5)["verdict"] == "growing"
    assert soak.flatness(times, rss(-3.0), 0.5)["verdict"] == "flat"  # shrinking is not a leak
    # Too few samples, or too short a span, get no verdict either way.
    assert soak.flatness(times[:9], rss(5.0)[:9], 0.5)["verdict"] == "too_short"
    short = [t / 10 for t in times]  # 30 s
    assert soak.flatness(short, rss(50.0), 0.5)["verdict"] == "too_short"


def test_warmup_is_a_share_of_the_run_capped_at_a_minute() -> None:
    assert soak.warmup_seconds(18, 0.2) == pytest.approx(3.6)
    assert soak.warmup_seconds(300, 0.2) == pytest.approx(60)
    assert soak.warmup_seconds(3600, 0.2) == pytest.approx(60)


def test_throughput_counts_each_minute_from_the_last_sample_in_it() -> None:
    def sample(t: float, ops: int) -> dict[str, object]:
        w = {"ops": ops, "reads": ops - ops // 10, "writes": ops // 10, "hits": ops // 2, "misses": 0}
        return {"t": t, "workers": [w, dict(w)]}

    samples = [sample(t, int(t * 100)) for t in range(0, 151, 10)]  # 0..150 s, 100 ops/s per worker
    rows = soak.throughput(samples)
    assert [r["minute"] for r in rows] == [1, 2, 3]
    assert [r["seconds"] for r in rows] == [60, 60, 30]
    assert [r["ops"] for r in rows] == [12000, 12000, 6000]
    assert all(r["ops_per_min"] == pytest.approx(12000) for r in rows)
    assert soak.throughput(samples[:1]) == []


# -- the oracle's extensions: absent documents and counts -----------------------


def _rows_file(path: Path, rows: list[tuple[int, int, int, int, int]]) -> str:
    path.write_bytes(b"".join(ROW.pack(*r) for r in rows))
    return str(path)


def test_checker_judges_absent_documents_and_counts(tmp_path: Path) -> None:
    # Four documents in two groups ({0, 2}, {1, 3}); writes are
    # (op, doc, version, operationTime, sent, ack).
    writes = [
        (OP_UPDATE, 0, 1, 100, 10, 11),
        (OP_DELETE, 0, 2, 200, 20, 21),
        (OP_INSERT, 0, 3, 300, 30, 31),
        (OP_DELETE, 1, 1, 150, 15, 16),
    ]
    checker = Checker(writes, documents=4, groups=2)
    assert checker.absent_version(0, 19) is None
    assert checker.absent_version(0, 25) == 2
    # Group 0 has 2 members, 1 after the delete at 200, 2 again at 300.
    assert checker.valid_counts(0, 0, 5) == {2}
    assert checker.valid_counts(0, 199, 25) == {2, 1}  # the insert was sent after the read ended
    assert checker.valid_counts(0, 250, 100) == {1, 2}
    assert checker.valid_counts(0, 300, 100) == {2}
    assert checker.valid_counts(1, 160, 100) == {1}

    fine = [
        (0, 0, 0, 50, 12),  # id read of the initial version before any write applied
        (0, 0, ABSENT, 250, 40),  # absent once its deletion was applied
        (2, 0, 3, 300, 40),  # find returned the re-inserted version
        (COUNT_KIND, 0, 1, 250, 29),
        (COUNT_KIND, 0, 2, 199, 25),
        (3, 1, ABSENT, 150, 40),  # aggregate without the deleted member
    ]
    result = checker.check_worker(0, _rows_file(tmp_path / "fine", fine))
    assert result == {"rows": 6, "counts_checked": 2, "stale": 0, "impossible": 0, "wrong": 0, "examples": []}

    bad = [
        (0, 0, ABSENT, 300, 40),  # absent after the re-insert was applied: stale
        (1, 0, 1, 200, 40),  # a live version after its deletion was applied: stale
        (COUNT_KIND, 0, 2, 250, 29),  # 2 only after the insert at 300, sent after the read: stale
        (0, 1, ABSENT, 100, 12),  # absent before its deletion was sent: wrong
        (0, 0, 2, 300, 40),  # a document carrying its deletion's version: wrong
        (2, 0, 9, 300, 40),  # a version never written: impossible
    ]
    result = checker.check_worker(7, _rows_file(tmp_path / "bad", bad))
    assert (result["stale"], result["wrong"], result["impossible"]) == (3, 2, 1)
    assert all(e.startswith("worker 7: ") for e in result["examples"])
