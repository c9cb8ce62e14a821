"""One change stream per cache: every database a manager (or a shared
cache's owner) serves rides one deployment-wide stream on one thread and one
connection, a database added later is carried without losing the events of
the others, and where the deployment refuses a deployment-wide stream (or
the application asks) each database gets a stream of its own, polled by the
same thread, with the scope and its reason in ``snapshot()``.

Observed from outside: the process's threads (/proc), the server's
connections that announce the stream's application name (currentOp),
hits, and documents read back after writes made by another client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
import pytest

from client_query_cache import CacheConfigurationError, CacheManager, SharedCache, SharedCacheConfig
from client_query_cache.testing import DisposableServer, external_uri
from support import (
    DEADLINE_S,
    TEST_MAX_AWAIT_MS,
    connections_named,
    served,
    wait_until,
    with_app_name,
)

DBS = 12


def threads_of(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or 'self'}/task"))


@pytest.fixture
def databases(client: pymongo.MongoClient) -> Iterator[list[str]]:
    """DBS databases of this test, each with a collection ``t`` holding
    ``{"_id": 1, "v": 0}``; dropped afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = [f"one_stream_{tag}_{i}" for i in range(DBS)]
    for name in names:
        client[name].t.insert_one({"_id": 1, "v": 0})
    yield names
    for name in names:
        client.drop_database(name)


def app_manager(client: pymongo.MongoClient, server_uri: str, **options: Any) -> tuple[CacheManager, str]:
    """A manager whose stream announces an application name of its own."""
    app = f"cqc-stream-{uuid.uuid4().hex[:8]}"
    return (
        CacheManager(
            client,
            max_await_time_ms=TEST_MAX_AWAIT_MS,
            stream_uri=with_app_name(server_uri, app),
            **options,
        ),
        app,
    )


def all_healthy(manager: CacheManager, names: list[str]) -> bool:
    streams = {s.database: s for s in manager.snapshot().streams}
    return all(n in streams and streams[n].state.value == "healthy" for n in names)


def read_all(manager: CacheManager, names: list[str]) -> None:
    for name in names:
        manager[name].t.find_one({"_id": 1})


def serve_all(manager: CacheManager, names: list[str]) -> None:
    """Read every database until all its streams serve, then until each read
    is a hit."""
    read_all(manager, names)
    wait_until(lambda: all_healthy(manager, names), what="every database's stream serves")
    for name in names:
        served(manager, lambda n=name: manager[n].t.find_one({"_id": 1}), what=f"{name} is served")


def reads_back(manager: CacheManager, name: str, value: int) -> Callable[[], bool]:
    return lambda: (manager[name].t.find_one({"_id": 1}) or {}).get("v") == value


@pytest.mark.parametrize("scope", ["deployment", "database"])
def test_a_manager_follows_every_database_on_one_thread_and_one_connection(
    client: pymongo.MongoClient, server_uri: str, databases: list[str], scope: str
) -> None:
    manager, app = app_manager(client, server_uri, stream_scope=scope)
    try:
        serve_all(manager, databases[:1])
        threads_one, conns_one = threads_of(), connections_named(client, app)
        serve_all(manager, databases)
        assert threads_of() <= threads_one
        assert connections_named(client, app) == conns_one == 1
        streams = {s.database: s for s in manager.snapshot().streams}
        assert {streams[n].scope for n in databases} == {scope}
        reasons = {streams[n].scope_reason for n in databases}
        assert reasons == ({""} if scope == "deployment" else {"asked for: a stream per database"})
        # Another client's writes reach every database's entries.
        for i, name in enumerate(databases):
            client[name].t.update_one({"_id": 1}, {"$set": {"v": i + 1}})
        for i, name in enumerate(databases):
            wait_until(reads_back(manager, name, i + 1), what=f"{name} reads the write back")
        for i, name in enumerate(databases):
            assert served(manager, lambda n=name: manager[n].t.find_one({"_id": 1}))["v"] == i + 1
        streams = {s.database: s for s in manager.snapshot().streams}
        assert all(streams[n].events >= 1 and streams[n].invalidations >= 1 for n in databases)
    finally:
        manager.close()
    wait_until(lambda: connections_named(client, app) == 0, what="the stream's connection is closed")


