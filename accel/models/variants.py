"""Pipeline variants: the other diffusers pipelines of a family's transformer, and their input files.

A family is its transformer class, so FluxKontextPipeline or QwenImageEditPipeline get every
accelerator the base pipeline has; what differs is the call: an input image, a mask. This module
picks the variant (`[model] pipeline`, or the class a repo loads as), checks the inputs before
any rank starts, and opens them for the call. No torch here: it runs in the launcher's preflight.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accel.errors import UserError
from accel.models.base import Family, Variant

# What each input is called on the command line and in the recipe.
FLAGS = {"image": "--image PATH ([generate] image)", "mask": "--mask PATH ([generate] mask)"}


class InputImage(str):
    """A path the pipeline call receives as a PIL image: it stays a path (and JSON) until the call."""


def variant_of(family: Family, pipeline_class: str) -> Variant:
    """The family's entry for `pipeline_class` (the base pipeline, unless listed: a variant with no inputs)."""
    for variant in family.variants:
        if variant.pipeline_class == pipeline_class:
            return variant
    if pipeline_class == family.pipeline_class:
        return Variant(pipeline_class)
    known = ", ".join(family.pipeline_classes)
    raise UserError(
        f"[model] pipeline: {pipeline_class} is not a pipeline accel runs for {family.title} "
        f"({family.transformer_class}); use one of {known}, or build it in your own script and call accel.apply"
    )


def variant_of_class(family: Family, cls: type) -> Variant:
    """The variant a loaded pipeline is (its class or the nearest listed base class). A pipeline
    class accel does not list (a user's own) gets no input keywords: it is called as the base one."""
    names = [klass.__name__ for klass in cls.__mro__]
    for name in names:
        if name in family.pipeline_classes:
            return variant_of(family, name)
    return Variant(cls.__name__)


def refuse_split(variant: Variant, sequence: int) -> None:
    """One line, before any rank starts, where Ulysses / Ring would cut a pipeline they cannot."""
    if sequence > 1 and variant.not_split:
        raise UserError(
            f"[parallel] ulysses × ring = {sequence}: context parallelism cannot split {variant.pipeline_class}: "
            f"{variant.not_split}; set ulysses = 1 and ring = 1 (the cache, quantization and compile still apply)"
        )


def input_arguments(variant: Variant, image: str | None, mask: str | None) -> dict[str, InputImage]:
    """The call's keyword arguments for the input files; a missing required one, or one the pipeline
    does not take, is one line naming the flag."""
    arguments: dict[str, InputImage] = {}
    for name, keyword, path in (("image", variant.image, image), ("mask", variant.mask, mask)):
        if keyword is None and path is not None:
            raise UserError(f"[generate] {name}: {variant.pipeline_class} takes no {name}; remove --{name}")
        if keyword is not None and path is None and name not in variant.optional:
            raise UserError(f"{variant.pipeline_class} needs an input {name}: pass {FLAGS[name]}")
        if keyword is not None and path is not None:
            arguments[keyword] = InputImage(_readable_image(name, path))
    return arguments


def _readable_image(name: str, path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"[generate] {name}: {path} does not exist; pass an image file (PNG, JPEG, WebP, …)")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(file) as picture:
            picture.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise UserError(f"[generate] {name}: {path} is not an image Pillow can read ({error})") from None
    return str(file)


def open_inputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with every InputImage opened as an RGB PIL image (what the pipelines take)."""
    from PIL import Image

    opened = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, InputImage):
            with Image.open(value) as picture:
                opened[key] = picture.convert("RGB")
    return opened
