"""Faults of the stream's link, its cursor and the server while the cache
serves reads and a writer writes (``benchmarks.faults``): no stale read, no
exception but PyMongo's own for a direct read, and caching resumes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks import faults  # noqa: E402
from client_query_cache.testing import external_uri  # noqa: E402

pytestmark = pytest.mark.skipif(
    external_uri() is not None, reason="MONGODB_URI is set: the scenarios stop and break a local server"
)

#: Scheduling slack on a loaded 2-core machine.
SLACK_MS = 600
#: ring_full runs again (at most this many times in all) when something
#: other than its ring kept its reads' admissions out while it was filled.
RING_FULL_RUNS = 3


def _ring_full_result() -> dict:
    """ring_full's result once its ring refused admissions while it was
    filled, or once nothing else happened then: its reads (12 of 200 KB,
    over twice the 1 MiB ring, nobody draining it) then all pushed their
    admissions, and the ring must have refused some. A run whose ring
    refused nothing while reads bypassed or admissions were refused for
    another reason (the owner's stream demoted by a starved owner, or not
    serving between a read's capture and its admission) is checked like
    any other and then run again."""
    for _ in range(RING_FULL_RUNS):
        result = faults.run_scenario("ring_full")
        assert faults.checks({"scenarios": [result]}) == []
        assert result["stale_reads"] == 0 and result["other_errors"] == 0
        fill = result["ring_fill"]
        if fill["ring_full"] > 0 or fill["rejected_otherwise"] + fill["bypasses"] == 0:
            return result
    pytest.fail(f"the ring's admissions were kept out otherwise in every run: {fill}")


@pytest.mark.parametrize("name", list(faults.SCENARIOS))
def test_a_fault_leads_to_bypass_and_recovery_never_to_a_stale_read(name: str) -> None:
    result = _ring_full_result() if name == "ring_full" else faults.run_scenario(name)
    assert faults.checks({"scenarios": [result]}) == []
    assert result["stale_reads"] == 0 and result["other_errors"] == 0
    assert result["hits"] > 0 and result["recovery_ms"] is not None
    # A read never returns a version superseded longer ago than a silent
    # stream (the stall bound) or owner (the heartbeat timeout) is trusted:
    # they stop serving by then, and one that comes back does not serve
    # again before its backlog is applied.
    assert result["superseded_max_ms"] <= result["trust_bound_ms"] + SLACK_MS
    if name == "history_lost":
        assert result["history_lost"] == 1
    if name == "server_restart":
        assert result["writes_acked"] > 0
    if name == "ring_full":
        assert result["rejected_admissions"].get("ring_full", 0) > 0, result["rejected_admissions"]
    if name == "arena_full":
        assert result["evictions"] > 0
    if name == "worker_killed":
        assert result["attached_workers_at_end"] == 1  # the owner detached every killed worker
