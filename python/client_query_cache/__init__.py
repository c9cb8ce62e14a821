"""client-query-cache: a coherent read cache for PyMongo.

Wrap a ``MongoClient`` with :class:`CacheManager` (or an ``AsyncMongoClient``
with :class:`AsyncCacheManager`); reads that are safe to cache
are answered from memory, everything else goes to MongoDB unchanged. Entries
are invalidated by following MongoDB change streams.
"""

# Names resolve on first use (PEP 562): ``python -m client_query_cache.owner``
# imports this package too, and the owner must not pay for PyMongo and the
# facades in memory. ``from client_query_cache import CacheManager`` works as
# usual. For the same reason the owner's modules import neither typing nor
# pathlib: type checkers read this name as True, the interpreter as False.
TYPE_CHECKING = False
_EXPORTS = {
    "CacheConfig": "._core.config",
    "SharedCache": "._core.handle",
    "SharedCacheConfig": "._core.handle",
    "CacheError": "._core.errors",
    "CacheConfigurationError": "._core.errors",
    "CacheClosedError": "._core.errors",
    "CacheForkedError": "._core.errors",
    "BypassReason": "._core.reasons",
    "RejectReason": "._core.reasons",
    "StreamState": "._core.reasons",
    "SharedCacheError": "._core.shared",
    "SharedCacheConnection": "._core.shared",
    "CacheSnapshot": "._core.snapshot",
    "StreamSnapshot": "._core.snapshot",
    "AsyncCacheManager": ".asynchronous",
    "AsyncCachedCollection": ".asynchronous",
    "AsyncCachedDatabase": ".asynchronous",
    "AsyncCachedCursor": ".asynchronous",
    "CacheManager": ".synchronous",
    "CachedCollection": ".synchronous",
    "CachedDatabase": ".synchronous",
    "CachedCursor": ".synchronous",
    "CausalListener": "._core.causal",
}

if TYPE_CHECKING:
    from ._core.causal import CausalListener
    from ._core.config import CacheConfig
    from ._core.handle import SharedCache, SharedCacheConfig
    from ._core.errors import CacheClosedError, CacheConfigurationError, CacheError, CacheForkedError
    from ._core.reasons import BypassReason, RejectReason, StreamState
    from ._core.shared import SharedCacheConnection, SharedCacheError
    from ._core.snapshot import CacheSnapshot, StreamSnapshot
    from .asynchronous import AsyncCacheManager, AsyncCachedCollection, AsyncCachedCursor, AsyncCachedDatabase
    from .synchronous import CachedCollection, CachedCursor, CachedDatabase, CacheManager

__version__ = "0.1.0"

__all__ = [
    "CacheManager",
    "CachedDatabase",
    "CachedCollection",
    "CachedCursor",
    "AsyncCacheManager",
    "AsyncCachedDatabase",
    "AsyncCachedCollection",
    "AsyncCachedCursor",
    "CacheConfig",
    "CacheSnapshot",
    "StreamSnapshot",
    "BypassReason",
    "RejectReason",
    "StreamState",
    "CacheError",
    "CacheConfigurationError",
    "CacheClosedError",
    "CacheForkedError",
    "SharedCache",
    "SharedCacheConfig",
    "SharedCacheConnection",
    "SharedCacheError",
    "CausalListener",
    "__version__",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
