"""The family accel makes itself for a pipeline none of its families describes (issue 34).

Caching, compile and quantization need no model knowledge beyond the transformer's repeated blocks,
what each block returns and the order the lists run in; a family record holds exactly that
(`Family.blocks`, `primary_stream`) beside the call defaults. For a pipeline no family lists, this
module builds that record from the model itself: the block lists from `discover_blocks`; what a
block returns from diffusers' block registry, else learned from one probe call; call defaults from
the pipeline's signature. The probe is the pipeline's own call at a small size, stopped right after
the transformer's first forward (no denoising, no decode): the only inputs every pipeline is sure to
accept are the ones it makes itself.

Context parallelism is learned (`AutomaticPlan`) and verified on simulated ranks when several ranks
are asked for: the class's own diffusers `_cp_plan` first, its streams read off the probe, else the
automatic plan. What the record leaves out is refused, not guessed: CFG parallelism
(how the pipeline runs guidance is not known), tensor parallelism, a tiny variant. Learned records are kept per
(pipeline class, transformer
class, config) for the life of the process, so `accel serve` and `accel bench` probe once.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import re
from typing import Any

import torch
from torch import nn

from accel.errors import ModelError, UserError, first_line
from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults, OutputKind
from accel.models.variant_format import Variant
from accel.parallel.plan_format import AutomaticPlan
from accel.models.discover import Discovery, discover_blocks
from accel.models.probe import named_arguments, probe_returns

PROBE_SIZE = 128  # pixels a side: a multiple of every VAE scale x patch size in diffusers (8-32 x 1-4)
# Widths of the second probe call, tried in turn (a small model's positions may not reach the first):
# which dims follow the token count is seen between two calls (accel/parallel/automatic.py).
OTHER_PROBE_WIDTHS = (PROBE_SIZE // 2, 2 * PROBE_SIZE)
PROBE_FRAMES = 9  # 8k + 1 and 4k + 1: a frame count causal video VAEs take
PRIMARY = "hidden_states"

_LEARNED: dict[tuple[str, str, str], Family] = {}


class _FirstForwardDone(Exception):
    """Raised from the transformer's forward hook to end the probe call after its first forward."""


def config_hash(transformer: nn.Module) -> str:
    """A short digest of the transformer's config: two checkpoints of one class with other shapes differ.
    diffusers' own bookkeeping keys (`_name_or_path`, `_diffusers_version`, …) are left out, so a model
    built from a config.json and the same one loaded from its folder agree."""
    config = {
        key: value for key, value in dict(getattr(transformer, "config", {}) or {}).items() if not key.startswith("_")
    }
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def no_transformer_message(pipeline_class: str) -> str:
    return (
        f"{pipeline_class} has no transformer: accel accelerates diffusion transformers (pipe.transformer); "
        "diffusers' own VAE tiling (pipe.vae.enable_tiling()) and offload still work on it"
    )


def learned_family(pipe: Any) -> Family:
    """The family record accel learns for `pipe` (kept for the process); a ModelError in one line
    where the pipeline has no transformer, the transformer no repeated blocks, or the probe fails."""
    transformer = getattr(pipe, "transformer", None)
    if not isinstance(transformer, nn.Module):
        raise ModelError(no_transformer_message(type(pipe).__name__))
    key = (type(pipe).__name__, type(transformer).__name__, config_hash(transformer))
    if key not in _LEARNED:
        _LEARNED[key] = _learn(pipe, transformer)
    return _LEARNED[key]


def _learn(pipe: Any, transformer: nn.Module) -> Family:
    acceleration = learned_acceleration(pipe, transformer)
    signature = inspect.signature(type(pipe).__call__).parameters
    frames_arg = frames_keyword(signature)
    output: OutputKind = "video" if frames_arg else "image"
    config = dict(getattr(transformer, "config", {}) or {})
    heads = config.get("num_attention_heads")
    vae = getattr(pipe, "vae", None)
    return Family(
        name=_slug(type(pipe).__name__),
        title=type(pipe).__name__,
        pipeline_class=type(pipe).__name__,
        transformer_class=type(transformer).__name__,
        repo="",
        output=output,
        dtype="bfloat16",
        defaults=_defaults(pipe, signature, frames_arg),
        acceleration=acceleration,
        frames_arg=frames_arg,
        heads=heads if isinstance(heads, int) else None,
        vae=type(vae).__name__ if isinstance(vae, nn.Module) else None,
        variants=_own_variant(type(pipe).__name__, signature),
    )


