"""The cache for PyMongo's ``AsyncMongoClient``."""

from .collection import AsyncCachedCollection, AsyncCachedDatabase
from .manager import AsyncCacheManager

__all__ = ["AsyncCacheManager", "AsyncCachedDatabase", "AsyncCachedCollection"]
