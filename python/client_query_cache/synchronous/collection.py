"""Cached views of PyMongo's synchronous Database and Collection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pymongo.collection import Collection

from .._core.facade import CollectionBase, DatabaseBase
from .._core.read import Step, StepKind

__all__ = ["CachedDatabase", "CachedCollection"]


class CachedCollection(CollectionBase):
    """A PyMongo ``Collection`` whose safe reads are served from the cache.

    ``find_one``, ``count_documents``, ``estimated_document_count`` and
    ``distinct`` are cached when safe (see the bypass reasons); every other
    read is passed to PyMongo unchanged and counted as a bypass. Writes and
    other attributes are the wrapped collection's (``.raw``).
    """

    __slots__ = ()

    def _serve(self, step: Step, bypass: Callable[[], Any]) -> Any:
        """Drive a read's steps with the sync client."""
        core = self._core
        if step.kind is StepKind.PROBE:
            infos = list(core.probe_db.list_collections(filter=core.probe_filter()))
            step = core.probed(step, infos)
        if step.kind is StepKind.READ:
            return core.finish(step, core.miss_read(step))
        if step.kind is StepKind.HIT:
            return step.value
        return bypass()

    def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when safe."""
        core = self._core
        step = core.fast_find_one(filter) if not args and not kwargs else core.start_find_one(filter, args, kwargs)
        if type(step) is not Step:
            return step
        return self._serve(step, lambda: self._raw.find_one(filter, *args, **kwargs))

    def count_documents(self, filter: Any, *args: Any, **kwargs: Any) -> int:
        """PyMongo's ``count_documents``, served from the cache when safe."""
        step = self._core.start_count_documents(filter, args, kwargs)
        return self._serve(step, lambda: self._raw.count_documents(filter, *args, **kwargs))

    def estimated_document_count(self, *args: Any, **kwargs: Any) -> int:
        """PyMongo's ``estimated_document_count``, served from the cache when safe."""
        step = self._core.start_estimated_document_count(args, kwargs)
        return self._serve(step, lambda: self._raw.estimated_document_count(*args, **kwargs))

    def distinct(self, key: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """PyMongo's ``distinct``, served from the cache when safe."""
        step = self._core.start_distinct(key, args, kwargs)
        return self._serve(step, lambda: self._raw.distinct(key, *args, **kwargs))

    # -- reads this version does not cache: PyMongo's, counted --------------

    def find(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.find(*args, **kwargs)

    def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        self._core.uncached()
        return self._raw.aggregate(*args, **kwargs)


class CachedDatabase(DatabaseBase):
    """A PyMongo ``Database`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = Collection
    _collection_cls = CachedCollection
