"""LTX-Video: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import ltx

CASE = FamilyCase(
    dict(PROMPT, height=96, width=128, num_frames=9, num_inference_steps=4, guidance_scale=3.0),
    odd=dict(height=128, width=160, num_frames=9),  # 2 latent frames x 4x5 = 40 video tokens
    threshold=0.1,
    tiny=TinyCase(
        name="ltx",
        build=ltx.build_tiny,
        pipeline_class=diffusers.LTXPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=96,
            width=128,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=3.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 96, 128, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on a batch of two
        latent_shape=(2, 24, 16),  # 9 frames -> 2 latent frames, 96x128 -> 3x4: 24 packed tokens
        text_shape=(2, 128, 32),  # T5 padded to the pipeline's default max_sequence_length (128)
        components=("text_encoder", "transformer", "vae"),
    ),
)
