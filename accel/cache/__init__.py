"""Step caching accelerators (First Block Cache; later calibrators plug in here)."""

from accel.cache.fbcache import CacheStats, CallRecord, FirstBlockCache

__all__ = ["CacheStats", "CallRecord", "FirstBlockCache"]
