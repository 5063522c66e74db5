"""Each family's largest public checkpoint as configs, for `accel plan` to measure before anything loads.

Configs are the published ones (the checkpoints' config.json files, as diffusers and transformers
read them); only the widths, depths and vocabularies matter here, since the plan builds every
component on the meta device to count its weights and on fake `cuda` to measure its working
memory. `inputs` makes the transformer's call at a size (batch 1: a CFG pipeline calls it once per
half, or once per rank under CFG parallel), in the current default dtype and device.

HunyuanVideo 1.5's forward gathers its text tokens with boolean masks: the fake mode keeps the
values of small tensors such as its masks to answer that (accel/memory/fake_cuda.py, KnownValues).

CogVideoX's call takes the rotary tables its pipeline computes: `inputs` passes tables of their shape.

Helios's call is one chunk's, its history latents in front, whatever the frame count.

Not yet here: FLUX.2 klein.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when a plan measures: `accel run` asks for a flagship's name before torch loads
    import torch


@dataclass(frozen=True)
class Component:
    """One model of a pipeline as its library builds it from a config: `attr` names it in the pipeline."""

    attr: str
    library: str  # "diffusers" or "transformers"
    cls: str
    config: Mapping[str, Any]
    model_type: str = ""  # transformers: AutoConfig.for_model's key


@dataclass(frozen=True)
class Size:
    width: int
    height: int
    frames: int | None = None

    def describe(self) -> str:
        return f"{self.width}x{self.height}" + (f"x{self.frames}" if self.frames else "")


@dataclass(frozen=True)
class Flagship:
    title: str
    repo: str
    components: tuple[Component, ...]
    size: Size
    # The transformer call at a size (the keyword arguments of its forward).
    inputs: Callable[[Size], dict[str, Any]]
    # The latents the VAE decodes at a size, (batch, channels, [frames,] height, width).
    latents: Callable[[Size], tuple[int, ...]]

    def of_kind(self, attr_prefix: str) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.attr.startswith(attr_prefix))


def _randn(*shape: int) -> torch.Tensor:
    import torch

    return torch.randn(*shape)


def _video_latents(channels: int, time: int, space: int, frames: int) -> Callable[[Size], tuple[int, ...]]:
    """A video VAE's latents at a size: the first frame, then one per `time` frames; sides `space`x smaller."""
    return lambda s: (1, channels, ((s.frames or frames) - 1) // time + 1, s.height // space, s.width // space)


def _grid_ids(axes: int, *sizes: int) -> torch.Tensor:
    """FLUX-style position ids: zeros then the grid coordinates, one row per token."""
    import torch

    grids = torch.meshgrid(*(torch.arange(float(n)) for n in sizes), indexing="ij")
    ids = torch.stack([torch.zeros_like(grids[0])] * (axes - len(sizes)) + list(grids), -1)
    return ids.reshape(-1, axes)


T5_XXL = dict(
    d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128, feed_forward_proj="gated-gelu"
)
CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    vocab_size=49408,
    max_position_embeddings=77,
    projection_dim=768,
)
UMT5_XXL = dict(T5_XXL, vocab_size=256384)
# Mistral Small 3.1 24B (FLUX.2-dev's text encoder): its Mistral text model and Pixtral vision tower;
# its LM head is its own (24.0 B parameters), Gemma 3's is its embedding.
MISTRAL_SMALL_3 = dict(
    tie_word_embeddings=False,
    text_config=dict(
        model_type="mistral",
        hidden_size=5120,
        intermediate_size=32768,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
        max_position_embeddings=131072,
    ),
    vision_config=dict(
        model_type="pixtral",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        patch_size=14,
        image_size=1540,
    ),
)
# Llama 3 8B as LLaVA-Llama-3 extends its vocabulary (HunyuanVideo's text encoder).
LLAVA_LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128320,
)
# Qwen3 4B (Z-Image's text encoder).
QWEN3_4B = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
)
# Qwen2.5-VL 7B (Qwen-Image's text encoder), Gemma 3 12B (LTX-2's) and CLIP-G (SD 3.5's).
QWEN25_VL_7B = dict(
    text_config=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    vision_config=dict(
        depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14
    ),
)
# Qwen-Image 2.1's text encoder: a Qwen3-VL whose width is the transformer's context_in_dim (4096, the
# diffusers class default), which is Qwen3-VL 8B's (its published widths and depths, from memory: no
# config.json could be read here).
QWEN3_VL_8B = dict(
    text_config=dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        deepstack_visual_indexes=[8, 16, 24],
    ),
)
GEMMA3_12B = dict(
    text_config=dict(
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
    ),
    vision_config=dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
    ),
)
CLIP_G = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    vocab_size=49408,
    max_position_embeddings=77,
    projection_dim=1280,
)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
SD35_LARGE = dict(
    in_channels=16,
    out_channels=16,
    patch_size=2,
    sample_size=128,
    num_layers=38,
    num_attention_heads=38,
    attention_head_dim=64,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
    qk_norm="rms_norm",
)
# ByT5-small (HunyuanVideo 1.5's and HunyuanImage 2.1's glyph encoder, Glyph-SDXL-v2, fine-tunes google/byt5-small: its
# config).
BYT5_SMALL = dict(
    d_model=1472, d_ff=3584, d_kv=64, num_heads=6, num_layers=12, vocab_size=384, feed_forward_proj="gated-gelu"
)
# Kandinsky 5.0 Video Pro (19 B): the widths and depths of the original Kandinsky-5 task config
# k5-pro-t2v-5s-sd (as musubi-tuner's kandinsky5/configs.py mirrors it; the Diffusers repo's
# transformer/config.json was not at hand). `visual_cond` as on Lite: the pipeline always passes the
# condition latents and mask beside the noise. "regular" attention: the 5 s SD task runs no NABLA.
KANDINSKY5_PRO = dict(
    in_visual_dim=16,
    out_visual_dim=16,
    in_text_dim=3584,
    in_text_dim2=768,
    time_dim=1024,
    patch_size=(1, 2, 2),
    model_dim=4096,
    ff_dim=16384,
    num_text_blocks=4,
    num_visual_blocks=60,
    axes_dims=(32, 48, 48),
    visual_cond=True,
)
# Kandinsky 6.0 Pro's released widths (the Diffusers repo's transformer/config.json was not at hand; ComfyUI's
# checkpoint
# detection lists them): Kandinsky 5 Pro's video stream, a 2048-wide audio stream of 16 heads of 128 (the cross-modal
# rotary tables need one head width) over the MMAudio VAE's 40 latent channels, and the released switches.
KANDINSKY6_PRO = dict(
    KANDINSKY5_PRO,
    in_audio_dim=40,
    out_audio_dim=40,
    model_dim_a=2048,
    ff_dim_a=7168,
    time_dim_a=1024,
    text_token_padding=True,
    ca_rope=True,
    cross_gates=True,
    fix_modulation=True,
    visual_token_type_num_embeddings=2,
)
# HunyuanImage 2.1's 32x image VAE: 64 latent channels, six levels, as the original HunyuanImage-2.1 code configures
# it (its 32x VAE config; the Diffusers repo's vae/config.json was not at hand). diffusers' class has no defaults.
HUNYUANIMAGE_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=64,
    block_out_channels=(128, 256, 512, 512, 1024, 1024),
    layers_per_block=2,
    spatial_compression_ratio=32,
    sample_size=384,
    scaling_factor=0.75289,
)
WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
# ChronoEdit-14B fine-tunes Wan2.1-I2V-14B-720P, so these are that transformer's widths: Wan 14B's blocks reading 36
# channels (noise, first-frame mask, picture latents), CLIP ViT-H/14's 1280-wide picture tokens embedded to the blocks'
# width and given their own keys and values in every cross-attention (the ChronoEdit repo's config.json was not at hand;
# ChronoEditTransformer3DModel's defaults are Wan 14B's, its docstring's I2V settings these). CLIP_VIT_H14 is the image
# encoder Wan 2.1 I2V ships (the open_clip ViT-H/14 in transformers' CLIPVisionModel layout).
CHRONOEDIT_14B = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
CLIP_VIT_H14 = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=16,
    image_size=224,
    patch_size=14,
    projection_dim=1024,
    hidden_act="gelu",
)


