"""One cache over TLS in a process of its own, for tests/test_tls.py.

    python tests/tls_child.py '<json>'

The platform trust-store tests run this in a private mount namespace where
/etc shows a Debian or a RHEL layout with only the test CA in it, and
without SSL_CERT_FILE / SSL_CERT_DIR: it is the product as a user runs it,
with no hook of the tests in it. The JSON argument:

    port         the TLS server's port on 127.0.0.1
    db           the database to use
    client_ca    tlsCAFile for the PyMongo client, or null: the client then
                 verifies with Python's default trust store
    stream_uri   the followers' connection string, or null: derived from
                 the client (the manager's default)
    shared       true: the followers run in an owner process
                 (SharedCache.start, CQC_RUNTIME_DIR from the environment)

It caches a document, changes it through PyMongo, waits until the change has
reached the cache through the follower (the new value served as a hit), and
prints one JSON line with what it saw. Failing steps are reported, not
raised, so the test shows the stream's state and error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import pymongo

from client_query_cache import CacheManager, SharedCache
from client_query_cache._core.trust import platform_trust
from client_query_cache._core.uri import stream_uri_for

DEADLINE_S = 15.0


def _served(manager: CacheManager, read: Any, expected: Any) -> bool:
    """Whether ``read`` returns ``expected`` as a hit before the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        hits = manager.snapshot().hits
        if read() == expected and manager.snapshot().hits > hits:
            return True
        time.sleep(0.02)
    return False


def main(spec: dict[str, Any]) -> dict[str, Any]:
    uri = f"mongodb://127.0.0.1:{spec['port']}/?tls=true&directConnection=true"
    options: dict[str, Any] = {"serverSelectionTimeoutMS": 10_000}
    if spec["client_ca"]:
        options["tlsCAFile"] = spec["client_ca"]
    trust = platform_trust()
    report: dict[str, Any] = {
        "trust": [trust.ca_file, trust.ca_dir],
        "trust_file_target": trust.ca_file and os.path.realpath(trust.ca_file),
    }
    client: pymongo.MongoClient = pymongo.MongoClient(uri, **options)
    owner = None
    manager = None
    try:
        items = client[spec["db"]].items
        items.insert_one({"_id": 1, "v": 1})  # PyMongo itself verified the server
        stream_uri = spec["stream_uri"]
        if spec["shared"]:
            owner = SharedCache.start("tls", stream_uri or stream_uri_for(client), max_await_time_ms=200)
            manager = CacheManager(client, shared="tls", max_await_time_ms=200)
        else:
            manager = CacheManager(client, stream_uri=stream_uri, max_await_time_ms=200)
        coll = manager[spec["db"]]["items"]
        report["ready"] = manager.wait_ready(DEADLINE_S, database=spec["db"])
        read = lambda: coll.find_one({"_id": 1})  # noqa: E731
        report["hit_before"] = _served(manager, read, {"_id": 1, "v": 1})
        items.update_one({"_id": 1}, {"$set": {"v": 2}})
        report["hit_after"] = _served(manager, read, {"_id": 1, "v": 2})
    finally:
        if manager is not None:
            snapshot = manager.snapshot()
            stream = next((s for s in snapshot.streams if s.database == spec["db"]), None)
            report["state"] = stream.state.value if stream else None
            report["last_error"] = stream.last_error if stream else None
            report["events"] = stream.events if stream else None
            report["bypasses"] = dict(snapshot.bypasses)
            manager.close()
        if owner is not None:
            owner.stop()
        client.drop_database(spec["db"])
        client.close()
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
