"""First Block Cache on tiny instances of every registered family's real diffusers transformer.

`tests/test_fbcache.py` checks the engine on toy transformers; this checks the data each family
gives it. A family's `blocks=` plan names the block lists and what each block returns, in order:
if a name or the order were wrong, a cached call would hand the transformer its streams swapped
or mis-shaped. Each transformer here is the real class from a small config (seeded, float32,
two or more blocks in every list, two heads), called directly with random inputs of the shapes
its pipeline passes.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from accel.cache.fbcache import FirstBlockCache  # noqa: E402
from accel.models.base import BlockList  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402

HEADS = 2
HEAD_DIM = 16
TEXT_TOKENS = 8  # differs from every family's video/image token count, so swapped streams mis-shape
TEXT_DIM = 32

Inputs = dict[str, Any]

# MochiRoPE enters a float32 CPU autocast region, which torch warns about and skips; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Build a module with seeded float32 weights, leaving the caller's RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().float().eval()


def _noise(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _latents(shape: tuple[int, ...], drift: float) -> torch.Tensor:
    """Fixed latents plus `drift` times a fixed direction, as latents move between denoising steps."""
    generator = torch.Generator().manual_seed(0)
    base = _noise(generator, *shape)
    direction = _noise(generator, *shape)
    return base + drift * direction


def _text(seed: int = 1) -> torch.Tensor:
    return _noise(torch.Generator().manual_seed(seed), 1, TEXT_TOKENS, TEXT_DIM)


def _text_mask() -> torch.Tensor:
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    mask[:, -2:] = 0  # padded prompt tokens, as the pipelines pass them
    return mask


# -- flux: 2 double-stream + 2 single-stream blocks, 4x4 packed latents (16 tokens) ---------------
def build_flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return _seeded(
        10,
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=TEXT_DIM,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def flux_inputs(drift: float) -> Inputs:
    side = 4
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
    return dict(
        hidden_states=_latents((1, side * side, 16), drift),
        encoder_hidden_states=_text(),
        pooled_projections=_noise(torch.Generator().manual_seed(2), 1, TEXT_DIM),
        timestep=torch.tensor([0.7 - drift]),  # the pipeline passes sigmas (t / 1000)
        img_ids=img_ids,
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
        guidance=torch.tensor([3.5]),
        return_dict=False,
    )


# -- wan: 2 blocks, 2 latent frames of 8x8, (1, 2, 2) patches (32 tokens) -------------------------
def build_wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return _seeded(
        11,
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
        ),
    )


def wan_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        return_dict=False,
    )


def _wan_shaped(cls: str, seed: int, **extra: Any) -> nn.Module:
    """A transformer class of Wan 2.1's shape (SkyReels-V2's, ChronoEdit's) at build_wan's sizes; `extra` adds
    settings."""
    import diffusers

    return _seeded(
        seed,
        lambda: getattr(diffusers, cls)(
            patch_size=(1, 2, 2),
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
            **extra,
        ),
    )


# -- skyreels2: Wan's shape; diffusion forcing's one timestep per latent frame (per-token modulation) --
def build_skyreels2() -> nn.Module:
    return _wan_shaped("SkyReelsV2Transformer3DModel", 22)


def skyreels2_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([[700.0 - 1000 * drift, 900.0 - 1000 * drift]]),  # one per latent frame
        encoder_hidden_states=_text(),
        enable_diffusion_forcing=True,
        return_dict=False,
    )


# -- hunyuan: 2 double-stream + 2 single-stream blocks, 2 latent frames of 8x8 (32 tokens) --------
def build_hunyuan() -> nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    return _seeded(
        12,
        lambda: HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=TEXT_DIM,
            pooled_projection_dim=16,
            rope_axes_dim=(4, 6, 6),
        ),
    )


def hunyuan_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        encoder_attention_mask=_text_mask(),
        pooled_projections=_noise(torch.Generator().manual_seed(2), 1, 16),
        guidance=torch.tensor([6000.0]),  # the pipeline passes guidance_scale * 1000
        return_dict=False,
    )


# -- cogvideox: 2 blocks, 2 latent frames of 8x8, 2x2 patches (32 tokens), sin-cos positions ------
def build_cogvideox() -> nn.Module:
    from diffusers import CogVideoXTransformer3DModel

    return _seeded(
        13,
        lambda: CogVideoXTransformer3DModel(
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=TEXT_DIM,
            num_layers=2,
            sample_width=8,
            sample_height=8,
            sample_frames=5,  # 2 latent frames after 4x temporal compression
            patch_size=2,
            temporal_compression_ratio=4,
            max_text_seq_length=TEXT_TOKENS,
        ),
    )


def cogvideox_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 2, 4, 8, 8), drift),  # (batch, frames, channels, height, width)
        encoder_hidden_states=_text(),
        timestep=torch.tensor([700 - int(1000 * drift)]),
        return_dict=False,
    )


# -- mochi: 2 blocks (the last is context_pre_only), 2 latent frames of 8x8, 2x2 patches ----------
def build_mochi() -> nn.Module:
    from diffusers import MochiTransformer3DModel

    return _seeded(
        14,
        lambda: MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=4,
            text_embed_dim=TEXT_DIM,
            time_embed_dim=32,
            max_sequence_length=TEXT_TOKENS,
        ),
    )


def mochi_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        encoder_hidden_states=_text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=_text_mask(),
        return_dict=False,
    )


# -- ltx: 2 blocks, 2 latent frames of 4x4 patchified by the pipeline (32 tokens) ----------------
def build_ltx() -> nn.Module:
    from diffusers import LTXVideoTransformer3DModel

    return _seeded(
        15,
        lambda: LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            cross_attention_dim=HEADS * HEAD_DIM,
            num_layers=2,
            caption_channels=TEXT_DIM,
        ),
    )


def ltx_inputs(drift: float) -> Inputs:
    frames, height, width = 2, 4, 4
    return dict(
        hidden_states=_latents((1, frames * height * width, 8), drift),
        encoder_hidden_states=_text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=_text_mask(),
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(20 / 25, 32, 32),
        return_dict=False,
    )


# -- qwenimage: 2 double-stream blocks, 4x4 packed image tokens next to TEXT_TOKENS -----------------
def build_qwenimage() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return _seeded(
        16,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def qwenimage_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 16, 16), drift),
        encoder_hidden_states=_text(),
        encoder_hidden_states_mask=_text_mask(),
        timestep=torch.tensor([0.7 - drift]),
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )


# -- flux2-klein: 2 double and 2 single blocks, 4x4 image tokens with 4-axis ids ------------------------
def build_flux2() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return _seeded(
        17,
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        ),
    )


def flux2_inputs(drift: float) -> Inputs:
    grid = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), torch.zeros(1), indexing="ij"), -1
    )
    text = torch.stack([torch.zeros(TEXT_TOKENS)] * 3 + [torch.arange(float(TEXT_TOKENS))], -1)
    return dict(
        hidden_states=_latents((1, 16, 16), drift),
        encoder_hidden_states=_text(),
        timestep=torch.tensor([0.7 - drift]),
        img_ids=grid.reshape(1, 16, 4),
        txt_ids=text[None],
        return_dict=False,
    )


# -- flux2 (dev): the same transformer with the guidance embedding of a guidance-distilled model --------
def build_flux2_dev() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return _seeded(
        19,
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        ),
    )


def flux2_dev_inputs(drift: float) -> Inputs:
    return dict(flux2_inputs(drift), guidance=torch.tensor([4.0]))


# -- sd3: 2 joint blocks (the last keeps no text output) on 4x4 patches; medium's attn2 in block 0 -----
def build_sd3() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return _seeded(
        18,
        lambda: SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=HEADS * HEAD_DIM,
            pooled_projection_dim=16,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        ),
    )


def sd3_inputs(drift: float) -> Inputs:
    return dict(
        hidden_states=_latents((1, 4, 8, 8), drift),
        encoder_hidden_states=_text(),
        pooled_projections=_noise(torch.Generator().manual_seed(2), 1, 16),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        return_dict=False,
    )


# -- zimage: 2 refiner blocks of each kind, then 2 main layers on the unified (image, caption) sequence --
def build_zimage() -> nn.Module:
    from diffusers import ZImageTransformer2DModel

    return _seeded(
        20,
        lambda: ZImageTransformer2DModel(
            in_channels=4,
            dim=HEADS * HEAD_DIM,
            n_layers=2,
            n_refiner_layers=2,
            n_heads=HEADS,
            n_kv_heads=HEADS,
            cap_feat_dim=TEXT_DIM,
            axes_dims=[4, 6, 6],
        ),
    )


def zimage_inputs(drift: float) -> Inputs:
    # Lists with one tensor per sample: (C, F, H, W) latents (4x4 patches) and (tokens, dim) caption features.
    return dict(
        x=[_latents((4, 1, 8, 8), drift)],
        t=torch.tensor([0.3 + drift]),
        cap_feats=[_text()[0]],
        return_dict=False,
    )


# -- qwenimage21: 2 single-stream blocks over the joint sequence (8 text tokens, then 16 target tokens) --
def build_qwenimage21() -> nn.Module:
    from diffusers import QwenImage21Transformer2DModel

    return _seeded(
        22,
        lambda: QwenImage21Transformer2DModel(
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            context_in_dim=TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def qwenimage21_inputs(drift: float) -> Inputs:
    # Unpatched 4x4 target latents; the encoder's mask holds one slot per 2x2 of them after the text.
    slots = torch.cat([torch.zeros(1, TEXT_TOKENS, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)], dim=1)
    return dict(
        hidden_states=_latents((1, 16, 4), drift),
        encoder_hidden_states=_text(),
        timestep=torch.tensor([0.7 - drift]),
        img_shapes=[[(1, 4, 4)]],
        img_mask=slots,
        return_dict=False,
    )


# -- hunyuan15: 2 double-stream blocks, 2 latent frames of 4x4 (32 tokens, patch 1), a joint text stream --
def build_hunyuan15() -> nn.Module:
    from diffusers import HunyuanVideo15Transformer3DModel

    return _seeded(
        21,
        lambda: HunyuanVideo15Transformer3DModel(
            in_channels=9,
            out_channels=4,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            num_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            text_embed_2_dim=16,
            image_embed_dim=16,
            rope_axes_dim=(4, 6, 6),
        ),
    )


def hunyuan15_inputs(drift: float) -> Inputs:
    # The text stream the transformer joins: 3 image tokens (zero: text-to-video, masked), 4 glyph and 8 prompt tokens.
    return dict(
        hidden_states=_latents((1, 9, 2, 4, 4), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        encoder_attention_mask=_text_mask(),
        encoder_hidden_states_2=_noise(torch.Generator().manual_seed(2), 1, 4, 16),
        encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]]),
        image_embeds=torch.zeros(1, 3, 16),
        return_dict=False,
    )


# -- kandinsky5: 2 text blocks, then 2 visual blocks over 2x4x4 = 32 video tokens (the cache's) --
def build_kandinsky5() -> nn.Module:
    from diffusers import Kandinsky5Transformer3DModel

    from accel.models.kandinsky5 import random_modulation

    def build() -> nn.Module:
        model = Kandinsky5Transformer3DModel(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=TEXT_DIM,
            in_text_dim2=16,
            time_dim=32,
            model_dim=HEADS * HEAD_DIM,
            ff_dim=64,
            num_text_blocks=2,
            num_visual_blocks=2,
            axes_dims=(4, 6, 6),
        )
        random_modulation(model)  # diffusers zeroes it: every block would be an identity
        return model

    return _seeded(21, build)


def kandinsky5_inputs(drift: float) -> Inputs:
    # (B, frames, H, W, C) latents; the rotary positions the pipeline builds from the latent grid.
    return dict(
        hidden_states=_latents((1, 2, 8, 8, 4), drift),
        encoder_hidden_states=_text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        pooled_projections=_noise(torch.Generator().manual_seed(2), 1, 16),
        visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
        text_rope_pos=torch.arange(TEXT_TOKENS),
        return_dict=False,
    )


# -- ltx2: 2 blocks that return (video, audio); 32 video tokens, 5 audio tokens --------------------
def build_ltx2() -> nn.Module:
    from diffusers import LTX2VideoTransformer3DModel

    return _seeded(
        22,
        lambda: LTX2VideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            cross_attention_dim=HEADS * HEAD_DIM,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=HEADS,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            caption_channels=TEXT_DIM,
            rope_type="split",
        ),
    )


def ltx2_inputs(drift: float) -> Inputs:
    frames, height, width, audio = 2, 4, 4, 5
    return dict(
        hidden_states=_latents((1, frames * height * width, 8), drift),
        audio_hidden_states=_latents((1, audio, 4), drift),
        encoder_hidden_states=_text(),
        audio_encoder_hidden_states=_text(3),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=_text_mask(),
        audio_encoder_attention_mask=_text_mask(),
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio,
        return_dict=False,
    )


# -- chronoedit: Wan's blocks, the picture's CLIP tokens before the text (own key and value projections) --
def build_chronoedit() -> nn.Module:
    return _wan_shaped("ChronoEditTransformer3DModel", 23, image_dim=16, added_kv_proj_dim=HEADS * HEAD_DIM)


def chronoedit_inputs(drift: float) -> Inputs:
    # 2 latent frames: the rotary table puts the second 7 frames after the first, as for a 5-frame edit.
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        encoder_hidden_states_image=_noise(torch.Generator().manual_seed(2), 1, 5, 16),
        return_dict=False,
    )


# -- hunyuanimage: 2 double-stream + 2 single-stream blocks, 4x4 latents (16 tokens, patch 1), 8 prompt and 4 glyph
# tokens --
def build_hunyuanimage() -> nn.Module:
    from diffusers import HunyuanImageTransformer2DModel

    return _seeded(
        23,
        lambda: HunyuanImageTransformer2DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=TEXT_DIM,
            text_embed_2_dim=16,
            rope_axes_dim=(8, 8),
        ),
    )


def hunyuanimage_inputs(drift: float) -> Inputs:
    # The forward joins the glyph tokens and the prompt tokens, valid ones first, into one text stream.
    return dict(
        hidden_states=_latents((1, 4, 4, 4), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        encoder_attention_mask=_text_mask(),
        encoder_hidden_states_2=_noise(torch.Generator().manual_seed(2), 1, 4, 16),
        encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]]),
        return_dict=False,
    )


# -- helios: Wan's shape; 2 chunk latent frames of 8x8 (32 tokens) after 37 history tokens ------------
def build_helios() -> nn.Module:
    from diffusers import HeliosTransformer3DModel

    return _seeded(
        23,
        lambda: HeliosTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_dim=(4, 6, 6),
        ),
    )


def helios_inputs(drift: float) -> Inputs:
    """The pipeline's layout with history sizes (4, 2, 1) over 8x8 latents: the first frame's slot and
    the last frame at 2x2 patches (32 tokens), two frames at 4x4 over two frames (4), four at 8x8
    over four (1), in front of the chunk's tokens."""
    generator = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=_latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=_text(),
        indices_hidden_states=torch.tensor([[8, 9]]),
        indices_latents_history_short=torch.tensor([[0, 7]]),
        indices_latents_history_mid=torch.tensor([[5, 6]]),
        indices_latents_history_long=torch.tensor([[1, 2, 3, 4]]),
        latents_history_short=_noise(generator, 1, 4, 2, 8, 8),
        latents_history_mid=_noise(generator, 1, 4, 2, 8, 8),
        latents_history_long=_noise(generator, 1, 4, 4, 8, 8),
        return_dict=False,
    )


