"""LTX-2's tiny, seeded, random-weight pipelines, built offline for tests: the plain pipeline and
LTX-2.5's DFR pass and temporal refine round (accel/models/ltx2.py lists them as the family's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.ltx2_refine import ancestral_scheduler

if TYPE_CHECKING:
    from diffusers import LTX2DFRPipeline, LTX2DFRTemporalRefinePipeline, LTX2Pipeline


_LATENT_CHANNELS = 16
_AUDIO_LATENT_CHANNELS = 2
_MEL_BINS = 16  # the audio VAE compresses them 4x: 4 latent bins, 2 x 4 = 8 channels per audio token


def _components(seed: int, keyframes: bool = False) -> dict[str, Any]:
    """Every component of the tiny pipeline, each from its own seed. `keyframes`: LTX-2.5's learned
    marker of single-pixel-frame tokens (DFR's keyframe slots), seeded apart so the other weights
    stay those of the plain tiny transformer."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    from accel.models.tiny.gemma import gemma3_model, gemma3_tokenizer
    from accel.models.tiny.seeding import finish, seeded

    base = seed * 8
    tokenizer = gemma3_tokenizer()
    text_encoder = gemma3_model(tokenizer, seed=base + 1)
    text = text_encoder.config.text_config
    with seeded(base + 2):
        transformer = finish(
            LTX2VideoTransformer3DModel(
                in_channels=_LATENT_CHANNELS,
                out_channels=_LATENT_CHANNELS,
                num_attention_heads=4,
                attention_head_dim=16,
                cross_attention_dim=64,
                audio_in_channels=_AUDIO_LATENT_CHANNELS * _MEL_BINS // 4,
                audio_out_channels=_AUDIO_LATENT_CHANNELS * _MEL_BINS // 4,
                audio_num_attention_heads=4,
                audio_attention_head_dim=8,
                audio_cross_attention_dim=32,
                num_layers=2,
                caption_channels=text.hidden_size,
                rope_type="split",  # LTX-2's: per-head (cos, sin) tables, tokens on dim 2
                use_keyframes_abs_pos_embedding=keyframes,
            )
        )
    if keyframes:
        with seeded(base + 7):  # built as zeros: random, so the marked tokens differ from the rest
            transformer.keyframes_abs_pos_embedding.data.normal_(std=0.5)
    with seeded(base + 3):
        # The text encoder's every hidden state (embeddings + 2 layers) is stacked and projected.
        connectors = finish(
            LTX2TextConnectors(
                caption_channels=text.hidden_size,
                text_proj_in_factor=text.num_hidden_layers + 1,
                video_connector_num_attention_heads=2,
                video_connector_attention_head_dim=8,
                video_connector_num_layers=1,
                video_connector_num_learnable_registers=None,
                audio_connector_num_attention_heads=2,
                audio_connector_attention_head_dim=8,
                audio_connector_num_layers=1,
                audio_connector_num_learnable_registers=None,
                connector_rope_base_seq_len=1024,
                rope_type="split",
            )
        )
    with seeded(base + 4):
        # LTX-2's compression: 4x4 patching then three 2x stages, 32x in space and 8x in time
        # (8k+1 frames -> k+1 latent frames); channels narrowed.
        vae = finish(
            AutoencoderKLLTX2Video(
                latent_channels=_LATENT_CHANNELS,
                block_out_channels=(8, 16, 16, 16),
                decoder_block_out_channels=(8, 16, 32),
                layers_per_block=(1, 1, 1, 1, 1),
                decoder_layers_per_block=(1, 1, 1, 1),
                spatial_compression_ratio=32,
                temporal_compression_ratio=8,
            )
        )
    with seeded(base + 5):
        audio_vae = finish(
            AutoencoderKLLTX2Audio(
                base_channels=8,
                ch_mult=(1, 2, 4),
                num_res_blocks=1,
                latent_channels=_AUDIO_LATENT_CHANNELS,
                mel_bins=_MEL_BINS,
            )
        )
    with seeded(base + 6):
        # As LTX-2's vocoder: 100 mel frames a second (16 kHz, hop 160) upsampled 240x to 24 kHz stereo.
        vocoder = finish(
            LTX2Vocoder(
                in_channels=2 * _MEL_BINS,
                hidden_channels=32,
                out_channels=2,
                upsample_kernel_sizes=[12, 10, 4, 4, 4],
                upsample_factors=[6, 5, 2, 2, 2],
                resnet_kernel_sizes=[3],
                resnet_dilations=[[1, 3]],
                output_sampling_rate=24000,
            )
        )
    # LTX-2's scheduler config: the shift grows with the video token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


def build_tiny(seed: int = 0) -> "LTX2Pipeline":
    """A tiny LTX-2 look-alike: real classes, LTX-2 configs scaled down, random seeded weights.

    Two blocks with four video heads of 16 and four audio heads of 8. 9 frames at 64x96 give 2x2x3
    = 12 video tokens; their 0.375 s of sound give 9 audio tokens (25 a second). The Gemma 3
    stand-in encodes the prompt padded on the left to the pipeline's 1024 tokens. Guidance is
    batched (negative then positive); with the pipeline's default scales each step also runs a
    spatio-temporal-guidance and a modality-isolation call on the positive prompt alone.
    """
    from diffusers import LTX2Pipeline

    return LTX2Pipeline(**_components(seed))


def build_tiny_dfr(seed: int = 0) -> "LTX2DFRPipeline":
    """The tiny pipeline as LTX-2.5's DFR pass: a transformer with the keyframe marker, and a
    scheduler that takes the distilled sigmas as given (DFR passes no shift `mu`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2DFRPipeline

    return LTX2DFRPipeline(**dict(_components(seed, keyframes=True), scheduler=FlowMatchEulerDiscreteScheduler()))


def tiny_temporal_upsampler(seed: int = 0) -> Any:
    """A seeded LTX2LatentUpsamplerModel doubling the latent frames (2F - 1), at the tiny channels."""
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplerModel

    from accel.models.tiny.seeding import finish, seeded

    with seeded(seed * 8 + 8):
        return finish(
            LTX2LatentUpsamplerModel(
                in_channels=_LATENT_CHANNELS,
                mid_channels=32,
                num_blocks_per_stage=1,
                dims=3,
                spatial_upsample=False,
                temporal_upsample=True,
            )
        )


def build_tiny_dfr_refine(seed: int = 0) -> "LTX2DFRTemporalRefinePipeline":
    """The DFR pass's components as its temporal refine round: a tiny temporal upsampler and the
    ancestral scheduler the round requires (eta 0.5, as diffusers' example builds it)."""
    from diffusers import LTX2DFRTemporalRefinePipeline

    components = dict(_components(seed, keyframes=True), scheduler=ancestral_scheduler())
    return LTX2DFRTemporalRefinePipeline(**components, temporal_latent_upsampler=tiny_temporal_upsampler(seed))
