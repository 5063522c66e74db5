"""LTX-Video: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import ltx


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, grid.tokens, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["caption_channels"]),
        timestep=t,
        encoder_attention_mask=torch.ones(batch, text, device="cuda", dtype=torch.long),
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=(20 / 25, 32, 32),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.tokens, out_channels(config))


def fake_more_overrides(config: dict[str, Any], width: int) -> dict[str, Any]:
    return {"cross_attention_dim": width}


# -- ltx: 2 blocks, 2 latent frames of 4x4 patchified by the pipeline (32 tokens) ----------------
def block_transformer() -> nn.Module:
    from diffusers import LTXVideoTransformer3DModel

    return block_cases.seeded(
        15,
        lambda: LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            cross_attention_dim=block_cases.HEADS * block_cases.HEAD_DIM,
            num_layers=2,
            caption_channels=block_cases.TEXT_DIM,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    frames, height, width = 2, 4, 4
    return dict(
        hidden_states=block_cases.latents((1, frames * height * width, 8), drift),
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=block_cases.text_mask(),
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(20 / 25, 32, 32),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=96, width=128, num_frames=9, num_inference_steps=4, guidance_scale=3.0),
    odd=dict(height=128, width=160, num_frames=9),  # 2 latent frames x 4x5 = 40 video tokens
    threshold=0.1,
    tiny=TinyCase(
        name="ltx",
        build=ltx.build_tiny,
        pipeline_class=diffusers.LTXPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=96,
            width=128,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=3.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 96, 128, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on a batch of two
        latent_shape=(2, 24, 16),  # 9 frames -> 2 latent frames, 96x128 -> 3x4: 24 packed tokens
        text_shape=(2, 128, 32),  # T5 padded to the pipeline's default max_sequence_length (128)
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        more_overrides=fake_more_overrides,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
