"""Stable Diffusion 3.5 family: an MMDiT (joint attention over image then text) with two CLIP text
towers and T5; SD 3.5 medium adds a second, image-only attention in its first blocks.

`build_tiny` makes a seeded, random-weight SD-3.5-large-shaped pipeline offline for tests;
`build_tiny_medium` the medium shape, with its dual-attention blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import img2img_and_inpaint
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    JOINT_ATTENTION,
    ParallelPlan,
    SELF_ATTENTION,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import StableDiffusion3Pipeline

_LATENT_CHANNELS = 16


def build_tiny(
    seed: int = 0, pipeline: str = "StableDiffusion3Pipeline", **transformer: Any
) -> "StableDiffusion3Pipeline":
    """A tiny SD 3.5 large look-alike: real classes, configs scaled down, random seeded weights.

    Two joint blocks (the last one, as on the real model, keeps no text output) of four 16-wide
    heads with RMS q/k norms; 64x64 images give 8x8 latents, 4x4 = 16 image tokens after 2x2
    patches, next to 77 CLIP tokens and 256 T5 tokens (333 text tokens). The CLIP features (two
    towers of 32) are padded to T5's width, 64, as the pipeline pads 2048 to 4096.
    """
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from accel.models.tiny.clip import CLIP_HIDDEN, clip_text_model, clip_tokenizer
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.t5 import t5_encoder, t5_tokenizer

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer, tokenizer_2, tokenizer_3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    text_encoder = clip_text_model(tokenizer, seed=base + 1, projection=True)
    text_encoder_2 = clip_text_model(tokenizer_2, seed=base + 2, projection=True)
    text_encoder_3 = t5_encoder(tokenizer_3, seed=base + 3, hidden=2 * CLIP_HIDDEN)
    settings: dict[str, Any] = dict(
        sample_size=8,
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=text_encoder_3.config.d_model,
        caption_projection_dim=64,
        pooled_projection_dim=2 * CLIP_HIDDEN,
        pos_embed_max_size=16,
        qk_norm="rms_norm",
    )
    with seeded(base + 4):
        model = finish(SD3Transformer2DModel(**{**settings, **transformer}))
    with seeded(base + 5):
        # SD3's VAE shape: four levels (8x downsampling), 16 latent channels, no quant convs.
        vae = finish(
            AutoencoderKL(
                in_channels=3,
                out_channels=3,
                down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4,
                block_out_channels=(8, 16, 16, 16),
                layers_per_block=1,
                latent_channels=_LATENT_CHANNELS,
                norm_num_groups=4,
                sample_size=64,
                scaling_factor=1.5305,
                shift_factor=0.0609,
                use_quant_conv=False,
                use_post_quant_conv=False,
            )
        )
    return getattr(diffusers, pipeline)(
        transformer=model,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),  # SD 3.5's scheduler
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def build_tiny_medium(seed: int = 0) -> "StableDiffusion3Pipeline":
    """SD 3.5 medium's shape: its first block runs a second attention (`attn2`) on the image alone."""
    return build_tiny(seed, dual_attention_layers=(0,))


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn", JOINT_ATTENTION),
        **split_layers("transformer_blocks.*.attn2", SELF_ATTENTION),  # SD 3.5 medium's second attention
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
        **split_layers("transformer_blocks.*.ff_context", DIFFUSERS_MLP),  # not in the last block
    },
    per_rank=("heads",),
)


FAMILY = Family(
    name="sd3",
    title="Stable Diffusion 3.5",
    pipeline_class="StableDiffusion3Pipeline",
    transformer_class="SD3Transformer2DModel",
    vae="AutoencoderKL",
    repo="stabilityai/stable-diffusion-3.5-large",
    output="image",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=28, height=1024, width=1024, guidance_scale=3.5),
    size_step=16,
    acceleration=Acceleration(
        # The last block keeps no text output (context_pre_only): its skipped call passes the text on,
        # which the transformer drops.
        blocks=(BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),),
        # diffusers has no _cp_plan for SD3: image tokens (after patch embedding, with their position
        # embedding added) and text tokens are cut at the first block; every joint attention is over
        # (image, text); medium's attn2 over the image alone; the output is gathered at proj_out. The
        # ControlNet pipelines pass per-block residuals of the image tokens (a list, added after each
        # block but the last), cut as the image; they carry the batched CFG branches too.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("hidden_states", "image", dim=1, module="transformer_blocks.0"),
                SequenceSplit("encoder_hidden_states", "text", dim=1, module="transformer_blocks.0"),
                SequenceSplit("block_controlnet_hidden_states", "image", dim=1),
            ),
            attention_keys=("image", "text"),
            output_stream="image",
            output_dim=1,
            output_module="proj_out",
            module_keys=(("transformer_blocks.*.attn2", ("image",)),),
            batch_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
            batch_items=("block_controlnet_hidden_states",),
        ),
        # The pipeline batches the negative and positive prompts into one transformer call.
        cfg="batch",
    ),
    heads=38,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=3.5),
    variants=(*img2img_and_inpaint("StableDiffusion3Pipeline", "StableDiffusion3"),),
)
