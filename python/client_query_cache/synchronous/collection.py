"""Cached views of PyMongo's synchronous Database and Collection."""

from __future__ import annotations

from typing import Any

from bson.raw_bson import RawBSONDocument
from pymongo.collection import Collection
from pymongo.database import Database
from pymongo.read_concern import ReadConcern
from pymongo.read_preferences import ReadPreference

from .._core.classify import FAST_ID_TYPES, FindOnePlan, classify_find_one, collection_bypass
from .._core.engine import FALLBACK, MISS, UNHEALTHY, Engine, decode_bson
from .._core.reasons import BypassReason

__all__ = ["CachedDatabase", "CachedCollection"]

_ABSENT = object()  # not of a FAST_ID_TYPES type


class CachedDatabase:
    """A database whose collections read through the cache."""

    __slots__ = ("_engine", "_raw")

    def __init__(self, engine: Engine, database: Database[Any]) -> None:
        self._engine = engine
        self._raw = database

    @property
    def raw(self) -> Database[Any]:
        """The wrapped PyMongo database."""
        return self._raw

    @property
    def name(self) -> str:
        return self._raw.name

    def __getitem__(self, name: str) -> CachedCollection:
        return self.get_collection(name)

    def get_collection(self, name: str, **options: Any) -> CachedCollection:
        return CachedCollection(self._engine, self._raw.get_collection(name, **options))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._raw, name)

    def __repr__(self) -> str:
        return f"CachedDatabase({self._raw!r})"


class CachedCollection:
    """A PyMongo collection whose safe reads are served from the cache.

    ``find_one`` by ``_id`` is cached; every other read is passed to PyMongo
    unchanged and counted as a bypass. Writes and other attributes are the
    wrapped collection's (``.raw``).
    """

    __slots__ = ("_engine", "_native", "_raw", "_primary", "_codec", "_ns", "_bypass", "_fast")

    def __init__(self, engine: Engine, collection: Collection[Any]) -> None:
        self._engine = engine
        self._native = engine.native
        self._raw = collection
        self._codec = collection.codec_options
        # Misses read raw BSON at primary with majority read concern
        # (coherence rule 4), whatever the collection's own settings.
        self._primary = collection.with_options(
            codec_options=collection.codec_options.with_options(document_class=RawBSONDocument),
            read_preference=ReadPreference.PRIMARY,
            read_concern=ReadConcern("majority"),
        )
        self._bypass = collection_bypass(collection)
        self._ns = engine.namespace(collection.database.name, collection.name)
        if self._bypass is None and self._ns.unavailable:
            self._bypass = BypassReason.NAMESPACE_UNAVAILABLE
        self._fast = self._bypass is None

    @property
    def raw(self) -> Collection[Any]:
        """The wrapped PyMongo collection."""
        return self._raw

    @property
    def name(self) -> str:
        return self._raw.name

    @property
    def full_name(self) -> str:
        return self._raw.full_name

    def with_options(self, **options: Any) -> CachedCollection:
        return CachedCollection(self._engine, self._raw.with_options(**options))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._raw, name)

    def __repr__(self) -> str:
        return f"CachedCollection({self._raw!r})"

    # -- find_one -----------------------------------------------------------

    def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``, served from the cache when it is an
        ``{"_id": value}`` lookup that is safe to cache."""
        if self._fast and not args and not kwargs and type(filter) is dict and len(filter) == 1:
            id_value = filter.get("_id", _ABSENT)
            if type(id_value) in FAST_ID_TYPES:
                result = self._native.lookup_id(
                    self._ns.ns_idx, self._ns.db_idx, id_value, self._codec
                )
                if result is MISS:
                    plan = classify_find_one(filter, args, kwargs, self._codec)
                    if type(plan) is FindOnePlan:
                        return self._miss(plan, filter, args, kwargs)
                elif result is not UNHEALTHY and result is not FALLBACK:
                    return result
        return self._find_one_slow(filter, args, kwargs)

    def _find_one_slow(self, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._native.check()  # CacheClosedError, CacheForkedError
        reason = self._bypass
        if reason is None:
            plan = classify_find_one(filter, args, kwargs, self._codec)
            if type(plan) is FindOnePlan:
                result = self._engine.lookup_find_one(self._ns, plan, self._codec)
                if result is MISS:
                    return self._miss(plan, filter, args, kwargs)
                if result is not UNHEALTHY:
                    return result
                reason = BypassReason.STREAM_UNHEALTHY
            else:
                reason = plan
        self._engine.count_bypass(reason)
        return self._raw.find_one(filter, *args, **kwargs)

    def _miss(
        self, plan: FindOnePlan, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        engine, ns = self._engine, self._ns
        key = engine.ns_key(ns)
        if ns.probe_key != key:
            infos = list(
                self._raw.database.with_options(read_preference=ReadPreference.PRIMARY)
                .list_collections(filter={"name": ns.coll})
            )
            engine.record_probe(ns, key, infos)
        reason = engine.verdict(ns, key)
        token = None if reason is not None else engine.capture(ns, plan, key)
        if token is None:
            engine.count_bypass(reason or BypassReason.STREAM_UNHEALTHY)
            return self._raw.find_one(filter, *args, **kwargs)
        hooks = engine.hooks
        if hooks.after_capture is not None:
            hooks.after_capture()
        raw = self._primary.find_one(plan.filter, plan.projection, **plan.read_kwargs)
        if hooks.before_admit is not None:
            hooks.before_admit()
        engine.admit(plan, token, raw)
        return None if raw is None else decode_bson(raw.raw, self._codec)

    # -- reads not cached by this version -----------------------------------

    def _uncached(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._native.check()  # CacheClosedError, CacheForkedError
        self._engine.count_bypass(BypassReason.UNCACHED_METHOD)
        return getattr(self._raw, method)(*args, **kwargs)

    def find(self, *args: Any, **kwargs: Any) -> Any:
        return self._uncached("find", *args, **kwargs)

    def aggregate(self, *args: Any, **kwargs: Any) -> Any:
        return self._uncached("aggregate", *args, **kwargs)

    def count_documents(self, *args: Any, **kwargs: Any) -> Any:
        return self._uncached("count_documents", *args, **kwargs)

    def estimated_document_count(self, *args: Any, **kwargs: Any) -> Any:
        return self._uncached("estimated_document_count", *args, **kwargs)

    def distinct(self, *args: Any, **kwargs: Any) -> Any:
        return self._uncached("distinct", *args, **kwargs)
