"""Wan 2.1 family: a video DiT with self-attention over video tokens and cross-attention to UMT5 text.

`build_tiny` makes a seeded, random-weight Wan2.1-T2V-shaped pipeline offline for tests.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import NamedInput, Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    GroupedTokens,
    ParallelPlan,
    SELF_ATTENTION,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import LucyEditPipeline, WanImageToVideoPipeline, WanPipeline, WanVACEPipeline

# Wan 2.1's latent width; the VAE's default latents_mean/std have 16 entries.
_Z_DIM = 16


def _tiny_shared(base: int) -> dict[str, Any]:
    """The parts all tiny Wans share: UMT5 text stack (seed `base + 1`), VAE (`base + 3`), scheduler.

    Wan 2.1 T2V/I2V and Wan 2.2 A14B ship the same UMT5 and VAE, so the tiny builders do too.
    """
    from accel.models.tiny.t5 import t5_tokenizer, umt5_encoder  # heavy (transformers): only when building

    tokenizer = t5_tokenizer()
    text_encoder = umt5_encoder(tokenizer, seed=base + 1)
    vae = tiny_vae(base + 3)
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=tiny_scheduler())


def tiny_scheduler() -> Any:
    """Wan2.1-T2V's diffusers scheduler: UniPC over flow-matching sigmas with a fixed shift."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
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


def tiny_vae(seed: int) -> Any:
    """Wan 2.1's VAE scaled down (seeded): 8x spatial and 4x temporal compression (4k+1 frames -> k+1
    latents) to _Z_DIM channels, with Wan 2.1's latent statistics (Cosmos 3 reuses it)."""
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import AutoencoderKLWan

    with seeded(seed):
        return finish(
            AutoencoderKLWan(
                base_dim=8,
                z_dim=_Z_DIM,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=1,
                attn_scales=[],
                temperal_downsample=[False, True, True],
            )
        )


def _tiny_transformer(seed: int, text_dim: int, cls: str = "WanTransformer3DModel", **config: Any) -> Any:
    """Wan 2.1's DiT (or another class of its shape: VACE, SkyReels-V2) scaled down to two blocks of
    four 16-wide heads; `config` adds or overrides settings."""
    import diffusers

    from accel.models.tiny.seeding import finish, seeded

    settings: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=128,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    with seeded(seed):
        return finish(getattr(diffusers, cls)(**{**settings, **config}))


def build_tiny(seed: int = 0) -> "WanPipeline":
    """A tiny Wan2.1-T2V look-alike: real classes, Wan configs scaled down, random seeded weights.

    Two blocks with four heads keep the structure the cache and context-parallel code see on the
    real model; 5 frames at 64x64 give 2x8x8 latents, i.e. 32 video tokens after (1, 2, 2)
    patching, cross-attending to the text tokens (512 by default, the pipeline's padding length).
    """
    from diffusers import WanPipeline

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    # Offsets: 1 text encoder, 2 transformer, 3 VAE; 4-5 build_tiny_i2v's, 6-7 build_tiny_22's;
    # the VACE and Lucy transformers take _VARIANT_SEEDS + seed * 8 + 0 and + 1.
    base = seed * 8
    shared = _tiny_shared(base)
    transformer = _tiny_transformer(base + 2, text_dim=shared["text_encoder"].config.d_model)
    return WanPipeline(**shared, transformer=transformer, transformer_2=None)


def build_tiny_i2v(seed: int = 0) -> "WanImageToVideoPipeline":
    """A tiny Wan2.1-I2V look-alike: build_tiny's text stack, VAE and scheduler plus a CLIP image encoder.

    As in Wan2.1-I2V, the DiT reads 36 channels: the 16 noise latents and 20 condition channels,
    i.e. a 4-channel first-frame mask (one channel per frame a latent frame packs) and the VAE
    latents of the input image followed by zero (mid-grey) frames. CLIP's penultimate hidden
    states (17 tokens: 16 patches of 8x8 over a 32x32 crop, plus the class token) are embedded to
    the DiT's width and put in front of the text; each cross-attention gives them their own key
    and value projections (`add_k_proj`, `add_v_proj`). Call with `image=` (a PIL image), resized
    to the output size for the VAE and to 32x32 for CLIP.
    """
    from accel.models.tiny.clip import clip_image_processor, clip_vision_model
    from diffusers import WanImageToVideoPipeline

    base = seed * 8
    shared = _tiny_shared(base)
    image_encoder = clip_vision_model(seed=base + 5)
    transformer = _tiny_transformer(
        base + 4,
        text_dim=shared["text_encoder"].config.d_model,
        in_channels=_Z_DIM + 4 + _Z_DIM,  # noise + first-frame mask (VAE temporal factor) + condition
        image_dim=image_encoder.config.hidden_size,
        added_kv_proj_dim=4 * 16,  # the DiT width, as in Wan2.1-I2V (5120)
    )
    return WanImageToVideoPipeline(
        **shared,
        image_processor=clip_image_processor(),
        image_encoder=image_encoder,
        transformer=transformer,
        transformer_2=None,
    )


