"""Qwen-Image: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, out_channels, randn
from accel.models import qwenimage


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """The pipeline drops an all-true prompt mask, so no mask here."""
    h, w, text = grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, h * w, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        timestep=t / 1000,
        img_shapes=[[(1, h, w)]] * batch,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.rows * grid.cols, 4 * out_channels(config))  # 2x2 patches


# -- qwenimage: 2 double-stream blocks, 4x4 packed image tokens next to block_cases.TEXT_TOKENS -----------------
def block_transformer() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return block_cases.seeded(
        16,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 16, 16), drift),
        encoder_hidden_states=block_cases.text(),
        encoder_hidden_states_mask=block_cases.text_mask(),
        timestep=torch.tensor([0.7 - drift]),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=4),
    odd=dict(height=48, width=80),  # 3x5 = 15 image tokens; 4 and 2 prompt tokens, unpadded
    threshold=0.5,
    tiny=TinyCase(
        name="qwenimage",
        build=qwenimage.build_tiny,
        pipeline_class=diffusers.QwenImagePipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            true_cfg_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # true CFG: a second call per step for the negative prompt
        latent_shape=(1, 16, 64),  # 64x64 -> 8x8 latents -> 4x4 packed tokens of 16*4 channels
        text_shape=(1, 29, 32),  # the prompt's tokens after the 34-token template prefix, unpadded
        negative_text_shape=(1, 21, 32),
        reload_tolerance=1e-5,  # seen: 4e-7 (a batch-1 timestep Linear on an unaligned weight)
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
