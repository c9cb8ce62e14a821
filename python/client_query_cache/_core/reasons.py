"""Enumerations shared by the facades: why a read bypassed, stream states."""

from __future__ import annotations

import enum

__all__ = ["BypassReason", "StreamState", "RejectReason"]


class BypassReason(str, enum.Enum):
    """Why a read went to PyMongo instead of the cache (counted per reason)."""

    #: A PyMongo option that changes the result and is not part of the key
    #: (hint, estimated_document_count's collation, cursor options, ...), or
    #: extra positional arguments.
    UNSUPPORTED_OPTION = "unsupported_option"
    #: A keyword argument PyMongo's method does not know either.
    UNKNOWN_OPTION = "unknown_option"
    #: PyMongo would run the read in an explicit session (or transaction): a
    #: ``session=`` argument, or a session bound with ``ClientSession.bind()``
    #: (of this client or, for PyMongo to refuse, of another).
    SESSION = "session"
    #: The collection reads from other than the primary.
    READ_PREFERENCE = "read_preference"
    #: The collection's read concern is neither unset nor majority.
    READ_CONCERN = "read_concern"
    #: The result is not a function of the stored documents: ``$where``,
    #: ``$text``, ``$function``, ``$accumulator``, ``$rand``, ``$sampleRate``,
    #: ``$meta`` (in a filter, projection or sort), ``$$NOW``,
    #: ``$$CLUSTER_TIME``, ``$$USER_ROLES``.
    NONDETERMINISTIC = "nondeterministic"
    #: An operator the classifier does not know (geospatial, ``$jsonSchema``,
    #: newer expression operators, ...): it may not be deterministic.
    UNKNOWN_OPERATOR = "unknown_operator"
    #: An aggregation stage that reads another collection (``$lookup``,
    #: ``$graphLookup``, ``$unionWith``), whose writes the entry would miss.
    OTHER_COLLECTION = "other_collection"
    #: An aggregation that writes (``$out``, ``$merge``).
    WRITE_STAGE = "write_stage"
    #: The filter or projection cannot be encoded to BSON; PyMongo will
    #: report the problem itself.
    UNENCODABLE = "unencodable"
    #: The database's change stream is not established and making progress.
    STREAM_UNHEALTHY = "stream_unhealthy"
    #: The database's stream has not yet applied every write up to the
    #: process's causal floor (the highest cluster time it observed from the
    #: database) or the token of an enclosing ``after()`` block: the cache
    #: may hold a version older than one already seen.
    STREAM_BEHIND = "stream_behind"
    #: Shared cache: the owner's heartbeat stopped (it died, hung or was
    #: stopped); the worker tries to attach to a new owner once a second.
    OWNER_UNAVAILABLE = "owner_unavailable"
    #: A view, a time-series collection or a ``system.*`` collection.
    UNSUPPORTED_COLLECTION = "unsupported_collection"
    #: The collection does not exist (nothing is cached for it).
    MISSING_COLLECTION = "missing_collection"
    #: The arena's namespace or database table is full.
    NAMESPACE_UNAVAILABLE = "namespace_unavailable"
    #: The cache already tracks ``max_namespaces`` namespaces.
    NAMESPACE_LIMIT = "namespace_limit"


class RejectReason(str, enum.Enum):
    """Why a miss's result was not admitted (counted per reason)."""

    #: A write (or namespace event) was applied between capture and admission.
    STALE = "stale"
    #: The stream stopped serving between capture and admission.
    UNHEALTHY = "unhealthy"
    #: The result is larger than ``max_entry_bytes`` or, in a shared-cache
    #: worker, the admission (the read's filter and options with the result)
    #: is larger than half the worker's admission ring and could never fit.
    OVERSIZE = "oversize"
    #: The entry is larger than a quarter of the arena's payload budget.
    TOO_LARGE = "too_large"
    #: No free slot within the probe limit of the entry table.
    NO_SLOT = "no_slot"
    #: Another read under the same generations returned other bytes (a write
    #: landed between them and its event was not applied yet): the entry is
    #: replaced by a marker that is never served, and admissions under those
    #: generations are refused until the write's event is applied.
    CONFLICT = "conflict"
    #: A shared-cache worker's admission ring was full (the owner lags).
    RING_FULL = "ring_full"
    #: A shared-cache worker found its admission ring's header changed by
    #: another process: the admission was dropped and the header written again.
    RING_DAMAGED = "ring_damaged"


class StreamState(str, enum.Enum):
    """Health of one database's change-stream follower."""

    NOT_STARTED = "not_started"
    CONNECTING = "connecting"
    HEALTHY = "healthy"
    RECONNECTING = "reconnecting"
    FAILED = "failed"
    STARTUP_FAILED = "startup_failed"
    CLOSED = "closed"
