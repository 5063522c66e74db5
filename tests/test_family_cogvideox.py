"""CogVideoX: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import cogvideox

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
)
