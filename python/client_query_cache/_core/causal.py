"""Sessions and cluster times: what keeps a process's reads in causal order.

**Sessions.** A read that PyMongo would run in an explicit session bypasses
the cache (coherence rule 4): a ``session=`` argument, or a session bound
with ``ClientSession.bind()`` (PyMongo 4.17 and later), which PyMongo keeps in
a context variable and resolves when the operation runs (for a ``find``
cursor, at its first fetch). ``bound_session_getter`` returns that variable's
``get``; a bound session of another client is a bypass too, and PyMongo
raises its own ``InvalidOperation`` for it.

**The causal floor** (coherence rule 7). After every read or write a cached
view sends to MongoDB, the manager raises the floor of that database to the
client's highest cluster time (the ``$clusterTime`` MongoDB gossips in every
reply, which is at or after the operation's own ``operationTime``). A hit is
served only when the database's applied time (``cqc_db_t.applied_ts``) has
reached its floor; otherwise the read goes to MongoDB (``stream_behind``).

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
import weakref
from collections.abc import Callable, Iterator
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

_AFTER: contextvars.ContextVar[int] = contextvars.ContextVar("cqc_after", default=0)


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
            # The C fast path leaves every read to the Python path, which
            # reads the context variable, before any token is set.
            _native.after_blocks(1)
            self.used = True


BLOCKS = _Blocks()


def after_floor() -> int:
    """The token of the innermost ``after`` block of this thread or task (0
    outside any)."""
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
    value = max((token.time << 32) | token.inc, _AFTER.get())
    BLOCKS.enter()
    reset = _AFTER.set(value)
    try:
        yield
    finally:
        _AFTER.reset(reset)


# -- every command of a client ----------------------------------------------------


class CausalListener(monitoring.CommandListener):
    """A PyMongo command listener that raises the causal floor of every
    manager over its client after every command the client runs, to that
    command's ``operationTime``: writes made through ``.raw``, through
    collections that are not cached views, ``Database.command`` and
    transactions are then covered as the cached views' own writes are.

    Install it when creating the client, before the manager:
    ``MongoClient(uri, event_listeners=[CausalListener()])``. A command on
    the ``admin`` database (a transaction's commit, a client-level bulk
    write) raises the floor of every database.
    """

    def __init__(self) -> None:
        self._engines: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    def attach(self, engine: Any) -> None:
        with self._lock:
            self._engines.add(engine)

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        ts = event.reply.get("operationTime")
        if not isinstance(ts, Timestamp):
            return
        value = (ts.time << 32) | ts.inc
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            if event.database_name == "admin":
                engine.observe_everywhere(value)
            else:
                engine.observe_time(event.database_name, value)
