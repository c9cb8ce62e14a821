"""Sessions and cluster times: what keeps a process's reads in causal order.

**Sessions.** A read that PyMongo would run in an explicit session bypasses
the cache (coherence rule 4): a ``session=`` argument, or a session bound
with ``ClientSession.bind()`` (PyMongo 4.17 and later), which PyMongo keeps in
a context variable and resolves when the operation runs (for a ``find``
cursor, at its first fetch). ``bound_session_getter`` returns that variable's
``get``; a bound session of another client is a bypass too, and PyMongo
raises its own ``InvalidOperation`` for it.

**The causal floor** (coherence rule 7, floor.h). Every read or write a
cached view sends to MongoDB, and every hit, is an observation, bounded by
the client's highest cluster time (the ``$clusterTime`` MongoDB gossips in
every reply, at or after the operation's own ``operationTime``) and by
CLOCK_MONOTONIC after its reply. A hit is served only when its entry
reflects every observation of its scope; otherwise the read goes to MongoDB
(``stream_behind``).

**Tokens.** ``ManagerBase.cluster_time()`` hands out the process's highest
cluster time; ``ManagerBase.after(token)`` holds the reads of a block (a
thread's or a task's) to it, so a request carrying the token of a write made
by another process reads at least that write.

Cluster times are handled as integers ``(seconds << 32) | increment``, the
order MongoDB compares them in, and as ``bson.Timestamp`` at the API.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from bson.timestamp import Timestamp
from pymongo import monitoring

from .errors import CacheConfigurationError

__all__ = [
    "bound_session_getter",
    "client_cluster_time",
    "one_member",
    "to_timestamp",
    "after",
    "after_floor",
    "CausalListener",
]

_UNBOUND: contextvars.ContextVar[Any] = contextvars.ContextVar("cqc_unbound", default=None)


def bound_session_getter(asynchronous: bool) -> Callable[[], Any]:
    """``get`` of PyMongo's bound-session context variable (sync or async
    API): the bound session, or None. PyMongo before 4.17 has no ``bind()``:
    then a variable that is never set."""
    try:
        if asynchronous:
            from pymongo.asynchronous.client_session import _SESSION
        else:
            from pymongo.synchronous.client_session import _SESSION
    except ImportError:
        return _UNBOUND.get
    return _SESSION.get


def client_cluster_time(client: Any) -> int:
    """The highest cluster time ``client`` has received, 0 if none yet."""
    cluster_time = client._topology.max_cluster_time()
    if cluster_time is None:  # PyMongo keeps None or a document it received
        return 0
    ts = cluster_time["clusterTime"]
    return (ts.time << 32) | ts.inc


def one_member(client: Any) -> bool | None:
    """Whether ``client``'s deployment is a replica set of one member (None
    while that is not known yet). There every acknowledged write and every
    read is majority-committed, so a stream round that began after a read or
    write returned and came back empty has applied it, even where the
    server's resume tokens do not follow its cluster time."""
    servers = list(client.topology_description.server_descriptions().values())
    if not servers or any(sd.server_type_name == "Unknown" for sd in servers):
        return None
    return len(servers) == 1 and servers[0].server_type_name == "RSPrimary" and len(servers[0].all_hosts) == 1


def to_timestamp(value: int) -> Timestamp | None:
    return Timestamp(value >> 32, value & 0xFFFFFFFF) if value else None


# -- tokens from elsewhere ------------------------------------------------------

#: The innermost after() block's token: (cluster time, CLOCK_MONOTONIC when
#: the block was entered), (0, 0) outside any.
_AFTER: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("cqc_after", default=(0, 0))


class _Blocks:
    """Whether an ``after`` block was ever entered in this process: reads look
    at the context variable from then on. A block's token lives in the
    context, so a task created (or a context copied) inside the block
    carries it after the block has closed: whether a read is held to a token
    depends on its own context only, never on other blocks being open."""

    __slots__ = ("used", "_lock")

    def __init__(self) -> None:
        self.used = False
        self._lock = threading.Lock()

    def enter(self) -> None:
        if self.used:
            return
        from .. import _native

        with self._lock:
            # The C fast path reads the context variable too from now on,
            # before any token is set.
            _native.after_blocks(_AFTER)
            self.used = True


