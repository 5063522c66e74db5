"""Refusals that span sections: [memory] placements and offload that cannot run with the rest of a
recipe, each a one-line reason (None: it runs), asked before any rank changes anything."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accel.recipe import Recipe


def vae_placement_refusal(recipe: Recipe) -> str | None:
    """Why [memory] vae = "rank0" cannot run with the rest of `recipe` (None: it can): the split decode
    of [vae] parallel needs every rank of the layout to decode."""
    if recipe.memory.vae == "rank0" and recipe.vae.parallel:
        return (
            '[memory] vae = "rank0" and [vae] parallel = true do not compose: the split decode needs every rank to '
            "decode; "
            'set vae = "replicated" to split the decode, or parallel = false to decode on the first rank alone'
        )
    return None


def memory_refusal(recipe: Recipe, replicas: int = 1) -> str | None:
    """The first of [memory]'s refusals of `recipe` (None: it runs): the VAE placement's, then offload's."""
    return vae_placement_refusal(recipe) or offload_refusal(recipe, replicas)


def offload_refusal(recipe: Recipe, replicas: int = 1) -> str | None:
    """Why [memory] offload cannot run with the rest of `recipe` (None: it can): one process, no compile,
    and model offload moves the encoders itself. `replicas`: `accel serve`'s copies of the recipe's
    layout, each of which would hold its own copy in host memory."""
    mode = recipe.memory.offload
    if mode == "none":
        return None
    if recipe.world_size > 1:
        return (
            f'[memory] offload = "{mode}" runs one process: each rank would stream its own whole copy; '
            f'set offload = "none" with a parallel layout, or run one process'
        )
    if replicas > 1:
        return (
            f'[memory] offload = "{mode}" serves one replica: each of the {replicas} replicas would stream its own '
            "whole "
            f'copy from host memory; set offload = "none" with --replicas, or serve one replica'
        )
    if recipe.compile.enabled:
        return (
            f'[memory] offload = "{mode}" and [compile] do not compose: compiled graphs would capture weights that '
            "offloading moves; turn one of them off"
        )
    if mode == "model" and recipe.memory.text_encoder == "cpu":
        return (
            '[memory] offload = "model" already keeps the text encoders in host memory between prompts and encodes on '
            "the GPU; "
            'set text_encoder = "replicated" with it, or offload = "group" to encode on the CPU'
        )
    return None