# CogVideoX-5B (THUDM/CogVideoX-5b, transformer/config.json): 48 heads of 64, 42 blocks, rotary positions
# (no learned ones), a 512-wide time embedding; sample sizes in latents (480x720 / 8) and frames (49).
COGVIDEOX_5B = dict(
    num_attention_heads=48,
    attention_head_dim=64,
    num_layers=42,
    in_channels=16,
    out_channels=16,
    text_embed_dim=4096,
    time_embed_dim=512,
    sample_width=90,
    sample_height=60,
    sample_frames=49,
    patch_size=2,
    temporal_compression_ratio=4,
    max_text_seq_length=226,
    use_rotary_positional_embeddings=True,
    use_learned_positional_embeddings=False,
    spatial_interpolation_scale=1.875,
    temporal_interpolation_scale=1.0,
    activation_fn="gelu-approximate",
    attention_bias=True,
    norm_eps=1e-5,
    flip_sin_to_cos=True,
    freq_shift=0,
)
# Its vae/config.json: four levels of three layers (8x space, 4x time), 16 latent channels, no quant convs.
# Wan 2.2's VAE (TI2V-5B's, which Cosmos 3 uses): residual blocks over 2x2-patched pixels, 16x in space, 48 latent
# channels
# (its latent statistics left neutral: neither weights nor working memory depend on them).
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    latents_mean=[0.0] * 48,
    latents_std=[1.0] * 48,
)
COGVIDEOX_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=16,
    block_out_channels=(128, 256, 256, 512),
    layers_per_block=3,
    norm_num_groups=32,
    norm_eps=1e-6,
    temporal_compression_ratio=4,
    sample_height=480,
    sample_width=720,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.7,
)
# LTX-Video 0.9.7 dev 13B (Lightricks/LTX-Video-0.9.7-dev): diffusers' scripts/convert_ltx_to_diffusers.py,
# get_transformer_config("0.9.7"): 32 heads of 128 (4096 wide), 48 blocks, T5 features projected to 4096.
LTX_13B = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=4096,
    attention_bias=True,
    attention_out_bias=True,
)
# Its VAE, the same script's get_vae_config("0.9.7") (the 0.9.5 VAE): 128 latent channels, 32x space and
# 8x time; the decoder's three upsampling stages with residual 2x upsamplers, conditioned on the decode
# timestep (the plan's decode passes one, as the pipeline does).
LTX_097_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=(128, 256, 512, 1024, 2048),
    down_block_types=("LTXVideo095DownBlock3D",) * 4,
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True,) * 4,
    decoder_spatio_temporal_scaling=(True,) * 3,
    decoder_inject_noise=(False,) * 4,
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True,) * 3,
    upsample_factor=(2,) * 3,
    timestep_conditioning=True,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    scaling_factor=1.0,
    encoder_causal=True,
    decoder_causal=False,
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)


