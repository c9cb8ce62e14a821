"""Run the example app: ``python -m examples.webapp [--workers N] [--port P]``.

Starts a disposable SecantusDB server (or uses ``MONGODB_URI`` when set),
seeds ``items`` 1-5 in the example database, starts gunicorn with the shared
cache's owner in its master and N sync workers, prints the URL once a worker
answers, and runs until Ctrl-C (SIGINT) or SIGTERM, which stop gunicorn (its
master stops the owner) and then the disposable server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pymongo import MongoClient

from client_query_cache.testing import disposable_uri

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the directory that holds the examples package
ITEMS = [{"_id": i, "name": f"item {i}", "price": 10 * i, "version": 1} for i in range(1, 6)]

#: Seconds to wait for the first worker to answer, and for gunicorn to stop.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def seed(uri: str, database: str) -> None:
    """Reset items 1-5 to version 1 (replaces them if they exist)."""
    with MongoClient(uri) as client:
        coll = client[database]["items"]
        for doc in ITEMS:
            coll.replace_one({"_id": doc["_id"]}, doc, upsert=True)


# Requests to the app go straight to it, whatever proxy the environment sets.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get_json(url: str) -> dict | None:
    try:
        with _OPENER.open(url, timeout=5) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def wait_until_serving(url: str, gunicorn: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until a worker answers ``/health`` with its stream ready.
    False if gunicorn exited or the time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if gunicorn.poll() is not None:
            return False
        answer = _get_json(url + "/health")
        if answer is not None and answer.get("ready"):
            return True
        time.sleep(0.2)
    return False


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    # The first signal starts the cleanup; later ones must not interrupt it
    # (every wait in it is bounded).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


@contextlib.contextmanager
def _signals(handler: object) -> Iterator[None]:
    """Handle SIGINT and SIGTERM with ``handler`` while the block runs."""
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_gunicorn(gunicorn: subprocess.Popen[bytes], signum: int) -> int:
    """Pass the signal on to gunicorn's master (SIGINT: quick, SIGTERM:
    graceful) and wait; SIGKILL after STOP_TIMEOUT_S. A Ctrl-C in the
    terminal has reached it already; a second signal is harmless."""
    if gunicorn.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            gunicorn.send_signal(signum)
        try:
            gunicorn.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print("gunicorn did not stop in time; killing it", file=sys.stderr)
            gunicorn.kill()
            gunicorn.wait()
    return gunicorn.returncode


def run(args: argparse.Namespace) -> int:
    signum = signal.SIGINT
    # Signals that arrive while the server starts unwind through the same
    # cleanup as those that arrive while it serves.
    with _signals(_raise_stop):
        try:
            with disposable_uri() as uri:
                where = "MONGODB_URI" if os.environ.get("MONGODB_URI") else f"a disposable SecantusDB at {uri}"
                print(f"database: {where}, database {args.database!r}", flush=True)
                seed(uri, args.database)
                port = args.port or _free_port(args.host)
                url = f"http://{args.host}:{port}"
                env = dict(os.environ, MONGODB_URI=uri, EXAMPLE_DB=args.database, EXAMPLE_CACHE=args.cache_name)
                gunicorn = subprocess.Popen(
                    [
                        sys.executable, "-m", "gunicorn",
                        "--config", str(HERE / "gunicorn.conf.py"),
                        "--chdir", str(ROOT),
                        "--bind", f"{args.host}:{port}",
                        "--workers", str(args.workers),
                        "examples.webapp.app:app",
                    ],  # fmt: skip
                    env=env,
                )
                try:
                    if not wait_until_serving(url, gunicorn, START_TIMEOUT_S):
                        print("the app did not start serving; stopping", file=sys.stderr, flush=True)
                        stop_gunicorn(gunicorn, signal.SIGTERM)
                        return 1
                    print(f"serving on {url} with {args.workers} workers (gunicorn master pid {gunicorn.pid})", flush=True)
                    print(f"  curl {url}/items/1            # repeat: 'cached' turns true, 'pid' varies", flush=True)
                    print(f"  curl -X PUT -H 'Content-Type: application/json' -d '{{\"price\": 99}}' {url}/items/1", flush=True)
                    print(f"  curl {url}/stats", flush=True)
                    print("Ctrl-C to stop", flush=True)
                    code = gunicorn.wait()
                    print(f"gunicorn exited with status {code}", file=sys.stderr, flush=True)
                    return code or 1  # it should not stop by itself
                except _Stop as stop:
                    signum = stop.signum
                    raise
                finally:
                    # Also reached by _Stop: stop gunicorn (its master stops
                    # the owner) before the database goes away, undisturbed
                    # by a second Ctrl-C (stop_gunicorn's wait is bounded).
                    with _signals(signal.SIG_IGN):
                        print("stopping", flush=True)
                        stop_gunicorn(gunicorn, signum)
        except _Stop:
            print("stopped", flush=True)
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.webapp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="gunicorn workers (default 2)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind, 0 for a free one (default 8000)")
    parser.add_argument("--database", default="cqc_example", help="database of the items (default cqc_example)")
    parser.add_argument("--cache-name", default="webapp-example", help="shared cache name (default webapp-example)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
