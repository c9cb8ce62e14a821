"""Files a process of ours leaves on the host: mongo-c-driver's counters file
(``/dev/shm/mongoc-<pid>``), made at its init and removed only at a clean
exit, must never be made, so that no process killed or leaving through
``os._exit`` (a forked child, a worker killed by its server) leaves one.
Whichever mongo-c-driver is linked: 1.x as Debian builds it makes the file
when the library is loaded, 2.x only at mongoc_init."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SHM = Path("/dev/shm")

# A process that makes a cache with change-stream followers (the libmongoc
# clients that would count) and leaves without cleaning up, as a killed
# worker does; it prints its pid and what the C environment held.
_CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    import pymongo
    from client_query_cache import CacheManager
    client = pymongo.MongoClient(sys.argv[1])
    manager = CacheManager(client)
    manager[sys.argv[2]]["items"].find_one({"_id": 1})
    manager.wait_ready(timeout=10)
    libc = ctypes.CDLL(None)
    libc.getenv.restype = ctypes.c_char_p
    print(os.getpid(), os.path.exists(f"/dev/shm/mongoc-{os.getpid()}"),
          libc.getenv(b"MONGOC_DISABLE_SHM"), flush=True)
    os._exit(0)
    """
)


def test_no_process_leaves_a_libmongoc_counters_file(server_uri: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MONGOC_DISABLE_SHM"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, server_uri, "cqc_test_process_files"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    ).stdout.split()
    pid, existed, env_value = int(out[0]), out[1], out[2]
    assert existed == "False"  # not made while it ran, with followers started
    assert not (SHM / f"mongoc-{pid}").exists()  # nor left after os._exit
    # The environment the application sees is left as it was.
    assert env_value == "None"


# Compares every counters file in /dev/shm before and after: with mongo-c-driver
# 1.x, any process of ours has one for the moment between loading the library
# and its init (csrc/cache.c), so the processes of tests running beside this
# one (pytest-xdist) would show up as new files.
@pytest.mark.serial
def test_a_forked_child_leaving_through_exit_leaves_no_counters_file() -> None:
    assert SHM.is_dir()
    before = {p.name for p in SHM.glob("mongoc-*")}
    child = textwrap.dedent(
        """
        import os, sys
        import client_query_cache._native  # mongo-c-driver's init
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    assert {p.name for p in SHM.glob("mongoc-*")} <= before


def test_a_counters_file_this_process_did_not_make_is_left_alone() -> None:
    # A file of that name that the process does not map belongs to another
    # process (another PID namespace sharing /dev/shm, say): not ours to remove.
    child = textwrap.dedent(
        """
        import os
        path = f"/dev/shm/mongoc-{os.getpid()}"
        with open(path, "x") as f:
            f.write("not mongo-c-driver's")
        try:
            import client_query_cache._native  # mongo-c-driver's init
            print(os.path.exists(path), open(path).read() == "not mongo-c-driver's")
        finally:
            os.unlink(path)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["True", "True"]
