"""PyMongo's own argument checks, run before a cacheable read is looked up.

PyMongo checks a read's arguments on the client before any I/O (the find
cursor's constructor, the aggregation command's, ``pymongo.common``'s
validators). A read the classifier found cacheable runs the same checks
before its lookup, so a hit raises what a miss and PyMongo raise. Each check
first asks whether every argument has a shape PyMongo surely accepts (a few
type tests: the hot path) and otherwise runs PyMongo's own code, which
raises PyMongo's exception or accepts.

Values only the server judges (``maxTimeMS``, ``allowDiskUse``, an
unencodable ``comment``, ``hint=None`` where PyMongo sends it) are not
checked here: the classifier sends such reads to PyMongo
(``classify.server_accepts``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymongo import common
from pymongo.collation import Collation, validate_collation_or_none

__all__ = ["check_find", "check_find_one", "check_aggregate", "check_collation"]

#: find() keywords whose every value a cacheable plan has, PyMongo accepts:
#: the filter, projection and sort are checked by the classifier, comment
#: and max_time_ms are the server's to judge, a session is None.
_ANY_VALUE = frozenset({"filter", "projection", "sort", "comment", "max_time_ms", "session"})


def _surely_valid_find(kwargs: dict[str, Any]) -> bool:
    """Whether PyMongo's cursor surely accepts these find() keywords of a
    cacheable read (the classifier has let only known names through)."""
    for name, value in kwargs.items():
        if name in _ANY_VALUE:
            continue
        if name == "skip" or name == "limit":
            ok = type(value) is int
        elif name == "batch_size":
            ok = type(value) is int and value >= 0
        elif name == "collation":
            ok = value is None or type(value) is dict or isinstance(value, Collation)
        else:
            # Options of the classifier's _RESULT_OPTIONS, which a cacheable
            # read gives at their default (False, 0 or None) only.
            ok = value is None or value is False or (name == "cursor_type" and type(value) is int and value == 0)
        if not ok:
            return False
    return True


def check_find(collection: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise what ``collection.find(*args, **kwargs)`` raises at the call:
    PyMongo's cursor constructor does no I/O."""
    if not _surely_valid_find(kwargs):
        collection.find(*args, **kwargs)


def check_find_one(collection: Any, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise what ``collection.find_one(filter, *args, **kwargs)`` raises
    before its I/O (PyMongo's find_one builds a find cursor)."""
    if kwargs and not _surely_valid_find(kwargs):
        if filter is not None and not isinstance(filter, Mapping):
            filter = {"_id": filter}
        collection.find(filter, *args, **kwargs)


def check_collation(kwargs: dict[str, Any]) -> None:
    """Raise what PyMongo raises for the ``collation`` of count_documents,
    distinct and aggregate."""
    collation = kwargs.get("collation")
    if collation is not None and type(collation) is not dict:
        validate_collation_or_none(collation)


def check_aggregate(kwargs: dict[str, Any]) -> None:
    """Raise what PyMongo's aggregation command raises for the keywords of
    a cacheable ``aggregate`` (its pipeline is a list and its ``let`` a
    mapping, or it would not be cacheable)."""
    batch_size = kwargs.get("batchSize")
    if batch_size is not None and not (type(batch_size) is int and batch_size >= 0):
        common.validate_non_negative_integer_or_none("batchSize", batch_size)
    check_collation(kwargs)
