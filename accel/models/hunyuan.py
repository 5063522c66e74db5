"""HunyuanVideo family: double-stream then single-stream blocks, both returning (video, text)."""

from __future__ import annotations

from accel.models.base import BlockList, Family, GenerationDefaults

FAMILY = Family(
    name="hunyuan",
    title="HunyuanVideo",
    pipeline_class="HunyuanVideoPipeline",
    transformer_class="HunyuanVideoTransformer3DModel",
    repo="hunyuanvideo-community/HunyuanVideo",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=720, width=1280, frames=129, guidance_scale=6.0),
    blocks=(
        BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
        BlockList("single_transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
    ),
    frames_arg="num_frames",
    fps=15,
)
