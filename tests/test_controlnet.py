"""ControlNet pipelines of a supported transformer, in a user's script with accel.apply: the
per-block residuals the ControlNet hands the transformer are cut with the image tokens, and the
cache counts them once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import parallel_cases as cases
import variant_cases
from accel.cache.fbcache import FirstBlockCache
from accel.models.registry import FAMILIES, family_of

TOLERANCE = 1e-4
BUILDER = "controlnet_cases:build_flux"


def flux_call(height: int, width: int, **extra: Any) -> dict[str, Any]:
    return dict(prompt="a red fox", height=height, width=width, num_inference_steps=4, guidance_scale=3.5,
                control_image=variant_cases.picture((width, height)), **extra)


MODES = {
    "ulysses2": ({"ulysses": 2}, flux_call(64, 64), 0.0),
    # 3x5 = 15 image tokens and 512 text tokens: neither divides over 3 ranks
    "ring3, odd size": ({"ring": 3}, flux_call(48, 80), 0.0),
    "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, flux_call(48, 80, true_cfg_scale=2.0, negative_prompt="blurry"), 0.5),
}


def test_the_controlnet_changes_the_picture() -> None:
    """Else the parallel test below would pass with the residuals dropped."""
    call = MODES["ring3, odd size"][1]
    with_residuals, _, _ = cases.tiny_run(BUILDER, {}, call)
    without, _, _ = cases.tiny_run(BUILDER, {}, dict(call, controlnet_conditioning_scale=0.0))
    assert np.abs(with_residuals - without).max() > 0.1
    assert family_of(cases.tiny_pipeline(BUILDER)) is FAMILIES["flux"]


@pytest.mark.parametrize("mode", list(MODES))
def test_flux_controlnet_equals_one_process(rank_pools, mode: str) -> None:
    parallel, call, threshold = MODES[mode]
    recipe = {"cache": {"threshold": threshold}} if threshold else {}
    expected, decisions, _ = cases.tiny_run(BUILDER, recipe, call)
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1)
    for output, records, bytes_sent in rank_pools(world).run(cases.tiny_run, BUILDER, {**recipe, "parallel": parallel}, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
        if threshold and parallel.get("cfg", 1) == 1:
            assert records == decisions


def test_a_cached_call_counts_the_controlnet_residuals_once() -> None:
    """The same inputs twice, the second call cached: the transformer adds the ControlNet's
    residuals between the blocks it skips, and the stored residual already holds them, so the
    cached output must equal the computed one (before the fix it counted them twice)."""
    transformer = cases.tiny_pipeline(BUILDER).transformer
    generator = torch.Generator().manual_seed(0)
    tokens, text = 12, 7
    inputs = dict(
        hidden_states=torch.randn(1, tokens, transformer.config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, text, transformer.config.joint_attention_dim, generator=generator),
        pooled_projections=torch.randn(1, transformer.config.pooled_projection_dim, generator=generator),
        timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3),
        controlnet_block_samples=[torch.randn(1, tokens, 64, generator=generator) for _ in range(2)],
        controlnet_single_block_samples=[torch.randn(1, tokens, 64, generator=generator) for _ in range(2)],
        return_dict=False,
    )
    cache = FirstBlockCache(transformer, FAMILIES["flux"].blocks, threshold=1e9)
    try:
        with torch.no_grad():
            (computed,), (cached,) = transformer(**inputs), transformer(**inputs)
    finally:
        cache.remove()
    assert [record.cached for record in cache.stats.records] == [False, True]
    assert torch.allclose(cached, computed, atol=1e-5)
