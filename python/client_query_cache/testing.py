"""A disposable MongoDB-compatible server for tests and benchmarks.

MongoDB itself is not installable on the development and CI machines, so the
test suites and benchmarks run against SecantusDB (``secantusd-py``): a
MongoDB-compatible server that implements change streams and presents itself
as the primary of the one-member replica set ``secantus``.

This module is the one place that starts it. Everything else asks for a URI::

    with disposable_uri() as uri:      # MONGODB_URI, or a fresh local server
        client = pymongo.MongoClient(uri)

and tests that must stop or restart the server use :class:`DisposableServer`
directly (and skip themselves when ``MONGODB_URI`` names a real deployment).

Known limits of the server: it closes client connections that stay idle for
300 s (neither its CLI nor its config file can change that; PyMongo notices the
closed socket on its next checkout and opens a new one, and a change stream's
awaiting getMores keep its connection busy), read/write concerns are accepted
but not enforced, and resume tokens are not portable between two server
instances.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

__all__ = ["DisposableServer", "disposable_uri", "external_uri"]

#: The server listens on IPv4 loopback only.
HOST = "127.0.0.1"
#: Seconds to wait for the "listening on" line before giving up.
START_TIMEOUT_S = 60.0
#: Seconds between SIGTERM and SIGKILL when stopping.
STOP_TIMEOUT_S = 20.0
#: Seconds between the no-op entries the server appends to its oplog, as
#: mongod does every ``periodicNoopIntervalSecs`` (10 by default). Without
#: them a quiet server's change streams never move past the last event: a
#: cluster time minted after it (every ``hello`` mints one, and replies
#: carry the latest as ``operationTime``) would then never be reached.
NOOP_INTERVAL_S = 10.0

_READY_MARKER = "listening on"
_SERVER_SCRIPT = "secantusd-py"
# Lines of server output kept in memory for error messages.
_TAIL_LINES = 200
# The sanitizer run preloads ASan/UBSan into the test process. The server is
# a separate program that is not ours to instrument, so it must not inherit
# the preload.
_SCRUBBED_ENV = ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")


def external_uri() -> str | None:
    """Return ``MONGODB_URI`` when it names a deployment to test against."""
    return os.environ.get("MONGODB_URI") or None


@contextlib.contextmanager
def disposable_uri() -> Iterator[str]:
    """Yield a MongoDB URI for the duration of the block.

    With ``MONGODB_URI`` set, yield it unchanged and start nothing. Otherwise
    start a :class:`DisposableServer`, yield its URI, and remove it (process
    and storage) on exit.
    """
    uri = external_uri()
    if uri is not None:
        yield uri
        return
    with DisposableServer() as server:
        yield server.uri


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _server_command() -> list[str]:
    """How to run the server: the script installed beside this interpreter,
    else one on PATH, else the package's ``python -m secantus`` entry point."""
    beside = Path(sys.executable).parent / _SERVER_SCRIPT
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    on_path = shutil.which(_SERVER_SCRIPT)
    if on_path is not None:
        return [on_path]
    if importlib.util.find_spec("secantus") is None:
        raise RuntimeError(
            "the disposable server needs SecantusDB, which this environment lacks: "
            "pip install 'client-query-cache[test]'"
        )
    return [sys.executable, "-m", "secantus"]


# Arguments follow Python's convention (this module is no part of the cache):
# TypeError for a wrong type, ValueError for a value out of range, each
# naming the argument.


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number of seconds, got {value!r}")


def _check_path(name: str, value: object) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str, an os.PathLike or None, not {type(value).__name__}")


#: First starts on a picked port that another process took: how many ports
#: to try in all.
PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    """The server could not bind the port picked for it."""


