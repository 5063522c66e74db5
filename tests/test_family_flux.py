"""FLUX.1: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import flux

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
)
