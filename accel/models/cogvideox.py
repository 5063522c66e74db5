"""CogVideoX family: one block list over separate video and text streams; CFG is batched."""

from __future__ import annotations

from accel.models.base import BlockList, Family, GenerationDefaults

FAMILY = Family(
    name="cogvideox",
    title="CogVideoX",
    pipeline_class="CogVideoXPipeline",
    transformer_class="CogVideoXTransformer3DModel",
    repo="THUDM/CogVideoX-5b",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=720, frames=49, guidance_scale=6.0),
    blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
    frames_arg="num_frames",
    fps=8,
)
