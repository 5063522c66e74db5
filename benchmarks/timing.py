"""Timing shared by the benchmark scripts (run as `python benchmarks/X.py`, so this imports as `timing`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(
    fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None, warmup: int = 0
) -> float:
    """Median wall time of `fn` over `repeats` runs after `warmup` untimed ones; `sync` brackets each
    timed run (a device synchronize, a barrier across ranks)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
