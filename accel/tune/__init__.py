"""`accel tune`: what the caches need from the user's own pipeline.

`--calibrate` measures MagCache's curve (`calibrate`); `--target` searches the cache settings for the
fastest one whose worst-prompt quality meets a target (`search`, `trials`, `job`).
"""

from accel.tune.calibrate import (
    DEFAULT_MAGCACHE_THRESHOLD,
    calibrate,
    calibrate_magcache,
    calibrated_recipe,
    fresh_recipe_path,
    write_recipe,
)

__all__ = [
    "DEFAULT_MAGCACHE_THRESHOLD",
    "calibrate",
    "calibrate_magcache",
    "calibrated_recipe",
    "fresh_recipe_path",
    "write_recipe",
]
