"""Cached views of PyMongo's AsyncDatabase and AsyncCollection.

A hit completes without suspending the event loop: ``find_one`` awaits
nothing unless it must read MongoDB. Cancelling a task during a miss's read
raises CancelledError and admits nothing (admission happens after the read
returns, in the same step, and only if no cancellation was asked for
meanwhile: PyMongo's read can swallow one and return its result).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.asynchronous.command_cursor import AsyncCommandCursor
from pymongo.asynchronous.cursor import AsyncCursor
from pymongo.errors import OperationFailure

from .._core.causal import bound_session_getter
from .._core.cursor import CursorBase, only
from .._core.facade import CollectionBase, DatabaseBase, install_write_methods
from .._core.read import Step, StepKind

__all__ = ["AsyncCachedDatabase", "AsyncCachedCollection", "AsyncCachedCursor"]


async def _probe(core: Any, step: Step) -> Step:
    """A PROBE step's reads: the collection's listCollections entry and, for
    a plain collection, its indexes (none if they cannot be listed: no
    unique-key aliases then)."""
    infos = await (await core.probe_db.list_collections(filter=core.probe_filter())).to_list(None)
    indexes: list[Any] = []
    if core.lists_indexes(infos):
        try:
            indexes = await (await core.primary.list_indexes()).to_list(None)
        except OperationFailure:
            pass
    return core.probed(step, infos, indexes)


def _cancel_requests() -> int:
    """The cancellations asked of the current task and not yet handled."""
    task = asyncio.current_task()
    return 0 if task is None else task.cancelling()


def _honour_cancel(before: int) -> None:
    """After a miss's await: if the task was asked to cancel meanwhile and
    the read returned all the same (PyMongo's network code can swallow the
    request), end the task as asked, before anything is admitted."""
    if _cancel_requests() > before:
        raise asyncio.CancelledError


class AsyncCachedCollection(CollectionBase):
    """A PyMongo ``AsyncCollection`` whose safe reads are served from the
    cache; the async twin of ``CachedCollection``."""

    __slots__ = ()
    _raw_collection_type = AsyncCollection
    _bound_session = bound_session_getter(asynchronous=True)

    async def _serve(self, step: Step, bypass: Callable[[], Awaitable[Any]]) -> Any:
        """Drive a read's steps with the async client (a hit awaits nothing)."""
        core = self._core
        if step.kind is StepKind.HIT:
            return step.value
        cancels = _cancel_requests()
        if step.kind is StepKind.PROBE:
            step = await _probe(core, step)
        if step.kind is StepKind.READ:
            result = await core.miss_read(step)
            _honour_cancel(cancels)
            return core.finish(step, result)
        if step.kind is StepKind.HIT:
            return step.value
        read_id = core.new_read()
        try:
            return await bypass()
        finally:
            core.observe(read_id)

    async def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when safe."""
        core = self._core
        step = core.fast_find_one(filter) if not args and not kwargs else core.start_find_one(filter, args, kwargs)
        if type(step) is not Step:
            return step
        return await self._find_one_rest(step, filter, args, kwargs)

    async def _find_one_rest(self, step: Step, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``find_one`` past a step that is not its result. Apart from
        ``find_one`` so that a hit's frame holds no closure (its variables
        would each be a cell, made on every call)."""
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

    def find(self, *args: Any, **kwargs: Any) -> AsyncCachedCursor:
        """PyMongo's ``find``: an async cursor whose result comes from the
        cache when it is safe (nothing is read before the first document is
        asked for; a hit's documents are returned without suspending)."""
        self._core.native.check()
        return AsyncCachedCursor(self._core, self._raw, args, kwargs)

    async def aggregate(self, pipeline: Any, *args: Any, **kwargs: Any) -> AsyncCachedCursor:
        """PyMongo's ``aggregate``: an async cursor whose result comes from the
        cache when the pipeline is deterministic and reads only this collection."""
        cursor = AsyncCachedCursor(self._core, self._raw, (pipeline, *args), kwargs, method="aggregate")
        await cursor._start()  # like PyMongo, aggregate runs (or looks up) at once
        return cursor


def _observed_write(name: str) -> Callable[..., Awaitable[Any]]:
    async def write(self: AsyncCachedCollection, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self._raw, name)(*args, **kwargs)
        finally:
            self._core.observe_write(name, args, kwargs)

    return write


