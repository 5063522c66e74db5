"""load → warm up → timed generation → save; what `accel run` does, returning Metrics."""

from __future__ import annotations

import functools
import inspect
import resource
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel.compose import apply
from accel.errors import NotAvailableError, UserError
from accel.files import claim, write_file, write_fresh
from accel.media import Audio, output_writer, viewable
from accel.models.base import OUTPUT_FILES, Family, GenerationDefaults, OutputKind
from accel.models.loading import load_pipeline, resolve_device, resolve_dtype, resolve_model
from accel.optimize.compile import compiled_graphs
from accel.optimize.quantize import check_hardware
from accel.parallel.plan import refuse_layout
from accel.parallel.comm import TRAFFIC
from accel.parallel.encoders import ONE_RANK_PLACEMENTS, SHARDED, loads_text_encoders, refusal_before_start
from accel.vae.placement import decodes_here, loads_vae_on_gpu
from accel.parallel.mesh import Degrees, init_distributed, tp_slice
from accel.models.registry import family_of
from accel.models.variants import (
    LATENTS_MARK,
    InputLatents,
    InputVideo,
    call_arguments,
    check_out_suffix,
    clip_frames,
    component_folders,
    condition_arguments,
    input_arguments,
    latent_settings,
    made_by,
    named_input_arguments,
    open_inputs,
    refuse_together,
    variant_of,
    variant_of_class,
)
from accel.prompts import truncation_notes
from accel.quality import psnr, ssim
from accel.recipe import Recipe
from accel.steps import StepEvents, StepListener
from accel.threads import cpu_threads


@dataclass
class Measurement:
    """Timed generations after their warm-up runs (`output`: a latent pass's saved fields where asked)."""

    output: np.ndarray | dict[str, Any] | None  # None on a rank that does not decode ([memory] vae = "rank0")
    times: list[float]
    warmup_seconds: float
    steps: int
    peak_memory_bytes: int
    # Bytes this rank sent through collectives during the timed runs, by kind.
    bytes_sent: dict[str, int]
    # Graphs torch.compile built during the warm-up and during the timed runs (None: not counted).
    graphs_warmup: int | None = None
    graphs_timed: int | None = None
    # The sound the last run made with its video (LTX-2); None: the pipeline makes none.
    audio: Audio | None = None

    @property
    def seconds(self) -> float:
        """The median timed run: robust to one slow repeat."""
        return statistics.median(self.times)


@dataclass
class Measured:
    """One recipe applied to a pipeline and measured: what `run` and each bench variant report."""

    measurement: Measurement
    cache: dict[str, Any] | None
    degrees: Degrees | None
    vae_split: bool
    quant: dict[str, Any] | None
    # Scope, mode, compiled_modules and the graphs built in warm-up / timed runs (None: no compile).
    compile: dict[str, Any] | None
    # Where the context-parallel plan came from: "family", or, learned and verified, "automatic" or
    # "diffusers _cp_plan" (the class's own plan, its streams learned).
    plan: str = "family"
    # Lines for the run's report about how the recipe met the calls (a context-parallel plan that cut none).
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_sent_per_rank(self) -> dict[str, int] | None:
        """This rank's bytes by collective kind; None on one process, and with compile, whose
        collectives inside graphs are not counted (comm.Traffic): no partial figure."""
        if self.degrees is None or self.compile is not None:
            return None
        return dict(self.measurement.bytes_sent)