def learned_acceleration(pipe: Any, transformer: nn.Module) -> Acceleration:
    """What accelerating `transformer` needs, learned from the model and one probe call of `pipe`:
    its block lists in run order with what each block returns, the stream the cache compares, the
    pipeline attributes holding a transformer of its class, and the automatic plan (verified when
    applied). CFG and tensor parallelism are not learned: a named family adds them."""
    try:
        discovery = discover_blocks(transformer)
    except UserError as error:
        raise ModelError(
            f"{error}. accel's cache, compile and parallelism work block by block, so none applies to "
            f"{type(pipe).__name__}; diffusers' VAE tiling and offload still do"
        ) from None
    seams = _Seams(transformer, discovery)
    try:
        if discovery.block_lists() is None or discovery.order == "definition" or len(discovery.lists) > 1:
            discovery = probe_returns(transformer, discovery, lambda: _probe_call(pipe, transformer))
            if discovery.order == "definition":  # the same call showed the order the lists ran in
                discovery = discovery.ordered(tuple(dict.fromkeys(seams.runs)))
    finally:
        seams.remove()
    interleaved = seams.interleaved(type(transformer).__name__)
    lists = main_lists(discovery) if interleaved else seams.feeding_output(seams.joined(main_lists(discovery)))
    return Acceleration(
        blocks=lists,
        primary_stream=PRIMARY if PRIMARY in lists[0].returns else lists[0].returns[0],
        transformer_attrs=_transformer_attrs(pipe, transformer),
        parallel=AutomaticPlan(),
        learned=True,
        cache_refused=interleaved,
    )


def _own_variant(pipeline_class: str, parameters: Any) -> tuple[Variant, ...]:
    """The pipeline's own inputs as a variant: `--image` fills its picture where its call takes one
    (required for an edit or image-to-video pipeline whose call has no default for it; optional where it has one)."""
    taken = image_keyword(parameters)
    if taken is None:
        return ()
    keyword, required = taken
    return (Variant(pipeline_class, image=keyword, optional=() if required else ("image",)),)


def main_lists(discovery: Discovery) -> tuple[BlockList, ...]:
    """The block lists the cache and compile run over: in run order, those whose blocks return the
    primary stream (`hidden_states` where a list returns it, else the stream of the last list to run,
    which becomes the output; refiners that prepare another stream before the main blocks, and lists
    of one block, are left to run as they are); then trailing lists dropped until the first list
    returns every stream the last one does, which the cache's residual needs."""
    known = [found for found in discovery.lists if found.returns is not None and found.count >= 2]
    if not known:
        reasons = (
            "; ".join(found.unknown for found in discovery.lists if found.unknown) or "no list of two or more blocks"
        )
        raise ModelError(
            f"{discovery.transformer_class}: accel could not learn what its blocks return ({reasons}); "
            "its cache and compile need that"
        )
    primary = PRIMARY if any(PRIMARY in (found.returns or ()) for found in known) else (known[-1].returns or ("",))[0]
    lists = [BlockList(found.attr, returns=found.returns) for found in known if primary in (found.returns or ())]
    while len(lists) > 1 and not set(lists[-1].returns) <= set(lists[0].returns):
        lists.pop()
    return tuple(lists)


