"""`apply(pipe, recipe)`: the one place that composes the accelerators on a pipeline instance.

Order (fixed; each step assumes the ones before it):

0. mesh      — join the process group, build the mesh and, with tp > 1, split the blocks' weights
               over the TP group (before quant: torchao then quantizes each rank's shard)
1. quant     — torchao on the transformer's Linear layers (weights change first, so every later
               step sees the final modules, and compile traces the quantized kernels)
2. parallel  — context-parallel attention and the split / gather plan (hooks and a mode that
               compiled code traces through), the CFG halves, agreed arguments and noise;
               [memory] text_encoder = "rank0" / "cpu": one rank encodes (in host memory with "cpu"),
               the others drop their encoders; "sharded": transformers' TP plan splits them over the
               layout's ranks, which encode together; [memory] vae = "rank0": the other ranks ask for
               latents and keep the VAE in host memory; [memory] offload: diffusers' model or group offload
3. compile   — torch.compile of each repeated block's forward (or the whole transformer's)
4. cache     — First Block Cache, wrapping each block's (compiled) forward from outside, so its
               branch stays out of every graph
5. vae       — VAE tiling / parallel decode

Only the pipeline instance given is changed; the returned handle undoes every step in reverse,
except quantization, the tensor-parallel split, text encoders dropped by "rank0" placement or
split by "sharded", and group offload: they free the weights this rank no longer needs (the point of
them), so they stay, and a second apply with the same type or degree leaves them as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from accel.cache.calls import CacheSite, StepCache
from accel.cache.config import CACHE_METHODS
from accel.cache.sums import cache_sums
from accel.errors import NotAvailableError, UserError
from accel.hooks import CACHE_CALL, wrap
from accel.parallel.plan_format import TensorPlan
from accel.models.parts import execution_device, transformer_device, transformers_of
from accel.models.registry import family_of
from accel.models.variants import variant_of_class
from accel.optimize.compile import CompiledRegions
from accel.optimize.processors import install_processors
from accel.parallel.engine import ContextParallel
from accel.parallel.plan import plan_of, refuse_layout, resolve_plans
from accel.parallel.tensor import TensorParallel
from accel.apply_quant import apply_quant
from accel.handle import APPLIED, AccelHandle
from accel.apply_memory import apply_memory, apply_offload, apply_vae_placement, skips_decode
from accel.apply_refusals import (
    refuse_another_ranks_gpu,
    refuse_bypassing_attention,
    refuse_later_diffusers_cache,
    refuse_shared_components,
    refuse_two_caches,
)
from accel.recipe import Recipe, load_recipe
from accel.recipe.refusals import vae_placement_refusal
from accel.steps import StepEvents
from accel.vae import ParallelDecode, plan_for
from accel.vae.masks import fill_masks_by_frame


def as_recipe(recipe: Recipe | Mapping[str, Any] | str | Path | None) -> Recipe:
    if recipe is None:
        return Recipe.from_dict({})
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping):
        return Recipe.from_dict(recipe)
    if isinstance(recipe, (str, Path)):
        return load_recipe(recipe)
    raise UserError(f"accel.apply: recipe must be a Recipe, a dict or a path, got {type(recipe).__name__}")


def apply(pipe: Any, recipe: Recipe | Mapping[str, Any] | str | Path | None = None) -> AccelHandle:
    """Accelerate `pipe` in place as the recipe asks; see the module docstring for the order."""
    recipe = as_recipe(recipe)
    if pipe in APPLIED:
        raise UserError(
            "accel.apply: this pipeline is already accelerated; call remove() on the handle "
            "apply() returned before applying again"
        )
    refuse_shared_components(pipe, APPLIED)
    family = family_of(pipe)
    handle = AccelHandle(pipe, recipe, family)
    refuse_two_caches(handle)
    _check_cache_blocks(handle)
    if (refusal := vae_placement_refusal(recipe)) is not None:  # before any rank changes anything
        raise UserError(refusal)
    refuse_another_ranks_gpu(transformer_device(pipe, family))
    try:
        _join_mesh(handle)
        _apply_processors(handle)
        apply_quant(handle)
        _apply_parallel(handle)
        apply_memory(handle)
        apply_vae_placement(handle)
        apply_offload(handle)
        _apply_compile(handle)
        _apply_cache(handle)
        _apply_vae(handle)
        refuse_later_diffusers_cache(handle)
    except BaseException:
        handle.remove()
        raise
    APPLIED[pipe] = handle
    return handle


def _apply_processors(handle: AccelHandle) -> None:
    """The family's leaner attention processors (same outputs, less memory), under every layout."""
    for transformer in transformers_of(handle.pipe, handle.family).values():
        handle._undo.append(install_processors(transformer, handle.family))


