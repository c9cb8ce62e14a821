"""Differential test: the cache against PyMongo on generated data, reads and writes.

Hypothesis generates a collection's documents and a sequence of operations:
reads of every cached method (find_one, find, aggregate, count_documents,
estimated_document_count, distinct) with filters, sorts, projections, skips
and limits drawn from a small grammar, and writes by another client (insert,
update, delete). After each write the test waits until the cache's change
stream has delivered it; every read then runs through the cache (twice, so
that the second one is usually a hit) and directly through PyMongo, and the
results must be identical.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis keeps files of its own even without an example database: in the
# temporary directory, not in the checkout.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "cqc-hypothesis"))

from support import ready_collection, stream_of, wait_until

_COUNTER = itertools.count()

ints = st.integers(min_value=0, max_value=3)
words = st.sampled_from(["x", "y", "z"])

document = st.fixed_dictionaries(
    {
        "a": ints,
        "b": words,
        "c": st.lists(ints, max_size=3),
        "d": st.fixed_dictionaries({"x": ints}),
    },
    optional={"e": st.one_of(st.none(), ints, words)},
)

# A small grammar, so that the reads of one example often share a filter and
# differ in one keyed part (projection, sort, skip, limit, method).
FILTERS = [
    {},
    {"a": 1},
    {"a": {"$gt": 1}},
    {"b": "x"},
    {"a": 1, "b": "x"},
    {"b": "x", "a": 1},
    {"c": 2},
    {"d.x": 1},
    {"_id": 2},
    {"$or": [{"a": 0}, {"b": "y"}]},
    {"a": {"$in": [0, 2]}},
    {"e": {"$exists": True}},
    {"$expr": {"$gt": ["$a", {"$size": "$c"}]}},
]
sorts = st.sampled_from([None, [("a", 1), ("_id", 1)]])
projections = st.sampled_from([None, {"a": 1}, {"_id": 0, "b": 1}])
small = st.integers(0, 2)


def _find_one(f: Any, sort: Any, proj: Any, skip: int) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    kwargs: dict[str, Any] = {"sort": sort or [("_id", 1)]}
    if skip:
        kwargs["skip"] = skip
    return ("find_one", (f, proj), kwargs)


def _find(f: Any, sort: Any, proj: Any, skip: int, limit: int) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    kwargs: dict[str, Any] = {"sort": sort or [("_id", 1)], "skip": skip, "limit": limit}
    return ("find", (f, proj), kwargs)


def reads(filters: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Reads of every cached method over ``filters``; a small grammar, so
    that reads of one example often differ in one keyed part only."""
    find_one = st.builds(_find_one, filters, sorts, projections, small)
    find = st.builds(_find, filters, sorts, projections, small, small)
    return st.one_of(
        find_one,
        find_one,
        find,
        find,
        st.builds(lambda f: ("count_documents", (f,), {}), filters),
        st.builds(lambda f, s, n: ("count_documents", (f,), {"skip": s, "limit": n + 1}), filters, small, small),
        st.just(("estimated_document_count", (), {})),
        st.builds(lambda k, f: ("distinct", (k, f), {}), st.sampled_from(["a", "b", "c", "d.x", "e"]), filters),
        st.builds(
            lambda f: ("aggregate", ([{"$match": f}, {"$group": {"_id": "$b", "n": {"$sum": 1}, "s": {"$sum": "$a"}}}, {"$sort": {"_id": 1}}],), {}),
            filters,
        ),
        st.builds(
            lambda f: ("aggregate", ([{"$match": f}, {"$unwind": "$c"}, {"$project": {"c": 1}}, {"$sort": {"_id": 1, "c": 1}}],), {}),
            filters,
        ),
    )  # fmt: skip


writes = st.one_of(
    st.builds(lambda i, d: ("insert", i, d), st.integers(min_value=100, max_value=200), document),
    st.builds(lambda i, a: ("update", i, {"$set": {"a": a}}), st.integers(0, 7), ints),
    st.builds(lambda i, b: ("update", i, {"$set": {"b": b}, "$push": {"c": 1}}), st.integers(0, 7), words),
    st.builds(lambda i: ("delete", i, None), st.integers(0, 7)),
)