# -- cosmos3: 2 decoder layers over the text (8 token ids, causal) and the generation stream (12 video
# patches of 2 latent frames at 4x6, then 3 sound latents), each layer returning both --------------
def build_cosmos3() -> nn.Module:
    from diffusers import Cosmos3OmniTransformer

    return _seeded(
        24,
        lambda: Cosmos3OmniTransformer(
            head_dim=HEAD_DIM,
            hidden_size=TEXT_DIM,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            latent_channel=4,
            patch_latent_dim=16,
            vocab_size=64,
            rope_axes_dim=(4, 2, 2),
            sound_gen=True,
            sound_dim=4,
        ),
    )


def cosmos3_inputs(drift: float) -> Inputs:
    """One sample packed as the pipeline packs it: token ids first, then the video's patches, then the sound."""
    text, video, sound = TEXT_TOKENS, 12, 3
    video_at, sound_at = torch.arange(text, text + video), torch.arange(text + video, text + video + sound)
    return dict(
        input_ids=torch.arange(text) * 7 % 64,
        text_indexes=torch.arange(text),
        und_len=text,
        sequence_length=text + video + sound,
        position_ids=torch.arange(text + video + sound, dtype=torch.float32).expand(3, -1),
        vision_tokens=[_latents((1, 4, 2, 4, 6), drift)],
        vision_token_shapes=[(2, 2, 3)],
        vision_sequence_indexes=video_at,
        vision_mse_loss_indexes=video_at,
        vision_timesteps=torch.full((video,), 700.0 - 1000 * drift),
        vision_noisy_frame_indexes=[torch.arange(2)],
        sound_tokens=[_noise(torch.Generator().manual_seed(3), 4, sound)],
        sound_token_shapes=[(sound, 1, 1)],
        sound_sequence_indexes=sound_at,
        sound_mse_loss_indexes=sound_at,
        sound_timesteps=torch.full((sound,), 700.0 - 1000 * drift),
        sound_noisy_frame_indexes=[torch.arange(sound)],
        return_dict=False,
    )