def _apply_compile(handle: AccelHandle) -> None:
    settings = handle.recipe.compile
    if not settings.enabled:
        return
    for transformer in transformers_of(handle.pipe, handle.family).values():
        regions = CompiledRegions(transformer, handle.family.blocks, settings.scope, settings.mode, settings.backend)
        handle.compiled.append(regions)
        handle._undo.append(regions.remove)


def _join_mesh(handle: AccelHandle) -> None:
    """Join (or start) the process group and build the mesh, after every refusal that numbers and
    the loaded modules allow (each rank refuses alike, none waits in a collective); then split the
    blocks' weights over the TP group."""
    settings = handle.recipe.parallel
    if settings.world_size == 1:
        return
    from accel.parallel.mesh import build_mesh, init_distributed, parallel_degrees

    family = handle.family
    plan_of(family, "[parallel]")
    refuse_layout(family, variant_of_class(family, type(handle.pipe)), settings)
    transformers = transformers_of(handle.pipe, handle.family)
    device = transformer_device(handle.pipe, family)
    init_distributed(device.type, settings.timeout)
    degrees = parallel_degrees(handle.pipe, settings)
    if degrees.sequence > 1:
        refuse_bypassing_attention(transformers, degrees)
    if degrees.sequence * degrees.cfg > 1:
        handle.resolved = resolve_plans(handle.pipe, family, transformers, degrees, settings.plan)
    tensor_plans = _tensor_plans(handle, degrees.tp)
    mesh = build_mesh(degrees, device.type)
    assert mesh is not None  # build_mesh refuses a layout this rank is not part of
    handle.mesh = mesh
    for attr, plan in tensor_plans.items():
        handle.tensor[attr] = TensorParallel(transformers[attr], plan, mesh.tp_group)
    if tensor_plans:
        from accel.parallel.tensor_lora import loads_split_loras

        handle.on_each_pipeline(loads_split_loras)  # a LoRA loaded from now on is cut like its layers


def _tensor_plans(handle: AccelHandle, tp: int) -> dict[str, TensorPlan]:
    """Each transformer's tensor plan, checked against its widths and state (refused in one line)."""
    if tp == 1:
        return {}
    from accel.optimize.quantize import quantized_as
    from accel.parallel.tensor import SPLIT_MARK, resolve_tensor_plan, width_problem

    family = handle.family
    if family.tensor is None:
        raise NotAvailableError(f"[parallel] tp = {tp}: {family.title} has no tensor-parallel plan; set tp = 1")
    plans = {}
    for attr, transformer in transformers_of(handle.pipe, handle.family).items():
        plan = resolve_tensor_plan(family.tensor, transformer)
        if getattr(transformer, SPLIT_MARK, None) is None:
            scheme = quantized_as(transformer)
            if scheme is not None:
                raise UserError(
                    f"[parallel] tp = {tp}: pipe.{attr} was quantized ('{scheme}') before it was split; load the "
                    "pipeline "
                    "again and apply [quant] and tp together (accel splits first, then quantizes each rank's shard)"
                )
            problem = width_problem(transformer, plan, tp, type(transformer).__name__)
            if problem is not None:
                raise UserError(problem)
        plans[attr] = plan
    return plans


def _apply_parallel(handle: AccelHandle) -> None:
    """Put each transformer under the context-parallel plan, split the CFG branches over the mesh's
    cfg halves, and make every rank start each call alike: the same arguments (checked first, one
    message on every rank) and rank 0's noise."""
    mesh = handle.mesh
    if mesh is None:
        return
    from accel.parallel.agree import agree_on_arguments, agree_on_noise

    transformers, resolved = transformers_of(handle.pipe, handle.family), handle.resolved
    if resolved is not None:
        for attr, plan in resolved.sequence.items():
            engine = ContextParallel(transformers[attr], plan, mesh)
            handle.parallel[attr] = engine
            handle._undo.append(engine.remove)
        if resolved.cfg is not None:
            from accel.parallel.cfg import CfgParallel

            cfg = CfgParallel(transformers, resolved.cfg, mesh, StepEvents.of(handle.pipe))
            handle._undo.append(cfg.remove)
    handle.on_each_pipeline(partial(agree_on_noise, group=mesh.group))
    # Under [memory] vae = "rank0" the ranks that do not decode ask for latents whatever output_type they were
    # given, so that one argument may differ; every other one is still checked.
    may_differ = ("output_type",) if skips_decode(handle) else ()
    # first of every call: one message, no hang
    handle.on_each_pipeline(partial(agree_on_arguments, group=mesh.group, may_differ=may_differ))


