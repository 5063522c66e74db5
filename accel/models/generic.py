"""The family accel makes itself for a pipeline none of its families describes (issue 34).

Caching, compile and quantization need no model knowledge beyond the transformer's repeated blocks,
what each block returns and the order the lists run in; a family record holds exactly that
(`Family.blocks`, `primary_stream`) beside the call defaults. For a pipeline no family lists, this
module builds that record from the model itself: the block lists from `discover_blocks`; what a
block returns from diffusers' block registry, else learned from one probe call; call defaults from
the pipeline's signature. The probe call is accel/models/pipeline_probe.py's; what crosses between
block lists in it (run order, joined streams, which lists feed the output) accel/models/seams.py's.

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
import json
import re
from typing import Any

from torch import nn

from accel.errors import ModelError, UserError
from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults, OutputKind
from accel.models.discover import Discovery, discover_blocks
from accel.models.pipeline_probe import frames_keyword, image_keyword, probe_call, stated_default
from accel.models.probe import probe_returns
from accel.models.seams import Seams
from accel.models.variant_format import Variant
from accel.parallel.plan_format import AutomaticPlan

PRIMARY = "hidden_states"

_LEARNED: dict[tuple[str, str, str], Family] = {}


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
        batches=False,  # a batch of prompts is not checked for a pipeline accel learns
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
    seams = Seams(transformer, discovery)
    try:
        if discovery.block_lists() is None or discovery.order == "definition" or len(discovery.lists) > 1:
            discovery = probe_returns(transformer, discovery, lambda: probe_call(pipe, transformer))
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


def _defaults(pipe: Any, signature: Any, frames_arg: str | None) -> GenerationDefaults:
    """The pipeline's own call defaults where its signature states them; a size from the transformer's
    sample size and the VAE's scale where it leaves height / width to be computed."""
    steps = stated_default(signature, "num_inference_steps", int) or 28
    guidance = stated_default(signature, "guidance_scale", float)
    size = _default_size(pipe, "video" if frames_arg else "image")
    height, width = (
        stated_default(signature, "height", int) or size[0],
        stated_default(signature, "width", int) or size[1],
    )
    frames = (stated_default(signature, frames_arg, int) or 49) if frames_arg else None
    return GenerationDefaults(steps=steps, height=height, width=width, frames=frames, guidance_scale=guidance)


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
