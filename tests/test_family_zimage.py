"""Z-Image specifics the shared matrices do not show by themselves.

Z-Image's transformer pads each sample's image and caption tokens to multiples of 32 and then pads
the batch to its longest unified sequence under a key mask. With batched CFG the negative prompt
is often much shorter or longer than the prompt, so the batch is padded and the mask is a model
mask the engine must gather; under CFG parallelism each half then runs its own sequence length.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
import torch
from family_parallel import MODES, reference, world_of

from accel.models.registry import FAMILIES
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from fakecuda import Grid, HEADS, Layout, out_channels, randn
from accel.models import zimage


# Z-Image's transformer (diffusers' defaults, Z-Image's shape; two main layers, one refiner of each kind): 30 heads of
# 128,
# Qwen3-4B's 2560-wide text.
Z_IMAGE = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=30,
    n_kv_heads=30,
    cap_feat_dim=2560,
    axes_dims=[32, 48, 48],
    axes_lens=[1024, 512, 512],
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Lists of per-sample (C, F, H, W) latents (2x2 patches) and (tokens, width) caption features."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        x=[randn(config["in_channels"], f, 2 * h, 2 * w) for _ in range(batch)],
        t=t / 1000,
        cap_feats=[randn(text, config["cap_feat_dim"]) for _ in range(batch)],
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)  # the per-sample outputs, stacked


def fake_overrides(config: dict[str, Any]) -> dict[str, Any]:
    # its config says n_heads (no grouped keys) and sets the width itself
    return {"n_heads": HEADS, "n_kv_heads": HEADS, "dim": HEADS * (config["dim"] // config["n_heads"])}


# -- zimage: 2 refiner blocks of each kind, then 2 main layers on the unified (image, caption) sequence --
def block_transformer() -> nn.Module:
    from diffusers import ZImageTransformer2DModel

    return block_cases.seeded(
        20,
        lambda: ZImageTransformer2DModel(
            in_channels=4,
            dim=block_cases.HEADS * block_cases.HEAD_DIM,
            n_layers=2,
            n_refiner_layers=2,
            n_heads=block_cases.HEADS,
            n_kv_heads=block_cases.HEADS,
            cap_feat_dim=block_cases.TEXT_DIM,
            axes_dims=[4, 6, 6],
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    # Lists with one tensor per sample: (C, F, H, W) latents (4x4 patches) and (tokens, dim) caption features.
    return dict(
        x=[block_cases.latents((4, 1, 8, 8), drift)],
        t=torch.tensor([0.3 + drift]),
        cap_feats=[block_cases.text()[0]],
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_inference_steps=4, guidance_scale=4.0),  # batched CFG, as the base model runs
    # 5x7 = 35 image tokens and 17 caption tokens, each padded to 32s: 96 unified tokens; the
    # negative's 43 caption tokens make 128, so the batch pads the positive with a key mask.
    odd=dict(height=80, width=112, negative_prompt="blurry, low quality, jpeg artifacts"),
    threshold=1.15,  # block 0's residual changes by ~100 % a step with random adaLN weights,
    tiny=TinyCase(
        name="zimage",
        build=zimage.build_tiny,
        pipeline_class=diffusers.ZImagePipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            guidance_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("layers", "noise_refiner", "context_refiner"),
        transformer_calls=4,  # CFG is batched: one call per step on [positive, negative]
        inputs=("x", "cap_feats"),
        latent_shape=((16, 1, 8, 8),) * 2,  # one (C, F, H, W) latent per sample
        text_shape=((41, 8), (27, 8)),  # each prompt's real tokens (chat framing included), unpadded
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        overrides=fake_overrides,
        # Z-Image (the base model, batched CFG) at 1024x1024: 4096 image tokens and a 512-token caption in one sequence;
        # CFG halves x Ulysses 4 (30 heads in 32 slots).
        real_config=Z_IMAGE,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(1, 64, 64, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)

TOLERANCE = 1e-4
ODD = dict(CASE.call, **CASE.odd)


def unified_inputs(call: dict[str, Any]) -> list[tuple[tuple[int, ...], list[int] | None]]:
    """(shape of the unified sequence, each sample's real-token count or None without a mask) at
    the first main layer, per transformer call of a one-step run on one process."""
    pipe = cases.tiny_pipeline("tiny-zimage")
    seen: list[tuple[tuple[int, ...], list[int] | None]] = []

    def record(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        x, mask = args[:2]
        seen.append((tuple(x.shape), None if mask is None else mask.sum(dim=1).tolist()))

    hook = pipe.transformer.layers[0].register_forward_pre_hook(record)
    try:
        pipe(**dict(call, num_inference_steps=1), generator=torch.Generator().manual_seed(0), output_type="np")
    finally:
        hook.remove()
    return seen


def test_the_shared_cases_cover_an_unmasked_and_a_masked_batch() -> None:
    # 16 image tokens and 17 / 14 caption tokens, each padded to 32: two samples of 64, no mask.
    assert unified_inputs(CASE.call) == [((2, 64, 64), None)]
    # 35 image tokens (64) with 17 (32) and 43 (64) caption tokens: 96 and 128, the batch padded to
    # 128 under a key mask; 128 tokens do not divide over 3 ranks.
    assert unified_inputs(ODD) == [((2, 128, 64), [96, 128])]


@pytest.mark.parametrize("mode", ["cfg2", "cfg2xulysses2"])
def test_cfg_halves_of_different_lengths_equal_one_process(rank_pools: Any, mode: str) -> None:
    """The halves split the batched call into its samples: each runs its own unified length (96, 128)."""
    expected, _ = reference("zimage", ODD)
    parallel = MODES[mode]
    for output, _, bytes_sent in rank_pools(world_of(parallel)).run(
        cases.tiny_run, "tiny-zimage", {"parallel": parallel}, ODD
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_guidance_runs_above_zero_on_z_image() -> None:
    """Z-Image's pipeline guides whenever guidance_scale > 0, so cfg = 2 is accepted at 0.5 and
    refused at 0 (Turbo's setting) with the family's own threshold in the message."""
    family = FAMILIES["zimage"]
    assert family.cfg_off(dict(CASE.call, guidance_scale=0.5)) is None
    assert (
        family.cfg_off(dict(CASE.call, guidance_scale=0.0)) == "guidance_scale is 0.0, and guidance runs only above 0"
    )
    assert (
        FAMILIES["flux2-klein"].cfg_off(dict(guidance_scale=1.0))
        == "guidance_scale is 1.0, and guidance runs only above 1"
    )


def test_steps_left_unguided_by_cfg_truncation_run_whole_on_each_half(rank_pools: Any) -> None:
    """cfg_truncation = 0.2 turns guidance off for the last two of four steps (their normalised times
    are 0, 0.1, 0.25 and 0.5 under the shift of 3): the pipeline's batch drops from
    [positive, negative] to [positive] mid-run, and CFG parallelism runs those calls whole on both
    halves instead of refusing a batch of one."""
    call = dict(ODD, cfg_truncation=0.2)
    batches: list[int] = []
    pipe = cases.tiny_pipeline("tiny-zimage")
    hook = pipe.transformer.register_forward_pre_hook(lambda _m, args: batches.append(len(args[0])))
    try:
        expected, _ = reference("zimage", call)
    finally:
        hook.remove()
    assert batches == [2, 2, 1, 1]
    for output, _, bytes_sent in rank_pools(2).run(cases.tiny_run, "tiny-zimage", {"parallel": {"cfg": 2}}, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
