"""FLUX.2 [klein]: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, TinyCase
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
)