def build_tiny_22(seed: int = 0) -> "WanPipeline":
    """A tiny Wan2.2-T2V-A14B look-alike: two build_tiny-shaped experts that split the steps by noise level.

    `transformer` (the high-noise expert) takes the steps whose timestep is at least
    `boundary_ratio` x 1000 = 875, `transformer_2` (low-noise) the rest: with build_tiny's
    scheduler, 4 steps run at timesteps 999, 900, 750 and 500, two per expert. Wan 2.2 pairs them
    with two guidance scales: `guidance_scale` for the high-noise and `guidance_scale_2` (defaulting
    to the same) for the low-noise steps. Text stack, VAE and scheduler are build_tiny's.
    """
    from diffusers import WanPipeline

    base = seed * 8
    shared = _tiny_shared(base)
    text_dim = shared["text_encoder"].config.d_model
    return WanPipeline(
        **shared,
        transformer=_tiny_transformer(base + 6, text_dim=text_dim),
        transformer_2=_tiny_transformer(base + 7, text_dim=text_dim),
        boundary_ratio=0.875,
    )


_VARIANT_SEEDS = 1000


def build_tiny_vace(seed: int = 0) -> "WanVACEPipeline":
    """A tiny Wan2.1-VACE look-alike: build_tiny's text stack, VAE and scheduler, and a VACE DiT.

    WanVACETransformer3DModel is a sibling of WanTransformer3DModel (not a subclass): the same
    blocks plus `vace_blocks`, run first on the control latents, whose outputs ("hints") the
    transformer adds to the main blocks' hidden states after the blocks `vace_layers` names (here
    both). The control latents are 96 channels as in Wan2.1-VACE: the VAE latents of the input
    video's kept and repainted parts (16 + 16) and the mask folded 8x8 into channels (64).
    """
    from diffusers import WanVACEPipeline

    shared = _tiny_shared(seed * 8)
    transformer = _tiny_transformer(
        _VARIANT_SEEDS + seed * 8,
        text_dim=shared["text_encoder"].config.d_model,
        cls="WanVACETransformer3DModel",
        vace_layers=[0, 1],
        vace_in_channels=2 * _Z_DIM + 64,
    )
    return WanVACEPipeline(**shared, transformer=transformer, transformer_2=None)


def build_tiny_lucy(seed: int = 0) -> "LucyEditPipeline":
    """A tiny Lucy-Edit look-alike: a Wan DiT reading the noise latents next to the input video's
    (2 x 16 channels), with one timestep per video token (Wan 2.2 TI2V's `expand_timesteps`)."""
    from diffusers import LucyEditPipeline

    shared = _tiny_shared(seed * 8)
    transformer = _tiny_transformer(
        _VARIANT_SEEDS + seed * 8 + 1, text_dim=shared["text_encoder"].config.d_model, in_channels=2 * _Z_DIM
    )
    return LucyEditPipeline(**shared, transformer=transformer, transformer_2=None, expand_timesteps=True)


def build_tiny_animate(seed: int = 0) -> Any:
    """A tiny Wan2.2-Animate look-alike: build_tiny_i2v's parts and a WanAnimateTransformer3DModel.

    The DiT reads I2V's 36 channels plus the pose video's latents (added to the patched tokens of
    every frame after the first), and after every block (`inject_face_latents_blocks` = 1) a face
    adapter attends from each latent frame's tokens to that frame's motion tokens, which a motion
    encoder (16x16 face crops here, 512x512 on the real model) and a face encoder make.
    """
    from accel.models.tiny.clip import clip_image_processor, clip_vision_model
    from diffusers import WanAnimatePipeline

    shared = _tiny_shared(seed * 8)
    image_encoder = clip_vision_model(seed=_VARIANT_SEEDS + seed * 8 + 2)
    transformer = _tiny_transformer(
        _VARIANT_SEEDS + seed * 8 + 3,
        text_dim=shared["text_encoder"].config.d_model,
        cls="WanAnimateTransformer3DModel",
        in_channels=2 * _Z_DIM + 4,
        latent_channels=_Z_DIM,
        out_channels=_Z_DIM,
        image_dim=image_encoder.config.hidden_size,
        added_kv_proj_dim=4 * 16,
        motion_encoder_channel_sizes={"16": 16, "8": 16, "4": 16},
        motion_encoder_size=16,
        motion_style_dim=32,
        motion_dim=8,
        motion_encoder_dim=32,
        face_encoder_hidden_dim=32,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=1,
        motion_encoder_batch_size=8,
    )
    return WanAnimatePipeline(
        **shared, image_processor=clip_image_processor(), image_encoder=image_encoder, transformer=transformer
    )


