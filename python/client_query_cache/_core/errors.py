"""Exceptions raised by client-query-cache itself.

Everything else a caller sees is PyMongo's own: a read the cache cannot serve
safely is passed to PyMongo unchanged (coherence rule 5, "bypass, never raise").
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "CacheConfigurationError",
    "CacheClosedError",
    "CacheForkedError",
]


class CacheError(Exception):
    """Base class of every exception raised by the cache (not by PyMongo)."""


class CacheConfigurationError(CacheError, ValueError):
    """An argument to the cache is invalid; the message names it."""


class CacheClosedError(CacheError, RuntimeError):
    """The manager was closed; create a new one to read through the cache."""


class CacheForkedError(CacheError, RuntimeError):
    """A manager created before ``fork()`` was used in the child process."""