# -- kandinsky6: 2 text blocks per stream, then 2 fused blocks returning (video, audio); 32 video, 5 audio tokens --
def build_kandinsky6() -> nn.Module:
    from diffusers import Kandinsky6Transformer3DModel

    from accel.models.kandinsky6 import random_modulation

    def build() -> nn.Module:
        # The released checkpoints' switches; the audio heads as wide as the video's (the cross-modal rotary tables need
        # it).
        model = Kandinsky6Transformer3DModel(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=TEXT_DIM,
            in_text_dim2=16,
            time_dim=32,
            model_dim=HEADS * HEAD_DIM,
            ff_dim=64,
            num_text_blocks=2,
            num_visual_blocks=2,
            axes_dims=(4, 6, 6),
            in_audio_dim=4,
            out_audio_dim=4,
            text_token_padding=True,
            ca_rope=True,
            cross_gates=True,
            fix_modulation=True,
            visual_token_type_num_embeddings=2,
        )
        random_modulation(model)  # diffusers zeroes it: every block would be an identity
        return model

    return _seeded(24, build)


def kandinsky6_inputs(drift: float) -> Inputs:
    # (B, frames, H, W, C) latents with the condition channels and mask (2 x 4 + 1), (B, tokens, C) audio latents.
    return dict(
        hidden_states=_latents((1, 2, 8, 8, 9), drift),
        audio_hidden_states=_latents((1, 5, 4), drift),
        encoder_hidden_states=_text(),
        pooled_projections=_noise(torch.Generator().manual_seed(2), 1, 16),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=_text_mask().bool(),
        return_dict=False,
    )


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[float], Inputs]]] = {
    "flux": (build_flux, flux_inputs),
    "wan": (build_wan, wan_inputs),
    "hunyuan": (build_hunyuan, hunyuan_inputs),
    "cogvideox": (build_cogvideox, cogvideox_inputs),
    "mochi": (build_mochi, mochi_inputs),
    "ltx": (build_ltx, ltx_inputs),
    "qwenimage": (build_qwenimage, qwenimage_inputs),
    "flux2-klein": (build_flux2, flux2_inputs),
    "sd3": (build_sd3, sd3_inputs),
    "flux2": (build_flux2_dev, flux2_dev_inputs),
    "zimage": (build_zimage, zimage_inputs),
    "hunyuan15": (build_hunyuan15, hunyuan15_inputs),
    "skyreels2": (build_skyreels2, skyreels2_inputs),
    "kandinsky5": (build_kandinsky5, kandinsky5_inputs),
    "ltx2": (build_ltx2, ltx2_inputs),
    "chronoedit": (build_chronoedit, chronoedit_inputs),
    "hunyuanimage": (build_hunyuanimage, hunyuanimage_inputs),
    "qwenimage21": (build_qwenimage21, qwenimage21_inputs),
    "helios": (build_helios, helios_inputs),
    "cosmos3": (build_cosmos3, cosmos3_inputs),
    "kandinsky6": (build_kandinsky6, kandinsky6_inputs),
}
DRIFTS = (0.0, 0.01, 0.02)  # three calls, as three neighbouring denoising steps

