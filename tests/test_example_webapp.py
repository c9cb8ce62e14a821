"""The example web app (examples/webapp) run the way its README says:
``python -m examples.webapp``, which starts gunicorn (the shared cache's owner
in its master) with two sync workers, driven over HTTP like a user would.

The app runs against the session's server (``MONGODB_URI`` set to it, so it
also runs against a real deployment), in a database of this test
(``db_name``), with its own shared-cache name and runtime directory. Every
wait has a deadline; teardown kills whatever a failed test left running.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2

#: Longest the app may take to print its URL (gunicorn, the owner, the
#: workers and their change stream all start on a loaded 2-core machine).
START_TIMEOUT_S = 40.0
#: Longest a phase of reads may take to see what it waits for.
READ_DEADLINE_S = 15.0
#: Longest the app may take to stop after Ctrl-C.
STOP_TIMEOUT_S = 30.0
#: Concurrent requests: gunicorn's workers accept connections from one
#: socket, and concurrent requests are what spreads them over the workers.
CONCURRENCY = 4

_SERVING = re.compile(r"serving on (http://\S+) ")
# No proxy from the environment for requests to 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class Reply:
    """One answered read: when it started and ended (monotonic), and what
    the app said."""

    start: float
    end: float
    body: dict[str, Any]

    @property
    def pid(self) -> int:
        return int(self.body["pid"])

    @property
    def version(self) -> int:
        return int(self.body["item"]["version"])

    @property
    def hit(self) -> bool:
        return self.body["outcome"] == "hit"


class App:
    """``python -m examples.webapp`` in its own process group, as in a
    terminal; its output goes to files (read for the URL and on failure)."""

    def __init__(self, server_uri: str | None, database: str, runtime: Path, logs: Path) -> None:
        self.runtime = runtime
        self.cache_name = f"cqc-web-{uuid.uuid4().hex[:10]}"
        env = dict(os.environ, CQC_RUNTIME_DIR=str(runtime))
        env.pop("MONGODB_URI", None)
        if server_uri is not None:
            env["MONGODB_URI"] = server_uri
        self.stdout_path, self.stderr_path = logs / "stdout.txt", logs / "stderr.txt"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "examples.webapp",
                    "--workers", str(WORKERS), "--port", "0",
                    "--database", database, "--cache-name", self.cache_name,
                ],  # fmt: skip
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self.url = ""
        self.descendants: list[psutil.Process] = []

    def output(self) -> str:
        return (
            f"--- stdout\n{self.stdout_path.read_text(errors='replace')}"
            f"--- stderr\n{self.stderr_path.read_text(errors='replace')[-6000:]}"
        )

    def wait_serving(self) -> str:
        """Wait for the URL line; record every process the app started."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            match = _SERVING.search(self.stdout_path.read_text(errors="replace"))
            if match:
                self.url = match.group(1)
                break
            if self.process.poll() is not None:
                raise AssertionError(f"the app exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the app printed no URL within {START_TIMEOUT_S:g} s:\n{self.output()}")
            time.sleep(0.1)
        self.descendants = psutil.Process(self.process.pid).children(recursive=True)
        return self.url

    def processes(self) -> dict[str, list[psutil.Process]]:
        """The app's processes by role: gunicorn's master, its workers, the owner."""
        roles: dict[str, list[psutil.Process]] = {"master": [], "workers": [], "owner": [], "other": []}
        for proc in self.descendants:
            with contextlib.suppress(psutil.Error):
                cmdline = " ".join(proc.cmdline())
                if "client_query_cache.owner" in cmdline:
                    roles["owner"].append(proc)
                elif "gunicorn" in cmdline and proc.ppid() == self.process.pid:
                    roles["master"].append(proc)
                elif "gunicorn" in cmdline:
                    roles["workers"].append(proc)
                else:
                    roles["other"].append(proc)
        return roles

    # -- HTTP -----------------------------------------------------------------

    def get(self, path: str) -> dict[str, Any]:
        with _OPENER.open(self.url + path, timeout=10) as resp:
            return json.loads(resp.read())

    def put(self, path: str, fields: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(fields).encode(),
            method="PUT",
            headers={"Content-Type": "application/json"},
        )
        with _OPENER.open(req, timeout=10) as resp:
            return json.loads(resp.read())

    def read(self, path: str) -> Reply:
        start = time.monotonic()
        body = self.get(path)
        return Reply(start, time.monotonic(), body)

    def read_until(self, path: str, done: Any, what: str, timeout: float = READ_DEADLINE_S) -> list[Reply]:
        """Read ``path`` from CONCURRENCY threads until ``done(replies)`` is
        true; return every reply in order of completion."""
        replies: list[Reply] = []
        deadline = time.monotonic() + timeout
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            while not done(replies):
                if time.monotonic() > deadline:
                    summary = [(r.pid, r.body.get("outcome"), r.body.get("item")) for r in replies[-10:]]
                    raise AssertionError(
                        f"timed out after {timeout:g} s waiting until {what}; "
                        f"{len(replies)} replies, the last: {summary}"
                    )
                batch = [pool.submit(self.read, path) for _ in range(CONCURRENCY)]
                replies.extend(sorted((f.result() for f in batch), key=lambda r: r.end))
        return replies

    # -- stopping -------------------------------------------------------------

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the app's process group, as a terminal sends it;
        return the app's exit status."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the app did not stop within {STOP_TIMEOUT_S:g} s of Ctrl-C:\n{self.output()}") from None

    def _owners(self) -> list[psutil.Process]:
        """Owner processes of this app's runtime directory, wherever they
        ended up (an owner runs in a session of its own and outlives a
        killed master)."""
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if "client_query_cache.owner" in " ".join(proc.cmdline()) and (
                    proc.environ().get("CQC_RUNTIME_DIR") == str(self.runtime)
                ):
                    found.append(proc)
        return found

    def kill(self) -> None:
        """Teardown: SIGKILL whatever is left of the app."""
        with contextlib.suppress(psutil.Error):
            self.descendants += psutil.Process(self.process.pid).children(recursive=True)
        self.descendants += self._owners()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for proc in self.descendants:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.process.wait(10)
        psutil.wait_procs(self.descendants, timeout=10)


