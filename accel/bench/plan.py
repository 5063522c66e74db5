"""Planning a bench: every variant checked and the job sized before any rank starts, so that everything a
user can get wrong is found here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from accel.errors import RecipeError, UserError
from accel.preflight import cpu_cores
from accel.recipe import Recipe
from accel.recipe.sections import BenchVariant


@dataclass(frozen=True)
class PlannedVariant:
    """One row of the bench: the concrete recipe it runs, or why it cannot run in this job."""

    name: str
    recipe: Recipe
    overrides: dict[str, Any]
    world_size: int
    skip: str | None = None
    planned_peak: int | None = None  # accel plan's estimate of its peak per GPU (fit_bench), where one applied


@dataclass(frozen=True)
class BenchPlan:
    """What a bench job will run, checked before any rank starts."""

    recipe: Recipe
    world_size: int
    variants: tuple[PlannedVariant, ...]

    @property
    def baseline(self) -> PlannedVariant:
        return self.variants[0]


def plan_bench(recipe: Recipe, gpus: int | None = None, only: list[str] | None = None) -> BenchPlan:
    """Check every variant and choose the job's size: `gpus`, or as many processes as the largest
    variant needs, at most the GPUs visible (CPU cores on a machine without CUDA)."""
    from accel.models.loading import resolve_device, resolve_model

    ref = resolve_model(recipe.model.name)
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {gpus}")
    chosen = _chosen_variants(recipe, only)
    device = resolve_device(recipe.model.device)
    world = gpus or _default_world(max(variant.world_size for _, _, variant in chosen), device.type)
    planned = []
    for name, overrides, variant in chosen:
        _check_variant(ref, name, variant)
        skip = _skip_reason(variant, ref, world, device)
        planned.append(PlannedVariant(name, variant, overrides, variant.world_size, skip))
    return BenchPlan(recipe, world, tuple(planned))


def fit_bench(plan: BenchPlan, gpu_memory: float | None) -> BenchPlan:
    """The memory plan (accel/memory/fit.py) on each variant that will run, on the launcher before any
    rank starts: on a flagship checkpoint a variant that leaves its layout to accel takes the plan's,
    one whose layout will not fit refuses the bench in one line; the ranks take the same from the launcher."""
    from accel.memory.fit import planned_each

    running = {variant.name: variant.recipe for variant in plan.variants if variant.skip is None}
    fits = planned_each(running, gpu_memory, lambda name: f"{plan.recipe.source}: [bench] variant {name!r}")
    variants = tuple(
        dataclasses.replace(variant, recipe=fits[variant.name].recipe, planned_peak=fits[variant.name].peak)
        if variant.name in fits
        else variant
        for variant in plan.variants
    )
    return dataclasses.replace(plan, variants=variants)


def _chosen_variants(recipe: Recipe, only: list[str] | None) -> list[tuple[str, dict[str, Any], Recipe]]:
    """(name, overrides as written, concrete recipe) in recipe order. Without variants: the recipe
    against itself with every accelerator off, as `run --compare` measures it."""
    variants: tuple[BenchVariant, ...] = recipe.variants
    if not variants:
        if only:
            raise UserError(f"--only: {recipe.source} defines no [bench] variants to choose from")
        return [("baseline", {}, recipe.unaccelerated()), ("recipe", {}, recipe)]
    names = [v.name for v in variants]
    for name in only or ():
        if name not in names:
            recipe.variant(name)  # raises the message with the valid names
    chosen = [v for v in variants if not only or v.name == names[0] or v.name in only]
    return [(v.name, _plain(v.overrides), _variant_recipe(recipe, v.name)) for v in chosen]


def _variant_recipe(recipe: Recipe, name: str) -> Recipe:
    variant = recipe.variant(name)
    for key in ("name", "device", "pipeline", "lora"):
        if getattr(variant.model, key) != getattr(recipe.model, key):
            raise RecipeError(
                f"{recipe.source}: [bench] variant {name!r} changes [model] {key}; every variant runs on the "
                f"pipeline the recipe loads (only [model] dtype may change), so use a second recipe"
            )
    return variant


def _check_variant(ref: Any, name: str, variant: Recipe) -> None:
    """The checks `accel run` makes before start-up, naming the variant."""
    from accel.models.refs import heads_before_start
    from accel.models.lora import parse_loras
    from accel.parallel.mesh import resolve_degrees
    from accel.parallel.plan import plan_of, refuse_untaught_before_start
    from accel.models.call import generation_kwargs

    try:
        parse_loras(variant.model.lora)
        if ref.family is not None:
            generation_kwargs(ref.family, ref.tiny, variant, loads_as=ref.pipeline)
            if variant.world_size > 1:
                plan_of(ref.family, "[parallel]")
        if variant.world_size > 1:
            refuse_untaught_before_start(ref, "[parallel]", variant.parallel)
            resolve_degrees(variant.parallel, heads_before_start(ref), ref.name)
    except UserError as error:
        raise type(error)(f"{variant.source}: [bench] variant {name!r}: {error}") from None


def _skip_reason(variant: Recipe, ref: Any, world: int, device: Any) -> str | None:
    from accel.models.loading import resolve_dtype
    from accel.optimize.quantize import check_hardware

    if variant.world_size > world:
        return f"needs {variant.world_size} processes; this run has {world} (--gpus {variant.world_size})"
    try:
        check_hardware(variant.quant.type, device, resolve_dtype(variant.model.dtype, ref))
    except UserError as error:
        return str(error)
    return None


def _default_world(needed: int, device_type: str) -> int:
    import torch

    available = torch.cuda.device_count() if device_type == "cuda" else cpu_cores()
    return max(1, min(needed, available))


def _plain(overrides: Any) -> dict[str, Any]:
    return {section: dict(keys) for section, keys in overrides.items()}
