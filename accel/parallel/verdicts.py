"""Verdicts on learned plans kept on disk, per (transformer class, config, accel version, layout), so
a model is verified once, not at every start; written atomically, read by `accel inspect`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from accel.cache_dir import cache_root
from accel.parallel.plan_format import ParallelPlan


# A verdict's `sources` where the class's own `_cp_plan` was tried before the automatic plan.
DIFFUSERS_FIRST = "diffusers _cp_plan, automatic"


def plan_digest(plan: ParallelPlan) -> str:
    return hashlib.sha256(repr(plan).encode()).hexdigest()[:16]


def verdict_identity(transformer: nn.Module, ulysses: int, ring: int) -> dict[str, Any] | None:
    """What a verdict holds for: the transformer's class and config, accel's version, the layout.
    None for a model with no diffusers config, whose class alone does not say what it computes (it
    is verified at every start)."""
    from accel import __version__
    from accel.models.generic import config_hash

    if not getattr(transformer, "config", None):
        return None
    return {
        "class": type(transformer).__name__,
        "config": config_hash(transformer),
        "version": __version__,
        "ulysses": ulysses,
        "ring": ring,
    }


def identity_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def verdict_key(transformer: nn.Module, ulysses: int, ring: int) -> str | None:
    """The verdict's name on disk (None: not kept)."""
    identity = verdict_identity(transformer, ulysses, ring)
    return None if identity is None else identity_key(identity)


def verdict_dir() -> Path:
    """Where verdicts are kept: $ACCEL_CACHE_DIR, else accel/ under the user's cache folder."""
    return cache_root() / "plans"


def verdicts_for(transformer_class: str, config: str) -> list[dict[str, Any]]:
    """The verdicts kept for a transformer class and config hash under this accel version, by layout."""
    from accel import __version__

    found = []
    for path in sorted(verdict_dir().glob("*.json")):
        verdict = read_verdict(path.stem)
        if verdict is not None and (verdict.get("class"), verdict.get("config"), verdict.get("version")) == (
            transformer_class,
            config,
            __version__,
        ):
            found.append(verdict)
    return sorted(found, key=lambda v: (v.get("ulysses", 1) * v.get("ring", 1), v.get("ring", 1)))


def read_verdict(key: str) -> dict[str, Any] | None:
    try:
        value = json.loads((verdict_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_verdict(key: str, verdict: dict[str, Any]) -> None:
    """Atomically, so ranks writing the same verdict at once never leave half a file; a cache that
    cannot be written only costs a verification at the next start."""
    folder = verdict_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "w") as file:
            json.dump(verdict, file)
        os.replace(temporary, folder / f"{key}.json")
    except OSError:
        pass
