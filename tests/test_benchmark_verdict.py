"""Every harness ends with one verdict line, also in its JSON: its checks,
then its targets in a full run; a quick run's figures are a smoke check."""

from __future__ import annotations

import json

from benchmarks import _kit as kit
from benchmarks import collection_reads, hit_path, public_shared_cache, threads

TARGETS = (kit.Target("ratios.*.hot", "<=", 0.2), kit.Target("ratios.a.cold", ">=", 1.0))


def _report(hot_b: float, checks: bool | None = True) -> dict:
    report = {"ratios": {"a": {"hot": 0.1, "cold": 1.5}, "b": {"hot": hot_b, "cold": 2.0}}}
    if checks is not None:
        report["checks"] = {"passed": checks, "problems": [] if checks else ["x"]}
    return report


def test_a_full_run_is_judged_on_the_worst_figure_of_a_wildcard():
    assert kit.verdict(_report(0.15), TARGETS, quick=False)["status"] == "passed"
    missed = kit.verdict(_report(0.25), TARGETS, quick=False)
    assert missed["status"] == "targets missed"
    assert missed["targets"][0] == {"figure": "ratios.*.hot", "target": "<= 0.2", "value": 0.25, "met": False}
    assert missed["targets"][1]["met"] is True


def test_a_quick_run_is_a_smoke_check_whose_figures_are_not_judged():
    v = kit.verdict(_report(0.25), TARGETS, quick=True)
    assert v["status"] == "smoke check"
    assert [t["met"] for t in v["targets"]] == [None, None]
    assert v["targets"][0]["value"] == 0.25


def test_failed_checks_come_first_and_a_missing_figure_is_a_miss():
    assert kit.verdict(_report(0.1, checks=False), TARGETS, quick=True)["status"] == "checks failed"
    v = kit.verdict({"ratios": {}}, TARGETS, quick=False)
    assert v["status"] == "targets missed" and v["targets"][0]["value"] is None


def test_without_targets_the_checks_decide(capsys):
    assert kit.verdict(_report(9.0), (), quick=True)["status"] == "passed"
    assert kit.verdict(_report(9.0, checks=None), (), quick=False)["status"] == "passed"


def test_conclude_prints_one_verdict_line_and_writes_it(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = kit.conclude(_report(0.25), None, lambda r: print("table"), str(out), targets=TARGETS, quick=False)
    printed = capsys.readouterr().out.splitlines()
    assert code == 0  # targets are reported, never a failure
    assert [line for line in printed if line.startswith("verdict:")] == ["verdict: targets missed: ratios.*.hot"]
    assert json.loads(out.read_text())["verdict"]["status"] == "targets missed"


def test_the_ratio_harnesses_name_figures_their_reports_have():
    # The paths exist in the reports' shapes (a wrong one would be a
    # permanent miss).
    shapes = {
        hit_path: {"ratios": dict.fromkeys(
            ["hit_over_direct_p50", "async_hit_over_direct_p50", "hit_over_decode_p50", "async_hit_over_decode_p50"], 1.0
        )},
        threads: {"ratios": dict.fromkeys(["threads_2_throughput_over_one_thread"], 1.0)},
        collection_reads: {"ratios": {"find": {"hot_cached_over_direct_p50": 1.0, "cold_cached_over_direct_p50": 1.0}}},
        public_shared_cache: {"summary": {m: dict.fromkeys(
            ["shared_over_direct_hot_p50", "shared_over_independent_hot_p50", "pss_shared_over_independent_hot"], 1.0
        ) for m in public_shared_cache.MODES}},
    }
    for module, shape in shapes.items():
        v = kit.verdict(shape, module.TARGETS, quick=False)
        assert v["targets"] and all(t["value"] == 1.0 for t in v["targets"]), module.__name__
    shared = {"ratios": dict.fromkeys(["shared_hit_over_decode_p50", "shared_over_local_p50"], 1.0)}
    v = kit.verdict(shared, hit_path.SHARED_TARGETS, quick=False)
    assert v["targets"] and all(t["value"] == 1.0 for t in v["targets"])
