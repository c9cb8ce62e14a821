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


def test_a_picked_port_another_process_takes_first_is_replaced(monkeypatch) -> None:
    # Between picking a free port and the server's bind, another process
    # (another test worker's server, say) may take it: the first start then
    # tries another port. A port the caller gave is never replaced.
    from client_query_cache import testing

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        real = testing._free_port
        monkeypatch.setattr(testing, "_free_port", lambda: next(ports, None) or real())
        server = DisposableServer()
        try:
            server.start()
            assert server.port != busy
            with pymongo.MongoClient(server.uri, serverSelectionTimeoutMS=10_000) as c:
                assert c.admin.command("ping")["ok"] == 1
        finally:
            server.close()
        given = DisposableServer(port=busy)
        try:
            with pytest.raises(RuntimeError, match="Address already in use"):
                given.start(timeout=30)
        finally:
            given.close()


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


# -- a limitation of the test server that the product must not depend on -------


@needs_local_server
def test_an_empty_batchs_resume_token_can_precede_a_later_event_with_writers_on_two_databases(
    server_uri: str,
) -> None:
    # docs/consistency.md ("Causal reads"): SecantusDB's empty-batch
    # postBatchResumeToken is no high-water mark when writes to the watched
    # database commit while its scan sees only another database's: an event
    # can come after an empty batch whose token is at or past the event's own
    # time. MongoDB's KeyString tokens (type byte 0x82) do not do this; this
    # server's are a BSON document whose "t" is the time. Should this test
    # fail, the server changed: revisit stream.c's resume_token_time.
    import threading

    import bson

    db_a, db_b = f"cqc_pbrt_a_{os.getpid()}", f"cqc_pbrt_b_{os.getpid()}"
    stop = threading.Event()

    def write(db: str, pause: float) -> None:
        with _client(server_uri) as w:
            while not stop.is_set():
                w[db].items.update_one({"_id": 0}, {"$inc": {"n": 1}}, upsert=True)
                time.sleep(pause)

    writers = [threading.Thread(target=write, args=(db_a, 0.002)), threading.Thread(target=write, args=(db_b, 0))]
    found = events = empties = 0
    with _client(server_uri) as client:
        try:
            with client[db_a].watch(max_await_time_ms=50) as stream:
                for t in writers:
                    t.start()
                newest_empty = None
                deadline = time.monotonic() + 30
                while not found and time.monotonic() < deadline:
                    change = stream.try_next()
                    if change is None:
                        empties += 1
                        token_time = bson.decode(bytes.fromhex(stream.resume_token["_data"]))["t"]
                        newest_empty = max(newest_empty or token_time, token_time)
                        continue
                    events += 1
                    found += newest_empty is not None and change["clusterTime"] <= newest_empty
        finally:
            stop.set()
            for t in writers:
                if t.is_alive() or t.ident:
                    t.join(10)
            client.drop_database(db_a)
            client.drop_database(db_b)
    assert found, f"no event at or before an earlier empty batch's token ({events} events, {empties} empty batches)"
