"""Wan 2.1 family: a video DiT with self-attention over video tokens and cross-attention to UMT5 text.

`build_tiny` makes a seeded, random-weight Wan2.1-T2V-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import BlockList, Family, GenerationDefaults

if TYPE_CHECKING:
    from diffusers import WanPipeline


def build_tiny(seed: int = 0) -> "WanPipeline":
    """A tiny Wan2.1-T2V look-alike: real classes, Wan configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model; 5 frames at 64x64 give 2x8x8 latents, i.e. 32 video tokens after (1, 2, 2)
    patching, cross-attending to the text tokens (512 by default, the pipeline's padding length).
    """
    from accel.models import _tiny_parts as parts  # heavy (transformers): only when building
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = parts.t5_tokenizer()
    text_encoder = parts.umt5_encoder(tokenizer, seed=base + 1)

    z_dim = 16  # Wan 2.1's latent width; the VAE's default latents_mean/std have 16 entries
    with parts.seeded(base + 2):
        transformer = parts.finish(
            WanTransformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=4,
                attention_head_dim=16,
                in_channels=z_dim,
                out_channels=z_dim,
                text_dim=text_encoder.config.d_model,
                freq_dim=32,
                ffn_dim=128,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                eps=1e-6,
                rope_max_seq_len=1024,
            )
        )
    with parts.seeded(base + 3):
        # Wan 2.1's VAE shape: 8x spatial and 4x temporal compression (4k+1 frames -> k+1 latents).
        vae = parts.finish(
            AutoencoderKLWan(
                base_dim=8,
                z_dim=z_dim,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=1,
                attn_scales=[],
                temperal_downsample=[False, True, True],
            )
        )
    # Wan2.1-T2V's diffusers scheduler: UniPC over flow-matching sigmas with a fixed shift.
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000,
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        solver_order=2,
        solver_type="bh2",
        predict_x0=True,
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
        transformer_2=None,
    )


FAMILY = Family(
    name="wan",
    title="Wan 2.1 / 2.2",
    pipeline_class="WanPipeline",
    transformer_class="WanTransformer3DModel",
    repo="Wan-AI/Wan2.1-T2V-14B-Diffusers",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=832, frames=81, guidance_scale=5.0),
    blocks=(BlockList("blocks", returns=("hidden_states",)),),
    transformer_attrs=("transformer", "transformer_2"),  # Wan 2.2: high-noise and low-noise experts
    frames_arg="num_frames",
    fps=16,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
)
