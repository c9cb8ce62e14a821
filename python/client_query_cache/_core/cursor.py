"""The state of a cached ``find`` or ``aggregate`` cursor, without I/O.

The sync and async cursors subclass :class:`CursorBase` and add the I/O: the
first step of the read (lookup, probe, capture) and the iteration of the
source, which is one of

* the documents of a hit (a list decoded from the entry; no I/O at all),
* for a miss, read at primary with majority read concern, a raw batch cursor
  (``find_raw_batches``: each batch is decoded in one call with the caller's
  codec options, as PyMongo decodes it) or an aggregate cursor of
  RawBSONDocuments (``aggregate_raw_batches`` would cost a round trip more),
  whose bytes a :class:`Collector` keeps; when the cursor is exhausted the complete result
  is admitted (never a partial one: a cursor closed, abandoned or failed
  early admits nothing),
* PyMongo's own cursor for a bypass.
"""

from __future__ import annotations

import copy
from typing import Any

from pymongo.errors import InvalidOperation

from .._native import decoded
from .engine import decode_documents
from .read import CollectionCore, Step
from .reasons import BypassReason

__all__ = ["CursorBase", "Collector", "only", "slice_bounds"]


class Collector:
    """The raw batches of a miss, kept until its cursor is exhausted."""

    __slots__ = ("core", "step", "batches", "count", "size", "oversize", "read")

    def __init__(self, core: CollectionCore, step: Step) -> None:
        self.core = core
        self.step = step
        self.batches: list[bytes] = []
        self.count = 0
        self.size = 0
        self.oversize = False
        #: Bytes of the result received so far.
        self.read = 0

    def add(self, batch: bytes) -> list[Any]:
        """Keep one raw batch; return its documents decoded for the caller."""
        assert self.step.plan is not None
        self.core.observe_read(self.step, self.step.plan, None, batch, self.read)
        self.read += len(batch)
        docs = decoded(batch, decode_documents, self.core.codec)
        self.count += len(docs)
        if not self.oversize:
            self.size += len(batch)
            if self.size > self.core.engine.max_entry_bytes:
                self.oversize = True  # counted when the cursor is exhausted
                self.batches = []
            else:
                self.batches.append(batch)
        return docs

    def complete(self) -> None:
        """The cursor is exhausted: admit the complete result (the last
        getMore may have brought no batch, and a result may have none)."""
        plan, prior = self.step.plan, self.step.prior
        assert plan is not None
        if prior is not None and prior[0] is not None and len(prior[0]) == self.read:
            seen = self.core.observe_read(self.step, plan, None, b"", self.read)  # all of it the same
        else:
            seen = self.core.observe_read(self.step, plan)
        self.core.admit_documents(self.step, self.batches, self.count, self.oversize, seen)


def _plain_sort(key_or_list: Any, direction: Any) -> bool:
    """``sort("a")``, ``sort("a", -1)``, ``sort([("a", 1), ("b", -1)])`` or
    ``sort({"a": 1})``: arguments PyMongo's ``sort`` accepts, told without
    asking it."""
    if isinstance(key_or_list, str):
        return direction in (None, 1, -1)
    if direction is not None:
        return False
    if type(key_or_list) is dict:
        pairs: Any = key_or_list.items()
    elif type(key_or_list) is list:
        pairs = key_or_list
    else:
        return False
    return bool(pairs) and all(
        type(pair) is tuple and len(pair) == 2 and type(pair[0]) is str and pair[1] in (1, -1)
        for pair in pairs
    )


class only:
    """A member of one kind of cursor only (``"find"``: PyMongo's ``Cursor``
    has it, ``"aggregate"``: its ``CommandCursor``). On the other kind it
    raises ``AttributeError``, so ``hasattr`` answers as for PyMongo's class."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.member: Any = None
        self.name = ""

    def __call__(self, member: Any) -> only:
        self.member = member
        self.__doc__ = member.__doc__
        return self

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cursor: Any, owner: type | None = None) -> Any:
        if cursor is None:
            return self
        if cursor._method != self.kind:
            raise AttributeError(f"an {cursor._method} cursor has no attribute {self.name!r}")
        return self.member.__get__(cursor, owner)


def slice_bounds(index: slice) -> tuple[int, int, bool]:
    """``cursor[start:stop]`` as PyMongo's ``Cursor.__getitem__`` reads it:
    (skip, limit, empty), or PyMongo's ``IndexError``."""
    if index.step is not None:
        raise IndexError("Cursor instances do not support slice steps")
    skip = 0
    if index.start is not None:
        if index.start < 0:
            raise IndexError("Cursor instances do not support negative indices")
        skip = index.start
    limit = 0
    if index.stop is not None:
        limit = index.stop - skip
        if limit < 0:
            raise IndexError(f"stop index must be greater than start index for slice {index!r}")
    return skip, limit, index.stop is not None and limit == 0


