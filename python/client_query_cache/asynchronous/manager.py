"""AsyncCacheManager: the cache over a ``pymongo.AsyncMongoClient``."""

from __future__ import annotations

import asyncio
import time

from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from .._core.facade import ManagerBase
from .collection import AsyncCachedCollection, AsyncCachedDatabase

__all__ = ["AsyncCacheManager"]


class AsyncCacheManager(ManagerBase):
    """The async twin of ``CacheManager``: same options, same cache; reads
    await the ``AsyncMongoClient`` only on a miss. Change streams are followed
    by C threads, not by the event loop.

    ``await manager.close()`` or ``async with AsyncCacheManager(client) as m``.
    """

    _client_type = AsyncMongoClient
    _collection_type = AsyncCollection
    _database_cls = AsyncCachedDatabase
    _collection_cls = AsyncCachedCollection

    async def wait_ready(self, timeout: float = 10.0, database: str | None = None) -> bool:
        """Wait (without blocking the loop) until the change streams serve."""
        deadline = time.monotonic() + self._check_wait(timeout, database)
        while not self._engine.ready(database):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    async def close(self) -> None:
        """Stop the change streams (in a worker thread: joining them can take
        up to ``max_await_time_ms``). Idempotent; the client stays open. A
        cancelled close still closes: the thread runs to the end, and only
        the wait for it is cancelled."""
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, self._engine.close))

    async def __aenter__(self) -> AsyncCacheManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
