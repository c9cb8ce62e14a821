"""SharedCache: the handle that starts and stops a shared cache's owner
process (``python -m client_query_cache.owner``) and asks it for statistics."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

from .config import CacheConfig, MiB
from .errors import CacheConfigurationError
from .shared import SharedCacheError, paths_for, peer_uid, recv_message, send_message, validate_name

__all__ = ["SharedCache"]


class SharedCache:
    """Handle of a running owner process (``start()`` returns one)."""

    def __init__(self, name: str, process: subprocess.Popen[bytes] | None, pid: int) -> None:
        self.name = name
        self._process = process
        self.pid = pid

    @classmethod
    def start(
        cls,
        name: str,
        uri: str,
        *,
        arena_bytes: int | None = None,
        budget_bytes: int = 32 * MiB,
        slots: int = 16384,
        max_entry_bytes: int = 1 * MiB,
        max_await_time_ms: int = 1000,
        ready_timeout: float = 60.0,
    ) -> SharedCache:
        """Start the owner of shared cache ``name`` for the deployment at
        ``uri``, and return once it accepts workers."""
        validate_name(name)
        if not isinstance(uri, str) or not uri.startswith(("mongodb://", "mongodb+srv://")):
            raise CacheConfigurationError("uri must be a 'mongodb://' or 'mongodb+srv://' connection string")
        CacheConfig(
            budget_bytes=budget_bytes,
            max_entry_bytes=max_entry_bytes,
            max_await_time_ms=max_await_time_ms,
            slot_count=slots,
        )
        if arena_bytes is not None and (isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int) or arena_bytes <= 0):
            raise CacheConfigurationError("arena_bytes must be a positive int")
        config = {
            "name": name,
            "uri": uri,
            "arena_bytes": arena_bytes or 0,
            "budget_bytes": budget_bytes,
            "slots": slots,
            "max_entry_bytes": max_entry_bytes,
            "max_await_time_ms": max_await_time_ms,
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
            raise SharedCacheError(
                f"the owner of {name!r} did not start: {ready.get('error', 'no answer')}"
            )
        return cls(name, process, int(ready["pid"]))

    def _request(self, op: str) -> dict[str, Any]:
        path = paths_for(self.name)["sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30.0)
            sock.connect(str(path))
            if peer_uid(sock) != os.getuid():
                raise SharedCacheError("the owner runs as another user")
            send_message(sock, {"op": op})
            with sock.makefile("rb") as reader:
                reply = recv_message(reader)
        if not reply or not reply.get("ok"):
            raise SharedCacheError(f"the owner refused {op!r}")
        return reply

    def snapshot(self) -> dict[str, Any]:
        """Group statistics: arena bytes, entries, evictions, invalidations,
        admissions, attached workers, active streams, owner uptime."""
        return dict(self._request("snapshot")["snapshot"])

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the owner; workers fall back to MongoDB until one runs again."""
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

    def __enter__(self) -> SharedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
