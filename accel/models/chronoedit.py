"""ChronoEdit family: NVIDIA's picture editor, Wan2.1-I2V-14B fine-tuned to edit a picture by
generating a short clip that starts at it and ends at the edit.

ChronoEditPipeline encodes the input picture twice, as Wan 2.1 image-to-video does: its VAE latents
(followed by zero frames) and a first-frame mask join the noise in channels (16 + 4 + 16), and CLIP's
penultimate hidden states join the UMT5 text in the cross-attention (with their own key and value
projections). Without temporal reasoning the call makes 5 frames whatever it is asked (2 latent
frames, which the transformer's rotary table places 7 frames apart). With `enable_temporal_reasoning`
it denoises `num_frames` for the first `num_temporal_reasoning_steps` steps and only the first and
last latent frames after them, so the token count drops mid-run; the clip is then 5 frames again, or,
where the reasoning lasts every step, the reasoning frames with the edit's appended (`num_frames` in
all). Its output is that clip, the first frame the input picture, the last the edited one: accel
writes it as it writes any video.

Context parallelism is diffusers' own `_cp_plan`, as Wan's hand plan: the video tokens are cut at the
first block with their rotary (cos, sin) tables, the text and picture tokens stay whole on every rank
(the cross-attention needs no exchange), and the output is gathered at `proj_out`. The blocks are
Wan's, so Wan's tensor plan splits them.

`build_tiny` makes a seeded, random-weight ChronoEdit-14B-shaped pipeline offline for tests from Wan's
tiny parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models import wan
from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import FromDiffusers

if TYPE_CHECKING:
    from diffusers import ChronoEditPipeline

_CLASS = "ChronoEditTransformer3DModel"
# Seeds apart from the tiny Wans' (builder seed x 8 + 0..7) and SkyReels-V2's (2000 + ...).
_SEEDS = 3000


def build_tiny(seed: int = 0) -> "ChronoEditPipeline":
    """A tiny ChronoEdit look-alike: Wan's tiny UMT5, VAE and UniPC scheduler, a two-layer CLIP vision
    tower and a two-block DiT of four 16-wide heads reading Wan I2V's 36 channels.

    The scheduler is multistep (UniPC) as the pipeline needs: temporal reasoning trims the solver's
    stored `model_outputs` and `last_sample` to the kept latent frames. A 64x64 picture makes 2 latent
    frames of 4x4 patches, 32 video tokens; 80x112 makes 2 x 5x7 = 70, which 3, 4 and 8 ranks do not divide.
    """
    from accel.models.tiny.clip import clip_image_processor, clip_vision_model
    from diffusers import ChronoEditPipeline

    shared = wan._tiny_shared(seed * 8)
    image_encoder = clip_vision_model(seed=_SEEDS + seed * 8 + 1)
    transformer = wan._tiny_transformer(
        _SEEDS + seed * 8,
        text_dim=shared["text_encoder"].config.d_model,
        cls=_CLASS,
        in_channels=2 * wan._Z_DIM + 4,  # noise, first-frame mask (the VAE's temporal factor), picture latents
        image_dim=image_encoder.config.hidden_size,
        added_kv_proj_dim=4 * 16,  # the DiT width, as Wan2.1-I2V's 5120
    )
    return ChronoEditPipeline(
        **shared, image_processor=clip_image_processor(), image_encoder=image_encoder, transformer=transformer
    )


FAMILY = Family(
    name="chronoedit",
    title="ChronoEdit",
    pipeline_class="ChronoEditPipeline",
    transformer_class=_CLASS,
    vae="AutoencoderKLWan",
    repo="nvidia/ChronoEdit-14B-Diffusers",
    output="video",
    dtype="bfloat16",
    # diffusers' example: 720p (a 720 x 1280 pixel budget at the picture's aspect), guidance 5, the
    # call's 50 steps; 5 frames is what the call makes without temporal reasoning.
    defaults=GenerationDefaults(
        steps=50,
        height=720,
        width=1280,
        frames=5,
        guidance_scale=5.0,
        prompt="turn the scene into a snowy winter evening, keeping everything else unchanged",
    ),
    size_step=16,  # the VAE's 8x times the 2x2 patch
    frame_step=4,
    acceleration=Acceleration(
        blocks=(BlockList("blocks", returns=("hidden_states",)),),
        tensor=wan.TENSOR_PLAN,  # Wan's block layout (the module's own copy of WanTransformerBlock)
        parallel=FromDiffusers(
            streams=(("rope[0]", "video"), ("rope[1]", "video"), ("hidden_states", "video")),
            attention_keys=("video",),
            output_stream="video",
            local_attention=("blocks.*.attn2",),
        ),
        cfg="calls",  # a conditional and an unconditional transformer call per step
    ),
    frames_arg="num_frames",
    fps=16,  # diffusers' example exports the clip at 16 fps, as Wan 2.1's
    heads=40,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    # Not tested batched: every call edits an input picture (accel serve runs those requests alone anyway).
    batches=False,
    variants=(Variant("ChronoEditPipeline", image="image"),),  # the picture to edit, required
)
