"""``benchmarks.threads`` at a tiny size: every count of threads and tasks is
measured in every round, every read is a checked hit, each ratio is the
median of its per-round throughput ratios, and a wrong result fails the run."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pymongo
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import _kit as kit  # noqa: E402
from benchmarks import threads  # noqa: E402


def test_a_tiny_run_measures_every_count_and_derives_its_ratios(server_uri: str) -> None:
    with pymongo.MongoClient(server_uri) as client:
        before = set(client.list_database_names())
    report = threads.run(server_uri, docs=60, rounds=2, seconds=0.2, seed=7)
    with pymongo.MongoClient(server_uri) as client:
        assert set(client.list_database_names()) <= before, "the benchmark must drop its database"

    names = {"sync": "threads_{}_throughput_over_one_thread", "async": "async_tasks_{}_throughput_over_one_thread"}
    assert set(report["ratios"]) == {name.format(n) for name in names.values() for n in (2, 4, 8)}
    assert set(report["control"]["decode"]) == set(report["ratios"])
    for api, name in names.items():
        assert report["results"][api]["hits"] > 0
        for kind, ratios in (("hit", report["ratios"]), ("decode", report["control"]["decode"])):
            per = report["results"][api][f"{kind}_throughput_per_s"]
            assert set(per) == {"1", "2", "4", "8"}
            assert all(len(v) == 2 and min(v) > 0 for v in per.values()), per
            for n in ("2", "4", "8"):
                expected = statistics.median([a / b for a, b in zip(per[n], per["1"])])
                assert ratios[name.format(n)] == expected


def test_a_wrong_result_fails_the_run(server_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = threads._expected

    def one_wrong(*args):
        raws, expected = real(*args)
        expected[3] = dict(expected[3], name="not what the server holds")
        return raws, expected

    monkeypatch.setattr(threads, "_expected", one_wrong)
    with pytest.raises(kit.BenchmarkFailed, match="sync verification failed: [1-9][0-9]* mismatching"):
        threads.run(server_uri, docs=5, rounds=1, seconds=0.2, seed=7)
