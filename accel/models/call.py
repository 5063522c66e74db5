"""Building a pipeline call from a recipe: its keyword arguments (the recipe over the family's and the
variant's defaults, the variant's input files), refused in one line where the pipeline would not take
them; the guidance a `guider` takes; the steps a call runs; the recipe as a call resolved it."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from accel.errors import UserError
from accel.models.base import Family, GenerationDefaults
from accel.models.input_checks import (
    call_arguments,
    condition_arguments,
    input_arguments,
    named_input_arguments,
    picture_list,
    refuse_together,
)
from accel.models.input_files import InputLatents, InputVideo, clip_frames, latent_settings
from accel.models.variants import component_folders, made_by, variant_of, variant_of_class
from accel.parallel.plan import refuse_layout
from accel.recipe import Recipe


def generation_kwargs(
    family: Family, tiny: bool, recipe: Recipe, pipe: Any = None, loads_as: str | None = None
) -> dict[str, Any]:
    """The pipeline call's keyword arguments: recipe values over the family's (or tiny) defaults, and
    the input files the pipeline variant needs (`[model] pipeline`, else the loaded `pipe`'s class, else
    `loads_as`: the class a saved folder names, known before loading)."""
    settings = recipe.generate
    if recipe.model.pipeline:
        variant = variant_of(family, recipe.model.pipeline)
    elif pipe is not None:
        variant = variant_of_class(family, type(pipe))
    else:
        variant = variant_of(family, loads_as if loads_as in family.pipeline_classes else family.pipeline_class)
    defaults: GenerationDefaults = (family.tiny_defaults if tiny else None) or variant.defaults or family.defaults
    maker, kind = made_by(family, variant.pipeline_class)

    def pick(name: str, default: Any) -> Any:
        value = getattr(settings, name)
        return default if value is None else value

    kwargs: dict[str, Any] = {
        "prompt": pick("prompt", defaults.prompt),
        "num_inference_steps": pick("steps", defaults.steps),
        "height": pick("height", defaults.height),
        "width": pick("width", defaults.width),
    }
    guidance = pick("guidance_scale", defaults.guidance_scale)
    if guidance is not None:
        kwargs["guidance_scale"] = guidance
    negative = pick("negative_prompt", defaults.negative_prompt)
    if negative is not None:
        kwargs["negative_prompt"] = negative
    if settings.true_cfg_scale is not None and not family.true_cfg:
        raise UserError(f"[generate] true_cfg_scale: {family.title} pipelines have no true CFG scale")
    true_cfg = pick("true_cfg_scale", defaults.true_cfg_scale)
    if true_cfg is not None:
        kwargs["true_cfg_scale"] = true_cfg
    video = family.frames_arg is not None and kind != "image"  # videos, HDR ones too, take a frame count
    if video:
        kwargs[family.frames_arg] = pick("frames", defaults.frames)
    elif settings.frames is not None:
        raise UserError(f"[generate] frames: {maker} makes images; remove frames")
    refuse_together(
        variant,
        {"image": settings.image, "mask": settings.mask, "video": settings.video, "conditions": settings.conditions},
    )
    inputs = input_arguments(variant, settings.image, settings.mask, settings.video)
    kwargs.update(inputs)
    # A missing component: one line before a long load (a tiny variant's builder, a folder saved as the variant, hold
    # theirs).
    component_folders(
        variant, recipe.model.components, not tiny and variant.pipeline_class != (loads_as or _class_of(pipe))
    )
    named = named_input_arguments(variant, settings.inputs, settings.arguments)
    kwargs.update(named)
    for path in named.values():  # a latent pass fixes the canvas the call works on
        if isinstance(path, InputLatents):
            _take_settings(kwargs, latent_settings(path), path, settings, family.frames_arg)
    kwargs.update(condition_arguments(variant, settings.conditions or (), tiny))
    if settings.references and variant.pictures > 1:  # more pictures after --image, in one list
        kwargs[variant.image] = picture_list(variant, kwargs.get(variant.image), settings.references)
        references = {}
    else:
        references = condition_arguments(variant, settings.references or (), tiny, key="references")
    kwargs.update(references)
    if video and settings.frames is None and variant.video in inputs:
        kwargs[family.frames_arg] = clip_frames(inputs[variant.video])  # the clip's length, unless asked otherwise
    elif (
        video
        and settings.frames is None
        and variant.references is not None
        and variant.references.sets_frames
        and references
    ):
        first = next(iter(references.values()))[0][0]  # (file, index, strength) of the first reference
        if isinstance(first, InputVideo):
            kwargs[family.frames_arg] = clip_frames(first)  # HDR converts the whole clip, unless asked otherwise
    if variant.area is not None:
        kwargs[variant.area] = kwargs["height"] * kwargs["width"]
    if variant.seed is not None:  # the call seeds generators of its own from it: the run's seed, on every rank
        kwargs[variant.seed] = settings.seed
    kwargs.update(variant.fixed)
    if tiny:
        kwargs.update(variant.tiny_fixed)
    if (
        pipe is not None or recipe.model.pipeline
    ):  # the family's own pipeline takes its defaults: no diffusers import before start
        _fit_to_call(kwargs, type(pipe) if pipe is not None else _pipeline_class(variant.pipeline_class), settings)
    taken = dict(kwargs)  # what accel fills: `[generate] arguments` may not replace it, the variant's defaults it may
    taken.update({keyword: None for spec in variant.inputs for _, keyword in spec.fields})  # filled from a latent pass
    kwargs.update(variant.arguments)
    if settings.arguments:
        sources = {
            **_RECIPE_KEYS,
            **{
                keyword: name
                for name, keyword in (
                    ("frames", family.frames_arg),
                    ("image", variant.image),
                    ("mask", variant.mask),
                    ("video", variant.video),
                )
                if keyword
            },
            **{spec.keyword: "inputs" for spec in variant.inputs},
            **({variant.seed: "seed"} if variant.seed else {}),
            **{keyword: "inputs" for spec in variant.inputs for _, keyword in spec.fields},
        }
        pipeline = type(pipe) if pipe is not None else _pipeline_class(variant.pipeline_class)
        kwargs.update(call_arguments(pipeline, settings.arguments, taken, sources))
    refuse_layout(family, variant, recipe.parallel)  # as apply does: nothing to cut, or no guidance to turn on
    if (
        recipe.parallel.cfg > 1
        and (pipe is not None or recipe.model.pipeline)
        and not _takes_guidance(family, pipe, variant)
    ):
        raise UserError(
            f"[parallel] cfg = 2 splits the classifier-free guidance branches, and {variant.pipeline_class} runs none "
            f"(its call takes no {family.cfg_scale}); set cfg = 1"
        )
    if recipe.parallel.cfg > 1 and (reason := family.cfg_off(kwargs)):
        raise UserError(
            f"[parallel] cfg = 2 splits the classifier-free guidance branches, but {reason}; turn guidance on or set "
            "cfg = 1"
        )
    _refuse_rounded(family, settings, kwargs)
    return kwargs


def _refuse_rounded(family: Family, settings: Any, kwargs: Mapping[str, Any]) -> None:
    """A height, width or frame count asked that the pipeline would round (or refuse mid-run): one
    line naming the sizes it makes, so the file written is the size asked."""
    for key, keyword in (("height", "height"), ("width", "width"), ("frames", family.frames_arg)):
        value = getattr(settings, key)
        if (
            value is not None
            and keyword in kwargs
            and kwargs[keyword] == value
            and (problem := family.size_problem(key, value))
        ):
            raise UserError(problem)


def _takes_guidance(family: Family, pipe: Any, variant: Any) -> bool:
    """Whether the pipeline's call (or its guider) takes the family's guidance scale: a distilled one (DFR) does not."""
    pipeline = type(pipe) if pipe is not None else _pipeline_class(variant.pipeline_class)
    parameters = inspect.signature(pipeline.__call__).parameters
    return (
        family.cfg_scale in parameters
        or guided_by_guider(pipeline)
        or any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    )


def _class_of(pipe: Any) -> str | None:
    return type(pipe).__name__ if pipe is not None else None


def _take_settings(
    kwargs: dict[str, Any], fixed: Mapping[str, Any], path: str, settings: Any, frames_arg: str | None
) -> None:
    """The call keywords a latent pass fixes replace the defaults; a recipe value that differs is one line."""
    for keyword, value in fixed.items():
        key = "frames" if keyword == frames_arg else _RECIPE_KEYS.get(keyword, keyword)
        asked = getattr(settings, key, None)
        if asked is not None and asked != value:
            raise UserError(
                f"[generate] {key}: the latent pass {path} holds {keyword} = {value}, not {asked}; remove {key} "
                "(the pass sets it)"
            )
        kwargs[keyword] = value


# The recipe key each call keyword comes from (frames: any family's frame keyword).
_RECIPE_KEYS = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "num_inference_steps": "steps",
    "height": "height",
    "width": "width",
    "guidance_scale": "guidance_scale",
    "true_cfg_scale": "true_cfg_scale",
}


def _pipeline_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, name)


def _fit_to_call(kwargs: dict[str, Any], pipeline: type, settings: Any) -> None:
    """Drop the family defaults this pipeline's call does not take (FluxFillPipeline has no negative
    prompt); a setting the user gave that it does not take is one line, not a TypeError mid-run."""
    parameters = inspect.signature(pipeline.__call__).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return
    taken = set(parameters) | ({"guidance_scale"} if guided_by_guider(pipeline) else set())
    for keyword in [keyword for keyword in kwargs if keyword not in taken]:
        key = _RECIPE_KEYS.get(keyword, "frames")
        if getattr(settings, key, None) is not None:
            # A distilled schedule (LTX-2.5 DFR) is its steps: say where they are set.
            hint = (
                " (its steps are its schedule: --arg sigmas=[…])"
                if keyword == "num_inference_steps" and "sigmas" in parameters
                else ""
            )
            raise UserError(f"[generate] {key}: {pipeline.__name__} takes no {keyword}; remove it{hint}")
        del kwargs[keyword]


def guided_by_guider(pipeline: type) -> bool:
    """Whether the pipeline takes its guidance scale from a `guider` component (diffusers' guiders:
    HunyuanVideo 1.5) rather than from a call keyword; accel then sets `guidance_scale` there."""
    return (
        "guidance_scale" not in inspect.signature(pipeline.__call__).parameters
        and "guider" in inspect.signature(pipeline.__init__).parameters
    )


def planned_class(ref: Any, recipe: Recipe) -> str:
    """The pipeline class a run will make, known before loading (a folder's own class, else the family's)."""
    return recipe.model.pipeline or (
        ref.pipeline if ref.pipeline in ref.family.pipeline_classes else ref.family.pipeline_class
    )


def call_steps(pipe: Any, kwargs: dict[str, Any]) -> int:
    """Denoising steps of one call: its step count, or, for a pipeline that takes none, the sum of
    its steps per stage (Helios's pyramid) or the length of its `sigmas` (a distilled schedule,
    LTX-2.5 DFR's), as given or by default."""
    if "num_inference_steps" in kwargs:
        return int(kwargs["num_inference_steps"])
    stages = _given_or_default(pipe, kwargs, "pyramid_num_inference_steps_list")
    if stages is not None:
        return int(sum(stages))
    sigmas = _given_or_default(pipe, kwargs, "sigmas")
    return len(sigmas) if sigmas is not None else 0


def _given_or_default(pipe: Any, kwargs: dict[str, Any], keyword: str) -> Any:
    """The call's `keyword`, else its default in the pipeline's signature (None: neither)."""
    if kwargs.get(keyword) is not None:
        return kwargs[keyword]
    parameter = inspect.signature(type(pipe).__call__).parameters.get(keyword)
    return parameter.default if parameter is not None and parameter.default is not inspect.Parameter.empty else None


def effective_recipe(
    recipe: Recipe, call: Mapping[str, Any], frames_arg: str | None, device: str, dtype: str
) -> Recipe:
    """`recipe` as the run resolved it: the device and dtype "auto" picked, and the [generate] keys
    it left unset as the call got them (the family's defaults, a clip's frame count), in recipe key names."""
    keys = {**_RECIPE_KEYS, **({frames_arg: "frames"} if frames_arg else {})}
    filled = {
        keys[keyword]: value
        for keyword, value in call.items()
        if keyword in keys and getattr(recipe.generate, keys[keyword]) is None and isinstance(value, (int, float, str))
    }
    return recipe.with_overrides(
        {"model": {"device": device, "dtype": dtype}, "generate": filled}, source=recipe.source
    )