@contextlib.contextmanager
def a_cache(mode: str, client: pymongo.MongoClient, server_uri: str) -> Iterator[CacheManager]:
    """A process-local manager (``local``), or a worker of an owner started
    for the block (``shared``; needs the runtime_dir fixture)."""
    if mode == "local":
        manager, _ = app_manager(client, server_uri)
        with manager:
            yield manager
        return
    owner = SharedCache.start(f"one-stream-{uuid.uuid4().hex[:8]}", server_uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        with CacheManager(client, shared=owner.name) as manager:
            yield manager
    finally:
        owner.stop()


@pytest.mark.parametrize("mode", ["local", "shared"])
def test_a_database_added_while_the_stream_runs_loses_no_event_of_the_others(
    client: pymongo.MongoClient, server_uri: str, databases: list[str], mode: str, runtime_dir: Any
) -> None:
    """Every document of the first database is cached, then another client
    updates each of them once, without pause, while the other databases are
    added one by one (each re-opens the stream with a wider $match). A
    change lost across a re-open would leave that document's old version
    cached for good: no later write touches it."""
    docs = 300
    first, rest = databases[0], databases[1:]
    client[first].t.insert_many([{"_id": i, "v": 0} for i in range(2, docs)])
    done = threading.Event()

    def write() -> None:
        writer = pymongo.MongoClient(server_uri)
        try:
            for i in range(1, docs):
                writer[first].t.update_one({"_id": i}, {"$set": {"v": 1}})
        finally:
            writer.close()
            done.set()

    with a_cache(mode, client, server_uri) as manager:
        serve_all(manager, [first])
        view = manager[first].t
        for i in range(1, docs):
            served(manager, lambda i=i: view.find_one({"_id": i}))
        thread = threading.Thread(target=write)
        thread.start()
        try:
            for name in rest:
                manager[name].t.find_one({"_id": 1})
                wait_until(lambda n=name: all_healthy(manager, [n]), what=f"{name} is carried")
        finally:
            thread.join()
        wait_until(
            lambda: {x.database: x.events for x in manager.snapshot().streams}[first] >= docs - 1,
            what="every update's event is applied",
        )
        assert done.is_set()
        assert all_healthy(manager, databases)
        for i in range(1, docs):
            wait_until(
                lambda i=i: view.find_one({"_id": i}) == {"_id": i, "v": 1},
                timeout=5 if i == 1 else 1,
                what=f"document {i}'s write is read back",
            )


def test_dropping_one_database_leaves_the_others_served(
    client: pymongo.MongoClient, server_uri: str, databases: list[str]
) -> None:
    manager, _ = app_manager(client, server_uri)
    try:
        serve_all(manager, databases[:3])
        client.drop_database(databases[0])
        wait_until(lambda: manager[databases[0]].t.find_one({"_id": 1}) is None, what="the drop is seen")
        hits = manager.snapshot().hits
        for name in databases[1:3]:
            assert manager[name].t.find_one({"_id": 1}) == {"_id": 1, "v": 0}
        assert manager.snapshot().hits == hits + 2
        assert all_healthy(manager, databases[:3])
    finally:
        manager.close()


def test_stream_scope_is_checked(client: pymongo.MongoClient) -> None:
    for bad in ("cluster", "", None, 1):
        with pytest.raises(CacheConfigurationError, match="stream_scope"):
            CacheManager(client, stream_scope=bad)  # type: ignore[arg-type]
        with pytest.raises(CacheConfigurationError, match="stream_scope"):
            SharedCacheConfig("scope-check", stream_scope=bad)  # type: ignore[arg-type]
        with pytest.raises(CacheConfigurationError, match="stream_scope"):
            SharedCache.start("scope-check", "mongodb://127.0.0.1:1", stream_scope=bad)  # type: ignore[arg-type]


def test_a_shared_owner_follows_every_database_on_one_thread(
    client: pymongo.MongoClient, server_uri: str, databases: list[str], runtime_dir: Any
) -> None:
    name = f"one-stream-{uuid.uuid4().hex[:8]}"
    owner = SharedCache.start(name, server_uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        manager = CacheManager(client, shared=name)
        try:
            serve_all(manager, databases[:1])
            threads_one = threads_of(owner.pid)
            serve_all(manager, databases)
            assert threads_of(owner.pid) <= threads_one
            streams = owner.snapshot()["streams"]
            assert {s["database"] for s in streams} >= set(databases)
            assert {s["scope"] for s in streams} == {"deployment"}
            for i, db in enumerate(databases):
                client[db].t.update_one({"_id": 1}, {"$set": {"v": i + 1}})
            for i, db in enumerate(databases):
                wait_until(reads_back(manager, db, i + 1), what=f"{db} reads the write back")
            # A worker's snapshot leaves the scope to the owner's.
            assert {s.scope for s in manager.snapshot().streams} == {None}
        finally:
            manager.close()
    finally:
        owner.stop()


# -- a deployment that refuses a deployment-wide stream ------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[str, str]]:
    """A server with --auth, and the connection strings of a root user and
    of a user with readWrite on the databases a0..a3 only (its
    deployment-wide change stream is refused: Unauthorized)."""
    if external_uri() is not None:
        pytest.skip("MONGODB_URI is set: this test starts servers of its own")
    storage = tempfile.mkdtemp(prefix="cqc-auth-")
    try:
        with DisposableServer(storage_path=storage) as setup:
            port = setup.port
            admin = pymongo.MongoClient(setup.uri)
            admin.admin.command("createUser", "root", pwd="root-pw", roles=["root"])
            roles = [{"role": "readWrite", "db": f"a{i}"} for i in range(4)]
            admin.admin.command("createUser", "app", pwd="app-pw", roles=roles)
            admin.close()
        with DisposableServer(storage_path=storage, port=port, extra_args=["--auth"]) as srv:
            yield (
                srv.uri.replace("mongodb://", "mongodb://root:root-pw@", 1),
                srv.uri.replace("mongodb://", "mongodb://app:app-pw@", 1),
            )
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def refused_scope(snapshot_streams: list[Any], names: list[str]) -> set[tuple[str, str]]:
    return {(s.scope, s.scope_reason) for s in snapshot_streams if s.database in names}


def test_a_refused_deployment_wide_stream_falls_back_to_one_per_database(
    auth_server: tuple[str, str],
) -> None:
    root_uri, app_uri = auth_server
    names = ["a0", "a1", "a2"]
    root = pymongo.MongoClient(root_uri)
    app = pymongo.MongoClient(app_uri)
    try:
        for n in names:
            root[n].t.replace_one({"_id": 1}, {"_id": 1, "v": 0}, upsert=True)
        manager = CacheManager(app, max_await_time_ms=TEST_MAX_AWAIT_MS)
        try:
            serve_all(manager, names)
            scopes = refused_scope(list(manager.snapshot().streams), names)
            assert len(scopes) == 1
            ((scope, reason),) = scopes
            assert scope == "database"
            assert "refused a deployment-wide change stream" in reason and ".13:" in reason
            assert "app-pw" not in reason
            for i, n in enumerate(names):
                root[n].t.update_one({"_id": 1}, {"$set": {"v": i + 1}})
            for i, n in enumerate(names):
                wait_until(reads_back(manager, n, i + 1), what=f"{n} reads the write back")
                assert served(manager, lambda n=n: manager[n].t.find_one({"_id": 1}))["v"] == i + 1
        finally:
            manager.close()
        # A user allowed everywhere keeps the deployment-wide stream.
        manager = CacheManager(root, max_await_time_ms=TEST_MAX_AWAIT_MS)
        try:
            serve_all(manager, names)
            assert refused_scope(list(manager.snapshot().streams), names) == {("deployment", "")}
        finally:
            manager.close()
    finally:
        root.close()
        app.close()


def test_a_shared_owner_reports_the_fallback(auth_server: tuple[str, str], runtime_dir: Any) -> None:
    root_uri, app_uri = auth_server
    root = pymongo.MongoClient(root_uri)
    app = pymongo.MongoClient(app_uri)
    name = f"refused-{uuid.uuid4().hex[:8]}"
    owner = SharedCache.start(name, app_uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        root.a3.t.replace_one({"_id": 1}, {"_id": 1, "v": 0}, upsert=True)
        manager = CacheManager(app, shared=name)
        try:
            serve_all(manager, ["a3"])
            (stream,) = [s for s in owner.snapshot()["streams"] if s["database"] == "a3"]
            assert stream["scope"] == "database"
            assert "refused a deployment-wide change stream" in stream["scope_reason"]
            root.a3.t.update_one({"_id": 1}, {"$set": {"v": 7}})
            wait_until(reads_back(manager, "a3", 7), what="the write is read back")
        finally:
            manager.close()
    finally:
        owner.stop()
        root.close()
        app.close()


def test_a_collection_renamed_in_from_a_database_the_cache_does_not_serve_is_seen(
    client: pymongo.MongoClient, server_uri: str, databases: list[str]
) -> None:
    """A rename's event names its source's database: one from a database
    the cache does not serve onto a collection it caches must still drop
    that collection's entries (the test server also reports the dropped
    target; the deployment-wide stream lets every rename through), and one
    between two databases it does not serve changes nothing."""
    served_db, other = databases[0], databases[-1]
    manager, _ = app_manager(client, server_uri)
    try:
        serve_all(manager, [served_db, databases[1]])
        client[other].src.insert_one({"_id": 1, "v": 99})
        client.admin.command(
            "renameCollection", f"{other}.src", to=f"{served_db}.t", dropTarget=True
        )
        wait_until(reads_back(manager, served_db, 99), what="the renamed-in collection is read")
        assert served(manager, lambda: manager[served_db].t.find_one({"_id": 1}))["v"] == 99
        # A rename between two databases the cache does not serve changes nothing here.
        events = {x.database: x.events for x in manager.snapshot().streams}
        hits = manager.snapshot().hits
        client[other].a.insert_one({"_id": 1})
        client.admin.command("renameCollection", f"{other}.a", to=f"{databases[-2]}.b")
        time.sleep(3 * TEST_MAX_AWAIT_MS / 1000)
        assert manager[databases[1]].t.find_one({"_id": 1}) == {"_id": 1, "v": 0}
        assert manager.snapshot().hits == hits + 1
        assert {x.database: x.events for x in manager.snapshot().streams} == events
        assert all_healthy(manager, [served_db, databases[1]])
    finally:
        manager.close()
