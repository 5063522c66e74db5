"""SD 3.5 medium: the image-only second attention of its first blocks (the plan's module keys)
under context parallelism equals one process, with and without the cache."""

from __future__ import annotations

import numpy as np
import pytest
from family_parallel import MODES, world_of

import parallel_cases as cases
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import sd3


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Latents before patching (2x2)."""
    h, w, text = grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], 2 * h, 2 * w),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        pooled_projections=randn(batch, config["pooled_projection_dim"]),
        timestep=t,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), 2 * grid.rows, 2 * grid.cols)


def fake_more_overrides(config: dict[str, Any], width: int) -> dict[str, Any]:
    # the text is projected to the blocks' width
    return {"caption_projection_dim": width}


# -- sd3: 2 joint blocks (the last keeps no text output) on 4x4 patches; medium's attn2 in block 0 -----
def block_transformer() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return block_cases.seeded(
        18,
        lambda: SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            caption_projection_dim=block_cases.HEADS * block_cases.HEAD_DIM,
            pooled_projection_dim=16,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 4, 8, 8), drift),
        encoder_hidden_states=block_cases.text(),
        pooled_projections=block_cases.noise(torch.Generator().manual_seed(2), 1, 16),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_inference_steps=4, guidance_scale=3.5),  # batched CFG
    odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 333 text tokens
    threshold=0.5,
    tiny=TinyCase(
        name="sd3",
        build=sd3.build_tiny,
        pipeline_class=diffusers.StableDiffusion3Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            guidance_scale=3.5,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 16, 8, 8),  # the pipeline hands over unpatchified latents
        text_shape=(2, 333, 64),  # 77 CLIP tokens (padded to T5's width) then 256 T5 tokens
        components=("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        more_overrides=fake_more_overrides,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)

MEDIUM = "accel.models.sd3:build_tiny_medium"
TOLERANCE = 1e-4


def test_the_medium_builder_has_dual_attention_blocks() -> None:
    transformer = cases.tiny_pipeline(MEDIUM).transformer
    assert transformer.config.dual_attention_layers == (0,)
    assert transformer.transformer_blocks[0].attn2 is not None
    assert getattr(transformer.transformer_blocks[1], "attn2", None) is None


@pytest.mark.parametrize(
    "mode, odd, cache", [("ulysses2", False, False), ("usp2x2", True, True), ("cfg2xulysses2", False, True)]
)
def test_medium_equals_one_process(rank_pools, mode: str, odd: bool, cache: bool) -> None:
    case = CASE
    call = dict(case.call, **case.odd) if odd else case.call
    recipe = {"cache": {"threshold": case.threshold}} if cache else {}
    expected, records, _ = cases.tiny_run(MEDIUM, recipe, call)
    parallel = MODES[mode]
    for output, got, bytes_sent in rank_pools(world_of(parallel)).run(
        cases.tiny_run, MEDIUM, {**recipe, "parallel": parallel}, call
    ):
        assert bytes_sent > 0
        if cache:  # the same calls cached, after the same block-0 change (up to float rounding)
            assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records]
            assert [r[2] or -1.0 for r in got] == pytest.approx([r[2] or -1.0 for r in records], rel=1e-5)
        assert np.abs(output - expected).max() <= TOLERANCE
