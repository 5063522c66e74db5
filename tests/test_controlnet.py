"""ControlNet pipelines of a supported transformer, in a user's script with accel.apply: the
per-block residuals the ControlNet hands the transformer are cut with the stream they are added to,
halved with the batched CFG branches, and counted once by the cache.

FLUX.1 and Qwen-Image run real CFG as a second transformer call (true_cfg_scale); SD 3.5 and
Z-Image batch both branches into one call, so the residuals carry the batch and CFG parallelism
halves them. Z-Image's residuals are a {layer: tensor} mapping on its unified sequence, padded to
the batch's longest sample; its odd call gives the halves 96 and 128 tokens.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch

import controlnet_cases
import parallel_cases as cases
import variant_cases
from accel.cache.fbcache import FirstBlockCache
from accel.models.registry import FAMILIES, family_of

TOLERANCE = 1e-4


def call(height: int, width: int, **extra: Any) -> dict[str, Any]:
    return dict(
        prompt="a red fox",
        height=height,
        width=width,
        num_inference_steps=4,
        control_image=variant_cases.picture((width, height)),
        **extra,
    )


# family: (builder, small call, a call whose token counts 3 ranks do not divide, CFG call, cache threshold)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], float]] = {
    # 3x5 = 15 image tokens and 512 text tokens; CFG: a second call (true_cfg_scale)
    "flux": (
        "controlnet_cases:build_flux",
        call(64, 64, guidance_scale=3.5),
        call(48, 80, guidance_scale=3.5),
        call(48, 80, guidance_scale=3.5, true_cfg_scale=2.0, negative_prompt="blurry"),
        0.5,
    ),
    # 15 image tokens, 4 and 2 prompt tokens; CFG: a second call
    "qwenimage": (
        "controlnet_cases:build_qwenimage",
        call(64, 64, true_cfg_scale=4.0, negative_prompt="blurry"),
        call(48, 80, true_cfg_scale=4.0, negative_prompt="blurry"),
        call(48, 80, true_cfg_scale=4.0, negative_prompt="blurry"),
        0.5,
    ),
    # 15 image tokens, 333 text tokens; CFG batched, the residuals with it
    "sd3": (
        "controlnet_cases:build_sd3",
        call(64, 64, guidance_scale=3.5, negative_prompt="blurry"),
        call(48, 80, guidance_scale=3.5, negative_prompt="blurry"),
        call(48, 80, guidance_scale=3.5, negative_prompt="blurry"),
        0.5,
    ),
    # 5x7 = 35 image tokens (padded to 64) and 17 / 43 caption tokens (32 / 64): 96 and 128 unified
    # tokens, the batch padded to 128 under a key mask; CFG batched, each half its own length
    "zimage": (
        "controlnet_cases:build_zimage",
        call(64, 64, guidance_scale=4.0, negative_prompt="blurry"),
        call(80, 112, guidance_scale=4.0, negative_prompt="blurry, low quality, jpeg artifacts"),
        call(80, 112, guidance_scale=4.0, negative_prompt="blurry, low quality, jpeg artifacts"),
        1.15,
    ),
}


def modes(family: str) -> dict[str, tuple[dict[str, int], dict[str, Any], float]]:
    _, small, odd, guided, threshold = CASES[family]
    return {
        "ulysses2": ({"ulysses": 2}, small, 0.0),
        "ring3, odd size": ({"ring": 3}, odd, 0.0),
        "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, guided, threshold),
    }


@pytest.mark.parametrize("family", list(CASES))
def test_the_controlnet_changes_the_picture(family: str) -> None:
    """Else the parallel test below would pass with the residuals dropped."""
    builder, _, odd, _, _ = CASES[family]
    with_residuals, _, _ = controlnet_cases.run(builder, {}, odd)
    without, _, _ = controlnet_cases.run(builder, {}, dict(odd, controlnet_conditioning_scale=0.0))
    assert np.abs(with_residuals - without).max() > 0.1
    assert family_of(cases.tiny_pipeline(builder)) is FAMILIES[family]


@pytest.mark.parametrize("mode", ["ulysses2", "ring3, odd size", "cfg2 x ulysses2 + cache"])
@pytest.mark.parametrize("family", list(CASES))
def test_controlnet_equals_one_process(rank_pools, family: str, mode: str) -> None:
    builder = CASES[family][0]
    parallel, call, threshold = modes(family)[mode]
    recipe = {"cache": {"threshold": threshold}} if threshold else {}
    expected, decisions, _ = controlnet_cases.run(builder, recipe, call)
    if threshold:  # the cache caches some calls and computes others
        assert {record[3] for record in decisions} == {True, False}
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1)
    # Each rank seeds its global random state with its own index: rank 0's (the reference's) must win.
    for output, records, bytes_sent in rank_pools(world).run(
        controlnet_cases.run, builder, {**recipe, "parallel": parallel}, call, None
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
        if threshold and parallel.get("cfg", 1) == 1:
            assert records == decisions


def transformer_inputs(builder: str, call: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the pipeline's first transformer call (ControlNet residuals included)."""
    pipe = cases.tiny_pipeline(builder)
    seen: list[dict[str, Any]] = []

    signature = inspect.signature(pipe.transformer.forward)

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not seen:
            seen.append(dict(signature.bind(*args, **kwargs).arguments))

    hook = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        pipe(**dict(call, num_inference_steps=2), generator=torch.Generator().manual_seed(0), output_type="np")
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("family", list(CASES))
def test_a_cached_call_counts_the_controlnet_residuals_once(family: str) -> None:
    """The same inputs twice, the second call cached: the transformer adds the ControlNet's
    residuals between the blocks it skips, and the stored residual already holds them, so the
    cached output must equal the computed one (FLUX.1's counted them twice before the fix)."""
    builder, _, odd, _, _ = CASES[family]
    inputs = dict(transformer_inputs(builder, odd), return_dict=False)
    transformer = cases.tiny_pipeline(builder).transformer
    cache = FirstBlockCache(
        transformer, FAMILIES[family].blocks, threshold=1e9, primary_stream=FAMILIES[family].primary_stream
    )
    try:
        with torch.no_grad():
            (computed,), (cached,) = transformer(**inputs), transformer(**inputs)
    finally:
        cache.remove()
    assert [record.cached for record in cache.stats.records] == [False, True]
    computed, cached = (torch.stack(x) if isinstance(x, list) else x for x in (computed, cached))
    assert torch.allclose(cached, computed, atol=1e-5)


