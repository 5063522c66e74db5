"""Step caching: one installer (accel/cache/blocks.py) for First Block Cache and DBCache, with the
skipped blocks' residual reused or extrapolated (accel/cache/calibrate.py)."""

from accel.cache.blocks import BlockCache
from accel.cache.fbcache import FirstBlockCache
from accel.cache.stats import CacheStats, CallRecord

__all__ = ["BlockCache", "CacheStats", "CallRecord", "FirstBlockCache"]
