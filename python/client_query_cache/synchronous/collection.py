"""Cached views of PyMongo's synchronous Database and Collection."""

from __future__ import annotations

from typing import Any

from pymongo.collection import Collection

from .._core.facade import CollectionBase, DatabaseBase
from .._core.read import Step, StepKind

__all__ = ["CachedDatabase", "CachedCollection"]


class CachedCollection(CollectionBase):
    """A PyMongo ``Collection`` whose safe reads are served from the cache.

    ``find_one`` by ``_id`` is cached; every other read is passed to PyMongo
    unchanged and counted as a bypass. Writes and other attributes are the
    wrapped collection's (``.raw``).
    """

    __slots__ = ()

    def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when it is an
        ``{"_id": value}`` lookup that is safe to cache."""
        core = self._core
        step = core.fast_find_one(filter) if not args and not kwargs else core.start_find_one(filter, args, kwargs)
        if type(step) is not Step:
            return step
        if step.kind is StepKind.PROBE:
            infos = list(core.probe_db.list_collections(filter=core.probe_filter()))
            step = core.probed(step, infos)
        if step.kind is StepKind.READ:
            plan = step.plan
            assert plan is not None
            return core.finish(step, core.primary.find_one(plan.filter, plan.projection, **plan.read_kwargs))
        if step.kind is StepKind.HIT:
            return step.value
        return self._raw.find_one(filter, *args, **kwargs)

    # -- reads this version does not cache: PyMongo's, counted --------------

    def find(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.find(*args, **kwargs)

    def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.aggregate(*args, **kwargs)

    def count_documents(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.count_documents(*args, **kwargs)

    def estimated_document_count(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.estimated_document_count(*args, **kwargs)

    def distinct(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.distinct(*args, **kwargs)


class CachedDatabase(DatabaseBase):
    """A PyMongo ``Database`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = Collection
    _collection_cls = CachedCollection