@st.composite
def cursor_family(draw: st.DrawFn, f: Any) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """A find (or find_one) and variants of it that each differ in one keyed
    part: projection, sort, skip, limit or the method."""
    params = {"sort": draw(sorts), "proj": draw(projections), "skip": draw(small), "limit": draw(small)}
    family = []
    for _ in range(draw(st.integers(1, 4))):
        method = draw(st.sampled_from(["find", "find", "find_one"]))
        if method == "find":
            family.append(_find(f, params["sort"], params["proj"], params["skip"], params["limit"]))
        else:
            family.append(_find_one(f, params["sort"], params["proj"], params["skip"]))
        part = draw(st.sampled_from(["limit", "limit", "proj", "skip", "sort"]))
        params = {**params, part: draw({"sort": sorts, "proj": projections, "skip": small, "limit": small}[part])}
    return family


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """Documents, and operations: writes, and bursts of reads that share a
    filter (one of one or two per example), so that reads differing in one
    keyed part meet under the same generation."""
    docs = draw(st.lists(document, min_size=2, max_size=8))
    pool = draw(st.lists(st.sampled_from(FILTERS), min_size=1, max_size=2))
    burst = st.one_of(
        st.sampled_from(pool).flatmap(lambda f: st.lists(reads(st.just(f)), min_size=1, max_size=4)),
        st.sampled_from(pool).flatmap(cursor_family),
    )
    steps = draw(
        st.lists(
            st.one_of(burst, burst, burst, writes.map(lambda w: [w])),
            min_size=1,
            max_size=10,
        )
    )
    ops = [("write" if op[0] in ("insert", "update", "delete") else "read", op) for step in steps for op in step]
    return docs, ops


def _comparable(method: str, result: Any) -> Any:
    if method in ("find", "aggregate"):
        return list(result)
    if method == "distinct":
        return sorted(result, key=repr)
    return result


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_the_cache_returns_what_pymongo_returns_under_generated_reads_and_writes(
    manager, client, other_client, db_name
):
    raw_db, writer_db = client[db_name], other_client[db_name]
    raw_db.create_collection("warmup")
    ready_collection(manager, db_name, "warmup")

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=scenarios())
    def run(scenario: tuple[list[dict[str, Any]], list[tuple[str, Any]]]) -> None:
        docs, ops = scenario
        name = f"c{next(_COUNTER)}"
        if docs:
            raw_db[name].insert_many([{"_id": i, **d} for i, d in enumerate(docs)])
        else:
            raw_db.create_collection(name)
        cached, raw, writer = manager[db_name][name], raw_db[name], writer_db[name]
        for kind, op in ops:
            if kind == "write":
                action, _id, arg = op
                events = stream_of(manager, db_name).events
                if action == "insert":
                    changed = 0
                    if raw.find_one({"_id": _id}) is None:
                        writer.insert_one({"_id": _id, **arg})
                        changed = 1
                elif action == "update":
                    changed = writer.update_one({"_id": _id}, arg).modified_count
                else:
                    changed = writer.delete_one({"_id": _id}).deleted_count
                if changed:
                    wait_until(
                        lambda: stream_of(manager, db_name).events >= events + changed,
                        what=f"the {action} reaches the cache",
                    )
                continue
            method, args, kwargs = op
            expected = _comparable(method, getattr(raw, method)(*args, **kwargs))
            for attempt in ("first", "second"):
                got = _comparable(method, getattr(cached, method)(*args, **kwargs))
                assert got == expected, (attempt, method, args, kwargs)

    run()
    snap = manager.snapshot()
    assert snap.hits > 0 and snap.admissions > 0, snap  # the cache was really exercised
    assert not snap.bypasses, snap.bypasses  # every generated read is cacheable
