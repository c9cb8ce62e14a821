"""A strict comparison of decoded BSON (imported as ``bson_strict``).

``==`` alone cannot tell a document builder's objects from PyMongo's: it
treats ``1 == 1.0 == True``, ``Int64(1) == 1``, ``{"a": 1, "b": 2} ==
{"b": 2, "a": 1}``, ``Binary(b"x", 0) == b"x"``, and a NaN is not equal to
itself. ``strict_difference`` compares type, value and key order,
recursively, and says where two objects first differ. ``as_batch_elements``
decodes documents as PyMongo's cursors do (as elements of a reply's batch),
the reference of the cache's decode_document and decode_documents. The fuzz
target of the builder (tests/fuzz/fuzz_build.c) imports both.
"""

from __future__ import annotations

import datetime
import struct
from typing import Any

from bson.binary import Binary
from bson.code import Code
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

__all__ = ["strict_difference", "assert_strict_equal"]


def strict_difference(a: Any, b: Any, path: str = "$") -> str | None:
    """Where ``a`` and ``b`` first differ in type, value or key order (a
    path and what differs), or None when they are the same."""
    if type(a) is not type(b):
        return f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if type(a) is dict:
        if list(a) != list(b):
            return f"{path}: keys {list(a)!r} != {list(b)!r}"
        for key in a:
            if type(key) is not str:
                return f"{path}: key {key!r} of type {type(key).__name__}"
            found = strict_difference(a[key], b[key], f"{path}.{key}")
            if found:
                return found
        return None
    if type(a) is list:
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = strict_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return _leaf_difference(a, b, path)


def _leaf_difference(a: Any, b: Any, path: str) -> str | None:
    t = type(a)
    if t is float:
        # Bit for bit: -0.0 is not 0.0, and each NaN keeps its payload.
        same = struct.pack("<d", a) == struct.pack("<d", b)
    elif t is datetime.datetime:
        same = a == b and a.tzinfo is b.tzinfo and a.fold == b.fold and repr(a) == repr(b)
    elif t is ObjectId:
        same = a.binary == b.binary
    elif t is Binary:
        same = bytes(a) == bytes(b) and a.subtype == b.subtype
    elif t is Code:
        same = str(a) == str(b)
        if same:
            return strict_difference(a.scope, b.scope, f"{path}.scope")
    elif t is Regex:
        same = strict_difference(a.pattern, b.pattern) is None and strict_difference(a.flags, b.flags) is None
    elif t is DBRef:
        for name in ("collection", "id", "database"):
            found = strict_difference(getattr(a, name), getattr(b, name), f"{path}.{name}")
            if found:
                return found
        return strict_difference(a._DBRef__kwargs, b._DBRef__kwargs, f"{path}.kwargs")  # type: ignore[attr-defined]
    elif t is Timestamp:
        same = (a.time, a.inc) == (b.time, b.inc)
    elif t is Decimal128:
        same = a.bid == b.bid
    elif t in (MinKey, MaxKey) or a is None:
        same = True
    elif t in (int, Int64, bool, str, bytes):
        same = a == b
    else:
        return f"{path}: unexpected type {t.__name__}"
    if not same or (t is not float and repr(a) != repr(b)):
        return f"{path}: {a!r} != {b!r}"
    return None


def as_batch_elements(data: bytes, codec_options: Any, many: bool) -> Any:
    """The document of ``data`` (``many`` false) or the list of documents
    laid end to end in it, decoded as PyMongo's cursor decodes a reply: each
    one an element of the batch array of a document, here
    ``{"b": [d0, d1, ...]}``. Bytes that are not documents laid end to end
    go to PyMongo's top-level decoder (its error)."""
    import bson

    docs, pos = [], 0
    while pos < len(data):
        size = struct.unpack_from("<i", data, pos)[0] if len(data) - pos >= 5 else 0
        if size < 5 or size > len(data) - pos:
            break
        docs.append(data[pos : pos + size])
        pos += size
    if pos != len(data) or (not many and len(docs) != 1):
        return (bson._decode_all if many else bson._bson_to_dict)(data, codec_options)
    array = b"".join(b"\x03" + str(i).encode() + b"\x00" + doc for i, doc in enumerate(docs))
    array = struct.pack("<i", len(array) + 5) + array + b"\x00"
    outer = b"\x04b\x00" + array
    decoded = bson._bson_to_dict(struct.pack("<i", len(outer) + 5) + outer + b"\x00", codec_options)["b"]
    return list(decoded) if many else decoded[0]


def assert_strict_equal(a: Any, b: Any) -> None:
    found = strict_difference(a, b)
    assert found is None, found


def _self_check() -> None:
    """The comparer itself tells apart what ``==`` confuses."""
    assert strict_difference(1, 1.0) and strict_difference(1, True) and strict_difference(Int64(1), 1)
    assert strict_difference({"a": 1, "b": 2}, {"b": 2, "a": 1})
    assert strict_difference(Binary(b"x", 0), b"x") and strict_difference(0.0, -0.0)
    assert strict_difference(float("nan"), float("nan")) is None
    assert strict_difference(Code("f", {"a": 1}), Code("f", {"a": Int64(1)}))
    assert strict_difference(DBRef("c", 1, x=1), DBRef("c", 1, x=1.0))


_self_check()
