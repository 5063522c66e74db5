"""Pipeline variants on every rank: a family's tiny pipeline run as another pipeline class of its
transformer (img2img, inpaint, Kontext, fill, control, edit, image- and video-to-video, VACE), with
deterministic input pictures and clips."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import diffusers
import numpy as np
import torch
from PIL import Image

from accel.models.registry import FAMILIES
from accel.models.input_files import condition_object
from accel.models.variants import variant_of

_pipelines: dict[tuple[str, str], Any] = {}

# Qwen-Image's edit pipelines resize the input picture to about one megapixel whatever the output
# size (diffusers' `calculate_dimensions(1024 * 1024, ratio)` in their modules): a 1024x1024 VAE
# encode and 4096 reference tokens, ~5 s a call on each CPU rank. In the matrix runs they take it at
# 128x128 (64 reference tokens): the same code, and the split of the joined sequence, at a tiny size.
_MEGAPIXEL = 1024 * 1024
_REFERENCE_AREA = 128 * 128
_RESIZING_MODULES = {
    "QwenImageEditPipeline": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit",
    "QwenImageEditInpaintPipeline": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_inpaint",
    "QwenImageEditPlusPipeline": "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus",
}


@contextmanager
def small_reference(pipeline_class: str) -> Iterator[None]:
    """For this call only (restored after): the edit pipeline's megapixel reference at `_REFERENCE_AREA`."""
    if pipeline_class not in _RESIZING_MODULES:
        yield
        return
    module = importlib.import_module(_RESIZING_MODULES[pipeline_class])
    original = module.calculate_dimensions

    def resized(target_area: float, ratio: float) -> Any:
        return original(_REFERENCE_AREA if target_area == _MEGAPIXEL else target_area, ratio)

    module.calculate_dimensions = resized
    try:
        yield
    finally:
        module.calculate_dimensions = original


def picture(size: tuple[int, int] = (64, 64)) -> Image.Image:
    """An RGB gradient, the input image of every variant test (width, height)."""
    width, height = size
    x, y = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    return Image.fromarray(np.stack([x, y, 255 - (x + y) / 2], -1).astype(np.uint8))


def needs_picture(family: str) -> bool:
    """Whether the family's own pipeline requires an input picture (ChronoEdit edits one): a call
    accel makes for it, and a recipe that runs it, must name one."""
    own = variant_of(FAMILIES[family], FAMILIES[family].pipeline_class)
    return own.image is not None and "image" not in own.optional


def has_text_encoders(family: str) -> bool:
    """Whether the family's own pipeline holds a text encoder (Cosmos 3's transformer embeds the
    prompt's token ids itself): text encoder placement has something to place."""
    import diffusers

    return any(
        name.startswith("text_encoder")
        for name in inspect.signature(getattr(diffusers, FAMILIES[family].pipeline_class)).parameters
    )


