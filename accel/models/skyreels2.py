"""SkyReels-V2 family: Wan 2.1's DiT and VAE, plus diffusion forcing (one noise level per latent frame).

`build_tiny` makes a seeded, random-weight SkyReels-V2-T2V-shaped pipeline offline for tests from
Wan's tiny parts (the same UMT5 text stack, VAE and scheduler, a SkyReelsV2Transformer3DModel of
the tiny Wan's shape).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models import wan
from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import ParallelPlan, SequenceSplit

if TYPE_CHECKING:
    from diffusers import SkyReelsV2ImageToVideoPipeline, SkyReelsV2Pipeline

_CLASS = "SkyReelsV2Transformer3DModel"
# Seeds apart from the tiny Wans' (builder seed x 8 + 0..7), so neither family's weights move.
_SEEDS = 2000


def build_tiny(seed: int = 0) -> "SkyReelsV2Pipeline":
    """A tiny SkyReels-V2 look-alike: Wan's tiny text stack, VAE and scheduler and a two-block DiT.

    The same transformer runs the diffusion-forcing pipelines (converted with `from_pipe`): they
    give it one timestep per latent frame, which it turns into one modulation per video token.
    5 frames at 64x64 make 2x4x4 latent patches, 32 video tokens, as tiny-wan.
    """
    from diffusers import SkyReelsV2Pipeline

    shared = wan._tiny_shared(seed * 8)
    transformer = wan._tiny_transformer(_SEEDS + seed * 8, text_dim=shared["text_encoder"].config.d_model, cls=_CLASS)
    return SkyReelsV2Pipeline(**shared, transformer=transformer)


def build_tiny_i2v(seed: int = 0) -> "SkyReelsV2ImageToVideoPipeline":
    """A tiny SkyReels-V2-I2V look-alike: as wan.build_tiny_i2v, a DiT reading 36 channels (noise,
    first-frame mask, condition latents) and CLIP image tokens before the text."""
    from accel.models.tiny.clip import clip_image_processor, clip_vision_model
    from diffusers import SkyReelsV2ImageToVideoPipeline

    shared = wan._tiny_shared(seed * 8)
    image_encoder = clip_vision_model(seed=_SEEDS + seed * 8 + 1)
    transformer = wan._tiny_transformer(
        _SEEDS + seed * 8 + 2,
        text_dim=shared["text_encoder"].config.d_model,
        cls=_CLASS,
        in_channels=2 * wan._Z_DIM + 4,
        image_dim=image_encoder.config.hidden_size,
        added_kv_proj_dim=4 * 16,
    )
    return SkyReelsV2ImageToVideoPipeline(
        **shared, image_processor=clip_image_processor(), image_encoder=image_encoder, transformer=transformer
    )


FAMILY = Family(
    name="skyreels2",
    title="SkyReels-V2",
    pipeline_class="SkyReelsV2Pipeline",
    transformer_class=_CLASS,
    vae="AutoencoderKLWan",
    repo="Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=544, width=960, frames=97, guidance_scale=6.0),
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        blocks=(BlockList("blocks", returns=("hidden_states",)),),
        # As Wan: video tokens cut at the first block with their rotary table, text whole on every rank.
        # Diffusion forcing gives each latent frame its own timestep, which the transformer expands to one
        # modulation per token, (batch, 6, tokens, dim), handed to every block: cut on its token dim (a
        # plain call's (batch, 6, dim) is not). The output is gathered at `norm_out`, before the
        # transformer applies the per-token shift and scale of the whole sequence.
        tensor=wan.TENSOR_PLAN,  # the same block layout as Wan 2.1
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("output", "video", dim=1, module="rope"),
                SequenceSplit("hidden_states", "video", dim=1, module="blocks.0"),
                SequenceSplit("temb", "video", dim=2, module="blocks.*", ndim=4),
            ),
            attention_keys=("video",),
            output_stream="video",
            output_dim=1,
            output_module="norm_out",
            local_attention=("blocks.*.attn2",),
        ),
        cfg="calls",
    ),
    frames_arg="num_frames",
    fps=24,
    heads=40,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=6.0),
    variants=(
        Variant("SkyReelsV2ImageToVideoPipeline", image="image", tiny=build_tiny_i2v),
        Variant("SkyReelsV2DiffusionForcingPipeline"),
        Variant("SkyReelsV2DiffusionForcingImageToVideoPipeline", image="image"),
        # Extends the clip: its last `overlap_history` frames are the prefix the new frames continue
        # (17 is the model card's; the call needs one), and the output is the clip and the new frames.
        Variant("SkyReelsV2DiffusionForcingVideoToVideoPipeline", video="video", arguments=(("overlap_history", 17),)),
    ),
)
