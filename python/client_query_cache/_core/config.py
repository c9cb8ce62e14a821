"""Validated configuration of a cache manager."""

from __future__ import annotations

import dataclasses
import math

from .errors import CacheConfigurationError

__all__ = [
    "CacheConfig",
    "MiB",
    "check_connection_string",
    "check_owner_options",
    "check_seconds",
    "default_slot_count",
]

MiB = 1024 * 1024
_MIN_BUDGET = 64 * 1024
_MAX_BUDGET = 0xF0000000  # the arena addresses payload with 32-bit offsets
_MIN_AWAIT_MS, _MAX_AWAIT_MS = 10, 60_000
_MIN_SLOTS, _MAX_SLOTS = 64, 1 << 26
_MAX_TEMPLATE_BYTES = 1 << 40


def _int_arg(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheConfigurationError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise CacheConfigurationError(f"{name} must be between {low} and {high}, got {value}")
    return value


def check_seconds(name: str, value: object) -> float:
    """A duration argument: a finite, non-negative int or float (not a bool:
    ``True`` is no number of seconds). NaN would never compare as elapsed."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise CacheConfigurationError(f"{name} must be a finite non-negative number of seconds, got {value!r}")
    return float(value)


def check_connection_string(name: str, value: object) -> str:
    """A ``mongodb://`` or ``mongodb+srv://`` connection string whose hosts,
    ports and user information parse (options are left to the driver that
    uses it: libmongoc knows some that PyMongo does not). The message never
    quotes the string, which may hold a password."""
    if not isinstance(value, str) or not value.startswith(("mongodb://", "mongodb+srv://")):
        raise CacheConfigurationError(f"{name} must be a 'mongodb://' or 'mongodb+srv://' connection string")
    try:
        from pymongo.uri_parser_shared import _validate_uri
    except ImportError:  # a PyMongo without it: the prefix check only
        return value
    try:
        _validate_uri(value, validate=False)  # no DNS lookup for mongodb+srv
    except Exception:
        raise CacheConfigurationError(f"{name} is not a valid MongoDB connection string") from None
    return value


#: The most namespaces an arena's table holds (csrc/arena.c: 1,024 cells,
#: filled to three quarters).
MAX_NAMESPACES = 768


def check_max_namespaces(name: str, value: object) -> None:
    """None (the arena's table is the only limit) or 1..MAX_NAMESPACES."""
    if value is not None:
        _int_arg(name, value, 1, MAX_NAMESPACES)


#: What ``stream_scope`` may be: one deployment-wide change stream for every
#: database the cache serves, or one stream per database (csrc/stream.h).
STREAM_SCOPES = ("deployment", "database")


def check_stream_scope(name: str, value: object) -> int:
    """``stream_scope``'s value, as the native cache takes it (0, 1)."""
    if not isinstance(value, str) or value not in STREAM_SCOPES:
        raise CacheConfigurationError(f"{name} must be 'deployment' or 'database', not {value!r}")
    return STREAM_SCOPES.index(value)


def check_owner_options(
    *,
    arena_bytes: object,
    budget_bytes: object,
    slots: object,
    max_entry_bytes: object,
    max_await_time_ms: object,
    prefix: str = "",
) -> None:
    """The geometry and settings of a shared cache's owner, as
    ``SharedCache.start`` and ``SharedCacheConfig`` name them (``slots``, not
    ``slot_count``); the ranges are ``CacheConfig``'s."""
    budget = _int_arg(prefix + "budget_bytes", budget_bytes, _MIN_BUDGET, _MAX_BUDGET)
    _int_arg(prefix + "max_entry_bytes", max_entry_bytes, 1, budget // 4)
    _int_arg(prefix + "max_await_time_ms", max_await_time_ms, _MIN_AWAIT_MS, _MAX_AWAIT_MS)
    if slots is not None:
        _int_arg(prefix + "slots", slots, _MIN_SLOTS, _MAX_SLOTS)
    if arena_bytes is not None and (
        isinstance(arena_bytes, bool) or not isinstance(arena_bytes, int) or arena_bytes <= 0
    ):
        raise CacheConfigurationError(f"{prefix}arena_bytes must be a positive int or None")


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """Options shared by the sync and async managers.

    ``budget_bytes`` bounds the payload bytes of cached entries; eviction keeps
    the total under it. ``max_entry_bytes`` is the largest document that is
    admitted (larger ones are returned and not cached); the managers default it
    to 1 MiB, or a quarter of a smaller budget. ``max_await_time_ms``
    is how long a change-stream getMore waits for events; a stream that has not
    made progress within ``2 * max_await_time_ms + 2000`` ms stops serving.
    ``slot_count`` is the capacity of the entry table (rounded up to a power of
    two; default: one slot per 512 bytes of budget, at least 1024, so that
    entries of 700 bytes or more fill the budget before the table's 3/4).
    ``max_namespaces`` caps the collections the cache tracks (each costs a
    table cell, and each new database widens the change stream's $match):
    reads of one more bypass with reason ``namespace_limit`` (default None:
    the arena's table, 768 namespaces, is the limit). ``stream_scope``:
    ``"deployment"`` (default) follows every database on one deployment-wide
    change stream; ``"database"`` opens one stream per database, polled in
    turn by the same thread (what the cache falls back to by itself when
    the deployment refuses a deployment-wide stream). ``template_bytes``
    bounds this process's templates of the entries it hits (the objects of
    a hit kept so that the next hits of the entry copy only its containers;
    docs/api.md): an estimate of their objects' size (default 16 MiB; 0
    keeps none).
    """

    budget_bytes: int = 64 * MiB
    max_entry_bytes: int = 1 * MiB
    max_await_time_ms: int = 1000
    slot_count: int | None = None
    stream_uri: str | None = None
    max_namespaces: int | None = None
    stream_scope: str = "deployment"
    template_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        _int_arg("budget_bytes", self.budget_bytes, _MIN_BUDGET, _MAX_BUDGET)
        _int_arg("max_entry_bytes", self.max_entry_bytes, 1, self.budget_bytes // 4)
        _int_arg("max_await_time_ms", self.max_await_time_ms, _MIN_AWAIT_MS, _MAX_AWAIT_MS)
        if self.slot_count is not None:
            _int_arg("slot_count", self.slot_count, _MIN_SLOTS, _MAX_SLOTS)
        if self.stream_uri is not None:
            check_connection_string("stream_uri", self.stream_uri)
        check_max_namespaces("max_namespaces", self.max_namespaces)
        check_stream_scope("stream_scope", self.stream_scope)
        _int_arg("template_bytes", self.template_bytes, 0, _MAX_TEMPLATE_BYTES)

    @staticmethod
    def default_max_entry_bytes(budget_bytes: object) -> int:
        """1 MiB, or a quarter of a smaller budget."""
        if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool):
            return max(1, min(1 * MiB, budget_bytes // 4))
        return 1 * MiB  # the budget's own check reports the bad value

    @property
    def effective_slot_count(self) -> int:
        if self.slot_count is not None:
            return self.slot_count
        return default_slot_count(self.budget_bytes)


def default_slot_count(budget_bytes: int) -> int:
    """The entry table's default capacity: one slot per 512 bytes of budget
    (at least 1024). The table is kept at most 3/4 full, so entries of about
    700 bytes and more (a 64-byte header, the key, the document) fill the
    budget before the table; smaller ones are bound by the table
    (docs/deployment.md, capacity planning)."""
    return max(1024, budget_bytes // 512)
