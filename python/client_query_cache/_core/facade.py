"""Base classes of the sync and async facades: everything but the I/O.

Each facade subclasses these with its PyMongo types (``MongoClient`` or
``AsyncMongoClient``) and adds only the methods whose bodies differ by
``await``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from bson.timestamp import Timestamp

from . import causal
from .._native import ViewBase
from .config import (
    CacheConfig,
    MiB,
    check_connection_string,
    check_owner_options,
    check_seconds,
)
from .engine import Engine
from .errors import CacheConfigurationError
from .read import CollectionCore
from .snapshot import CacheSnapshot
from .handle import SharedCacheConfig, attach_or_start
from .shared import (
    CONNECTION_PREFIX,
    OwnerLink,
    SharedCacheConnection,
    deployment_of_client,
    identity_of_client,
    validate_name,
)
from .uri import stream_uri_for

__all__ = ["ManagerBase", "DatabaseBase", "CollectionBase", "install_write_methods"]

#: The collection methods that write, which a cached view wraps: after each
#: one (acknowledged or failed) the database's causal floor is raised, so the
#: process's next reads see the write (coherence rule 7).
WRITE_METHODS = (
    "insert_one", "insert_many", "replace_one", "update_one", "update_many", "delete_one", "delete_many",
    "bulk_write", "find_one_and_delete", "find_one_and_replace", "find_one_and_update", "drop", "rename",
)  # fmt: skip


def install_write_methods(cls: type, wrap: Callable[[str], Callable[..., Any]]) -> None:
    """Give a facade's collection class the ``WRITE_METHODS``, each made by
    ``wrap(name)``: the wrapped collection's method, then ``observe()``."""
    for name in WRITE_METHODS:
        method = wrap(name)
        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"PyMongo's ``{name}``; the process's next reads see its write."
        setattr(cls, name, method)


class CollectionBase(ViewBase):
    """A wrapped PyMongo collection; reads are added by the facade.

    ``_core`` (the CollectionCore) is ViewBase's field: its ``find_one``,
    which the sync facade keeps, answers a fast-path hit in C and calls the
    facade's ``_find_one_rest`` for everything else.
    """

    __slots__ = ("_engine", "_raw")
    _core: CollectionCore
    #: causal.bound_session_getter for the facade's PyMongo API.
    _bound_session: ClassVar[Callable[[], Any]]
    #: The facade's PyMongo collection class (sub-collections are wrapped).
    _raw_collection_type: ClassVar[type]

    def __init__(self, engine: Engine, collection: Any) -> None:
        self._engine = engine
        self._raw = collection
        self._core = CollectionCore(engine, collection, self._bound_session)

    @property
    def raw(self) -> Any:
        """The wrapped PyMongo collection."""
        return self._raw

    @property
    def name(self) -> str:
        return str(self._raw.name)

    @property
    def full_name(self) -> str:
        return str(self._raw.full_name)

    def with_options(self, **options: Any) -> Any:
        """The same collection with other PyMongo options, also cached."""
        return type(self)(self._engine, self._raw.with_options(**options))

    def __getitem__(self, name: str) -> Any:
        """The sub-collection ``<this collection>.name``, also cached
        (PyMongo's ``collection[name]``)."""
        return type(self)(self._engine, self._raw[name])

    def __getattr__(self, name: str) -> Any:
        # Writes and everything else are PyMongo's own; a sub-collection
        # (coll.chunks) reads through the cache.
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._raw, name)
        if isinstance(value, self._raw_collection_type):
            return type(self)(self._engine, value)
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._raw!r})"


class DatabaseBase:
    """A database whose collections read through the cache."""

    __slots__ = ("_engine", "_raw")
    _collection_cls: ClassVar[type[CollectionBase]]
    _raw_collection_type: ClassVar[type]

    def __init__(self, engine: Engine, database: Any) -> None:
        self._engine = engine
        self._raw = database

    @property
    def raw(self) -> Any:
        """The wrapped PyMongo database."""
        return self._raw

    @property
    def name(self) -> str:
        return str(self._raw.name)

    def __getitem__(self, name: str) -> Any:
        return self.get_collection(name)

    def get_collection(self, name: str, **options: Any) -> Any:
        """A cached view of ``database.get_collection(name, **options)``."""
        return self._collection_cls(self._engine, self._raw.get_collection(name, **options))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._raw, name)
        if isinstance(value, self._raw_collection_type):
            return self._collection_cls(self._engine, value)  # db.users reads through the cache
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._raw!r})"


def _check_shared_config(config: SharedCacheConfig) -> None:
    """What ``SharedCacheConfig`` leaves to the owner's start: checked when
    the manager is built, not first when an owner must be (re)started, which
    can be in the middle of a read long after."""
    if config.uri is not None:
        check_connection_string("SharedCacheConfig.uri", config.uri)
    check_owner_options(
        arena_bytes=config.arena_bytes,
        budget_bytes=config.budget_bytes,
        slots=config.slots,
        max_entry_bytes=config.max_entry_bytes,
        max_await_time_ms=config.max_await_time_ms,
        prefix="SharedCacheConfig.",
    )
    check_seconds("SharedCacheConfig.grace_seconds", config.grace_seconds)


