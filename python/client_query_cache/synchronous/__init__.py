"""The cache for PyMongo's synchronous ``MongoClient``."""

from .collection import CachedCollection, CachedCursor, CachedDatabase
from .manager import CacheManager

__all__ = ["CacheManager", "CachedDatabase", "CachedCollection", "CachedCursor"]
