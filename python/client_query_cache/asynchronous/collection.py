"""Cached views of PyMongo's AsyncDatabase and AsyncCollection.

A hit completes without suspending the event loop: ``find_one`` awaits
nothing unless it must read MongoDB. Cancelling a task during a miss's read
admits nothing (admission happens after the read returns, in the same step).
"""

from __future__ import annotations

from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from .._core.facade import CollectionBase, DatabaseBase
from .._core.read import Step, StepKind

__all__ = ["AsyncCachedDatabase", "AsyncCachedCollection"]


class AsyncCachedCollection(CollectionBase):
    """A PyMongo ``AsyncCollection`` whose safe reads are served from the
    cache; the async twin of ``CachedCollection``."""

    __slots__ = ()

    async def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when it is an
        ``{"_id": value}`` lookup that is safe to cache."""
        core = self._core
        step = core.fast_find_one(filter) if not args and not kwargs else core.start_find_one(filter, args, kwargs)
        if type(step) is not Step:
            return step
        if step.kind is StepKind.PROBE:
            cursor = await core.probe_db.list_collections(filter=core.probe_filter())
            step = core.probed(step, await cursor.to_list(None))
        if step.kind is StepKind.READ:
            plan = step.plan
            assert plan is not None
            return core.finish(step, await core.primary.find_one(plan.filter, plan.projection, **plan.read_kwargs))
        if step.kind is StepKind.HIT:
            return step.value
        return await self._raw.find_one(filter, *args, **kwargs)

    # -- reads this version does not cache: PyMongo's, counted --------------

    def find(self, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find`` (an ``AsyncCursor``: ``async for``, ``to_list``)."""
        self._core.uncached()
        return self._raw.find(*args, **kwargs)

    async def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return await self._raw.aggregate(*args, **kwargs)

    async def count_documents(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return await self._raw.count_documents(*args, **kwargs)

    async def estimated_document_count(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return await self._raw.estimated_document_count(*args, **kwargs)

    async def distinct(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return await self._raw.distinct(*args, **kwargs)


class AsyncCachedDatabase(DatabaseBase):
    """A PyMongo ``AsyncDatabase`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = AsyncCollection
    _collection_cls = AsyncCachedCollection
