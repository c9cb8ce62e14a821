"""The steps of a cached read, without I/O, shared by the sync and async facades.

A facade drives a read through these steps and does only the I/O in between
(with a sync or an async PyMongo collection):

    step = core.start_find_one(filter, args, kwargs)   # or start_count_documents, ...
    PROBE  -> list the collection (listCollections by name), core.probed(step, infos)
    READ   -> run core.miss_read(step) (a value, or an awaitable for the async
              client), then core.finish(step, result)
    HIT    -> step.value is the result
    BYPASS -> call PyMongo's method with the caller's arguments, unchanged

The fast path (``fast_find_one``, in C: ``_native.CoreBase``) answers
``{"_id": int|str|ObjectId}`` hits with no Python frame and no allocation
besides the result; otherwise it returns the first Step, so a facade tells the
two apart with ``type(r) is Step``. The sync facade's ``find_one`` is C too
(``_native.ViewBase``): a hit of that shape runs no Python code at all.

Entries hold BSON: a ``find_one`` entry the document itself (or "not found"),
a count ``{"n": count}``, a ``distinct`` entry ``{"v": [values]}``, a ``find``
or ``aggregate`` entry the raw documents one after the other (the bytes of the
raw batches the miss read); a hit is decoded with the caller's codec options,
like PyMongo decodes the reply.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson.codec_options import CodecOptions, DatetimeConversion
from bson.raw_bson import RawBSONDocument
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.client_session import ClientSession
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from .classify import (
    KIND_AGGREGATE,
    KIND_DISTINCT,
    KIND_FIND,
    KIND_FIND_ONE,
    ReadPlan,
    classify_aggregate,
    classify_count_documents,
    classify_distinct,
    classify_estimated_document_count,
    classify_find,
    classify_find_one,
    classify_id,
    collection_bypass,
)
from .causal import BLOCKS, after_floor
from .._native import CoreBase, decoded
from .engine import BEHIND, MISS, UNHEALTHY, Engine, decode_bson, decode_document
from .errors import CacheClosedError
from .reasons import BypassReason
from .validate import check_aggregate, check_collation, check_find, check_find_one

__all__ = ["CollectionCore", "Step", "StepKind"]

#: Write methods that change at most the one document their filter matches.
_ONE_DOCUMENT_WRITES = frozenset(
    {"update_one", "replace_one", "delete_one", "find_one_and_delete", "find_one_and_replace", "find_one_and_update"}
)

#: The refused entry's value (None: "not found") and stamp (Cache.peek).
Prior = tuple[bytes | None, int, int, int]
#: observe_read without a result to compare.
_WHOLE: Any = object()


#: Write methods that drop or rename namespaces.
_NAMESPACE_WRITES = frozenset({"drop", "rename"})

#: PyMongo's session classes: a write's session given positionally.
_SESSION_TYPES = (ClientSession, AsyncClientSession)

#: How distinct values are read on a miss: elements that are documents stay
#: raw, and scalars decode to types that encode back to the same bytes (no
#: UUID or type-registry conversion, any datetime).
_VALUES_CODEC: CodecOptions[Any] = CodecOptions(
    document_class=RawBSONDocument, datetime_conversion=DatetimeConversion.DATETIME_AUTO
)


class StepKind(enum.Enum):
    HIT = "hit"
    BYPASS = "bypass"
    PROBE = "probe"
    READ = "read"


class Step:
    """What the facade must do next for one read."""

    __slots__ = ("kind", "value", "plan", "key", "token", "read_id", "started", "prior")

    def __init__(
        self,
        kind: StepKind,
        value: Any = None,
        plan: ReadPlan | None = None,
        key: tuple[int, int] | None = None,
        token: bytes | None = None,
        read_id: int = 0,
        started: int = 0,
        prior: Prior | None = None,
    ) -> None:
        self.kind = kind
        self.value = value
        self.plan = plan
        self.key = key
        self.token = token
        #: A READ step: its read id, and CLOCK_MONOTONIC before it is sent
        #: (its stamp, floor.h).
        self.read_id = read_id
        self.started = started
        #: For a read the causal floor refused: the refused entry's value
        #: and stamp (Cache.peek).
        self.prior = prior


_BYPASS = Step(StepKind.BYPASS)


class CollectionCore(CoreBase):
    """Per-collection state and logic of a cached collection (either facade).

    ``collection`` is a PyMongo ``Collection`` or ``AsyncCollection``; only
    its options are used here. ``native``, ``codec``, ``bound_session``,
    ``ns_idx``, ``db_idx`` and ``fast`` are CoreBase's fields: its
    ``fast_find_one`` reads them.
    """

    __slots__ = (
        "engine", "ns", "raw", "primary", "primary_values", "probe_db", "bypass",
        "generation", "_db_name", "_coll_name", "_base_bypass",
    )  # fmt: skip

    def __init__(self, engine: Engine, collection: Any, bound_session: Callable[[], Any]) -> None:
        self.engine = engine
        #: The session PyMongo's bind() made current for this context (see
        #: causal.bound_session_getter), or None.
        self.bound_session = bound_session
        self.native = engine.native
        self.codec = collection.codec_options
        #: The caller's collection: PyMongo's argument checks (validate.py).
        self.raw = collection
        # Misses read raw BSON at primary with majority read concern
        # (coherence rule 4), whatever the collection's own settings.
        self.primary = collection.with_options(
            codec_options=collection.codec_options.with_options(document_class=RawBSONDocument),
            read_preference=ReadPreference.PRIMARY,
            read_concern=ReadConcern("majority"),
        )
        self.primary_values = self.primary.with_options(codec_options=_VALUES_CODEC)
        self.probe_db = collection.database.with_options(read_preference=ReadPreference.PRIMARY)
        self._db_name = collection.database.name
        self._coll_name = collection.name
        self._base_bypass = collection_bypass(collection)
        self._bind()

    def _bind(self) -> None:
        """Take the engine's current native cache and namespace handle (again
        after a shared-mode worker re-attached to a new owner)."""
        engine = self.engine
        self.generation = engine.generation
        self.native = engine.native
        self.ns = engine.namespace(self._db_name, self._coll_name)
        self.ns_idx = self.ns.ns_idx
        self.db_idx = self.ns.db_idx
        self.bypass = self._base_bypass
        if self.bypass is None and self.ns.unavailable:
            self.bypass = BypassReason.NAMESPACE_LIMIT if self.ns.limited else BypassReason.NAMESPACE_UNAVAILABLE
        self.fast = self.bypass is None

    # -- starting a read -------------------------------------------------------

    def _start_id(self, id_value: Any, looked_up: Any) -> Step:
        """``find_one({"_id": id_value})`` after the fast path's lookup of it
        answered ``looked_up`` (MISS, UNHEALTHY or BEHIND): start_find_one's
        steps with that lookup done, and the plan this filter is known to
        have (classify_id; PyMongo checks nothing of it)."""
        return self._start(lambda: classify_id(id_value, self.codec), looked_up)

    def start_find_one(self, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        """``find_one(filter, *args, **kwargs)``: classify, look up, and say
        what the facade must do next."""
        return self._start(
            lambda: classify_find_one(filter, args, kwargs, self.codec),
            check=lambda: check_find_one(self.raw, filter, args, kwargs),
        )

    def start_count_documents(self, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        return self._start(
            lambda: classify_count_documents(filter, args, kwargs, self.codec), check=lambda: check_collation(kwargs)
        )

    def start_estimated_document_count(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        return self._start(lambda: classify_estimated_document_count(args, kwargs))

    def start_distinct(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        return self._start(
            lambda: classify_distinct(key, args, kwargs, self.codec), check=lambda: check_collation(kwargs)
        )

    def start_find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        """``find(*args, **kwargs)``; a HIT's value is the list of documents."""
        return self._start(
            lambda: classify_find(args, kwargs, self.codec), check=lambda: check_find(self.raw, args, kwargs)
        )

    def start_aggregate(self, pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Step:
        """``aggregate(pipeline, *args, **kwargs)``; a HIT's value is the list
        of documents."""
        return self._start(
            lambda: classify_aggregate(pipeline, args, kwargs, self.codec), check=lambda: check_aggregate(kwargs)
        )

    def _start(
        self,
        classify: Callable[[], ReadPlan | BypassReason],
        looked_up: Any = None,
        check: Callable[[], None] | None = None,
    ) -> Step:
        """Classify a read and look it up. ``check`` raises what PyMongo
        raises for the read's arguments before any I/O; it runs before the
        lookup of a cacheable read (a bypass is PyMongo's to check), so that
        a hit raises what a miss raises."""
        if self.generation != self.engine.generation or (
            self.ns.retry_at and time.monotonic() >= self.ns.retry_at
        ):
            # A new owner, or a registration the owner could not answer
            # (gone or hung) is due to be tried again.
            self._bind()
            looked_up = None  # that lookup was in the old owner's arena
        self.native.check()  # CacheClosedError, CacheForkedError
        reason = self.bypass
        if self.bound_session() is not None:
            # PyMongo runs this read in the bound session (or raises for
            # another client's): never from or into the cache.
            reason = BypassReason.SESSION
        elif reason is None and BLOCKS.used:
            token = after_floor()
            if token[0] and not self.engine.after_allows(self.ns.db_idx, token):
                reason = BypassReason.STREAM_BEHIND
        if looked_up is BEHIND and self.engine.holds(self._db_name) and self.engine.release_transactions(
            self._db_name
        ):
            looked_up = None  # refused while a transaction was open: look up again
        if reason is None:
            plan = classify()
            if check is not None and type(plan) is ReadPlan:
                check()
            if type(plan) is ReadPlan and self.ns.collation[1] is not None:
                collated = self._under_default_collation(plan, self.engine.ns_key(self.ns))
                if collated is not plan:
                    plan = collated
                    if looked_up is MISS:
                        self.engine.uncount_miss()  # the fast path's lookup of the plain key
                    looked_up = None
            if type(plan) is ReadPlan:
                result = looked_up
                if result is None:
                    if self.engine.holds(self._db_name):
                        self.engine.release_transactions(self._db_name)
                    if plan.limit:
                        result = self.engine.lookup_limited(self.ns, plan, self.codec)
                    else:
                        result = self.engine.lookup(self.ns, plan, self.codec)
                if result is MISS:
                    return self._after_miss(plan)
                if result is BEHIND:
                    # The entry may be older than what this process has seen
                    # (the causal floor): read MongoDB as a miss, whose
                    # result replaces it or moves its stamp on.
                    return self._after_miss(plan, self.native.peek(self.ns_idx, plan.kind, plan.filter_bytes, plan.rest))
                if result is not UNHEALTHY:
                    return Step(StepKind.HIT, value=_hit_value(plan, result))
                else:
                    reason = BypassReason.STREAM_UNHEALTHY
                    if self.engine.link is not None and self.engine.owner_lost():
                        reason = BypassReason.OWNER_UNAVAILABLE
                        self.engine.maybe_reattach()
            else:
                reason = plan
        self.engine.count_bypass(reason)
        return _BYPASS

    # -- the miss ----------------------------------------------------------------

    def _after_miss(self, plan: ReadPlan, prior: Prior | None = None) -> Step:
        key = self.engine.ns_key(self.ns)
        if self.ns.probe_key != key:
            return Step(StepKind.PROBE, plan=plan, key=key)
        return self._capture(plan, key, prior)

    def probe_filter(self) -> dict[str, Any]:
        """The listCollections filter of a PROBE step."""
        return {"name": self.ns.coll}

    @staticmethod
    def lists_indexes(infos: list[Mapping[str, Any]]) -> bool:
        """Whether a probe lists the indexes too: for a plain collection only
        (a view's or a time-series collection's reads bypass anyway)."""
        return bool(infos) and infos[0].get("type", "collection") == "collection"

    def probed(self, step: Step, infos: list[Mapping[str, Any]], indexes: list[Mapping[str, Any]]) -> Step:
        """Continue after a PROBE step with the listCollections answer and,
        if the collection exists, its listIndexes answer."""
        assert step.plan is not None and step.key is not None
        self.engine.record_probe(self.ns, step.key, infos, indexes)
        return self._capture(step.plan, step.key)

    def _capture(self, plan: ReadPlan, key: tuple[int, int], prior: Prior | None = None) -> Step:
        engine = self.engine
        reason = engine.verdict(self.ns, key)
        if reason is None and self.ns.collation[1] is not None:
            # Looked up before the probe told of a default collation: key
            # the read under it before its token is taken.
            collated = self._under_default_collation(plan, key)
            if type(collated) is not ReadPlan:
                engine.count_bypass(collated)
                return _BYPASS
            plan = collated
        token = None if reason is not None else engine.capture(self.ns, plan, key)
        if token is None:
            engine.count_bypass(reason or BypassReason.STREAM_UNHEALTHY)
            return _BYPASS
        hook = engine.hooks.after_capture
        if hook is not None:
            hook()
        return Step(
            StepKind.READ,
            plan=plan,
            key=key,
            token=token,
            read_id=engine.new_read(),
            started=time.monotonic_ns(),
            prior=prior,
        )

    def _under_default_collation(self, plan: ReadPlan, key: tuple[int, int]) -> ReadPlan | BypassReason:
        """``plan`` keyed under the collection's non-simple default collation
        as probed under ``key`` (``plan`` itself if it has a collation of its
        own or the collection has none): such a read is never validated by an
        identity generation."""
        if plan.collation is not None:
            return plan
        default = self.engine.default_collation(self.ns, key)
        return plan if default is None else plan.collated(default)

    def miss_read(self, step: Step) -> Any:
        """Start a READ step's MongoDB read: its result, or an awaitable of it
        with the async client."""
        plan = step.plan
        assert plan is not None
        target = self.primary_values if plan.kind == KIND_DISTINCT else self.primary
        return getattr(target, plan.method)(*plan.args, **plan.kwargs)

    def finish(self, step: Step, result: Any) -> Any:
        """Admit a READ step's result (if still current) and return what
        PyMongo would have returned."""
        plan = step.plan
        assert plan is not None and step.token is not None
        at = time.monotonic_ns()
        kind = plan.kind
        if kind == KIND_FIND_ONE:
            value = None if result is None else result.raw
        elif kind == KIND_DISTINCT:
            value = bson.encode({"v": result}, codec_options=_VALUES_CODEC)
        else:
            value = bson.encode({"n": result})
        seen = self.observe_read(step, plan, at, None if value is None else bytes(value), -1)
        rebind = (
            value is not None
            and plan.unique_fields is not None
            and self.engine.unique_key(self.ns, step.key, plan.unique_fields)
        )
        self._admit(step, plan, value, seen, rebind)
        if value is None:
            return None
        if kind == KIND_FIND_ONE:
            return decoded(value, decode_document, self.codec)
        if kind == KIND_DISTINCT:
            return _hit_value(plan, decode_bson(value, self.codec))
        return result

    def admit_documents(
        self, step: Step, batches: list[bytes], count: int, oversize: bool, seen: tuple[int, int]
    ) -> None:
        """Admit the complete result of a ``find`` or ``aggregate`` miss (its
        cursor was exhausted): the raw batches, ``count`` documents in all.
        A ``find`` that returned fewer documents than its limit returned
        every match: it is admitted without its limit, where any limit's
        read finds its prefix."""
        plan = step.plan
        assert plan is not None and step.token is not None
        if oversize:
            self.engine.count_oversize()
            return
        if plan.limit and count < plan.limit:
            plan = plan.unlimited()
        self._admit(step, plan, b"".join(batches), seen)

    def _admit(
        self, step: Step, plan: ReadPlan, value: bytes | None, seen: tuple[int, int], rebind: bool = False
    ) -> None:
        """Admit under ``step``'s token, stamped with the read's start and
        ``seen`` (the bounds of its last observation, observe_read)."""
        assert step.token is not None
        hook = self.engine.hooks.before_admit
        if hook is not None:
            hook()
        try:
            stamp = (step.started, seen[1], seen[0], step.read_id, self.engine.ordered)
            self.engine.admit(plan, step.token, value, rebind, stamp)
        except CacheClosedError:
            pass  # closed while this read was in flight: return it, cache nothing

    def count_bypass(self, reason: BypassReason) -> None:
        self.engine.count_bypass(reason)

    def new_read(self) -> int:
        """A read id for an operation of this collection about to be sent."""
        return self.engine.new_read()

    def observe(self, read_id: int = 0) -> tuple[int, int]:
        """A read or write of this collection (read ``read_id``) came back
        from MongoDB: an observation of its namespace (coherence rule 7);
        its bounds."""
        return self.engine.observe(self._db_name, read_id, self.ns)

    def observe_read(
        self, step: Step, plan: ReadPlan, at: int | None = None, result: Any = _WHOLE, offset: int = 0
    ) -> tuple[int, int]:
        """A miss's read (or one batch of it: ``result``'s bytes at
        ``offset`` of the whole; -1: ``result`` is the whole) came back: an observation of the one
        document of a read by ``{"_id": v}`` (the C core tells it from the
        filter, as it tells identity entries), else of the namespace.
        Returns the read's bounds (for its stamp). A read the floor sent
        here that returned what the refused entry holds (``step.prior``)
        saw nothing newer than that entry: it is observed as a hit of it
        (floor.h), bounded by the entry's stamp."""
        at = time.monotonic_ns() if at is None else at
        prior = step.prior
        if prior is not None and result is not _WHOLE and _same_part(prior[0], result, offset):
            self.engine.observe(self._db_name, prior[3], self.ns, plan.filter_bytes, prior[2], prior[1])
            return self.engine.client_time(), at
        step.prior = None  # it differs: every later part is observed anew
        whole = (plan.kind, plan.rest, result) if result is not _WHOLE and offset == -1 else None
        return self.engine.observe(self._db_name, step.read_id, self.ns, plan.filter_bytes, at=at, result=whole)

    def observe_written(self, pipeline: Any) -> None:
        """An aggregation ``pipeline`` of this collection ran (a bypass): the
        databases its ``$out`` or ``$merge`` wrote into are observed too
        (every database the process knows, if a target cannot be read)."""
        self.engine.observe_written(self._db_name, pipeline)

    def observe_write(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A view's write ``method(*args, **kwargs)`` went to MongoDB: an
        observation of the one document of a write by exactly ``{"_id": v}``
        (without a collation), of the whole database for ``drop`` and
        ``rename``, else of the namespace. One in a transaction (a
        ``session`` argument, or a bound session, in a transaction) holds the
        database back until the transaction has ended."""
        session = kwargs.get("session")
        if session is None:
            session = next((a for a in args if isinstance(a, _SESSION_TYPES)), None) or self.bound_session()
        if session is not None and getattr(session, "in_transaction", False):
            self.engine.hold_for_transaction(self._db_name, session)
        read_id = self.engine.new_read()
        if method in _NAMESPACE_WRITES:
            self.engine.observe(self._db_name, read_id)
            return
        if method in _ONE_DOCUMENT_WRITES and kwargs.get("collation") is None:
            flt = args[0] if args else kwargs.get("filter")
            if type(flt) is dict and len(flt) == 1 and "_id" in flt:
                try:
                    encoded = bson.encode(flt, codec_options=self.codec)
                except (bson.errors.BSONError, TypeError, ValueError, OverflowError):
                    encoded = None
                if encoded is not None:
                    bounds = self.engine.observe(self._db_name, read_id, self.ns, encoded)
                    self.engine.invalidate_written(self._db_name, self.ns, encoded, bounds)
                    return
        bounds = self.observe(read_id)
        self.engine.invalidate_written(self._db_name, self.ns, None, bounds)


def _same_part(entry: bytes | None, part: Any, offset: int) -> bool:
    """Whether ``part`` (bytes, or None for "not found") is what ``entry``
    holds at ``offset`` (-1: ``part`` is the whole result)."""
    if entry is None or part is None:
        return entry is None and part is None
    if offset < 0:
        return entry == part
    return entry[offset : offset + len(part)] == part


def _hit_value(plan: ReadPlan, entry: Any) -> Any:
    """A method's result from its decoded entry."""
    kind = plan.kind
    if kind == KIND_FIND_ONE or entry is None:
        return entry
    if kind == KIND_FIND or kind == KIND_AGGREGATE:
        return entry[: plan.limit] if plan.limit else entry  # a list of documents
    return entry["v"] if kind == KIND_DISTINCT else entry["n"]
