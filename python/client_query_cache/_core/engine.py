"""The part of a manager shared by the sync and async facades.

It owns the native cache (arena, writer, change-stream followers), the
namespace handles, the bypass and rejection counters and the collection
probes' verdicts. The facades only add the I/O: the MongoDB read of a miss and
the collection probe, done with a sync or an async client.

Miss protocol (coherence rule 1):
    1. ``lookup`` misses;
    2. ``probe_key`` / ``record_probe``: the collection is a plain collection
       (and its default collation and unique indexes are known) for the
       current namespace epoch;
    3. ``capture`` takes the admission token (generations, stream health);
    4. the facade reads MongoDB at primary with majority read concern;
    5. ``admit`` stores the raw result only if the token is still current.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import bson
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from .. import _native
from .classify import KIND_FIND, KIND_FIND_ONE, ReadPlan, written_databases
from .config import CacheConfig, check_stream_scope
from .errors import CacheClosedError, CacheForkedError
from .reasons import BypassReason, RejectReason, StreamState
from .shared import OwnerLink, SharedCacheError, identity_proof, ring_bytes_for, ring_path
from .snapshot import CacheSnapshot, StreamSnapshot
from .trust import platform_trust
from .uri import crl_file_in

__all__ = [
    "Engine", "NamespaceHandle", "Hooks", "decode_bson", "decode_document", "decode_documents", "MISS", "UNHEALTHY",
    "BEHIND", "Stamp", "NO_STAMP",
]  # fmt: skip

MISS = _native.MISS
UNHEALTHY = _native.UNHEALTHY
BEHIND = _native.BEHIND
#: Seconds before a namespace the owner could not register is tried again.
RETRY_S = 1.0

#: The cheapest way to build a top-level document from BSON bytes with given
#: codec options: PyMongo's C decoder, without bson.decode's argument checks.
#: The entries of count_documents, estimated_document_count and distinct
#: ({"n": count}, {"v": values}) are decoded with it.
decode_bson: Callable[[Any, Any], Any] = getattr(bson, "_bson_to_dict", bson.decode)
#: A find_one's document, and the documents of a find or aggregate (laid end
#: to end; a list), decoded as PyMongo's cursors decode a reply's batch: as
#: array elements, where a document with "$ref" and "$id" becomes a DBRef
#: and a TypeRegistry decoder's exception becomes InvalidBSON. The cache's
#: results are those of the read it serves, miss or hit.
decode_document: Callable[[Any, Any], Any] = _native.decode_document
decode_documents: Callable[[Any, Any], list[Any]] = _native.decode_documents

def unique_field_sets(indexes: Any) -> frozenset[frozenset[str]]:
    """The field sets of the unique indexes whose equality match finds at
    most one document under the simple collation: unique, not partial, not
    sparse, ascending or descending keys only, simple or no collation. The
    ``_id`` index is left out (those reads are identity reads already)."""
    sets = set()
    for spec in indexes:
        key = spec.get("key") or {}
        collation = spec.get("collation")
        if (
            not spec.get("unique")
            or spec.get("partialFilterExpression") is not None
            or spec.get("sparse")
            or (collation and collation.get("locale", "simple") != "simple")
            or not key
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v not in (1, -1) for v in key.values())
        ):
            continue
        fields = frozenset(key)
        if fields != frozenset({"_id"}):
            sets.add(fields)
    return frozenset(sets)


#: A read's stamp (arena.h): monotonic ns before it was sent and after its
#: last reply, the client's cluster time after it, its read id, and whether
#: the deployment is known to have one member.
Stamp = tuple[int, int, int, int, bool]
NO_STAMP: Stamp = (0, 0, 0, 0, False)


#: Read ids of this process, for every manager (Engine.new_read).
_READS = itertools.count(1)


def _higher(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The floor that holds both: each part's maximum."""
    return (max(a[0], b[0]), max(a[1], b[1]))


class Hooks:
    """Test hooks called on the miss path (None: nothing is called)."""

    __slots__ = ("after_capture", "before_admit")

    def __init__(self) -> None:
        self.after_capture: Callable[[], None] | None = None
        self.before_admit: Callable[[], None] | None = None


