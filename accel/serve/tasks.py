"""Which pipeline answers a request: the served one, or a sibling on the same weights.

FLUX.1 [dev]'s checkpoint runs as FluxPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline alike
(`Variant.same_weights_as`). A server of any of them answers the others' requests: an edit with a
mask on a text-to-image server runs the inpaint pipeline, a prompt alone on an img2img server the
text-to-image one. Each replica builds a sibling from the served pipeline's modules the first time a
request needs it and attaches it to the same accelerators (AccelHandle.attach), so nothing loads,
splits, quantizes or compiles again.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from accel.models.base import Family
from accel.models.variant_format import Variant
from accel.models.variants import variant_of


def siblings_of(family: Family, served: Variant) -> dict[str, Variant]:
    """The family's pipelines on the served one's checkpoint, by class, the served one first."""
    root = served.same_weights_as or served.pipeline_class
    found = {served.pipeline_class: served}
    for name in family.pipeline_classes:
        variant = variant_of(family, name)
        if name not in found and (variant.same_weights_as or name) == root:
            found[name] = variant
    return found


def needs(variant: Variant, given: Set[str]) -> set[str]:
    """The pictures `variant` requires that the request does not give."""
    required = {
        name for name in ("image", "mask") if getattr(variant, name) is not None and name not in variant.optional
    }
    return required - set(given)


def takes(variant: Variant, given: Set[str]) -> bool:
    return all(getattr(variant, name, None) is not None for name in given)


def pipeline_for(
    family: Family,
    served: Variant,
    choices: dict[str, Variant],
    output: str,
    given: Set[str],
    asked: str | None = None,
) -> str | None:
    """The pipeline class (of `choices`, the served one first) to run a request with pictures `given`
    (image, mask) on: None for the served one. `asked` is the request's own choice, checked; without
    one, the served pipeline where it takes the request as it is, else the first sibling that does.
    Where none does, the served one, whose checks then say what is missing."""
    choices = choices or {served.pipeline_class: served}
    siblings = {name: variant for name, variant in choices.items() if family.output_of(name) == output}
    if asked is not None:
        if asked not in siblings:
            raise ValueError(f"pipeline: this server runs {', '.join(siblings)}, not {asked!r}")
        return None if asked == served.pipeline_class else asked
    for name, variant in siblings.items():
        if takes(variant, given) and not needs(variant, given):
            return None if name == served.pipeline_class else name
    return None


def build_sibling(pipe: Any, handle: Any, pipeline_class: str) -> Any:
    """`pipeline_class` on `pipe`'s modules, accelerated with it (every rank of a replica builds it
    at the same job)."""
    import diffusers

    sibling = getattr(diffusers, pipeline_class).from_pipe(pipe)
    sibling.set_progress_bar_config(disable=True)
    handle.attach(sibling)
    return sibling