# Helios-Base (14 B): diffusers' HeliosTransformer3DModel defaults, which are its config (the class docstring's
# defaults and the pipeline's example use them; BestWishYsh/Helios-Base's config.json was not at hand): Wan 2.1
# 14B's widths with the three history patch embeddings. Wan 2.1's VAE and UMT5-XXL, as the pipeline's classes say.
HELIOS_CHUNK = 9  # the pipeline's num_latent_frames_per_chunk: 33 frames a chunk
HELIOS_HISTORY = 1 + 16 + 2 + 1  # the first frame's slot and history_sizes (16, 2, 1)


def _flux_inputs(size: Size) -> dict[str, Any]:
    import torch

    h, w = size.height // 16, size.width // 16
    return dict(
        hidden_states=_randn(1, h * w, 64),
        encoder_hidden_states=_randn(1, 512, 4096),
        pooled_projections=_randn(1, 768),
        timestep=torch.ones(1),
        guidance=torch.full((1,), 3.5),
        img_ids=_grid_ids(3, h, w),
        txt_ids=torch.zeros(512, 3),
        return_dict=False,
    )


def _flux2_inputs(size: Size) -> dict[str, Any]:
    import torch

    h, w = size.height // 16, size.width // 16
    return dict(
        hidden_states=_randn(1, h * w, 128),
        encoder_hidden_states=_randn(1, 512, 15360),
        timestep=torch.ones(1),
        guidance=torch.full((1,), 4.0),
        img_ids=_grid_ids(4, 1, h, w)[None],
        txt_ids=_grid_ids(4, 512)[None],
        return_dict=False,
    )