class NamespaceHandle:
    """One registered namespace and the verdict of its last probe."""

    __slots__ = (
        "db", "coll", "ns_idx", "db_idx", "unavailable", "limited", "retry_at", "probe_key", "probe_verdict",
        "unique", "collation",
    )  # fmt: skip

    def __init__(self, db: str, coll: str) -> None:
        self.db = db
        self.coll = coll
        self.ns_idx = 0
        self.db_idx = 0
        self.unavailable = False
        #: Unavailable because the cache tracks max_namespaces already.
        self.limited = False
        #: For an unavailable handle: when to try registering again (0: never).
        self.retry_at = 0.0
        self.probe_key: tuple[int, int] | None = None
        self.probe_verdict: BypassReason | None = None
        #: (probe key, the field sets of the collection's unique indexes that
        #: a find_one may be validated by), assigned as one tuple.
        self.unique: tuple[tuple[int, int] | None, frozenset[frozenset[str]]] = (None, frozenset())
        #: (probe key, the collection's default collation if not simple).
        self.collation: tuple[tuple[int, int] | None, Any] = (None, None)


class Engine:
    """Native cache plus counters; thread-safe."""

    def __init__(
        self,
        config: CacheConfig,
        stream_uri: str | None,
        link: OwnerLink | None = None,
        deployment: dict[str, Any] | None = None,
        identity: dict[str, Any] | None = None,
        reconnect: Callable[[], OwnerLink] | None = None,
        clock: Callable[[], int] = lambda: 0,
        one_member: Callable[[], bool | None] = lambda: False,
    ) -> None:
        self.config = config
        #: The client's highest cluster time (causal.client_cluster_time).
        self._clock = clock
        #: Whether the deployment has one member (causal.one_member), asked
        #: until known: then reads are ordered in real time (floor.h).
        self._one_member = one_member
        self._ordered: bool | None = None
        #: Per database, the highest (cluster time, monotonic ns) of every
        #: observation: cluster_time(), and the floor a new owner's arena
        #: starts from (the native floor is by the current arena's indexes).
        self._floors: dict[str, tuple[int, int]] = {}
        #: A floor for every database, also those not registered yet.
        self._everywhere = (0, 0)
        self._db_idx: dict[str, int] = {}
        #: Per database, the sessions whose open transaction wrote there
        #: through a view (weak references): the database's entries are
        #: refused until each has ended (hold_for_transaction).
        self._transactions: dict[str, list[weakref.ref[Any]]] = {}
        self.link = link
        self.max_entry_bytes = config.max_entry_bytes
        #: Bumped when a worker re-attaches to a new owner; collections then
        #: drop their namespace handles and native reference (see read.py).
        self.generation = 0
        self._deployment = deployment or {}
        #: The MongoDB identity the client authenticates as (shared.py;
        #: holds its password, sent to an owner only as a salted proof).
        self._identity = identity
        self._reconnect = reconnect
        self._last_reattach = 0.0
        self._reattaching = False
        self._carried = {"hits": 0, "misses": 0, "behind": 0}
        self._segment: Any = None
        #: The ring file belongs to the process that created it: a forked
        #: copy of this engine must not remove its parent's ring.
        self._pid = os.getpid()
        #: What every native cache of this engine decodes with and raises.
        self._reader = dict(
            decode=decode_document,
            objectid_type=ObjectId,
            closed_error=CacheClosedError,
            forked_error=CacheForkedError,
            template_bytes=config.template_bytes,
        )
        if link is None:
            # Used by the followers only where the URI turns TLS on without
            # tlsCAFile (trust.py).
            trust = platform_trust()
            self.native = _native.Cache.local(
                budget_bytes=config.budget_bytes,
                slot_count=config.effective_slot_count,
                uri=stream_uri,
                max_await_time_ms=config.max_await_time_ms,
                tls_ca_file=trust.ca_file,
                tls_ca_dir=trust.ca_dir,
                tls_crl_file=crl_file_in(stream_uri) if stream_uri else None,
                stream_scope=check_stream_scope("stream_scope", config.stream_scope),
                **self._reader,
            )
        else:
            self.native, self._segment, self.max_entry_bytes = self._attach(link, self._deployment, self._identity, self._reader)
        self.hooks = Hooks()
        self._lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._bypasses: dict[str, int] = {}
        self._rejects: dict[str, int] = {}
        self._namespaces: dict[tuple[str, str], NamespaceHandle] = {}

    @staticmethod
    def _attach(
        link: OwnerLink, deployment: dict[str, Any], identity: dict[str, Any] | None, reader: dict[str, Any]
    ) -> tuple[Any, str, int]:
        """Map the owner's arena, create this worker's ring and say hello:
        (the native cache, the ring's path, the owner's max entry size)."""
        segment = ring_path(link.name)
        native = None
        try:
            info = link.request("info")
            salt = info.get("identity_salt")
            if not isinstance(salt, str) or len(salt) != 32:
                raise SharedCacheError(
                    f"the owner of {link.name!r} does not check the MongoDB identity of its workers "
                    "(an older version): restart it"
                )
            try:
                proof = identity_proof(identity, salt)
            except ValueError:
                raise SharedCacheError(f"the owner of {link.name!r} sent an invalid identity salt") from None
            ring_bytes = int(info["ring_bytes"])
            if not ring_bytes_for(0) <= ring_bytes <= 1 << 30:
                raise SharedCacheError(f"the owner of {link.name!r} asks for a ring of {ring_bytes} bytes")
            hello = {"pid": os.getpid(), "deployment": deployment, "identity": proof}
            if link.capability is not None:
                hello["capability"] = link.capability
            if info.get("capability_required"):
                if link.capability is None:
                    raise SharedCacheError(
                        f"shared cache {link.name!r} requires its capability: attach with "
                        "CacheManager(client, shared=owner.connection)"
                    )
                segment = None
                native, reply = Engine._attach_by_fd(link, ring_bytes, hello, reader)
            else:
                native = _native.Cache.worker(
                    arena_path=link.paths["arena"],
                    segment_path=segment,
                    ring_bytes=ring_bytes,
                    **reader,
                )
                reply = link.request("hello", segment=segment, **hello)
            mine, theirs = native.geometry(), reply["geometry"]
            for key in ("layout_version", "arena_bytes", "budget_bytes", "slot_count", "owner_uid", "owner_pid"):
                if mine[key] != theirs[key]:
                    raise SharedCacheError(
                        f"the arena of {link.name!r} does not match its owner ({key}: "
                        f"{mine[key]} != {theirs[key]})"
                    )
        except BaseException:
            if native is not None:
                native.close()
            if segment is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment)
            link.close()
            raise
        return native, segment, int(reply["max_entry_bytes"])

    @staticmethod
    def _attach_by_fd(
        link: OwnerLink, ring_bytes: int, hello: dict[str, Any], reader: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """Attach to an owner that requires a capability: the hello's reply
        brings the arena's descriptor; this worker's ring is a memfd of its
        own, sealed, whose descriptor goes back with a "ring" request. No
        file of either is left anywhere: both descriptors are closed once
        mapped. (the native cache, the hello's reply)"""
        reply, fds = link.request_fds("hello", None, **hello)
        ring_fd, native = -1, None
        try:
            if len(fds) != 1:
                raise SharedCacheError(f"the owner of {link.name!r} did not hand over its arena")
            ring_fd = os.memfd_create(f"cqc-{link.name}.ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            native = _native.Cache.worker(
                arena_path=None, segment_path=None, ring_bytes=ring_bytes,
                arena_fd=fds[0], segment_fd=ring_fd, **reader,
            )  # fmt: skip
            fcntl.fcntl(ring_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            link.request_fds("ring", [ring_fd])
        except BaseException:
            if native is not None:
                native.close()
            raise
        finally:
            for fd in [*fds, ring_fd]:
                if fd >= 0:
                    os.close(fd)
        return native, reply

    # -- shared mode: losing and finding an owner ---------------------------

    def owner_lost(self) -> bool:
        """Shared mode: whether the owner's heartbeat is older than its
        timeout (it died, hung or was stopped)."""
        if self.link is None:
            return False
        geo = self.native.geometry()
        beat = self.native.stats()["heartbeat_ns"]
        return time.monotonic_ns() - beat > geo["heartbeat_timeout_ns"]

    def maybe_reattach(self) -> None:
        """Shared mode, owner lost: look for a new owner of the same name in
        a background thread (at most one attempt at a time, one a second), so
        that no read waits for it: a hung owner still accepts connections and
        would hold a read until the handshake times out. Reads bypass
        meanwhile; once attached, collections re-bind on their next read."""
        if self._reconnect is None or self.closed or not self.owner_lost():
            return
        with self._lock:
            now = time.monotonic()
            if self._reattaching or now - self._last_reattach < 1.0:
                return
            self._reattaching = True
            self._last_reattach = now
        try:
            threading.Thread(target=self._reattach, name="cqc-reattach", daemon=True).start()
        except BaseException:
            self._reattaching = False
            raise

    def _reattach(self) -> None:
        """The attempt itself (a background thread). The old arena stays
        mapped until no reader holds it."""
        try:
            try:
                link = self._reconnect()  # type: ignore[misc]
                native, segment, max_entry_bytes = self._attach(link, self._deployment, self._identity, self._reader)
            except (SharedCacheError, OSError, ValueError):
                return
            with self._lock:
                # The old owner came back (it was paused, not dead), or the
                # manager was closed meanwhile: keep what there is.
                keep = self.closed or not self.owner_lost()
                if not keep:
                    old_native, old_link, old_segment = self.native, self.link, self._segment
                    stats = old_native.stats()
                    self._carried["hits"] += stats["hits"]
                    self._carried["misses"] += stats["misses"]
                    self._carried["behind"] += stats["behind_lookups"]
                    self.native, self.link, self._segment = native, link, segment
                    self.max_entry_bytes = max_entry_bytes
                    self._namespaces = {}
                    self._db_idx = {}
                    self.generation += 1
            if keep:
                native.close()
                link.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment)
                return
            if old_link is not None:
                old_link.close()
            if old_segment is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old_segment)  # the dead owner could not remove it
        finally:
            self._reattaching = False

    # -- namespaces ---------------------------------------------------------

    def namespace(self, db: str, coll: str) -> NamespaceHandle:
        """The handle of ``db.coll``, registering it (and starting the
        database's change stream) on first use."""
        key = (db, coll)
        handle = self._namespaces.get(key)
        if handle is not None:
            return handle
        if self.link is not None and self.owner_lost():
            # Not even asked: a hung owner would hold this read. Tried
            # again once a new owner is attached (or this one is back).
            self.maybe_reattach()
            return self._unavailable_for_now(db, coll)
        with self._lock:
            handle = self._namespaces.get(key)
            if handle is None:
                limit = self.config.max_namespaces
                if limit is not None and sum(not h.unavailable for h in self._namespaces.values()) >= limit:
                    return self._limited()  # this manager's own cap
                handle = NamespaceHandle(db, coll)
                try:
                    if self.link is None:
                        handle.ns_idx, handle.db_idx = self.native.register(db, coll)
                    else:
                        reply = self.link.request("register", db=db, coll=coll)
                        if reply.get("limited"):
                            return self._limited()  # the owner's cap
                        handle.ns_idx, handle.db_idx = int(reply["ns_idx"]), int(reply["db_idx"])
                except ValueError:
                    handle.unavailable = True  # table full, name too long: for good
                except SharedCacheError:
                    return self._unavailable_for_now(db, coll)  # the owner is gone or hung
                if not handle.unavailable:
                    # The floor this process holds for the database, also
                    # in a new owner's arena.
                    floor = _higher(self._floors.get(db, (0, 0)), self._everywhere)
                    self._floors[db] = floor
                    first = db not in self._db_idx
                    self._db_idx[db] = handle.db_idx
                    self._set_ordered(self.native)
                    if first and floor[0]:
                        # What this process observed of the database, in
                        # every scope at once (a new owner's arena).
                        self.native.observe(_native.SCOPE_DB, handle.db_idx, 0, None, *floor, 0)
                    if db in self._transactions:
                        self.native.hold(handle.db_idx, True)
                self._namespaces[key] = handle
        return handle

    @staticmethod
    def _limited() -> NamespaceHandle:
        """A handle of a namespace past max_namespaces: it bypasses
        (``namespace_limit``), and is asked for again after RETRY_S (an
        owner restarted meanwhile may have room)."""
        handle = NamespaceHandle("", "")
        handle.unavailable = handle.limited = True
        handle.retry_at = time.monotonic() + RETRY_S
        return handle

    @staticmethod
    def _unavailable_for_now(db: str, coll: str) -> NamespaceHandle:
        """A handle that bypasses and is registered again after RETRY_S."""
        handle = NamespaceHandle(db, coll)
        handle.unavailable = True
        handle.retry_at = time.monotonic() + RETRY_S
        return handle

    # -- the causal floor (coherence rule 7) --------------------------------

    @staticmethod
    def new_read() -> int:
        """A read id for an operation about to be sent (floor.h): unique
        among every manager of the host's processes (the pid and a count of
        the process's, which a forked child starts anew under its own
        pid)."""
        return ((os.getpid() & 0x3FFFFF) << 40) | (next(_READS) & 0xFFFFFFFFFF)

    @property
    def ordered(self) -> bool:
        """Whether the deployment is known to have one member: there a read
        that began after another ended read at least what it read."""
        ordered = self._ordered
        if ordered is None:
            known = self._one_member()
            if known is not None:
                ordered = self._ordered = bool(known)
                self._set_ordered(self.native)
        return bool(ordered)

    def _set_ordered(self, native: Any) -> None:
        if self._ordered:
            with contextlib.suppress(CacheClosedError, CacheForkedError):
                native.set_ordered(True)

    def observe(
        self,
        db: str,
        read_id: int,
        ns: NamespaceHandle | None = None,
        filter_bytes: bytes | None = None,
        value: int | None = None,
        at: int | None = None,
        result: tuple[int, bytes, bytes | None] | None = None,
    ) -> tuple[int, int]:
        """Something of ``db`` came back from MongoDB (floor.h): of the
        whole database (``ns`` None), of namespace ``ns``, or of the one
        document ``filter_bytes`` (``{"_id": v}``) of it. Bounded by the
        client's cluster time (or ``value``, an operationTime) and
        CLOCK_MONOTONIC now (or ``at``); returns those bounds. ``result``:
        (kind, rest, value) of a read that returned one whole result of the
        key (kind, ``filter_bytes``, rest) (Cache.observe_result). Never
        raises (it runs after the caller's operation, whose own result or
        error must stand)."""
        ts = max(self._clock() if value is None else value, 1)
        now = time.monotonic_ns() if at is None else at
        self.ordered  # noqa: B018 - learn it as soon as the client knows
        with self._lock:
            self._floors[db] = _higher(self._floors.get(db, (0, 0)), (ts, now))
            native, db_idx = self.native, self._db_idx.get(db)
        if db_idx is None or (ns is not None and (ns.unavailable or ns.db_idx != db_idx)):
            if db_idx is None:
                return ts, now
            ns = None  # a handle of an arena a new owner has replaced
        if ns is None:
            scope, ns_idx = _native.SCOPE_DB, 0
        else:
            scope = _native.SCOPE_NS if filter_bytes is None else _native.SCOPE_CELL
            ns_idx = ns.ns_idx
        with contextlib.suppress(CacheClosedError, CacheForkedError):
            if result is not None and ns is not None and filter_bytes is not None:
                kind, rest, found = result
                native.observe_result(db_idx, ns_idx, kind, filter_bytes, rest, found, ts, now, read_id)
            else:
                native.observe(scope, db_idx, ns_idx, filter_bytes, ts, now, read_id)
        return ts, now

    def invalidate_written(
        self, db: str, ns: NamespaceHandle, filter_bytes: bytes | None, bounds: tuple[int, int]
    ) -> None:
        """A view's write of ``ns`` (of the one document ``filter_bytes``,
        ``{"_id": v}``, or None: anywhere in it), observed with ``bounds``,
        went to MongoDB: the entries it may have changed are invalid until
        the stream applies it, and the next read of them is a miss, not a
        refusal by the floor (Cache.invalidate_written). Never raises (it
        runs after the caller's write)."""
        with self._lock:
            native, db_idx = self.native, self._db_idx.get(db)
        if db_idx is None or ns.unavailable or ns.db_idx != db_idx:
            return
        with contextlib.suppress(CacheClosedError, CacheForkedError):
            native.invalidate_written(db_idx, ns.ns_idx, filter_bytes, *bounds)

    def client_time(self) -> int:
        """The client's highest cluster time (at least 1)."""
        return max(self._clock(), 1)

    def observe_collection(self, db: str, coll: str | None, value: int) -> None:
        """A write a CausalListener reported: of collection ``coll`` of
        ``db`` (the whole database if None or not cached here), bounded by
        its ``operationTime``."""
        handle = self._namespaces.get((db, coll)) if coll is not None else None
        self.observe(db, 0, handle, value=value)

    def observe_written(self, db: str, pipeline: Any, value: int | None = None) -> None:
        """An aggregation ``pipeline`` of ``db`` ran: every database its
        ``$out`` or ``$merge`` wrote into (every database the process knows,
        if a target cannot be read)."""
        targets = written_databases(pipeline, db)
        if targets is None:
            self.observe_everywhere(self.cluster_time() if value is None else value)
            return
        for target in targets:
            self.observe(target, 0, value=value)

    def observe_everywhere(self, value: int) -> None:
        """A command whose databases are not known (a transaction's commit,
        a client-level bulk write): every database."""
        with self._lock:
            self._everywhere = _higher(self._everywhere, (value, time.monotonic_ns()))
            names = list(self._floors)
        for db in names:
            self.observe(db, 0, value=value)

    def hold_for_transaction(self, db: str, session: Any) -> None:
        """A view's write to ``db`` ran in ``session``'s open transaction: it
        becomes visible at the commit, which the views do not see, so every
        entry of ``db`` is refused until the transaction has ended
        (release_transactions, on the next read of ``db``)."""
        with self._lock:
            sessions = self._transactions.setdefault(db, [])
            if not any(ref() is session for ref in sessions):
                sessions.append(weakref.ref(session))
            native, db_idx = self.native, self._db_idx.get(db)
        if db_idx is not None:
            with contextlib.suppress(CacheClosedError, CacheForkedError):
                native.hold(db_idx, True)

    def holds(self, db: str) -> bool:
        """Whether a transaction that wrote to ``db`` may still be open."""
        return db in self._transactions

    def release_transactions(self, db: str) -> bool:
        """Stop refusing ``db``'s entries if every transaction that wrote
        there has ended (committed, aborted, or its session ended or
        collected): the database is first observed (past the commit).
        Returns whether ``db`` is no longer held."""
        with self._lock:
            sessions = self._transactions.get(db)
            if sessions is None:
                return True
            sessions[:] = [ref for ref in sessions if getattr(ref(), "in_transaction", False)]
            if sessions:
                return False
            del self._transactions[db]
            native, db_idx = self.native, self._db_idx.get(db)
        self.observe(db, 0)
        if db_idx is not None:
            with contextlib.suppress(CacheClosedError, CacheForkedError):
                native.hold(db_idx, False)
        return True

    def after_allows(self, db_idx: int, token: tuple[int, int]) -> bool:
        """Whether the database's stream covers an after() token (cluster
        time, monotonic ns when its block was entered): floor.h (a), (b)."""
        return bool(self.native.covers(db_idx, *token))

    def cluster_time(self) -> int:
        """The highest cluster time this process has observed: the client's,
        or one a listener reported."""
        with self._lock:
            highest = max(ts for ts, _ in (self._everywhere, *self._floors.values()))
        return max(highest, self._clock())

    # -- counters -----------------------------------------------------------

    def count_bypass(self, reason: BypassReason) -> None:
        with self._lock:
            self._bypasses[reason.value] = self._bypasses.get(reason.value, 0) + 1

    def _count_reject(self, reason: RejectReason) -> None:
        with self._lock:
            self._rejects[reason.value] = self._rejects.get(reason.value, 0) + 1

    # -- the miss protocol --------------------------------------------------

    def lookup(self, ns: NamespaceHandle, plan: ReadPlan, codec_options: Any, rest: bytes | None = None) -> Any:
        """The entry decoded with ``codec_options`` (a list of documents for
        find and aggregate), None (a cached "not found"), MISS or UNHEALTHY."""
        native, kind = self.native, plan.kind
        rest = plan.rest if rest is None else rest
        if kind >= KIND_FIND:
            return native.lookup(ns.ns_idx, ns.db_idx, kind, plan.filter_bytes, rest, codec_options, decode_documents)
        if kind == KIND_FIND_ONE:
            return native.lookup(ns.ns_idx, ns.db_idx, kind, plan.filter_bytes, rest, codec_options)
        return native.lookup(ns.ns_idx, ns.db_idx, kind, plan.filter_bytes, rest, codec_options, decode_bson)

    def lookup_limited(self, ns: NamespaceHandle, plan: ReadPlan, codec_options: Any) -> Any:
        """``lookup`` for a ``find`` with a positive limit: its own entry, else
        the entry of the same find without a limit, whose prefix serves it.
        Counted as one lookup (the second one's hit or miss)."""
        result = self.lookup(ns, plan, codec_options)
        if result is not MISS:
            return result
        result = self.lookup(ns, plan, codec_options, plan.unlimited_rest)
        self.uncount_miss()
        return result

    def uncount_miss(self) -> None:
        """A lookup that missed was followed by another one for the same
        read: only the second one counts."""
        with self._lock:
            self._carried["misses"] -= 1

    def count_oversize(self) -> None:
        self._count_reject(RejectReason.OVERSIZE)

    def ns_key(self, ns: NamespaceHandle) -> tuple[int, int]:
        """The (epoch, incarnation) a collection probe is valid for; read it
        before probing, and probe again when it is not ``ns.probe_key``."""
        return self.native.ns_epoch(ns.ns_idx)

    def record_probe(
        self,
        ns: NamespaceHandle,
        key: tuple[int, int],
        infos: list[Mapping[str, Any]],
        indexes: list[Mapping[str, Any]],
    ) -> None:
        """Record a listCollections answer for ``ns`` (filtered by name) and
        its listIndexes answer."""
        ns.unique = (key, unique_field_sets(indexes))
        if not infos:
            ns.probe_key, ns.probe_verdict = None, BypassReason.MISSING_COLLECTION
            return  # not remembered: the collection may appear at any time
        info = infos[0]
        options = info.get("options") or {}
        collation = options.get("collation")
        simple = not collation or collation.get("locale", "simple") == "simple"
        ns.collation = (key, None if simple else dict(collation))
        if info.get("type", "collection") != "collection":
            verdict: BypassReason | None = BypassReason.UNSUPPORTED_COLLECTION
        else:
            verdict = None
        ns.probe_key, ns.probe_verdict = key, verdict

    def unique_key(self, ns: NamespaceHandle, key: tuple[int, int] | None, fields: frozenset[str] | None) -> bool:
        """Whether ``fields`` are exactly those of a unique index of ``ns``,
        as probed under ``key``."""
        probed_under, sets = ns.unique
        return fields is not None and probed_under == key and fields in sets

    def default_collation(self, ns: NamespaceHandle, key: tuple[int, int]) -> Any:
        """The collection's non-simple default collation as probed under
        ``key``, else None."""
        probed_under, collation = ns.collation
        return collation if probed_under == key else None

    def verdict(self, ns: NamespaceHandle, key: tuple[int, int]) -> BypassReason | None:
        """The bypass reason of the collection under ``key``, None if its reads
        may be cached."""
        if ns.probe_key == key:
            return ns.probe_verdict
        return BypassReason.MISSING_COLLECTION

    def capture(self, ns: NamespaceHandle, plan: ReadPlan, probed_under: tuple[int, int]) -> bytes | None:
        """The admission token, or None if the read must bypass (the stream
        stopped serving, or the namespace changed since it was probed)."""
        token = self.native.capture(ns.ns_idx, plan.filter_bytes)
        if token is not None and self.native.ns_epoch(ns.ns_idx) != probed_under:
            return None
        return token

    def admit(
        self, plan: ReadPlan, token: bytes, value: bytes | None, rebind: bool = False, stamp: Stamp = NO_STAMP
    ) -> None:
        """Admit a miss's result: its BSON, or None for "not found". With
        ``rebind`` (a find_one by the fields of a unique index), the entry is
        validated by the identity of the document found (see
        cqc_arena_w_rebind). ``stamp``: when and by which read it was read
        (floor.h)."""
        if value is not None and len(value) > self.max_entry_bytes:
            self._count_reject(RejectReason.OVERSIZE)
            return
        # Rejections by the arena are counted there (see snapshot()); a
        # worker's ring counts what it had to drop.
        kind = plan.kind | _native.KIND_REBIND if rebind else plan.kind
        self.native.admit(token, kind, plan.filter_bytes, plan.rest, value, *stamp)

    # -- state --------------------------------------------------------------

    def snapshot(self) -> CacheSnapshot:
        stats = self.native.stats()
        follows = self.link is None  # a worker's streams are its owner's
        client_s = self.client_time() >> 32

        def stream(s: dict[str, Any]) -> StreamSnapshot:
            n, p50, p95, top = s["lag"]
            lag = follows and n > 0
            return StreamSnapshot(
                database=s["database"],
                state=StreamState(s["state"]),
                events=s["events"],
                reconnects=s["reconnects"],
                history_lost=s["history_lost"],
                last_error=s["last_error"],
                applied_time=Timestamp(*s["applied_time"]) if s["applied_time"][0] else None,
                getmores=s["getmores"] if follows else None,
                event_bytes=s["event_bytes"] if follows else None,
                invalidations=s["invalidations"] if follows else None,
                lag_samples=n if follows else None,
                lag_p50_ms=p50 if lag else None,
                lag_p95_ms=p95 if lag else None,
                lag_max_ms=top if lag else None,
                behind_client_s=max(client_s - s["applied_time"][0], 0) if s["applied_time"][0] else None,
                scope=s["scope"][0] if "scope" in s else None,
                scope_reason=s["scope"][1] if "scope" in s else None,
            )

        streams = tuple(stream(s) for s in self.native.streams())
        with self._lock:
            bypasses = dict(self._bypasses)
            rejects = dict(self._rejects)
        for name, reason in (
            ("rejected_stale", RejectReason.STALE),
            ("rejected_unhealthy", RejectReason.UNHEALTHY),
            ("rejected_too_large", RejectReason.TOO_LARGE),
            ("rejected_no_slot", RejectReason.NO_SLOT),
            ("rejected_conflict", RejectReason.CONFLICT),
        ):
            if stats[name]:
                rejects[reason.value] = stats[name]
        if stats.get("ring_oversize"):
            # An admission (its filter with the result) no ring could carry.
            oversize = RejectReason.OVERSIZE.value
            rejects[oversize] = rejects.get(oversize, 0) + stats["ring_oversize"]
        if stats.get("ring_dropped"):
            rejects[RejectReason.RING_FULL.value] = stats["ring_dropped"]
        if stats.get("ring_damaged"):
            rejects[RejectReason.RING_DAMAGED.value] = stats["ring_damaged"]
        return CacheSnapshot(
            hits=stats["hits"] + self._carried["hits"],
            misses=stats["misses"] + self._carried["misses"],
            bypasses=bypasses,
            admissions=stats["admissions"],
            rejected_admissions=rejects,
            evictions=stats["evictions"],
            invalidations=stats["invalidations"],
            used_bytes=stats["used_bytes"],
            budget_bytes=stats["budget_bytes"],
            entries=stats["entries"],
            streams=streams,
            behind=stats["behind_lookups"] + self._carried["behind"],
            live_bytes=stats["live_bytes"],
            dead_bytes=stats["dead_bytes"],
            promotions=stats["promotions"],
            reinsertions=stats["reinsertions"],
            forced_evictions=stats["forced_evictions"],
            ghost_hits=stats["ghost_hits"],
            reclaimed=stats["dead_reclaimed"],
            template_hits=stats["template_hits"],
            templates=stats["templates"],
            template_bytes=stats["template_bytes"],
        )

    def ready(self, database: str | None) -> bool:
        streams = [s for s in self.native.streams() if database is None or s["database"] == database]
        if database is not None and not streams:
            return False
        return all(
            self.native.db_state(s["db_idx"])[0] == _native.STATE_HEALTHY for s in streams
        )

    def wait_ready(self, timeout: float, database: str | None) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if self.ready(database):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    @property
    def closed(self) -> bool:
        return bool(self.native.closed)

    def close(self) -> None:
        """Stop the streams; a concurrent second close returns only once they
        are stopped."""
        with self._close_lock:
            self._close_locked()

    def _close_locked(self) -> None:
        self.native.close()
        if self.link is not None:
            self.link.close()  # the owner detaches this worker's ring
        if self._segment is not None and os.getpid() == self._pid:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._segment)  # in case the owner is gone
