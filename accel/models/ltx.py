"""LTX-Video family: one block list, text enters by cross-attention so only the video stream flows.

`build_tiny` makes a seeded, random-weight LTX-Video-0.9-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Conditions, Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    ParallelPlan,
    Rotary,
    SELF_ATTENTION,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import LTXConditionPipeline, LTXI2VLongMultiPromptPipeline, LTXPipeline


def build_tiny(seed: int = 0) -> "LTXPipeline":
    """A tiny LTX-Video 0.9 look-alike: real classes, LTX configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model. The VAE compresses 32x in space and 8x in time as the real one does, so 9 frames
    at 96x128 (landscape, like the real 480x704) give 2x3x4 latents, i.e. 24 video tokens (patch
    size 1), cross-attending to the text tokens (128 by default, the pipeline's padding length).
    Guidance is batched: each step makes one transformer call on a batch of two.
    """
    from accel.models.tiny.seeding import finish, seeded  # heavy (transformers): only when building
    from accel.models.tiny.t5 import t5_encoder, t5_tokenizer
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    # LTX-Video's tokenizer stops at 128 tokens, the pipeline's default max_sequence_length.
    tokenizer = t5_tokenizer(model_max_length=128)
    text_encoder = t5_encoder(tokenizer, seed=base + 1)

    latent_channels = 16
    heads, head_dim = 4, 16
    with seeded(base + 2):
        transformer = finish(
            LTXVideoTransformer3DModel(
                in_channels=latent_channels,
                out_channels=latent_channels,
                patch_size=1,
                patch_size_t=1,
                num_attention_heads=heads,
                attention_head_dim=head_dim,
                # As on the real model (2048 = 32 x 64): captions are projected to the inner width.
                cross_attention_dim=heads * head_dim,
                num_layers=2,
                activation_fn="gelu-approximate",
                qk_norm="rms_norm_across_heads",
                norm_elementwise_affine=False,
                norm_eps=1e-6,
                caption_channels=text_encoder.config.d_model,
                attention_bias=True,
                attention_out_bias=True,
            )
        )
    with seeded(base + 3):
        # LTX-Video 0.9.0's VAE shape: 4x4 patching then three spatio-temporal 2x stages, i.e.
        # 32x spatial and 8x temporal compression (8k+1 frames -> k+1 latent frames).
        vae = finish(
            AutoencoderKLLTXVideo(
                in_channels=3,
                out_channels=3,
                latent_channels=latent_channels,
                block_out_channels=(8, 16, 16, 16),
                decoder_block_out_channels=(8, 16, 16, 16),
                layers_per_block=(1, 1, 1, 1, 1),
                decoder_layers_per_block=(1, 1, 1, 1, 1),
                spatio_temporal_scaling=(True, True, True, False),
                decoder_spatio_temporal_scaling=(True, True, True, False),
                decoder_inject_noise=(False, False, False, False, False),
                upsample_residual=(False, False, False, False),
                upsample_factor=(1, 1, 1, 1),
                timestep_conditioning=False,
                patch_size=4,
                patch_size_t=1,
                resnet_norm_eps=1e-6,
                scaling_factor=1.0,
                encoder_causal=True,
                decoder_causal=False,
            )
        )
    # LTX-Video's scheduler config: the shift grows with the video token count, and the sigmas
    # are stretched to end at 0.1.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return LTXPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )


def _tiny_unshifted(pipeline: str, seed: int) -> Any:
    """build_tiny's parts as `pipeline`, with a scheduler that does not shift its sigmas by token
    count: the condition and long multi-prompt pipelines set their own schedules and pass no `mu`,
    which the family's dynamically shifting tiny scheduler (like the default repo's) refuses."""
    import diffusers

    base = build_tiny(seed)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(base.scheduler.config, use_dynamic_shifting=False)
    return getattr(diffusers, pipeline).from_pipe(base, scheduler=scheduler)


def build_tiny_condition(seed: int = 0) -> "LTXConditionPipeline":
    """The tiny LTXConditionPipeline (diffusers' example runs it on LTX-Video 0.9.5)."""
    return _tiny_unshifted("LTXConditionPipeline", seed)


def build_tiny_long(seed: int = 0) -> "LTXI2VLongMultiPromptPipeline":
    """The tiny LTXI2VLongMultiPromptPipeline. Its scheduler class stays the checkpoints' flow-match
    one (the pipeline logs that ComfyUI runs it with LTXEulerAncestralRFScheduler; under that
    schedule the tiny's block-0 residual changes too much per step for the cache test to skip a call)."""
    return _tiny_unshifted("LTXI2VLongMultiPromptPipeline", seed)


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn1", SELF_ATTENTION),
        **split_layers("transformer_blocks.*.attn2", SELF_ATTENTION),
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
    },
    # LTX-Video's query and key norms span all heads.
    norms=(
        "transformer_blocks.*.attn1.norm_q",
        "transformer_blocks.*.attn1.norm_k",
        "transformer_blocks.*.attn2.norm_q",
        "transformer_blocks.*.attn2.norm_k",
    ),
    per_rank=("heads",),
    rotary=(Rotary("transformer_blocks.*", ("image_rotary_emb",), {3: -1}),),  # cos and sin over the whole width
)