install_write_methods(AsyncCachedCollection, _observed_write)


class AsyncCachedCursor(CursorBase):
    """The async twin of ``CachedCursor``, with the surface of PyMongo's
    ``AsyncCursor`` (find) and ``AsyncCommandCursor`` (aggregate): ``async
    for``, ``to_list()``, ``next()``, ``close()``, ``async with``,
    ``cursor_id``, ``address``, ``alive``, ``session``; for a find the
    option methods before the first document, ``await rewind()``,
    ``clone()``, ``copy.copy``/``copy.deepcopy``, ``retrieved`` (indexing
    raises ``IndexError``, as PyMongo's async cursor); for an aggregate
    ``await try_next()`` and ``batch_size``."""

    _pymongo_classes = {"find": AsyncCursor, "aggregate": AsyncCommandCursor}

    def __init__(
        self, core: Any, raw: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: str = "find"
    ) -> None:
        self._method = method
        super().__init__(core, raw, args, kwargs)

    async def _start(self) -> None:
        core = self._core
        step = self._first_step()
        cancels = _cancel_requests()
        if step.kind is StepKind.PROBE:
            step = await _probe(core, step)
        if step.kind is StepKind.READ:
            source = core.miss_read(step)
            source = await source if self._method == "aggregate" else source
            _honour_cancel(cancels)
            self._serve_read(step, source)
        elif step.kind is StepKind.HIT:
            self._serve_hit(step)
        else:
            source = self._bypass_call()
            self._serve_bypass(await source if self._method == "aggregate" else source)

    def __aiter__(self) -> AsyncCachedCursor:
        return self

    async def __anext__(self) -> Any:
        if not self._started:
            if self._empty:
                raise StopAsyncIteration
            await self._start()
        while True:
            more, doc = self._buffered()
            if more:
                return doc
            if self._docs is None:
                return self._bypassed(await self._source.__anext__())  # PyMongo's cursor (a bypass)
            if not self._needs_batch():
                raise StopAsyncIteration
            cancels = _cancel_requests()
            try:
                batch = await self._source.__anext__()
            except StopAsyncIteration:
                self._honour_cancel(cancels)
                self._exhausted()
                raise
            self._honour_cancel(cancels)
            self._take_batch(batch)

    next = __anext__

    def _honour_cancel(self, before: int) -> None:
        """_honour_cancel for a miss's batch: a cancelled miss admits nothing,
        even if its cursor is read on."""
        try:
            _honour_cancel(before)
        except asyncio.CancelledError:
            self._abandon()
            raise

    @only("aggregate")
    async def try_next(self) -> Any:
        """PyMongo's ``AsyncCommandCursor.try_next()``: the next document, or
        None at the end."""
        if self._docs is None:
            return self._bypassed(await self._source.try_next())  # PyMongo's cursor (a bypass)
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    def __getitem__(self, index: Any) -> Any:
        """As PyMongo's async cursors: a find's raises ``IndexError``, an
        aggregate's is not subscriptable (``TypeError``)."""
        if self._method != "find":
            raise TypeError(f"{type(self).__name__!r} object of an aggregate is not subscriptable")
        raise IndexError("Cursor does not support indexing")

    @only("find")
    async def rewind(self) -> AsyncCachedCursor:
        """PyMongo's ``await rewind()``: this cursor, back to its unevaluated
        state with the same options; the next document reads (or hits) again."""
        source = self._rewound()
        if self._pinned:
            await source.rewind()
        elif source is not None:
            await source.close()
        return self

    async def to_list(self, length: int | None = None) -> list[Any]:
        """The remaining documents (at most ``length``), as PyMongo's ``to_list``."""
        if length is not None and length < 1:
            raise ValueError("to_list() length must be greater than 0")
        out: list[Any] = []
        async for doc in self:
            out.append(doc)
            if length is not None and len(out) >= length:
                break
        return out

    async def close(self) -> None:
        """Close the cursor; a miss that was not read to the end admits nothing."""
        source = self._source
        self._abandon()
        if source is not None:
            await source.close()

    async def __aenter__(self) -> AsyncCachedCursor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncCachedDatabase(DatabaseBase):
    """A PyMongo ``AsyncDatabase`` whose collections read through the cache."""

    __slots__ = ()
    _raw_collection_type = AsyncCollection
    _collection_cls = AsyncCachedCollection