def _free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class _OutputPump:
    """Drains the server's merged stdout/stderr on a daemon thread.

    A pipe nobody reads fills up and blocks the writer, so this thread reads
    until EOF for the whole life of the process: it keeps the last lines for
    error messages, copies everything to ``log`` when one is given (and owns
    it from then on), and signals ``ready`` once the server reports that it
    is listening.
    """

    def __init__(self, stream: IO[bytes], log: IO[str] | None) -> None:
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.ready_line = ""
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._lock = threading.Lock()
        self._stream = stream
        self._log = log
        self._thread = threading.Thread(
            target=self._run, name="secantus-output", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        log = self._log
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                with self._lock:
                    self._tail.append(line)
                if log is not None:
                    try:
                        log.write(line + "\n")
                        log.flush()
                    except OSError:  # a full disk must not stop the draining
                        log.close()
                        log = None
                if not self.ready.is_set() and _READY_MARKER in line:
                    self.ready_line = line
                    self.ready.set()
        finally:
            if log is not None:
                log.close()
            self._stream.close()
            self.finished.set()

    def tail(self) -> str:
        with self._lock:
            return "\n".join(self._tail)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class _Resources:
    """What a server holds that must be released even if ``close()`` is never
    called (the finalizer below runs at garbage collection or interpreter exit)."""

    __slots__ = ("proc", "pump", "temp_dirs")

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.pump: _OutputPump | None = None
        self.temp_dirs: list[str] = []


def _terminate(res: _Resources, timeout: float) -> None:
    """SIGTERM the process, wait up to ``timeout``, then SIGKILL. Idempotent."""
    proc, pump = res.proc, res.pump
    res.proc = res.pump = None
    if proc is not None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if pump is not None:
        # The process is gone, so the pipe reaches EOF promptly.
        pump.join(timeout=5.0)


def _release(res: _Resources) -> None:
    _terminate(res, STOP_TIMEOUT_S)
    for path in res.temp_dirs:
        shutil.rmtree(path, ignore_errors=True)
    res.temp_dirs.clear()


# --------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------


class DisposableServer:
    """One ``secantusd-py`` process on 127.0.0.1, started and stopped at will.

    ``storage_path=None`` uses a fresh temporary directory that ``close()``
    removes; a given path is created if missing and never removed. The port
    (given, or picked once at construction) and the storage path stay the
    same across ``stop()``/``start()``/``restart()``, so a client built from
    ``uri`` reconnects to the restarted server and finds its data.
    Like mongod, the server appends a no-op to its oplog every
    ``noop_interval_seconds`` (0 turns that off).
    """

    def __init__(
        self,
        *,
        storage_path: str | os.PathLike[str] | None = None,
        port: int | None = None,
        oplog_retention_seconds: float | None = None,
        oplog_max_entries: int | None = None,
        noop_interval_seconds: float = NOOP_INTERVAL_S,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        # Checked before anything is created: nothing to clean up on error.
        _check_path("storage_path", storage_path)
        _check_path("log_path", log_path)
        if port is not None:
            _check_int("port", port, 1, 65535)
        if oplog_retention_seconds is not None:
            _check_seconds("oplog_retention_seconds", oplog_retention_seconds)
        if oplog_max_entries is not None:
            _check_int("oplog_max_entries", oplog_max_entries, 1, 2**63 - 1)
        _check_seconds("noop_interval_seconds", noop_interval_seconds)
        if isinstance(extra_args, (str, bytes)) or not isinstance(extra_args, Sequence):
            raise TypeError(f"extra_args must be a sequence of str, not {type(extra_args).__name__}")
        if not all(isinstance(arg, str) for arg in extra_args):
            raise TypeError("extra_args must be a sequence of str")
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _release, self._res)
        self._closed = False
        if storage_path is None:
            storage_path = tempfile.mkdtemp(prefix="cqc-secantus-data-")
            self._res.temp_dirs.append(storage_path)
        self._storage_path = os.fspath(storage_path)
        self._port = port if port is not None else _free_port()
        # A port picked here may be taken by another process before the
        # server binds it: the first start then tries another (restarts keep
        # the port the server has had).
        self._port_picked = port is None
        self._started = False
        self._oplog_retention_seconds = oplog_retention_seconds
        self._oplog_max_entries = oplog_max_entries
        self._noop_interval_seconds = noop_interval_seconds
        self._log_path = os.fspath(log_path) if log_path is not None else None
        # More command-line flags, e.g. ("--enable-test-commands",) for tests
        # that arm failpoints with configureFailPoint.
        self._extra_args = tuple(extra_args)
        # The server reads ./secantusd.toml, ~/.secantus/ and /etc/secantus/
        # unless given a config file. Run it from a private directory with an
        # empty config so a stray file on the machine cannot change it.
        self._run_dir = tempfile.mkdtemp(prefix="cqc-secantus-run-")
        self._res.temp_dirs.append(self._run_dir)
        self._config_path = os.path.join(self._run_dir, "secantusd.toml")
        Path(self._config_path).write_text("# defaults only\n", encoding="utf-8")

    # -- properties ----------------------------------------------------------

    @property
    def uri(self) -> str:
        return f"mongodb://{HOST}:{self._port}/?directConnection=true"

    @property
    def port(self) -> int:
        return self._port

    @property
    def storage_path(self) -> str:
        return self._storage_path

    @property
    def pid(self) -> int | None:
        """The server's process id while it is running, else None."""
        proc = self._res.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        proc = self._res.proc
        return proc is not None and proc.poll() is None

    # -- lifecycle -----------------------------------------------------------

    def _command(self) -> list[str]:
        cmd = _server_command() + [
            "--config", self._config_path,
            "--host", HOST,
            "--port", str(self._port),
            "--storage-path", self._storage_path,
            "--log-level", "INFO",
        ]  # fmt: skip
        if self._oplog_retention_seconds is not None:
            cmd += ["--oplog-retention-seconds", str(self._oplog_retention_seconds)]
        if self._oplog_max_entries is not None:
            cmd += ["--oplog-max-entries", str(self._oplog_max_entries)]
        if self._noop_interval_seconds > 0:
            cmd += ["--noop-heartbeat-seconds", repr(float(self._noop_interval_seconds))]
        return cmd + list(self._extra_args)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the server and return once it accepts connections.

        Raises RuntimeError, with the server's output, if it exits early or
        does not report that it is listening within ``timeout`` seconds. On
        a port it picked itself, a first start that finds the port taken by
        another process (between the pick and the server's bind) tries
        another port, up to PORT_ATTEMPTS times in all.
        """
        _check_seconds("timeout", timeout)
        if self._closed:
            raise RuntimeError("DisposableServer is closed")
        if self.running:
            raise RuntimeError(f"server already running (pid {self.pid})")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                self._start_once(timeout)
            except _PortTaken:
                if attempt == PORT_ATTEMPTS:
                    raise
                self._port = _free_port()
                continue
            self._started = True
            return

    def _start_once(self, timeout: float) -> None:
        _terminate(self._res, 0)  # reap a process that died on its own
        env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        cmd = self._command()
        # Opened here so that a bad log path raises to the caller.
        log = open(self._log_path, "a", encoding="utf-8") if self._log_path else None
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=self._run_dir,
            env=env,
        )
        assert proc.stdout is not None
        pump = _OutputPump(proc.stdout, log)
        self._res.proc, self._res.pump = proc, pump

        # Wait for the ready line, an early exit, or the deadline.
        problem = None
        deadline = time.monotonic() + timeout
        while not pump.ready.wait(0.05):
            if proc.poll() is not None:
                pump.finished.wait(1.0)  # let the last lines arrive
                if not pump.ready.is_set():
                    problem = f"exited with status {proc.returncode} before listening"
                break
            if time.monotonic() > deadline:
                problem = f"did not report listening within {timeout:g} s"
                break
        if problem is None and not pump.ready_line.endswith(f"{HOST}:{self._port}"):
            problem = f"listens on an unexpected address: {pump.ready_line!r}"
        if problem is not None:
            _terminate(self._res, 5.0)
            error = _PortTaken if self._port_taken(pump.tail()) else RuntimeError
            raise error(
                f"SecantusDB server {problem}.\n"
                f"command: {' '.join(cmd)}\n"
                f"output:\n{pump.tail() or '(none)'}"
            )

    def _port_taken(self, output: str) -> bool:
        """Whether a failed first start found its picked port in use."""
        return self._port_picked and not self._started and "Address already in use" in output

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout`` s. Idempotent."""
        _check_seconds("timeout", timeout)
        _terminate(self._res, timeout)

    def restart(self) -> None:
        """Stop, then start again on the same port and storage (outage tests)."""
        if self._storage_path == ":memory:":
            raise RuntimeError("restart() needs on-disk storage, not ':memory:'")
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove the temporary directories. Idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> DisposableServer:
        if not self.running:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<DisposableServer {HOST}:{self._port} {state}>"
