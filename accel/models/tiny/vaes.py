"""Narrowed VAEs of real shapes that several tiny families decode with."""

from __future__ import annotations

from typing import Any


def flux1_vae() -> Any:
    """FLUX.1's VAE shape, narrowed: four levels (8x downsampling), 16 latent channels, no quant
    convs. FLUX.1 and Z-Image decode with it. Build it inside `seeded`."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    )


def hunyuan_video_vae() -> Any:
    """HunyuanVideo's 3D VAE shape, narrowed: 8x spatial and 4x temporal compression (4k+1 frames ->
    k+1 latents), 16 latent channels. HunyuanVideo and Kandinsky 5 decode with it. Build it inside `seeded`."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )
