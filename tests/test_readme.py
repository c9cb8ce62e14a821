"""README's usage examples run as written (the connection string aside) and
do what their comments say: a miss, then a hit."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pymongo
import pytest

from client_query_cache.testing import external_uri

README = Path(__file__).resolve().parent.parent / "README.md"
URI = "mongodb://db1,db2,db3/?replicaSet=rs0"


def _usage_blocks() -> list[str]:
    text = README.read_text()
    usage = text[text.index("\n## Usage\n") :]
    blocks = re.findall(r"```python\n(.*?)```", usage, flags=re.S)
    return blocks[:2]


@pytest.fixture
def app_db(client: pymongo.MongoClient):
    if external_uri() is not None:
        pytest.skip("MONGODB_URI is set: the examples write to the database 'app'")
    client.drop_database("app")
    client.app.users.insert_one({"_id": 1, "email": "a@example.com", "name": "n", "active": True})
    yield
    client.drop_database("app")


def _run(block: str, server_uri: str) -> str:
    assert URI in block
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.replace(URI, server_uri), str(README), "exec"), {"__name__": "readme"})
    return out.getvalue()


def test_the_sync_usage_example_gets_a_miss_then_a_hit(server_uri, app_db):
    sync_block, _ = _usage_blocks()
    out = _run(sync_block, server_uri)
    hits = int(re.search(r"hits=(\d+)", out).group(1))
    misses = int(re.search(r"misses=(\d+)", out).group(1))
    assert hits >= 1 and misses >= 1, out
    assert "stream_unhealthy" not in out, out


def test_the_async_usage_example_gets_a_miss_then_a_hit(server_uri, app_db, recwarn):
    _, async_block = _usage_blocks()
    out = _run(async_block, server_uri)
    doc = {"_id": 1, "email": "a@example.com", "name": "n", "active": True}
    assert out.splitlines()[:2] == [repr(doc), repr(doc)]
    assert re.search(r"hits=1, misses=1,", out), out
    assert not [w for w in recwarn.list if issubclass(w.category, ResourceWarning)]
