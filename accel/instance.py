"""Instance-level overrides: shadow one object's attribute, never its class, and undo it exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()


def override(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set `name` on this instance only and return the function that puts back what was there
    (an earlier instance attribute, or nothing, so the class's own attribute shows again)."""
    saved = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)

    def undo() -> None:
        if saved is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, saved)

    return undo
