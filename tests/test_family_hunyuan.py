"""HunyuanVideo: its case for the shared matrices (tests/families.py)."""

from __future__ import annotations

import diffusers
from family_case import FamilyCase, PROMPT, TinyCase
from accel.models import hunyuan

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
)
