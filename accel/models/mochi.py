"""Mochi family: asymmetric video/text streams in one block list; CFG is batched."""

from __future__ import annotations

from accel.models.base import BlockList, Family, GenerationDefaults

FAMILY = Family(
    name="mochi",
    title="Mochi 1",
    pipeline_class="MochiPipeline",
    transformer_class="MochiTransformer3DModel",
    repo="genmo/mochi-1-preview",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=64, height=480, width=848, frames=85, guidance_scale=4.5),
    blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
    frames_arg="num_frames",
    fps=30,
)
