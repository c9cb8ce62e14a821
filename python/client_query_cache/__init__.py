"""client-query-cache: a coherent read cache for PyMongo.

Wrap a ``MongoClient`` with :class:`CacheManager` (or an ``AsyncMongoClient``
with :class:`AsyncCacheManager`); reads that are safe to cache
are answered from memory, everything else goes to MongoDB unchanged. Entries
are invalidated by following MongoDB change streams.
"""

from ._core.config import CacheConfig
from ._core.handle import SharedCache, SharedCacheConfig
from ._core.errors import CacheClosedError, CacheConfigurationError, CacheError, CacheForkedError
from ._core.reasons import BypassReason, RejectReason, StreamState
from ._core.shared import SharedCacheError
from ._core.snapshot import CacheSnapshot, StreamSnapshot
from .asynchronous import AsyncCacheManager, AsyncCachedCollection, AsyncCachedDatabase
from .synchronous import CachedCollection, CachedDatabase, CacheManager

__version__ = "0.1.0"

__all__ = [
    "CacheManager",
    "CachedDatabase",
    "CachedCollection",
    "AsyncCacheManager",
    "AsyncCachedDatabase",
    "AsyncCachedCollection",
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
    "SharedCacheError",
    "__version__",
]
