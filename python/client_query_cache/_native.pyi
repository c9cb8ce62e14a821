"""Type stubs for ``client_query_cache._native``, the C core (csrc/module.c).

Private to the package: the facades in ``_core`` are its only callers.
tests/test_native_stub.py fails when a public name here and in the built
module differ, or when a constructor's keywords stop matching the C keyword
lists.
"""

from collections.abc import Callable
from typing import Any, Final, NotRequired, TypedDict, final

from typing_extensions import Buffer

# Sentinels returned by lookups, compared by identity.
MISS: Final[str]
"""No valid entry: read MongoDB and admit."""
UNHEALTHY: Final[str]
"""The database's change stream does not serve: bypass."""
BEHIND: Final[str]
"""An entry was found, but the database's stream has not reached the causal
floor: it may be older than what the process has seen. Read MongoDB."""

# admit() results.
ADMIT_OK: Final[int]
ADMIT_STALE: Final[int]
ADMIT_UNHEALTHY: Final[int]
ADMIT_TOO_LARGE: Final[int]
ADMIT_NO_SLOT: Final[int]
ADMIT_CONFLICT: Final[int]
ADMIT_QUEUED: Final[int]
"""A worker pushed the admission to its ring; the owner applies it."""
ADMIT_DROPPED: Final[int]
"""A worker's ring was full; the admission was dropped."""

KIND_REBIND: Final[int]
"""Or-ed into ``admit``'s kind: a find_one by a unique key, validated by the
identity of the document it found."""

# Scopes of ``Cache.observe`` (floor.h).
SCOPE_DB: Final[int]
SCOPE_NS: Final[int]
SCOPE_CELL: Final[int]

# Cache modes: where the arena lives and who writes it.
MODE_LOCAL: Final[int]
MODE_OWNER: Final[int]
MODE_WORKER: Final[int]

LAYOUT_VERSION: Final[int]
STATE_HEALTHY: Final[int]

class _StreamInfo(TypedDict):
    database: str
    db_idx: int
    state: str
    stalled: bool
    events: int
    reconnects: int
    history_lost: int
    incarnation: int
    last_error: str
    applied_time: tuple[int, int]
    getmores: int
    event_bytes: int
    invalidations: int
    #: (samples, p50 ms, p95 ms, max ms) of the latest events' lag
    lag: tuple[int, float, float, float]
    #: (scope in use, why): "deployment" or "database", and "" or the
    #: reason; absent where this process follows no stream (a worker)
    scope: NotRequired[tuple[str, str]]

