"""SharedCache: the handle that starts and stops a shared cache's owner
process (``python -m client_query_cache.owner``) and asks it for statistics."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from .config import (
    MiB,
    check_max_namespaces,
    check_owner_options,
    check_seconds,
    check_stream_scope,
    default_slot_count,
)
from .errors import CacheConfigurationError
from .shared import (
    OwnerLink,
    SharedCacheConnection,
    SharedCacheError,
    deployment_of_uri,
    identity_of_uri,
    identity_proof,
    new_capability,
    paths_for,
    peer_uid,
    recv_message,
    send_message,
    validate_name,
)
from .trust import platform_trust
from .uri import crl_file_in

__all__ = ["SharedCache", "SharedCacheConfig", "attach_or_start"]


class SharedCache:
    """Handle of a running owner process (``start()`` returns one)."""

    def __init__(
        self, name: str, process: subprocess.Popen[bytes] | None, pid: int, capability: str | None = None
    ) -> None:
        self.name = name
        self._process = process
        self.pid = pid
        self._capability = capability
        #: start()'s arguments, for restart() (None: a handle not made by
        #: start(), which cannot restart its owner).
        self._started: tuple[str, dict[str, Any]] | None = None

    @classmethod
    def start(
        cls,
        name: str,
        uri: str,
        *,
        arena_bytes: int | None = None,
        budget_bytes: int = 32 * MiB,
        slots: int | None = None,
        max_entry_bytes: int = 1 * MiB,
        max_await_time_ms: int = 1000,
        idle_exit_seconds: float | None = None,
        ready_timeout: float = 60.0,
        max_namespaces: int | None = None,
        stream_scope: str = "deployment",
        require_capability: bool = False,
    ) -> SharedCache:
        """Start the owner of shared cache ``name`` for the deployment at
        ``uri``, and return once it accepts workers. With
        ``idle_exit_seconds``, the owner exits that long after its last
        worker detached (how auto-started owners end). The owner gets a new
        random capability (``connection``); with ``require_capability``, a
        worker attaches only with it, and the arena is no file (see
        docs/deployment.md)."""
        return cls._start(
            name, uri, new_capability(), arena_bytes=arena_bytes, budget_bytes=budget_bytes, slots=slots,
            max_entry_bytes=max_entry_bytes, max_await_time_ms=max_await_time_ms,
            idle_exit_seconds=idle_exit_seconds, ready_timeout=ready_timeout, max_namespaces=max_namespaces,
            stream_scope=stream_scope, require_capability=require_capability,
        )  # fmt: skip

    @classmethod
    def _start(
        cls,
        name: str,
        uri: str,
        capability: str,
        *,
        arena_bytes: int | None,
        budget_bytes: int,
        slots: int | None,
        max_entry_bytes: int,
        max_await_time_ms: int,
        idle_exit_seconds: float | None,
        ready_timeout: float,
        max_namespaces: int | None,
        stream_scope: str,
        require_capability: bool,
    ) -> SharedCache:
        """start() with the owner's capability given (restart keeps it)."""
        # Every argument is checked before the owner process exists: a
        # late error would leave it running and holding the name.
        validate_name(name)
        if not isinstance(uri, str) or not uri.startswith(("mongodb://", "mongodb+srv://")):
            raise CacheConfigurationError("uri must be a 'mongodb://' or 'mongodb+srv://' connection string")
        check_owner_options(
            arena_bytes=arena_bytes,
            budget_bytes=budget_bytes,
            slots=slots,
            max_entry_bytes=max_entry_bytes,
            max_await_time_ms=max_await_time_ms,
        )
        check_max_namespaces("max_namespaces", max_namespaces)
        check_stream_scope("stream_scope", stream_scope)
        if not isinstance(require_capability, bool):
            raise CacheConfigurationError(
                f"require_capability must be a bool, not {type(require_capability).__name__}"
            )
        if idle_exit_seconds is not None:
            idle_exit_seconds = check_seconds("idle_exit_seconds", idle_exit_seconds)
        ready_timeout = check_seconds("ready_timeout", ready_timeout)
        try:
            # Parsed here, not in the owner: the owner does not import PyMongo
            # (its memory counts against the cache's saving).
            deployment = deployment_of_uri(uri)
            # The identity the owner's connection string authenticates as,
            # its password kept only as a proof under a salt of this owner.
            salt = os.urandom(16).hex()
            identity = identity_proof(identity_of_uri(uri), salt)
        except Exception:
            # The parser's message could quote the connection string.
            raise CacheConfigurationError("uri is not a valid MongoDB connection string") from None
        # Resolved here too, so the owner need not import ssl (trust.py).
        trust = platform_trust()
        config = {
            "name": name,
            "uri": uri,
            "deployment": deployment,
            "identity": identity,
            "identity_salt": salt,
            "capability": capability,
            "require_capability": require_capability,
            "max_namespaces": max_namespaces,
            "stream_scope": stream_scope,
            "arena_bytes": arena_bytes or 0,
            "budget_bytes": budget_bytes,
            "slots": slots if slots is not None else default_slot_count(budget_bytes),
            "max_entry_bytes": max_entry_bytes,
            "max_await_time_ms": max_await_time_ms,
            "idle_exit_seconds": idle_exit_seconds,
            "tls_ca_file": trust.ca_file,
            "tls_ca_dir": trust.ca_dir,
            "tls_crl_file": crl_file_in(uri),
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "client_query_cache.owner"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(json.dumps(config).encode() + b"\n")
        process.stdin.close()
        ready: dict[str, Any] = {}

        def read_ready() -> None:
            assert process.stdout is not None
            line = process.stdout.readline()
            with contextlib.suppress(ValueError):
                ready.update(json.loads(line))

        reader = threading.Thread(target=read_ready, daemon=True)
        reader.start()
        reader.join(ready_timeout)
        if not ready.get("ready"):
            process.kill()
            process.wait()
            reader.join()  # the pipe is at its end now
            process.stdout.close()
            raise SharedCacheError(
                f"the owner of {name!r} did not start: {ready.get('error', 'no answer')}"
            )
        process.stdout.close()  # the owner writes nothing after its ready line
        handle = cls(name, process, int(ready["pid"]), capability)
        handle._started = (
            uri,
            {
                "arena_bytes": arena_bytes, "budget_bytes": budget_bytes, "slots": slots,
                "max_entry_bytes": max_entry_bytes, "max_await_time_ms": max_await_time_ms,
                "idle_exit_seconds": idle_exit_seconds, "ready_timeout": ready_timeout,
                "max_namespaces": max_namespaces, "stream_scope": stream_scope,
                "require_capability": require_capability,
            },
        )  # fmt: skip
        return handle

    @property
    def connection(self) -> SharedCacheConnection:
        """The name and capability a worker attaches with:
        ``CacheManager(client, shared=owner.connection)`` (picklable; its
        ``str()`` is the same for an environment variable)."""
        if self._capability is None:
            raise SharedCacheError(f"this handle of {self.name!r} was not returned by SharedCache.start()")
        return SharedCacheConnection(self.name, self._capability)

    def _request(self, op: str) -> dict[str, Any]:
        path = paths_for(self.name)["sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30.0)
            sock.connect(path)
            if peer_uid(sock) != os.getuid():
                raise SharedCacheError("the owner runs as another user")
            message = {"op": op}
            if self._capability is not None:
                message["capability"] = self._capability
            send_message(sock, message)
            with sock.makefile("rb") as reader:
                try:
                    reply = recv_message(reader)
                except ValueError:
                    raise SharedCacheError(
                        f"the owner of {self.name!r} answered {op!r} with something that is not a control message"
                    ) from None
        if not reply or not reply.get("ok"):
            raise SharedCacheError(f"the owner refused {op!r}")
        return reply

    def snapshot(self) -> dict[str, Any]:
        """Group statistics: arena bytes, entries, evictions, invalidations,
        admissions, attached workers, active streams, owner uptime."""
        snapshot = self._request("snapshot").get("snapshot")
        if not isinstance(snapshot, dict):
            raise SharedCacheError(f"the owner of {self.name!r} answered 'snapshot' without a snapshot")
        return dict(snapshot)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the owner; workers fall back to MongoDB until one runs again."""
        timeout = check_seconds("timeout", timeout)
        if self._process is not None and self._process.poll() is not None:
            return
        with contextlib.suppress(OSError, SharedCacheError):
            self._request("stop")
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def restart(self, timeout: float = 30.0) -> None:
        """Replace the owner with a fresh one of the same name and options
        (an empty arena, new streams): the old one is stopped as ``stop()``
        does, then one is started as ``start()`` did. Workers bypass
        (``owner_unavailable``) from the moment they see the old owner gone
        until they have re-attached to the new one, by themselves, within
        about a second of it accepting workers; no entry of the old arena
        is served after that. Raises ``SharedCacheError`` if this handle was
        not made by ``start()`` or the new owner does not start (the old one
        is stopped either way)."""
        if self._started is None:
            raise SharedCacheError(f"this handle of {self.name!r} did not start its owner: it cannot restart it")
        uri, options = self._started
        self.stop(timeout)
        # The same capability: the workers' connection stays good.
        assert self._capability is not None
        fresh = type(self)._start(self.name, uri, self._capability, **options)
        self._process, self.pid = fresh._process, fresh.pid

    def __enter__(self) -> SharedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclasses.dataclass(frozen=True, slots=True)
class SharedCacheConfig:
    """``CacheManager(client, shared=SharedCacheConfig(name, start_owner=True))``
    attaches to the owner of ``name``, starting one first if none runs (for
    ``uvicorn --workers`` and other servers without a master hook). Concurrent
    workers start exactly one owner: starters serialize on a lock file, and an
    owner holds its own lock for its life. An owner started this way exits
    ``grace_seconds`` after its last worker detached.

    ``uri`` defaults to the connection string derived from the worker's
    client. The geometry options are the owner's (see ``SharedCache.start``).
    """

    name: str
    start_owner: bool = False
    uri: str | None = None
    arena_bytes: int | None = None
    budget_bytes: int = 32 * MiB
    slots: int | None = None
    max_entry_bytes: int = 1 * MiB
    max_await_time_ms: int = 1000
    grace_seconds: float = 5.0
    max_namespaces: int | None = None
    stream_scope: str = "deployment"

    def __post_init__(self) -> None:
        validate_name(self.name)
        check_max_namespaces("SharedCacheConfig.max_namespaces", self.max_namespaces)
        check_stream_scope("SharedCacheConfig.stream_scope", self.stream_scope)
        if not isinstance(self.start_owner, bool):
            raise CacheConfigurationError("start_owner must be a bool")
        if isinstance(self.grace_seconds, bool) or not isinstance(self.grace_seconds, (int, float)) or self.grace_seconds < 0:
            raise CacheConfigurationError("grace_seconds must be a non-negative number")


def attach_or_start(config: SharedCacheConfig, derived_uri: str) -> OwnerLink:
    """Connect to the owner of ``config.name``, starting it if allowed."""
    try:
        return OwnerLink(config.name)
    except SharedCacheError:
        if not config.start_owner:
            raise
    lock_path = paths_for(config.name, create=True)["starting"]
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            return OwnerLink(config.name)  # another worker started it meanwhile
        except SharedCacheError:
            pass
        try:
            SharedCache.start(
                config.name,
                config.uri or derived_uri,
                arena_bytes=config.arena_bytes,
                budget_bytes=config.budget_bytes,
                slots=config.slots,
                max_entry_bytes=config.max_entry_bytes,
                max_await_time_ms=config.max_await_time_ms,
                idle_exit_seconds=float(config.grace_seconds),
                max_namespaces=config.max_namespaces,
                stream_scope=config.stream_scope,
            )
        except SharedCacheError:
            pass  # lost a race with an owner started by other means: attach to it
        return OwnerLink(config.name)
    finally:
        os.close(fd)
