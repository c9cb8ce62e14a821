"""Shared fixtures: one database server per test session, a client per test,
cache managers closed at teardown (helpers for polling are in support.py).
The async fixtures (pytest-asyncio, ``asyncio_mode = "auto"``) mirror the sync
ones with an ``AsyncMongoClient`` bound to the test's event loop; the ``d``
fixture runs a test written once with each API (see support.Driver).

The server is a disposable local SecantusDB, or the deployment named by the
environment variable MONGODB_URI (see client_query_cache.testing).
"""

from __future__ import annotations

import shutil
import stat
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from client_query_cache import AsyncCacheManager, CacheManager
from client_query_cache.testing import disposable_uri
from support import TEST_MAX_AWAIT_MS, Driver


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh runtime directory (0700, short path: it holds unix sockets)
    for this test's shared caches; spawned workers and owners inherit it."""
    path = Path(tempfile.mkdtemp(prefix="cqc-rt-"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    monkeypatch.setenv("CQC_RUNTIME_DIR", str(path))
    try:
        yield path
    finally:
        path.chmod(0o700)
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def server_uri() -> Iterator[str]:
    """URI of the session's server: MONGODB_URI, or a disposable local one."""
    with disposable_uri() as uri:
        yield uri


@pytest.fixture
def client(server_uri: str) -> Iterator[pymongo.MongoClient]:
    """A PyMongo client for this test, closed at teardown."""
    mongo = pymongo.MongoClient(server_uri)
    try:
        yield mongo
    finally:
        mongo.close()


@pytest.fixture
def db_name(client: pymongo.MongoClient) -> Iterator[str]:
    """A database name no other test uses; the database is dropped afterwards."""
    name = f"cqc_test_{uuid.uuid4().hex[:16]}"
    yield name
    client.drop_database(name)


# -- cache managers ------------------------------------------------------------

@pytest.fixture
def other_client(server_uri: str) -> Iterator[pymongo.MongoClient]:
    """A second PyMongo client: "another application" that writes."""
    mongo = pymongo.MongoClient(server_uri)
    try:
        yield mongo
    finally:
        mongo.close()


@pytest.fixture
def make_manager(client: pymongo.MongoClient) -> Iterator[Callable[..., CacheManager]]:
    """Build managers over ``client`` (or another client given as ``client=``),
    with ``max_await_time_ms=200`` unless told otherwise; all are closed at
    teardown."""
    made: list[CacheManager] = []

    def make(**options: Any) -> CacheManager:
        options.setdefault("max_await_time_ms", TEST_MAX_AWAIT_MS)
        owner = options.pop("client", client)
        cache = CacheManager(owner, **options)
        made.append(cache)
        return cache

    try:
        yield make
    finally:
        for cache in made:
            cache.close()


@pytest.fixture
def manager(make_manager: Callable[..., CacheManager]) -> CacheManager:
    """A manager over ``client`` with the test settings, closed at teardown."""
    return make_manager()


# -- async clients and managers ------------------------------------------------

@pytest.fixture
async def async_client(server_uri: str) -> AsyncIterator[pymongo.AsyncMongoClient]:
    """A PyMongo ``AsyncMongoClient`` for this test, closed at teardown."""
    mongo: pymongo.AsyncMongoClient = pymongo.AsyncMongoClient(server_uri)
    try:
        yield mongo
    finally:
        await mongo.close()


@pytest.fixture
async def make_async_manager(
    async_client: pymongo.AsyncMongoClient,
) -> AsyncIterator[Callable[..., AsyncCacheManager]]:
    """Build async managers over ``async_client`` (or ``client=``), with
    ``max_await_time_ms=200`` unless told otherwise; all are closed at
    teardown."""
    made: list[AsyncCacheManager] = []

    def make(**options: Any) -> AsyncCacheManager:
        options.setdefault("max_await_time_ms", TEST_MAX_AWAIT_MS)
        owner = options.pop("client", async_client)
        cache = AsyncCacheManager(owner, **options)
        made.append(cache)
        return cache

    try:
        yield make
    finally:
        for cache in made:
            await cache.close()


@pytest.fixture
def async_manager(make_async_manager: Callable[..., AsyncCacheManager]) -> AsyncCacheManager:
    """An async manager over ``async_client`` with the test settings, closed
    at teardown."""
    return make_async_manager()


# -- one test, both APIs -------------------------------------------------------

@pytest.fixture(params=["sync", "async"])
async def d(request: pytest.FixtureRequest, server_uri: str) -> AsyncIterator[Driver]:
    """The test runs twice, with the sync API (``CacheManager`` over a
    ``MongoClient``) and with the async one: test ids say ``sync``/``async``.
    What the driver made is closed at teardown."""
    driver = Driver(request.param, server_uri)
    try:
        yield driver
    finally:
        await driver.close()
