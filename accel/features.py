"""Which accelerators have landed: a recipe asking for one that has not is refused, not ignored.

Kept free of torch so the CLI can refuse such a recipe in a fraction of a second.
"""

from __future__ import annotations

from accel.errors import NotAvailableError
from accel.recipe import Recipe


def unavailable_features(recipe: Recipe) -> list[str]:
    """What the recipe asks for that has not landed yet, one phrase each (empty when all is well)."""
    missing = []
    if recipe.quant.type != "none":
        missing.append(f"[quant] type = '{recipe.quant.type}': quantization")
    if recipe.compile.enabled:
        missing.append("[compile] enabled = true: torch.compile")
    return missing


def ensure_available(recipe: Recipe) -> None:
    """Refuse, before anything loads or starts, a recipe that asks for a feature not built yet."""
    missing = unavailable_features(recipe)
    if missing:
        raise NotAvailableError(
            f"{missing[0]} is not available yet in accel {_version()}; remove it from the recipe or flags"
        )


def _version() -> str:
    from accel import __version__

    return __version__
