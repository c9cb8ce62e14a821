"""``benchmarks.streams`` at a tiny size, run as its command: in both modes,
at one and four databases, the follower adds at most four threads and two
connections, every database serves a hit, every read is allowed and every
latency sample is read back; and its checks fail a report that breaks them."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pymongo
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import streams  # noqa: E402

#: The idle window is three of the follower's await periods (streams.MAX_AWAIT_MS): an idle
#: getMore returns after one, so a window of one could end before any did (it did once in CI,
#: under a load average of 12) and find no getMore where the follower was polling as it should.
IDLE_SECONDS = 3 * streams.MAX_AWAIT_MS / 1000
TINY = ["--quick", "--dbs", "1,4", "--samples", "10", "--idle-seconds", f"{IDLE_SECONDS:g}", "--modes", "local,shared"]


@pytest.fixture(scope="module")
def report(server_uri: str) -> Iterator[dict]:
    """The JSON report of a tiny quick run against the session's server, its owners' sockets
    in a runtime directory of its own (and the databases it left behind, under ``leftover``)."""
    tmp = Path(tempfile.mkdtemp(prefix="cqc-rt-"))
    out = tmp / "streams.json"
    try:
        with pymongo.MongoClient(server_uri) as client:
            before = set(client.list_database_names())
            env = {**os.environ, "MONGODB_URI": server_uri, "CQC_RUNTIME_DIR": str(tmp)}
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.streams", *TINY, "--json", str(out)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            leftover = set(client.list_database_names()) - before
        yield {**json.loads(out.read_text(encoding="utf-8")), "leftover": leftover}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_tiny_run_measures_one_follower_per_cache_in_both_modes(report: dict) -> None:
    assert report["schema"] == "cqc.streams/1" and report["mode"] == "quick"
    assert report["leftover"] == set(), "the benchmark must drop its databases"
    assert report["checks"] == {"passed": True, "problems": []}
    assert report["verdict"]["status"] == "smoke check"
    assert report["machine"]["cpus"] >= 1 and report["settings"]["dbs"] == [1, 4]
    assert set(report["results"]) == {"local", "shared"}
    for mode, rows in report["results"].items():
        assert set(rows) == {"1", "4"}, mode
        for n, r in rows.items():
            where = f"{mode} x{n}"
            assert 1 <= r["stream_threads"] <= streams.MAX_THREADS, where
            assert 1 <= r["stream_connections"] <= streams.MAX_CONNECTIONS, where
            assert r["served"] == r["databases"] == int(n), where
            assert r["scope"] == ["deployment"] and r["scope_reason"] == [""], where
            assert r["idle"]["getmores_per_s"] > 0 and r["idle"]["cpu_ms_per_s"] >= 0, where
            assert r["rss"]["after_bytes"] > 0, where
            lat = r["latency"]
            assert lat["n"] == lat["samples"] == 10, where
            assert 0 < lat["p50"] <= lat["p95"] <= lat["max"] < streams.POLL_TIMEOUT_S * 1000, where
            assert lat["violations"] == lat["timeouts"] == lat["uncached"] == 0, (where, lat["violation_examples"])
            # A cached read, a read of the new value and the confirming reads, each sample.
            assert lat["reads_checked"] >= lat["n"] * (2 + streams.CONFIRM_READS) + int(n), where
    assert set(report["ratios"]) == {"local_p95_over_one_database", "shared_p95_over_one_database"}
    # The control: the server alone, after the first mode's cache, every event delivered.
    for n in ("1", "4"):
        control = report["results"]["local"][n]["server_delivery"]
        assert control["n"] == control["samples"] == 10 and control["lost"] == 0, n
        # 0: the event reached the stream before the insert returned.
        assert 0 <= control["p50"] <= control["p95"] < streams.POLL_TIMEOUT_S * 1000, n
        assert "server_delivery" not in report["results"]["shared"][n]
    assert report["server_p95_over_one_database"] > 0


def test_the_checks_fail_a_report_that_breaks_them(report: dict) -> None:
    broken = copy.deepcopy(report)
    local = broken["results"]["local"]["4"]
    local.update(stream_threads=5, stream_connections=3, served=3)
    local["latency"].update(violations=1, timeouts=2, uncached=1)
    broken["ratios"].update(local_p95_over_one_database=1.2, shared_p95_over_one_database=1.6)
    problems = streams.problems_of(broken)
    assert len(problems) == 6 and all(p.startswith("local with 4 databases") for p in problems), problems
    # The latency ratio is a check of a full run only.
    broken["mode"] = "full"
    assert streams.problems_of(broken)[6:] == ["shared_p95_over_one_database = 1.60 (at most 1.5)"]


def test_a_read_of_a_value_it_may_not_return_is_a_violation() -> None:
    reads = streams.Reads()
    view = types.SimpleNamespace(full_name="db.t")
    docs = [{"_id": 1, "v": 0}, {"_id": 1, "v": 7}, {"_id": 1, "v": 3}, None, {"_id": 2, "v": 0}]
    assert [reads.check(view, 1, doc, (0, 7), "a read") for doc in docs] == [0, 7, 3, None, None]
    assert reads.count == 5 and reads.violations == 3 and len(reads.examples) == 3