@dataclass
class Metrics:
    """Everything `accel run` reports; `as_dict()` is the --json document."""

    model: str
    family: str
    output_kind: str
    device: str
    dtype: str
    # The effective recipe (Recipe.to_dict, recipe key names): the one given, with every [generate]
    # key the family's defaults filled written out, so that `accel run --recipe` on the JSON rebuilds the run.
    recipe: dict[str, Any]
    load_s: float
    warmup_s: float
    generate_s: float
    steps: int
    peak_memory_bytes: int
    peak_memory_kind: str
    # accel plan's estimate of the peak per GPU (weights, the working phase, the reserve), where one applied.
    planned_peak_bytes: int | None = None
    output_path: str | None = None
    cache: dict[str, Any] | None = None
    # Context parallelism: degrees, whether they were chosen automatically, bytes this rank sent.
    parallel: dict[str, Any] | None = None
    # Quantization: scheme and layer counts; compile: scope, mode, graphs built (warm-up / timed).
    quant: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    # Every timed run (generate_s is their median).
    times_s: list[float] = field(default_factory=list)
    baseline_s: float | None = None
    psnr_db: float | None = None
    ssim: float | None = None
    # Frames of the video written (DFR's refine round makes twice its input's); None for pictures and latents.
    output_frames: int | None = None
    # Pixel size of the picture or video written; None for latents.
    output_width: int | None = None
    output_height: int | None = None
    # What the run changed or cut from what was asked (a long prompt, a size the pipeline rounded), one line each.
    notes: list[str] = field(default_factory=list)
    # Every timed baseline run with --compare (baseline_s is their median); how the two were ordered.
    baseline_times_s: list[float] = field(default_factory=list)
    compare_order: str | None = None
    # CPU threads the run computed with and what chose them (accel.threads.Threads.as_dict).
    threads: dict[str, Any] | None = None

    @property
    def per_step_s(self) -> float:
        return self.generate_s / self.steps if self.steps else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.generate_s if self.generate_s > 0 else float("nan")

    @property
    def speedup(self) -> float | None:
        """Baseline over accelerated: the median of the per-pair ratios when the runs alternated
        (`paired_ratios`), else baseline median / median; None without --compare."""
        if self._paired:
            return statistics.median(paired_ratios(self.baseline_times_s, self.times_s))
        return self.baseline_s / self.generate_s if self.baseline_s and self.generate_s > 0 else None

    @property
    def speedup_spread(self) -> tuple[float, float] | None:
        """The speedup's min–max over the repeats: of the per-pair ratios when the runs alternated,
        else `speedup_range`; None without --compare."""
        if self.speedup is None or not self.baseline_times_s or not self.times_s:
            return None
        if self._paired:
            ratios = paired_ratios(self.baseline_times_s, self.times_s)
            return min(ratios), max(ratios)
        return speedup_range(self.baseline_times_s, self.times_s)

    @property
    def _paired(self) -> bool:
        return self.compare_order == "interleaved" and 0 < len(self.baseline_times_s) == len(self.times_s)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        spread = self.speedup_spread
        data.update(
            per_step_s=self.per_step_s,
            steps_per_s=self.steps_per_s,
            speedup=self.speedup,
            min_s=min(self.times_s) if self.times_s else None,
            max_s=max(self.times_s) if self.times_s else None,
            speedup_min=spread[0] if spread else None,
            speedup_max=spread[1] if spread else None,
        )
        return data


def paired_ratios(baseline_times: list[float], times: list[float]) -> list[float]:
    """Baseline run i / accelerated run i: with alternating runs the two of a pair ran side by side,
    so a machine slowing down meanwhile cancels out of their ratio (measured on a shared 2-core VM:
    the median of these varied ±2 % between demo runs, the ratio of medians ±6 %)."""
    return [baseline / time for baseline, time in zip(baseline_times, times) if time > 0]


def speedup_range(baseline_times: list[float], times: list[float]) -> tuple[float, float]:
    """The widest spread the repeats allow: fastest baseline over
    slowest accelerated run, up to slowest baseline over fastest run. It always holds the ratio of
    medians, and a single repeat on both sides makes it that one ratio."""
    return min(baseline_times) / max(times), max(baseline_times) / min(times)


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


def guiders_of(pipe: Any) -> list[Any]:
    """The diffusers guiders a pipeline holds as components: its `guider`, and any other it picks
    per call (HunyuanImage 2.1's `ocr_guider`, for prompts with quoted text to render)."""
    from diffusers.guiders.guider_utils import BaseGuidance

    names = inspect.signature(type(pipe).__init__).parameters
    return [guider for name in names if isinstance(guider := getattr(pipe, name, None), BaseGuidance)]


@contextmanager
def _guider_scale(pipe: Any, call: dict[str, Any]) -> Iterator[None]:
    """Moves the call's `guidance_scale` onto each of the pipeline's guiders for the call (restored
    after). A pipeline built to hold one but loaded without (a guidance-distilled checkpoint: it
    runs no CFG) takes the call without it."""
    if "guidance_scale" not in call or not guided_by_guider(type(pipe)):
        yield
        return
    scale, guiders = call.pop("guidance_scale"), guiders_of(pipe)
    previous = [guider.guidance_scale for guider in guiders]
    for guider in guiders:
        guider.guidance_scale = scale
    try:
        yield
    finally:
        for guider, value in zip(guiders, previous):
            guider.guidance_scale = value


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


