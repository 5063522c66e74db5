"""The family registry: name → Family, and recognising the family of a loaded pipeline."""

from __future__ import annotations

import difflib
from typing import Any

from accel.models import (
    chronoedit,
    cogvideox,
    cosmos3,
    flux,
    flux2,
    helios,
    hunyuan,
    hunyuan15,
    hunyuanimage,
    kandinsky5,
    kandinsky6,
    ltx,
    ltx2,
    mochi,
    qwenimage,
    qwenimage21,
    sd3,
    skyreels2,
    wan,
    zimage,
)
from accel.models.base import Family

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        flux.FAMILY,
        hunyuan.FAMILY,
        wan.FAMILY,
        cogvideox.FAMILY,
        mochi.FAMILY,
        ltx.FAMILY,
        qwenimage.FAMILY,
        flux2.KLEIN,
        sd3.FAMILY,
        flux2.FAMILY,
        zimage.FAMILY,
        hunyuan15.FAMILY,
        skyreels2.FAMILY,
        kandinsky5.FAMILY,
        ltx2.FAMILY,
        chronoedit.FAMILY,
        hunyuanimage.FAMILY,
        qwenimage21.FAMILY,
        helios.FAMILY,
        cosmos3.FAMILY,
        kandinsky6.FAMILY,
    )
}

# Aliases users type for families whose registry name is terse.
ALIASES: dict[str, str] = {
    "hunyuanvideo": "hunyuan",
    "hunyuanvideo15": "hunyuan15",
    "cogvideo": "cogvideox",
    "ltx-video": "ltx",
    "kandinsky": "kandinsky5",
    "ltx-2": "ltx2",
    "hunyuanimage21": "hunyuanimage",
    "hunyuanimage-2.1": "hunyuanimage",
    "qwen-image-2.1": "qwenimage21",
    "kandinsky-6": "kandinsky6",
}


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


def _is_a(obj: Any, class_name: str) -> bool:
    return obj is not None and any(cls.__name__ == class_name for cls in type(obj).__mro__)


def _lists_pipeline(family: Family, pipeline: type) -> bool:
    return any(cls.__name__ in family.pipeline_classes for cls in pipeline.__mro__)


def family_of_classes(transformer_class: str, pipeline_class: str | None) -> Family | None:
    """The family of a saved pipeline, from its class names alone (model_index.json)."""
    matching = [family for family in FAMILIES.values() if transformer_class in family.transformer_classes]
    for family in matching:
        if pipeline_class in family.pipeline_classes:
            return family
    return matching[0] if matching else None


def unknown_model_message(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), known_names(), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"unknown model '{name}'{hint}: use one of {', '.join(known_names())}, "
        "a Hugging Face repo id (owner/name) or a local pipeline folder"
    )


def family_of(pipe: Any) -> Family:
    """The family whose transformer this pipeline holds, recognised by class (subclasses too). Where
    families share a transformer class (FLUX.2 dev and Klein), the one that lists the pipeline's class.
    A pipeline no family knows gets the record accel learns from the model (accel/models/generic.py)."""
    matching = [
        family
        for family in FAMILIES.values()
        if any(
            _is_a(getattr(pipe, attr, None), name)
            for attr in family.transformer_attrs
            for name in family.transformer_classes
        )
    ]
    if matching:
        return next((family for family in matching if _lists_pipeline(family, type(pipe))), matching[0])
    from accel.models.generic import learned_family

    return learned_family(pipe)
