"""apply's [memory] steps: where the text encoders and the VAE run, and diffusers' offload hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from accel.errors import NotAvailableError, UserError
from accel.models.parts import transformer_device
from accel.recipe.refusals import offload_refusal

if TYPE_CHECKING:
    from accel.handle import AccelHandle


def apply_memory(handle: AccelHandle) -> None:
    """[memory] placement: with text_encoder = "rank0" or "cpu" the layout's first rank encodes for
    all (one process holds its encoders anyway); with "cpu" that rank encodes in host memory. With
    "sharded" the encoders that transformers has a TP plan for are split over the layout's ranks
    (every rank of it encodes the same prompts, so the whole layout shares the weights); on one
    process nothing is split, but a pipeline with no such encoder is refused alike."""
    placement = handle.recipe.memory.text_encoder
    if placement == "replicated":
        return
    from accel.parallel.encoders import SHARDED, EncodesOnCpu, FirstRankEncodes, shard_text_encoders, sharded_refusal

    device = transformer_device(handle.pipe, handle.family)
    if placement == SHARDED:
        if handle.mesh is not None:
            shard_text_encoders(handle.pipe, handle.mesh.group, device)
        elif (refusal := sharded_refusal(handle.pipe, 1)) is not None:  # one process: nothing to split, same refusal
            raise NotAvailableError(refusal)
        return
    if handle.mesh is not None:
        first = FirstRankEncodes(handle.pipe, handle.mesh.group, device)
        handle._undo.append(first.remove)
        handle._per_pipeline.append(first.also_on)
        if not first.leads:
            return
    if placement == "cpu":
        on_cpu = EncodesOnCpu(handle.pipe, device)
        handle._undo.append(on_cpu.remove)
        handle._per_pipeline.append(on_cpu.also_on)


def skips_decode(handle: AccelHandle) -> bool:
    """Whether [memory] vae = "rank0" changes anything here: several ranks, and a pipeline with a VAE
    whose decode its call's output_type can skip (latent-only or VAE-less pipelines: nothing to skip)."""
    from accel.vae.placement import ONE_RANK, takes_output_type

    return (
        handle.recipe.memory.vae == ONE_RANK
        and handle.mesh is not None
        and getattr(handle.pipe, "vae", None) is not None
        and takes_output_type(handle.pipe)
    )


def apply_vae_placement(handle: AccelHandle) -> None:
    """[memory] vae = "rank0": the ranks other than the layout's first skip the decode (output_type
    "latent") and move their VAE to host memory; remove() puts it back. One process: nothing to do."""
    if not skips_decode(handle):
        return
    from accel.vae.placement import OtherRanksSkipDecode

    assert handle.mesh is not None
    skips = OtherRanksSkipDecode(handle.pipe, handle.mesh.group)
    handle._undo.append(skips.remove)
    handle._per_pipeline.append(skips.also_on)


def apply_offload(handle: AccelHandle) -> None:
    """[memory] offload through diffusers' own hooks, onto the recipe's device. Model offload is undone by
    remove(); group offload stays (diffusers has no public way to take it off), like the TP split."""
    mode = handle.recipe.memory.offload
    if mode == "none":
        return
    refusal = offload_refusal(handle.recipe)
    if refusal is not None:
        raise UserError(refusal)
    from accel.models.loading import resolve_device

    device = resolve_device(handle.recipe.model.device)
    pipe = handle.pipe
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
        # The hooks chain this pipeline's components in its own call's order and the pipeline frees them
        # after its call: another pipeline on the modules would run them outside that chain.
        handle._attach_refusal = (
            '[memory] offload = "model" moves modules in one pipeline\'s call order, so no other pipeline may '
            'share them; use offload = "group" (it offloads module by module, whichever pipeline calls)'
        )

        def undo() -> None:
            pipe.remove_all_hooks()
            pipe.to(device)

        handle._undo.append(undo)
        return
    from diffusers.hooks import apply_group_offloading

    from accel.parallel.encoders import text_encoder_names

    # Component by component rather than pipe.enable_group_offload: encoders kept in host memory
    # ([memory] text_encoder = "cpu") must not be hooked to move to the GPU, and diffusers' exclusion
    # moves the excluded components onto it.
    on_cpu = set(text_encoder_names(pipe)) if handle.recipe.memory.text_encoder == "cpu" else set()
    options = dict(
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=device.type == "cuda",
    )
    for name, component in pipe.components.items():
        if name in on_cpu or not isinstance(component, torch.nn.Module):
            continue
        if hasattr(component, "enable_group_offload"):
            component.enable_group_offload(**options)
        else:
            apply_group_offloading(component, **options)
