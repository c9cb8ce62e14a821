"""The cache for PyMongo's ``AsyncMongoClient``."""

from .collection import AsyncCachedCollection, AsyncCachedCursor, AsyncCachedDatabase
from .manager import AsyncCacheManager

__all__ = ["AsyncCacheManager", "AsyncCachedDatabase", "AsyncCachedCollection", "AsyncCachedCursor"]