class CursorBase:
    """What the sync and async cursors share: options, state, buffering."""

    _method: str  # "find" or "aggregate"
    #: PyMongo's cursor classes of the facade's API, by method: what
    #: __getattr__ may hand a read to.
    _pymongo_classes: dict[str, type]

    def __init__(self, core: CollectionCore, raw: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._core = core
        self._raw = raw
        self._args = args
        self._kwargs = dict(kwargs)
        self._started = False
        #: Documents being served: a hit's, or the current batch of a miss.
        self._docs: list[Any] | None = None
        self._pos = 0
        self._source: Any = None  # the miss's raw batch cursor, or PyMongo's (bypass)
        self._collector: Collector | None = None
        #: A bypass's read id (each document it fetches is observed).
        self._read_id = 0
        #: Handed to PyMongo's cursor for good (an option the cache does not
        #: model): rewind, clone and options are that cursor's.
        self._pinned = False
        #: A zero-length slice: no documents and no read (PyMongo's _empty).
        self._empty = False
        #: Documents of a hit, or received by a miss (``retrieved``).
        self._retrieved = 0

    # -- the first step --------------------------------------------------------

    def _first_step(self) -> Step:
        core = self._core
        if self._method == "find":
            return core.start_find(self._args, self._kwargs)
        pipeline, *rest = self._args  # aggregate(pipeline, *args, **kwargs)
        return core.start_aggregate(pipeline, tuple(rest), self._kwargs)

    def _serve_hit(self, step: Step) -> None:
        self._docs = step.value
        self._retrieved = len(step.value)
        self._started = True

    def _serve_read(self, step: Step, source: Any) -> None:
        self._collector = Collector(self._core, step)
        self._docs = []
        self._source = source
        self._started = True

    def _bypass_call(self) -> Any:
        """PyMongo's ``find`` or ``aggregate`` with the caller's arguments (a
        cursor, or an awaitable of one for ``AsyncCollection.aggregate``)."""
        self._read_id = self._core.new_read()
        return getattr(self._raw, self._method)(*self._args, **self._kwargs)

    def _serve_bypass(self, source: Any) -> None:
        self._source = source
        self._started = True
        # An aggregate has run; a find reads on its first fetch.
        self._core.observe(self._read_id)
        if self._method == "aggregate" and self._args:
            # $out and $merge may write into another database.
            self._core.observe_written(self._args[0])

    def _bypassed(self, doc: Any) -> Any:
        """A document of PyMongo's cursor (a bypass), which may have read a
        batch for it."""
        self._core.observe(self._read_id)
        return doc

    # -- iteration ----------------------------------------------------------------

    def _buffered(self) -> tuple[bool, Any]:
        """(True, document) if one is buffered, else (False, None)."""
        docs = self._docs
        if docs is not None and self._pos < len(docs):
            doc = docs[self._pos]
            self._pos += 1
            return True, doc
        return False, None

    def _needs_batch(self) -> bool:
        """The buffer is empty and a miss's cursor may have more batches."""
        return self._collector is not None

    def _take_batch(self, batch: Any) -> None:
        """A raw batch (bytes) of a find, or one RawBSONDocument of an aggregate."""
        assert self._collector is not None
        self._docs = self._collector.add(batch if type(batch) is bytes else batch.raw)
        self._retrieved += len(self._docs)
        self._pos = 0

    def _exhausted(self) -> None:
        collector, self._collector = self._collector, None
        if collector is not None:
            collector.complete()

    def _abandon(self) -> None:
        """Closed before the end: admit nothing."""
        self._collector = None
        self._docs = []
        self._pos = 0
        self._started = True

    def _rewound(self) -> Any:
        """Back to the unevaluated state with the same options (``rewind``):
        a miss in progress admits nothing. Returns the source to close, or
        to rewind if the cursor is PyMongo's for good."""
        source = self._source
        self._collector = None
        self._docs = None
        self._pos = 0
        self._retrieved = 0
        if not self._pinned:
            self._source = None
            self._started = False
        return source

    def _check_okay_to_chain(self) -> None:
        """PyMongo's check before an option is set: not once the read started."""
        if self._started:
            raise InvalidOperation("cannot set options after executing query")

    # -- options before the read starts --------------------------------------------

    def _set_option(self, name: str, value: Any) -> Any:
        if self._pinned:
            getattr(self._source, name)(value)  # PyMongo's cursor checks and keeps it
            return self
        self._check_okay_to_chain()
        if len(self._args) > 2:
            # find(filter, projection, skip, limit, ...): let PyMongo merge them.
            self._give_to_pymongo()
            getattr(self._source, name)(value)
            return self
        if name == "limit":
            self._empty = False
        self._kwargs[name] = value
        return self

    # Each option method raises what PyMongo's cursor method raises, when it
    # raises it (at the call, not at the first document): a value the cheap
    # check does not accept is given to a PyMongo cursor of the same
    # collection (built without I/O) to accept or reject.

    def _pymongo_check(self, name: str, *values: Any) -> None:
        getattr(self._raw.find(), name)(*values)

    def limit(self, limit: int) -> Any:
        if type(limit) is not int:
            self._pymongo_check("limit", limit)
        return self._set_option("limit", limit)

    def skip(self, skip: int) -> Any:
        if type(skip) is not int or skip < 0:
            self._pymongo_check("skip", skip)
        return self._set_option("skip", skip)

    def batch_size(self, batch_size: int) -> Any:
        """The cursor; for an aggregate (PyMongo's ``CommandCursor``) also
        once the read has started: it sizes the miss's or the bypass's next
        batches."""
        if type(batch_size) is not int or batch_size < 0:
            self._pymongo_check("batch_size", batch_size)
        if self._method == "aggregate":
            if self._source is not None:
                self._source.batch_size(batch_size)
            return self
        return self._set_option("batch_size", batch_size)

    def max_time_ms(self, max_time_ms: int | None) -> Any:
        if max_time_ms is not None and type(max_time_ms) is not int:
            self._pymongo_check("max_time_ms", max_time_ms)
        return self._set_option("max_time_ms", max_time_ms)

    def comment(self, comment: Any) -> Any:
        return self._set_option("comment", comment)

    def sort(self, key_or_list: Any, direction: Any = None) -> Any:
        if not _plain_sort(key_or_list, direction):
            self._pymongo_check("sort", key_or_list, direction)
        if isinstance(key_or_list, str):
            key_or_list = [(key_or_list, 1 if direction is None else direction)]
        return self._set_option("sort", key_or_list)

    def _give_to_pymongo(self) -> None:
        """An option this cursor does not model: PyMongo's cursor serves the
        read instead (counted as a bypass)."""
        source = self._raw.find(*self._args, **self._kwargs)
        if self._empty:
            source = source[0:0]
        self._pin(source)

    def _pin(self, source: Any) -> None:
        """Serve the read with PyMongo's cursor ``source``, for good."""
        self._core.count_bypass(BypassReason.UNSUPPORTED_OPTION)
        self._read_id = self._core.new_read()
        self._pinned = True
        self._serve_bypass(source)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not hasattr(self._pymongo_classes[self._method], name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if not self._started and self._method == "find":
            self._give_to_pymongo()
        if self._docs is None and self._source is not None:
            return getattr(self._source, name)  # PyMongo's cursor serves this read
        raise AttributeError(f"{name!r} is not available on a cursor served from the cache")

    # -- PyMongo's cursor surface ----------------------------------------------

    @property
    def cursor_id(self) -> int | None:
        """PyMongo's ``cursor_id``: None before the first read; 0 for a hit
        (no server cursor) and once the server's cursor is exhausted."""
        if not self._started:
            return None
        if self._source is None:
            return 0
        return self._source.cursor_id  # type: ignore[no-any-return]

    @property
    def address(self) -> Any:
        """PyMongo's ``address``: the (host, port) read from, None for a hit."""
        return None if self._source is None else self._source.address

    @property
    def session(self) -> Any:
        """PyMongo's ``session``: the explicit session of a read PyMongo
        serves, else None (a cached read never runs in one)."""
        return None if self._source is None else self._source.session

    @only("find")
    @property
    def retrieved(self) -> int:
        """PyMongo's ``retrieved``: documents received so far (a hit's are
        all there once it started)."""
        if self._docs is None and self._source is not None:
            return int(self._source.retrieved)
        return self._retrieved

    def _clone(self, deep: bool, memo: dict[int, Any] | None = None) -> Any:
        """A new unevaluated cursor with this one's arguments and options;
        ``deep``: copies of them (the session itself is shared, as PyMongo
        does)."""
        args, kwargs = self._args, dict(self._kwargs)
        if deep:
            args = copy.deepcopy(args, memo)
            kwargs = {k: v if k == "session" else copy.deepcopy(v, memo) for k, v in kwargs.items()}
        clone = type(self)(self._core, self._raw, args, kwargs, self._method)  # type: ignore[call-arg]
        clone._empty = self._empty
        if self._pinned:
            clone._pin(self._source.clone() if deep else copy.copy(self._source))
        return clone

    @only("find")
    def clone(self) -> Any:
        """PyMongo's ``clone()``: a new unevaluated cursor with the same
        arguments and options (deep copies), read through the cache."""
        return self._clone(True)

    def __copy__(self) -> Any:
        """``copy.copy``: for a find, ``clone()`` without copying the
        arguments (PyMongo's ``Cursor.__copy__``); for an aggregate, another
        cursor over the same documents (it admits nothing)."""
        if self._method == "find":
            return self._clone(False)
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._collector = None
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """``copy.deepcopy``: ``clone()`` for a find; an aggregate cursor
        cannot be deep-copied (nor can PyMongo's ``CommandCursor``)."""
        if self._method != "find":
            raise TypeError("an aggregate cursor cannot be deep-copied")
        return self._clone(True, memo)

    def _slice(self, index: slice) -> Any:
        """``cursor[start:stop]`` of a find, as PyMongo: this cursor, with
        the slice's skip and limit in place of any before."""
        skip, limit, empty = slice_bounds(index)
        self._kwargs["skip"] = skip
        self._kwargs["limit"] = limit
        self._empty = empty
        return self

    def _item_cursor(self, index: Any) -> Any:
        """``cursor[index]`` of a find: the checks PyMongo makes, then the
        cursor that reads that one document (None for a slice, applied to
        this cursor). A cursor that is PyMongo's, or given skip and limit
        positionally, leaves it to PyMongo's cursor (``self._source``):
        ``self`` is returned then."""
        if self._method != "find":
            raise TypeError(f"{type(self).__name__!r} object of an aggregate is not subscriptable")
        if not self._pinned:
            self._check_okay_to_chain()
            if len(self._args) > 2:
                self._give_to_pymongo()
        if self._pinned:
            return self
        self._empty = False
        if isinstance(index, slice):
            self._slice(index)
            return None
        if isinstance(index, int):
            if index < 0:
                raise IndexError("Cursor instances do not support negative indices")
            clone = self._clone(True)
            clone._kwargs["skip"] = index + self._kwargs.get("skip", 0)
            clone._kwargs["limit"] = 1  # PyMongo's -1 (one batch) would bypass
            return clone
        raise TypeError(f"index {index!r} cannot be applied to Cursor instances")

    @property
    def alive(self) -> bool:
        """Whether more documents may come (as PyMongo's ``alive``)."""
        if not self._started:
            return True
        if self._docs is None:
            return bool(self._source.alive)
        return self._collector is not None or self._pos < len(self._docs)

    def __repr__(self) -> str:
        if not self._started:
            state = "not started"
        elif self._docs is None:
            state = "pymongo"
        else:
            state = "miss" if self._source is not None else "hit"
        return f"<{type(self).__name__} {self._method} {state}>"
