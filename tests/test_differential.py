"""Differential test: a cached view against PyMongo, the oracle of fidelity.

Hypothesis generates a collection (documents whose ``_id``s mix types that
MongoDB compares equal, ``1``, ``1.0``, ``Int64(1)``, ``Decimal128("1")``,
and ones it does not; optionally a unique index and a default collation; the
codec options of both collections) and a sequence of operations:

* reads of every cached method (``find_one``, ``find``, ``aggregate``,
  ``count_documents``, ``estimated_document_count``, ``distinct``), good and
  bad: malformed filters, projections, sorts, pipelines and arguments, whose
  outcome is PyMongo's exception; cursors read to the end or closed after a
  few documents, options given as keywords or by the cursor's methods, and
  families of reads that differ in one keyed part (limit, skip, sort
  direction, projection, method), where a key that mixes two of them up
  returns one's result for the other;
* writes between them (insert, replace, update, delete, drop, rename, a
  collection renamed over the one being read), sent by another client or
  through the cached view itself.

Every read is sent to PyMongo, then three times to the cached view ("cold",
then "warm": usually a hit, then "template": under the default codec
options usually a hit served from the entry's template, after the warm
result's containers were changed in place), and the outcomes must be
identical: the result with its types (``1`` and ``1.0`` differ, a ``SON``
is not a ``dict``), or the exception's class and server error code.

The oracle is exact, not timing-dependent. The cache may serve a write's old
version only until its change event is applied (docs/consistency.md,
"Limits"), so after a write by another client the test waits until the
manager's stream has applied it: the other client then writes a marker and
the test waits until the stream's ``applied_time`` reaches the marker's
operation time (events are applied in order, so every earlier write is in).
A write through the view needs no wait: the causal floor (docs/consistency.md,
"Causal reads") promises the process reads its own writes at once, and the
generator leaves the wait out for some of them to test exactly that.

The test runs with the sync API (``CacheManager``), the async one
(``AsyncCacheManager``, on an event loop of its own) and a shared cache (a
``SharedCache`` owner process and a worker manager in this process; after a
miss the test waits until the owner has applied or refused its admission,
so that the warm read can be a hit). The
examples of a run (``CQC_DIFF_EXAMPLES``, 1,000 by default) are shared out
between the three; the seed is fixed (``derandomize``) unless
``CQC_DIFF_SEED`` names one, e.g. to run more by hand::

    CQC_DIFF_EXAMPLES=10000 CQC_DIFF_SEED=7 .venv/bin/python -m pytest -q tests/test_differential.py

(``CQC_DIFF_SHRINK=0`` reports the first failing example unshrunk.)
"""

from __future__ import annotations

import asyncio
import datetime
import os
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import pymongo
import pytest
from bson import SON, Decimal128, Int64
from bson.codec_options import CodecOptions
from bson.raw_bson import RawBSONDocument
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from client_query_cache import AsyncCacheManager, CacheManager, SharedCache, _native

# Hypothesis keeps files of its own even without an example database: in the
# temporary directory, not in the checkout.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "cqc-hypothesis"))

from support import DEADLINE_S, TEST_MAX_AWAIT_MS, async_wait_until, resolve

#: Examples per run, shared out between the modes (at least one each).
EXAMPLES = int(os.environ.get("CQC_DIFF_EXAMPLES", "1000"))
SHARES = {"sync": 0.45, "async": 0.30, "shared": 0.25}
#: A seed of one's own instead of the fixed derandomized one.
SEED = os.environ.get("CQC_DIFF_SEED") or None
#: CQC_DIFF_SHRINK=0 reports the first failing example as found (quicker,
#: e.g. to check that a planted bug is caught).
SHRINK = os.environ.get("CQC_DIFF_SHRINK", "1") != "0"

MAIN, ALT, MARKER = "main", "alt", "marker"
#: How long the oracle waits for the stream to apply a marker. What is under
#: test is the results once it has, not how fast the test server delivers
#: events: once in a full suite run a stream went 15 s without applying the
#: marker and the server's streams recovered afterwards. A longer stall
#: fails with what a new PyMongo change stream sees from the applied time.
SETTLE_S = 60.0

