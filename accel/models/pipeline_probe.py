"""The probe call: the pipeline's own call at a small size, stopped right after the transformer's first
forward (no denoising, no decode): the only inputs every pipeline is sure to accept are the ones it
makes itself. What a block returns (accel/models/probe.py) and the automatic parallel plan
(accel/parallel/automatic.py) are learned from it; the pipeline's signature says what it takes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from accel.errors import ModelError, first_line

PROBE_SIZE = 128  # pixels a side: a multiple of every VAE scale x patch size in diffusers (8-32 x 1-4)
# Widths of the second probe call, tried in turn (a small model's positions may not reach the first):
# which dims follow the token count is seen between two calls (accel/parallel/automatic.py).
OTHER_PROBE_WIDTHS = (PROBE_SIZE // 2, 2 * PROBE_SIZE)
PROBE_FRAMES = 9  # 8k + 1 and 4k + 1: a frame count causal video VAEs take


class _FirstForwardDone(Exception):
    """Raised from the transformer's forward hook to end the probe call after its first forward."""


def first_transformer_call(pipe: Any, transformer: nn.Module, width: int = PROBE_SIZE) -> Any:
    """The arguments of `transformer`'s first forward in the probe call (a TransformerCall), made
    `width` pixels wide: the input the automatic parallel plan is learned and verified on."""
    from accel.parallel.observe import TransformerCall

    calls: list[Any] = []

    def keep(module: nn.Module, args: Any, kwargs: Any) -> None:
        if not calls:
            call = TransformerCall(tuple(args), dict(kwargs))
            calls.append(TransformerCall(*call.fresh()))

    handle = transformer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        probe_call(pipe, transformer, width)
    finally:
        handle.remove()
    return calls[0]


def other_transformer_call(pipe: Any, transformer: nn.Module) -> Any:
    """The transformer's first call at another width (OTHER_PROBE_WIDTHS, the first the pipeline takes)."""
    for width in OTHER_PROBE_WIDTHS[:-1]:
        try:
            return first_transformer_call(pipe, transformer, width)
        except ModelError:
            continue
    return first_transformer_call(pipe, transformer, OTHER_PROBE_WIDTHS[-1])


def probe_call(pipe: Any, transformer: nn.Module, width: int = PROBE_SIZE) -> None:
    """Run the pipeline at a small size until the transformer's first forward has returned."""

    def stop(module: nn.Module, args: Any, output: Any) -> None:
        raise _FirstForwardDone

    from diffusers.utils import logging as diffusers_logging

    handle = transformer.register_forward_hook(stop)
    verbosity = diffusers_logging.get_verbosity()  # the probe's own prompts are not the user's: no truncation notices
    diffusers_logging.set_verbosity_error()
    bar = getattr(pipe, "_progress_bar_config", None)  # the user's, put back after: the probe shows no bar
    if callable(getattr(pipe, "set_progress_bar_config", None)):
        pipe.set_progress_bar_config(**{**(bar or {}), "disable": True})
    try:
        with torch.no_grad():
            pipe(**probe_kwargs(pipe, width))
    except _FirstForwardDone:
        return
    except Exception as error:  # the pipeline's own failure, whatever it is, is the user's one line
        raise ModelError(
            f"{type(pipe).__name__}: accel's probe call (one small call to learn what the transformer's "
            f"blocks return) failed: {first_line(error)}"
        ) from None
    finally:
        handle.remove()
        diffusers_logging.set_verbosity(verbosity)
        if bar is None and hasattr(pipe, "_progress_bar_config"):
            del pipe._progress_bar_config
        elif bar is not None:
            pipe._progress_bar_config = bar
    raise ModelError(f"{type(pipe).__name__}: accel's probe call never ran the transformer")


# A negative prompt much longer than the probe's prompt: a pipeline that batches the two branches then
# pads the shorter one and passes a key mask, so the automatic plan sees (and verifies) masked attention.
PROBE_NEGATIVE = ", ".join(["blurry", "low quality", "jpeg artifacts", "deformed", "watermark", "text"] * 4)

FRAMES_KEYWORDS = ("num_frames", "video_length")  # what diffusers' video pipelines call the frame count


def frames_keyword(parameters: Any) -> str | None:
    return next((name for name in FRAMES_KEYWORDS if name in parameters), None)


def probe_kwargs(pipe: Any, width: int = PROBE_SIZE) -> dict[str, Any]:
    """A small call every text-to-image / video pipeline takes: a prompt (and a long negative one), two steps (Mochi's
    schedule
    divides by the steps less one; the probe stops at the first forward anyway), 128 px, and the
    pipeline's own frame count where it states one (a model with learned temporal positions takes
    no other), else 9."""
    parameters = inspect.signature(type(pipe).__call__).parameters
    wanted: dict[str, Any] = {
        "prompt": "a probe",
        "negative_prompt": PROBE_NEGATIVE,
        "num_inference_steps": 2,
        "height": PROBE_SIZE,
        "width": width,
        "output_type": "latent",
        "generator": torch.Generator().manual_seed(0),
    }
    frames = frames_keyword(parameters)
    if frames is not None:
        wanted[frames] = stated_default(parameters, frames, int) or PROBE_FRAMES
    if image_keyword(parameters) == (IMAGE, True):  # an edit or image-to-video pipeline: a plain grey picture
        from PIL import Image

        wanted[IMAGE] = Image.new("RGB", (width, PROBE_SIZE), (128, 128, 128))
    return {key: value for key, value in wanted.items() if key in parameters}


IMAGE = "image"  # what diffusers' edit and image-to-video pipelines call their input picture


def image_keyword(parameters: Any) -> tuple[str, bool] | None:
    """(keyword, required) of the pipeline's input picture; None where its call takes none."""
    parameter = parameters.get(IMAGE)
    if parameter is None:
        return None
    return IMAGE, parameter.default is inspect.Parameter.empty


def stated_default(parameters: Any, name: str, kind: type) -> Any:
    """The default the signature states for `name` where it is a `kind` (not a bool); else None."""
    parameter = parameters.get(name)
    value = parameter.default if parameter is not None else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None
