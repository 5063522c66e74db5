"""The family registry: name → Family, and recognising the family of a loaded pipeline."""

from __future__ import annotations

import difflib
from typing import Any

from accel.errors import ModelError
from accel.models import cogvideox, flux, hunyuan, ltx, mochi, wan
from accel.models.base import Family

FAMILIES: dict[str, Family] = {
    module.FAMILY.name: module.FAMILY for module in (flux, hunyuan, wan, cogvideox, mochi, ltx)
}

# Aliases users type for families whose registry name is terse.
ALIASES: dict[str, str] = {"hunyuanvideo": "hunyuan", "cogvideo": "cogvideox", "ltx-video": "ltx"}


def known_names() -> list[str]:
    names = list(FAMILIES)
    names += [family.tiny_alias for family in FAMILIES.values() if family.tiny_alias]
    return names


def lookup(name: str) -> tuple[Family, bool] | None:
    """The family for an alias or tiny alias, and whether the tiny variant was asked for."""
    key = name.lower()
    key = ALIASES.get(key, key)
    if key in FAMILIES:
        return FAMILIES[key], False
    if key.startswith("tiny-"):
        family = FAMILIES.get(ALIASES.get(key[5:], key[5:]))
        if family is not None and family.tiny is not None:
            return family, True
    return None


def unknown_model_message(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), known_names(), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"unknown model '{name}'{hint}: use one of {', '.join(known_names())}, "
        "a Hugging Face repo id (owner/name) or a local pipeline folder"
    )


def family_of(pipe: Any) -> Family:
    """The family whose transformer this pipeline holds, recognised by class (subclasses too)."""
    for family in FAMILIES.values():
        for attr in family.transformer_attrs:
            transformer = getattr(pipe, attr, None)
            if transformer is not None and any(
                cls.__name__ == family.transformer_class for cls in type(transformer).__mro__
            ):
                return family
    found = getattr(getattr(pipe, "transformer", None), "__class__", type(None)).__name__
    supported = ", ".join(f.transformer_class for f in FAMILIES.values())
    raise ModelError(
        f"accel does not support {type(pipe).__name__} (transformer {found}); "
        f"supported transformers: {supported}"
    )