# -- values ----------------------------------------------------------------------

#: Numeric _id keys; each document stores one of the representations of its
#: key, all of which MongoDB compares equal.
NUM_KEYS = list(range(5))
#: String _ids that differ only in case (equal under a strength-2 collation
#: on MongoDB; SecantusDB compares bytewise, and both sides use one server).
STR_IDS = ["a", "A", "b"]


def representations(k: int) -> list[Any]:
    return [k, float(k), Int64(k), Decimal128(str(k))]


#: _id values of queries: every representation of a present or absent key,
#: and values that are not equal to any of them.
query_ids = st.one_of(
    st.integers(0, 6).flatmap(lambda k: st.sampled_from(representations(k))),
    st.sampled_from([0.5, 2.5, "1", "2", "a", "A", "B", Decimal128("1.5")]),
)
a_values = st.sampled_from([0, 1, 2, 3, 1.0, 2.5, Int64(2), Decimal128("1")])
b_values = st.sampled_from(["x", "X", "y"])
U_VALUES = [f"u{i}" for i in range(8)]
TIMES = [datetime.datetime(2024, 1, 1, h, 30, 0, 123000) for h in range(3)]

CODECS: dict[str, CodecOptions[Any]] = {
    "default": CodecOptions(),
    "son": CodecOptions(document_class=SON),
    "tz_aware": CodecOptions(tz_aware=True),
    "raw": CodecOptions(document_class=RawBSONDocument),
}
COLLATIONS = [None, {"locale": "en"}, {"locale": "en", "strength": 2}, {"locale": "simple"}]


def body(draw: st.DrawFn) -> dict[str, Any]:
    """A document's fields but ``_id`` and ``u``."""
    doc: dict[str, Any] = {
        "a": draw(a_values),
        "b": draw(b_values),
        "c": draw(st.lists(st.integers(0, 3), max_size=3)),
        "d": {"x": draw(st.integers(0, 2))},
        "t": draw(st.sampled_from(TIMES)),
    }
    if draw(st.booleans()):
        doc["e"] = draw(st.sampled_from([None, 1, "z"]))
    return doc


