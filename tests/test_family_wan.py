"""Wan 2.1: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import wan

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
)