FAMILY = Family(
    name="ltx",
    title="LTX-Video",
    pipeline_class="LTXPipeline",
    transformer_class="LTXVideoTransformer3DModel",
    vae="AutoencoderKLLTXVideo",
    repo="Lightricks/LTX-Video",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=704, frames=161, guidance_scale=3.0),
    size_step=32,
    frame_step=8,
    acceleration=Acceleration(
        blocks=(BlockList("transformer_blocks", returns=("hidden_states",)),),
        # Latents arrive packed, one token per row: cut them and the rotary embedding; the text stays
        # whole, so the masked cross-attention (attn2) runs on each rank unchanged.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("hidden_states", "video", dim=1),
                SequenceSplit("output", "video", dim=1, module="rope"),
                # Image-to-video and the condition pipeline: one timestep per video token (the
                # conditioning tokens' are 0), cut with the tokens; text-to-video's one per sample
                # (batch,) or (batch, 1) stays whole.
                SequenceSplit("timestep", "video", dim=1, ndim=2, broadcast=True),
                # The long multi-prompt pipeline's: (batch, tokens, 1).
                SequenceSplit("timestep", "video", dim=1, ndim=3),
            ),
            attention_keys=("video",),
            output_stream="video",
            output_dim=1,
            output_module="proj_out",
            local_attention=("transformer_blocks.*.attn2",),
            # The condition pipeline's `video_coords` (batch, 3, tokens) place every token for the
            # rotary embedding, the conditioning tokens it puts before the video's included: the rope
            # module reads them whole on every rank and its output is cut, so CFG only halves them.
            batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "video_coords"),
        ),
        cfg="batch",
    ),
    frames_arg="num_frames",
    fps=24,
    heads=32,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=96, width=128, frames=9, guidance_scale=3.0),
    variants=(
        # Image-to-video puts the picture's latents in the first latent frame and keeps them there.
        Variant("LTXImageToVideoPipeline", image="image", same_weights_as="LTXPipeline"),
        # A picture or a clip at `frame_index` (--arg frame_index=8 --arg strength=0.9), several of
        # them (--condition PATH@FRAME:STRENGTH, repeatable), or none (text-to-video): at frame 0 its
        # latents blend into the first latent frames, elsewhere its tokens join the sequence before
        # the video's and are dropped after the last step.
        Variant(
            "LTXConditionPipeline",
            image="image",
            video="video",
            optional=("image", "video"),
            one_of=("image", "video", "conditions"),
            in_list=("video",),
            tiny=build_tiny_condition,
            conditions=Conditions(
                "diffusers.pipelines.ltx.pipeline_ltx_condition.LTXVideoCondition",
                units="video frames; 0 blends into the first latent frames, a later one adds tokens",
                frames="image",
                video="video",
                index="frame_index",
            ),
        ),
        # A long video in temporal windows (`temporal_tile_size`, `temporal_overlap` frames), one
        # prompt per window ("a fox runs | the fox sleeps"), each window a generation of its own
        # whose tokens end with the previous window's tail and the picture's latent frame; every
        # window's generator is seeded from `seed` plus its first frame.
        Variant(
            "LTXI2VLongMultiPromptPipeline", image="cond_image", optional=("image",), seed="seed", tiny=build_tiny_long
        ),
    ),
)
