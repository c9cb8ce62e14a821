"""The shared cache's owner process.

    python -m client_query_cache.owner  reads its JSON
                                        configuration (connection string
                                        included) from stdin, so credentials
                                        never appear on a command line

The owner creates the arena in shared memory, follows one change stream per
database that any worker uses, drains the workers' admission rings (a C
thread), publishes a heartbeat, and answers control requests. Workers attach
with ``CacheManager(client, shared=name)``; ``SharedCache.start()`` starts
this process and waits until it serves.
"""

from __future__ import annotations

# Deliberately lean: no PyMongo, no bson, no facade, not even typing or
# pathlib, and C modules in place of signal, socket, threading and json
# (whose Python layers, with the enum and re modules they pull in, are
# about 2 MiB). The owner's private memory is overhead the shared cache must
# earn back (docs/deployment.md).
import _signal
import _socket
import _thread
import fcntl
import os
import sys
import time

from . import TYPE_CHECKING, _native
from ._core.errors import CacheClosedError, CacheForkedError
from ._core.shared import (
    LineReader,
    SharedCacheError,
    capability_matches,
    decode_message,
    encode_message,
    identity_mismatch,
    paths_for,
    ring_bytes_for,
    peer_uid,
    recv_message,
    same_deployment,
    send_message,
    validate_name,
)

if TYPE_CHECKING:
    from typing import Any

__all__ = ["main"]

#: Workers consider the owner gone once its heartbeat (published every
#: 100 ms by a C thread that never waits for the GIL) is this old.
HEARTBEAT_TIMEOUT_MS = 500


# ============================================================================
# The owner process
# ============================================================================