def inpaint_call(family: str) -> dict[str, Any]:
    _, _, odd, _, _ = CASES[family]
    size = (odd["width"], odd["height"])
    masks = (
        dict(image=odd["control_image"], mask_image=variant_cases.mask(size))
        if family == "zimage"
        else dict(control_mask=variant_cases.mask(size))
    )
    return dict(odd, **masks)


@pytest.mark.parametrize("family", ["qwenimage", "sd3", "zimage"])
def test_inpaint_controlnet_equals_one_process_on_ring3_at_an_odd_size(rank_pools, family: str) -> None:
    """The ControlNet inpaint pipelines hand the transformer the same residuals (the ControlNet also
    reads the mask); with CFG on, as the odd calls above run it."""
    builder = f"controlnet_cases:build_{family}_inpaint"
    call = inpaint_call(family)
    expected, _, _ = controlnet_cases.run(builder, {}, call)
    without, _, _ = controlnet_cases.run(builder, {}, dict(call, controlnet_conditioning_scale=0.0))
    assert np.abs(expected - without).max() > 0.1
    for output, _, bytes_sent in rank_pools(3).run(
        controlnet_cases.run, builder, {"parallel": {"ring": 3}}, call, None
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_zimage_cfg_halves_fit_the_residuals_to_their_own_length(rank_pools) -> None:
    """CFG parallelism alone: the half with the shorter samples (96 unified tokens) gets the
    residuals of its sample cut to 96, where the ControlNet padded them to the batch's 128."""
    builder, _, odd, _, _ = CASES["zimage"]
    expected, _, _ = controlnet_cases.run(builder, {}, odd)
    for output, _, bytes_sent in rank_pools(2).run(controlnet_cases.run, builder, {"parallel": {"cfg": 2}}, odd):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
