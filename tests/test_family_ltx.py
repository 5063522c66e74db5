"""LTX-Video: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
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
)
