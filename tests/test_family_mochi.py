"""Mochi: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import mochi

CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5),
    odd=dict(height=64, width=80, num_frames=7),  # 2 latent frames x 4x5 = 40 video tokens
    threshold=0.3,
    tiny=TinyCase(
        name="mochi",
        build=mochi.build_tiny,
        pipeline_class=diffusers.MochiPipeline,
        call=dict(height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5, output_type="np"),
        output_attr="frames",
        output_shape=(1, 7, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 12, 2, 8, 8),  # 7 frames -> 2 latent frames, 64x64 -> 8x8, 12 channels
        text_shape=(2, 256, 128),  # T5 padded to the pipeline's default max_sequence_length (256)
        components=("text_encoder", "transformer", "vae"),
    ),
)