BLOCKS = _Blocks()


def after_floor() -> tuple[int, int]:
    """The token of the innermost ``after`` block of this thread or task and
    when the block was entered ((0, 0) outside any). The writes the token
    stands for were acknowledged before it was handed over, so before the
    block was entered: a stream round that began after that covers them on
    a deployment of one member (floor.h (b))."""
    return _AFTER.get()


@contextlib.contextmanager
def after(token: Any) -> Iterator[None]:
    """Hold the reads of the block to ``token`` (a ``Timestamp`` from
    ``cluster_time()``, or None for no constraint)."""
    if token is None:
        yield
        return
    if not isinstance(token, Timestamp):
        raise CacheConfigurationError(f"token must be a bson.Timestamp or None, not {type(token).__name__}")
    outer = _AFTER.get()
    value = ((token.time << 32) | token.inc, time.monotonic_ns())
    if outer[0] >= value[0]:
        value = outer
    BLOCKS.enter()
    reset = _AFTER.set(value)
    try:
        yield
    finally:
        _AFTER.reset(reset)


# -- every command of a client ----------------------------------------------------


class CausalListener(monitoring.CommandListener):
    """A PyMongo command listener that makes every command the client runs
    an observation of every manager over its client (of its database,
    bounded by the command's ``operationTime``): writes made through
    ``.raw``, through collections that are not cached views,
    ``Database.command`` and transactions are then covered as the cached
    views' own writes are.

    Install it when creating the client, before the manager:
    ``MongoClient(uri, event_listeners=[CausalListener()])``. A command on
    the ``admin`` database (a transaction's commit, a client-level bulk
    write) raises the floor of every database.
    """

    def __init__(self) -> None:
        self._engines: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        #: Write commands in flight: (request id, connection) -> (name,
        #: collection, pipeline); their replies carry no command.
        self._writes: dict[Any, tuple[str, Any, Any]] = {}

    def attach(self, engine: Any) -> None:
        with self._lock:
            self._engines.add(engine)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name = event.command_name
        command = event.command
        if name in _WRITE_COMMANDS or (name == "aggregate" and _writes(command)):
            with self._lock:
                self._writes[(event.request_id, event.connection_id)] = (
                    name, command.get(name), command.get("pipeline")
                )

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        # A failed write may have written part of what it was asked to.
        failure = event.failure if isinstance(event.failure, Mapping) else {}
        self._observe(event, failure.get("operationTime"))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        self._observe(event, event.reply.get("operationTime"))

    def _observe(self, event: Any, ts: Any) -> None:
        with self._lock:
            write = self._writes.pop((event.request_id, event.connection_id), None)
            engines = list(self._engines) if write is not None else []
        if write is None:
            return  # a read: the views observe their own (their misses go through this client)
        name, coll, pipeline = write
        for engine in engines:
            value = (ts.time << 32) | ts.inc if isinstance(ts, Timestamp) else engine.cluster_time()
            if event.database_name == "admin":
                engine.observe_everywhere(value)
            elif name == "aggregate":
                engine.observe_written(event.database_name, pipeline, value)
            else:
                engine.observe_collection(
                    event.database_name, coll if name in _COLLECTION_WRITES and isinstance(coll, str) else None, value
                )


#: Commands that may change documents or namespaces: what the listener
#: observes. Reads are the views' to observe (misses, bypasses).
_COLLECTION_WRITES = frozenset({"insert", "update", "delete", "findAndModify"})
_WRITE_COMMANDS = _COLLECTION_WRITES | frozenset(
    {
        "bulkWrite", "commitTransaction", "abortTransaction", "drop", "dropDatabase", "renameCollection",
        "create", "collMod", "createIndexes", "dropIndexes", "applyOps", "convertToCapped", "cloneCollectionAsCapped",
    }
)  # fmt: skip


def _writes(command: Any) -> bool:
    """Whether an aggregate command's pipeline has a write stage."""
    pipeline = command.get("pipeline")
    return isinstance(pipeline, list) and any(
        isinstance(stage, dict) and ("$out" in stage or "$merge" in stage) for stage in pipeline
    )
