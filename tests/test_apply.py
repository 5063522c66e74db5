"""accel.apply on the tiny pipelines: cache behaviour, statistics, undo, refusals."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import accel
from accel.cache.fbcache import FirstBlockCache
from accel.errors import ModelError, RecipeError, UserError
from accel.models.registry import FAMILIES
from conftest import FLUX_CALL, WAN_CALL, generate

CASES = [("tiny_flux", FLUX_CALL, "flux", 1), ("tiny_wan", WAN_CALL, "wan", 2)]  # calls per step


@pytest.mark.parametrize("fixture, call, family, branches", CASES)
def test_cache_at_threshold_zero_is_bit_identical(
    request: Any, fixture: str, call: dict, family: str, branches: int
) -> None:
    pipe = request.getfixturevalue(fixture)
    reference = request.getfixturevalue(f"{family}_reference")
    cache = FirstBlockCache(pipe.transformer, FAMILIES[family].blocks, threshold=0.0)
    try:
        assert np.array_equal(generate(pipe, call), reference)
        assert cache.stats.calls == call["num_inference_steps"] * branches and cache.stats.cached == 0
    finally:
        cache.remove()


@pytest.mark.parametrize("fixture, call, family, branches", CASES)
def test_huge_threshold_caches_every_call_after_warmup(
    request: Any, fixture: str, call: dict, family: str, branches: int
) -> None:
    pipe = request.getfixturevalue(fixture)
    reference = request.getfixturevalue(f"{family}_reference")
    handle = accel.apply(pipe, {"cache": {"threshold": 1e9, "warmup_steps": 2}})
    try:
        output = generate(pipe, call)
        stats = handle.cache_stats
        steps = call["num_inference_steps"]
        assert stats is not None
        assert [(r.step, r.branch) for r in stats.records] == [(s, b) for s in range(steps) for b in range(branches)]
        assert [r.cached for r in stats.records] == [False] * (2 * branches) + [True] * ((steps - 2) * branches)
        assert stats.calls == steps * branches and stats.hit_rate == pytest.approx((steps - 2) / steps)
        assert not np.array_equal(output, reference), "skipping blocks must change the output"
        # Statistics describe the last call: a second generation starts from a fresh state.
        generate(pipe, call)
        assert handle.cache_stats.calls == steps * branches
    finally:
        handle.remove()
    assert np.array_equal(generate(pipe, call), reference), "remove() restores bit-identical output"


def test_each_call_is_cached_exactly_when_its_change_is_below_threshold(tiny_flux: Any) -> None:
    call = FLUX_CALL | {"num_inference_steps": 8}
    probe = FirstBlockCache(tiny_flux.transformer, FAMILIES["flux"].blocks, threshold=0.0)
    reference = generate(tiny_flux, call)
    probe.remove()
    uncached_changes = sorted(r.change for r in probe.stats.records[1:])
    threshold = uncached_changes[len(uncached_changes) // 2]  # some calls fall below, some above

    handle = accel.apply(tiny_flux, {"cache": {"threshold": threshold}})
    try:
        output = generate(tiny_flux, call)
        stats = handle.cache_stats
    finally:
        handle.remove()
    assert 0 < stats.cached < stats.calls
    changes = [r.change for r in stats.records[1:]]
    assert [r.cached for r in stats.records[1:]] == [c < threshold for c in changes]
    assert 0 < np.abs(output - reference).max() < 0.5


def test_apply_with_nothing_on_leaves_output_identical(tiny_flux: Any, flux_reference: np.ndarray) -> None:
    handle = accel.apply(tiny_flux, {})
    try:
        assert handle.cache_stats is None
        assert np.array_equal(generate(tiny_flux, FLUX_CALL), flux_reference)
    finally:
        handle.remove()


def test_recipe_may_be_a_recipe_a_dict_or_a_path(tiny_flux: Any, tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text("[cache]\nthreshold = 0.5\n")
    for recipe in (
        accel.Recipe.from_dict({"cache": {"threshold": 0.5}}),
        {"cache": {"threshold": 0.5}},
        path,
        str(path),
    ):
        handle = accel.apply(tiny_flux, recipe)
        assert handle.recipe.cache.threshold == 0.5 and len(handle.caches) == 1
        handle.remove()


def test_applying_twice_is_refused_until_removed(tiny_flux: Any) -> None:
    handle = accel.apply(tiny_flux, {"cache": {"threshold": 0.1}})
    try:
        with pytest.raises(
            UserError, match=re.escape("accel.apply: this pipeline is already accelerated; call remove()")
        ):
            accel.apply(tiny_flux, {"cache": {"threshold": 0.1}})
    finally:
        handle.remove()
    assert not handle.active
    accel.apply(tiny_flux, {}).remove()


def test_a_pipeline_without_a_transformer_or_blocks_is_refused_in_one_line() -> None:
    """No family knows these, and the generic path finds nothing to work on: one line naming what is
    missing and what still works."""
    with pytest.raises(ModelError) as refused:
        accel.apply(SimpleNamespace(transformer=torch.nn.Linear(2, 2)), {"cache": {"threshold": 0.1}})
    assert str(refused.value) == (
        "Linear has no repeated blocks: no _repeated_blocks or _no_split_modules, and no module list of two or more "
        "blocks "
        "of one class holding an attention. accel's cache, compile and parallelism work block by block, so none "
        "applies to "
        "SimpleNamespace; diffusers' VAE tiling and offload still do"
    )
    with pytest.raises(ModelError) as refused:
        accel.apply(SimpleNamespace(vae=torch.nn.Linear(2, 2)), {})
    assert str(refused.value) == (
        "SimpleNamespace has no transformer: accel accelerates diffusion transformers (pipe.transformer); diffusers' "
        "own "
        "VAE tiling (pipe.vae.enable_tiling()) and offload still work on it"
    )


def test_parallel_outside_a_distributed_job_is_refused(tiny_flux: Any) -> None:
    with pytest.raises(
        UserError,
        match=re.escape(
            "[parallel] asks for several processes, but this is a single process: use `accel run … --gpus N`, "
            "or start your script with `accel launch --gpus N` or torchrun"
        ),
    ):
        accel.apply(tiny_flux, {"parallel": {"ulysses": 2}})
    accel.apply(tiny_flux, {}).remove()  # nothing was left applied


def test_bad_recipe_dict_is_a_value_error(tiny_flux: Any) -> None:
    with pytest.raises(
        RecipeError, match=re.escape("<dict>: unknown key [cache] treshold (did you mean 'threshold'?)")
    ):
        accel.apply(tiny_flux, {"cache": {"treshold": 0.1}})
    assert issubclass(RecipeError, ValueError)


def test_vae_tiling_is_applied_and_undone(tiny_flux: Any) -> None:
    assert not tiny_flux.vae.use_tiling
    handle = accel.apply(tiny_flux, {"vae": {"tiling": True}})
    assert tiny_flux.vae.use_tiling
    handle.remove()
    assert not tiny_flux.vae.use_tiling


def test_only_the_given_instance_changes(tiny_flux: Any) -> None:
    other = accel.load_pipeline("tiny-flux")
    handle = accel.apply(tiny_flux, {"cache": {"threshold": 0.1}})
    try:
        assert "forward" in tiny_flux.transformer.transformer_blocks[0].__dict__
        assert "forward" not in other.transformer.transformer_blocks[0].__dict__
        assert "step" not in other.scheduler.__dict__
        assert type(tiny_flux) is type(other) and type(tiny_flux.scheduler) is type(other.scheduler)
    finally:
        handle.remove()
    assert "forward" not in tiny_flux.transformer.transformer_blocks[0].__dict__
    assert "step" not in tiny_flux.scheduler.__dict__