def output_array(result: Any, pipe: Any = None) -> Any:
    """What a pipeline result holds as its output, batched: video frames, images, Kandinsky 5's one
    `image` field, or the field the family of `pipe` names (`Family.result`: Cosmos 3's one-sample
    `video`, given a batch dim of one here)."""
    spec = family_of(pipe).result if pipe is not None else None
    if spec is not None and (value := getattr(result, spec.name, None)) is not None:
        return value if spec.batched else np.asarray(value)[None]
    for name in ("frames", "images", "image"):
        value = getattr(result, name, None)
        if value is not None:
            return value
    raise TypeError(f"{type(result).__name__} holds no frames, images or image")


def generate(pipe: Any, kwargs: dict[str, Any], seed: int) -> np.ndarray:
    """One pipeline call from a fresh CPU generator: the same seed gives the same noise on any device."""
    return generate_with_audio(pipe, kwargs, seed)[0]


def generate_with_audio(
    pipe: Any, kwargs: dict[str, Any], seed: int, latents: tuple[str, ...] = ()
) -> tuple[Any, Audio | None]:
    """`generate`, and the sound the pipeline made with the video where its family says it makes some.
    With `latents` (a variant's `latent_output`), the call returns latents and the output is what
    `--out NAME.pt` saves: those fields, on the CPU, marked with the pipeline that made them. On a rank
    that does not decode ([memory] vae = "rank0") the call returned latents: no output, no sound (only
    the first rank writes, reports or answers)."""
    generator = torch.Generator("cpu").manual_seed(seed)
    call = open_inputs(kwargs)
    with _guider_scale(pipe, call):
        result = pipe(**call, generator=generator, output_type="latent" if latents else "np")
    if latents:
        fields = {name: _on_cpu(getattr(result, name)) for name in latents}
        return {
            "kind": LATENTS_MARK,
            "pipeline": variant_of_class(family_of(pipe), type(pipe)).pipeline_class,
            "fields": fields,
        }, None
    if not decodes_here(pipe):
        return None, None
    return np.asarray(output_array(result, pipe))[0], audio_of(pipe, result)


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def audio_of(pipe: Any, result: Any) -> Audio | None:
    """The first sample's sound in a pipeline result, found where the family's `AudioOutput` says."""
    spec = family_of(pipe).audio
    samples = getattr(result, spec.field, None) if spec is not None else None
    if samples is None:
        return None
    if isinstance(samples, torch.Tensor):
        samples = samples.float().cpu().numpy()
    rate = functools.reduce(getattr, spec.sample_rate.split("."), pipe)
    return Audio(np.asarray(samples)[0] if spec.batched else np.asarray(samples), int(rate))


def measure(
    pipe: Any,
    kwargs: dict[str, Any],
    seed: int,
    warmup: int,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
    label: str = "generating",
    repeats: int = 1,
    latents: tuple[str, ...] = (),
) -> Measurement:
    """Warm-up runs, then `repeats` timed runs (the output is the last one's).

    `progress(label)` gives a context in which step events drive a bar (None: no bar)."""
    show = progress or (lambda _label: nullcontext())
    graphs_before = compiled_graphs()
    start = time.perf_counter()
    for index in range(warmup):
        with show(f"{label}: warm-up {index + 1}/{warmup}"):
            generate_with_audio(pipe, kwargs, seed, latents)
    warmup_seconds = time.perf_counter() - start
    graphs_warmed = compiled_graphs()
    device = _device_of(pipe)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    TRAFFIC.reset()
    times: list[float] = []
    with _PeakMemory(device) as memory:
        for index in range(repeats):
            with show(label if repeats == 1 else f"{label}: run {index + 1}/{repeats}"):
                start = time.perf_counter()
                output, audio = generate_with_audio(pipe, kwargs, seed, latents)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
    graphs_after = compiled_graphs()
    return Measurement(
        output,
        times,
        warmup_seconds,
        call_steps(pipe, kwargs),
        memory.peak,
        dict(TRAFFIC.bytes_sent),
        _difference(graphs_warmed, graphs_before),
        _difference(graphs_after, graphs_warmed),
        audio,
    )


