"""``benchmarks.floor_cost`` at a tiny size: every pattern runs in both
modes, every read is checked (a read that went back in time fails the run),
and the counts add up to the reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pymongo

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import _kit as kit  # noqa: E402
from benchmarks import floor_cost  # noqa: E402


def _args() -> object:
    ns = kit.parser("floor_cost", floor_cost.__doc__).parse_args([])
    ns.quick, ns.patterns, ns.modes = True, floor_cost.PATTERNS, floor_cost.MODES
    ns.documents, ns.rounds, ns.pause, ns.connect_every, ns.max_await_ms = 20, 6, 0.0, 0.05, 200
    return ns


def test_a_tiny_run_reads_every_pattern_in_both_modes_and_checks_every_read(server_uri: str, runtime_dir) -> None:
    with pymongo.MongoClient(server_uri) as client:
        before = set(client.list_database_names())
    report = floor_cost.run(_args(), server_uri, kit.Status(quiet=True))
    with pymongo.MongoClient(server_uri) as client:
        assert set(client.list_database_names()) <= before, "the benchmark must drop its database"

    assert report["problems"] == []
    assert set(report["patterns"]) == set(floor_cost.PATTERNS)
    for pattern, modes in report["patterns"].items():
        assert set(modes) == {"local", "shared"}, pattern
        for mode, r in modes.items():
            assert r["reads"] == r["hits"] + r["misses"] + r["behind"] + r["bypasses"] > 0, (pattern, mode, r)
            assert r["bypasses"] == 0, (pattern, mode, r)
    for mode in ("local", "shared"):
        assert report["patterns"]["read_back"][mode]["read_backs"] == 6
        assert report["patterns"]["read_others"][mode]["others"] == 6 * 4


def test_a_read_that_goes_back_is_reported() -> None:
    seen = floor_cost._Seen()
    seen.check("p", {"_id": 1, "n": 3}, 1)
    seen.check("p", {"_id": 1, "n": 2}, 1)
    seen.check("p", {"_id": 2, "n": 0}, 1)
    assert len(seen.problems) == 2 and "went back to version 2 after 3" in seen.problems[0]
