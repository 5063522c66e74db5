"""Step caching: every method is a `StepCache` (accel/cache/calls.py: branches, steps, statistics).
First Block Cache and DBCache share one block installer (accel/cache/blocks.py), with the skipped
blocks' residual reused or extrapolated (accel/cache/calibrate.py); TaylorSeer extrapolates the
attention and feed-forward outputs inside every block (accel/cache/taylorseer.py); MagCache skips
whole calls along a calibrated residual-magnitude curve (accel/cache/magcache.py)."""

from accel.cache.blocks import BlockCache
from accel.cache.calls import StepCache
from accel.cache.fbcache import FirstBlockCache
from accel.cache.magcache import MagCache
from accel.cache.stats import CacheStats, CallRecord
from accel.cache.taylorseer import TaylorSeerCache

__all__ = ["BlockCache", "CacheStats", "CallRecord", "FirstBlockCache", "MagCache", "StepCache", "TaylorSeerCache"]
