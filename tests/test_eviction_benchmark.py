"""``benchmarks.eviction`` in its quick mode: every trace runs in both modes
through the real cache and through libCacheSim, every read is checked with
no wrong document, the counters account for every read, and the miss
ratios are sane (in [0, 1], Belady's the lowest of libCacheSim's); and the
pieces whose answer is known: the documents' sizes, the traces' shapes, the
oracleGeneral records, a write's new object for libCacheSim, the budgets."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import bson
import numpy as np
import pymongo
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) leaves the root out
    sys.path.insert(0, str(ROOT))

# The sanitizer's venv (.ci/sanitize) installs the test extra only; libCacheSim is the bench extra's.
pytest.importorskip("libcachesim")

from benchmarks import _kit as kit  # noqa: E402
from benchmarks import eviction  # noqa: E402


def test_the_quick_run_replays_every_trace_in_both_modes_and_checks_every_read(
    server_uri: str, runtime_dir: Path, tmp_path: Path
) -> None:
    args = eviction._parse(["--quick"])
    with pymongo.MongoClient(server_uri) as client:
        before = set(client.list_database_names())
    report = eviction.run(args, server_uri, kit.Status(quiet=True))
    with pymongo.MongoClient(server_uri) as client:
        assert set(client.list_database_names()) <= before, "the benchmark must drop its database"
    out = tmp_path / "eviction.json"
    kit.write_json(str(out), report)
    report = json.loads(out.read_text(encoding="utf-8"))

    assert report["schema"] == "cqc.eviction/1" and report["mode"] == "quick"
    assert report["problems"] == []
    calibration = report["calibration"]
    assert calibration["residues_mod_8"] == 8 and 64 < calibration["overhead_bytes"] < 64 + 200

    traces, budgets = eviction.QUICK["traces"], eviction.QUICK["budgets"]
    assert set(report["results"]) == set(traces)
    expected = {f"{t}_{b}_{m}_miss_over_best" for t in traces for b in budgets for m in eviction.MODES}
    assert set(report["ratios"]) == expected
    for name, ratio in report["ratios"].items():
        assert 0 < ratio < 10, (name, ratio)

    for trace, rows in report["results"].items():
        assert set(rows) == set(budgets), trace
        t = report["traces"][trace]
        assert t["reads"] == args.reads and t["working_set_bytes"] > 0
        for label, row in rows.items():
            where = f"{trace} {label}"
            sims = row["libcachesim"]
            assert set(sims) == set(eviction.POLICIES), where
            for policy, sim in sims.items():
                assert 0.0 <= sim["obj_miss"] <= 1.0 and 0.0 <= sim["byte_miss"] <= 1.0, (where, policy)
                assert sims["Belady"]["obj_miss"] <= sim["obj_miss"], (where, policy)
            assert sims["W-TinyLFU"]["obj_miss"] < 1.0, f"{where}: W-TinyLFU's window admits nothing"
            assert row["best"]["obj_miss"] == min(sims[p]["obj_miss"] for p in eviction.BEST_OF)
            assert row["budget_bytes"] % 64 == 0 and not row["clamped"]
            for mode in eviction.MODES:
                r = row[mode]
                assert r["reads"] == r["checked"] == args.reads, (where, mode)
                assert r["mismatches"] == 0, (where, mode, r["mismatch_examples"])
                assert 0.0 <= r["obj_miss"] <= 1.0 and 0.0 <= r["byte_miss"] <= 1.0, (where, mode)
                not_served = r["reads"] - r["hits"]
                assert r["obj_miss"] == pytest.approx(not_served / r["reads"]), (where, mode)
                assert sum(r["not_served"].values()) == not_served, (where, mode)
                # Each read counted once: a hit, a miss, a refusal or a bypass alone.
                o = r["outcomes"]
                assert o["uncounted"] == 0 and sum(o.values()) == r["reads"], (where, mode)
                assert o["hit"] == r["hits"] > 0, (where, mode)
                # No cache beats the clairvoyant one, nor misses less than the first reads.
                assert r["obj_miss"] >= sims["Belady"]["obj_miss"] - 1e-9, (where, mode)
                # A first read in the trace's order can hit in shared mode: another worker may
                # have read the document's next read first.
                first_reads, distinct = r["not_served"]["compulsory"], t["distinct_documents"]
                assert first_reads == distinct if mode == "local" else first_reads <= distinct
                a = r["arena"]
                assert a["budget_bytes"] == row["budget_bytes"] and 0 < a["used_bytes"] <= a["budget_bytes"]
                assert a["evictions"] > 0, f"{where} {mode}: a 10% budget must evict"
            if trace == "writes":
                assert row["local"]["writes"] == row["shared"]["writes"] == args.reads // 100

    verdict = kit.verdict(report, eviction.TARGETS, quick=True)
    assert verdict["status"] == "smoke check" and [t["met"] for t in verdict["targets"]] == [None]
    # A full run would judge the worst ratio (the target names the report's figures).
    [judged] = kit.verdict(report, eviction.TARGETS, quick=False)["targets"]
    assert judged["value"] == max(report["ratios"].values()) and judged["met"] is not None

    png = tmp_path / "eviction.png"
    eviction.plot(str(png), report)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_document_has_its_size_at_every_version_and_a_wrong_one_is_named() -> None:
    for key in (0, 1, 77, 9999):
        raw = bson.encode(eviction.document(key, 0, 5))
        assert eviction.DOC_MIN <= len(raw) == eviction.doc_size(key, 5) <= eviction.DOC_MAX
        assert len(bson.encode(eviction.document(key, 12345, 5))) == len(raw)
    doc = eviction.document(7, 3, 5)
    assert eviction.check_read(doc, 7, 0, 3, 5) == 3
    assert eviction.check_read(doc, 7, 4, 9, 5) == "version 3 outside [4, 9]"
    assert eviction.check_read(doc, 8, 0, 9, 5).startswith("_id 7")
    assert eviction.check_read({**doc, "body": doc["body"][:-1] + "?"}, 7, 0, 9, 5).startswith("content differs")
    assert eviction.check_read(None, 7, 0, 9, 5) == "no document"


def test_the_traces_have_their_shapes() -> None:
    n, reads = 1000, 10_000
    scan = eviction.make_trace("scan", n, reads, 1)
    cold = scan.keys[scan.keys >= n]
    assert len(scan.keys) == reads and len(cold) == len(np.unique(cold)) == reads // 5
    assert (scan.keys[4 * (n // 5) : 5 * (n // 5)] == np.arange(n, n + n // 5)).all()
    shift = eviction.make_trace("shift", n, reads, 1)
    first, second = shift.keys[: reads // 2], shift.keys[reads // 2 :]
    top = lambda keys: np.bincount(keys, minlength=n).argmax()  # noqa: E731
    assert top(first) != top(second)
    writes = eviction.make_trace("writes", n, reads, 1)
    assert len(writes.writes) == reads // 100
    assert [pos for pos, _ in writes.writes] == sorted(pos for pos, _ in writes.writes)
    assert all(0 <= key < n for _, key in writes.writes)
    again = eviction.make_trace("zipf09", n, reads, 1).keys
    assert eviction.make_trace("zipf09", n, reads, 1).keys.tolist() == again.tolist()


def test_a_write_makes_a_new_object_for_libcachesim_and_the_records_say_so(tmp_path: Path) -> None:
    trace = eviction.Trace("writes", np.array([5, 5, 6, 5, 5, 6]), ((2, 5), (4, 5)))
    ids = eviction.object_ids(trace, 100)
    assert ids.tolist() == [5, 5, 6, 100, 101, 6]
    path = tmp_path / "t.bin"
    eviction.write_oracle_general(str(path), ids, np.full(6, 1192))
    rec = np.fromfile(path, dtype=np.dtype([("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nx", "<i8")]))
    assert rec["id"].tolist() == [6, 6, 7, 101, 102, 7] and (rec["sz"] == 1192).all()
    assert rec["nx"].tolist() == [1, -1, 5, -1, -1, -1]


def test_a_budget_is_rounded_as_the_arena_rounds_and_raised_to_its_minimum() -> None:
    assert eviction.budget_bytes(0.10, 1_000_001) == (100_032, False)
    assert eviction.budget_bytes(0.01, 1_000_000) == (64 * 1024, True)
    assert eviction.align8(87 + 900) == 992 and eviction.align8(992) == 992
