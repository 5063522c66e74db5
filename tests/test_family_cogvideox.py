"""CogVideoX: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import cogvideox


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    rope = tuple(torch.randn(grid.tokens, config["attention_head_dim"], device="cuda") for _ in range(2))
    return dict(
        hidden_states=randn(batch, f, config["in_channels"], 2 * h, 2 * w),
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        timestep=t,
        image_rotary_emb=rope,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.frames, out_channels(config), 2 * grid.rows, 2 * grid.cols)


# -- cogvideox: 2 blocks, 2 latent frames of 8x8, 2x2 patches (32 tokens), sin-cos positions ------
def block_transformer() -> nn.Module:
    from diffusers import CogVideoXTransformer3DModel

    return block_cases.seeded(
        13,
        lambda: CogVideoXTransformer3DModel(
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=block_cases.TEXT_DIM,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=5,  # 2 latent frames after 4x temporal compression
            patch_size=2,
            temporal_compression_ratio=4,
            max_text_seq_length=block_cases.TEXT_TOKENS,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 2, 4, 8, 8), drift),  # (batch, frames, channels, height, width)
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([700 - int(1000 * drift)]),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=6.0),
    odd=dict(height=64, width=80, num_frames=17),  # 5 latent frames x 4x5 = 100 video tokens, 226 text
    threshold=0.8,
    tiny=TinyCase(
        name="cogvideox",
        build=cogvideox.build_tiny,
        pipeline_class=diffusers.CogVideoXPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=6.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # one batched (negative, positive) call per step
        latent_shape=(2, 3, 16, 8, 8),  # CFG batch of 2; 9 frames -> 3 latent frames, (F, C, H, W)
        text_shape=(2, 226, 32),  # T5 padded to the pipeline's default max_sequence_length
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
