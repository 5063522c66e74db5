"""Step caching: every method is a `StepCache` (accel/cache/calls.py: branches, steps, statistics),
named with its settings in accel/cache/config.py (torch-free: the recipe reads it).
First Block Cache and DBCache share one block installer (accel/cache/blocks.py), with the skipped
blocks' residual reused or extrapolated (accel/cache/calibrate.py); TaylorSeer extrapolates the
attention and feed-forward outputs inside every block (accel/cache/taylorseer.py); MagCache skips
whole calls along a calibrated residual-magnitude curve (accel/cache/magcache.py). Where a deciding
cache sums its change over the ranks: accel/cache/sums.py."""