# Families whose plan is known to be wrong, with why (xfail(strict=True) keeps them honest).
KNOWN_WRONG: dict[str, str] = {}


def _families() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_WRONG[name]))
        if name in KNOWN_WRONG
        else name
        for name in CASES
    ]


def _run(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    output, *others = model(**inputs)
    output = torch.stack(output) if isinstance(output, list) else output  # Z-Image: one tensor per sample
    # LTX-2 also predicts its audio, Cosmos 3 its sound (a list per modality, None where there is none):
    # compared too, appended to the video flattened.
    others = [torch.stack(other) if isinstance(other, list) else other for other in others if other is not None]
    return torch.cat([output.flatten(), *(other.flatten() for other in others)]) if others else output


def _blocks(model: nn.Module, plan: tuple[BlockList, ...]) -> list[nn.Module]:
    return [block for spec in plan for block in getattr(model, spec.attr)]


def _count_calls(blocks: list[nn.Module]) -> tuple[list[int], list[int]]:
    """Per block: how often it was called, and how many of its submodule calls ran inside it.

    Forward pre-hooks on a block fire on every call, skipped or not: `nn.Module.__call__` runs
    them and then `self.forward`, which is the cache's instance attribute. So they count calls.
    Hooks on a block's submodules fire only when the block's original forward actually runs,
    so they count real work.
    """
    calls = [0] * len(blocks)
    work = [0] * len(blocks)
    for index, block in enumerate(blocks):

        def on_call(module: nn.Module, args: Any, index: int = index) -> None:
            calls[index] += 1

        def on_work(module: nn.Module, args: Any, index: int = index) -> None:
            work[index] += 1

        block.register_forward_pre_hook(on_call)
        for submodule in block.modules():
            if submodule is not block:
                submodule.register_forward_pre_hook(on_work)
    return calls, work


def test_every_registered_family_is_covered() -> None:
    assert set(CASES) == set(FAMILIES)


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_transformer_has_the_planned_structure(name: str) -> None:
    build, _ = CASES[name]
    model = build()
    family = FAMILIES[name]
    assert type(model).__name__ == family.transformer_class
    for spec in family.blocks:
        assert len(getattr(model, spec.attr)) >= 2, f"{spec.attr} needs two blocks to test skipping"


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_threshold_zero_is_bit_identical(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    reference = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    cache = FirstBlockCache(model, FAMILIES[name].blocks, threshold=0.0, primary_stream=FAMILIES[name].primary_stream)
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference))
    assert cache.stats.calls == len(DRIFTS) and cache.stats.cached == 0


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_cached_call_on_same_inputs_reproduces_the_full_output(name: str) -> None:
    """Same inputs: block 0 moves by zero, so the cached output is block 0's + the skipped residual."""
    build, make_inputs = CASES[name]
    model = build()
    plan = FAMILIES[name].blocks
    blocks = _blocks(model, plan)
    calls, work = _count_calls(blocks)
    cache = FirstBlockCache(model, plan, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)

    full = _run(model, make_inputs(0.0))
    work_once = list(work)
    cached = _run(model, make_inputs(0.0))

    assert [record.cached for record in cache.stats.records] == [False, True]
    assert cache.stats.records[1].change == 0.0
    # The hooks fire around the cache's instance forward: every block is *called* on both calls...
    assert calls == [2] * len(blocks)
    # ...but only block 0 does its work again; later blocks pass their inputs through.
    assert all(count > 0 for count in work_once)
    assert work[0] == 2 * work_once[0], "block 0 runs on every call"
    assert work[1:] == work_once[1:], "later blocks run only on the computed call"
    assert cached.shape == full.shape
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_cached_calls_on_drifting_inputs_are_finite(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    cache = FirstBlockCache(model, FAMILIES[name].blocks, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert [record.cached for record in cache.stats.records] == [False, True, True]
    for output in outputs[1:]:
        assert output.shape == outputs[0].shape
        assert torch.isfinite(output).all()


@pytest.mark.parametrize("name", _families())
@torch.no_grad()
def test_remove_restores_the_uncached_transformer(name: str) -> None:
    build, make_inputs = CASES[name]
    model = build()
    reference = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    plan = FAMILIES[name].blocks
    cache = FirstBlockCache(model, plan, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
    for drift in DRIFTS:
        _run(model, make_inputs(drift))
    assert cache.stats.cached == len(DRIFTS) - 1
    cache.remove()
    assert all("forward" not in block.__dict__ for block in _blocks(model, plan))
    outputs = [_run(model, make_inputs(drift)) for drift in DRIFTS]
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference))


TWO_STREAM = [name for name in CASES if any(len(spec.returns) > 1 for spec in FAMILIES[name].blocks)]


@pytest.mark.parametrize("name", TWO_STREAM)
@torch.no_grad()
def test_a_plan_with_the_returns_reversed_is_caught(name: str) -> None:
    """The same-input check has teeth: reversing each list's `returns` makes it fail or raise."""
    build, make_inputs = CASES[name]
    model = build()
    wrong = tuple(replace(spec, returns=spec.returns[::-1]) for spec in FAMILIES[name].blocks)
    try:
        FirstBlockCache(model, wrong, threshold=1e9, primary_stream=FAMILIES[name].primary_stream)
        full = _run(model, make_inputs(0.0))
        cached = _run(model, make_inputs(0.0))
    except (RuntimeError, ValueError):
        return  # streams of different lengths cannot be mixed up silently
    assert cached.shape != full.shape or not torch.allclose(cached, full, rtol=0, atol=1e-5)
