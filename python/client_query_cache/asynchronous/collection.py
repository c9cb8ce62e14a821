"""Cached views of PyMongo's AsyncDatabase and AsyncCollection.

A hit completes without suspending the event loop: ``find_one`` awaits
nothing unless it must read MongoDB. Cancelling a task during a miss's read
admits nothing (admission happens after the read returns, in the same step).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from .._core.facade import CollectionBase, DatabaseBase
from .._core.read import Step, StepKind

__all__ = ["AsyncCachedDatabase", "AsyncCachedCollection"]


class AsyncCachedCollection(CollectionBase):
    """A PyMongo ``AsyncCollection`` whose safe reads are served from the
    cache; the async twin of ``CachedCollection``."""

    __slots__ = ()

    async def _serve(self, step: Step, bypass: Callable[[], Awaitable[Any]]) -> Any:
        """Drive a read's steps with the async client (a hit awaits nothing)."""
        core = self._core
        if step.kind is StepKind.PROBE:
            cursor = await core.probe_db.list_collections(filter=core.probe_filter())
            step = core.probed(step, await cursor.to_list(None))
        if step.kind is StepKind.READ:
            return core.finish(step, await core.miss_read(step))
        if step.kind is StepKind.HIT:
            return step.value
        return await bypass()

    async def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when safe."""
        core = self._core
        step = core.fast_find_one(filter) if not args and not kwargs else core.start_find_one(filter, args, kwargs)
        if type(step) is not Step:
            return step
        return await self._serve(step, lambda: self._raw.find_one(filter, *args, **kwargs))

    async def count_documents(self, filter: Any, *args: Any, **kwargs: Any) -> int:
        """PyMongo's ``count_documents``, served from the cache when safe."""
        step = self._core.start_count_documents(filter, args, kwargs)
        return await self._serve(step, lambda: self._raw.count_documents(filter, *args, **kwargs))

    async def estimated_document_count(self, *args: Any, **kwargs: Any) -> int:
        """PyMongo's ``estimated_document_count``, served from the cache when safe."""
        step = self._core.start_estimated_document_count(args, kwargs)
        return await self._serve(step, lambda: self._raw.estimated_document_count(*args, **kwargs))

    async def distinct(self, key: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """PyMongo's ``distinct``, served from the cache when safe."""
        step = self._core.start_distinct(key, args, kwargs)
        return await self._serve(step, lambda: self._raw.distinct(key, *args, **kwargs))

    # -- reads this version does not cache: PyMongo's, counted --------------

    def find(self, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find`` (an ``AsyncCursor``: ``async for``, ``to_list``)."""
        self._core.uncached()
        return self._raw.find(*args, **kwargs)

    async def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return await self._raw.aggregate(*args, **kwargs)


class AsyncCachedDatabase(DatabaseBase):
    """A PyMongo ``AsyncDatabase`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = AsyncCollection
    _collection_cls = AsyncCachedCollection
