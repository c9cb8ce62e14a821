"""``benchmarks.guard``'s decision from block medians, without builds or a
server: identical blocks pass, a stable 30% slowdown fails, noise is
inconclusive, and the exact intervals have the textbook critical values.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

from benchmarks.guard import (  # noqa: E402
    Comparison,
    Verdict,
    _cut,
    _rank_sum_counts,
    _signed_rank_counts,
    decide,
    exit_status,
    not_measured,
)

#: Block medians (ns) of a hit-like case that drifts from pair to pair, as
#: these machines do: the same operation between 18 and 27 us.
DRIFTING = [21_000.0, 18_500.0, 24_000.0, 19_900.0, 26_800.0, 22_100.0, 20_300.0, 25_500.0, 18_900.0, 23_700.0]


def _jitter(values: list[float], rel: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [v * (1.0 + rng.uniform(-rel, rel)) for v in values]


def test_identical_block_medians_are_ok() -> None:
    result = decide(DRIFTING, list(DRIFTING))
    assert result.verdict is Verdict.OK
    assert result.ratio_of_medians == 1.0 and result.estimate == 1.0
    assert result.ci_low == result.ci_high == 1.0


def test_an_identical_build_with_a_few_percent_of_noise_per_block_is_ok() -> None:
    work = _jitter(DRIFTING, 0.04, seed=1)
    result = decide(DRIFTING, work)
    assert result.verdict is Verdict.OK, result
    assert 0.95 < result.ci_low <= result.estimate <= result.ci_high < 1.06


def test_a_stable_30_percent_slowdown_is_slower_even_while_the_machine_drifts() -> None:
    work = _jitter([v * 1.3 for v in DRIFTING], 0.04, seed=2)
    result = decide(DRIFTING, work)
    assert result.verdict is Verdict.SLOWER, result
    assert result.ci_low > 1.15
    assert 1.2 < result.estimate < 1.4


def test_pairing_is_what_separates_the_slowdown_from_the_drift() -> None:
    # The drift between pairs (15-30 us) is wider than the slowdown: paired,
    # the slowdown is clear; unpaired, the rank-sum interval cannot exclude
    # 1.15.
    drift = [15_000.0, 29_000.0, 17_500.0, 26_000.0, 21_000.0, 30_000.0, 16_000.0, 24_000.0, 19_000.0, 27_500.0]
    work = _jitter([v * 1.3 for v in drift], 0.04, seed=2)
    paired = decide(drift, work)
    unpaired = decide(drift, work, paired=False)
    assert paired.verdict is Verdict.SLOWER
    assert unpaired.verdict is Verdict.INCONCLUSIVE
    assert unpaired.ci_high - unpaired.ci_low > 5 * (paired.ci_high - paired.ci_low)


def test_noisy_blocks_are_inconclusive_not_slower() -> None:
    # 20% slower on average, but each block moves by up to +-35% on its own.
    base = _jitter(DRIFTING, 0.35, seed=3)
    work = _jitter([v * 1.2 for v in DRIFTING], 0.35, seed=4)
    result = decide(base, work)
    assert result.verdict is Verdict.INCONCLUSIVE, result
    assert result.ci_low < 1.15 < result.ci_high
    assert "contains 1.15" in result.reason


def test_a_slowdown_just_under_the_threshold_is_not_a_failure() -> None:
    work = _jitter([v * 1.10 for v in DRIFTING], 0.02, seed=5)
    assert decide(DRIFTING, work).verdict is not Verdict.SLOWER


def test_too_few_pairs_for_a_95_percent_interval_are_inconclusive() -> None:
    # 5 pairs: even five slower pairs out of five happen with p = 1/32 > 0.025.
    result = decide(DRIFTING[:5], [v * 2 for v in DRIFTING[:5]])
    assert result.verdict is Verdict.INCONCLUSIVE
    assert math.isnan(result.ci_low) and "too few" in result.reason
    # 6 pairs are enough: the interval is then [min, max] of the pair ratios.
    assert decide(DRIFTING[:6], [v * 2 for v in DRIFTING[:6]]).verdict is Verdict.SLOWER


def test_a_faster_working_tree_is_ok() -> None:
    assert decide(DRIFTING, [v * 0.6 for v in DRIFTING]).verdict is Verdict.OK


def test_unpaired_comparison_detects_a_slowdown_larger_than_the_spread() -> None:
    base = _jitter([20_000.0] * 10, 0.05, seed=6)
    work = _jitter([26_000.0] * 12, 0.05, seed=7)
    result = decide(base, work, paired=False)
    assert result.verdict is Verdict.SLOWER, result
    assert result.method.startswith("unpaired")


def test_identical_builds_are_never_called_slower_over_many_noisy_runs() -> None:
    # Same distribution on both sides (drift plus 10% per-block noise): with
    # a 95% interval, "slower" (interval above 1.15) must essentially never
    # happen, and most runs must say "ok".
    verdicts = []
    for seed in range(300):
        rng = random.Random(seed)
        drift = [rng.uniform(18_000, 27_000) for _ in range(12)]
        base = [d * math.exp(rng.gauss(0, 0.10)) for d in drift]
        work = [d * math.exp(rng.gauss(0, 0.10)) for d in drift]
        verdicts.append(decide(base, work).verdict)
    assert Verdict.SLOWER not in verdicts
    assert verdicts.count(Verdict.OK) > 0.8 * len(verdicts)


def test_a_30_percent_slowdown_with_moderate_noise_is_found_in_most_runs() -> None:
    found = 0
    for seed in range(300):
        rng = random.Random(seed)
        drift = [rng.uniform(18_000, 27_000) for _ in range(12)]
        base = [d * math.exp(rng.gauss(0, 0.05)) for d in drift]
        work = [1.3 * d * math.exp(rng.gauss(0, 0.05)) for d in drift]
        found += decide(base, work).verdict is Verdict.SLOWER
    assert found > 0.9 * 300


def test_exact_intervals_use_the_textbook_critical_values() -> None:
    # Wilcoxon signed rank, n = 10, two-sided 0.05: reject if T <= 8, so the
    # interval drops 9 Walsh averages at each end (coverage 0.951).
    k, coverage = _cut(_signed_rank_counts(10), 0.95)
    assert k == 9 and coverage == pytest.approx(1 - 2 * 25 / 1024)
    # Mann-Whitney, 10 and 10, two-sided 0.05: reject if U <= 23.
    k, coverage = _cut(_rank_sum_counts(10, 10), 0.95)
    assert k == 24 and 0.95 <= coverage < 0.96
    assert sum(_signed_rank_counts(10)) == 2**10
    assert sum(_rank_sum_counts(4, 6)) == math.comb(10, 4)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        decide([1.0, 2.0], [1.0])  # paired needs equal lengths
    with pytest.raises(ValueError):
        decide([1.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError):
        decide([], [])


def test_exit_status_is_1_only_for_a_stable_slowdown() -> None:
    ok = decide(DRIFTING, DRIFTING)
    slower = decide(DRIFTING, [v * 1.5 for v in DRIFTING])
    inconclusive = decide(DRIFTING[:3], DRIFTING[:3])
    missing = not_measured(Verdict.NOT_COMPARABLE, "the base cannot run it")
    broken = not_measured(Verdict.ERROR, "the working tree fails it")
    cases: dict[str, Comparison] = {"a": ok, "b": inconclusive, "c": missing}
    assert exit_status(cases) == 0
    assert exit_status({**cases, "d": broken}) == 2
    assert exit_status({**cases, "d": broken, "e": slower}) == 1


def test_the_guard_builds_and_runs_both_sides_end_to_end(tmp_path: Path) -> None:
    # One pair of small blocks: too few for an interval, so every case must
    # come out inconclusive (exit 0) with measured block medians on both
    # sides, and the checkout must be left as it was.
    import json
    import subprocess

    def status() -> list[str]:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        return [line for line in out.splitlines() if "__pycache__" not in line]

    before = status()
    out = tmp_path / "guard.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.guard", "HEAD", "--work-rev", "HEAD", "--blocks", "1",
         "--warmup-pairs", "0", "--ops", "50", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["exit_status"] == 0
    assert set(report["cases"]) == {"hit", "miss", "admission", "invalidation"}
    for name, case in report["cases"].items():
        assert case["comparison"]["verdict"] == "inconclusive", name
        assert len(case["base_block_p50_ns"]) == len(case["work_block_p50_ns"]) == 1, name
        # Every block timed its operations: a median of 0 ns (or none) would
        # be a block that measured nothing.
        for side in ("base_block_p50_ns", "work_block_p50_ns"):
            (p50,) = case[side]
            assert isinstance(p50, (int, float)) and p50 > 0, (name, side, p50)
    assert status() == before
