"""Helios family: a Wan-shaped 14B video DiT that makes long videos a chunk at a time.

Each chunk (`num_latent_frames_per_chunk` latent frames, 9 by default) is denoised from noise with
the video made so far as context: the last latent frame (beside the first frame's slot), the 2
before it and the 16 before those, patched ever coarser (2x2, 4x4 over two frames, 8x8 over four),
go in front of the chunk's tokens as one sequence, with their own rotary positions and a zero
timestep. Self-attention runs over history and chunk together; cross-attention to the UMT5 text
only over the chunk; the output is the chunk's tokens. Wan 2.1's VAE decodes each chunk as it is made.

Its context-parallel plan is a hand one. diffusers' `_cp_plan` cuts the sequence at every block's
self-attention, cross-attention and MLP and gathers it after each (three all-gathers of the whole
sequence per block), and lets a shard reckon its history length from its own length, which is
wrong on every shard (the history-key amplification of `is_amplify_history` models would scale the
wrong keys, or none); accel cannot derive a plan that gathers at 120 places either. Here history
and chunk are one stream, cut once at the first block with its rotary table and per-token
modulation and gathered after the last; each block gets how many of its shard's tokens are the chunk (LeadingCount,
trailing), so every rank gives cross-attention to exactly its chunk tokens, and the text stays
whole on every rank. (The automatic plan, which tries both readings of such a count, finds the
same plan.)

`build_tiny` makes a seeded, random-weight Helios-Base-shaped pipeline offline for tests;
`build_tiny_pyramid` the Helios-Mid-shaped pyramid one (three stages at growing sizes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models import wan
from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import LeadingCount, ParallelPlan, SequenceSplit

if TYPE_CHECKING:
    from diffusers import HeliosPipeline, HeliosPyramidPipeline

_CLASS = "HeliosTransformer3DModel"
# Seeds apart from the other families' tiny builders (seed x 8 + 0..7, Wan's 1000s, SkyReels' 2000s).
_SEEDS = 3000
# Latent frames per chunk of the tiny calls: 2 make 5-frame chunks (the pipeline's 9, 33-frame chunks
# cost a CPU test seconds of VAE decoding per call); history and tokens keep the real layout.
TINY_CHUNK = 2


def _tiny_transformer(seed: int, text_dim: int, **config: Any) -> Any:
    """Helios's DiT scaled down as tiny-wan's: two blocks of four 16-wide heads; the rotary axes
    (4, 6, 6) sum to the head width as (44, 42, 42) do to 128. `config` overrides settings."""
    import diffusers

    from accel.models.tiny.seeding import finish, seeded

    settings: dict[str, Any] = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=wan._Z_DIM,
        out_channels=wan._Z_DIM,
        text_dim=text_dim,
        freq_dim=32,
        ffn_dim=128,
        num_layers=2,
        rope_dim=(4, 6, 6),
        # Helios-Base's: history tokens in front of the chunk, cross-attention for the chunk alone.
        guidance_cross_attn=True,
        zero_history_timestep=True,
        has_multi_term_memory_patch=True,
        is_amplify_history=False,
    )
    with seeded(seed):
        return finish(getattr(diffusers, _CLASS)(**{**settings, **config}))


def build_tiny(seed: int = 0, **config: Any) -> "HeliosPipeline":
    """A tiny Helios-Base look-alike: tiny-wan's UMT5 text stack and VAE, a two-block DiT.

    At 64x64 a latent frame is 4x4 = 16 tokens after (1, 2, 2) patching. A call with 2 latent
    frames per chunk (TINY_CHUNK) makes 5 frames a chunk, so 5 frames are one chunk and 9 two; each
    transformer call sees 2 x 16 chunk tokens after 40 history tokens: the last latent frame and
    the first frame's slot at 2x2 patches, 32 tokens; the two before at 4x4 over two frames, 4; the
    16 before those at 8x8 over four frames, 4. The scheduler is diffusers' own test
    configuration of HeliosScheduler for this pipeline: one stage, shift from the token count.
    `config` overrides transformer settings (`is_amplify_history=True`: amplified history keys).
    """
    from diffusers import HeliosPipeline, HeliosScheduler

    shared = wan._tiny_shared(seed * 8)  # Wan's text stack and VAE, as Helios ships them
    shared["scheduler"] = HeliosScheduler(stages=1, stage_range=[0, 1], use_dynamic_shifting=True)
    transformer = _tiny_transformer(_SEEDS + seed * 8, text_dim=shared["text_encoder"].config.d_model, **config)
    return HeliosPipeline(**shared, transformer=transformer)


def build_tiny_pyramid(seed: int = 0, cfg_zero_star: bool = False) -> "HeliosPyramidPipeline":
    """A tiny Helios-Mid look-alike: build_tiny's parts with HeliosScheduler's three stages.

    Each chunk is denoised at a quarter, a half and the whole latent size in turn (the first stage's
    noise scaled down, each next one upsampled with block noise); the history stays at the whole
    size. 64x64 makes 1, 4 and 16 tokens a latent frame. The scheduler's `gamma` is 0.25: the class
    default 1/3 makes the block noise's 2x2 covariance singular (its least eigenvalue, 1 - 3 gamma,
    is 0), which Cholesky refuses. Guidance is plain CFG unless `cfg_zero_star` (Helios-Mid's
    CFG-Zero*), which diffusers 0.42 runs only where the first stage is at least two patches wide
    (it calls `.view` on the transformer's output, not contiguous at one patch): 128 pixels.
    """
    from diffusers import HeliosPyramidPipeline, HeliosScheduler

    tiny = build_tiny(seed)
    return HeliosPyramidPipeline(
        tokenizer=tiny.tokenizer,
        text_encoder=tiny.text_encoder,
        vae=tiny.vae,
        transformer=tiny.transformer,
        scheduler=HeliosScheduler(gamma=0.25),
        is_cfg_zero_star=cfg_zero_star,
    )


# History then chunk tokens are one stream: cut at the first block with the rotary table and the
# per-token modulation (history tokens get the zero timestep's); every block's chunk length becomes
# its shard's share. Cross-attention reads the whole text on every rank.
PLAN = ParallelPlan(
    splits=(
        SequenceSplit("hidden_states", "video", dim=1, module="blocks.0"),
        SequenceSplit("rotary_emb", "video", dim=1, module="blocks.*"),
        SequenceSplit("temb", "video", dim=1, module="blocks.*", ndim=4),
    ),
    attention_keys=("video",),
    output_stream="video",
    output_dim=1,
    # The output norm keeps the chunk's tokens (the last ones of the whole sequence): gathered before it.
    output_module="blocks.-1",
    local_attention=("blocks.*.attn2",),
    leading_counts=(LeadingCount("original_context_length", "video", module="blocks.*", trailing=True),),
)


FAMILY = Family(
    name="helios",
    title="Helios",
    pipeline_class="HeliosPipeline",
    transformer_class=_CLASS,
    vae="AutoencoderKLWan",
    repo="BestWishYsh/Helios-Base",
    output="video",
    dtype="bfloat16",
    # Helios-Base's examples (diffusers' Helios page): 50 steps, guidance 5 with a negative prompt,
    # 99 frames at the pipeline's 384x640, played at 24 fps.
    defaults=GenerationDefaults(steps=50, height=384, width=640, frames=99, guidance_scale=5.0),
    # The pipeline checks multiples of 16 (8x VAE, 2x2 patches). Frames: it makes whole chunks of
    # (num_latent_frames_per_chunk - 1) x 4 + 1 frames, the total cut to 4k + 1 (99 asked: three
    # 33-frame chunks, 97 made), so no step says which counts it makes as asked: the run's note
    # reports the count made.
    size_step=16,
    acceleration=Acceleration(
        blocks=(BlockList("blocks", returns=("hidden_states",)),),
        tensor=wan.TENSOR_PLAN,  # Wan 2.1's block layout: attn1, attn2 (no image keys), ffn, norms across heads
        parallel=PLAN,
        # Positive and negative prompts: one transformer call each per step (both pipelines).
        cfg="calls",
    ),
    frames_arg="num_frames",
    fps=24,
    heads=40,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    variants=(
        # Text, image or video to video in one pipeline: the picture is the first frame, a clip's
        # chunks the history the new ones continue.
        Variant(
            "HeliosPipeline",
            image="image",
            video="video",
            optional=("image", "video"),
            one_of=("image", "video"),
            tiny_fixed=(("num_latent_frames_per_chunk", TINY_CHUNK),),
        ),
        # Helios-Mid and -Distilled (their own checkpoints' schedulers): steps per stage, not num_inference_steps.
        Variant(
            "HeliosPyramidPipeline",
            image="image",
            video="video",
            optional=("image", "video"),
            one_of=("image", "video"),
            tiny=build_tiny_pyramid,
            tiny_fixed=(("num_latent_frames_per_chunk", TINY_CHUNK), ("pyramid_num_inference_steps_list", (2, 1, 1))),
        ),
    ),
)