class _Owner:
    def __init__(self, config: dict[str, Any]) -> None:
        self.name = validate_name(config["name"])
        self.uri = config["uri"]
        deployment = config["deployment"]
        if not isinstance(deployment, dict) or not isinstance(deployment.get("hosts"), list):
            raise ValueError("the configuration lacks the deployment's hosts")
        self.deployment = deployment
        # The MongoDB identity of the connection string (shared.py): a worker
        # whose client authenticates otherwise may not read the arena.
        identity, salt = config["identity"], config["identity_salt"]
        if identity is not None and not (
            isinstance(identity, dict) and {"mechanism", "source", "user", "proof"} <= identity.keys()
        ):
            raise ValueError("the configuration's identity is not valid")
        if not isinstance(salt, str) or len(salt) != 32:
            raise ValueError("the configuration lacks the identity's salt")
        self.identity = identity
        self.identity_salt = salt
        #: The capability of SharedCache.connection; with require_capability
        #: every worker must present it, and the arena is a memfd handed
        #: over the control socket (no file of it in the runtime directory).
        capability, required = config.get("capability"), config.get("require_capability", False)
        if not isinstance(capability, str) or len(capability) != 64 or not isinstance(required, bool):
            raise ValueError("the configuration's capability is not valid")
        self.capability = capability
        self.require_capability = required
        #: The namespaces workers registered, at most max_namespaces (None:
        #: the arena's table is the only limit).
        limit = config.get("max_namespaces")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError("the configuration's max_namespaces is not valid")
        self.max_namespaces = limit
        self.namespaces: set[tuple[str, str]] = set()
        self.max_entry_bytes = int(config["max_entry_bytes"])
        self.max_await_time_ms = int(config["max_await_time_ms"])
        self.paths = paths_for(self.name, create=True)
        self.started = time.monotonic()
        #: Set by a stop request or SIGTERM/SIGINT; serve() looks every 0.2 s.
        self.stopping = False
        self.lock = _thread.allocate_lock()
        self.workers = 0
        idle = config.get("idle_exit_seconds")
        self.idle_exit = None if idle is None else float(idle)
        self.idle_since = time.monotonic()
        self._lock_fd = os.open(self.paths["lock"], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SharedCacheError(f"an owner of {self.name!r} is already running") from None
        # Holding the lock: whatever files are left are a dead owner's.
        _unlink(self.paths["arena"], self.paths["sock"])
        self.arena_fd = self.arena_ro_fd = -1
        if required:
            self.arena_fd = os.memfd_create(f"cqc-{self.name}.arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.native = _native.Cache.owner(
            budget_bytes=int(config["budget_bytes"]),
            slot_count=int(config["slots"]),
            uri=self.uri,
            max_await_time_ms=self.max_await_time_ms,
            arena_path=None if required else self.paths["arena"],
            arena_fd=self.arena_fd,
            closed_error=CacheClosedError,
            forked_error=CacheForkedError,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
            arena_bytes=int(config.get("arena_bytes") or 0),
            # The platform's trust store, resolved by SharedCache.start
            # (_core/trust.py): for a URI with TLS on and no tlsCAFile.
            tls_ca_file=config.get("tls_ca_file"),
            tls_ca_dir=config.get("tls_ca_dir"),
            tls_crl_file=config.get("tls_crl_file"),
            stream_scope=1 if config.get("stream_scope") == "database" else 0,
        )
        if required:
            # Workers get a read-only descriptor of their own (a mapping of
            # it cannot be made writable); nobody can shrink or grow it.
            fcntl.fcntl(
                self.arena_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            self.arena_ro_fd = os.open(f"/proc/self/fd/{self.arena_fd}", os.O_RDONLY | os.O_CLOEXEC)
            # /proc/<pid>/fd, its memory and ptrace: closed to this user's
            # other processes, which could otherwise open the memfd there.
            _native.undumpable()
        old = os.umask(0o177)
        try:
            self.server = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
            self.server.bind(self.paths["sock"])
        finally:
            os.umask(old)
        self.server.listen(64)

    # -- requests -------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        stats = self.native.stats()
        streams = self.native.streams()
        return {
            "arena_bytes": stats["arena_bytes"],
            "used_bytes": stats["used_bytes"],
            "budget_bytes": stats["budget_bytes"],
            "entries": stats["entries"],
            "evictions": stats["evictions"],
            "live_bytes": stats["live_bytes"],
            "dead_bytes": stats["dead_bytes"],
            **{k: stats[k] for k in ("promotions", "reinsertions", "forced_evictions", "ghost_hits")},
            "reclaimed": stats["dead_reclaimed"],
            "invalidations": stats["invalidations"],
            "admissions_accepted": stats["admissions"],
            "admissions_rejected": {
                "stale": stats["rejected_stale"],
                "unhealthy": stats["rejected_unhealthy"],
                "too_large": stats["rejected_too_large"],
                "no_slot": stats["rejected_no_slot"],
                "conflict": stats["rejected_conflict"],
            },
            "admissions_dropped": stats["ring_dropped"],
            "attached_workers": stats["attached_rings"],
            "namespaces": len(self.namespaces),
            "max_namespaces": self.max_namespaces,
            "active_streams": sum(1 for s in streams if s["state"] not in ("closed", "not_started")),
            "streams": [
                {
                    **{k: s[k] for k in ("database", "state", "events", "reconnects", "history_lost")},
                    **{k: s[k] for k in ("getmores", "event_bytes", "invalidations")},
                    "lag_samples": s["lag"][0],
                    "lag_p50_ms": s["lag"][1] if s["lag"][0] else None,
                    "lag_p95_ms": s["lag"][2] if s["lag"][0] else None,
                    "lag_max_ms": s["lag"][3] if s["lag"][0] else None,
                    "last_error": s["last_error"],
                    "scope": s["scope"][0] if "scope" in s else None,
                    "scope_reason": s["scope"][1] if "scope" in s else None,
                }
                for s in streams
            ],
            "owner_pid": os.getpid(),
            "owner_uptime_s": time.monotonic() - self.started,
        }

    def _check_capability(self, msg: dict[str, Any]) -> None:
        """Refuse a request without this owner's capability where one is
        required, and one with another capability anywhere."""
        given = msg.get("capability")
        if given is None and not self.require_capability:
            return
        if not capability_matches(given, self.capability):
            raise SharedCacheError(
                f"refused: shared cache {self.name!r} requires its capability (SharedCache.connection)"
                if given is None
                else f"refused: the capability does not match shared cache {self.name!r}'s"
            )

    def handle(self, conn: _socket.socket) -> None:
        ring_id = 0
        #: Whether a hello with the capability passed on this connection
        #: (what a worker's later requests need where one is required).
        trusted = not self.require_capability
        try:
            if peer_uid(conn) != os.getuid():
                return  # another user: say nothing
            reader = LineReader(conn)
            while True:
                try:
                    msg = recv_message(reader)
                except (OSError, ValueError):
                    break
                if msg is None:
                    break
                op = msg.get("op")
                fds: list[int] = []
                try:
                    if op not in ("info", "hello") and not trusted:
                        self._check_capability(msg)
                    if op == "info":
                        reply = {
                            "ok": True,
                            "max_entry_bytes": self.max_entry_bytes,
                            "ring_bytes": ring_bytes_for(self.max_entry_bytes),
                            "identity_salt": self.identity_salt,
                            "capability_required": self.require_capability,
                        }
                    elif op == "hello":
                        self._check_capability(msg)
                        if not same_deployment(msg.get("deployment") or {}, self.deployment):
                            raise SharedCacheError(
                                "the worker's client and the owner follow different deployments"
                            )
                        refused = identity_mismatch(msg.get("identity"), self.identity)
                        if refused:
                            raise SharedCacheError(f"refused to attach to {self.name!r}: {refused}")
                        if ring_id:
                            raise SharedCacheError("already attached")
                        reply = {
                            "ok": True,
                            "geometry": self.native.geometry(),
                            "max_entry_bytes": self.max_entry_bytes,
                            "max_await_time_ms": self.max_await_time_ms,
                        }
                        if self.require_capability:
                            # The arena's descriptor; the ring's comes back
                            # with the worker's "ring" request.
                            trusted = True
                            fds = [self.arena_ro_fd]
                        else:
                            ring_id = self._attach(str(msg["segment"]))
                            reply["arena"] = self.paths["arena"]
                    elif op == "ring":
                        if not self.require_capability or ring_id:
                            raise SharedCacheError("unexpected ring")
                        fd = reader.take_fd()
                        if fd is None:
                            raise SharedCacheError("the ring's descriptor did not come with the request")
                        try:
                            ring_id = self._attach(fd)
                        finally:
                            os.close(fd)
                        reply = {"ok": True}
                    elif op == "register":
                        key = (str(msg["db"]), str(msg["coll"]))
                        with self.lock:
                            limited = (
                                self.max_namespaces is not None
                                and key not in self.namespaces
                                and len(self.namespaces) >= self.max_namespaces
                            )
                        if limited:
                            reply = {"ok": True, "limited": True}
                        else:
                            ns_idx, db_idx = self.native.register(*key)
                            with self.lock:
                                self.namespaces.add(key)
                            reply = {"ok": True, "ns_idx": ns_idx, "db_idx": db_idx}
                    elif op == "snapshot":
                        reply = {"ok": True, "snapshot": self.snapshot()}
                    elif op == "stop":
                        send_message(conn, {"ok": True})
                        self.stopping = True
                        break
                    else:
                        raise SharedCacheError(f"unknown request {op!r}")
                except (SharedCacheError, ValueError, KeyError, RuntimeError, TypeError) as exc:
                    reply = {"ok": False, "error": str(exc)}
                    fds = []
                finally:
                    reader.close_fds()  # any nobody asked for
                send_message(conn, reply, fds)
        except OSError:
            pass
        finally:
            if ring_id:
                self.native.detach_ring(ring_id)
                with self.lock:
                    self.workers -= 1
                    if self.workers == 0:
                        self.idle_since = time.monotonic()
            conn.close()

    def _attach(self, ring: str | int) -> int:
        ring_id = self.native.attach_ring(ring)
        with self.lock:
            self.workers += 1
        return ring_id

    # -- lifecycle ------------------------------------------------------------

    def serve(self) -> None:
        self.server.settimeout(0.2)
        while not self.stopping:
            try:
                fd, _ = self.server._accept()
            except TimeoutError:
                if self.idle_exit is not None:
                    with self.lock:
                        idle = self.workers == 0 and time.monotonic() - self.idle_since > self.idle_exit
                    if idle:
                        break
                continue
            except OSError:
                break
            conn = _socket.socket(fileno=fd)
            conn.settimeout(None)
            _thread.start_new_thread(self.handle, (conn,))

    def close(self) -> None:
        self.server.close()
        _unlink(self.paths["sock"], self.paths["arena"])
        self.native.close()
        for fd in (self.arena_ro_fd, self.arena_fd):
            if fd >= 0:
                os.close(fd)
        os.close(self._lock_fd)


def _unlink(*paths: str) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _tell_starter(message: dict[str, Any]) -> None:
    sys.stdout.buffer.write(encode_message(message))
    sys.stdout.buffer.flush()


def main() -> int:
    try:
        config = decode_message(sys.stdin.readline())
        owner = _Owner(config)
    except Exception as exc:  # reported to the starter, which raises it
        message = f"{type(exc).__name__}: {exc}"
        uri = config.get("uri") if isinstance(locals().get("config"), dict) else None
        if isinstance(uri, str) and uri and (uri in message or "@" in message):
            message = "invalid configuration (the message could reveal the connection string)"
        _tell_starter({"ready": False, "error": message})
        return 3

    def stop(*_: object) -> None:
        owner.stopping = True

    _signal.signal(_signal.SIGTERM, stop)
    _signal.signal(_signal.SIGINT, stop)
    _tell_starter({"ready": True, "pid": os.getpid()})
    # The starter stops reading after the ready line.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    try:
        owner.serve()
    finally:
        owner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
