"""LTX-Video family: one block list, text enters by cross-attention so only the video stream flows."""

from __future__ import annotations

from accel.models.base import BlockList, Family, GenerationDefaults

FAMILY = Family(
    name="ltx",
    title="LTX-Video",
    pipeline_class="LTXPipeline",
    transformer_class="LTXVideoTransformer3DModel",
    repo="Lightricks/LTX-Video",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=704, frames=161, guidance_scale=3.0),
    blocks=(BlockList("transformer_blocks", returns=("hidden_states",)),),
    frames_arg="num_frames",
    fps=24,
)
