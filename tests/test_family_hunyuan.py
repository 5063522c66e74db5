"""HunyuanVideo: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import Grid, Layout, out_channels, randn
from accel.models import hunyuan

HUNYUAN = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=24,
    attention_head_dim=128,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    mlp_ratio=4.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    text_embed_dim=4096,
    pooled_projection_dim=768,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, 2 * h, 2 * w),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        encoder_attention_mask=torch.ones(batch, text, device="cuda", dtype=torch.long),
        pooled_projections=randn(batch, config["pooled_projection_dim"]),
        guidance=t,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)


# -- hunyuan: 2 double-stream + 2 single-stream blocks, 2 latent frames of 8x8 (32 tokens) --------
def block_transformer() -> nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    return block_cases.seeded(
        12,
        lambda: HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=block_cases.TEXT_DIM,
            pooled_projection_dim=16,
            rope_axes_dim=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        encoder_attention_mask=block_cases.text_mask(),
        pooled_projections=block_cases.noise(torch.Generator().manual_seed(2), 1, 16),
        guidance=torch.tensor([6000.0]),  # the pipeline passes guidance_scale * 1000
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, true_cfg_scale=2.0, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0),
    odd=dict(height=64, width=80, num_frames=5),  # 40 video tokens, 256 text tokens
    threshold=0.3,
    tiny=TinyCase(
        name="hunyuan",
        build=hunyuan.build_tiny,
        pipeline_class=diffusers.HunyuanVideoPipeline,
        call=dict(height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0, output_type="np"),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=4,  # distilled guidance: one call per step (true CFG needs true_cfg_scale > 1)
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 256, 32),  # Llama tokens after the template crop, padded to max_sequence_length
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        masking=True,
        # HunyuanVideo at 544x960, 129 frames: 33 x 34 x 60 = 67320 tokens, 256 text tokens; Ulysses 8.
        real_config=HUNYUAN,
        real_layout=Layout(world=8, ulysses=8, grid=Grid(33, 34, 60, 256)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
