"""FLUX.1: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import DTYPE, Grid, Layout, randn
from accel.models import flux

# -- real widths ------------------------------------------------------------------------------------------
FLUX_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    h, w, text = grid.rows, grid.cols, grid.text
    ids = torch.zeros(h * w, 3, device="cuda", dtype=DTYPE)
    return dict(
        hidden_states=randn(batch, h * w, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        pooled_projections=randn(batch, config["pooled_projection_dim"]),
        timestep=t / 1000,
        img_ids=ids,
        txt_ids=torch.zeros(text, 3, device="cuda", dtype=DTYPE),
        guidance=t,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.rows * grid.cols, config["in_channels"])


# -- flux: 2 double-stream + 2 single-stream blocks, 4x4 packed latents (16 tokens) ---------------
def block_transformer() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return block_cases.seeded(
        10,
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            pooled_projection_dim=block_cases.TEXT_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    side = 4
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    return dict(
        hidden_states=block_cases.latents((1, side * side, 16), drift),
        encoder_hidden_states=block_cases.text(),
        pooled_projections=block_cases.noise(torch.Generator().manual_seed(2), 1, block_cases.TEXT_DIM),
        timestep=torch.tensor([0.7 - drift]),  # the pipeline passes sigmas (t / 1000)
        img_ids=img_ids,
        txt_ids=torch.zeros(block_cases.TEXT_TOKENS, 3),
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, true_cfg_scale=2.0, height=64, width=64, num_inference_steps=4, guidance_scale=3.5),
    odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 512 text tokens
    threshold=0.5,
    tiny=TinyCase(
        name="flux",
        build=flux.build_tiny,
        pipeline_class=diffusers.FluxPipeline,
        call=dict(height=64, width=64, num_inference_steps=4, guidance_scale=3.5, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=4,
        latent_shape=(1, 16, 64),  # 64x64 -> 8x8 latents -> 4x4 packed tokens of 16*4 channels
        text_shape=(1, 512, 32),  # T5 padded to the pipeline's default max_sequence_length
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        # FLUX.1-dev at 1024x1024: 64x64 packed latents = 4096 image tokens, 512 T5 tokens; USP on 8.
        real_config=FLUX_DEV,
        real_layout=Layout(world=8, ulysses=4, ring=2, cache=True, grid=Grid(1, 64, 64, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