class ManagerBase:
    """Configuration, the engine and access to cached databases."""

    _client_type: ClassVar[type]
    _collection_type: ClassVar[type]
    _database_cls: ClassVar[type[DatabaseBase]]
    _collection_cls: ClassVar[type[CollectionBase]]

    def __init__(
        self,
        client: Any,
        *,
        budget_bytes: int = 64 * MiB,
        max_entry_bytes: int | None = None,
        max_await_time_ms: int = 1000,
        slot_count: int | None = None,
        stream_uri: str | None = None,
        shared: str | SharedCacheConnection | SharedCacheConfig | None = None,
        max_namespaces: int | None = None,
        stream_scope: str = "deployment",
        template_bytes: int = 16 * MiB,
    ) -> None:
        if not isinstance(client, self._client_type):
            raise CacheConfigurationError(
                f"client must be a pymongo.{self._client_type.__name__}, "
                f"not {type(client).__name__}"
            )
        if shared is not None and not isinstance(shared, (str, SharedCacheConnection, SharedCacheConfig)):
            raise CacheConfigurationError(
                "shared must be a shared cache name or connection string (str), a SharedCacheConnection "
                f"or a SharedCacheConfig, not {type(shared).__name__}"
            )
        if isinstance(shared, str) and shared.startswith(CONNECTION_PREFIX):
            shared = SharedCacheConnection.parse(shared)
        if isinstance(shared, SharedCacheConfig):
            _check_shared_config(shared)
        if max_entry_bytes is None:
            max_entry_bytes = CacheConfig.default_max_entry_bytes(budget_bytes)
        self._config = CacheConfig(
            budget_bytes=budget_bytes,
            max_entry_bytes=max_entry_bytes,
            max_await_time_ms=max_await_time_ms,
            slot_count=slot_count,
            stream_uri=stream_uri,
            max_namespaces=max_namespaces,
            stream_scope=stream_scope,
            template_bytes=template_bytes,
        )
        self._client = client

        def clock() -> int:
            return causal.client_cluster_time(client)

        def members() -> bool | None:
            return causal.one_member(client)

        if shared is None:
            self._engine = Engine(
                self._config, stream_uri or stream_uri_for(client), clock=clock, one_member=members
            )
        else:
            # The owner's geometry and streams apply; this process reads its
            # arena and pushes admissions to it.
            if isinstance(shared, SharedCacheConfig):
                derived = stream_uri or stream_uri_for(client)
                config = shared

                def reconnect() -> OwnerLink:
                    return attach_or_start(config, derived)
            else:
                if isinstance(shared, SharedCacheConnection):
                    name, capability = shared.name, shared.capability
                else:
                    name, capability = validate_name(shared), None

                def reconnect() -> OwnerLink:
                    return OwnerLink(name, capability)

            self._engine = Engine(
                self._config,
                None,
                link=reconnect(),
                deployment=deployment_of_client(client),
                identity=identity_of_client(client),
                reconnect=reconnect,
                clock=clock,
                one_member=members,
            )
        for listener in client.options.event_listeners:
            if isinstance(listener, causal.CausalListener):
                listener.attach(self._engine)

    @property
    def client(self) -> Any:
        return self._client

    @property
    def config(self) -> CacheConfig:
        return self._config

    def __getitem__(self, name: str) -> Any:
        return self.get_database(name)

    def get_database(self, name: str, **options: Any) -> Any:
        """A cached view of ``client.get_database(name, **options)``."""
        return self._database_cls(self._engine, self._client.get_database(name, **options))

    def get_cached_collection(self, collection: Any) -> Any:
        """Wrap a PyMongo collection of this manager's client."""
        if not isinstance(collection, self._collection_type):
            raise CacheConfigurationError(
                f"collection must be a pymongo {self._collection_type.__name__}, "
                f"not {type(collection).__name__}"
            )
        if collection.database.client is not self._client:
            raise CacheConfigurationError("collection belongs to another client")
        return self._collection_cls(self._engine, collection)

    def snapshot(self) -> CacheSnapshot:
        """Counters, memory use and the state of every change stream."""
        return self._engine.snapshot()

    def cluster_time(self) -> Timestamp | None:
        """The highest cluster time this process has observed through the
        manager's client (every reply it received, writes of any kind
        included): a token for ``after()`` in another process. None before
        the client's first reply."""
        return causal.to_timestamp(self._engine.cluster_time())

    @staticmethod
    def after(token: Timestamp | None) -> contextlib.AbstractContextManager[None]:
        """``with manager.after(token):`` serves no read of the block (this
        thread's or task's) from a cache that has not applied every write up
        to ``token`` (from ``cluster_time()`` of any process); such reads go
        to MongoDB. ``None`` constrains nothing."""
        return causal.after(token)

    @staticmethod
    def _check_wait(timeout: object, database: object) -> float:
        """``wait_ready``'s arguments: the timeout in seconds."""
        if database is not None and not isinstance(database, str):
            raise CacheConfigurationError(f"database must be a str or None, not {type(database).__name__}")
        return check_seconds("timeout", timeout)

    @property
    def closed(self) -> bool:
        return self._engine.closed

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<{type(self).__name__} {state} budget={self._config.budget_bytes}>"
