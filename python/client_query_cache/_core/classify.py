"""Classification of reads: cacheable (with a canonical key) or a bypass reason.

Pure functions of the call's arguments and the collection's options; no I/O.

A cacheable read becomes a :class:`ReadPlan`: its kind, its key parts and the
call that reads it from MongoDB on a miss. The key is ``(kind, namespace,
filter BSON, rest)``: the filter encoded with the collection's codec options,
exactly as PyMongo sends it (top-level fields sorted when the filter is a flat
equality filter, so that their permutations share an entry), and ``rest``, the
options that change the result, tagged and encoded. Codec options that only
affect decoding are not part of the key: the cache stores raw BSON and decodes
every hit with the caller's codec options.

Whether an entry is validated by an identity generation (it depends on one
document) or by the namespace's write generation is decided by the C core from
the filter bytes: exactly ``{"_id": v}`` with a canonicalizable ``v``.

A read is cacheable only when its result is a function of the collection's
documents: operators that are not (``$where``, ``$text``, ``$rand``,
``$$NOW``, ``$meta``, ...) bypass as ``nondeterministic``, and operators the
classifier does not know bypass as ``unknown_operator``. Malformed reads are
left to the miss read, which raises what PyMongo raises.
"""

from __future__ import annotations

import datetime
import struct
import uuid
from collections.abc import Mapping
from typing import Any

import bson
from bson.binary import Binary
from bson.codec_options import CodecOptions
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from pymongo.collation import Collation
from pymongo.read_preferences import ReadPreference

from .reasons import BypassReason

__all__ = [
    "ReadPlan",
    "classify_find_one",
    "classify_id",
    "classify_count_documents",
    "classify_estimated_document_count",
    "classify_distinct",
    "classify_find",
    "classify_aggregate",
    "collection_bypass",
    "written_databases",
    "KIND_FIND_ONE",
    "KIND_COUNT_DOCUMENTS",
    "KIND_ESTIMATED_COUNT",
    "KIND_DISTINCT",
    "KIND_FIND",
    "KIND_AGGREGATE",
]

# The first byte of a key: which method's result an entry holds.
KIND_FIND_ONE = 1
KIND_COUNT_DOCUMENTS = 2
KIND_ESTIMATED_COUNT = 3
KIND_DISTINCT = 4
# Kinds from KIND_FIND on hold a sequence of documents (a cursor's result).
KIND_FIND = 5
KIND_AGGREGATE = 6

_EMPTY_DOC = bson.encode({})
_PLAIN: CodecOptions[Any] = CodecOptions()

