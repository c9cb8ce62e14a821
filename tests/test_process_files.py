"""Files a process of ours leaves on the host: mongo-c-driver's counters file
(``/dev/shm/mongoc-<pid>``), made at its init and removed only at a clean
exit, must never be made, so that no process killed or leaving through
``os._exit`` (a forked child, a worker killed by its server) leaves one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
