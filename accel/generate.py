"""One pipeline call: from a fresh seeded CPU generator, with the guidance scale on the pipeline's
guiders where it takes it there; the output (or a latent pass's fields) and sound taken from its result."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from accel.media import Audio
from accel.models.call import guided_by_guider
from accel.models.registry import family_of
from accel.models.input_files import LATENTS_MARK, open_inputs
from accel.models.variants import variant_of_class
from accel.vae.placement import decodes_here


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


def generate_batch(
    pipe: Any, kwargs: dict[str, Any], prompts: list[str], seeds: list[int]
) -> list[tuple[Any, Audio | None]]:
    """Several prompts in one pipeline call, sample i drawn from its own generator seeded `seeds[i]`:
    diffusers draws each sample's noise from its generator alone, so it is the noise `generate` draws
    for that seed, and the output differs from the unbatched one only by the batched arithmetic."""
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    call = open_inputs(dict(kwargs, prompt=list(prompts)))
    with _guider_scale(pipe, call):
        result = pipe(**call, generator=generators, output_type="np")
    if not decodes_here(pipe):
        return [(None, None)] * len(seeds)
    outputs = np.asarray(output_array(result, pipe))
    return [(outputs[index], audio_of(pipe, result, index)) for index in range(len(seeds))]


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


def guiders_of(pipe: Any) -> list[Any]:
    """The diffusers guiders a pipeline holds as components: its `guider`, and any other it picks
    per call (HunyuanImage 2.1's `ocr_guider`, for prompts with quoted text to render)."""
    from diffusers.guiders.guider_utils import BaseGuidance

    names = inspect.signature(type(pipe).__init__).parameters
    return [guider for name in names if isinstance(guider := getattr(pipe, name, None), BaseGuidance)]


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


def audio_of(pipe: Any, result: Any, sample: int = 0) -> Audio | None:
    """A sample's sound in a pipeline result (the first's by default), found where the family's
    `AudioOutput` says."""
    spec = family_of(pipe).audio
    samples = getattr(result, spec.field, None) if spec is not None else None
    if samples is None:
        return None
    if isinstance(samples, torch.Tensor):
        samples = samples.float().cpu().numpy()
    rate = functools.reduce(getattr, spec.sample_rate.split("."), pipe)
    return Audio(np.asarray(samples)[sample] if spec.batched else np.asarray(samples), int(rate))


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value
