"""CogVideoX: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
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
)