@pytest.fixture
def start_app(db_name: str, tmp_path: Path) -> Iterator[Any]:
    """Start the app (against ``uri``, or a server it starts itself when
    ``uri`` is None) and wait until it serves; killed at teardown."""
    apps: list[App] = []
    runtime = Path(tempfile.mkdtemp(prefix="cqc-rt-"))

    def start(uri: str | None) -> App:
        app = App(uri, db_name, runtime, tmp_path)
        apps.append(app)
        app.wait_serving()
        return app

    try:
        yield start
    finally:
        for app in apps:
            app.kill()
        shutil.rmtree(runtime, ignore_errors=True)


def assert_stops_cleanly(app: App) -> None:
    """Ctrl-C stops the app with status 0 and leaves no process of it and
    no shared-memory file of its cache behind."""
    roles = app.processes()
    assert len(roles["master"]) == 1 and len(roles["workers"]) >= WORKERS and len(roles["owner"]) == 1, (
        f"expected gunicorn's master, {WORKERS} workers and the owner, got {roles}"
    )
    status = app.interrupt()
    assert status == 0, f"the app exited with {status}:\n{app.output()}"
    assert app.stdout_path.read_text().rstrip().endswith("stopped"), app.output()
    gone, alive = psutil.wait_procs(app.descendants, timeout=10)
    assert not alive, f"left running after Ctrl-C: {alive}"
    left = sorted(p.name for p in app.runtime.glob(f"{app.cache_name}.*") if not p.name.endswith(".lock"))
    assert not left, f"shared-memory files left behind: {left}"


def _pids_with_hits(replies: list[Reply]) -> set[int]:
    return {r.pid for r in replies if r.hit}


def _stats_of_every_worker(app: App, worker_pids: set[int]) -> dict[int, dict[str, Any]]:
    replies = app.read_until(
        "/stats", lambda rs: {r.pid for r in rs} >= worker_pids, what="/stats answered from every worker"
    )
    return {r.pid: r.body for r in replies}  # the last answer of each worker


# =============================================================================


