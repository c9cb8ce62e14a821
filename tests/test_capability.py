"""Attach by capability: ``SharedCache.start(require_capability=True)``.

Such an owner refuses every worker that does not present the capability of
``SharedCache.connection`` (the object, its string form, or either handed
to another process), keeps its arena in a memfd that it hands over the
control socket instead of a file in the runtime directory, takes each
worker's ring the same way, and makes itself undumpable, so that another
process of the same user finds no path from which to map the arena: not in
the runtime directory, not under /proc/<owner>/fd or map_files.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pymongo
import pytest

from client_query_cache import (
    CacheConfigurationError,
    CacheManager,
    SharedCache,
    SharedCacheConnection,
    SharedCacheError,
)
from client_query_cache._core.shared import LineReader, paths_for, recv_message, send_message
from support import DEADLINE_S, TEST_MAX_AWAIT_MS, wait_until

_SPAWN = multiprocessing.get_context("spawn")


def _name() -> str:
    return f"cap-{uuid.uuid4().hex[:8]}"


def _start(server_uri: str, **options: Any) -> SharedCache:
    return SharedCache.start(_name(), server_uri, max_await_time_ms=TEST_MAX_AWAIT_MS, **options)


def _hit(manager: CacheManager, db: str, doc: dict[str, Any]) -> bool:
    """Whether reading ``doc`` again and again becomes a hit that returns
    it within the deadline (the stream becomes ready, or the worker
    re-attaches, and the owner drains the admission meanwhile)."""
    coll = manager[db]["items"]

    def hit() -> bool:
        before = manager.snapshot().hits
        assert coll.find_one({"_id": doc["_id"]}) == doc
        return manager.snapshot().hits > before

    return bool(wait_until(hit, what="the document is a hit"))


def _attach_and_read(shared: Any, uri: str, db: str, doc: dict[str, Any], results: Any) -> None:
    """A spawned worker: attach with ``shared`` (a pickled connection, or
    None to take the string form from CQC_TEST_CONNECTION) and report
    whether its reads become hits."""
    try:
        if shared is None:
            shared = os.environ["CQC_TEST_CONNECTION"]
        with pymongo.MongoClient(uri) as client, CacheManager(client, shared=shared) as manager:
            results.put(("ok", _hit(manager, db, doc)))
    except BaseException as exc:  # noqa: BLE001 (reported to the test)
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def test_an_owner_that_requires_its_capability_refuses_a_worker_without_it(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Path
) -> None:
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    with _start(server_uri, require_capability=True) as owner:
        with pytest.raises(SharedCacheError, match="requires its capability") as refused:
            CacheManager(client, shared=owner.name)
        assert owner.connection.capability not in str(refused.value)
        wrong = SharedCacheConnection(owner.name, "0" * 64)
        with pytest.raises(SharedCacheError, match="capability does not match"):
            CacheManager(client, shared=wrong)
        with pytest.raises(SharedCacheError, match="capability does not match"):
            CacheManager(client, shared=str(wrong))
        assert owner.snapshot()["attached_workers"] == 0
        # The same process, with the connection: attached and served.
        with CacheManager(client, shared=owner.connection) as manager:
            assert _hit(manager, db_name, {"_id": 1, "v": 1})
            assert owner.snapshot()["attached_workers"] == 1


@pytest.mark.parametrize("form", ["pickled", "environment"])
def test_another_process_attaches_with_the_connection_and_shares_the_arena(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Path, form: str, monkeypatch: Any
) -> None:
    doc = {"_id": 7, "v": "shared"}
    client[db_name].items.insert_one(doc)
    with _start(server_uri, require_capability=True) as owner:
        with CacheManager(client, shared=owner.connection) as manager:
            assert _hit(manager, db_name, doc)
            admissions = owner.snapshot()["admissions_accepted"]
            results = _SPAWN.Queue()
            if form == "environment":
                monkeypatch.setenv("CQC_TEST_CONNECTION", str(owner.connection))
                shared = None
            else:
                shared = pickle.loads(pickle.dumps(owner.connection))
            proc = _SPAWN.Process(target=_attach_and_read, args=(shared, server_uri, db_name, doc, results))
            proc.start()
            try:
                kind, value = results.get(timeout=DEADLINE_S * 4)
            finally:
                proc.join(DEADLINE_S)
            assert (kind, value) == ("ok", True)
            # Its first read was already a hit: the entry the first worker
            # admitted, read from the same arena.
            assert owner.snapshot()["admissions_accepted"] == admissions


def test_an_owner_without_the_requirement_takes_both_a_name_and_its_capability_but_no_other(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Path
) -> None:
    client[db_name].items.insert_one({"_id": 2, "v": 2})
    with _start(server_uri) as owner:
        with CacheManager(client, shared=owner.name) as by_name:
            assert _hit(by_name, db_name, {"_id": 2, "v": 2})
        with CacheManager(client, shared=owner.connection) as by_capability:
            assert _hit(by_capability, db_name, {"_id": 2, "v": 2})
        with pytest.raises(SharedCacheError, match="capability does not match"):
            CacheManager(client, shared=SharedCacheConnection(owner.name, "f" * 64))
        # Without the requirement the arena is a file in the runtime directory.
        assert Path(paths_for(owner.name)["arena"]).exists()


def test_a_restarted_owner_keeps_its_capability_and_its_workers_reattach(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Path
) -> None:
    doc = {"_id": 3, "v": 3}
    client[db_name].items.insert_one(doc)
    with _start(server_uri, require_capability=True) as owner:
        connection = owner.connection
        with CacheManager(client, shared=connection) as manager:
            assert _hit(manager, db_name, doc)
            owner.restart()
            assert owner.connection == connection
            # Back on the new owner by itself, within the deadline.
            assert _hit(manager, db_name, doc)
            assert owner.snapshot()["attached_workers"] == 1


def test_the_connection_string_round_trips_and_hides_its_capability() -> None:
    connection = SharedCacheConnection("orders.v2", "ab" * 32)
    assert str(connection) == "cqc1:orders.v2:" + "ab" * 32
    assert SharedCacheConnection.parse(str(connection)) == connection
    assert pickle.loads(pickle.dumps(connection)) == connection
    assert "ab" * 32 not in repr(connection)
    assert connection != SharedCacheConnection("orders.v2", "cd" * 32)
    with pytest.raises(AttributeError):
        connection.name = "other"  # type: ignore[misc]
    for bad in ("orders.v2", "cqc1:orders.v2", "cqc1:orders.v2:xyz", "cqc1::" + "ab" * 32, "cqc1:a b:" + "ab" * 32):
        with pytest.raises(CacheConfigurationError) as exc:
            SharedCacheConnection.parse(bad)
        assert "ab" * 32 not in str(exc.value)
    with pytest.raises(CacheConfigurationError):
        SharedCacheConnection("orders", "AB" * 32)


def test_a_bad_connection_string_is_a_configuration_error(client: pymongo.MongoClient, runtime_dir: Path) -> None:
    with pytest.raises(CacheConfigurationError):
        CacheManager(client, shared="cqc1:orders:" + "z" * 64)
    with pytest.raises(CacheConfigurationError, match="require_capability"):
        SharedCache.start("orders", "mongodb://127.0.0.1:1/", require_capability="yes")  # type: ignore[arg-type]


def test_the_owner_takes_no_ring_that_its_worker_could_still_shrink(
    server_uri: str, client: pymongo.MongoClient, db_name: str, runtime_dir: Path
) -> None:
    # A raw client of the control protocol, as a worker that presents the
    # capability but hands over an unsealed ring: refused. (Shrunk under
    # the owner's mapping, a ring would kill the owner with SIGBUS.)
    with _start(server_uri, require_capability=True) as owner, socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(DEADLINE_S)
        sock.connect(paths_for(owner.name)["sock"])
        reader = LineReader(sock)
        send_message(sock, {"op": "info"})
        info = recv_message(reader)
        assert info is not None and info["capability_required"] is True
        for request in ({"op": "register", "db": db_name, "coll": "items"}, {"op": "snapshot"}, {"op": "stop"}):
            send_message(sock, request)
            reply = recv_message(reader)
            assert reply is not None and not reply["ok"] and "requires its capability" in reply["error"], request
        hello = {"op": "hello", "capability": owner.connection.capability, "pid": os.getpid(),
                 "deployment": owner_deployment(server_uri), "identity": None}  # fmt: skip
        send_message(sock, hello)
        reply = recv_message(reader)
        assert reply is not None and reply["ok"], reply
        (arena_fd,) = reader.fds
        reader.fds.clear()
        try:
            # Handed over read-only: no writable mapping can be made of it.
            flags = os.readlink(f"/proc/self/fd/{arena_fd}")
            assert "memfd:" in flags
            import mmap

            with pytest.raises(PermissionError):
                mmap.mmap(arena_fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(arena_fd)
        ring = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        try:
            os.ftruncate(ring, 2 * 1024 * 1024)
            send_message(sock, {"op": "ring"}, [ring])
        finally:
            os.close(ring)
        reply = recv_message(reader)
        assert reply is not None and not reply["ok"] and "sealed" in reply["error"], reply
        assert owner.snapshot()["attached_workers"] == 0


def owner_deployment(uri: str) -> dict[str, Any]:
    from client_query_cache._core.shared import deployment_of_uri

    return deployment_of_uri(uri)


# What runs as a process of the same user without privileges (as root in CI:
# every capability dropped, so that root's own powers do not stand in for a
# same-user process's): start an owner that requires its capability, then
# look for its arena where such a process could open it.
_PROBE = r"""
import json, os, subprocess, sys, time
from client_query_cache import SharedCache
uri, rt = sys.argv[1], sys.argv[2]
os.environ["CQC_RUNTIME_DIR"] = rt
out = {}
with SharedCache.start("probe", uri, require_capability=True) as owner:
    out["runtime_dir"] = sorted(os.listdir(rt))
    opened, refused = [], 0
    for fd in os.listdir(f"/proc/{owner.pid}/fd"):
        try:
            os.close(os.open(f"/proc/{owner.pid}/fd/{fd}", os.O_RDONLY))
            opened.append(fd)
        except OSError:
            refused += 1
    out["owner_fds_opened"], out["owner_fds_refused"] = opened, refused
    try:
        os.listdir(f"/proc/{owner.pid}/map_files")
        out["owner_map_files"] = "listed"
    except OSError as exc:
        out["owner_map_files"] = type(exc).__name__
    # The control: another process of this user, an ordinary one, whose
    # descriptors this one can open (so the refusals above are the owner's
    # doing, not this probe's lack of access to /proc).
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(30)", __file__ if "__file__" in globals() else sys.executable])
    try:
        time.sleep(1.0)
        try:
            for fd in os.listdir(f"/proc/{child.pid}/fd"):
                os.close(os.open(f"/proc/{child.pid}/fd/{fd}", os.O_RDONLY))
            out["control_opened"] = True
        except OSError as exc:
            out["control_opened"] = type(exc).__name__
    finally:
        child.kill()
        child.wait()
print(json.dumps(out))
"""

#: setpriv (util-linux): run as this uid with no capabilities, and without
#: root's regaining them on exec.
_NO_CAPS = [
    "setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all",
    "--securebits=+noroot,+noroot_locked,+no_setuid_fixup,+no_setuid_fixup_locked", "--",
]  # fmt: skip


def test_an_owner_that_requires_its_capability_leaves_no_path_to_its_arena(
    server_uri: str, tmp_path: Path
) -> None:
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    prefix = _NO_CAPS if os.geteuid() == 0 else []
    out = subprocess.run(
        [*prefix, sys.executable, "-c", _PROBE, server_uri, str(rt)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # The runtime directory holds the socket and the lock, nothing to map.
    assert seen["runtime_dir"] == ["probe.lock", "probe.sock"], seen
    # Under /proc, the owner's descriptors (its arena's memfd among them)
    # and its mappings are closed to the same user's other processes, whose
    # ordinary processes' descriptors are open to it.
    assert seen["control_opened"] is True, seen
    assert seen["owner_fds_opened"] == [] and seen["owner_fds_refused"] >= 3, seen
    assert seen["owner_map_files"] == "PermissionError", seen
