"""SkyReels-V2: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from typing import Any
import torch
from fakecuda import DTYPE, Grid, out_channels, randn
from accel.models import skyreels2


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Diffusion forcing: one timestep per latent frame, expanded to one per token."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, 2 * h, 2 * w),
        timestep=torch.full((batch, f), 500.0, device="cuda", dtype=DTYPE),
        enable_diffusion_forcing=True,
        encoder_hidden_states=randn(batch, text, config["text_dim"]),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)


# -- skyreels2: Wan's shape; diffusion forcing's one timestep per latent frame (per-token modulation) --
def block_transformer() -> nn.Module:
    return block_cases.wan_shaped("SkyReelsV2Transformer3DModel", 22)


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([[700.0 - 1000 * drift, 900.0 - 1000 * drift]]),  # one per latent frame
        encoder_hidden_states=block_cases.text(),
        enable_diffusion_forcing=True,
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0),
    odd=dict(height=80, width=112, num_frames=17),  # 5 latent frames x 5x7 patches = 175 tokens (3, 4, 8 do not divide)
    threshold=0.1,
    tiny=TinyCase(
        name="skyreels2",
        build=skyreels2.build_tiny,
        pipeline_class=diffusers.SkyReelsV2Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=6.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("blocks",),
        transformer_calls=8,  # cond and uncond: two calls per step, as Wan
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)