def test_repeated_reads_become_hits_in_every_worker(start_app, server_uri):
    app = start_app(server_uri)
    expected = {"_id": 1, "name": "item 1", "price": 10, "version": 1}

    replies = app.read_until(
        "/items/1",
        lambda rs: len(_pids_with_hits(rs)) >= WORKERS,
        what=f"reads of item 1 are hits in {WORKERS} workers",
    )

    # Reads sent one at a time after those: each starts after the first hit,
    # and after two stream rounds (the workers' max_await_time_ms is 1 s):
    # until a round has passed a worker's own reads, an entry another worker
    # admitted may be refused to it and read again (the causal floor,
    # docs/consistency.md).
    time.sleep(2.5)
    settled = time.monotonic()
    replies += [app.read("/items/1") for _ in range(2 * WORKERS)]

    assert all(r.body["item"] == expected for r in replies), [r.body for r in replies]
    worker_pids = {p.pid for p in app.processes()["workers"]}
    assert {r.pid for r in replies} <= worker_pids
    # Once the document is in the shared cache (and a stream round has
    # passed), every read is a hit, in whichever worker it lands.
    first_hit = min(r.end for r in replies if r.hit)
    later = [(r.pid, r.body["outcome"]) for r in replies if r.start > max(first_hit, settled)]
    assert later and all(outcome == "hit" for _, outcome in later), later
    # /stats agrees with what the responses said.
    stats = _stats_of_every_worker(app, worker_pids)
    for pid in worker_pids:
        hits = sum(1 for r in replies if r.pid == pid and r.hit)
        assert stats[pid]["hits"] >= hits, (stats[pid], hits)
        assert stats[pid]["entries"] >= 1, stats[pid]
        assert [s["state"] for s in stats[pid]["streams"]] == ["healthy"], stats[pid]

    assert_stops_cleanly(app)


def test_a_write_through_the_app_reaches_every_worker_and_is_never_undone(start_app, server_uri):
    app = start_app(server_uri)
    app.read_until(
        "/items/2", lambda rs: len(_pids_with_hits(rs)) >= WORKERS, what=f"item 2 is a hit in {WORKERS} workers"
    )
    app.read_until("/items", lambda rs: any(r.hit for r in rs), what="the list of items is a hit")
    worker_pids = {p.pid for p in app.processes()["workers"]}

    written = app.put("/items/2", {"price": 99})
    acknowledged = time.monotonic()
    assert written["item"] == {"_id": 2, "name": "item 2", "price": 99, "version": 2}

    # Within the deadline every worker serves the new version, from the cache
    # again (re-admitted after the invalidation)...
    replies = app.read_until(
        "/items/2",
        lambda rs: {r.pid for r in rs if r.version == 2 and r.hit} >= worker_pids,
        what="every worker serves version 2 from the cache",
    )
    # ...and keeps serving it.
    replies += app.read_until("/items/2", lambda rs: len(rs) >= 10 * CONCURRENCY, what="40 more reads")

    assert {r.version for r in replies} <= {1, 2}, [r.body for r in replies]
    assert {r.pid for r in replies} <= worker_pids
    # The old version may be read only until the invalidation reaches the
    # shared arena: once any worker has returned the new one, no read that
    # starts after that returns the old one, in any worker.
    first_new = min(r.end for r in replies if r.version == 2)
    stale = [
        (r.pid, round(r.start - first_new, 4), r.body["outcome"])
        for r in replies
        if r.version == 1 and r.start > first_new
    ]
    assert not stale, f"old version read after the new one was seen (pid, s after, outcome): {stale}"
    first_new_by_pid = {pid: min(r.end for r in replies if r.pid == pid and r.version == 2) - acknowledged for pid in worker_pids}
    assert max(first_new_by_pid.values()) < READ_DEADLINE_S, first_new_by_pid

    # The cached list of items (a query) was invalidated by the same write.
    listing = app.read_until(
        "/items",
        lambda rs: any(r.hit and r.body["items"][1]["price"] == 99 for r in rs),
        what="the list shows the new price from the cache",
    )
    first_new = min(r.end for r in listing if r.body["items"][1]["price"] == 99)
    assert not [r.body for r in listing if r.start > first_new and r.body["items"][1]["price"] != 99]

    assert_stops_cleanly(app)


def test_the_one_command_starts_and_stops_its_own_database(start_app):
    """Without MONGODB_URI the command starts a disposable SecantusDB, and
    Ctrl-C stops it together with gunicorn and the owner."""
    app = start_app(None)
    servers = [p for p in app.processes()["other"] if "secantusd" in " ".join(p.cmdline())]
    assert len(servers) == 1, app.processes()
    replies = app.read_until("/items/3", lambda rs: any(r.hit for r in rs), what="item 3 is a hit")
    assert replies[-1].body["item"] == {"_id": 3, "name": "item 3", "price": 30, "version": 1}

    assert_stops_cleanly(app)