def measure_recipe(
    pipe: Any,
    recipe: Recipe,
    kwargs: dict[str, Any],
    warmup: int,
    repeats: int = 1,
    progress: Callable[[str], AbstractContextManager[Any]] | None = None,
    label: str = "generating",
    latents: tuple[str, ...] = (),
) -> Measured:
    """Apply the recipe, measure it, undo it: every measured row of `run` and `bench` comes from here."""
    handle = apply(pipe, recipe)
    try:
        result = measure(pipe, kwargs, recipe.generate.seed, warmup, progress, label, repeats, latents)
        stats = handle.cache_stats
        compiled = None
        if recipe.compile.enabled:
            compiled = {
                "scope": recipe.compile.scope,
                "mode": recipe.compile.mode,
                "compiled_modules": sum(len(regions.modules) for regions in handle.compiled),
                "graphs_warmup": result.graphs_warmup,
                "graphs_timed": result.graphs_timed,
            }
        return Measured(
            result,
            cache=stats.as_dict() if stats is not None else None,
            degrees=handle.degrees,
            vae_split=handle.vae_decode is not None,
            quant=handle.quant.as_dict() if handle.quant is not None else None,
            compile=compiled,
            plan=next((plan.origin for plan in handle.plans.values() if plan.origin), "automatic")
            if handle.plans
            else "family",
            notes=[note for engine in handle.parallel.values() if (note := engine.uncut_note()) is not None],
        )
    finally:
        handle.remove()


def compare_order(recipe: Recipe) -> str:
    """How --compare orders its timed runs: "interleaved" (baseline, accelerated, baseline, …), so
    that a machine slowing down or speeding up meanwhile touches both sides alike; "sequential" (all
    baseline runs, then all accelerated ones) when the recipe compiles, quantizes, splits the
    weights over TP ranks, or drops or splits the text encoders ("rank0", "cpu", "sharded"), which
    re-applying for every run would redo (and the last three cannot be undone)."""
    split = recipe.parallel.tp > 1 and recipe.parallel.world_size > 1
    dropped = recipe.memory.text_encoder in (*ONE_RANK_PLACEMENTS, SHARDED) and recipe.parallel.world_size > 1
    return "sequential" if recipe.compile.enabled or recipe.quant.type != "none" or split or dropped else "interleaved"


def measure_compared(
    pipe: Any,
    recipe: Recipe,
    kwargs: dict[str, Any],
    warmup: int,
    repeats: int,
    progress: Callable[[str], AbstractContextManager[Any]] | None,
    order: str,
) -> tuple[Measurement, Measured]:
    """The baseline's and the recipe's measurements for --compare, in `order` (`compare_order`)."""
    unaccelerated = recipe.unaccelerated()
    if order == "sequential":
        return (
            measure_recipe(pipe, unaccelerated, kwargs, warmup, repeats, progress, "baseline").measurement,
            measure_recipe(pipe, recipe, kwargs, warmup, repeats, progress, "accelerated"),
        )
    baselines: list[Measurement] = []
    rounds: list[Measured] = []
    for index in range(repeats):
        label = "" if repeats == 1 else f": run {index + 1}/{repeats}"
        first = warmup if index == 0 else 0  # each side warms up once, before its first timed run
        baselines.append(
            measure_recipe(pipe, unaccelerated, kwargs, first, 1, progress, "baseline" + label).measurement
        )
        rounds.append(measure_recipe(pipe, recipe, kwargs, first, 1, progress, "accelerated" + label))
    last = rounds[-1]
    return _joined(baselines), Measured(
        _joined([measured.measurement for measured in rounds]),
        last.cache,
        last.degrees,
        last.vae_split,
        last.quant,
        last.compile,
        last.plan,
    )


def _joined(parts: list[Measurement]) -> Measurement:
    """One-run measurements as one: every time, the first warm-up, the last output, the highest peak, bytes summed."""
    sent: dict[str, int] = {}
    for part in parts:
        for kind, count in part.bytes_sent.items():
            sent[kind] = sent.get(kind, 0) + count
    last = parts[-1]
    return Measurement(
        last.output,
        [time for part in parts for time in part.times],
        parts[0].warmup_seconds,
        last.steps,
        max(part.peak_memory_bytes for part in parts),
        sent,
        parts[0].graphs_warmup,
        last.graphs_timed,
        last.audio,
    )


def _difference(after: int | None, before: int | None) -> int | None:
    return after - before if after is not None and before is not None else None