def _wan_inputs(size: Size) -> dict[str, Any]:
    import torch

    frames = (size.frames or 81) - 1
    return dict(
        hidden_states=_randn(1, 16, frames // 4 + 1, size.height // 8, size.width // 8),
        encoder_hidden_states=_randn(1, 512, 4096),
        timestep=torch.ones(1),
        return_dict=False,
    )


def _chronoedit_inputs(size: Size) -> dict[str, Any]:
    """Wan 2.1 I2V's call: 36 channels in, and CLIP's 257 picture tokens (16 x 16 patches and the class token) beside
    the text."""
    return dict(
        _wan_inputs(size),
        hidden_states=_randn(1, 36, ((size.frames or 5) - 1) // 4 + 1, size.height // 8, size.width // 8),
        encoder_hidden_states_image=_randn(1, 257, 1280),
    )


def _helios_inputs(size: Size) -> dict[str, Any]:
    """One chunk's call, whatever the frame count (the pipeline makes a long video a chunk at a time):
    9 latent frames of noise, the history's 20 latent frames (2x2, 4x4 and 8x8 patches), 512 UMT5 tokens."""
    import torch

    h, w = size.height // 8, size.width // 8
    positions = torch.arange(HELIOS_HISTORY + HELIOS_CHUNK)[None]
    return dict(
        hidden_states=_randn(1, 16, HELIOS_CHUNK, h, w),
        timestep=torch.ones(1),
        encoder_hidden_states=_randn(1, 512, 4096),
        indices_hidden_states=positions[:, -HELIOS_CHUNK:],
        indices_latents_history_long=positions[:, 1:17],
        indices_latents_history_mid=positions[:, 17:19],
        indices_latents_history_short=positions[:, [0, 19]],
        latents_history_long=_randn(1, 16, 16, h, w),
        latents_history_mid=_randn(1, 16, 2, h, w),
        latents_history_short=_randn(1, 16, 2, h, w),
        return_dict=False,
    )


def _qwenimage_inputs(size: Size) -> dict[str, Any]:
    import torch

    h, w, text = size.height // 16, size.width // 16, 256
    return dict(
        hidden_states=_randn(1, h * w, 64),
        encoder_hidden_states=_randn(1, text, 3584),
        encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.bool),
        timestep=torch.ones(1),
        img_shapes=[[(1, h, w)]],
        return_dict=False,
    )


def _qwenimage21_inputs(size: Size) -> dict[str, Any]:
    """Unpatched latents at 16x (64 channels), a 256-token prompt and the encoder's slot mask: one
    slot per 2x2 target tokens after the text, as the pipeline appends them (text-to-image, the
    prefill call that computes every token)."""
    import torch

    h, w, text = size.height // 16, size.width // 16, 256
    img_mask = torch.cat([torch.zeros(1, text, dtype=torch.bool), torch.ones(1, h * w // 4, dtype=torch.bool)], dim=1)
    return dict(
        hidden_states=_randn(1, h * w, 64),
        encoder_hidden_states=_randn(1, text, 4096),
        timestep=torch.ones(1),
        img_shapes=[[(1, h, w)]],
        img_mask=img_mask,
        return_dict=False,
    )


def _cosmos3_inputs(size: Size) -> dict[str, Any]:
    """One sample packed as the pipeline packs it: 256 prompt token ids, then the video's latents at
    16x (48 channels; 4k+1 frames -> k+1) in 2x2 patches, every latent frame noisy (text-to-video)."""
    import torch

    frames = size.frames or 189
    t, h, w, text = (frames - 1) // 4 + 1, size.height // 16, size.width // 16, 256
    patches = (t, (h + 1) // 2, (w + 1) // 2)
    video = patches[0] * patches[1] * patches[2]
    at = torch.arange(text, text + video)
    return dict(
        input_ids=torch.zeros(text, dtype=torch.long),
        text_indexes=torch.arange(text),
        und_len=text,
        sequence_length=text + video,
        position_ids=torch.arange(text + video, dtype=torch.float32).expand(3, -1),
        vision_tokens=[_randn(1, 48, t, h, w)],
        vision_token_shapes=[patches],
        vision_sequence_indexes=at,
        vision_mse_loss_indexes=at,
        vision_timesteps=torch.full((video,), 500.0),
        vision_noisy_frame_indexes=[torch.arange(t)],
        return_dict=False,
    )


def _ltx2_inputs(size: Size) -> dict[str, Any]:
    """Video latents (8x time, 32x space), the audio's 25 latent frames a second at 24 fps, 1024 Gemma tokens."""
    import torch

    frames = size.frames or 121
    f, h, w, text = (frames - 1) // 8 + 1, size.height // 32, size.width // 32, 1024
    audio = round(frames / 24 * 25)
    mask = torch.ones(1, text, dtype=torch.long)
    return dict(
        hidden_states=_randn(1, f * h * w, 128),
        audio_hidden_states=_randn(1, audio, 128),
        encoder_hidden_states=_randn(1, text, 3840),
        audio_encoder_hidden_states=_randn(1, text, 3840),
        timestep=torch.full((1,), 500.0),
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=f,
        height=h,
        width=w,
        audio_num_frames=audio,
        return_dict=False,
    )


def _hunyuan15_inputs(size: Size) -> dict[str, Any]:
    """Noise, condition latents and their mask side by side (65 channels, 16x space, 4x time); the
    pipeline's padded 1000 Qwen and 256 ByT5 tokens, and 729 zero SigLIP tokens (text-to-video). The
    forward gathers valid tokens first, so the joint text stream is 1985 long whatever the masks hold:
    all valid here (the fake mode keeps these small tensors' values, accel/memory/fake_cuda.py)."""
    import torch

    frames = size.frames or 121
    return dict(
        hidden_states=_randn(1, 65, (frames - 1) // 4 + 1, size.height // 16, size.width // 16),
        timestep=torch.ones(1),
        encoder_hidden_states=_randn(1, 1000, 3584),
        encoder_attention_mask=torch.ones(1, 1000, dtype=torch.long),
        encoder_hidden_states_2=_randn(1, 256, 1472),
        encoder_attention_mask_2=torch.ones(1, 256, dtype=torch.long),
        image_embeds=torch.zeros(1, 729, 1152),
        return_dict=False,
    )


def _hunyuanimage_inputs(size: Size) -> dict[str, Any]:
    """Latents at 32x (64 channels; patch 1: one token each), the pipeline's padded 1000 Qwen and 128
    ByT5 tokens, which the forward joins into one 1128-token text stream, valid ones first."""
    import torch

    return dict(
        hidden_states=_randn(1, 64, size.height // 32, size.width // 32),
        timestep=torch.ones(1),
        encoder_hidden_states=_randn(1, 1000, 3584),
        encoder_attention_mask=torch.ones(1, 1000, dtype=torch.long),
        encoder_hidden_states_2=_randn(1, 128, 1472),
        encoder_attention_mask_2=torch.ones(1, 128, dtype=torch.long),
        return_dict=False,
    )


def _kandinsky5_inputs(size: Size) -> dict[str, Any]:
    """Channels-last latents with the condition latents and mask appended (33 wide), 8x space and 4x
    time; the pipeline's 512 Qwen tokens at most (max_sequence_length) and CLIP-L's pooled vector;
    the pipeline's RoPE scale for its size (x2 between 480 and 854 on both sides, else x3.16)."""
    import torch

    frames = size.frames or 121
    f, h, w, text = (frames - 1) // 4 + 1, size.height // 8, size.width // 8, 512
    scale = 2.0 if 480 <= size.height <= 854 and 480 <= size.width <= 854 else 3.16
    return dict(
        hidden_states=_randn(1, f, h, w, 33),
        encoder_hidden_states=_randn(1, text, 3584),
        pooled_projections=_randn(1, 768),
        timestep=torch.ones(1),
        visual_rope_pos=[torch.arange(f), torch.arange(h // 2), torch.arange(w // 2)],
        text_rope_pos=torch.arange(text),
        scale_factor=(1.0, scale, scale),
        return_dict=False,
    )


def _kandinsky6_inputs(size: Size) -> dict[str, Any]:
    """Kandinsky 5's channels-last video latents (33 wide), the audio's latent frames (44.1 kHz over a
    1024-sample hop for the video's length at 24 fps, 40 channels), the pipeline's 1024 Qwen tokens and
    CLIP-L's pooled vector; the forward builds its rotary positions itself."""
    import math

    import torch

    frames = size.frames or 121
    f = (frames - 1) // 4 + 1
    audio = math.ceil(((f - 1) * 4 + 1) / 24 * 44100 / 1024)
    return dict(
        hidden_states=_randn(1, f, size.height // 8, size.width // 8, 33),
        audio_hidden_states=_randn(1, audio, 40),
        encoder_hidden_states=_randn(1, 1024, 3584),
        pooled_projections=_randn(1, 768),
        timestep=torch.ones(1),
        return_dict=False,
    )


def _kandinsky(
    title: str, repo: str, transformer: str, config: dict[str, Any], inputs: Callable[[Size], dict[str, Any]]
) -> Flagship:
    """A Kandinsky 5 or 6 video checkpoint: its transformer beside Qwen2.5-VL-7B, CLIP-L and HunyuanVideo's VAE,
    at the pipelines' default size (512x768, 121 frames)."""
    return Flagship(
        title,
        repo,
        (
            Component("transformer", "diffusers", transformer, config),
            Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B, "qwen2_5_vl"),
            Component("text_encoder_2", "transformers", "CLIPTextModel", CLIP_L, "clip_text_model"),
            Component("vae", "diffusers", "AutoencoderKLHunyuanVideo", {}),
        ),
        Size(768, 512, 121),
        inputs,
        _video_latents(16, 4, 8, 121),
    )


def _zimage_inputs(size: Size) -> dict[str, Any]:
    """Lists of one latent (channels, frame, height, width) and one prompt's valid Qwen3 tokens, at
    most the pipeline's 512 (max_sequence_length); the flow time in [0, 1]."""
    import torch

    return dict(
        x=[_randn(16, 1, size.height // 8, size.width // 8)],
        t=torch.full((1,), 0.5),
        cap_feats=[_randn(512, 2560)],
        return_dict=False,
    )


def _hunyuan_inputs(size: Size) -> dict[str, Any]:
    """Latents at 8x space and 4x time, the pipeline's 256 Llama tokens (max_sequence_length), CLIP-L's
    pooled vector, guidance 6 as the pipeline scales it (x1000)."""
    import torch

    frames = size.frames or 129
    return dict(
        hidden_states=_randn(1, 16, (frames - 1) // 4 + 1, size.height // 8, size.width // 8),
        timestep=torch.ones(1),
        encoder_hidden_states=_randn(1, 256, 4096),
        encoder_attention_mask=torch.ones(1, 256, dtype=torch.long),
        pooled_projections=_randn(1, 768),
        guidance=torch.full((1,), 6000.0),
        return_dict=False,
    )


def _mochi_latents(size: Size) -> tuple[int, ...]:
    """Sides on Mochi's 16-pixel grid (its 2x2 patches of 8x latents; accel's size_step for it)."""
    return (1, 12, ((size.frames or 85) - 1) // 6 + 1, size.height // 16 * 2, size.width // 16 * 2)


def _mochi_inputs(size: Size) -> dict[str, Any]:
    """Latents at 8x space and 6x time (12 channels), the pipeline's 256 T5 tokens (max_sequence_length).
    Each attention gathers the valid prompt tokens by the mask (all valid here; the fake mode keeps it)."""
    import torch

    return dict(
        hidden_states=_randn(*_mochi_latents(size)),
        encoder_hidden_states=_randn(1, 256, 4096),
        timestep=torch.ones(1),
        encoder_attention_mask=torch.ones(1, 256, dtype=torch.long),
        return_dict=False,
    )


def _sd3_inputs(size: Size) -> dict[str, Any]:
    """77 CLIP tokens and 256 T5 tokens joined, CLIP-L and CLIP-G pooled side by side."""
    import torch

    return dict(
        hidden_states=_randn(1, 16, size.height // 8, size.width // 8),
        encoder_hidden_states=_randn(1, 333, 4096),
        pooled_projections=_randn(1, 2048),
        timestep=torch.ones(1),
        return_dict=False,
    )


def _cogvideox_inputs(size: Size) -> dict[str, Any]:
    """Frames-first latents at 8x space and 4x time, the pipeline's 226 T5 tokens (max_sequence_length),
    and the rotary tables it computes for the video tokens (cos and sin, one 64-wide row per 2x2 patch)."""
    import torch

    frames = ((size.frames or 49) - 1) // 4 + 1
    h, w = size.height // 8, size.width // 8
    tokens = frames * (h // 2) * (w // 2)
    return dict(
        hidden_states=_randn(1, frames, 16, h, w),
        encoder_hidden_states=_randn(1, 226, 4096),
        timestep=torch.ones(1),
        image_rotary_emb=(_randn(tokens, 64), _randn(tokens, 64)),
        return_dict=False,
    )


def _ltx_inputs(size: Size) -> dict[str, Any]:
    """Packed latents (8x time, 32x space, one token each), the pipeline's 128 T5 tokens
    (max_sequence_length) and their mask, its rope scale at the default 25 fps."""
    import torch

    frames = size.frames or 161
    f, h, w, text = (frames - 1) // 8 + 1, size.height // 32, size.width // 32, 128
    return dict(
        hidden_states=_randn(1, f * h * w, 128),
        encoder_hidden_states=_randn(1, text, 4096),
        timestep=torch.full((1,), 500.0),
        encoder_attention_mask=torch.ones(1, text, dtype=torch.long),
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )


FLAGSHIPS: dict[str, Flagship] = {
    "flux": Flagship(
        "FLUX.1-dev",
        "black-forest-labs/FLUX.1-dev",
        (
            Component("transformer", "diffusers", "FluxTransformer2DModel", dict(guidance_embeds=True)),
            Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L, "clip_text_model"),
            Component("text_encoder_2", "transformers", "T5EncoderModel", T5_XXL, "t5"),
            Component("vae", "diffusers", "AutoencoderKL", FLUX_VAE),
        ),
        Size(1024, 1024),
        _flux_inputs,
        lambda s: (1, 16, s.height // 8, s.width // 8),
    ),
    "flux2": Flagship(
        "FLUX.2-dev",
        "black-forest-labs/FLUX.2-dev",
        (
            Component("transformer", "diffusers", "Flux2Transformer2DModel", {}),
            Component("text_encoder", "transformers", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_3, "mistral3"),
            Component("vae", "diffusers", "AutoencoderKLFlux2", {}),
        ),
        Size(1024, 1024),
        _flux2_inputs,
        lambda s: (1, 32, s.height // 8, s.width // 8),
    ),
    "wan": Flagship(
        "Wan 2.2 T2V A14B",
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
        (
            Component("transformer", "diffusers", "WanTransformer3DModel", WAN_14B),
            Component("transformer_2", "diffusers", "WanTransformer3DModel", WAN_14B),
            Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, "umt5"),
            Component("vae", "diffusers", "AutoencoderKLWan", {}),
        ),
        Size(1280, 720, 81),
        _wan_inputs,
        _video_latents(16, 4, 8, 81),
    ),
    "qwenimage": Flagship(
        "Qwen-Image",
        "Qwen/Qwen-Image",
        (
            Component("transformer", "diffusers", "QwenImageTransformer2DModel", {}),
            Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B, "qwen2_5_vl"),
            Component("vae", "diffusers", "AutoencoderKLQwenImage", {}),
        ),
        Size(1328, 1328),
        _qwenimage_inputs,
        lambda s: (1, 16, 1, s.height // 8, s.width // 8),
    ),
    # QwenImage21Transformer2DModel's and AutoencoderKLQwenImage21's class defaults are the released
    # configs (the pipeline's docstring loads Qwen/Qwen-Image-2.1 with no overrides): 32 blocks of
    # 32 x 128 heads, 64 latent channels, a 16x VAE.
    "qwenimage21": Flagship(
        "Qwen-Image 2.1",
        "Qwen/Qwen-Image-2.1",
        (
            Component("transformer", "diffusers", "QwenImage21Transformer2DModel", {}),
            Component("text_encoder", "transformers", "Qwen3VLForConditionalGeneration", QWEN3_VL_8B, "qwen3_vl"),
            Component("vae", "diffusers", "AutoencoderKLQwenImage21", {}),
        ),
        Size(1024, 1024),
        _qwenimage21_inputs,
        lambda s: (1, 64, 1, s.height // 16, s.width // 16),
    ),
    "ltx2": Flagship(
        "LTX-2",
        "Lightricks/LTX-2",
        (
            Component(
                "transformer", "diffusers", "LTX2VideoTransformer3DModel", dict(num_layers=48, rope_type="split")
            ),
            Component("text_encoder", "transformers", "Gemma3ForConditionalGeneration", GEMMA3_12B, "gemma3"),
            Component("vae", "diffusers", "AutoencoderKLLTX2Video", {}),
        ),
        Size(768, 512, 121),
        _ltx2_inputs,
        _video_latents(128, 8, 32, 121),
    ),
    "sd3": Flagship(
        "Stable Diffusion 3.5 Large",
        "stabilityai/stable-diffusion-3.5-large",
        (
            Component("transformer", "diffusers", "SD3Transformer2DModel", SD35_LARGE),
            Component("text_encoder", "transformers", "CLIPTextModelWithProjection", CLIP_L, "clip_text_model"),
            Component("text_encoder_2", "transformers", "CLIPTextModelWithProjection", CLIP_G, "clip_text_model"),
            Component("text_encoder_3", "transformers", "T5EncoderModel", T5_XXL, "t5"),
            Component("vae", "diffusers", "AutoencoderKL", dict(FLUX_VAE, scaling_factor=1.5305, shift_factor=0.0609)),
        ),
        Size(1024, 1024),
        _sd3_inputs,
        lambda s: (1, 16, s.height // 8, s.width // 8),
    ),
    "hunyuan15": Flagship(
        "HunyuanVideo 1.5 720p",
        "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
        (
            Component(
                "transformer", "diffusers", "HunyuanVideo15Transformer3DModel", dict(target_size=960, task_type="t2v")
            ),
            Component(
                "text_encoder", "transformers", "Qwen2_5_VLTextModel", QWEN25_VL_7B["text_config"], "qwen2_5_vl_text"
            ),
            Component("text_encoder_2", "transformers", "T5EncoderModel", BYT5_SMALL, "t5"),
            Component("vae", "diffusers", "AutoencoderKLHunyuanVideo15", {}),
        ),
        Size(1280, 720, 121),
        _hunyuan15_inputs,
        _video_latents(32, 4, 16, 121),
    ),
    # The diffusers class defaults are HunyuanImage 2.1's shape (20 double and 40 single blocks of 28
    # heads of 128, 64 channels in, patch 1, rotary axes (64, 64); 17.4 B); its glyph projection reads
    # ByT5-small's 1472 (the class default, None, leaves it out).
    "hunyuanimage": Flagship(
        "HunyuanImage 2.1",
        "hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
        (
            Component("transformer", "diffusers", "HunyuanImageTransformer2DModel", dict(text_embed_2_dim=1472)),
            Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B, "qwen2_5_vl"),
            Component("text_encoder_2", "transformers", "T5EncoderModel", BYT5_SMALL, "t5"),
            Component("vae", "diffusers", "AutoencoderKLHunyuanImage", HUNYUANIMAGE_VAE),
        ),
        Size(2048, 2048),
        _hunyuanimage_inputs,
        lambda s: (1, 64, s.height // 32, s.width // 32),
    ),
    "kandinsky5": _kandinsky(
        "Kandinsky 5.0 Video Pro",
        "kandinskylab/Kandinsky-5.0-T2V-Pro-sft-5s-Diffusers",
        "Kandinsky5Transformer3DModel",
        KANDINSKY5_PRO,
        _kandinsky5_inputs,
    ),
    # The audio VAE (0.3 B) and vocoder (0.1 B) are left out, as LTX-2's.
    "kandinsky6": _kandinsky(
        "Kandinsky 6.0 Pro",
        "kandinskylab/Kandinsky-6.0-Pro-5s-Diffusers",
        "Kandinsky6Transformer3DModel",
        KANDINSKY6_PRO,
        _kandinsky6_inputs,
    ),
    "zimage": Flagship(
        "Z-Image-Turbo",
        "Tongyi-MAI/Z-Image-Turbo",
        (
            Component("transformer", "diffusers", "ZImageTransformer2DModel", {}),
            Component("text_encoder", "transformers", "Qwen3ForCausalLM", QWEN3_4B, "qwen3"),
            Component("vae", "diffusers", "AutoencoderKL", FLUX_VAE),
        ),
        Size(1024, 1024),
        _zimage_inputs,
        lambda s: (1, 16, s.height // 8, s.width // 8),
    ),
    "hunyuan": Flagship(
        "HunyuanVideo",
        "hunyuanvideo-community/HunyuanVideo",
        (
            Component("transformer", "diffusers", "HunyuanVideoTransformer3DModel", {}),
            Component("text_encoder", "transformers", "LlamaModel", LLAVA_LLAMA3_8B, "llama"),
            Component("text_encoder_2", "transformers", "CLIPTextModel", CLIP_L, "clip_text_model"),
            Component("vae", "diffusers", "AutoencoderKLHunyuanVideo", {}),
        ),
        Size(1280, 720, 129),
        _hunyuan_inputs,
        _video_latents(16, 4, 8, 129),
    ),
    # Wan 2.1 14B's widths, which SkyReels-V2 14B continues training from (its fps embedding, a few
    # small layers when the config injects sample info, is left out here).
    "skyreels2": Flagship(
        "SkyReels-V2 T2V 14B 540P",
        "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
        (
            Component("transformer", "diffusers", "SkyReelsV2Transformer3DModel", WAN_14B),
            Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, "umt5"),
            Component("vae", "diffusers", "AutoencoderKLWan", {}),
        ),
        Size(960, 544, 97),
        _wan_inputs,
        _video_latents(16, 4, 8, 97),
    ),
    # Its 5 frames at 720p, the size of diffusers' example for a 16:9 picture.
    "chronoedit": Flagship(
        "ChronoEdit-14B",
        "nvidia/ChronoEdit-14B-Diffusers",
        (
            Component("transformer", "diffusers", "ChronoEditTransformer3DModel", CHRONOEDIT_14B),
            Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, "umt5"),
            Component("image_encoder", "transformers", "CLIPVisionModel", CLIP_VIT_H14, "clip_vision_model"),
            Component("vae", "diffusers", "AutoencoderKLWan", {}),
        ),
        Size(1280, 720, 5),
        _chronoedit_inputs,
        _video_latents(16, 4, 8, 5),
    ),
    "mochi": Flagship(
        "Mochi 1 preview",
        "genmo/mochi-1-preview",
        (
            Component("transformer", "diffusers", "MochiTransformer3DModel", {}),
            Component("text_encoder", "transformers", "T5EncoderModel", T5_XXL, "t5"),
            Component("vae", "diffusers", "AutoencoderKLMochi", {}),
        ),
        Size(848, 480, 85),
        _mochi_inputs,
        _mochi_latents,
    ),
    "cogvideox": Flagship(
        "CogVideoX-5B",
        "THUDM/CogVideoX-5b",
        (
            Component("transformer", "diffusers", "CogVideoXTransformer3DModel", COGVIDEOX_5B),
            Component("text_encoder", "transformers", "T5EncoderModel", T5_XXL, "t5"),
            Component("vae", "diffusers", "AutoencoderKLCogVideoX", COGVIDEOX_VAE),
        ),
        Size(720, 480, 49),
        _cogvideox_inputs,
        _video_latents(16, 4, 8, 49),
    ),
    # The model card's 99 frames at the pipeline's 384x640; each chunk's 9 latent frames are decoded as it is made.
    "helios": Flagship(
        "Helios-Base 14B",
        "BestWishYsh/Helios-Base",
        (
            Component("transformer", "diffusers", "HeliosTransformer3DModel", {}),
            Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, "umt5"),
            Component("vae", "diffusers", "AutoencoderKLWan", {}),
        ),
        Size(640, 384, 99),
        _helios_inputs,
        lambda s: (1, 16, HELIOS_CHUNK, s.height // 8, s.width // 8),
    ),
    # Cosmos3OmniTransformer's class defaults (a Qwen3-8B-shaped backbone, 36 layers of 32 query and 8
    # key/value heads of 128, twice over: the text's weights and the generation stream's), Wan 2.2's 16x
    # VAE (48 channels), the sound tokenizer's defaults (48 kHz stereo); no text encoder (the transformer
    # embeds the token ids). The call's default size: 720p, 189 frames.
    "cosmos3": Flagship(
        "Cosmos 3 Nano",
        "nvidia/Cosmos3-Nano",
        (
            Component("transformer", "diffusers", "Cosmos3OmniTransformer", {}),
            Component("vae", "diffusers", "AutoencoderKLWan", WAN22_VAE),
            Component("sound_tokenizer", "diffusers", "Cosmos3AVAEAudioTokenizer", dict(encoder_enabled=False)),
        ),
        Size(1280, 720, 189),
        _cosmos3_inputs,
        _video_latents(48, 4, 16, 189),
    ),
    # The family's default size (accel/models/ltx.py), which `accel run ltx` generates.
    "ltx": Flagship(
        "LTX-Video 0.9.7 dev 13B",
        "Lightricks/LTX-Video-0.9.7-dev",
        (
            Component("transformer", "diffusers", "LTXVideoTransformer3DModel", LTX_13B),
            Component("text_encoder", "transformers", "T5EncoderModel", T5_XXL, "t5"),
            Component("vae", "diffusers", "AutoencoderKLLTXVideo", LTX_097_VAE),
        ),
        Size(704, 480, 161),
        _ltx_inputs,
        _video_latents(128, 8, 32, 161),
    ),
}


def flagship_of_repo(repo: str) -> str | None:
    """The flagship whose checkpoint is the hub id `repo` (compared without case)."""
    return next((key for key, flagship in FLAGSHIPS.items() if flagship.repo.lower() == repo.lower()), None)


def flagship_heads(name: str) -> int:
    """The flagship's own attention heads: a family's `heads` is its default checkpoint's (Kandinsky 5
    Lite 28, Pro 32)."""
    from accel.models.registry import FAMILIES

    family = FAMILIES[name]
    return family.heads_in(FLAGSHIPS[name].of_kind("transformer")[0].config) or family.heads
