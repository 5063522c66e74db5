"""accel: fast diffusion-transformer inference on unmodified diffusers pipelines.

Public names load lazily: `import accel` (and `accel --help`) stays fast until one is used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "apply": "accel.apply_recipe",
    "AccelHandle": "accel.handle",
    "load_pipeline": "accel.models.loading",
    "Recipe": "accel.recipe",
    "load_recipe": "accel.recipe",
}

__all__ = ["AccelHandle", "Recipe", "__version__", "apply", "load_pipeline", "load_recipe"]

if TYPE_CHECKING:
    from accel.apply_recipe import apply
    from accel.handle import AccelHandle
    from accel.models.loading import load_pipeline
    from accel.recipe import Recipe, load_recipe


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'accel' has no attribute {name!r}")
