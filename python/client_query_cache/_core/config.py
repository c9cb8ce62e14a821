"""Validated configuration of a cache manager."""

from __future__ import annotations

import dataclasses

from .errors import CacheConfigurationError

__all__ = ["CacheConfig", "MiB"]

MiB = 1024 * 1024
_MAX_BUDGET = 0xF0000000  # the arena addresses payload with 32-bit offsets


def _int_arg(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CacheConfigurationError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise CacheConfigurationError(f"{name} must be between {low} and {high}, got {value}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """Options shared by the sync and async managers.

    ``budget_bytes`` bounds the payload bytes of cached entries; eviction keeps
    the total under it. ``max_entry_bytes`` is the largest document that is
    admitted (larger ones are returned and not cached); the managers default it
    to 1 MiB, or a quarter of a smaller budget. ``max_await_time_ms``
    is how long a change-stream getMore waits for events; a stream that has not
    made progress within ``2 * max_await_time_ms + 2000`` ms stops serving.
    ``slot_count`` is the capacity of the entry table (rounded up to a power of
    two; default: one slot per 2 KiB of budget, at least 1024).
    """

    budget_bytes: int = 64 * MiB
    max_entry_bytes: int = 1 * MiB
    max_await_time_ms: int = 1000
    slot_count: int | None = None
    stream_uri: str | None = None

    def __post_init__(self) -> None:
        _int_arg("budget_bytes", self.budget_bytes, 64 * 1024, _MAX_BUDGET)
        _int_arg("max_entry_bytes", self.max_entry_bytes, 1, self.budget_bytes // 4)
        _int_arg("max_await_time_ms", self.max_await_time_ms, 10, 60_000)
        if self.slot_count is not None:
            _int_arg("slot_count", self.slot_count, 64, 1 << 26)
        if self.stream_uri is not None and (
            not isinstance(self.stream_uri, str)
            or not self.stream_uri.startswith(("mongodb://", "mongodb+srv://"))
        ):
            raise CacheConfigurationError(
                "stream_uri must be a 'mongodb://' or 'mongodb+srv://' connection string"
            )

    @staticmethod
    def default_max_entry_bytes(budget_bytes: object) -> int:
        """1 MiB, or a quarter of a smaller budget."""
        if isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool):
            return max(1, min(1 * MiB, budget_bytes // 4))
        return 1 * MiB  # the budget's own check reports the bad value

    @property
    def effective_slot_count(self) -> int:
        if self.slot_count is not None:
            return self.slot_count
        return max(1024, self.budget_bytes // 2048)