# find() options that change the result of find_one unless left at their
# default; a non-default value bypasses. (sort and skip are part of the key.)
_RESULT_OPTIONS: dict[str, Any] = {
    "no_cursor_timeout": False,
    "cursor_type": 0,
    "allow_partial_results": False,
    "oplog_replay": False,
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


class ReadPlan:
    """A cacheable read: its key parts and the PyMongo call that reads it.

    ``method``, ``args`` and ``kwargs`` are the call made on the collection
    that reads misses (primary, majority, raw BSON).
    """

    __slots__ = (
        "kind", "filter_bytes", "rest", "method", "args", "kwargs", "limit", "unlimited_rest",
        "unique_fields", "collation",
    )  # fmt: skip

    def __init__(
        self,
        kind: int,
        filter_bytes: bytes,
        rest: bytes,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.kind = kind
        self.filter_bytes = filter_bytes
        self.rest = rest
        self.method = method
        self.args = args
        self.kwargs = kwargs
        #: ``find`` with a positive limit: the limit, and the key's rest
        #: without it (the entry of the same read without a limit, whose
        #: prefix serves this one).
        self.limit = 0
        self.unlimited_rest = rest
        #: find_one whose filter is an equality on these fields only, with
        #: values a unique index compares like the query does, and whose
        #: result keeps its _id: if a unique index has exactly these fields,
        #: the document found is the only one that can match.
        self.unique_fields: frozenset[str] | None = None
        #: The collation the read runs under, if any (given, or the
        #: collection's default): part of the filter bytes, see collated().
        self.collation: Any = None

    def unlimited(self) -> ReadPlan:
        """The same ``find`` without its limit."""
        kwargs = {k: v for k, v in self.kwargs.items() if k != "limit"}
        plan = ReadPlan(self.kind, self.filter_bytes, self.unlimited_rest, self.method, self.args, kwargs)
        plan.collation = self.collation
        return plan

    def collated(self, collation: Any) -> ReadPlan | BypassReason:
        """The same read under ``collation``: the key's filter part becomes
        ``{"collation": ..., "filter": <filter>}``. That is never an identity
        filter, so the entry is validated by the namespace's write
        generation: under a collation, ``{"_id": "a"}`` also matches "A",
        whose writes move another identity generation."""
        if isinstance(collation, Collation):
            collation = collation.document
        if not isinstance(collation, Mapping):
            return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError
        wrapped = _encode({"collation": collation, "filter": RawBSONDocument(self.filter_bytes)}, _PLAIN)
        if wrapped is None:
            return BypassReason.UNENCODABLE
        plan = ReadPlan(self.kind, wrapped, self.rest, self.method, self.args, self.kwargs)
        plan.limit, plan.unlimited_rest, plan.collation = self.limit, self.unlimited_rest, collation
        return plan


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


# -- determinism ------------------------------------------------------------------

# Query operators whose operand is a literal (nothing to walk).
_FIELD_OPERATORS = frozenset(
    {
        "$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$exists", "$type",
        "$mod", "$regex", "$options", "$all", "$size",
        "$bitsAllSet", "$bitsAnySet", "$bitsAllClear", "$bitsAnyClear",
    }
)  # fmt: skip
_LOGICAL_OPERATORS = frozenset({"$and", "$or", "$nor"})
# Operators whose result is not a function of the stored documents.
_NONDETERMINISTIC_OPERATORS = frozenset(
    {"$where", "$text", "$function", "$accumulator", "$rand", "$sampleRate", "$meta"}
)
_NONDETERMINISTIC_VARIABLES = frozenset({"NOW", "CLUSTER_TIME", "USER_ROLES", "SEARCH_META"})
# Aggregation expression operators (deterministic).
_EXPRESSION_OPERATORS = frozenset(
    {
        "$abs", "$acos", "$acosh", "$add", "$allElementsTrue", "$and", "$anyElementTrue",
        "$arrayElemAt", "$arrayToObject", "$asin", "$asinh", "$atan", "$atan2", "$atanh", "$avg",
        "$binarySize", "$bitAnd", "$bitNot", "$bitOr", "$bitXor", "$bsonSize", "$ceil", "$cmp",
        "$concat", "$concatArrays", "$cond", "$convert", "$cos", "$cosh", "$dateAdd", "$dateDiff",
        "$dateFromParts", "$dateFromString", "$dateSubtract", "$dateToParts", "$dateToString",
        "$dateTrunc", "$dayOfMonth", "$dayOfWeek", "$dayOfYear", "$degreesToRadians", "$divide",
        "$eq", "$exp", "$filter", "$first", "$firstN", "$floor", "$getField", "$gt", "$gte",
        "$hour", "$ifNull", "$in", "$indexOfArray", "$indexOfBytes", "$indexOfCP", "$isArray",
        "$isNumber", "$isoDayOfWeek", "$isoWeek", "$isoWeekYear", "$last", "$lastN", "$let",
        "$literal", "$ln", "$log", "$log10", "$lt", "$lte", "$ltrim", "$map", "$max", "$maxN",
        "$mergeObjects", "$millisecond", "$min", "$minN", "$minute", "$mod", "$month",
        "$multiply", "$ne", "$not", "$objectToArray", "$or", "$pow", "$radiansToDegrees",
        "$range", "$reduce", "$regexFind", "$regexFindAll", "$regexMatch", "$replaceAll",
        "$replaceOne", "$reverseArray", "$round", "$rtrim", "$second", "$setDifference",
        "$setEquals", "$setField", "$setIntersection", "$setIsSubset", "$setUnion", "$size",
        "$sin", "$sinh", "$slice", "$sortArray", "$split", "$sqrt", "$stdDevPop", "$stdDevSamp",
        "$strcasecmp", "$strLenBytes", "$strLenCP", "$substr", "$substrBytes", "$substrCP",
        "$subtract", "$sum", "$switch", "$tan", "$tanh", "$toBool", "$toDate", "$toDecimal",
        "$toDouble", "$toInt", "$toLong", "$toLower", "$toObjectId", "$toString", "$toUpper",
        "$trim", "$trunc", "$tsIncrement", "$tsSecond", "$type", "$unsetField", "$week",
        "$year", "$zip",
    }
)  # fmt: skip
# Projection operators besides expressions.
_PROJECTION_OPERATORS = frozenset({"$elemMatch", "$slice"})


def check_expression(expr: Any, extra: frozenset[str] = frozenset()) -> BypassReason | None:
    """Why an aggregation expression is not cacheable (None if it is)."""
    if isinstance(expr, str):
        if expr.startswith("$$"):
            if expr[2:].split(".", 1)[0] in _NONDETERMINISTIC_VARIABLES:
                return BypassReason.NONDETERMINISTIC
        return None
    if isinstance(expr, Mapping):
        for key, value in expr.items():
            if isinstance(key, str) and key.startswith("$"):
                if key in _NONDETERMINISTIC_OPERATORS:
                    return BypassReason.NONDETERMINISTIC
                if key == "$literal":
                    continue  # its operand is data, not an expression
                if key == "$elemMatch" and key in extra:
                    reason = check_filter(value) if isinstance(value, Mapping) else None
                    if reason is not None:
                        return reason
                    continue
                if key not in _EXPRESSION_OPERATORS and key not in extra:
                    return BypassReason.UNKNOWN_OPERATOR
            reason = check_expression(value, extra)
            if reason is not None:
                return reason
        return None
    if isinstance(expr, (list, tuple)):
        for item in expr:
            reason = check_expression(item, extra)
            if reason is not None:
                return reason
    return None


def _is_operator_document(value: Any) -> bool:
    return isinstance(value, Mapping) and any(isinstance(k, str) and k.startswith("$") for k in value)


def _check_operators(operators: Mapping[Any, Any]) -> BypassReason | None:
    """``{"$gt": 1, ...}`` as the value of a field."""
    for op, operand in operators.items():
        if op in _FIELD_OPERATORS:
            continue
        if op == "$not":
            if _is_operator_document(operand):
                reason = _check_operators(operand)
                if reason is not None:
                    return reason
            continue  # a regular expression, or an error the server reports
        if op == "$elemMatch":
            # Its operand holds operators on the element itself ({"$gt": 1})
            # and/or a filter on the element's fields ({"a": 1, "$or": ...}).
            if isinstance(operand, Mapping):
                for k, v in operand.items():
                    if k in _FIELD_OPERATORS or k in ("$not", "$elemMatch"):
                        reason = _check_operators({k: v})
                    else:
                        reason = check_filter({k: v})
                    if reason is not None:
                        return reason
            continue
        if op in _NONDETERMINISTIC_OPERATORS:
            return BypassReason.NONDETERMINISTIC
        return BypassReason.UNKNOWN_OPERATOR
    return None


def check_filter(filter: Mapping[Any, Any]) -> BypassReason | None:
    """Why a query filter is not cacheable (None if it is)."""
    for key, value in filter.items():
        if not isinstance(key, str):
            return BypassReason.UNENCODABLE
        if key.startswith("$"):
            if key in _LOGICAL_OPERATORS:
                if isinstance(value, (list, tuple)):
                    for clause in value:
                        if isinstance(clause, Mapping):
                            reason = check_filter(clause)
                            if reason is not None:
                                return reason
                continue  # anything else is an error the server reports
            if key == "$expr":
                reason = check_expression(value)
            elif key == "$comment":
                reason = None
            elif key in _NONDETERMINISTIC_OPERATORS:
                reason = BypassReason.NONDETERMINISTIC
            else:
                reason = BypassReason.UNKNOWN_OPERATOR
        elif _is_operator_document(value):
            reason = _check_operators(value)
        else:
            reason = None  # equality with a literal (documents included)
        if reason is not None:
            return reason
    return None


# Accumulators of $group, $bucket, $bucketAuto and $setWindowFields besides
# the expression operators of the same name ($sum, $avg, $min, ...).
_ACCUMULATORS = frozenset(
    {"$push", "$addToSet", "$count", "$top", "$bottom", "$topN", "$bottomN", "$median", "$percentile"}
)
# Stages whose operand is checked as an expression.
_EXPRESSION_STAGES = frozenset(
    {
        "$project", "$addFields", "$set", "$replaceRoot", "$replaceWith", "$redact", "$group",
        "$bucket", "$bucketAuto", "$sortByCount", "$unwind", "$sort",
    }
)  # fmt: skip
# Stages with a literal operand.
_LITERAL_STAGES = frozenset({"$limit", "$skip", "$count", "$unset"})
_NONDETERMINISTIC_STAGES = frozenset(
    {
        "$sample", "$collStats", "$indexStats", "$planCacheStats", "$currentOp", "$listSessions",
        "$listLocalSessions", "$changeStream", "$search", "$searchMeta", "$vectorSearch",
    }
)  # fmt: skip
_OTHER_COLLECTION_STAGES = frozenset({"$lookup", "$graphLookup", "$unionWith"})
_WRITE_STAGES = frozenset({"$out", "$merge"})


def check_pipeline(pipeline: list[Any]) -> BypassReason | None:
    """Why an aggregation pipeline is not cacheable (None if it is)."""
    for stage in pipeline:
        if not isinstance(stage, Mapping) or len(stage) != 1:
            return BypassReason.UNKNOWN_OPERATOR  # the server rejects it
        ((name, spec),) = stage.items()
        if name == "$match":
            reason = check_filter(spec) if isinstance(spec, Mapping) else None
        elif name in _EXPRESSION_STAGES:
            reason = check_expression(spec, _ACCUMULATORS | _PROJECTION_OPERATORS)
        elif name in _LITERAL_STAGES:
            reason = None
        elif name == "$facet":
            reason = None
            if isinstance(spec, Mapping):
                for sub in spec.values():
                    reason = check_pipeline(sub) if isinstance(sub, list) else BypassReason.UNKNOWN_OPERATOR
                    if reason is not None:
                        break
        elif name in _NONDETERMINISTIC_STAGES:
            reason = BypassReason.NONDETERMINISTIC
        elif name in _OTHER_COLLECTION_STAGES:
            reason = BypassReason.OTHER_COLLECTION
        elif name in _WRITE_STAGES:
            reason = BypassReason.WRITE_STAGE
        else:
            reason = BypassReason.UNKNOWN_OPERATOR
        if reason is not None:
            return reason
    return None


def written_databases(pipeline: Any, own: str) -> frozenset[str] | None:
    """The databases an aggregation pipeline's ``$out`` or ``$merge`` writes
    into (``own``, the pipeline's database, for a target named by collection
    only): empty if it writes nothing, None if a write stage's target cannot
    be read (every database must then be taken as written)."""
    if not isinstance(pipeline, list):
        return frozenset()
    found: set[str] = set()
    for stage in pipeline:
        if not isinstance(stage, Mapping) or len(stage) != 1:
            continue
        ((name, spec),) = stage.items()
        if name not in _WRITE_STAGES:
            continue
        target = spec.get("into") if name == "$merge" and isinstance(spec, Mapping) else spec
        if isinstance(target, str):
            found.add(own)
        elif isinstance(target, Mapping) and isinstance(target.get("db", own), str):
            found.add(target.get("db", own))
        else:
            return None
    return frozenset(found)


def _canonical_filter(filter: Mapping[Any, Any]) -> dict[str, Any]:
    """Sort the fields of a flat equality filter (no operators, no embedded
    documents at the top level): their order cannot change the result."""
    flat = all(
        isinstance(k, str) and not k.startswith("$") and not isinstance(v, Mapping)
        for k, v in filter.items()
    )
    return dict(sorted(filter.items())) if flat else dict(filter)


# -- options -----------------------------------------------------------------------


def _normalize_projection(projection: Any) -> dict[str, Any] | BypassReason:
    if isinstance(projection, Mapping):
        reason = check_expression(dict(projection), _PROJECTION_OPERATORS)
        return reason if reason is not None else dict(projection)
    if isinstance(projection, (list, tuple)) and all(isinstance(f, str) for f in projection):
        return {f: 1 for f in projection}
    return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError


def _normalize_sort(sort: Any) -> dict[str, Any] | BypassReason:
    pairs: list[tuple[Any, Any]]
    if isinstance(sort, Mapping):
        pairs = list(sort.items())
    elif isinstance(sort, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in sort):
        pairs = [(p[0], p[1]) for p in sort]
    else:
        return BypassReason.UNSUPPORTED_OPTION  # PyMongo accepts or rejects it itself
    out: dict[str, Any] = {}
    for field, direction in pairs:
        if isinstance(direction, Mapping):
            return BypassReason.NONDETERMINISTIC  # {"$meta": ...}
        if not isinstance(field, str) or type(direction) is not int or direction not in (1, -1) or field in out:
            return BypassReason.UNSUPPORTED_OPTION
        out[field] = direction
    return out


def _encode(value: Any, codec_options: CodecOptions[Any]) -> bytes | None:
    try:
        return bson.encode(value, codec_options=codec_options)
    except (bson.errors.BSONError, TypeError, ValueError, OverflowError):
        return None


def _plan_filter(
    filter: Any, codec_options: CodecOptions[Any]
) -> tuple[dict[str, Any], bytes] | BypassReason:
    """The canonical filter and its BSON, or why it is not cacheable."""
    if not isinstance(filter, Mapping):
        return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError
    reason = check_filter(filter)
    if reason is not None:
        return reason
    canonical = _canonical_filter(filter)
    encoded = _encode(canonical, codec_options)
    if encoded is None:
        return BypassReason.UNENCODABLE
    return canonical, encoded


#: Options whose values only the server judges (PyMongo sends them as given):
#: a value outside these shapes is sent to PyMongo (``unsupported_option``),
#: so a hit never answers a read the server would refuse.
_MAX_TIME_MS = ("maxTimeMS", "max_time_ms")
_INT32_MAX = 2**31 - 1


def server_accepts(name: str, value: Any, codec_options: CodecOptions[Any]) -> bool:
    """Whether the server surely accepts ``value`` for option ``name`` (one
    of maxTimeMS, allowDiskUse, comment; any other name: True)."""
    if name in _MAX_TIME_MS:
        return (value is None and name == "max_time_ms") or (type(value) is int and 0 <= value <= _INT32_MAX)
    if name == "allowDiskUse":
        return type(value) is bool
    if name == "comment":
        return value is None or type(value) is str or _encode({"c": value}, codec_options) is not None
    return True


def _neutral(
    kwargs: dict[str, Any], neutral: frozenset[str], codec_options: CodecOptions[Any] = _PLAIN, hint: bool = True
) -> dict[str, Any] | BypassReason:
    """Split off ``session`` and ``hint`` (bypass unless None; any ``hint``
    without ``hint=True``: the method sends or checks even None) and
    ``collation`` unless it is ``neutral`` (then the caller keys it), and
    check that every other keyword is ``neutral`` with a value the server
    accepts."""
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name == "session":
            if value is not None:
                return BypassReason.SESSION
        elif name == "hint" or (name == "collation" and name not in neutral):
            if value is not None or (name == "hint" and not hint):
                return BypassReason.UNSUPPORTED_OPTION
        elif name in neutral:
            if not server_accepts(name, value, codec_options):
                return BypassReason.UNSUPPORTED_OPTION
            out[name] = value
        else:
            return BypassReason.UNSUPPORTED_OPTION
    return out


# -- the methods -------------------------------------------------------------------


def classify_find_one(
    filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``find_one(filter, *args, **kwargs)`` can be cached."""
    if filter is not None and not isinstance(filter, Mapping):
        filter = {"_id": filter}  # PyMongo's find_one(value) shorthand
    return _classify_find(KIND_FIND_ONE, filter, args, kwargs, codec_options)


def classify_id(id_value: Any, codec_options: CodecOptions[Any]) -> ReadPlan | BypassReason:
    """``classify_find_one({"_id": id_value}, (), {}, codec_options)`` for an
    ``id_value`` of a type the C fast path takes (an exact int, str or
    ObjectId: read.c's id_filter), built without walking the filter: the
    plan of a miss of the C fast path. The miss reads a filter
    of its own (the caller's dict may change while the read is in flight)."""
    canonical = {"_id": id_value}
    filter_bytes = _encode(canonical, codec_options)
    if filter_bytes is None:
        return BypassReason.UNENCODABLE
    return ReadPlan(KIND_FIND_ONE, filter_bytes, b"", "find_one", (canonical, None), {})


def classify_find(
    args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``find(*args, **kwargs)`` can be cached."""
    kwargs = dict(kwargs)
    if args:
        if "filter" in kwargs:
            return BypassReason.UNKNOWN_OPTION  # given twice: PyMongo raises
        kwargs["filter"] = args[0]
    return _classify_find(KIND_FIND, kwargs.pop("filter", None), args[1:], kwargs, codec_options)


def _classify_find(
    kind: int, filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    projection = None
    if args:
        if len(args) > 1:
            return BypassReason.UNSUPPORTED_OPTION
        projection = args[0]
    read_kwargs: dict[str, Any] = {}
    sort: Any = None
    skip: Any = 0
    limit: Any = 0
    collation: Any = None
    for name, value in kwargs.items():
        if name == "projection":
            if args:
                return BypassReason.UNKNOWN_OPTION  # given twice: PyMongo raises
            projection = value
        elif name == "session":
            if value is not None:
                return BypassReason.SESSION
        elif name == "sort":
            sort = value
        elif name == "skip":
            skip = value
        elif name == "limit" and kind == KIND_FIND:
            limit = value
        elif name == "collation":
            collation = value
        elif name in _NEUTRAL_OPTIONS:
            if not server_accepts(name, value, codec_options):
                return BypassReason.UNSUPPORTED_OPTION
            read_kwargs[name] = value
        elif name in _RESULT_OPTIONS:
            if value != _RESULT_OPTIONS[name]:
                return BypassReason.UNSUPPORTED_OPTION
        else:
            return BypassReason.UNKNOWN_OPTION

    planned = _plan_filter({} if filter is None else filter, codec_options)
    if isinstance(planned, BypassReason):
        return planned
    canonical, filter_bytes = planned

    # rest: tagged parts, each a length-prefixed BSON document or a fixed
    # width integer; empty for a bare filter (the C fast path's key).
    rest = b""
    if projection is not None:
        normalized = _normalize_projection(projection)
        if isinstance(normalized, BypassReason):
            return normalized
        projection = normalized
        encoded = _encode(projection, codec_options)
        if encoded is None:
            return BypassReason.UNENCODABLE
        rest += b"P" + encoded
    if sort is not None:
        normalized_sort = _normalize_sort(sort)
        if isinstance(normalized_sort, BypassReason):
            return normalized_sort
        if normalized_sort:
            rest += b"S" + bson.encode(normalized_sort)
            read_kwargs["sort"] = list(normalized_sort.items())
    for tag, name, value in ((b"K", "skip", skip), (b"L", "limit", limit)):
        if value:
            # A negative limit (one batch) and wrong types bypass; PyMongo
            # rejects the latter itself.
            if type(value) is not int or not 0 < value < 2**63:
                return BypassReason.UNSUPPORTED_OPTION
            rest += tag + struct.pack("<q", value)
            read_kwargs[name] = value
    # A find's miss reads raw batches: their bytes are the entry, decoded in
    # one call per batch, as PyMongo decodes them.
    method = "find_one" if kind == KIND_FIND_ONE else "find_raw_batches"
    plan = ReadPlan(kind, filter_bytes, rest, method, (canonical, projection), read_kwargs)
    if limit:
        plan.limit = limit
        plan.unlimited_rest = rest[: -len(b"L") - 8]
    if collation is not None:
        read_kwargs["collation"] = collation
        return plan.collated(collation)
    if kind == KIND_FIND_ONE and canonical and "_id" not in canonical and (
        projection is None or projection.get("_id", True)
    ):
        if all(type(v) in _UNIQUE_VALUE_TYPES and not k.startswith("$") for k, v in canonical.items()):
            plan.unique_fields = frozenset(canonical)
    return plan


#: Filter values whose equality match is the unique index's key equality:
#: not None (it also matches a missing field), arrays, documents or regular
#: expressions.
_UNIQUE_VALUE_TYPES = frozenset(
    {int, float, str, bool, ObjectId, Int64, datetime.datetime, uuid.UUID, Binary, bytes, Decimal128}
)


def classify_aggregate(
    pipeline: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``aggregate(pipeline, *args, **kwargs)`` can be cached."""
    if args:
        return BypassReason.UNSUPPORTED_OPTION
    if not isinstance(pipeline, list):
        return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError
    reason = check_pipeline(pipeline)
    if reason is not None:
        return reason
    kwargs = dict(kwargs)
    let = kwargs.pop("let", None)
    neutral = _neutral(
        kwargs, frozenset({"comment", "batchSize", "maxTimeMS", "allowDiskUse", "collation"}), codec_options, hint=False
    )
    if isinstance(neutral, BypassReason):
        return neutral
    if let is not None:
        if not isinstance(let, Mapping):
            return BypassReason.UNENCODABLE
        reason = check_expression(dict(let))
        if reason is not None:
            return reason
        neutral["let"] = let
    # The "filter" part of the key is the pipeline: never an identity filter.
    filter_bytes = _encode({"pipeline": pipeline}, codec_options)
    rest = b"" if let is None else _encode(let, codec_options)
    if filter_bytes is None or rest is None:
        return BypassReason.UNENCODABLE
    # Not aggregate_raw_batches: PyMongo opens those with an empty first
    # batch, which costs a getMore round trip. The miss reads RawBSONDocuments.
    return _with_collation(ReadPlan(KIND_AGGREGATE, filter_bytes, rest, "aggregate", (pipeline,), neutral))


_COUNT_KEYED = ("skip", "limit")


def classify_count_documents(
    filter: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``count_documents(filter, *args, **kwargs)`` can be cached."""
    if args:
        return BypassReason.UNSUPPORTED_OPTION
    keyed = {name: kwargs[name] for name in _COUNT_KEYED if name in kwargs}
    rest_kwargs = {k: v for k, v in kwargs.items() if k not in keyed}
    if type(keyed.get("skip")) is int and keyed["skip"] == 0:
        del keyed["skip"]  # the same count as no skip: one entry (a bool is sent as it is)
    neutral = _neutral(rest_kwargs, frozenset({"comment", "maxTimeMS", "collation"}), codec_options, hint=False)
    if isinstance(neutral, BypassReason):
        return neutral
    planned = _plan_filter(filter, codec_options)
    if isinstance(planned, BypassReason):
        return planned
    canonical, filter_bytes = planned
    rest = _encode(keyed, codec_options) if keyed else b""
    if rest is None:
        return BypassReason.UNENCODABLE
    return _with_collation(
        ReadPlan(KIND_COUNT_DOCUMENTS, filter_bytes, rest, "count_documents", (canonical,), {**keyed, **neutral})
    )


def classify_estimated_document_count(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``estimated_document_count(*args, **kwargs)`` can be cached."""
    if args or kwargs.get("session", 0) is None:
        return BypassReason.UNSUPPORTED_OPTION  # PyMongo refuses a session, even None
    neutral = _neutral(kwargs, frozenset({"comment", "maxTimeMS"}), hint=False)
    if isinstance(neutral, BypassReason):
        return neutral
    return ReadPlan(KIND_ESTIMATED_COUNT, _EMPTY_DOC, b"", "estimated_document_count", (), neutral)


def classify_distinct(
    key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], codec_options: CodecOptions[Any]
) -> ReadPlan | BypassReason:
    """Decide whether ``distinct(key, *args, **kwargs)`` can be cached."""
    if not isinstance(key, str):
        return BypassReason.UNENCODABLE  # PyMongo raises its own TypeError
    if len(args) > 1:
        return BypassReason.UNSUPPORTED_OPTION
    kwargs = dict(kwargs)
    if args:
        if "filter" in kwargs:
            return BypassReason.UNKNOWN_OPTION  # given twice: PyMongo raises
        kwargs["filter"] = args[0]
    filter = kwargs.pop("filter", None)
    neutral = _neutral(kwargs, frozenset({"comment", "maxTimeMS", "collation"}), codec_options)
    if isinstance(neutral, BypassReason):
        return neutral
    planned = _plan_filter({} if filter is None else filter, codec_options)
    if isinstance(planned, BypassReason):
        return planned
    canonical, filter_bytes = planned
    rest = _encode({"key": key}, codec_options)
    if rest is None:
        return BypassReason.UNENCODABLE
    return _with_collation(ReadPlan(KIND_DISTINCT, filter_bytes, rest, "distinct", (key, canonical), neutral))


def _with_collation(plan: ReadPlan) -> ReadPlan | BypassReason:
    """Key a read that was given a ``collation`` (passed to the miss read in
    its keyword arguments) under it."""
    collation = plan.kwargs.get("collation")
    return plan if collation is None else plan.collated(collation)
