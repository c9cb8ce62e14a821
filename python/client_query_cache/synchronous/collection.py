"""Cached views of PyMongo's synchronous Database and Collection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pymongo.collection import Collection
from pymongo.command_cursor import CommandCursor
from pymongo.cursor import Cursor
from pymongo.errors import OperationFailure

from .._core.causal import bound_session_getter
from .._core.cursor import CursorBase, only
from .._core.facade import CollectionBase, DatabaseBase, install_write_methods
from .._core.read import Step, StepKind

__all__ = ["CachedDatabase", "CachedCollection", "CachedCursor"]


def _probe(core: Any, step: Step) -> Step:
    """A PROBE step's reads: the collection's listCollections entry and, for
    a plain collection, its indexes (none if they cannot be listed: no
    unique-key aliases then)."""
    infos = list(core.probe_db.list_collections(filter=core.probe_filter()))
    indexes: list[Any] = []
    if core.lists_indexes(infos):
        try:
            indexes = list(core.primary.list_indexes())
        except OperationFailure:
            pass
    return core.probed(step, infos, indexes)


class CachedCollection(CollectionBase):
    """A PyMongo ``Collection`` whose safe reads are served from the cache.

    ``find_one``, ``find``, ``aggregate``, ``count_documents``,
    ``estimated_document_count`` and ``distinct`` are served from the cache
    when safe; otherwise they are passed to PyMongo unchanged and counted as a
    bypass with its reason. Writes are the wrapped collection's, followed by
    raising the causal floor (see ``WRITE_METHODS``); other attributes are
    the wrapped collection's (``.raw``).
    """

    __slots__ = ()
    _raw_collection_type = Collection
    _bound_session = bound_session_getter(asynchronous=False)

    def _serve(self, step: Step, bypass: Callable[[], Any]) -> Any:
        """Drive a read's steps with the sync client."""
        core = self._core
        if step.kind is StepKind.PROBE:
            step = _probe(core, step)
        if step.kind is StepKind.READ:
            return core.finish(step, core.miss_read(step))
        if step.kind is StepKind.HIT:
            return step.value
        read_id = core.new_read()
        try:
            return bypass()
        finally:
            core.observe(read_id)

    # find_one is ViewBase's (C): PyMongo's ``find_one``, served from the
    # cache when safe. A hit of find_one({"_id": int|str|ObjectId}) is
    # answered there; everything else continues here.

    def _find_one_rest(self, step: Step | None, /, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``find_one(filter, *args, **kwargs)`` past the C fast path:
        ``step`` is the first Step the fast path took, None if it did not
        apply to these arguments."""
        if step is None:
            step = self._core.start_find_one(filter, args, kwargs)
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

    def find(self, *args: Any, **kwargs: Any) -> CachedCursor:
        """PyMongo's ``find``: a cursor whose result comes from the cache when
        it is safe (nothing is read before the first document is asked for)."""
        self._core.native.check()
        return CachedCursor(self._core, self._raw, args, kwargs)

    def aggregate(self, pipeline: Any, *args: Any, **kwargs: Any) -> CachedCursor:
        """PyMongo's ``aggregate``: a cursor whose result comes from the cache
        when the pipeline is deterministic and reads only this collection."""
        cursor = CachedCursor(self._core, self._raw, (pipeline, *args), kwargs, method="aggregate")
        cursor._start()  # like PyMongo, aggregate runs (or looks up) at once
        return cursor


def _observed_write(name: str) -> Callable[..., Any]:
    def write(self: CachedCollection, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._raw, name)(*args, **kwargs)
        finally:
            self._core.observe_write(name, args, kwargs)

    return write


install_write_methods(CachedCollection, _observed_write)


class CachedCursor(CursorBase):
    """The cursor of a cached ``find`` or ``aggregate``, with PyMongo's cursor
    surface whether the result comes from the cache or not: iteration,
    ``list()``, ``to_list()``, ``next()``, ``close()``, ``with``,
    ``cursor_id``, ``address``, ``alive``, ``session``; for a find (PyMongo's
    ``Cursor``) ``limit``, ``skip``, ``sort``, ``batch_size``,
    ``max_time_ms`` and ``comment`` before the first document, indexing and
    slicing, ``rewind()``, ``clone()``, ``copy.copy``/``copy.deepcopy`` and
    ``retrieved``; for an aggregate (PyMongo's ``CommandCursor``)
    ``try_next()`` and ``batch_size``. Anything else PyMongo's cursor offers
    hands a find to PyMongo (counted as a bypass) when asked before the
    first document."""

    _pymongo_classes = {"find": Cursor, "aggregate": CommandCursor}

    def __init__(
        self, core: Any, raw: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: str = "find"
    ) -> None:
        self._method = method
        super().__init__(core, raw, args, kwargs)

    def _start(self) -> None:
        core = self._core
        step = self._first_step()
        if step.kind is StepKind.PROBE:
            step = _probe(core, step)
        if step.kind is StepKind.READ:
            self._serve_read(step, core.miss_read(step))
        elif step.kind is StepKind.HIT:
            self._serve_hit(step)
        else:
            self._serve_bypass(self._bypass_call())

    def __iter__(self) -> CachedCursor:
        return self

    def __next__(self) -> Any:
        if not self._started:
            if self._empty:
                raise StopIteration  # cursor[n:n], as PyMongo: nothing is read
            self._start()
        while True:
            more, doc = self._buffered()
            if more:
                return doc
            if self._docs is None:
                return self._bypassed(next(self._source))  # PyMongo's cursor (a bypass)
            if not self._needs_batch():
                raise StopIteration
            try:
                batch = next(self._source)
            except StopIteration:
                self._exhausted()
                raise
            self._take_batch(batch)

    next = __next__

    @only("aggregate")
    def try_next(self) -> Any:
        """PyMongo's ``CommandCursor.try_next()``: the next document, or None
        at the end."""
        if self._docs is None:
            return self._bypassed(self._source.try_next())  # PyMongo's cursor (a bypass)
        try:
            return next(self)
        except StopIteration:
            return None

    def __getitem__(self, index: Any) -> Any:
        """PyMongo's ``Cursor.__getitem__``: ``cursor[i]`` the i-th document
        (after the cursor's skip; ``IndexError`` past the end), ``cursor[a:b]``
        this cursor with skip ``a`` and limit ``b - a``; ``InvalidOperation``
        once the read has started. Read through the cache."""
        clone = self._item_cursor(index)
        if clone is self:
            result = self._source[index]  # PyMongo's cursor
            return self if isinstance(index, slice) else result
        if clone is None:
            return self
        for doc in clone.to_list():
            return doc
        raise IndexError("no such item for Cursor instance")

    @only("find")
    def rewind(self) -> CachedCursor:
        """PyMongo's ``rewind()``: this cursor, back to its unevaluated state
        with the same options; the next document reads (or hits) again."""
        source = self._rewound()
        if self._pinned:
            source.rewind()
        elif source is not None:
            source.close()
        return self

    def to_list(self, length: int | None = None) -> list[Any]:
        """The remaining documents (at most ``length``), as PyMongo's ``to_list``."""
        if length is not None and length < 1:
            raise ValueError("to_list() length must be greater than 0")
        out: list[Any] = []
        for doc in self:
            out.append(doc)
            if length is not None and len(out) >= length:
                break
        return out

    def close(self) -> None:
        """Close the cursor; a miss that was not read to the end admits nothing."""
        source = self._source
        self._abandon()
        if source is not None:
            source.close()

    def __enter__(self) -> CachedCursor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CachedDatabase(DatabaseBase):
    """A PyMongo ``Database`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = Collection
    _collection_cls = CachedCollection
