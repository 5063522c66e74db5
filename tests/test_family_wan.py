"""Wan 2.1: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, Layout, out_channels, randn
from accel.models import wan

WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, 2 * h, 2 * w),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_dim"]),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)


# -- wan: 2 blocks, 2 latent frames of 8x8, (1, 2, 2) patches (32 tokens) -------------------------
def block_transformer() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return block_cases.seeded(
        11,
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=block_cases.TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
    odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 patches = 40 tokens
    threshold=0.1,
    tiny=TinyCase(
        name="wan",
        build=wan.build_tiny,
        pipeline_class=diffusers.WanPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("blocks",),
        transformer_calls=8,
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        # Wan 2.1 14B at 480p, 81 frames: 21 x 30 x 52 = 32760 tokens; CFG halves x Ulysses 4.
        real_config=WAN_14B,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(21, 30, 52, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