class _Seams:
    """What crosses the seam between two block lists in the probe call: the last block's outputs of
    each list and the first block's arguments. A transformer that concatenates streams there (FLUX.2
    and Chroma run their single blocks on text then image in one tensor) shows it as a next-list
    stream equal to the previous list's streams concatenated on the token dim: `joins` in the record."""

    def __init__(self, transformer: nn.Module, discovery: Discovery) -> None:
        self.outputs: dict[str, Any] = {}
        self.inputs: dict[str, dict[str, Any]] = {}
        self.runs: list[str] = []  # the lists in the order their blocks ran, a run of one list's blocks once
        self._handles = []
        for found in discovery.lists:
            blocks = transformer.get_submodule(found.attr)
            if not len(blocks):
                continue

            def ran(module: nn.Module, args: Any, attr: str = found.attr) -> None:
                if not self.runs or self.runs[-1] != attr:
                    self.runs.append(attr)

            self._handles += [block.register_forward_pre_hook(ran) for block in blocks]

            def keep_output(module: nn.Module, args: Any, kwargs: Any, output: Any, attr: str = found.attr) -> None:
                self.outputs[attr] = output

            def keep_inputs(module: nn.Module, args: Any, kwargs: Any, attr: str = found.attr) -> None:
                self.inputs.setdefault(attr, named_arguments(module, args, kwargs))

            self._handles.append(blocks[-1].register_forward_hook(keep_output, with_kwargs=True))
            self._handles.append(blocks[0].register_forward_pre_hook(keep_inputs, with_kwargs=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def interleaved(self, transformer_class: str) -> str | None:
        """Why the block cache cannot run where the probe saw lists take turns (Latte's spatial and
        temporal blocks run one of each in turn); None where each list ran through in one go."""
        if len(self.runs) == len(set(self.runs)):
            return None
        lists = " and ".join(dict.fromkeys(self.runs))
        return (
            f"{transformer_class} runs {lists} interleaved (one block of each in turn), and accel's step caches "
            "need lists that run one after another; quantization and compile apply"
        )

    def joined(self, lists: tuple[BlockList, ...]) -> tuple[BlockList, ...]:
        """`lists` with each one-stream list after a several-stream one given the `joins` the probe
        saw; a list whose stream is neither the previous list's nor their concatenation ends the lists."""
        kept = [lists[0]]
        for block_list in lists[1:]:
            before = kept[-1]
            outputs = self.outputs.get(before.attr)
            arguments = self.inputs.get(block_list.attr, {})
            if outputs is None or len(block_list.returns) != 1 or len(before.returns) == 1:
                kept.append(block_list)
                continue
            streams = dict(zip(before.returns, outputs if isinstance(outputs, tuple) else (outputs,)))
            mine = arguments.get(block_list.returns[0])
            same = streams.get(block_list.returns[0])
            if isinstance(mine, torch.Tensor) and isinstance(same, torch.Tensor) and mine.shape == same.shape:
                kept.append(block_list)
                continue
            order = next(
                (
                    order
                    for order in itertools.permutations(before.returns)
                    if isinstance(mine, torch.Tensor) and _concatenation_of(mine, [streams[name] for name in order])
                ),
                None,
            )
            if order is None:
                break
            kept.append(BlockList(block_list.attr, returns=block_list.returns, joins=tuple(order)))
        return tuple(kept)

    def feeding_output(self, lists: tuple[BlockList, ...]) -> tuple[BlockList, ...]:
        """The lists whose stream becomes the transformer's output: the last list to run, and before it
        each list whose last block's output the next list's first block takes (unchanged, or joined).
        A list that prepares another stream apart runs as it is, outside the cache (Z-Image's refiners
        of the image and of the caption before they are joined per sample, Kandinsky 5's text blocks)."""
        kept = [lists[-1]]
        for before in reversed(lists[:-1]):
            if not (kept[0].joins or self._takes_output_of(kept[0].attr, before.attr)):
                break
            kept.insert(0, before)
        return tuple(kept)

    def _takes_output_of(self, after: str, before: str) -> bool:
        outputs = self.outputs.get(before)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        arguments = self.inputs.get(after, {}).values()
        return any(
            isinstance(argument, torch.Tensor)
            and isinstance(output, torch.Tensor)
            and argument.shape == output.shape
            and torch.equal(argument, output)
            for argument in arguments
            for output in outputs
        )


def _concatenation_of(joined: torch.Tensor, parts: list[Any]) -> bool:
    if not all(isinstance(part, torch.Tensor) and part.dim() == joined.dim() for part in parts):
        return False
    if sum(part.shape[1] for part in parts) != joined.shape[1]:
        return False
    return torch.equal(torch.cat(parts, dim=1), joined)


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
        _probe_call(pipe, transformer, width)
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


def _probe_call(pipe: Any, transformer: nn.Module, width: int = PROBE_SIZE) -> None:
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
        wanted[frames] = _stated(parameters, frames, int) or PROBE_FRAMES
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


def _defaults(pipe: Any, signature: Any, frames_arg: str | None) -> GenerationDefaults:
    """The pipeline's own call defaults where its signature states them; a size from the transformer's
    sample size and the VAE's scale where it leaves height / width to be computed."""
    steps = _stated(signature, "num_inference_steps", int) or 28
    guidance = _stated(signature, "guidance_scale", float)
    size = _default_size(pipe, "video" if frames_arg else "image")
    height, width = _stated(signature, "height", int) or size[0], _stated(signature, "width", int) or size[1]
    frames = (_stated(signature, frames_arg, int) or 49) if frames_arg else None
    return GenerationDefaults(steps=steps, height=height, width=width, frames=frames, guidance_scale=guidance)


def _stated(parameters: Any, name: str, kind: type) -> Any:
    """The default the signature states for `name` where it is a `kind` (not a bool); else None."""
    parameter = parameters.get(name)
    value = parameter.default if parameter is not None else None
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def _default_size(pipe: Any, output: OutputKind) -> tuple[int, int]:
    sample = getattr(getattr(getattr(pipe, "transformer", None), "config", None), "sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(scale, int) and sample * scale >= 256:
        return sample * scale, sample * scale
    return (1024, 1024) if output == "image" else (480, 832)


def _transformer_attrs(pipe: Any, transformer: nn.Module) -> tuple[str, ...]:
    """`transformer`, then other components of its class (a second expert, as Wan 2.2's transformer_2)."""
    others = [
        name
        for name, value in getattr(pipe, "components", {}).items()
        if name != "transformer" and type(value) is type(transformer)
    ]
    return ("transformer", *sorted(others))


def _slug(pipeline_class: str) -> str:
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", pipeline_class.removesuffix("Pipeline"))
    return words.lower()