def _apply_cache(handle: AccelHandle) -> None:
    settings = handle.recipe.cache
    if not settings.enabled:
        return
    config = CACHE_METHODS[settings.method].from_settings(settings)
    engine, events = config.engine_class(), StepEvents.of(handle.pipe)
    for attr, transformer in transformers_of(handle.pipe, handle.family).items():
        site = CacheSite(transformer, handle.family.blocks, events, **cache_sums(handle, attr))
        cache = engine.install(site, config)
        handle.caches.append(cache)
        handle._undo.append(cache.remove)
    # diffusers pipelines check their inputs once, at the start of a call: the cache's statistics then
    # cover the whole call, however many schedules it runs (Wan Animate's segments); a pipeline
    # without the method restarts them with each schedule.
    if handle.caches:
        handle.on_each_pipeline(partial(_cache_call_starts, caches=handle.caches))


def _cache_call_starts(pipe: Any, caches: list[StepCache[Any]]) -> Callable[[], None]:
    if not callable(getattr(pipe, "check_inputs", None)):
        return _nothing
    return wrap(pipe, "check_inputs", "accel.cache.per_call", CACHE_CALL, partial(_call_starts, caches))


def _nothing() -> None:
    pass


def _check_cache_blocks(handle: AccelHandle) -> None:
    """A user's first_blocks / last_blocks must leave the model blocks to cache: one line, before
    quantization (which cannot be undone) or any other change."""
    settings = handle.recipe.cache
    if settings.enabled and handle.family.cache_refused:
        raise UserError(f"[cache] method = '{settings.method}': {handle.family.cache_refused}")
    if not settings.enabled:
        return
    config = CACHE_METHODS[settings.method].from_settings(settings)
    for transformer in transformers_of(handle.pipe, handle.family).values():
        if (refusal := config.block_refusal(transformer, handle.family.blocks)) is not None:
            raise UserError(refusal)


def _call_starts(caches: list[StepCache[Any]], call_next: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    for cache in caches:
        cache.begin_call()
    return call_next(*args, **kwargs)


def _apply_vae(handle: AccelHandle) -> None:
    """Frame masks filled a frame at a time, tiling (the VAE's own choice of tiles), then the row split
    inside each decoder call."""
    vae = getattr(handle.pipe, "vae", None)
    if vae is None:
        return
    handle._undo.append(fill_masks_by_frame(vae))
    settings = handle.recipe.vae
    if settings.tiling:
        if not hasattr(vae, "enable_tiling"):
            raise UserError(f"[vae] tiling: {type(vae).__name__} does not support tiled decoding; set tiling = false")
        was_tiling = bool(getattr(vae, "use_tiling", False))
        vae.enable_tiling()
        if not was_tiling:
            handle._undo.append(vae.disable_tiling)
    if settings.parallel:
        _apply_parallel_vae(handle, vae)


def _apply_parallel_vae(handle: AccelHandle, vae: Any) -> None:
    """Split the decode over every rank of the job: the mesh's, or those of a script started under
    torchrun with a replicated transformer. One process: nothing to split."""
    import torch.distributed as dist

    from accel.launch.environment import world_size

    plan = plan_for(vae)
    if handle.mesh is None:
        if not dist.is_initialized():
            if world_size() == 1:
                return
            from accel.parallel.mesh import init_distributed

            init_distributed(execution_device(handle.pipe, vae).type, handle.recipe.parallel.timeout)
        if dist.get_world_size() == 1:
            return
        from accel.parallel.agree import agree_on_arguments, agree_on_noise

        handle.on_each_pipeline(agree_on_noise)  # every rank must decode the same latents
        handle.on_each_pipeline(agree_on_arguments)
    group = handle.mesh.group if handle.mesh is not None else None
    engine = ParallelDecode(vae, plan, group, all_ranks=handle.recipe.vae.all_ranks)
    handle.vae_decode = engine
    handle._undo.append(engine.remove)
