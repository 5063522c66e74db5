"""`accel tune RECIPE --target ...`: load the recipe's pipeline once, measure the uncached baseline
once per prompt, search the cache settings (`search`), and write the fastest one that meets the
target into a new recipe, with a plot of every setting tried.

Everything but the cache comes from the recipe (its layout, quantization, compile, size, steps), so
the speedups are those the user will get. Under torchrun every rank runs the same search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel.errors import UserError
from accel.recipe import Recipe
from accel.tune.search import Search, Trial, choose, finalists, mark_pareto, run_search
from accel.tune.target import Target


@dataclass
class TuneResult:
    """What rank 0 reports: the baseline, every setting tried, the choice (None: the target is out of reach)."""

    recipe: Recipe
    target: Target
    model: str
    device: str
    world_size: int
    prompts: list[str]
    baseline_s: list[float]
    trials: list[Trial]
    best: Trial | None
    generations: int
    blocks: int
    steps: int

    def chosen_recipe(self) -> Recipe:
        from accel.tune.trials import with_cache

        if self.best is None:
            raise ValueError("no setting met the target")
        return with_cache(self.recipe, self.best.cache)


def tune_to_target(
    recipe: Recipe,
    target: Target,
    prompts: tuple[str, ...] | None,
    repeats: int,
    warmup: int | None,
    announce: Callable[[str], None] = lambda _line: None,
    methods: frozenset[str] | None = None,
) -> TuneResult | None:
    """Run the search on this rank; rank 0 gets the result, other ranks None. `methods` (None: all)
    keeps the lines of those cache methods only (`accel tune --methods`)."""
    from accel.models.loading import resolve_device
    from accel.threads import cpu_threads

    device = resolve_device(recipe.model.device)
    with cpu_threads(device):  # the thread count accel run times with: steadier timings on a CPU
        return _tune(recipe, target, prompts, repeats, warmup, announce, device, methods)


def _tune(
    recipe: Recipe,
    target: Target,
    prompts: tuple[str, ...] | None,
    repeats: int,
    warmup: int | None,
    announce: Callable[[str], None],
    device: Any,
    methods: frozenset[str] | None,
) -> TuneResult | None:
    import accel
    from accel.models.parts import blocks_of, transformers_of
    from accel.models.loading import load_pipeline, resolve_model
    from accel.models.registry import family_of
    from accel.models.variants import variant_of_class
    from accel.models.call import call_steps, generation_kwargs
    from accel.tune.calibrate import calibrate_magcache
    from accel.tune.trials import Trials, with_cache

    rank, share = _join(recipe, device.type)
    ref = resolve_model(recipe.model.name)
    announce(f"loading {recipe.model.name}")
    pipe = load_pipeline(
        recipe.model.name, recipe.model.dtype, device, recipe.model.pipeline or None, recipe.model.lora
    )
    pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)
    if not family.blocks:
        raise UserError(f"accel tune: {family.title} has no block lists accel knows, so no cache applies to it")
    pipeline_class = variant_of_class(family, type(pipe)).pipeline_class
    texts = prompts or family.tune_prompts(pipeline_class)
    calls = [
        (text, generation_kwargs(family, ref.tiny, recipe.with_overrides({"generate": {"prompt": text}}), pipe))
        for text in texts
    ]
    trials = Trials(
        pipe,
        recipe,
        calls,
        family.output_of(pipeline_class),
        target,
        repeats,
        warmup if warmup is not None else int(recipe.compile.enabled),
        rank == 0,
        share,
    )
    announce(f"baseline: the recipe without its cache on {len(calls)} prompt{'s' if len(calls) > 1 else ''}")
    trials.baseline()
    ratios: tuple[tuple[float, ...], ...] | None = None
    if methods is None or "magcache" in methods:  # a generation spent only where a magcache line is searched
        announce("calibrating MagCache's curve on the first prompt")
        handle = accel.apply(pipe, with_cache(recipe, {}))
        try:
            ratios = share(calibrate_magcache(pipe, handle, calls[0][1], recipe.generate.seed))
        finally:
            handle.remove()
    blocks = min(len(blocks_of(transformer, family.blocks)) for transformer in transformers_of(pipe, family).values())
    steps = call_steps(pipe, calls[0][1])
    search: Search = run_search(target, trials, blocks, steps, ratios, announce, methods)
    chosen = finalists(search)
    if chosen:
        announce(f"timing the {len(chosen)} fastest settings again, interleaved with the baseline")
        trials.retime(chosen)
    mark_pareto(search.trials, target)
    if rank != 0:
        return None
    return TuneResult(
        recipe,
        target,
        recipe.model.name,
        str(device),
        recipe.world_size,
        list(texts),
        [p.seconds for p in trials.prompts],
        search.trials,
        choose(search),
        trials.generations,
        blocks,
        steps,
    )


def _join(recipe: Recipe, device_type: str) -> tuple[int, Callable[[Any], Any]]:
    """This rank, and how rank 0's value reaches every rank (identity on one process)."""
    if recipe.world_size == 1:
        return 0, lambda value: value
    import torch.distributed as dist

    from accel.parallel.agree import rank0_object
    from accel.parallel.mesh import init_distributed

    rank, _world = init_distributed(device_type, recipe.parallel.timeout)
    group = dist.new_group(backend="gloo")  # objects travel on the CPU, whatever the device's backend
    return rank, lambda value: rank0_object(value, group)


def write_outputs(result: TuneResult, recipe_path: Path, plot_path: Path) -> None:
    """The chosen recipe and the plot, neither over an existing file."""
    from accel.tune.calibrate import write_recipe
    from accel.tune.report import write_plot

    write_recipe(result.chosen_recipe(), recipe_path)
    write_plot(result, plot_path)