@st.composite
def documents(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Documents with distinct _ids (by MongoDB's equality) and distinct ``u``."""
    keys = draw(st.lists(st.sampled_from(NUM_KEYS + STR_IDS), unique=True, min_size=1, max_size=7))
    us = draw(st.permutations(U_VALUES))
    docs = []
    for key, u in zip(keys, us):
        _id = draw(st.sampled_from(representations(key))) if isinstance(key, int) else key
        docs.append({"_id": _id, "u": u, **body(draw)})
    return docs


# -- reads -------------------------------------------------------------------------

GOOD_FILTERS = [
    {},
    {"a": 1},
    {"a": {"$gt": 1}},
    {"a": {"$gte": 1}, "b": {"$in": ["x", "X"]}},
    {"b": "x"},
    {"b": "X"},
    {"a": 1, "b": "x"},
    {"b": "x", "a": 1},
    {"c": 2},
    {"d.x": 1},
    {"$or": [{"a": 0}, {"b": "y"}]},
    {"a": {"$in": [0, 2]}},
    {"e": {"$exists": True}},
    {"e": None},
    {"t": {"$gt": TIMES[0]}},
    {"$expr": {"$gt": ["$a", {"$size": "$c"}]}},
]
#: Filters the server refuses (some only when a document reaches them).
BAD_FILTERS = [
    {"a": {"$bogus": 1}},
    {"$or": []},
    {"$expr": {"$gt": [{"$divide": ["$a", 0]}, 1]}},
    {"a": {"$in": 5}},
]

filters = st.one_of(
    st.sampled_from(GOOD_FILTERS),
    st.sampled_from(GOOD_FILTERS),
    query_ids.map(lambda v: {"_id": v}),
    query_ids.map(lambda v: {"_id": v}),
    query_ids.map(lambda v: {"_id": {"$in": [v]}}),
    st.sampled_from([*U_VALUES[:4], "none"]).map(lambda u: {"u": u}),
    st.sampled_from([*U_VALUES[:4], "none"]).map(lambda u: {"u": u}),
    a_values.map(lambda a: {"a": a}),
    st.sampled_from(BAD_FILTERS),
)

#: Sorts: every good one ends with _id, so PyMongo's order is one order.
SORTS = [
    [("_id", 1)],
    [("_id", -1)],
    [("a", 1), ("_id", 1)],
    [("a", -1), ("_id", -1)],
    {"b": 1, "_id": 1},
    [("b", -1), ("a", 1), ("_id", 1)],
]
BAD_SORTS = [[("a", 2)], [("a", "x")]]
sorts = st.sampled_from(SORTS * 5 + BAD_SORTS)
PROJECTIONS = [None, {"a": 1}, {"_id": 0, "b": 1}, {"a": 0, "c": 0}, ["a", "b"], {"c": {"$slice": 1}}, {"d.x": 1}, {"u": 1}, {"_id": 0, "u": 1}]
BAD_PROJECTIONS = [{"a": 1, "b": 0}]
projections = st.sampled_from(PROJECTIONS * 3 + BAD_PROJECTIONS)
collations = st.sampled_from(COLLATIONS)
small = st.integers(0, 3)

Read = tuple[str, str, tuple[Any, ...], dict[str, Any], Any]  # ("read", method, args, kwargs, take)


def _options(draw: st.DrawFn, **candidates: st.SearchStrategy[Any]) -> dict[str, Any]:
    """Some of the keyword options (each left out half of the time; an
    option of None is left out: it is not the default of all of them)."""
    out = {}
    for name, strategy in candidates.items():
        if draw(st.booleans()):
            value = draw(strategy)
            if value is not None:
                out[name] = value
    return out


@st.composite
def find_ones(draw: st.DrawFn, f: Any = None) -> Read:
    f = draw(filters) if f is None else f
    if draw(st.integers(0, 9)) == 0:
        # find_one(v) is find_one({"_id": v}) for a value that is not a mapping.
        return ("read", "find_one", (draw(query_ids),), {}, None)
    proj = draw(projections)
    args = (f, proj) if proj is not None else (f,)
    return ("read", "find_one", args, _options(draw, sort=sorts, skip=small, collation=collations), None)


@st.composite
def finds(draw: st.DrawFn, f: Any = None) -> Read:
    f = draw(filters) if f is None else f
    kwargs = {"sort": draw(sorts), **_options(draw, projection=projections, skip=small, limit=small, collation=collations)}
    take = draw(st.one_of(st.none(), st.none(), st.integers(1, 3)))
    return ("read", "find", (f,), kwargs, take)


@st.composite
def counts(draw: st.DrawFn, f: Any = None) -> Read:
    f = draw(filters) if f is None else f
    kwargs = _options(draw, skip=small, limit=st.integers(1, 3), collation=collations)
    return ("read", "count_documents", (f,), kwargs, None)


@st.composite
def distincts(draw: st.DrawFn, f: Any = None) -> Read:
    key = draw(st.sampled_from(["a", "b", "c", "d.x", "e", "_id", "u"]))
    args = (key,) if f is None and draw(st.booleans()) else (key, draw(filters) if f is None else f)
    return ("read", "distinct", args, _options(draw, collation=collations), None)


def pipelines(f: Any) -> st.SearchStrategy[list[dict[str, Any]]]:
    good = [
        [{"$match": f}, {"$group": {"_id": "$b", "n": {"$sum": 1}, "s": {"$sum": "$a"}}}, {"$sort": {"_id": 1}}],
        [{"$match": f}, {"$unwind": "$c"}, {"$project": {"c": 1}}, {"$sort": {"_id": 1, "c": 1}}],
        [{"$match": f}, {"$sort": {"a": -1, "_id": 1}}, {"$skip": 1}, {"$limit": 2}],
        [{"$match": f}, {"$count": "n"}],
        # Fails when a matching document has d.x == 0.
        [{"$match": f}, {"$project": {"_id": 1, "q": {"$divide": [10, "$d.x"]}}}, {"$sort": {"_id": 1}}],
    ]
    bad = [
        [{"$match": f}, {"$bogus": {}}],
        [{"$match": f}, {"$project": {"a": 1, "b": 0}}],
    ]
    return st.sampled_from(good * 3 + bad)


@st.composite
def aggregates(draw: st.DrawFn, f: Any = None) -> Read:
    f = draw(filters) if f is None else f
    pipeline = draw(pipelines(f))
    take = draw(st.one_of(st.none(), st.none(), st.integers(1, 2)))
    return ("read", "aggregate", (pipeline,), _options(draw, collation=collations), take)


#: Calls that are wrong before they reach the server: PyMongo raises at the
#: call or at the first document, the view must raise the same.
BAD_CALLS: list[Read] = [
    ("read", "find", (5,), {}, None),
    ("read", "find", ({}, None, 0, 0, "x"), {}, None),  # a fifth positional argument
    ("read", "find", ({},), {"limit": "2"}, None),
    ("read", "find", ({},), {"sort": "a"}, None),  # a bare key needs a direction argument in find()
    ("read", "count_documents", (5,), {}, None),
    ("read", "distinct", (5,), {}, None),
    ("read", "distinct", ("a", 5), {}, None),
    ("read", "aggregate", ({"$match": {}},), {}, None),
    ("read", "find_one", ({},), {"bogus": 1}, None),
    ("read", "estimated_document_count", (), {"bogus": 1}, None),
    # Options refused by PyMongo or the server that the cache once served
    # from a cached result (found by this test; checked before the lookup,
    # or bypassed to the server, since):
    ("read", "find", ({},), {"batch_size": -1}, None),  # PyMongo: ValueError
    ("read", "find", ({},), {"max_time_ms": "x"}, None),  # PyMongo: OperationFailure 14
    ("read", "find_one", ({},), {"batch_size": -1}, None),  # ValueError
    ("read", "find_one", ({},), {"max_time_ms": "x"}, None),  # OperationFailure 14
    ("read", "count_documents", ({},), {"hint": None}, None),  # TypeError
    ("read", "aggregate", ([],), {"batchSize": -1}, None),  # ValueError
]



@st.composite
def chained_finds(draw: st.DrawFn) -> Read:
    """``find(filter).sort(...).skip(n).limit(n)``: the options given by the
    cursor's methods instead of keywords."""
    chain = []
    if draw(st.booleans()):
        chain.append(("sort", (draw(st.sampled_from(SORTS[:4])),)))
    else:
        chain.append(("sort", ("_id", draw(st.sampled_from([1, -1])))))
    for name in ("skip", "limit"):
        if draw(st.booleans()):
            chain.append((name, (draw(small),)))
    order = draw(st.permutations(chain))
    return ("read", "find", (draw(filters),), {"chain": tuple(order)}, None)


reads = st.one_of(
    chained_finds(),
    find_ones(),
    find_ones(),
    finds(),
    finds(),
    counts(),
    distincts(),
    aggregates(),
    st.just(("read", "estimated_document_count", (), {}, None)),
    st.sampled_from(BAD_CALLS),
)


def _flipped(sort: Any) -> list[tuple[str, int]]:
    """The same sort keys, every direction reversed."""
    pairs = sort.items() if isinstance(sort, Mapping) else sort
    return [(k, -d) for k, d in pairs]


@st.composite
def family(draw: st.DrawFn) -> list[Read]:
    """Reads of one filter that differ in one keyed part at a time (limit,
    skip, projection, sort direction or keys, method), so that entries meet
    and serve each other, as a find's limit is served from the entry
    without one (and a result cut by its limit must not serve a larger
    one), and so that two reads a key mixed up would meet."""
    f = draw(st.sampled_from([{}, {}, {}, *GOOD_FILTERS[:12]]))
    choices = {
        "limit": st.sampled_from([0, 1, 1, 2, 2, 3, 5]),
        "skip": st.sampled_from([0, 1, 2]),
        "projection": st.sampled_from(PROJECTIONS),
        "sort": st.sampled_from(SORTS),
    }
    params: dict[str, Any] = {name: draw(strategy) for name, strategy in choices.items()}
    out: list[Read] = []
    for _ in range(draw(st.integers(2, 6))):
        method = draw(st.sampled_from(["find", "find", "find", "find", "find_one", "count_documents"]))
        if method == "find":
            kwargs = {"sort": params["sort"], "projection": params["projection"], "skip": params["skip"], "limit": params["limit"]}
            take = draw(st.sampled_from([None, None, None, None, 1, 2]))
            out.append(("read", "find", (f,), kwargs, take))
        elif method == "find_one":
            out.append(("read", "find_one", (f, params["projection"]), {"sort": params["sort"], "skip": params["skip"]}, None))
        else:
            kwargs = {"skip": params["skip"], **({"limit": params["limit"]} if params["limit"] else {})}
            out.append(("read", "count_documents", (f,), kwargs, None))
        part = draw(st.sampled_from(["limit", "limit", "limit", "skip", "skip", "projection", "sort", "flip", "flip"]))
        if part == "flip":
            params["sort"] = _flipped(params["sort"])
        else:
            params[part] = draw(choices[part])
    return out


@st.composite
def limit_ladder(draw: st.DrawFn) -> list[Read]:
    """One find with several limits: a result its limit cut serves no larger
    limit; one shorter than its limit serves all of them."""
    f = draw(st.sampled_from([{}, {}, {}, *GOOD_FILTERS[:12]]))
    kwargs = {"sort": draw(st.sampled_from(SORTS)), "projection": draw(st.sampled_from(PROJECTIONS)), "skip": draw(st.sampled_from([0, 0, 0, 1]))}
    limits = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5]), min_size=2, max_size=4))
    return [("read", "find", (f,), {**kwargs, "limit": n}, None) for n in limits]


