"""`accel tune`: measure what a cache method needs from the user's own pipeline.

`--calibrate` runs the recipe's generation once with MagCache recording, and writes a new recipe
whose `[cache]` is MagCache with the measured per-step residual-magnitude ratios: a curve of this
pipeline, this schedule and these weights, never one copied from a paper for other weights.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import tomli_w

from accel.cache.config import MagCacheConfig
from accel.errors import UserError
from accel.recipe import Recipe

# A starting threshold for the written recipe: MagCache's accumulated error per cached run of calls.
DEFAULT_MAGCACHE_THRESHOLD = 0.12


def calibrate_magcache(pipe: Any, handle: Any, kwargs: dict[str, Any], seed: int) -> tuple[tuple[float, ...], ...]:
    """One generation of `pipe` (accelerated by `handle`, its cache off) with MagCache recording on
    every transformer: the ratios per CFG branch, one per step. With several transformers (Wan 2.2's
    experts) each records the steps it runs; the curve is theirs in step order."""
    from accel.cache.magcache import MagCache
    from accel.cache.sums import cache_sums
    from accel.models.parts import transformers_of
    from accel.generate import generate
    from accel.steps import StepEvents

    events = StepEvents.of(pipe)
    caches = [
        MagCache(
            transformer, handle.family.blocks, threshold=0.0, calibrate=True, events=events, **cache_sums(handle, attr)
        )
        for attr, transformer in transformers_of(handle.pipe, handle.family).items()
    ]
    try:
        generate(pipe, kwargs, seed)
    finally:
        for cache in caches:
            cache.remove()
    steps: dict[int, dict[int, float]] = {}
    for cache in caches:
        for branch, step, ratio in cache.recorded:
            steps.setdefault(branch, {})[step] = ratio
    return tuple(tuple(ratio for _, ratio in sorted(by_step.items())) for _, by_step in sorted(steps.items()))


def calibrate(recipe: Recipe, out: Path) -> Recipe:
    """Load the recipe's pipeline, run its generation once with MagCache recording (every other
    accelerator of the recipe applied, the cache off) and write the MagCache recipe to `out`."""
    import accel
    from accel.models.loading import load_pipeline, resolve_device, resolve_model
    from accel.models.registry import family_of
    from accel.recipe.sections import CacheSection
    from accel.models.call import generation_kwargs

    if recipe.parallel.world_size > 1:
        raise UserError(
            f"accel tune --calibrate: {recipe.source} asks for {recipe.parallel.world_size} processes; calibrate on "
            "one "
            "(the curve does not depend on the layout) and use the recipe it writes with any [parallel]"
        )
    if out.exists():
        raise UserError(f"{out} exists: accel tune never overwrites a recipe; pass another --out")
    ref = resolve_model(recipe.model.name)
    pipe = load_pipeline(
        recipe.model.name,
        recipe.model.dtype,
        resolve_device(recipe.model.device),
        recipe.model.pipeline or None,
        recipe.model.lora,
    )
    pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)
    if not family.blocks:
        raise UserError(
            f"accel tune --calibrate: {family.title} has no block lists accel knows, so no cache applies to it"
        )
    kwargs = generation_kwargs(family, ref.tiny, recipe, pipe)
    handle = accel.apply(pipe, dataclasses.replace(recipe, cache=CacheSection()))
    try:
        ratios = calibrate_magcache(pipe, handle, kwargs, recipe.generate.seed)
    finally:
        handle.remove()
    calibrated = calibrated_recipe(recipe, ratios)
    write_recipe(calibrated, out)
    return calibrated


def calibrated_recipe(recipe: Recipe, mag_ratios: tuple[tuple[float, ...], ...]) -> Recipe:
    """`recipe` with MagCache on at the default threshold and the measured curve; other cache keys
    MagCache reads (warm-up, limits) are kept, the rest reset."""
    kept = MagCacheConfig.from_settings(recipe.cache).keywords()
    cache = dataclasses.replace(
        type(recipe.cache)(),
        **{**kept, "method": "magcache", "threshold": DEFAULT_MAGCACHE_THRESHOLD, "mag_ratios": mag_ratios},
    )
    # Bench variants are left out: one tuned for another method could name keys MagCache refuses.
    return dataclasses.replace(recipe, cache=cache, bench=dataclasses.replace(recipe.bench, variants=()))


def write_recipe(recipe: Recipe, path: Path) -> None:
    """The recipe as TOML at `path`, which must not exist: tune never overwrites a recipe."""
    try:
        with open(path, "xb") as file:
            tomli_w.dump(recipe.to_dict(), file)
    except FileExistsError:
        raise UserError(f"{path} exists: accel tune never overwrites a recipe; pass another --out") from None


def fresh_recipe_path(source: Path, suffix: str) -> Path:
    """`<stem>-<suffix>.toml` beside the source recipe, numbered if taken."""
    from accel.outputs import first_free

    return first_free(source.parent, f"{source.stem}-{suffix}", ".toml")
