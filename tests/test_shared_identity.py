"""Who may read a shared cache: a worker attaches only when its client
authenticates to MongoDB as the owner's connection string does (the same
mechanism, source, user and password), since a hit never reaches MongoDB's
access control. The test server authenticates SCRAM users (it does not
enforce their roles, so these tests check the refusal, not the server).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymongo
import pytest

from client_query_cache import CacheManager, SharedCache, SharedCacheConfig, SharedCacheError
from client_query_cache.testing import external_uri
from support import TEST_MAX_AWAIT_MS, ready_collection, wait_until

pytestmark = pytest.mark.skipif(
    external_uri() is not None, reason="MONGODB_URI is set: these tests create users on the server"
)


class Users:
    """Two users of this test on the server, and connection strings for them."""

    def __init__(self, server_uri: str, admin: pymongo.MongoClient) -> None:
        tag = uuid.uuid4().hex[:8]
        self.server_uri = server_uri
        self.names = {"alice": f"alice_{tag}", "bob": f"bob_{tag}"}
        self.passwords = {"alice": f"pw-alice-{uuid.uuid4().hex}", "bob": f"pw-bob-{uuid.uuid4().hex}"}
        for who, name in self.names.items():
            admin.admin.command("createUser", name, pwd=self.passwords[who], roles=["root"])
        self._admin = admin

    def uri(self, who: str, password: str | None = None, **options: str) -> str:
        user, pw = self.names[who], password if password is not None else self.passwords[who]
        uri = self.server_uri.replace("mongodb://", f"mongodb://{user}:{pw}@", 1)
        for key, value in options.items():
            if "?" in uri:
                uri += "&"
            else:
                uri += "?" if uri.endswith("/") else "/?"
            uri += f"{key}={value}"
        return uri

    def secrets(self) -> list[str]:
        return list(self.passwords.values())

    def drop(self) -> None:
        for name in self.names.values():
            self._admin.admin.command("dropUser", name)


@pytest.fixture
def users(server_uri: str, client: pymongo.MongoClient) -> Iterator[Users]:
    u = Users(server_uri, client)
    try:
        yield u
    finally:
        u.drop()


@pytest.fixture
def clients() -> Iterator[Any]:
    made: list[pymongo.MongoClient] = []

    def make(uri: str) -> pymongo.MongoClient:
        c: pymongo.MongoClient = pymongo.MongoClient(uri)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def owners(runtime_dir: Path) -> Iterator[Any]:
    started: list[SharedCache] = []

    def start(uri: str) -> SharedCache:
        owner = SharedCache.start(f"id-{uuid.uuid4().hex[:10]}", uri, max_await_time_ms=TEST_MAX_AWAIT_MS)
        started.append(owner)
        return owner

    yield start
    for owner in started:
        owner.stop(timeout=10)


def _refused(client: pymongo.MongoClient, name: str, secrets: list[str]) -> str:
    with pytest.raises(SharedCacheError) as info:
        CacheManager(client, shared=name)
    message = str(info.value)
    for secret in secrets:
        assert secret not in message
    return message


def test_a_worker_of_the_owners_user_attaches_and_is_served(users, clients, owners, db_name):
    owner = owners(users.uri("alice"))
    alice = clients(users.uri("alice"))
    alice[db_name].items.insert_one({"_id": 1, "v": "a"})
    manager = CacheManager(alice, shared=owner.name, max_await_time_ms=TEST_MAX_AWAIT_MS)
    try:
        coll = ready_collection(manager, db_name, "items")
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": "a"}  # a miss: admitted
        wait_until(lambda: owner.snapshot()["entries"] == 1, what="the owner applied the admission")
        hits = manager.snapshot().hits
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": "a"}
        assert manager.snapshot().hits == hits + 1
        assert owner.snapshot()["attached_workers"] == 1
    finally:
        manager.close()


@pytest.mark.parametrize(
    "worker,reason",
    [
        (lambda u: u.uri("bob"), "another user"),
        (lambda u: u.uri("alice", password="not-" + u.passwords["alice"]), "another password"),
        (lambda u: u.uri("alice", authSource="elsewhere"), "another user"),
        (lambda u: u.uri("alice", authMechanism="SCRAM-SHA-256"), "another mechanism"),
        (lambda u: u.server_uri, "has no MongoDB credentials"),
    ],
    ids=["another-user", "another-password", "another-source", "another-mechanism", "no-credentials"],
)
def test_a_worker_that_authenticates_otherwise_is_refused_without_a_secret_named(
    users, clients, owners, runtime_dir, worker, reason
):
    owner = owners(users.uri("alice"))
    other = clients(worker(users))
    message = _refused(other, owner.name, users.secrets())
    assert reason in message and owner.name in message, message
    # Nothing of the refused worker stays: no ring, no attachment.
    assert list(runtime_dir.glob(f"{owner.name}.w*.ring")) == []
    assert owner.snapshot()["attached_workers"] == 0
    # The owner's own user still attaches after the refusals.
    manager = CacheManager(clients(users.uri("alice")), shared=owner.name)
    try:
        assert owner.snapshot()["attached_workers"] == 1
    finally:
        manager.close()


def test_a_worker_with_credentials_is_refused_by_an_owner_without(users, clients, owners, server_uri):
    owner = owners(server_uri)
    message = _refused(clients(users.uri("alice")), owner.name, users.secrets())
    assert "owner's connection string does not" in message, message
    # A worker without credentials, as the owner, attaches.
    manager = CacheManager(clients(server_uri), shared=owner.name)
    manager.close()


def test_a_worker_that_would_start_the_owner_is_refused_by_one_another_user_started(
    users, clients, runtime_dir
):
    name = f"auto-{uuid.uuid4().hex[:10]}"
    config = SharedCacheConfig(name, start_owner=True, max_await_time_ms=TEST_MAX_AWAIT_MS, grace_seconds=0.5)
    first = CacheManager(clients(users.uri("alice")), shared=config)
    try:
        # bob's worker finds alice's owner running: it neither attaches nor
        # starts an owner of its own under that name.
        message = _refused(clients(users.uri("bob")), config, users.secrets())
        assert "another user" in message, message
        assert first.snapshot().hits == 0
    finally:
        first.close()


def test_a_worker_process_of_another_user_is_refused(users, owners, runtime_dir):
    owner = owners(users.uri("alice"))
    code = (
        "import sys, pymongo\n"
        "from client_query_cache import CacheManager, SharedCacheError\n"
        "client = pymongo.MongoClient(sys.argv[1])\n"
        "try:\n"
        "    CacheManager(client, shared=sys.argv[2]).close()\n"
        "    print('attached')\n"
        "except SharedCacheError as exc:\n"
        "    print('refused:', exc)\n"
    )
    for who, expected in (("bob", "refused:"), ("alice", "attached")):
        done = subprocess.run(
            [sys.executable, "-c", code, users.uri(who), owner.name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(expected), (who, done.stdout, done.stderr)
        for secret in users.secrets():
            assert secret not in done.stdout