# -- writes ----------------------------------------------------------------------

#: Who writes: another client (the test then waits until the stream applied
#: it), the view (no wait: the causal floor must cover it), or the view
#: followed by the wait.
VIA = ["other", "other", "view", "view_settled"]


@st.composite
def write_ops(draw: st.DrawFn) -> tuple[Any, ...]:
    via = draw(st.sampled_from(VIA))
    kind = draw(st.sampled_from(
        ["insert_one", "insert_one", "replace_one", "update_one", "update_one", "update_u", "update_many",
         "delete_one", "delete_many", "drop", "rename_away", "rename_back", "swap_in"]
    ))  # fmt: skip
    if kind == "insert_one":
        key = draw(st.sampled_from(NUM_KEYS + [5, 6] + STR_IDS))
        _id = draw(st.sampled_from(representations(key))) if isinstance(key, int) else key
        doc = {"_id": _id, "u": draw(st.sampled_from(U_VALUES)), **body(draw)}
        return ("write", via, "insert_one", (doc,), {})
    if kind == "replace_one":
        doc = {"u": draw(st.sampled_from(U_VALUES)), **body(draw)}
        return ("write", via, "replace_one", ({"_id": draw(query_ids)}, doc), _options(draw, upsert=st.booleans()))
    if kind == "update_one":
        change = draw(st.sampled_from([
            {"$set": {"a": draw(a_values)}},
            {"$set": {"b": draw(b_values)}, "$push": {"c": 1}},
            {"$unset": {"e": ""}},
            {"$inc": {"d.x": 1}},
        ]))  # fmt: skip
        return ("write", via, "update_one", ({"_id": draw(query_ids)}, change), {})
    if kind == "update_u":  # a unique key moves (or collides: DuplicateKeyError)
        return ("write", via, "update_one", ({"u": draw(st.sampled_from(U_VALUES))}, {"$set": {"u": draw(st.sampled_from(U_VALUES))}}), {})
    if kind == "update_many":
        return ("write", via, "update_many", (draw(st.sampled_from(GOOD_FILTERS[:12])), {"$inc": {"a": 1}}), {})
    if kind == "delete_one":
        return ("write", via, "delete_one", ({"_id": draw(query_ids)},), {})
    if kind == "delete_many":
        return ("write", via, "delete_many", (draw(st.sampled_from(GOOD_FILTERS[:12])),), {})
    if kind == "swap_in":  # another collection renamed over the one being read
        return ("write", "other", "swap_in", (draw(documents()),), {})
    return ("write", via, kind, (), {})


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    docs = draw(documents())
    steps = draw(
        st.lists(
            st.one_of(reads.map(lambda r: [r]), reads.map(lambda r: [r]), family(), family(), limit_ladder(), write_ops().map(lambda w: [w])),
            min_size=1,
            max_size=10,
        )
    )
    return {
        "docs": docs,
        "unique": draw(st.booleans()),
        "collation": draw(st.sampled_from([None, None, None, {"locale": "en", "strength": 2}])),
        "codec": draw(st.sampled_from(list(CODECS))),
        "ops": [op for step in steps for op in step],
    }


