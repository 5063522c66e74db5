"""Mochi: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import mochi


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, 2 * h, 2 * w),
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        timestep=t,
        encoder_attention_mask=torch.ones(batch, text, device="cuda", dtype=torch.long),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)


def fake_more_overrides(config: dict[str, Any], width: int) -> dict[str, Any]:
    return {"pooled_projection_dim": width // 2}


def fake_model_syncs(config: dict[str, Any], batch: int, cached: bool) -> int:
    # its text compaction, per block run
    return (1 if cached else config["num_layers"]) * batch


# -- mochi: 2 blocks (the last is context_pre_only), 2 latent frames of 8x8, 2x2 patches ----------
def block_transformer() -> nn.Module:
    from diffusers import MochiTransformer3DModel

    return block_cases.seeded(
        14,
        lambda: MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=4,
            text_embed_dim=block_cases.TEXT_DIM,
            time_embed_dim=32,
            max_sequence_length=block_cases.TEXT_TOKENS,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=block_cases.text_mask(),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5),
    odd=dict(height=64, width=80, num_frames=7),  # 2 latent frames x 4x5 = 40 video tokens
    threshold=0.3,
    tiny=TinyCase(
        name="mochi",
        build=mochi.build_tiny,
        pipeline_class=diffusers.MochiPipeline,
        call=dict(height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5, output_type="np"),
        output_attr="frames",
        output_shape=(1, 7, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 12, 2, 8, 8),  # 7 frames -> 2 latent frames, 64x64 -> 8x8, 12 channels
        text_shape=(2, 256, 128),  # T5 padded to the pipeline's default max_sequence_length (256)
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        more_overrides=fake_more_overrides,
        model_syncs=fake_model_syncs,
        attention_per_sample=True,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