# Video tokens are cut after patch embedding (at the first block) along with their rotary
# embedding; text stays whole on every rank, so the cross-attention (attn2) needs no exchange.
_VIDEO_SPLITS = (
    SequenceSplit("output", "video", dim=1, module="rope"),
    SequenceSplit("hidden_states", "video", dim=1, module="blocks.0"),
    SequenceSplit("timestep", "video", dim=1, ndim=2),  # Wan 2.2 TI2V: one timestep per token
)
PLAN = ParallelPlan(
    splits=_VIDEO_SPLITS,
    attention_keys=("video",),
    output_stream="video",
    output_dim=1,
    output_module="proj_out",
    local_attention=("blocks.*.attn2",),
)
# VACE: the control branch runs first on the patched video tokens and the control tokens (one per
# video token, zero-padded by the transformer), both cut at the first VACE block; its hints then
# come out cut like the video, and are added to the main blocks' shards token for token.
VACE_PLAN = ParallelPlan(
    splits=(
        *_VIDEO_SPLITS,
        SequenceSplit("hidden_states", "video", dim=1, module="vace_blocks.0"),
        SequenceSplit("control_hidden_states", "video", dim=1, module="vace_blocks.0"),
    ),
    attention_keys=("video",),
    output_stream="video",
    output_dim=1,
    output_module="proj_out",
    local_attention=("blocks.*.attn2", "vace_blocks.*.attn2"),
)

# Animate: the pose latents are added to the patched tokens before the first block, on every rank's
# whole copy, so the video is cut as Wan's. After the blocks `inject_face_latents_blocks` picks, a face
# adapter regroups the video tokens by latent frame (a frame's tokens attend to that frame's motion
# tokens, which every rank computes whole from the face video): each rank runs it on its own tokens
# a run of frames at a time, a frame cut between ranks as a frame of its own (GroupedTokens), with no exchange.
ANIMATE_PLAN = dataclasses.replace(PLAN, grouped=(GroupedTokens("face_adapter.*", "video"),))


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("blocks.*.attn1", SELF_ATTENTION),
        # Image-to-video models add the image's keys and values to the cross-attention.
        **split_layers("blocks.*.attn2", (("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"), ("to_out.0",))),
        **split_layers("blocks.*.ffn", DIFFUSERS_MLP),
    },
    # The query and key norms span all heads (qk_norm = "rms_norm_across_heads").
    norms=(
        "blocks.*.attn1.norm_q",
        "blocks.*.attn1.norm_k",
        "blocks.*.attn2.norm_q",
        "blocks.*.attn2.norm_k",
        "blocks.*.attn2.norm_added_k",
    ),
    per_rank=("heads",),
)


FAMILY = Family(
    name="wan",
    title="Wan 2.1 / 2.2",
    pipeline_class="WanPipeline",
    transformer_class="WanTransformer3DModel",
    vae="AutoencoderKLWan",
    repo="Wan-AI/Wan2.1-T2V-14B-Diffusers",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=480, width=832, frames=81, guidance_scale=5.0),
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        blocks=(BlockList("blocks", returns=("hidden_states",)),),
        transformer_attrs=("transformer", "transformer_2"),  # Wan 2.2: high-noise and low-noise experts
        tensor=TENSOR_PLAN,
        parallel=PLAN,
        cfg="calls",
    ),
    frames_arg="num_frames",
    fps=16,
    heads=40,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    variants=(
        Variant("WanImageToVideoPipeline", image="image", tiny=build_tiny_i2v),
        Variant("WanVideoToVideoPipeline", video="video"),
        # Reference pictures, an input video and its per-frame mask are all optional (none: text to video).
        Variant(
            "WanVACEPipeline",
            image="reference_images",
            video="video",
            mask="mask",
            mask_frames=True,
            optional=("image", "video", "mask"),
            tiny=build_tiny_vace,
            transformer_class="WanVACETransformer3DModel",
            parallel=VACE_PLAN,
        ),
        Variant("LucyEditPipeline", video="video", tiny=build_tiny_lucy),
        # The character picture, its driving pose and face videos; "replace" mode also swaps the
        # character into a background video where a mask video is white.
        Variant(
            "WanAnimatePipeline",
            image="image",
            tiny=build_tiny_animate,
            transformer_class="WanAnimateTransformer3DModel",
            inputs=(
                NamedInput("pose_video", "video"),
                NamedInput("face_video", "video"),
                NamedInput("background_video", "video", when=("mode", "replace")),
                NamedInput("mask_video", "video", when=("mode", "replace")),
            ),
            parallel=ANIMATE_PLAN,
        ),
    ),
)