# -- comparing -------------------------------------------------------------------


def tagged(value: Any) -> Any:
    """``value`` with the type of every part, so that results compare equal
    only when they are the same (``1 == 1.0 == Int64(1)`` in Python)."""
    if isinstance(value, RawBSONDocument):
        return ("RawBSONDocument", bytes(value.raw), [(k, tagged(v)) for k, v in value.items()])
    if isinstance(value, Mapping):
        return (type(value).__name__, [(k, tagged(v)) for k, v in value.items()])
    if isinstance(value, list):
        return ("list", [tagged(v) for v in value])
    if isinstance(value, datetime.datetime):
        return ("datetime", value.isoformat(), repr(value.tzinfo))
    return (type(value).__name__, repr(value))


def mutate(value: Any) -> None:
    """Change every dict and list of a result in place (after it was
    compared): no later read may see it."""
    if isinstance(value, dict):
        for v in list(value.values()):
            mutate(v)
        value["mutated"] = True
    elif isinstance(value, list):
        for v in value:
            mutate(v)
        value.append("mutated")


async def outcome(call: Callable[[], Awaitable[Any]], mutate_after: bool = False) -> tuple[Any, ...]:
    try:
        result = await call()
    except Exception as exc:  # noqa: BLE001 - comparing behaviours
        return ("raised", type(exc).__name__, getattr(exc, "code", None))
    compared = ("returned", tagged(result))
    if mutate_after:
        mutate(result)
    return compared


