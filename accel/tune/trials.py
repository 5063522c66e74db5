"""Measuring cache settings for the search on the loaded pipeline: the uncached baseline once per
prompt, then each setting prompt by prompt against it.

Every rank of a job runs every generation (the layout needs them all), but only rank 0's clock
and output count: it sends what it measured to the others, so all ranks take the same path
through the search.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from accel.recipe import Recipe
from accel.tune.search import Trial
from accel.tune.target import Target


@dataclass(frozen=True)
class Prompt:
    text: str
    kwargs: dict[str, Any]
    seconds: float  # the uncached run's median
    output: np.ndarray | None  # as shown, rank 0 only


def with_cache(recipe: Recipe, cache: dict[str, Any]) -> Recipe:
    """`recipe` with exactly these [cache] keys (the rest default), validated like a recipe file."""
    data = recipe.to_dict()
    data["cache"] = dict(cache)
    data["bench"] = {key: value for key, value in data["bench"].items() if key != "variants"}
    return dataclasses.replace(Recipe.from_dict(data, recipe.source), source=recipe.source)


class Trials:
    """The search's `Probe` on one pipeline: `baseline()` first, then call it with settings."""

    def __init__(
        self,
        pipe: Any,
        recipe: Recipe,
        kwargs: list[tuple[str, dict[str, Any]]],
        kind: str,
        target: Target,
        repeats: int,
        warmup: int,
        lead: bool,
        share: Callable[[Any], Any],
    ) -> None:
        self.pipe = pipe
        self.recipe = recipe
        self.kwargs = kwargs
        self.kind = kind
        self.target = target
        self.repeats = repeats
        self.warmup = warmup
        self.lead = lead
        self.share = share  # rank 0's value, on every rank
        self.prompts: list[Prompt] = []
        self.generations = 0

    def baseline(self) -> None:
        """The recipe without its cache on every prompt: what each setting is timed and compared against."""
        uncached = with_cache(self.recipe, {})
        for index, (text, kwargs) in enumerate(self.kwargs):
            # One untimed generation first in any case: a pipeline's first call pays for lazy set-up.
            measured = self._measure(uncached, kwargs, max(self.warmup, 1) if index == 0 else self.warmup)
            seconds = self.share(measured.measurement.seconds if self.lead else None)
            self.prompts.append(Prompt(text, kwargs, seconds, self._shown(measured) if self.lead else None))

    def __call__(self, cache: dict[str, Any], line: str, to_beat: float) -> Trial:
        """Prompt by prompt; stops at the first prompt below the target, or after the first when the
        setting is no faster than `to_beat` (it cannot be chosen, its quality there is enough)."""
        recipe = with_cache(self.recipe, cache)
        speedups: list[float] = []
        hits: list[float] = []
        worst_psnr, worst_ssim = float("inf"), 1.0
        stopped: str | None = None
        meets: bool | None = True
        for index, prompt in enumerate(self.prompts):
            measured = self._measure(recipe, prompt.kwargs)
            numbers = None
            if self.lead:
                from accel.quality import psnr, ssim

                shown = self._shown(measured)
                assert prompt.output is not None
                hit = measured.cache["hit_rate"] if measured.cache is not None else 0.0
                numbers = (measured.measurement.seconds, psnr(shown, prompt.output), ssim(shown, prompt.output), hit)
            seconds, psnr_db, ssim_value, hit_rate = self.share(numbers)
            speedups.append(prompt.seconds / seconds if seconds > 0 else 0.0)
            hits.append(hit_rate)
            worst_psnr, worst_ssim = min(worst_psnr, psnr_db), min(worst_ssim, ssim_value)
            if not self.target.met(worst_psnr, worst_ssim):
                meets = False
            last = index == len(self.prompts) - 1
            if not last and meets is False:
                stopped = f"below the target on prompt {index + 1}"
                break
            if not last and speedups[0] <= to_beat:
                meets, stopped = None, f"no faster than the best on prompt {index + 1}"
                break
        return Trial(
            line,
            cache,
            sum(speedups) / len(speedups),
            worst_psnr,
            worst_ssim,
            sum(hits) / len(hits),
            len(speedups),
            meets,
            stopped,
        )

    def retime(self, finalists: list[Trial], rounds: int = 3) -> None:
        """The finalists and the baseline timed again, interleaved round by round on every prompt, so
        that a load change on the machine hits them alike; sets each finalist's `retimed` speedup."""
        import statistics

        uncached = with_cache(self.recipe, {})
        recipes = [uncached, *(with_cache(self.recipe, trial.cache) for trial in finalists)]
        times: list[list[list[float]]] = [[[] for _ in recipes] for _ in self.prompts]
        for _ in range(rounds):
            for prompt, timed in zip(self.prompts, times):
                for recipe, seconds in zip(recipes, timed):
                    measured = self._measure(recipe, prompt.kwargs)
                    seconds.append(self.share(measured.measurement.seconds if self.lead else None))
        for index, trial in enumerate(finalists, 1):
            ratios = [statistics.median(timed[0]) / statistics.median(timed[index]) for timed in times]
            trial.retimed = sum(ratios) / len(ratios)

    def _measure(self, recipe: Recipe, kwargs: dict[str, Any], warmup: int | None = None) -> Any:
        import torch

        from accel.measure import measure_recipe

        warmup = self.warmup if warmup is None else warmup
        self.generations += warmup + self.repeats
        measured = measure_recipe(self.pipe, recipe, kwargs, warmup, self.repeats)
        if recipe.compile.enabled and recipe.cache.method == "taylorseer":
            torch.compiler.reset()  # its wrapped modules change the blocks' graphs: the next setting starts afresh
        return measured

    def _shown(self, measured: Any) -> np.ndarray:
        from accel.media import viewable

        return viewable(measured.measurement.output, self.kind)
