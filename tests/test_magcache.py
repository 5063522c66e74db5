"""MagCache on toy transformers (its calibration, its accumulated-error rule) and `accel tune
--calibrate` on tiny-flux; the families run it on gloo ranks in tests/test_parallel_families.py."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from accel.cache.magcache import MagCache
from accel.cli import app
from accel.recipe import load_recipe
from toy_transformers import SingleTensorTransformer, TwoListTransformer, all_blocks, inputs


def drifting_inputs(calls: int, drift: float = 0.05) -> list[tuple[torch.Tensor, ...]]:
    base, step = inputs(0), inputs(1)
    return [tuple(b + drift * i * s for b, s in zip(base, step)) for i in range(calls)]


def make(structure: type = SingleTensorTransformer) -> torch.nn.Module:
    torch.manual_seed(0)
    return structure().eval()


@torch.no_grad()
def test_calibration_records_the_ratio_of_mean_token_norms_of_the_whole_residual() -> None:
    model = make()
    sequence = drifting_inputs(3)
    cache = MagCache(model, model.block_lists, threshold=0.0, calibrate=True)
    outputs = [model(*args) for args in sequence]
    norms = [torch.linalg.vector_norm(out - args[0], dim=-1).mean().item() for out, args in zip(outputs, sequence)]
    assert [step for _, step, _ in cache.recorded] == [0, 1, 2] and not any(r.cached for r in cache.stats.records)
    assert [ratio for *_, ratio in cache.recorded] == pytest.approx(
        [1.0, norms[1] / norms[0], norms[2] / norms[1]], rel=1e-6
    )


@torch.no_grad()
def test_calls_are_skipped_while_the_accumulated_error_stays_under_the_threshold() -> None:
    """Curve 0.9 a step, threshold 0.25: error 0.1 (skip), then 0.1 + |1 - 0.81| = 0.29 (compute, reset)."""
    model = make()
    cache = MagCache(model, model.block_lists, threshold=0.25, mag_ratios=[[1.0, 0.9, 0.9, 0.9, 0.9]])
    for args in drifting_inputs(5):
        model(*args)
    assert [r.cached for r in cache.stats.records] == [False, True, False, True, False]
    assert [round(r.change, 6) for r in cache.stats.records] == [0.0, 0.1, 0.29, 0.1, 0.29]
    assert all_blocks(model)[0].calls == 3, "a skipped call runs no block at all"


@torch.no_grad()
def test_a_skipped_call_adds_the_last_computed_residual_to_block_0_input() -> None:
    model = make(TwoListTransformer)
    computed, skipped = drifting_inputs(2)
    cache = MagCache(model, model.block_lists, threshold=1.0, mag_ratios=[[1.0, 1.0]])
    model(*computed)
    got = model(*skipped)
    assert [r.cached for r in cache.stats.records] == [False, True]
    plain = make(TwoListTransformer)
    hidden, text, temb = computed
    for block in plain.transformer_blocks:
        text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb)
    for block in plain.single_transformer_blocks:
        text, hidden = block(hidden, text, temb)
    expected = plain.out(skipped[0] + (hidden - computed[0]))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_curve_of_another_step_count_is_read_at_the_same_fraction_of_the_schedule() -> None:
    model = make()
    cache = MagCache(model, model.block_lists, threshold=0.1, mag_ratios=[[1.0, 0.8, 0.6]])
    cache._num_steps = 5  # what the scheduler announces at the start of a generation
    assert [cache.curve_ratio(0, step) for step in range(5)] == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.6])
    assert cache.curve_ratio(1, 2) == pytest.approx(0.8), "a branch without its own curve reads the last one"
    with pytest.raises(ValueError, match="magcache needs mag_ratios"):
        MagCache(model, model.block_lists, threshold=0.1)


def test_tune_calibrate_writes_a_magcache_recipe_that_runs(tmp_path: Path) -> None:
    out = tmp_path / "tuned.toml"
    runner = CliRunner()
    result = runner.invoke(
        app, ["tune", "recipes/tiny-flux.toml", "--calibrate", "--out", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert f'wrote {out}: [cache] method = "magcache"' in result.stdout
    tuned = load_recipe(out)
    source = load_recipe("recipes/tiny-flux.toml")
    assert tuned.cache.method == "magcache" and tuned.cache.threshold > 0 and tuned.model == source.model
    assert tuned.generate == source.generate and not tuned.variants
    steps = source.generate.steps
    assert [len(curve) for curve in tuned.cache.mag_ratios] == [steps] and tuned.cache.mag_ratios[0][0] == 1.0
    assert tomllib.loads(out.read_text())["cache"]["method"] == "magcache"

    again = runner.invoke(
        app, ["tune", "recipes/tiny-flux.toml", "--calibrate", "--out", str(out)], catch_exceptions=False
    )
    assert (
        again.exit_code == 2
        and again.stderr.strip() == f"error: {out} exists: accel tune never overwrites a recipe; pass another --out"
    )

    image = tmp_path / "a.png"
    ran = runner.invoke(app, ["run", "--recipe", str(out), "-o", str(image), "--warmup", "0"], catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    assert np.asarray(Image.open(image)).shape == (64, 64, 3)
