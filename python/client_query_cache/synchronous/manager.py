"""CacheManager: a process-local cache over a ``pymongo.MongoClient``."""

from __future__ import annotations

from pymongo import MongoClient
from pymongo.collection import Collection

from .._core.facade import ManagerBase
from .collection import CachedCollection, CachedDatabase

__all__ = ["CacheManager"]


class CacheManager(ManagerBase):
    """Caches reads of a ``MongoClient``'s collections, kept coherent by one
    change stream per database.

    ``CacheManager(client, *, budget_bytes=64 MiB, max_entry_bytes=1 MiB,
    max_await_time_ms=1000, slot_count=None, stream_uri=None)``.
    ``manager[db][coll]`` and ``manager.get_cached_collection(collection)``
    return a :class:`CachedCollection`. ``close()`` (or ``with``) stops the
    change streams; reads after that raise ``CacheClosedError``.
    """

    _client_type = MongoClient
    _collection_type = Collection
    _database_cls = CachedDatabase
    _collection_cls = CachedCollection

    def wait_ready(self, timeout: float = 10.0, database: str | None = None) -> bool:
        """Wait until the change streams (of ``database``, or all) serve."""
        return self._engine.wait_ready(self._check_wait(timeout, database), database)

    def close(self) -> None:
        """Stop the change streams. Idempotent; the client stays open."""
        self._engine.close()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