def run(
    recipe: Recipe,
    *,
    out: Path | None = None,
    overwrite: bool = False,
    compare: bool = False,
    warmup: int = 1,
    repeats: int = 1,
    progress: Callable[[str], Any] | None = None,
    announce: Callable[[str], None] | None = None,
    planned_peak: int | None = None,
) -> Metrics:
    """Run the recipe's model once as `accel run` does. `progress(label)` returns a context manager
    that shows denoising progress (the CLI passes a rich bar; the API passes nothing); `announce(line)`
    says when the load (often the longest wait) starts and how long it took. On a CPU the run
    computes with accel.threads' count (restored after)."""
    with cpu_threads(resolve_device(recipe.model.device)) as threads:
        metrics = _run(
            recipe,
            out=out,
            overwrite=overwrite,
            compare=compare,
            warmup=warmup,
            repeats=repeats,
            progress=progress,
            announce=announce,
        )
    metrics.threads = threads.as_dict()
    metrics.planned_peak_bytes = planned_peak
    return metrics


def _run(
    recipe: Recipe,
    *,
    out: Path | None,
    overwrite: bool,
    compare: bool,
    warmup: int,
    repeats: int,
    progress: Callable[[str], Any] | None,
    announce: Callable[[str], None] | None,
) -> Metrics:
    if warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {warmup}")
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    ref = resolve_model(recipe.model.name)
    planned = (
        made_by(ref.family, recipe.model.pipeline or ref.pipeline or ref.family.pipeline_class) if ref.family else None
    )
    planned_variant = variant_of(ref.family, planned_class(ref, recipe)) if ref.family else None
    _check_out(out, overwrite, planned, planned_variant)
    if compare and recipe.memory.offload != "none":
        raise UserError(
            f'--compare with [memory] offload = "{recipe.memory.offload}": the baseline would run from host memory on '
            f"the CPU, which says nothing of the speedup; drop one of them"
        )
    if compare and _latent(out):
        raise UserError(
            f"--compare measures the picture against the baseline's; --out {out} saves latents, so drop --compare"
        )
    if ref.family is not None:
        generation_kwargs(ref.family, ref.tiny, recipe, loads_as=ref.pipeline)  # refuse bad settings before a long load
    if recipe.memory.text_encoder == SHARDED and (refusal := refusal_before_start(ref)) is not None:
        raise NotAvailableError(refusal)

    device = resolve_device(recipe.model.device)
    dtype = resolve_dtype(recipe.model.dtype, ref)
    check_hardware(recipe.quant.type, device, dtype)
    lead = True
    if recipe.parallel.world_size > 1:  # before loading: on CUDA it picks this rank's GPU
        lead = init_distributed(device.type, recipe.parallel.timeout)[0] == 0
    # The writing rank claims --out now, so a second run aiming at it is refused before its load.
    with claim(out) if lead and out is not None else nullcontext():
        if lead:
            _check_out(
                out, overwrite, planned, planned_variant
            )  # again, now that it is ours: it may have appeared meanwhile
        say = announce or (lambda _line: None)
        say(f"loading {recipe.model.name}…")
        start = time.perf_counter()
        # Each rank reads only its TP slice, the text encoders only where it encodes ("rank0", "cpu") and
        # only its slice of them ("sharded": transformers splits them as it loads, over the whole job), unless
        # --compare needs the whole pipeline on every rank for its baseline.
        # Offloaded, the pipeline loads into host memory and accel.apply streams it to the device.
        pipe = load_pipeline(
            recipe.model.name,
            recipe.model.dtype,
            "cpu" if recipe.memory.offload != "none" else device,
            recipe.model.pipeline or None,
            recipe.model.lora,
            recipe.model.components,
            tp_slice=None if compare else tp_slice(recipe.parallel),
            text_encoders=compare or loads_text_encoders(recipe.memory.text_encoder, recipe.world_size),
            text_encoders_on_cpu=recipe.memory.text_encoder == "cpu" and not compare,
            text_encoders_tp=recipe.world_size if recipe.memory.text_encoder == SHARDED and not compare else 1,
            vae_on_cpu=not compare and not loads_vae_on_gpu(recipe.memory.vae, recipe.world_size),
        )
        load_s = time.perf_counter() - start
        say(f"loaded {recipe.model.name} in {load_s:.1f} s")
        family = family_of(pipe)
        variant = variant_of_class(family, type(pipe))
        made = made_by(family, variant.pipeline_class)
        latents = variant.latent_output if _latent(out) else ()
        pipe.set_progress_bar_config(disable=True)
        kwargs = generation_kwargs(family, ref.tiny, recipe, pipe)
        notes = truncation_notes(pipe, kwargs, family.prompt_tokenizers)

        bar = step_progress(pipe, progress)

        baseline, order = None, None
        if compare:  # the same measuring code as each bench variant, with every accelerator off
            order = compare_order(recipe)
            baseline, accelerated = measure_compared(pipe, recipe, kwargs, warmup, repeats, bar, order)
        else:
            accelerated = measure_recipe(pipe, recipe, kwargs, warmup, repeats, bar, "generating", latents)
        result, degrees = accelerated.measurement, accelerated.degrees

        out_path = None
        if lead:  # every rank holds the output; one writes it
            _check_out(out, True, made, variant)  # a hub id or folder reveals its family (image or video) only now
            fps = variant.fps(kwargs) if variant.fps is not None else family.fps
            out_path = _write_output(ref.name, fps, made[1], out, overwrite, result.output, result.audio)
    parallel = None
    if degrees is not None:
        parallel = {
            "world_size": degrees.world_size,
            "ulysses": degrees.ulysses,
            "ring": degrees.ring,
            "cfg": degrees.cfg,
            "tp": degrees.tp,
            "chosen": recipe.parallel.chooses_degrees,
            "vae_split": accelerated.vae_split,
            "plan": accelerated.plan,
            "bytes_sent_per_rank": accelerated.bytes_sent_per_rank,
        }
    device = _device_of(pipe)
    compared = (
        baseline is not None and result.output is not None
    )  # a rank that did not decode ([memory] vae = "rank0") has none
    written = _written_size(result.output)
    notes += accelerated.notes + _size_notes(kwargs, written, family.frames_arg, variant.fps is None)
    return Metrics(
        model=recipe.model.name,
        family=family.name,
        output_kind=made[1],
        device=str(device),
        dtype=str(pipe.transformer.dtype).removeprefix("torch."),
        recipe=effective_recipe(
            recipe, kwargs, family.frames_arg, device.type, str(dtype).removeprefix("torch.")
        ).to_dict(),
        load_s=load_s,
        warmup_s=result.warmup_seconds,
        generate_s=result.seconds,
        times_s=result.times,
        steps=result.steps,
        peak_memory_bytes=result.peak_memory_bytes,
        peak_memory_kind=peak_memory_kind(device),
        output_path=str(out_path) if out_path is not None else None,
        cache=accelerated.cache,
        parallel=parallel,
        quant=accelerated.quant,
        compile=accelerated.compile,
        baseline_s=baseline.seconds if baseline else None,
        baseline_times_s=baseline.times if baseline else [],
        compare_order=order,
        psnr_db=psnr(viewable(result.output, made[1]), viewable(baseline.output, made[1])) if compared else None,
        ssim=ssim(viewable(result.output, made[1]), viewable(baseline.output, made[1])) if compared else None,
        output_frames=written[2] if written is not None and made[1] != "image" else None,
        output_width=written[0] if written is not None else None,
        output_height=written[1] if written is not None else None,
        notes=notes,
    )


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