def run_written(out: Any, *args: str) -> tuple[np.ndarray, Any]:
    """`accel run ARGS --steps 2 --warmup 0 --out OUT` in this process: the video it wrote and its sound
    track (None: it has none)."""
    from typer.testing import CliRunner

    from accel.cli import app
    from accel.media import read_audio, read_video

    result = CliRunner().invoke(
        app, ["run", *args, "--steps", "2", "--warmup", "0", "--out", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return read_video(out), read_audio(out)


def mask(size: tuple[int, int] = (64, 64)) -> Image.Image:
    """White (repaint) on the right half, black (keep) on the left."""
    width, height = size
    return Image.fromarray(((np.arange(width)[None, :] >= width // 2) * np.ones((height, 1)) * 255).astype(np.uint8))


def clip(size: tuple[int, int] = (64, 64), frames: int = 5) -> list[Image.Image]:
    """A moving gradient: `frames` RGB frames (width, height), the input video of every variant test."""
    base = np.asarray(picture(size), dtype=np.int16)
    return [Image.fromarray(np.roll(base, 3 * index, axis=1).astype(np.uint8)) for index in range(frames)]


def variant_pipeline(family: str, pipeline_class: str) -> Any:
    """The family's tiny pipeline as `pipeline_class`, built once per process."""
    import accel

    key = (family, pipeline_class)
    if key not in _pipelines:
        pipe = accel.load_pipeline(f"tiny-{family}", pipeline=pipeline_class)
        pipe.set_progress_bar_config(disable=True)
        _pipelines[key] = pipe
    return _pipelines[key]


def variant_call(family: str, pipeline_class: str, call: dict[str, Any]) -> dict[str, Any]:
    """`call` plus the variant's input pictures at the call's size, under the variant's keywords
    the call does not set itself."""
    variant = variant_of(FAMILIES[family], pipeline_class)
    size = (call.get("width", 64), call.get("height", 64))
    frames = call.get("num_frames", 5)
    masks = [mask(size)] * frames if variant.mask_frames else mask(size)
    video = [clip(size, frames)] if "video" in variant.in_list else clip(size, frames)
    inputs = {variant.image: picture(size), variant.mask: masks, variant.video: video}
    # An input keyword the call sets itself stays as set (None leaves it out: LTX's condition pipeline
    # takes an image or a video, and the matrix gives it the image).
    arguments = {keyword: value for keyword, value in inputs.items() if keyword is not None and keyword not in call}
    if variant.area is not None:
        arguments[variant.area] = size[0] * size[1]
    if variant.seed is not None:
        arguments[variant.seed] = 0  # variant_run's generator seed
    taken = call_parameters(pipeline_class)
    if "_auto_resize" in taken:
        arguments["_auto_resize"] = False  # Kontext: keep the reference at the call's size, not ~1 megapixel
    common = {key: value for key, value in call.items() if key in taken}  # Fill has no negative prompt
    # A variant's own input files (Animate's pose video), unless the call brings its own (a face crop).
    named = {
        spec.keyword: clip(size, frames) if spec.kind == "video" else picture(size)
        for spec in variant.inputs
        if spec.required and spec.when is None and spec.kind != "latents"
    }
    fixed: dict[
        str, Any
    ] = {}  # a latent input's fields, from a pass of the pipeline that makes them at the call's size
    for spec in (spec for spec in variant.inputs if spec.kind == "latents"):
        fields = latent_pass(family, spec.made_by[0], call.get("prompt", "a red fox"), size, frames)
        named.update({keyword: fields[field] for field, keyword in spec.fields})
        fixed.update(spec.settings(fields) if spec.settings else {})
    if variant.references is not None:  # a reference clip of the call's length (IC-LoRA's depth or pose video)
        named[variant.references.keyword] = [
            condition_object(variant.references, clip(size, frames), 0, 1.0, tiny=True)
        ]
    if variant.conditions is not None:  # one that replaces the first latent frame, one appended as extra tokens
        named[variant.conditions.keyword] = [
            condition_object(variant.conditions, picture(size), 0, 1.0, tiny=True),
            condition_object(variant.conditions, picture(size), -1, 0.8, tiny=True),
        ]
    return {
        **named,
        **dict(variant.arguments),
        **common,
        **arguments,
        **dict(variant.fixed),
        **dict(variant.tiny_fixed),
        **fixed,
    }


_passes: dict[tuple[Any, ...], dict[str, Any]] = {}


def latent_pass(family: str, pipeline_class: str, prompt: str, size: tuple[int, int], frames: int) -> dict[str, Any]:
    """The latent output fields of one seed-0 pass of `pipeline_class` (what `--out NAME.pt` saves), once per
    process."""
    key = (family, pipeline_class, prompt, size, frames)
    if key not in _passes:
        result = variant_pipeline(family, pipeline_class)(
            prompt=prompt,
            width=size[0],
            height=size[1],
            num_frames=frames,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        )
        _passes[key] = {
            name: getattr(result, name) for name in variant_of(FAMILIES[family], pipeline_class).latent_output
        }
    return _passes[key]


def call_parameters(pipeline_class: str) -> set[str]:
    import diffusers

    return set(inspect.signature(getattr(diffusers, pipeline_class).__call__).parameters)


def variant_run(
    family: str, pipeline_class: str, recipe: dict[str, Any], call: dict[str, Any]
) -> tuple[np.ndarray, int, int]:
    """(output, calls the cache skipped, bytes this rank sent) of the variant under `recipe`."""
    import accel
    from accel.parallel.comm import TRAFFIC
    from accel.generate import output_array

    pipe = variant_pipeline(family, pipeline_class)
    handle = accel.apply(pipe, recipe)
    TRAFFIC.reset()
    try:
        with small_reference(pipeline_class):
            result = pipe(
                **variant_call(family, pipeline_class, call),
                generator=torch.Generator().manual_seed(0),
                output_type="np",
            )
        stats = handle.cache_stats
    finally:
        handle.remove()
    skipped = sum(record.cached for record in stats.records) if stats is not None else 0
    return np.asarray(output_array(result)), skipped, TRAFFIC.total_bytes  # frames, images or Kandinsky 5's `image`


def as_decoded(output: np.ndarray, family: str, pipeline_class: str) -> np.ndarray:
    """The output in the VAE's [0, 1] range, where 1e-4 means the same for every variant: a linear
    HDR video (LTX-2 HDR) goes back through LogC3, the exact inverse of the pipeline's last step.
    Compared linear, values up to 55 would turn a float32 rounding of the code into 3e-4."""
    if FAMILIES[family].output_of(pipeline_class) != "hdr-video":
        return output
    from diffusers.pipelines.ltx2.image_processor import LTX2VideoHDRProcessor as LogC3

    linear = output.astype(np.float64)
    logarithmic = (
        LogC3._LOGC3_C * np.log10(np.maximum(LogC3._LOGC3_A * linear + LogC3._LOGC3_B, 1e-30)) + LogC3._LOGC3_D
    )
    return np.where(linear >= LogC3._LOGC3_CUT, logarithmic, LogC3._LOGC3_E * linear + LogC3._LOGC3_F)


def block_argument(
    family: str, pipeline_class: str, recipe: dict[str, Any], call: dict[str, Any], block: str, argument: str
) -> list[Any]:
    """The values `argument` of the transformer's module `block` (a dotted name) took in each call
    of the variant under `recipe`, as the block received them (after accel's hooks)."""
    import accel

    pipe = variant_pipeline(family, pipeline_class)
    handle = accel.apply(pipe, recipe)
    module = pipe.transformer.get_submodule(block)
    signature = inspect.signature(module.forward)
    seen: list[Any] = []
    hook = module.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(signature.bind(*args, **kwargs).arguments[argument]), with_kwargs=True
    )
    try:
        pipe(**variant_call(family, pipeline_class, call), generator=torch.Generator().manual_seed(0), output_type="np")
    finally:
        hook.remove()
        handle.remove()
    return seen


def diffusion_forcing_run(recipe: dict[str, Any], call: dict[str, Any]) -> np.ndarray:
    """SkyReels-V2 diffusion forcing's output under `recipe`; its `causal_block_size` is written into
    the transformer's config, which is put back after, so later runs of this process see none."""
    transformer = variant_pipeline("skyreels2", "SkyReelsV2DiffusionForcingPipeline").transformer
    before = transformer.config.num_frame_per_block
    try:
        return variant_run("skyreels2", "SkyReelsV2DiffusionForcingPipeline", recipe, call)[0]
    finally:
        transformer.register_to_config(num_frame_per_block=before)


# diffusers pipelines of a supported transformer that `accel run` cannot give their inputs: they need
# another model or a second picture. In a script, build them and call accel.apply (the family is the
# transformer's, so every accelerator applies): the ControlNet residuals of FLUX.1, Qwen-Image, SD 3.5
# and Z-Image are split with the tokens they are added to and halved with batched CFG branches
# (tests/test_controlnet.py).
NEEDS_MORE = {
    "FluxControlNetPipeline": "a ControlNet model",
    "FluxControlNetImg2ImgPipeline": "a ControlNet model",
    "FluxControlNetInpaintPipeline": "a ControlNet model",
    "FluxControlImg2ImgPipeline": "a control image besides the image",
    "FluxControlInpaintPipeline": "a control image besides the image and mask",
    "VisualClozePipeline": "in-context example images and a resolution",
    "VisualClozeGenerationPipeline": "in-context example images and a resolution",
    "QwenImageControlNetPipeline": "a ControlNet model",
    "QwenImageControlNetInpaintPipeline": "a ControlNet model",
    "QwenImageLayeredPipeline": "Qwen-Image-Layered's own transformer (layer-aware rotary) and returns a stack of "
    "layers",
    "ZImageControlNetPipeline": "a ControlNet model",
    "ZImageControlNetInpaintPipeline": "a ControlNet model",
    "ZImageOmniPipeline": "a SigLIP image encoder",
    "StableDiffusion3ControlNetPipeline": "a ControlNet model",
    "StableDiffusion3ControlNetInpaintingPipeline": "a ControlNet model",
    "StableDiffusion3PAGPipeline": "perturbed-attention guidance layers",
    "StableDiffusion3PAGImg2ImgPipeline": "perturbed-attention guidance layers",
}


def diffusers_pipelines_of(transformer_class: str) -> set[str]:
    """Every pipeline class diffusers exports whose `transformer` component is `transformer_class`."""
    found = set()
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        cls = getattr(diffusers, name, None)
        if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
            continue
        parameter = inspect.signature(cls.__init__).parameters.get("transformer")
        annotation = getattr(parameter, "annotation", None)
        # A class, its name, or a union such as `WanTransformer3DModel | None` (WanPipeline, LucyEditPipeline).
        text = (
            annotation
            if isinstance(annotation, str)
            else annotation.__name__
            if isinstance(annotation, type)
            else str(annotation)
        )
        if parameter is not None and re.search(rf"\b{transformer_class}\b", text):
            found.add(name)
    return found
