"""CogVideoX family: one block list over separate video and text streams; CFG is batched.

`build_tiny` makes a seeded, random-weight CogVideoX-5b-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import BlockList, Family, GenerationDefaults, ParallelPlan, SequenceSplit, Variant

if TYPE_CHECKING:
    from diffusers import CogVideoXPipeline


def build_tiny(seed: int = 0) -> "CogVideoXPipeline":
    """A tiny CogVideoX-5b look-alike: real classes, CogVideoX configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model, rotary embeddings included; 9 frames at 64x64 give 3x8x8 latents, i.e. 48 video
    tokens after 2x2 patching, next to the text tokens (226 by default, the pipeline's padding length).
    """
    from accel.models import _tiny_parts as parts  # heavy (transformers): only when building
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDPMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = parts.t5_tokenizer()
    text_encoder = parts.t5_encoder(tokenizer, seed=base + 1)

    latent_channels = 16  # CogVideoX's latent width
    temporal_compression = 4
    # The tiny default size in latent units (the real model's 60x90 is 480x720 / 8): at 64x64 the
    # rotary grid equals the base grid, as it does for the real model at 480x720.
    sample_size = 64 // 8
    latent_frames = 3
    with parts.seeded(base + 2):
        transformer = parts.finish(
            CogVideoXTransformer3DModel(
                num_attention_heads=4,
                attention_head_dim=16,
                in_channels=latent_channels,
                out_channels=latent_channels,
                time_embed_dim=32,
                text_embed_dim=text_encoder.config.d_model,
                num_layers=2,
                sample_width=sample_size,
                sample_height=sample_size,
                # In frames, not latent frames, as on the real model (49 frames <-> 13 latent frames).
                sample_frames=(latent_frames - 1) * temporal_compression + 1,
                patch_size=2,
                temporal_compression_ratio=temporal_compression,
                max_text_seq_length=226,
                use_rotary_positional_embeddings=True,  # CogVideoX-5b: the pipeline passes the rope
            )
        )
    with parts.seeded(base + 3):
        # CogVideoX's VAE shape: four levels (8x spatial), 4x temporal compression (8k+1 frames ->
        # 2k+1 latent frames, which the decoder turns back into 8k+1 frames).
        vae = parts.finish(
            AutoencoderKLCogVideoX(
                in_channels=3,
                out_channels=3,
                block_out_channels=(8, 16, 16, 16),
                layers_per_block=1,
                latent_channels=latent_channels,
                norm_num_groups=4,
                temporal_compression_ratio=temporal_compression,
                sample_height=64,
                sample_width=64,
                scaling_factor=0.7,  # CogVideoX-5b's (2b's is 1.15258426)
            )
        )
    # CogVideoX-5b's scheduler config (v-prediction, zero-terminal-SNR betas, no SNR shift), in
    # the DPM variant its model card recommends.
    scheduler = CogVideoXDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=0,
        prediction_type="v_prediction",
        timestep_spacing="trailing",
        rescale_betas_zero_snr=True,
        snr_shift_scale=1.0,
    )
    return CogVideoXPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )


FAMILY = Family(
    name="cogvideox",
    title="CogVideoX",
    pipeline_class="CogVideoXPipeline",
    transformer_class="CogVideoXTransformer3DModel",
    vae="AutoencoderKLCogVideoX",
    repo="THUDM/CogVideoX-5b",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=720, frames=49, guidance_scale=6.0),
    blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
    frames_arg="num_frames",
    fps=8,
    heads=48,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=9, guidance_scale=6.0),
    # The patch embedding runs on the whole text + video sequence; both streams are cut where the
    # blocks start, and the pipeline's rotary embedding (video tokens only) with the video.
    parallel=ParallelPlan(
        splits=(
            SequenceSplit("image_rotary_emb", "video", dim=0),
            SequenceSplit("hidden_states", "video", dim=1, module="transformer_blocks.0"),
            SequenceSplit("encoder_hidden_states", "text", dim=1, module="transformer_blocks.0"),
        ),
        attention_keys=("text", "video"),
        output_stream="video",
        output_dim=1,
        output_module="proj_out",
        batch_args=("hidden_states", "encoder_hidden_states", "timestep", "timestep_cond", "ofs"),
    ),
    cfg="batch",
    # Video-to-video noises the input clip's latents (its frame count sets the output's): the same
    # transformer call, the same plan.
    variants=(Variant("CogVideoXVideoToVideoPipeline", video="video"),),
)
