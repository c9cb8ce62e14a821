"""Classification of reads: cacheable (with a canonical key) or a bypass reason.

Pure functions of the call's arguments and the collection's options; no I/O.
The key of a ``find_one`` is the BSON of ``{"_id": value}`` (encoded with the
collection's codec options, exactly as PyMongo sends it) plus the projection.
Codec options that only affect decoding are not part of the key: the cache
stores raw BSON and decodes every hit with the caller's codec options.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import bson
from bson.binary import Binary
from bson.codec_options import CodecOptions
from bson.int64 import Int64
from bson.objectid import ObjectId
from pymongo.read_preferences import ReadPreference

from .reasons import BypassReason

__all__ = ["FindOnePlan", "classify_find_one", "collection_bypass", "KIND_FIND_ONE", "FAST_ID_TYPES"]

KIND_FIND_ONE = 1

#: _id types the C fast path encodes itself (must match module.c).
FAST_ID_TYPES = frozenset({int, str, ObjectId})

#: _id types cached as identity reads: those whose BSON equality the C core
#: canonicalizes (numbers by value, strings, ObjectId, bool, dates, binary).
_IDENTITY_ID_TYPES = frozenset(
    {int, float, str, ObjectId, bool, datetime.datetime, bytes, Binary, uuid.UUID, Int64}
)

# find() options that change the result of find_one unless left at their
# default; a non-default value bypasses.
_RESULT_OPTIONS: dict[str, Any] = {
    "skip": 0,
    "no_cursor_timeout": False,
    "cursor_type": 0,
    "sort": None,
    "allow_partial_results": False,
    "oplog_replay": False,
    "collation": None,
    "hint": None,
    "max_scan": None,
    "max": None,
    "min": None,
    "return_key": None,
    "show_record_id": None,
    "snapshot": None,
    "allow_disk_use": None,
    "let": None,
}
# Options that do not change the document returned: passed to the miss read.
# (find_one always reads with limit -1, whatever limit says.)
_NEUTRAL_OPTIONS = frozenset({"batch_size", "comment", "max_time_ms", "limit"})


class FindOnePlan:
    """A cacheable ``find_one``: its canonical key parts and how to read it."""

    __slots__ = ("filter", "filter_bytes", "projection", "rest", "read_kwargs")

    def __init__(
        self,
        filter: dict[str, Any],
        filter_bytes: bytes,
        projection: dict[str, Any] | None,
        rest: bytes,
        read_kwargs: dict[str, Any],
    ) -> None:
        self.filter = filter
        self.filter_bytes = filter_bytes
        self.projection = projection
        self.rest = rest
        self.read_kwargs = read_kwargs


def collection_bypass(collection: Any) -> BypassReason | None:
    """Reasons that make every read of this collection object bypass."""
    if collection.read_preference != ReadPreference.PRIMARY:
        return BypassReason.READ_PREFERENCE
    level = collection.read_concern.level
    if level not in (None, "majority"):
        return BypassReason.READ_CONCERN
    if collection.name.startswith("system."):
        return BypassReason.UNSUPPORTED_COLLECTION
    return None


def _has_meta(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(k == "$meta" or _has_meta(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_meta(v) for v in value)
    return False


def _normalize_projection(projection: Any) -> dict[str, Any] | BypassReason:
    if isinstance(projection, Mapping):
        if _has_meta(projection):
            return BypassReason.NONDETERMINISTIC
        return dict(projection)
    if isinstance(projection, (list, tuple)) and all(isinstance(f, str) for f in projection):
        return {f: 1 for f in projection}
    return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError


def classify_find_one(
    filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> FindOnePlan | BypassReason:
    """Decide whether ``find_one(filter, *args, **kwargs)`` can be cached."""
    projection = None
    if args:
        if len(args) > 1:
            return BypassReason.UNSUPPORTED_OPTION
        projection = args[0]
    read_kwargs: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name == "projection":
            if args:
                return BypassReason.UNKNOWN_OPTION  # given twice: PyMongo raises
            projection = value
        elif name == "session":
            if value is not None:
                return BypassReason.SESSION
        elif name in _NEUTRAL_OPTIONS:
            read_kwargs[name] = value
        elif name in _RESULT_OPTIONS:
            if value != _RESULT_OPTIONS[name]:
                return BypassReason.UNSUPPORTED_OPTION
        else:
            return BypassReason.UNKNOWN_OPTION

    if filter is None:
        return BypassReason.NOT_IDENTITY_FILTER
    if not isinstance(filter, Mapping):
        filter = {"_id": filter}  # PyMongo's find_one(value) shorthand
    if len(filter) != 1 or "_id" not in filter:
        return BypassReason.NOT_IDENTITY_FILTER
    id_value = filter["_id"]
    if type(id_value) not in _IDENTITY_ID_TYPES:
        return BypassReason.UNSUPPORTED_ID_TYPE
    canonical = {"_id": id_value}

    if projection is not None:
        normalized = _normalize_projection(projection)
        if isinstance(normalized, BypassReason):
            return normalized
        projection = normalized
    try:
        filter_bytes = bson.encode(canonical, codec_options=codec_options)
        rest = b"" if projection is None else b"P" + bson.encode(projection, codec_options=codec_options)
    except (bson.errors.BSONError, TypeError, ValueError, OverflowError):
        return BypassReason.UNENCODABLE
    return FindOnePlan(canonical, filter_bytes, projection, rest, read_kwargs)
