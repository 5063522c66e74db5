"""Mochi family: asymmetric video/text streams in one block list; CFG is batched.

`build_tiny` makes a seeded, random-weight Mochi-1-preview-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.parallel.plan_format import (
    JOINT_ATTENTION,
    Packed,
    ParallelPlan,
    Rotary,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import MochiPipeline


def build_tiny(seed: int = 0) -> "MochiPipeline":
    """A tiny Mochi 1 look-alike: real classes, Mochi configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model (the last block is `context_pre_only`: it updates no text stream). The streams are
    asymmetric as in Mochi: 96-wide video tokens, 48-wide text tokens, 128-wide T5 features (3072,
    1536 and 4096 on the real model); their SwiGLU widths (256 and 128) split over 2 or 4 TP ranks. 7 frames at 64x64
    give 2x8x8 latents, i.e. 32 video tokens
    after 2x2 patching, next to the text tokens (256 by default, the pipeline's padding length),
    which the attention processor compacts per sample to the prompt's real tokens.
    """
    import torch

    from accel.models.tiny.seeding import finish, seeded  # heavy (transformers): only when building
    from accel.models.tiny.t5 import t5_encoder, t5_tokenizer
    from diffusers import (
        AutoencoderKLMochi,
        FlowMatchEulerDiscreteScheduler,
        MochiPipeline,
        MochiTransformer3DModel,
    )

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = t5_tokenizer()
    # Wider than the transformer, as T5-XXL's 4096 is wider than Mochi's 3072.
    text_encoder = t5_encoder(tokenizer, seed=base + 1, hidden=128)

    latent_channels = 12  # the pipeline hard-codes Mochi's 12 latent channels when denormalising
    heads, head_dim = 4, 24
    with seeded(base + 2):
        transformer = MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=heads,
            attention_head_dim=head_dim,
            num_layers=2,
            pooled_projection_dim=heads * head_dim // 2,  # the text stream is half as wide, as 1536/3072
            in_channels=latent_channels,
            qk_norm="rms_norm",
            text_embed_dim=text_encoder.config.d_model,
            time_embed_dim=32,
            activation_fn="swiglu",
            max_sequence_length=256,
        )
        # diffusers starts the learned mixed-RoPE frequencies at zero, which makes RoPE the identity
        # and token positions irrelevant. Give them a seeded RoPE-Mixed style init instead: per head
        # and frequency, a random (t, h, w) direction with the usual geometric magnitudes.
        half = head_dim // 2
        directions = torch.randn(3, heads, half)
        directions = directions / directions.norm(dim=0, keepdim=True)
        magnitudes = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        with torch.no_grad():
            transformer.pos_frequencies.copy_(directions * magnitudes)
        transformer = finish(transformer)
    with seeded(base + 3):
        # Mochi's VAE shape: 8x spatial and 6x temporal compression (6k+1 frames -> k+1 latents).
        # 32 channels is the floor: its group norms use 32 groups, its attention 32-wide heads.
        vae = finish(
            AutoencoderKLMochi(
                in_channels=15,  # RGB plus its Fourier features
                out_channels=3,
                encoder_block_out_channels=(32, 32, 32, 32),
                decoder_block_out_channels=(32, 32, 32, 32),
                latent_channels=latent_channels,
                layers_per_block=(1, 1, 1, 1, 1),
                temporal_expansions=(1, 2, 3),
                spatial_expansions=(2, 2, 2),
                add_attention_block=(False, True, True, True, True),
            )
        )
    # Mochi 1's scheduler config: the model's time runs from noise (0) to data (1000), hence
    # inverted sigmas; the pipeline passes its own linear-quadratic sigmas, so no shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=False,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        invert_sigmas=True,
    )
    return MochiPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn1", JOINT_ATTENTION),  # the last block has no text output
        # SwiGLU: the projection holds the value and the gate side by side.
        "transformer_blocks.*.ff.net.0.proj": Packed("colwise", (1, 1)),
        "transformer_blocks.*.ff.net.2": "rowwise",
        "transformer_blocks.*.ff_context.net.0.proj": Packed("colwise", (1, 1)),
        "transformer_blocks.*.ff_context.net.2": "rowwise",
    },
    per_rank=("heads",),
    rotary=(Rotary("transformer_blocks.*", ("image_rotary_emb",), {3: 1}),),  # (tokens, heads, r) cos and sin
)


FAMILY = Family(
    name="mochi",
    title="Mochi 1",
    pipeline_class="MochiPipeline",
    transformer_class="MochiTransformer3DModel",
    vae="AutoencoderKLMochi",
    repo="genmo/mochi-1-preview",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=64, height=480, width=848, frames=85, guidance_scale=4.5),
    size_step=16,
    frame_step=6,
    acceleration=Acceleration(
        blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
        # Video tokens are cut; the text stays whole on every rank, because Mochi's attention keeps
        # only each sample's real text tokens (a count that would differ between text shards). The
        # engine shares the text part of each joint attention out across the ranks instead.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("output", "video", dim=0, module="rope"),
                SequenceSplit("hidden_states", "video", dim=1, module="transformer_blocks.0"),
            ),
            attention_keys=("video", "text"),
            output_stream="video",
            output_dim=1,
            output_module="proj_out",
            local_attention=("time_embed",),  # attention-pools the (whole) text into the timestep embedding
            batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
        ),
        cfg="batch",
    ),
    frames_arg="num_frames",
    fps=30,
    heads=24,  # Mochi 1: 24 heads of 128 (3072 wide)
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=7, guidance_scale=4.5),
)