@final
class Cache:
    """A cache arena with its writer and change-stream followers."""

    @classmethod
    def local(
        cls,
        budget_bytes: int,
        slot_count: int,
        uri: str | None,
        max_await_time_ms: int,
        decode: Callable[[bytes, Any], Any],
        objectid_type: type,
        closed_error: type[BaseException],
        forked_error: type[BaseException],
        tls_ca_file: str | None = None,
        tls_ca_dir: str | None = None,
        tls_crl_file: str | None = None,
        stream_scope: int = 0,
        template_bytes: int = 0,
    ) -> Cache:
        """A process-local cache: an arena in private memory that this process
        admits to, and one change-stream follower for the registered
        databases (none when ``uri`` is None): one deployment-wide stream
        (``stream_scope`` 0) or one stream per database (1). ``tls_ca_file`` / ``tls_ca_dir``: the
        certificate authorities the followers verify the server with when
        ``uri`` turns TLS on without ``tlsCAFile`` (the platform's trust
        store, _core/trust.py); ``None``: libmongoc's default.
        ``tls_crl_file``: a revocation list the followers check the server's
        certificate against (the connection string's ``tlsCRLFile``).
        ``template_bytes``: the budget of the templates of hit entries
        (csrc/template.h; 0: none)."""

    @classmethod
    def owner(
        cls,
        budget_bytes: int,
        slot_count: int,
        uri: str | None,
        max_await_time_ms: int,
        arena_path: str | None,
        closed_error: type[BaseException],
        forked_error: type[BaseException],
        heartbeat_timeout_ms: int = ...,
        arena_bytes: int = ...,
        tls_ca_file: str | None = None,
        tls_ca_dir: str | None = None,
        tls_crl_file: str | None = None,
        stream_scope: int = 0,
        arena_fd: int = -1,
    ) -> Cache:
        """A shared cache's owner: creates the arena file at ``arena_path``,
        or in the empty memfd ``arena_fd`` (which stays the caller's),
        follows the change streams and drains the workers' rings. It serves
        no reads: ``lookup``, ``capture`` and ``admit`` raise
        RuntimeError. ``tls_ca_file``, ``tls_ca_dir``, ``tls_crl_file`` and
        ``stream_scope`` as for ``local``."""

    @classmethod
    def worker(
        cls,
        arena_path: str | None,
        segment_path: str | None,
        ring_bytes: int,
        decode: Callable[[bytes, Any], Any],
        objectid_type: type,
        closed_error: type[BaseException],
        forked_error: type[BaseException],
        arena_fd: int = -1,
        segment_fd: int = -1,
        template_bytes: int = 0,
    ) -> Cache:
        """A shared cache's worker: maps the owner's arena read-only (the
        file at ``arena_path``, or the memfd ``arena_fd`` the owner handed
        over, which must be sealed against shrinking) and creates its ring
        at ``segment_path`` or in the empty memfd ``segment_fd``;
        admissions go to the ring. The descriptors stay the caller's.
        ``template_bytes`` as for ``local``."""

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    def lookup(
        self,
        ns_idx: int,
        db_idx: int,
        kind: int,
        filter: Buffer,
        rest: Buffer,
        codec_options: Any,
        decode: Callable[[bytes, Any], Any] = ...,
        /,
    ) -> Any:
        """``decode(bytes, codec_options)`` of the entry (built by csrc/build.c
        when ``decode`` is ``decode_document``, ``decode_documents``,
        ``bson._bson_to_dict`` or ``bson._decode_all`` and ``codec_options``
        are the defaults), None, MISS, UNHEALTHY or BEHIND."""

    def capture(self, ns_idx: int, filter: Buffer, /) -> bytes | None:
        """The admission token, or None when the stream does not serve."""

    def admit(
        self,
        token: Buffer,
        kind: int,
        filter: Buffer,
        rest: Buffer,
        value: Buffer | None,
        start_ns: int,
        end_ns: int,
        end_ts: int,
        read_id: int,
        ordered: bool,
        /,
    ) -> int:
        """Admit a miss's result (``value`` None: "not found") under
        ``token``, stamped with its read (arena.h's cqc_stamp_t): an
        ``ADMIT_*`` code."""

    def observe(
        self,
        scope: int,
        db_idx: int,
        ns_idx: int,
        filter: Buffer | None,
        cluster_time: int,
        monotonic_ns: int,
        read_id: int,
        /,
    ) -> None:
        """An observation (floor.h) of a database (``SCOPE_DB``), a namespace
        (``SCOPE_NS``) or the identity cell of ``filter`` (``SCOPE_CELL``; the
        namespace for a filter other than ``{"_id": v}``), bounded by the
        client's cluster time ``(seconds << 32) | increment`` and
        CLOCK_MONOTONIC after its reply, made by read ``read_id``."""

    def observe_result(
        self,
        db_idx: int,
        ns_idx: int,
        kind: int,
        filter: Buffer,
        rest: Buffer,
        value: Buffer | None,
        cluster_time: int,
        monotonic_ns: int,
        read_id: int,
        /,
    ) -> None:
        """``observe`` of a read that returned one whole result of a key (an
        identity cell's scope for ``{"_id": v}``, else the namespace's):
        another read's entry of that key holding exactly ``value`` (None:
        "not found") counts as this read's own."""

    def set_ordered(self, ordered: bool, /) -> None:
        """The deployment is known to have one member: reads are ordered in
        real time (floor.h (b), (c))."""

    def covers(self, db_idx: int, cluster_time: int, monotonic_ns: int, /) -> bool:
        """Whether the database's stream has applied everything an
        observation so bounded (an ``after()`` token) could have seen."""

    def peek(
        self, ns_idx: int, kind: int, filter: Buffer, rest: Buffer, /
    ) -> tuple[bytes | None, int, int, int] | None:
        """``(value, end_ns, end_ts, read_id)`` of the valid entry under the
        key whatever the causal floor says (``value`` None: a cached "not
        found"), or None: what a read the floor refused would have been
        served. Counts nothing."""

    def hold(self, db_idx: int, held: bool, /) -> None:
        """Refuse every entry of the database (``held``), or stop: a
        transaction of this process wrote there and has not ended."""

    def invalidate_written(
        self, db_idx: int, ns_idx: int, filter: bytes | None, cluster_time: int, monotonic_ns: int, /
    ) -> None:
        """This process wrote the document ``filter`` (``{"_id": v}``; any
        other filter or None: somewhere in the namespace), observed with
        those bounds: its identity entries and the namespace's query entries
        are invalid until the stream applies the write. A process-local
        cache invalidates them now; a worker's lookups of them are misses
        (not refusals) until then."""

    def register(self, db: str, coll: str, /) -> tuple[int, int]:
        """``(ns_idx, db_idx)``; starts the database's follower."""

    def db_state(self, db_idx: int, /) -> tuple[int, bool, int]:
        """``(state, stalled, applied cluster time)`` as readers see them."""

    def ns_epoch(self, ns_idx: int, /) -> tuple[int, int]:
        """``(epoch, db incarnation)``."""

    def stats(self) -> dict[str, int]:
        """Arena and lookup counters."""

    def streams(self) -> list[_StreamInfo]:
        """What the follower reports of each registered database."""

    def close(self) -> None:
        """Stop the followers."""

    def check(self) -> None:
        """Raise if closed or used after fork."""

    def attach_ring(self, ring: str | int, /) -> int:
        """Owner: drain a worker's ring, its file or the memfd it handed
        over (sealed against shrinking; it stays the caller's); returns its
        id."""

    def detach_ring(self, id: int, /) -> None:
        """Owner: release a worker's ring."""

    def geometry(self) -> dict[str, int]:
        """Arena geometry and owner."""

