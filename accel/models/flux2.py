"""FLUX.2 families: FLUX.2-dev (a Mistral 3 text encoder, guidance-distilled) and FLUX.2 [klein]
(a Qwen3 text encoder; the base models run real CFG). Both run Flux2Transformer2DModel: double-stream
blocks on (text, image), then single-stream blocks on the two concatenated, and the VAE AutoencoderKLFlux2.

`build_tiny` and `build_tiny_klein` make seeded, random-weight FLUX.2-dev- and FLUX.2-klein-shaped
pipelines offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import FromDiffusers, TensorPlan

if TYPE_CHECKING:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline

# A chat template in the shape of Qwen3's, enough for the Klein pipeline's one user turn.
_QWEN3_CHAT = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LATENT_CHANNELS = 32  # FLUX.2's VAE; latents are packed 2x2 into 128 channels


def _tiny_transformer(seed: int, text_dim: int, guidance: bool) -> Any:
    """FLUX.2's transformer scaled down: one double and two single blocks would do for FLUX.2, but
    the cache needs two of each kind; four 16-wide heads with 4-axis rotary ids as on the real one."""
    from diffusers import Flux2Transformer2DModel

    from accel.models.tiny.seeding import finish, seeded

    with seeded(seed):
        return finish(
            Flux2Transformer2DModel(
                patch_size=1,
                in_channels=_LATENT_CHANNELS * 4,
                num_layers=2,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=4,
                joint_attention_dim=text_dim,
                timestep_guidance_channels=32,
                mlp_ratio=3.0,
                axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim, as (32, 32, 32, 32) does to 128
                guidance_embeds=guidance,
            )
        )


def _tiny_vae(seed: int) -> Any:
    from diffusers import AutoencoderKLFlux2

    from accel.models.tiny.seeding import finish, seeded

    with seeded(seed):
        # FLUX.2's VAE shape: four levels (8x downsampling), 32 latent channels, batch-normed 2x2 patches.
        return finish(
            AutoencoderKLFlux2(
                block_out_channels=(8, 16, 16, 16),
                layers_per_block=1,
                latent_channels=_LATENT_CHANNELS,
                norm_num_groups=4,
                sample_size=64,
            )
        )


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2's scheduler config: the shift is computed by the pipeline from the image token count.
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)


def build_tiny(seed: int = 0) -> "Flux2Pipeline":
    """A tiny FLUX.2-dev look-alike: real classes, configs scaled down, random seeded weights.

    The pipeline stacks the Mistral 3 encoder's hidden states 10, 20 and 30, so the tiny encoder has
    30 layers (8 wide). Its tokenizer spends one token per word of the pipeline's system message, as
    the real one roughly does; prompts are padded to 512 tokens either way. 64x64 images give 4x4 = 16
    packed image tokens. The transformer embeds the guidance scale: FLUX.2-dev is guidance-distilled.
    """
    import diffusers
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    from accel.models.tiny.mistral import mistral3_model, mistral_tokenizer

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = mistral_tokenizer(SYSTEM_MESSAGE)
    text_encoder = mistral3_model(tokenizer, seed=base + 1, layers=30)
    return diffusers.Flux2Pipeline(
        scheduler=_scheduler(),
        vae=_tiny_vae(base + 3),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_tiny_transformer(base + 2, 3 * text_encoder.config.text_config.hidden_size, guidance=True),
    )


def build_tiny_klein(seed: int = 0, pipeline: str = "Flux2KleinPipeline") -> "Flux2KleinPipeline":
    """A tiny FLUX.2 [klein] base look-alike: real classes, configs scaled down, random seeded weights.

    The pipeline stacks the Qwen3 encoder's hidden states 9, 18 and 27, so the tiny encoder has 27
    layers (8 wide: a few thousand weights each). 64x64 images give 4x4 = 16 packed image tokens
    next to the prompt's 512 padded tokens. `is_distilled=False`: real CFG, as the base models run it.
    """
    import diffusers

    from accel.models.tiny.qwen import qwen2_tokenizer, qwen3_model

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = qwen2_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = _QWEN3_CHAT
    text_encoder = qwen3_model(tokenizer, seed=base + 1, layers=27)
    return getattr(diffusers, pipeline)(
        scheduler=_scheduler(),
        vae=_tiny_vae(base + 3),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_tiny_transformer(base + 2, 3 * text_encoder.config.hidden_size, guidance=False),
        is_distilled=False,
    )


# diffusers' _cp_plan cuts text and image tokens and their 4-axis ids at the forward and gathers at
# proj_out. The double blocks attend over (text, image); the single blocks get the two local shards
# concatenated (text then image), which is the same key layout. Reference images (`image=`) put their
# tokens and ids after the generated ones in hidden_states and img_ids, so they are cut with the image
# stream; the pipeline keeps the first tokens of the (whole) gathered output.
_PLAN = FromDiffusers(
    streams=(("hidden_states", "image"), ("img_ids", "image"), ("encoder_hidden_states", "text"), ("txt_ids", "text")),
    attention_keys=("text", "image"),
    output_stream="image",
)
_BLOCKS = (
    BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
    BlockList(
        "single_transformer_blocks", returns=("hidden_states",), joins=("encoder_hidden_states", "hidden_states")
    ),
)

FAMILY = Family(
    name="flux2",
    title="FLUX.2 [dev]",
    pipeline_class="Flux2Pipeline",
    transformer_class="Flux2Transformer2DModel",
    vae="AutoencoderKLFlux2",
    repo="black-forest-labs/FLUX.2-dev",
    output="image",
    dtype="bfloat16",
    # The model card's settings: 50 steps, embedded guidance 4.
    defaults=GenerationDefaults(steps=50, height=1024, width=1024, guidance_scale=4.0),
    size_step=16,
    acceleration=Acceleration(
        blocks=_BLOCKS,
        tensor=TensorPlan(from_diffusers=True),
        parallel=_PLAN,
        # None: FLUX.2-dev is guidance-distilled. The pipeline feeds guidance_scale to the transformer's
        # guidance embedding and calls it once per step; it has no negative prompt or second branch.
        cfg=None,
    ),
    heads=48,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=4.0),
    # Flux2Pipeline itself takes reference pictures (`image=`, optional: --image); Klein's pipelines
    # run a Qwen3 text encoder, so they are the flux2-klein family's.
    # Up to ten pictures (FLUX.2 [dev]'s multi-reference limit): --image, then --reference for each next one.
    variants=(Variant("Flux2Pipeline", image="image", optional=("image",), pictures=10),),
)

KLEIN = Family(
    name="flux2-klein",
    title="FLUX.2 [klein]",
    pipeline_class="Flux2KleinPipeline",
    transformer_class="Flux2Transformer2DModel",
    vae="AutoencoderKLFlux2",
    repo="black-forest-labs/FLUX.2-klein-base-4B",
    output="image",
    dtype="bfloat16",
    # The base (undistilled) model: 50 steps, real CFG at guidance 4.
    defaults=GenerationDefaults(steps=50, height=1024, width=1024, guidance_scale=4.0),
    size_step=16,
    acceleration=Acceleration(
        blocks=_BLOCKS,
        tensor=TensorPlan(from_diffusers=True),
        parallel=_PLAN,
        # Real CFG when guidance_scale > 1 on a base model: a second call per step on the empty prompt.
        cfg="calls",
    ),
    heads=24,
    tiny_heads=4,
    tiny=build_tiny_klein,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=4.0),
    # Reference images (`image=`) join the image stream after the generated tokens, as in Kontext.
    # Flux2KleinKVPipeline runs the reference tokens once and keeps their keys and values: its
    # attention processors cut the joint sequence at whole-sequence token counts, so it runs on one
    # process (with the cache, quantization and compile); Ulysses and Ring are refused.
    variants=(
        Variant("Flux2KleinPipeline", image="image", optional=("image",), pictures=10),
        Variant("Flux2KleinInpaintPipeline", image="image", mask="mask_image", same_weights_as="Flux2KleinPipeline"),
        Variant(
            "Flux2KleinKVPipeline",
            image="image",
            optional=("image",),
            not_split=(
                "its attention processors cut text, reference and image tokens at whole-sequence positions, and its "
                "reference K/V cache holds the whole reference"
            ),
        ),
    ),
)
