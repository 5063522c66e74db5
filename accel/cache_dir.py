"""accel's folder for what it keeps between runs (verdicts of automatic plans, served video jobs)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$ACCEL_CACHE_DIR, else accel/ under the user's cache folder ($XDG_CACHE_HOME or ~/.cache)."""
    root = os.environ.get("ACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "accel"
    )
    return Path(root)