class CoreBase:
    """The C part of ``_core.read.CollectionCore``: the fields its fast path
    reads, which CollectionCore sets."""

    native: Cache
    codec: Any
    bound_session: Callable[[], Any]
    """The session PyMongo's ``bind()`` made current, or None."""
    ns_idx: int
    db_idx: int
    fast: bool
    """Whether the collection may be served at all (no bypass reason)."""

    def fast_find_one(self, filter: Any, /) -> Any:
        """``find_one(filter)``: the hit (a document, or None for a cached "not
        found") when ``filter`` is ``{"_id": int|str|ObjectId}``, ``fast`` is
        set, no session is bound and no ``after()`` block is open; else the
        read's first Step: ``self._start_id(id, looked_up)`` after a lookup
        that answered MISS, UNHEALTHY or BEHIND, or
        ``self.start_find_one(filter, (), {})``."""

class ViewBase:
    """The C part of ``_core.facade.CollectionBase``."""

    _core: CoreBase

    def find_one(self, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        """PyMongo's ``find_one``: with one positional argument, the fast
        path's hit (``CoreBase.fast_find_one``); else
        ``self._find_one_rest(step, filter, *args, **kwargs)``, where
        ``step`` is the fast path's first Step or None."""

def undumpable() -> None:
    """Make this process undumpable (prctl ``PR_SET_DUMPABLE`` 0): its
    ``/proc/<pid>/fd`` and memory become root's, and processes of the same
    user can no longer ptrace it."""

def after_blocks(var: Any, /) -> None:
    """The context variable of ``after()`` tokens, once a block was entered
    in the process (causal.py; None: none): from then on
    ``CoreBase.fast_find_one`` reads it, and leaves a read whose token the
    stream does not cover to the path that bypasses."""

def decode_document(data: Buffer, codec_options: Any, /) -> Any:
    """The document of ``data`` decoded as PyMongo's cursors decode a
    reply's batch, as an element of its array: a document with ``$ref`` and
    ``$id`` (a str ``$ref``, an absent or str ``$db``) becomes a DBRef, and
    an exception of a TypeRegistry decoder becomes InvalidBSON with its
    message. Bytes that are not one document go to ``bson._bson_to_dict``
    (its error)."""

def decode_documents(data: Buffer, codec_options: Any, /) -> list[Any]:
    """``decode_document`` of each document laid end to end in ``data``, as a
    list (bytes that are not documents end to end go to
    ``bson._decode_all``)."""

def decoded(data: Buffer, decode: Callable[[bytes, Any], Any], codec_options: Any, /) -> Any:
    """``decode(data, codec_options)``'s result, built by the document
    builder where a hit with this decoder and these codec options would be
    (else, or when the builder declines the bytes, ``decode``'s own)."""

# The document builder's private functions (csrc/build.c), for tests.

def _build(data: Buffer, many: bool = ..., elements: bool = ..., /) -> Any:
    """The builder's objects of ``data`` (one document, or a list of the
    documents end to end; as top-level documents, or with ``elements`` as
    ``decode_document`` decodes them), or NotImplemented when it declines
    them."""

def _build_hit(data: Buffer, decode: Callable[[bytes, Any], Any], codec_options: Any, /) -> Any:
    """What a hit whose entry is ``data`` returns with this decoder."""

def _template(obj: Any, /) -> tuple[Any, Any] | None:
    """The template a hit would keep of ``obj`` (csrc/template.h), or None
    when ``obj`` holds anything but containers and shareable values."""

def _template_copy(template: tuple[Any, Any], /) -> Any:
    """What a hit served from ``template`` returns: new containers, the same
    values."""

def _template_hits(n: int, /) -> int:
    """From now on, in this process, an entry gets its template on the
    ``n``-th hit of it (default 4); returns the previous ``n``."""

def _build_info() -> dict[str, Any]:
    """Whether the builder is ready, its fast paths, and how this process's
    hits were made (built, declined, decoded)."""

def _build_codec_ok(codec_options: Any, /) -> bool:
    """Whether hits under these codec options are built."""