class Harness:
    """One mode's manager, its clients and the collections of an example."""

    def __init__(self, mode: str, uri: str, db: str, writer: pymongo.MongoClient) -> None:
        self.mode = mode
        self.uri = uri
        self.db = db
        self.writer = writer  # "another application": setup, other writes, markers
        self.is_async = mode == "async"
        self.owner: SharedCache | None = None
        self.loop = asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self._open())
        except BaseException:
            self.close()
            raise

    async def _open(self) -> None:
        Client = pymongo.AsyncMongoClient if self.is_async else pymongo.MongoClient
        self.cache_client = Client(self.uri)
        self.oracle_client = Client(self.uri)
        if self.mode == "shared":
            self.owner = SharedCache.start(f"diff{uuid.uuid4().hex[:10]}", self.uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
            self.manager: Any = CacheManager(self.cache_client, shared=self.owner.name, max_await_time_ms=TEST_MAX_AWAIT_MS)
        else:
            Manager = AsyncCacheManager if self.is_async else CacheManager
            self.manager = Manager(self.cache_client, max_await_time_ms=TEST_MAX_AWAIT_MS)
        self.writer[self.db].create_collection(MARKER)
        self.manager[self.db][MARKER]  # registers the database: its stream starts
        assert await resolve(self.manager.wait_ready(DEADLINE_S, database=self.db)), self.manager.snapshot()

    def close(self) -> None:
        async def close() -> None:
            for thing in ("manager", "cache_client", "oracle_client"):
                if hasattr(self, thing):
                    await resolve(getattr(self, thing).close())

        try:
            self.loop.run_until_complete(close())
        finally:
            self.loop.close()
            if self.owner is not None:
                self.owner.stop(timeout=10)

    def applied(self) -> Any:
        streams = [s for s in self.manager.snapshot().streams if s.database == self.db]
        return streams[0].applied_time if streams else None

    async def settle(self) -> None:
        """Wait until the stream has applied every write made so far: up to
        the event of a marker written last. (The event's own time, read
        from a change stream of PyMongo's: the write's operationTime can lie
        past it, and on the test server an empty batch's resume token is not
        taken as applied, so the applied time may stop at the event.)"""
        with self.writer[self.db][MARKER].watch(max_await_time_ms=200) as stream:
            marker = self.writer[self.db][MARKER].insert_one({}).inserted_id
            written = None
            deadline = time.monotonic() + SETTLE_S
            while written is None and time.monotonic() < deadline:
                change = stream.try_next()
                if change is not None and change.get("documentKey", {}).get("_id") == marker:
                    written = change["clusterTime"]
            assert written is not None, "the marker's change event did not arrive"
        try:
            await async_wait_until(
                lambda: (t := self.applied()) is not None and t >= written,
                timeout=SETTLE_S,
                what=f"the {self.mode} stream applies the writes (at {written})",
            )
        except AssertionError as exc:
            # What the stream was doing, to tell a stall from a slow machine,
            # and what a new change stream of PyMongo's own sees from the
            # applied time on: nothing there as well means the server's
            # streams stopped, not the follower.
            owner = self.owner.snapshot() if self.owner is not None else None
            seen = self.fresh_stream_events(self.applied(), written)
            raise AssertionError(
                f"{exc}: {self.manager.snapshot()!r}; owner: {owner!r}; "
                f"a new PyMongo change stream from the applied time saw: {seen}"
            ) from None

    def fresh_stream_events(self, since: Any, until: Any, seconds: float = 5.0) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        deadline = time.monotonic() + seconds
        try:
            with self.writer[self.db].watch(start_at_operation_time=since, max_await_time_ms=200) as stream:
                while time.monotonic() < deadline and not (events and events[-1][1] >= until):
                    change = stream.try_next()
                    if change is not None:
                        events.append((change["operationType"], change["clusterTime"]))
        except pymongo.errors.PyMongoError as exc:
            events.append(("error", repr(exc)))
        return events

    # -- one example -------------------------------------------------------------

    async def play(self, scenario: dict[str, Any]) -> None:
        db = self.writer[self.db]
        db.drop_collection(MAIN)
        db.drop_collection(ALT)
        if scenario["collation"] is not None:
            db.create_collection(MAIN, collation=scenario["collation"])
        if scenario["docs"]:
            db[MAIN].insert_many(scenario["docs"])
        if scenario["unique"]:
            db[MAIN].create_index("u", unique=True)
        await self.settle()
        codec = CODECS[scenario["codec"]]
        view = self.manager[self.db].get_collection(MAIN, codec_options=codec)
        alt_view = self.manager[self.db].get_collection(ALT)
        oracle = self.oracle_client[self.db].get_collection(MAIN, codec_options=codec)
        for i, op in enumerate(scenario["ops"]):
            if op[0] == "write":
                await self.write(op, view, alt_view)
                continue
            _, method, args, kwargs, take = op
            expected = await outcome(lambda: self.call(oracle, method, args, kwargs, take))
            for attempt in ("cold", "warm", "template"):
                before = self.manager.snapshot()
                # What a caller does to the warm read's objects changes no
                # later read (the next may come from its template).
                got = await outcome(lambda: self.call(view, method, args, kwargs, take), attempt == "warm")
                assert got == expected, (self.mode, i, attempt, op, got, expected)
                if self.owner is not None and got[0] == "returned" and take is None:
                    await self.admitted(before)

    async def admitted(self, before: Any) -> None:
        """Shared mode: after a read that missed and pushed its result to
        the owner, wait until the owner has applied (or refused) it, so that
        the warm read can find it (the owner drains rings every millisecond;
        the warm read would often be faster)."""
        after = self.manager.snapshot()
        if after.misses == before.misses or after.bypass_total != before.bypass_total:
            return  # a hit, or a read that did not admit
        done = before.admissions + sum(before.rejected_admissions.values())
        await async_wait_until(
            lambda: (s := self.manager.snapshot()).admissions + sum(s.rejected_admissions.values()) > done,
            what="the owner applies the worker's admission",
        )

    async def call(self, coll: Any, method: str, args: Any, kwargs: Any, take: int | None) -> Any:
        chain = kwargs.get("chain", ())
        if chain:
            kwargs = {k: v for k, v in kwargs.items() if k != "chain"}
        result = await resolve(getattr(coll, method)(*args, **kwargs))
        for name, values in chain:
            result = getattr(result, name)(*values)
        if method not in ("find", "aggregate"):
            return result
        docs = []
        if self.is_async:
            async for doc in result:
                docs.append(doc)
                if take is not None and len(docs) >= take:
                    break
            await result.close()
        else:
            with result:
                for doc in result:
                    docs.append(doc)
                    if take is not None and len(docs) >= take:
                        break
        return docs

    async def write(self, op: tuple[Any, ...], view: Any, alt_view: Any) -> None:
        _, via, method, args, kwargs = op
        db = self.writer[self.db]
        if via == "other":
            target, alt = db[MAIN], db[ALT]
        else:
            target, alt = view, alt_view
        try:
            if method == "swap_in":
                db.drop_collection(ALT)
                if args[0]:
                    db[ALT].insert_many(args[0])
                else:
                    db.create_collection(ALT)
                db[ALT].rename(MAIN, dropTarget=True)
            elif method == "rename_away":
                await resolve(target.rename(ALT, dropTarget=True))
            elif method == "rename_back":
                await resolve(alt.rename(MAIN, dropTarget=True))
            else:
                await resolve(getattr(target, method)(*args, **kwargs))
        except pymongo.errors.PyMongoError:
            pass  # a duplicate key, a missing namespace: PyMongo's own, and nothing written
        if via != "view":
            await self.settle()


def _examples(mode: str) -> int:
    return max(1, round(EXAMPLES * SHARES[mode]))


# -- explicit examples ---------------------------------------------------------------------


def _doc(_id: Any, u: str, a: Any) -> dict[str, Any]:
    return {"_id": _id, "u": u, "a": a, "b": "x", "c": [1], "d": {"x": 1}, "t": TIMES[0]}


#: A find whose result its limit cut must not serve a larger limit or none;
#: one its limit did not cut serves them all (read.py, admit_documents).
LIMIT_CUT = {
    "docs": [_doc(0, "u0", 1), _doc(1.0, "u1", 2), _doc(Int64(2), "u2", 3)],
    "unique": False,
    "collation": None,
    "codec": "default",
    "ops": [
        ("read", "find", ({},), {"sort": [("_id", 1)], "limit": n}, None) for n in (2, 3, 0, 5, 1, 0)
    ],
}


@pytest.mark.parametrize("mode", list(SHARES))
@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_a_cached_view_acts_as_the_pymongo_collection_it_wraps(mode, server_uri, db_name, other_client, runtime_dir):
    harness = Harness(mode, server_uri, db_name, other_client)

    @settings(
        max_examples=_examples(mode),
        deadline=None,
        database=None,
        derandomize=SEED is None,
        print_blob=False,
        phases=tuple(Phase) if SHRINK else (Phase.explicit, Phase.reuse, Phase.generate),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(scenario=scenarios())
    @example(scenario=LIMIT_CUT)
    def run(scenario: dict[str, Any]) -> None:
        harness.loop.run_until_complete(harness.play(scenario))

    if SEED is not None:
        run = seed(int(SEED))(run)
    # Templates from an entry's first hit: the third read of a read is then
    # a template hit (under the default codec options).
    hits_before_template = _native._template_hits(1)
    try:
        run()
        snap = harness.manager.snapshot()
    finally:
        _native._template_hits(hits_before_template)
        harness.close()
    # The cache was really exercised: most examples were served hits, some
    # of them from templates.
    assert snap.admissions > 0 and snap.hits >= _examples(mode), snap
    assert snap.template_hits > 0, snap
