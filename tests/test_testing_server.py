"""The disposable-server helper that every suite and benchmark relies on."""

from __future__ import annotations

import os
import socket
import time

import psutil
import pymongo
import pytest

from client_query_cache.testing import DisposableServer, disposable_uri, external_uri

needs_local_server = pytest.mark.skipif(
    external_uri() is not None,
    reason="MONGODB_URI is set: starting and stopping servers is not tested",
)


def _port_accepts(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _client(uri: str) -> pymongo.MongoClient:
    return pymongo.MongoClient(uri, serverSelectionTimeoutMS=10_000)


# -- lifecycle (local server only) -------------------------------------------


@needs_local_server
def test_started_server_serves_reads_and_writes_as_a_replica_set_primary() -> None:
    with DisposableServer() as server:
        assert server.running
        assert psutil.Process(server.pid).is_running()
        assert server.uri == f"mongodb://127.0.0.1:{server.port}/?directConnection=true"
        with _client(server.uri) as client:
            hello = client.admin.command("hello")
            assert hello["isWritablePrimary"] is True
            assert hello["setName"] == "secantus"
            client.db.items.insert_one({"_id": 1, "name": "one"})
            assert client.db.items.find_one({"_id": 1}) == {"_id": 1, "name": "one"}


@needs_local_server
def test_restart_keeps_port_storage_and_data() -> None:
    with DisposableServer() as server:
        port, path, first_pid = server.port, server.storage_path, server.pid
        with _client(server.uri) as client:
            client.db.items.insert_one({"_id": "kept", "n": 7})

        server.restart()

        assert server.running
        assert (server.port, server.storage_path) == (port, path)
        assert server.pid != first_pid
        assert not psutil.pid_exists(first_pid) or not psutil.Process(first_pid).is_running()
        with _client(server.uri) as client:
            assert client.db.items.find_one({"_id": "kept"}) == {"_id": "kept", "n": 7}


@needs_local_server
def test_stop_frees_the_port_and_is_idempotent() -> None:
    with DisposableServer() as server:
        assert _port_accepts(server.port)
        proc = psutil.Process(server.pid)
        server.stop()
        assert not server.running
        assert server.pid is None
        assert not proc.is_running()
        assert not _port_accepts(server.port)
        server.stop()  # a second stop is a no-op
        assert not server.running


@needs_local_server
def test_close_ends_the_process_and_removes_temporary_storage() -> None:
    server = DisposableServer()
    server.start()
    path = server.storage_path
    proc = psutil.Process(server.pid)
    assert os.path.isdir(path) and os.listdir(path)  # the server wrote its files

    server.close()

    assert not proc.is_running()
    assert not os.path.exists(path)
    server.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        server.start()


@needs_local_server
def test_close_keeps_a_storage_path_the_caller_gave(tmp_path) -> None:
    path = tmp_path / "data"
    log = tmp_path / "server.log"
    with DisposableServer(storage_path=path, log_path=log) as server:
        assert server.storage_path == str(path)
    assert path.is_dir() and any(path.iterdir())
    assert "listening on" in log.read_text()


@needs_local_server
def test_failed_start_raises_with_the_server_output() -> None:
    with DisposableServer() as first:
        second = DisposableServer(port=first.port)  # the port is taken
        try:
            started = time.monotonic()
            with pytest.raises(RuntimeError, match="before listening") as info:
                second.start()
            assert time.monotonic() - started < 30  # early exit, not the timeout
            assert "output:" in str(info.value)
            assert "in use" in str(info.value).lower()
            assert not second.running
        finally:
            second.close()
        assert first.running  # the first server is untouched


def test_without_the_test_extra_the_error_names_it(monkeypatch) -> None:
    # SecantusDB neither installed as a script nor importable: the extra
    # that brings it is named, before any process is started.
    from client_query_cache import testing

    find_spec = testing.importlib.util.find_spec
    monkeypatch.setattr(testing, "_SERVER_SCRIPT", "cqc-no-such-server")
    monkeypatch.setattr(
        testing.importlib.util, "find_spec", lambda name, *a: None if name == "secantus" else find_spec(name, *a)
    )
    server = DisposableServer()
    try:
        with pytest.raises(RuntimeError, match=r"client-query-cache\[test\]"):
            server.start()
        assert not server.running
    finally:
        server.close()


@needs_local_server
def test_disposable_uri_starts_and_removes_a_local_server(monkeypatch) -> None:
    monkeypatch.delenv("MONGODB_URI", raising=False)
    with disposable_uri() as uri:
        port = int(uri.split(":")[2].split("/")[0])
        with _client(uri) as client:
            assert client.admin.command("ping")["ok"] == 1
    assert not _port_accepts(port)


def test_disposable_uri_passes_mongodb_uri_through_without_starting(monkeypatch) -> None:
    given = "mongodb://db.example.invalid:27017/?replicaSet=rs0"
    monkeypatch.setenv("MONGODB_URI", given)
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with disposable_uri() as uri:
        assert uri == given
        assert external_uri() == given
        children = {p.pid for p in psutil.Process().children(recursive=True)}
        assert children == children_before
    monkeypatch.delenv("MONGODB_URI")
    assert external_uri() is None


# -- behaviour every deployment must have (runs against MONGODB_URI too) ------


def test_database_change_stream_sees_an_insert(client, db_name) -> None:
    db = client[db_name]
    with db.watch(max_await_time_ms=200) as stream:
        db.items.insert_one({"_id": 42, "v": "x"})
        change = None
        deadline = time.monotonic() + 15
        while change is None and time.monotonic() < deadline:
            change = stream.try_next()
    assert change is not None, "no change event within 15 s"
    assert change["operationType"] == "insert"
    assert change["ns"] == {"db": db_name, "coll": "items"}
    assert change["documentKey"] == {"_id": 42}
    assert change["fullDocument"] == {"_id": 42, "v": "x"}
