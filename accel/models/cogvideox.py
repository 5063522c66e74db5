"""CogVideoX family: one block list over separate video and text streams; CFG is batched.

`build_tiny` makes a seeded, random-weight CogVideoX-5b-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import NamedInput, Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    ParallelPlan,
    SELF_ATTENTION,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import CogVideoXFunControlPipeline, CogVideoXImageToVideoPipeline, CogVideoXPipeline


_LATENT_CHANNELS = 16  # CogVideoX's latent width
_TEMPORAL_COMPRESSION = 4


def _tiny_transformer(seed: int, text_dim: int, **config: Any) -> Any:
    """CogVideoX-5b's transformer scaled down to two blocks of four 16-wide heads; `config` overrides.

    The default sample size is the tiny default size in latent units (the real model's 60x90 is
    480x720 / 8): at 64x64 the rotary grid equals the base grid, as it does for the real model at 480x720.
    """
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import CogVideoXTransformer3DModel

    latent_frames = 3
    settings: dict[str, Any] = dict(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        time_embed_dim=32,
        text_embed_dim=text_dim,
        num_layers=2,
        sample_width=64 // 8,
        sample_height=64 // 8,
        # In frames, not latent frames, as on the real model (49 frames <-> 13 latent frames).
        sample_frames=(latent_frames - 1) * _TEMPORAL_COMPRESSION + 1,
        patch_size=2,
        temporal_compression_ratio=_TEMPORAL_COMPRESSION,
        max_text_seq_length=226,
        use_rotary_positional_embeddings=True,  # CogVideoX-5b: the pipeline passes the rope
    )
    with seeded(seed):
        return finish(CogVideoXTransformer3DModel(**{**settings, **config}))


def build_tiny(seed: int = 0) -> "CogVideoXPipeline":
    """A tiny CogVideoX-5b look-alike: real classes, CogVideoX configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model, rotary embeddings included; 9 frames at 64x64 give 3x8x8 latents, i.e. 48 video
    tokens after 2x2 patching, next to the text tokens (226 by default, the pipeline's padding length).
    """
    from accel.models.tiny.seeding import finish, seeded  # heavy (transformers): only when building
    from accel.models.tiny.t5 import t5_encoder, t5_tokenizer
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDPMScheduler,
        CogVideoXPipeline,
    )

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    # Offsets: 1 text encoder, 2 transformer, 3 VAE, 4 build_tiny_i2v's transformer, 5 build_tiny_fun_control's.
    base = seed * 8
    tokenizer = t5_tokenizer()
    text_encoder = t5_encoder(tokenizer, seed=base + 1)

    transformer = _tiny_transformer(base + 2, text_dim=text_encoder.config.d_model)
    with seeded(base + 3):
        # CogVideoX's VAE shape: four levels (8x spatial), 4x temporal compression (8k+1 frames ->
        # 2k+1 latent frames, which the decoder turns back into 8k+1 frames).
        vae = finish(
            AutoencoderKLCogVideoX(
                in_channels=3,
                out_channels=3,
                block_out_channels=(8, 16, 16, 16),
                layers_per_block=1,
                latent_channels=_LATENT_CHANNELS,
                norm_num_groups=4,
                temporal_compression_ratio=_TEMPORAL_COMPRESSION,
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


def build_tiny_i2v(seed: int = 0) -> "CogVideoXImageToVideoPipeline":
    """A tiny CogVideoX1.5-5B-I2V look-alike: build_tiny's text stack, VAE and scheduler, another transformer.

    As in the real I2V models, the transformer reads 32 channels: the 16 noise latents and the
    input picture's latents followed by zero frames. It has CogVideoX 1.5's shape: latent frames
    patched in pairs (`patch_size_t=2`; the pipeline pads an odd latent frame count by repeating
    the picture's frame), an `ofs` embedding added to the time embedding, rotary positions over a
    grid sliced from the sample size (16x16 latents here: up to 8x8 patches), no learned
    positions. CogVideoX-5b-I2V's learned positions are added in the patch embedding, before the
    plan cuts the sequence, so they change nothing here (a 5b-I2V-shaped tiny with random learned
    positions equals one process within 6e-6 under Ulysses 2 and Ring 2, checked by hand), but
    they hold the size to the sample size, which the odd-size tests cannot keep.
    """
    from diffusers import CogVideoXImageToVideoPipeline

    pipe = build_tiny(seed)
    transformer = _tiny_transformer(
        seed * 8 + 4,
        text_dim=pipe.text_encoder.config.d_model,
        in_channels=2 * _LATENT_CHANNELS,  # noise + picture latents
        sample_width=16,
        sample_height=16,
        patch_size_t=2,
        ofs_embed_dim=32,  # the time embedding's width, to which it is added (512 and 512 on the real one)
        use_learned_positional_embeddings=False,
        patch_bias=False,
    )
    return CogVideoXImageToVideoPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=transformer,
        scheduler=pipe.scheduler,
    )


def build_tiny_fun_control(seed: int = 0) -> "CogVideoXFunControlPipeline":
    """A tiny CogVideoX-Fun-V1.1-5b-Control look-alike: build_tiny's parts and a transformer reading
    32 channels, the noise latents and the control video's, concatenated frame by frame. Its
    pipeline steps a DDIM-style scheduler (the Fun checkpoints ship CogVideoXDDIMScheduler): the
    family's scheduler config in that class."""
    from diffusers import CogVideoXDDIMScheduler, CogVideoXFunControlPipeline

    pipe = build_tiny(seed)
    transformer = _tiny_transformer(
        seed * 8 + 5, text_dim=pipe.text_encoder.config.d_model, in_channels=2 * _LATENT_CHANNELS
    )
    return CogVideoXFunControlPipeline(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler.from_config(pipe.scheduler.config),
    )


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn1", SELF_ATTENTION),
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
    },
    per_rank=("heads",),
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
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
        # The patch embedding runs on the whole text + video sequence; both streams are cut where the
        # blocks start, and the pipeline's rotary embedding (video tokens only) with the video.
        tensor=TENSOR_PLAN,
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
    ),
    frames_arg="num_frames",
    fps=8,
    heads=48,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=9, guidance_scale=6.0),
    # Video-to-video noises the input clip's latents (its frame count sets the output's): the same
    # transformer call, the same plan.
    variants=(
        Variant("CogVideoXVideoToVideoPipeline", video="video"),
        # Image-to-video concatenates the picture's latents in channels: the same token count and plan.
        Variant("CogVideoXImageToVideoPipeline", image="image", tiny=build_tiny_i2v),
        # CogVideoX-Fun's control video (poses, depth, edges) is encoded and concatenated in channels
        # as I2V's picture is: the same tokens; its length is the output's.
        Variant(
            "CogVideoXFunControlPipeline", inputs=(NamedInput("control_video", "video"),), tiny=build_tiny_fun_control
        ),
    ),
)
