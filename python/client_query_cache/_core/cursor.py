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

from typing import Any

from pymongo.errors import InvalidOperation

from .engine import decode_documents
from .read import CollectionCore, Step
from .reasons import BypassReason

__all__ = ["CursorBase", "Collector"]


class Collector:
    """The raw batches of a miss, kept until its cursor is exhausted."""

    __slots__ = ("core", "step", "batches", "count", "size", "oversize", "observations", "since")

    def __init__(self, core: CollectionCore, step: Step) -> None:
        self.core = core
        self.step = step
        self.batches: list[bytes] = []
        self.count = 0
        self.size = 0
        self.oversize = False
        self.observations = 0
        #: The observation count after its last batch (Engine.observe).
        self.since = step.observed

    def add(self, batch: bytes) -> list[Any]:
        """Keep one raw batch; return its documents decoded for the caller."""
        self.since = self.core.observe(self.since)
        self.observations += 1
        docs = decode_documents(batch, self.core.codec)
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
        self.since = self.core.observe(self.since)
        self.observations += 1
        self.core.admit_documents(self.step, self.batches, self.count, self.oversize, self.observations)


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


class CursorBase:
    """What the sync and async cursors share: options, state, buffering."""

    _method: str  # "find" or "aggregate"

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
        #: A bypass's observation count when it was sent (Engine.observe).
        self._since: int | None = None

    # -- the first step --------------------------------------------------------

    def _first_step(self) -> Step:
        core = self._core
        if self._method == "find":
            return core.start_find(self._args, self._kwargs)
        pipeline, *rest = self._args  # aggregate(pipeline, *args, **kwargs)
        return core.start_aggregate(pipeline, tuple(rest), self._kwargs)

    def _serve_hit(self, step: Step) -> None:
        self._docs = step.value
        self._started = True

    def _serve_read(self, step: Step, source: Any) -> None:
        self._collector = Collector(self._core, step)
        self._docs = []
        self._source = source
        self._started = True

    def _bypass_call(self) -> Any:
        """PyMongo's ``find`` or ``aggregate`` with the caller's arguments (a
        cursor, or an awaitable of one for ``AsyncCollection.aggregate``)."""
        self._since = self._core.observations()
        return getattr(self._raw, self._method)(*self._args, **self._kwargs)

    def _serve_bypass(self, source: Any) -> None:
        self._source = source
        self._started = True
        # An aggregate has run; a find reads on its first fetch.
        self._since = self._core.observe(self._since)

    def _bypassed(self, doc: Any) -> Any:
        """A document of PyMongo's cursor (a bypass), which may have read a
        batch for it."""
        self._since = self._core.observe(self._since)
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

    # -- options before the read starts --------------------------------------------

    def _set_option(self, name: str, value: Any) -> Any:
        if self._started:
            raise InvalidOperation("cannot set options after executing query")
        if len(self._args) > 2:
            # find(filter, projection, skip, limit, ...): let PyMongo merge them.
            self._give_to_pymongo()
            return getattr(self._source, name)(value)
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
        if type(batch_size) is not int or batch_size < 0:
            self._pymongo_check("batch_size", batch_size)
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
        self._core.count_bypass(BypassReason.UNSUPPORTED_OPTION)
        self._since = self._core.observations()
        self._serve_bypass(self._raw.find(*self._args, **self._kwargs))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if not self._started and self._method == "find":
            self._give_to_pymongo()
        if self._docs is None and self._source is not None:
            return getattr(self._source, name)  # PyMongo's cursor serves this read
        raise AttributeError(f"{name!r} is not available on a cursor served from the cache")

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