def _written_size(output: np.ndarray | dict[str, Any]) -> tuple[int, int, int] | None:
    """(width, height, frames) of a picture (H, W, C) or video (F, H, W, C) output; None for latents."""
    if not isinstance(output, np.ndarray):
        return None
    return int(output.shape[-2]), int(output.shape[-3]), int(output.shape[0]) if output.ndim == 4 else 1


def _size_notes(
    call: Mapping[str, Any], written: tuple[int, int, int] | None, frames_arg: str | None, frames_as_asked: bool
) -> list[str]:
    """A size the pipeline changed on the way (one Family.size_step does not foresee): said, not silent."""
    if written is None:
        return []
    asked = [("width", call.get("width"), written[0]), ("height", call.get("height"), written[1])]
    if frames_arg is not None and frames_as_asked:
        asked.append(("frames", call.get(frames_arg), written[2]))
    return [
        f"{key}: {value} asked, {made} made (the pipeline rounds it)"
        for key, value, made in asked
        if isinstance(value, int) and value != made
    ]


def step_progress(pipe: Any, progress: Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    """`measure`'s progress argument: the caller's bar per label, advanced by this pipeline's steps."""
    if progress is None:
        return None
    return lambda label: _progress_over_steps(pipe, progress, label)


@contextmanager
def _progress_over_steps(pipe: Any, progress: Callable[[str], Any], label: str) -> Iterator[None]:
    """Feeds the caller's progress bar from the scheduler's step events."""
    with progress(label) as bar:
        listener = _BarListener(bar)
        events = StepEvents.of(pipe)
        events.add(listener)
        try:
            yield
        finally:
            events.remove(listener)


class _BarListener(StepListener):
    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def on_generation_start(self, num_steps: int) -> None:
        self.bar.start(num_steps)

    def on_step_end(self, step_index: int) -> None:
        self.bar.advance()


LATENT_SUFFIX = ".pt"


def _suffix(kind: OutputKind) -> str:
    """The suffix of a name accel picks itself for this kind of output."""
    return OUTPUT_FILES[kind][1][0][0]


def planned_class(ref: Any, recipe: Recipe) -> str:
    """The pipeline class a run will make, known before loading (a folder's own class, else the family's)."""
    return recipe.model.pipeline or (
        ref.pipeline if ref.pipeline in ref.family.pipeline_classes else ref.family.pipeline_class
    )


def _latent(out: Path | None) -> bool:
    return out is not None and out.suffix.lower() == LATENT_SUFFIX


def _check_out(out: Path | None, overwrite: bool, made: tuple[str, OutputKind] | None, variant: Any = None) -> None:
    """Refuse a bad --out before the (possibly long) load, not after the generation; `made` is
    `made_by`'s (maker, kind), None while the model's family is not known yet. A .pt name saves
    the latents of a variant that hands them on (its `latent_output`)."""
    if out is None:
        return
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it or choose another --out")
    if _latent(out) and made is not None and not (variant is not None and variant.latent_output):
        raise UserError(
            f"--out {out}: {variant.pipeline_class if variant else made[0]} hands on no latents, so the name must end "
            "in "
            f"{_suffix(made[1])}"
        )
    if made is not None and not _latent(out):
        check_out_suffix(out, *made)


def _write_output(
    name: str,
    fps: float,
    kind: OutputKind,
    out: Path | None,
    overwrite: bool,
    output: np.ndarray | dict[str, Any],
    audio: Audio | None = None,
) -> Path:
    """Write the output whole (accel.files), with its sound where it has some: to `out` as given
    (replaced only with --overwrite), else to a fresh name under outputs/ taken exclusively; a latent
    pass's fields with torch.save. Returns the path written."""
    suffix = out.suffix if out is not None else _suffix(kind)  # an HDR video: its .npy frames or .mp4 preview
    if isinstance(output, dict):
        write = functools.partial(torch.save, output)
    else:
        write = output_writer(output, kind, suffix, fps, audio)
    if out is not None:
        return write_file(out, write, replace=overwrite, hint="pass --overwrite to replace it or choose another --out")
    return write_fresh(Path("outputs"), Path(name).name or "output", suffix, write)


def first_free(folder: Path, stem: str, suffix: str = "") -> Path:
    """folder/stem+suffix, or the first of stem-1, stem-2, … not taken now. Only a guess: another
    run may take it next; accel.files.write_fresh / fresh_folder take a name exclusively."""
    candidate, index = folder / f"{stem}{suffix}", 1
    while candidate.exists():
        candidate, index = folder / f"{stem}-{index}{suffix}", index + 1
    return candidate


def _device_of(pipe: Any) -> torch.device:
    return next(pipe.transformer.parameters()).device


def peak_memory_kind(device: torch.device) -> str:
    """What `_PeakMemory` measures on this device, for the reports."""
    return "CUDA allocated" if device.type == "cuda" else "process RSS"


class _PeakMemory:
    """Peak memory while the block runs: CUDA's allocator counter, or on CPU the process RSS sampled
    every 10 ms (the kernel's own peak never goes down, so later bench variants could not differ)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def __enter__(self) -> _PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif _rss() is not None:
            self.peak = _rss() or 0
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss() or 0)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
            return
        if self._sampler is None:  # no /proc: the process' lifetime peak is all there is
            self.peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
            return
        self._stop.set()
        self._sampler.join()
        self.peak = max(self.peak, _rss() or 0)


def _rss() -> int | None:
    """This process' resident set size in bytes (Linux /proc), None where there is no /proc."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None
