"""FLUX.2 [klein]: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import DTYPE, Grid, randn
from accel.models import flux2


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """4-axis ids (t, h, w, l) with a batch dim; FLUX.2-dev embeds the guidance."""
    h, w, text = grid.rows, grid.cols, grid.text
    img_ids = torch.zeros(batch, h * w, 4, device="cuda", dtype=DTYPE)
    guidance = dict(guidance=t) if config["guidance_embeds"] else {}
    return dict(
        hidden_states=randn(batch, h * w, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["joint_attention_dim"]),
        timestep=t / 1000,
        img_ids=img_ids,
        txt_ids=torch.zeros(batch, text, 4, device="cuda", dtype=DTYPE),
        return_dict=False,
        **guidance,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.rows * grid.cols, config["in_channels"])


# -- flux2-klein: 2 double and 2 single blocks, 4x4 image tokens with 4-axis ids ------------------------
def block_transformer() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return block_cases.seeded(
        17,
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    grid = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), torch.zeros(1), indexing="ij"), -1
    )
    text = torch.stack([torch.zeros(block_cases.TEXT_TOKENS)] * 3 + [torch.arange(float(block_cases.TEXT_TOKENS))], -1)
    return dict(
        hidden_states=block_cases.latents((1, 16, 16), drift),
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([0.7 - drift]),
        img_ids=grid.reshape(1, 16, 4),
        txt_ids=text[None],
        return_dict=False,
    )


CASE = FamilyCase(
    dict(prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=4.0),  # CFG on the empty prompt
    odd=dict(height=64, width=80),  # 4x5 = 20 image tokens, 512 text tokens (inpaint needs 64 px at least)
    threshold=0.8,
    tiny=TinyCase(
        name="flux2-klein",
        build=flux2.build_tiny_klein,
        pipeline_class=diffusers.Flux2KleinPipeline,
        call=dict(height=64, width=64, num_inference_steps=4, guidance_scale=4.0, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=8,  # real CFG (a base model): a second call per step on the empty prompt
        latent_shape=(1, 16, 128),  # 64x64 -> 8x8 latents of 32 channels -> 4x4 packed tokens of 128
        text_shape=(1, 512, 24),  # Qwen3 hidden states 9, 18 and 27 stacked (3 x 8), padded to 512
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
