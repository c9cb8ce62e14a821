"""Misuse: every public argument rejects a bad value with an error that names
it, and what PyMongo validates stays PyMongo's.

The rule (docs/errors.md): the cache's own arguments (managers, their
methods, ``CacheConfig``, ``SharedCache``, ``SharedCacheConfig``) raise
``CacheConfigurationError`` (a ``ValueError``), for a wrong type as for a
value out of range; ``client_query_cache.testing`` and ``.otel`` follow
Python's convention (``TypeError`` / ``ValueError``); arguments that are
PyMongo's (reads, cursor options, database and collection names and options)
raise exactly what the same call on PyMongo raises.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymongo
import pytest

import client_query_cache
from client_query_cache import (
    CacheConfig,
    CacheConfigurationError,
    CacheError,
    CacheManager,
    SharedCache,
    SharedCacheConfig,
)
from client_query_cache.testing import DisposableServer

REPO = Path(__file__).resolve().parent.parent
ERRORS_MD = REPO / "docs" / "errors.md"
PACKAGE = REPO / "python" / "client_query_cache"

MiB = 1024 * 1024
NAN = math.nan
INF = math.inf
#: A connection string whose port does not parse, with a password that no
#: message may quote.
SECRET = "s3cr3t-pw"
BAD_PORT_URI = f"mongodb://user:{SECRET}@127.0.0.1:notaport/"


def assert_names(error: BaseException, argument: str) -> None:
    """The message names ``argument`` as a word of its own."""
    pattern = rf"(?<![A-Za-z0-9_]){re.escape(argument)}(?![A-Za-z0-9_])"
    assert re.search(pattern, str(error)), f"{str(error)!r} does not name {argument!r}"
    assert SECRET not in str(error)


def case_id(case: tuple[Any, ...]) -> str:
    return f"{case[0]}={case[1]!r}"


# == managers =====================================================================

#: (argument, bad value): CacheManager(client, argument=value) and
#: AsyncCacheManager(async_client, argument=value) raise
#: CacheConfigurationError naming ``argument``.
MANAGER_OPTIONS: list[tuple[str, Any]] = [
    ("budget_bytes", "64MiB"),
    ("budget_bytes", True),
    ("budget_bytes", 64.0 * MiB),
    ("budget_bytes", 1024),
    ("budget_bytes", 0xF0000000 + 1),
    ("max_entry_bytes", 0),
    ("max_entry_bytes", 16 * MiB + 1),  # more than a quarter of the default budget
    ("max_entry_bytes", False),
    ("max_await_time_ms", 9),
    ("max_await_time_ms", 60_001),
    ("max_await_time_ms", None),
    ("max_await_time_ms", 1.5),
    ("slot_count", 63),
    ("slot_count", (1 << 26) + 1),
    ("slot_count", "1024"),
    ("slot_count", True),
    ("stream_uri", 27017),
    ("stream_uri", b"mongodb://127.0.0.1/"),
    ("stream_uri", "http://127.0.0.1:27017/"),
    ("stream_uri", "mongodb://"),  # no host
    ("stream_uri", BAD_PORT_URI),
    ("stream_uri", "mongodb://127.0.0.1:99999/"),
    ("stream_uri", "mongodb+srv://a.example,b.example/"),
    ("shared", 5),
    ("shared", {"name": "cache"}),
    ("shared", ""),
    ("shared", "a/b"),
    ("shared", "x" * 65),
    ("shared", ".."),
]

#: (field, bad value) of a SharedCacheConfig that the manager checks before
#: attaching: otherwise it is noticed only when an owner must be started,
#: possibly in the middle of a read long after.
SHARED_CONFIG_FIELDS: list[tuple[str, Any]] = [
    ("uri", 5),
    ("uri", "http://127.0.0.1/"),
    ("uri", BAD_PORT_URI),
    ("arena_bytes", 0),
    ("arena_bytes", True),
    ("budget_bytes", "32MiB"),
    ("budget_bytes", 1024),
    ("slots", 1),
    ("slots", 1024.0),
    ("max_entry_bytes", 0),
    ("max_entry_bytes", 8 * MiB + 1),  # more than a quarter of the default 32 MiB
    ("max_await_time_ms", 5),
    ("grace_seconds", NAN),
    ("grace_seconds", INF),
]


@pytest.mark.parametrize(("argument", "value"), MANAGER_OPTIONS, ids=map(case_id, MANAGER_OPTIONS))
async def test_a_bad_manager_option_raises_a_configuration_error_naming_it(d, runtime_dir, argument, value):
    with pytest.raises(CacheConfigurationError) as info:
        d.Manager(d.client(), **{argument: value})
    assert_names(info.value, argument)


@pytest.mark.parametrize(("field", "value"), SHARED_CONFIG_FIELDS, ids=map(case_id, SHARED_CONFIG_FIELDS))
async def test_a_bad_shared_cache_config_field_is_rejected_by_the_manager(d, runtime_dir, field, value):
    config = SharedCacheConfig("misuse", start_owner=True, **{field: value})
    with pytest.raises(CacheConfigurationError) as info:
        d.Manager(d.client(), shared=config)
    assert_names(info.value, field)
    assert not list(runtime_dir.iterdir()), "nothing is started or created"


async def test_a_client_of_the_other_facade_is_rejected(d, client, async_client):
    with pytest.raises(CacheConfigurationError) as info:
        d.Manager(client if d.is_async else async_client)
    assert_names(info.value, "client")


@pytest.mark.parametrize("not_a_client", [None, "mongodb://127.0.0.1/", object()], ids=["none", "uri", "object"])
async def test_what_is_not_a_client_is_rejected(d, not_a_client):
    with pytest.raises(CacheConfigurationError) as info:
        d.Manager(not_a_client)
    assert_names(info.value, "client")


def test_a_stream_uri_that_libmongoc_may_know_options_of_is_accepted(client):
    # Only hosts, ports and user information are checked: option names and
    # values are the C driver's to judge (PyMongo does not know all of them).
    with CacheManager(client, stream_uri="mongodb://127.0.0.1:1/?notAPyMongoOption=1") as cache:
        assert cache.config.stream_uri.endswith("notAPyMongoOption=1")


# -- manager methods ---------------------------------------------------------------

#: (argument, wait_ready keyword arguments)
WAIT_READY: list[tuple[str, dict[str, Any]]] = [
    ("timeout", {"timeout": -1}),
    ("timeout", {"timeout": "1"}),
    ("timeout", {"timeout": True}),
    ("timeout", {"timeout": None}),
    ("timeout", {"timeout": NAN}),
    ("timeout", {"timeout": INF}),
    ("database", {"timeout": 0, "database": 5}),
    ("database", {"timeout": 0, "database": b"db"}),
]


@pytest.mark.parametrize(("argument", "kwargs"), WAIT_READY, ids=[f"{a}={k[a]!r}" for a, k in WAIT_READY])
async def test_wait_ready_rejects_a_bad_argument_naming_it(d, argument, kwargs):
    cache = d.manager()
    with pytest.raises(CacheConfigurationError) as info:
        await d.r(cache.wait_ready(**kwargs))
    assert_names(info.value, argument)


async def test_get_cached_collection_rejects_what_is_not_its_clients_collection(d, client, async_client):
    mongo, another = d.client(), d.client()
    other_api = client if d.is_async else async_client
    cache = d.manager(mongo)
    for bad in (mongo["db"], other_api["db"]["c"], "db.c", another["db"]["c"]):
        with pytest.raises(CacheConfigurationError) as info:
            cache.get_cached_collection(bad)
        assert_names(info.value, "collection")


def raised(call: Callable[[], Any]) -> BaseException:
    """The exception ``call`` raises (the test fails if it raises none)."""
    with pytest.raises(Exception) as info:
        call()
    return info.value


def assert_same_error(cached: BaseException, direct: BaseException) -> None:
    assert type(cached) is type(direct)
    assert str(cached) == str(direct)


#: Names and options PyMongo validates: (what, call on a client or a manager).
NAMES: list[tuple[str, Callable[[Any], Any]]] = [
    ("get_database(5)", lambda c: c.get_database(5)),
    ("get_database('')", lambda c: c.get_database("")),
    ("get_database('a b')", lambda c: c.get_database("a b")),
    ("[5]", lambda c: c[5]),
    ("get_database(read_preference=5)", lambda c: c.get_database("db", read_preference=5)),
    ("get_database(bogus=1)", lambda c: c.get_database("db", bogus=1)),
    ("get_collection(5)", lambda c: c["db"].get_collection(5)),
    ("get_collection('')", lambda c: c["db"].get_collection("")),
    ("get_collection('$x')", lambda c: c["db"].get_collection("$x")),
    ("db[5]", lambda c: c["db"][5]),
    ("get_collection(codec_options=5)", lambda c: c["db"].get_collection("c", codec_options=5)),
    ("with_options(read_concern=5)", lambda c: c["db"]["c"].with_options(read_concern=5)),
    ("with_options(bogus=1)", lambda c: c["db"]["c"].with_options(bogus=1)),
]


@pytest.mark.parametrize("call", [c for _, c in NAMES], ids=[n for n, _ in NAMES])
async def test_names_and_options_raise_what_pymongo_raises(d, call):
    # The same class and message: where a message names a class (an
    # unexpected keyword), the cache's is the one of the driver's PyMongo API.
    mongo = d.client()
    cache = d.manager(mongo)
    assert_same_error(raised(lambda: call(cache)), raised(lambda: call(mongo)))


# == configuration objects ==========================================================

#: (the class, argument, keyword arguments): the configuration dataclasses
#: check their fields when built.
CONFIG_OBJECTS: list[tuple[type, str, dict[str, Any]]] = [
    (CacheConfig, "budget_bytes", {"budget_bytes": -1}),
    (CacheConfig, "budget_bytes", {"budget_bytes": None}),
    (CacheConfig, "max_entry_bytes", {"budget_bytes": 64 * 1024}),  # the 1 MiB default is over a quarter of it
    (CacheConfig, "max_entry_bytes", {"max_entry_bytes": 1.0}),
    (CacheConfig, "max_await_time_ms", {"max_await_time_ms": "1000"}),
    (CacheConfig, "slot_count", {"slot_count": 0}),
    (CacheConfig, "stream_uri", {"stream_uri": b"mongodb://127.0.0.1/"}),
    (CacheConfig, "stream_uri", {"stream_uri": BAD_PORT_URI}),
    (SharedCacheConfig, "name", {"name": 5}),
    (SharedCacheConfig, "name", {"name": "a b"}),
    (SharedCacheConfig, "start_owner", {"name": "x", "start_owner": 1}),
    (SharedCacheConfig, "start_owner", {"name": "x", "start_owner": "yes"}),
    (SharedCacheConfig, "grace_seconds", {"name": "x", "grace_seconds": -1}),
    (SharedCacheConfig, "grace_seconds", {"name": "x", "grace_seconds": "5"}),
    (SharedCacheConfig, "grace_seconds", {"name": "x", "grace_seconds": True}),
]


@pytest.mark.parametrize(
    ("cls", "argument", "kwargs"),
    CONFIG_OBJECTS,
    ids=[f"{cls.__name__}-{a}-{i}" for i, (cls, a, _) in enumerate(CONFIG_OBJECTS)],
)
def test_a_configuration_object_rejects_a_bad_field_naming_it(cls, argument, kwargs):
    with pytest.raises(CacheConfigurationError) as info:
        cls(**kwargs)
    assert_names(info.value, argument)


#: (argument, SharedCache.start keyword arguments besides name and uri, or
#: with them): each is rejected before an owner process is started.
SHARED_START: list[tuple[str, dict[str, Any]]] = [
    ("name", {"name": "a/b"}),
    ("name", {"name": None}),
    ("uri", {"uri": 27017}),
    ("uri", {"uri": "127.0.0.1:27017"}),
    ("uri", {"uri": BAD_PORT_URI}),
    ("arena_bytes", {"arena_bytes": -1}),
    ("arena_bytes", {"arena_bytes": "1MiB"}),
    ("budget_bytes", {"budget_bytes": 100}),
    ("max_entry_bytes", {"max_entry_bytes": 0}),
    ("max_await_time_ms", {"max_await_time_ms": 0}),
]

#: What SharedCache.start (in _core/handle.py) does not name or check yet.
SHARED_START_ARGUMENTS: list[tuple[str, dict[str, Any]]] = [
    ("slots", {"slots": 1}),
    ("ready_timeout", {"ready_timeout": -1}),
    ("ready_timeout", {"ready_timeout": "x"}),
    ("idle_exit_seconds", {"idle_exit_seconds": "soon"}),
    ("idle_exit_seconds", {"idle_exit_seconds": float("nan")}),
]


def start_owner(server_uri: str, kwargs: dict[str, Any]) -> None:
    options = {"name": "misuse", "uri": server_uri, **kwargs}
    handle = SharedCache.start(options.pop("name"), options.pop("uri"), **options)
    handle.stop()  # only if it was not rejected: a failing test leaves nothing running


@pytest.mark.parametrize(("argument", "kwargs"), SHARED_START, ids=[f"{a}-{k}" for a, k in SHARED_START])
def test_shared_cache_start_rejects_a_bad_argument_naming_it(runtime_dir, server_uri, argument, kwargs):
    with pytest.raises(CacheConfigurationError) as info:
        start_owner(server_uri, kwargs)
    assert_names(info.value, argument)
    assert not list(runtime_dir.iterdir()), "no owner was started"


@pytest.mark.parametrize(("argument", "kwargs"), SHARED_START_ARGUMENTS, ids=[a for a, _ in SHARED_START_ARGUMENTS])
def test_shared_cache_start_checks_every_argument_before_the_owner_starts(runtime_dir, server_uri, argument, kwargs):
    with pytest.raises(CacheConfigurationError) as info:
        start_owner(server_uri, kwargs)
    assert_names(info.value, argument)
    assert not list(runtime_dir.iterdir()), "no owner was started"


def test_shared_cache_stop_checks_its_timeout(runtime_dir, server_uri):
    from client_query_cache import SharedCache

    owner = SharedCache.start("misuse", server_uri, budget_bytes=4 * 1024 * 1024, max_entry_bytes=1024 * 1024)
    try:
        with pytest.raises(CacheConfigurationError) as info:
            owner.stop(timeout="soon")  # type: ignore[arg-type]
        assert_names(info.value, "timeout")
    finally:
        owner.stop(timeout=10)


# == reads: PyMongo's errors, unchanged =============================================

#: Reads PyMongo rejects: (what, the call on a sync collection). The cached
#: collection must raise the same exception, whether the read bypasses or
#: misses, and a second time (nothing was cached in between).
BAD_READS: list[tuple[str, Callable[[Any], Any]]] = [
    ("find_one projection=5", lambda c: c.find_one({}, 5)),
    ("find_one mixed projection", lambda c: c.find_one({}, {"a": 1, "s": 0})),
    ("find_one unknown operator", lambda c: c.find_one({"a": {"$bogus": 1}})),
    ("find_one sort=5", lambda c: c.find_one({}, sort=5)),
    ("find_one skip='x'", lambda c: c.find_one({}, skip="x")),
    ("find_one skip=-1", lambda c: c.find_one({}, skip=-1)),
    ("find_one batch_size='x'", lambda c: c.find_one({"a": 1}, batch_size="x")),
    ("find_one unknown keyword", lambda c: c.find_one({}, bogus=1)),
    ("find filter=5", lambda c: list(c.find(5))),
    ("find filter=[]", lambda c: list(c.find([("a", 1)]))),
    ("find projection=5", lambda c: list(c.find({}, 5))),
    ("find limit='x'", lambda c: list(c.find({"a": 1}, limit="x"))),
    ("find batch_size=-1", lambda c: list(c.find({"a": 1}, batch_size=-1))),
    ("find max_time_ms='x'", lambda c: list(c.find({"a": 1}, max_time_ms="x"))),
    ("find collation=5", lambda c: list(c.find({"a": 1}, collation=5))),
    ("find filter twice", lambda c: list(c.find({}, filter={}))),
    ("find sort direction True", lambda c: list(c.find({"a": 1}, sort=[("a", True)]))),
    ("count_documents filter=None", lambda c: c.count_documents(None)),
    ("count_documents filter=5", lambda c: c.count_documents(5)),
    ("count_documents skip='x'", lambda c: c.count_documents({}, skip="x")),
    ("count_documents limit=-1", lambda c: c.count_documents({}, limit=-1)),
    ("estimated_document_count maxTimeMS='x'", lambda c: c.estimated_document_count(maxTimeMS="x")),
    ("distinct key=5", lambda c: c.distinct(5)),
    ("distinct filter=5", lambda c: c.distinct("a", 5)),
    ("aggregate pipeline={}", lambda c: list(c.aggregate({"$match": {}}))),
    ("aggregate unknown stage", lambda c: list(c.aggregate([{"$bogus": 1}]))),
    ("aggregate batchSize='x'", lambda c: list(c.aggregate([{"$match": {"a": 1}}], batchSize="x"))),
]


def seed(client: pymongo.MongoClient, db_name: str) -> None:
    client[db_name]["items"].insert_many([{"_id": i, "a": i % 3, "s": str(i)} for i in range(6)])


@pytest.fixture
async def cached_items(d, client, db_name):
    """(the cached collection, the raw one) of seeded documents, for the
    driver ``d``, the stream serving."""
    seed(client, db_name)
    mongo = d.client()
    cache = d.manager(mongo)
    coll = cache[db_name]["items"]
    assert await d.r(cache.wait_ready(15, db_name))
    return coll, mongo[db_name]["items"]


@pytest.mark.parametrize("read", [r for _, r in BAD_READS], ids=[n for n, _ in BAD_READS])
async def test_a_bad_read_raises_what_pymongo_raises(d, cached_items, read):
    coll, raw = cached_items
    direct = await raised_by_read(d, read, raw)
    for _ in range(2):
        got = await raised_by_read(d, read, coll)
        # The class, and the server's error code for an OperationFailure.
        assert (type(got), getattr(got, "code", None)) == (type(direct), getattr(direct, "code", None)), (got, direct)


async def raised_by_read(d: Any, read: Callable[[Any], Any], coll: Any) -> BaseException:
    """The exception of ``read``, written for a sync collection, on ``coll``
    of the driver ``d``: on an async one, awaitables are awaited and cursors
    read to the end."""
    if not d.is_async:
        return raised(lambda: read(coll))
    with pytest.raises(Exception) as info:
        await run_async(read, coll)
    return info.value


class _AsyncView:
    """Runs a BAD_READS lambda on an async collection: ``list(c.find(...))``
    becomes ``await c.find(...).to_list()``."""

    def __init__(self, coll: Any) -> None:
        self._coll = coll
        self.pending: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._coll, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.pending.append(result)
            return _Deferred()

        return call


class _Deferred(list):
    """What ``list()`` or a sync method returns in the view: nothing yet."""


async def run_async(read: Callable[[Any], Any], coll: Any) -> None:
    view = _AsyncView(coll)
    read(view)
    for result in view.pending:
        if inspect.isawaitable(result):
            result = await result
        if hasattr(result, "to_list"):
            await result.to_list()


# -- cursor options ------------------------------------------------------------------

#: (what, a cursor method call): raised at the call, as PyMongo's cursor does.
CURSOR_OPTIONS: list[tuple[str, Callable[[Any], Any]]] = [
    ("limit('x')", lambda cur: cur.limit("x")),
    ("limit(1.0)", lambda cur: cur.limit(1.0)),
    ("skip(-1)", lambda cur: cur.skip(-1)),
    ("skip('x')", lambda cur: cur.skip("x")),
    ("batch_size(-1)", lambda cur: cur.batch_size(-1)),
    ("batch_size(None)", lambda cur: cur.batch_size(None)),
    ("max_time_ms('x')", lambda cur: cur.max_time_ms("x")),
    ("max_time_ms(1.5)", lambda cur: cur.max_time_ms(1.5)),
    ("sort(5)", lambda cur: cur.sort(5)),
    ("sort('a', [1])", lambda cur: cur.sort("a", [1])),
    ("sort([('a', [1])])", lambda cur: cur.sort([("a", [1])])),
    ("sort([])", lambda cur: cur.sort([])),
    ("sort({})", lambda cur: cur.sort({})),
    ("sort({'a': [1]})", lambda cur: cur.sort({"a": [1]})),
]


@pytest.mark.parametrize("option", [o for _, o in CURSOR_OPTIONS], ids=[n for n, _ in CURSOR_OPTIONS])
async def test_a_bad_cursor_option_raises_what_pymongo_raises_at_the_call(cached_items, option):
    coll, raw = cached_items
    assert_same_error(raised(lambda: option(coll.find({"a": 1}))), raised(lambda: option(raw.find({"a": 1}))))


def test_good_cursor_options_are_still_accepted(client, db_name, manager):
    seed(client, db_name)
    coll, raw = manager[db_name]["items"], client[db_name]["items"]
    assert manager.wait_ready(15, db_name)
    for _ in range(2):  # a miss, then a hit
        cursor = coll.find({"a": {"$gte": 0}}).sort("_id", -1).skip(1).limit(2).batch_size(0).max_time_ms(None)
        assert list(cursor) == list(raw.find({"a": {"$gte": 0}}).sort("_id", -1).skip(1).limit(2))
        for key in ([("a", 1), ("_id", -1)], {"a": -1, "_id": 1}, ["a"]):
            assert list(coll.find({}).sort(key)) == list(raw.find({}).sort(key))
        # What PyMongo's cursor accepts, the cache accepts too (a bool is an int there).
        assert list(coll.find({"a": 1}).limit(True).skip(False).max_time_ms(10**6)) == list(
            raw.find({"a": 1}).limit(True).skip(False)
        )


def test_to_list_rejects_a_length_below_one_as_pymongo_does(client, db_name, manager):
    coll, raw = manager[db_name]["items"], client[db_name]["items"]
    assert_same_error(raised(lambda: coll.find({}).to_list(0)), raised(lambda: raw.find({}).to_list(0)))


# == otel and testing: Python's conventions ==========================================


class _NoMeters:
    """Not a MeterProvider."""


#: (argument, instrument() arguments besides a manager, or with one)
OTEL: list[tuple[str, dict[str, Any]]] = [
    ("manager", {"manager": object()}),
    ("manager", {"manager": None}),
    ("meter_provider", {"meter_provider": 5}),
    ("meter_provider", {"meter_provider": _NoMeters()}),
    ("attributes", {"attributes": 5}),
    ("attributes", {"attributes": [("app", "api")]}),
    ("attributes", {"attributes": {1: "api"}}),
]


@pytest.mark.parametrize(("argument", "kwargs"), OTEL, ids=[f"{a}-{i}" for i, (a, _) in enumerate(OTEL)])
def test_instrument_rejects_a_bad_argument_with_a_type_error_naming_it(manager, argument, kwargs):
    otel = pytest.importorskip("client_query_cache.otel")
    options = {"manager": manager, **kwargs}
    with pytest.raises(TypeError) as info:
        otel.instrument(options.pop("manager"), **options)
    assert not isinstance(info.value, CacheError)
    assert_names(info.value, argument)


#: (argument, exception type, DisposableServer keyword arguments)
SERVER: list[tuple[str, type[Exception], dict[str, Any]]] = [
    ("storage_path", TypeError, {"storage_path": 5}),
    ("log_path", TypeError, {"log_path": 5}),
    ("port", TypeError, {"port": "27017"}),
    ("port", TypeError, {"port": True}),
    ("port", ValueError, {"port": 0}),
    ("port", ValueError, {"port": 65536}),
    ("oplog_retention_seconds", TypeError, {"oplog_retention_seconds": "3600"}),
    ("oplog_retention_seconds", ValueError, {"oplog_retention_seconds": -1}),
    ("oplog_retention_seconds", ValueError, {"oplog_retention_seconds": NAN}),
    ("oplog_max_entries", TypeError, {"oplog_max_entries": 5.0}),
    ("oplog_max_entries", ValueError, {"oplog_max_entries": 0}),
    ("noop_interval_seconds", TypeError, {"noop_interval_seconds": None}),
    ("noop_interval_seconds", ValueError, {"noop_interval_seconds": -1}),
    ("noop_interval_seconds", ValueError, {"noop_interval_seconds": float("inf")}),
    ("extra_args", TypeError, {"extra_args": "--enable-test-commands"}),
    ("extra_args", TypeError, {"extra_args": [1]}),
    ("extra_args", TypeError, {"extra_args": None}),
]


@pytest.mark.parametrize(
    ("argument", "error", "kwargs"), SERVER, ids=[f"{a}={k[a]!r}" for a, _, k in SERVER]
)
def test_disposable_server_rejects_a_bad_argument_naming_it(argument, error, kwargs):
    with pytest.raises(error) as info:
        DisposableServer(**kwargs).close()
    assert not isinstance(info.value, CacheError)
    assert_names(info.value, argument)


@pytest.mark.parametrize("timeout", [-1, "60", NAN, None], ids=["negative", "str", "nan", "none"])
def test_disposable_server_start_and_stop_reject_a_bad_timeout(timeout):
    server = DisposableServer()
    try:
        for method in (server.start, server.stop):
            with pytest.raises((TypeError, ValueError)) as info:
                method(timeout)
            assert_names(info.value, "timeout")
        assert not server.running  # start(bad) started nothing
    finally:
        server.close()


# == docs/errors.md ===================================================================


def exported_exceptions() -> dict[str, type[BaseException]]:
    modules = [client_query_cache] + [
        __import__(f"client_query_cache.{name}", fromlist=["__all__"])
        for name in ("synchronous", "asynchronous", "owner", "testing", "otel")
    ]
    found = {}
    for module in modules:
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found[name] = value
    return found


def test_every_exported_exception_class_is_in_errors_md_with_its_bases():
    text = ERRORS_MD.read_text(encoding="utf-8")
    classes = exported_exceptions()
    assert {"CacheError", "CacheConfigurationError", "SharedCacheError"} <= set(classes)
    for name, cls in classes.items():
        bases = ", ".join(base.__name__ for base in cls.__bases__)
        assert f"`{name}({bases})`" in text, f"docs/errors.md lacks `{name}({bases})`"


def test_every_exception_type_the_package_raises_is_named_in_errors_md():
    text = ERRORS_MD.read_text(encoding="utf-8")
    raised_names = set()
    for path in PACKAGE.rglob("*.py"):
        raised_names |= set(re.findall(r"\braise\s+([A-Z][A-Za-z]+)\b", path.read_text(encoding="utf-8")))
    for path in (REPO / "csrc").glob("*.c"):
        raised_names |= {
            f"{name}Error" for name in re.findall(r"PyErr_(?:SetString|Format)\s*\(\s*PyExc_(\w+?)Error\b", path.read_text())
        }
    assert "CacheConfigurationError" in raised_names
    internal = {"StopIteration", "StopAsyncIteration"}  # the end of a cursor
    missing = sorted(name for name in raised_names - internal if not re.search(rf"`{name}[`(]", text))
    assert not missing, f"docs/errors.md does not mention {missing}"
