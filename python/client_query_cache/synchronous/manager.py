"""CacheManager: a process-local cache over a ``pymongo.MongoClient``."""

from __future__ import annotations

from typing import Any

from pymongo import MongoClient
from pymongo.collection import Collection

from .._core.config import CacheConfig, MiB
from .._core.engine import Engine
from .._core.errors import CacheConfigurationError
from .._core.snapshot import CacheSnapshot
from .._core.uri import stream_uri_for
from .collection import CachedCollection, CachedDatabase

__all__ = ["CacheManager"]


class CacheManager:
    """Caches reads of a ``MongoClient``'s collections, kept coherent by one
    change stream per database.

    ``manager[db][coll]`` and ``manager.get_cached_collection(collection)``
    return a :class:`CachedCollection`. Use ``close()`` (or ``with``) to stop
    the change streams; reads after that raise ``CacheClosedError``.
    """

    def __init__(
        self,
        client: MongoClient[Any],
        *,
        budget_bytes: int = 64 * MiB,
        max_entry_bytes: int = 1 * MiB,
        max_await_time_ms: int = 1000,
        slot_count: int | None = None,
        stream_uri: str | None = None,
    ) -> None:
        if not isinstance(client, MongoClient):
            raise CacheConfigurationError(
                f"client must be a pymongo.MongoClient, not {type(client).__name__}"
            )
        self._config = CacheConfig(
            budget_bytes=budget_bytes,
            max_entry_bytes=max_entry_bytes,
            max_await_time_ms=max_await_time_ms,
            slot_count=slot_count,
            stream_uri=stream_uri,
        )
        self._client = client
        self._engine = Engine(self._config, stream_uri or stream_uri_for(client))

    # -- access -------------------------------------------------------------

    @property
    def client(self) -> MongoClient[Any]:
        return self._client

    @property
    def config(self) -> CacheConfig:
        return self._config

    def __getitem__(self, name: str) -> CachedDatabase:
        return self.get_database(name)

    def get_database(self, name: str, **options: Any) -> CachedDatabase:
        """A cached view of ``client.get_database(name, **options)``."""
        return CachedDatabase(self._engine, self._client.get_database(name, **options))

    def get_cached_collection(self, collection: Collection[Any]) -> CachedCollection:
        """Wrap a PyMongo collection of this manager's client."""
        if not isinstance(collection, Collection):
            raise CacheConfigurationError(
                f"collection must be a pymongo Collection, not {type(collection).__name__}"
            )
        if collection.database.client is not self._client:
            raise CacheConfigurationError("collection belongs to another MongoClient")
        return CachedCollection(self._engine, collection)

    # -- state --------------------------------------------------------------

    def snapshot(self) -> CacheSnapshot:
        """Counters, memory use and the state of every change stream."""
        return self._engine.snapshot()

    def wait_ready(self, timeout: float = 10.0, database: str | None = None) -> bool:
        """Wait until the change streams (of ``database``, or all) serve."""
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise CacheConfigurationError("timeout must be a non-negative number")
        return self._engine.wait_ready(float(timeout), database)

    # -- lifecycle ----------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def close(self) -> None:
        """Stop the change streams. Idempotent; the client stays open."""
        self._engine.close()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<CacheManager {state} budget={self._config.budget_bytes}>"
