"""HunyuanImage 2.1 family: a 17B text-to-image DiT of double-stream then single-stream blocks, both
returning (image, text), after a token refiner on the prompt; a Qwen2.5-VL prompt encoder, a ByT5 glyph
encoder for the text in quotes to render, and a 32x VAE whose latents are the tokens (patch 1).

Its classifier-free guidance is run by the pipeline's guider (AdaptiveProjectedMixGuidance: plain CFG
for the first steps, adaptive projected guidance after), or by its `ocr_guider` for prompts with
quoted text, as two transformer calls per step; the distilled checkpoint has no guider and embeds its
guidance scale instead. The refiner pipeline runs the same transformer class on 3-D latents (a
picture's latents concatenated in channels), with its own VAE.

`build_tiny` makes a seeded, random-weight HunyuanImage-2.1-shaped pipeline offline for tests;
`build_tiny_distilled` its guidance-distilled twin, `build_tiny_refiner` the refiner's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.models.hunyuan import TENSOR_PLAN, joint_plan

if TYPE_CHECKING:
    from diffusers import HunyuanImagePipeline, HunyuanImageRefinerPipeline

# The tiny VAE's latent channels (the real one has 64).
_LATENTS = 16
# The refiner's VAE latent channels (the real one has 32); its transformer reads four times as many
# (noise and picture latents, two latent frames folded into channels each) and predicts two.
_REFINER_LATENTS = 4
# The pipelines' prompt templates: the base one's first 34 tokens (the system prompt) are cropped off;
# the refiner's is a Llama-3-style template of which the pipeline crops a fixed 36 tokens.
_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
_REFINER_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\n{}<|eot_id|>"
)


def _guider() -> Any:
    """The guider of HunyuanImage-2.1-Diffusers (its documented config): CFG at scale 3.5 for the first
    five steps, then adaptive projected guidance at scale 10 with momentum -0.5."""
    from diffusers import AdaptiveProjectedMixGuidance

    return AdaptiveProjectedMixGuidance(
        guidance_scale=3.5,
        adaptive_projected_guidance_scale=10.0,
        adaptive_projected_guidance_momentum=-0.5,
        adaptive_projected_guidance_rescale=10.0,
        adaptive_projected_guidance_start_step=5,
    )


def _text_parts(base: int) -> dict[str, Any]:
    """The Qwen2.5-VL prompt stack (seed `base + 1`) and the ByT5 glyph stack (`base + 2`)."""
    from accel.models.tiny.qwen import qwen25_vl_model, qwen2_tokenizer  # heavy (transformers): only when building
    from accel.models.tiny.t5 import t5_encoder
    from transformers import ByT5Tokenizer

    # The tokenizer builds every word of both templates as one token: the base template's prefix is
    # then 34 tokens, as with Qwen2.5-VL's vocabulary, so the pipeline's fixed crop lands at the prompt.
    tokenizer = qwen2_tokenizer(_TEMPLATE + _REFINER_TEMPLATE)
    # Three layers: the pipeline takes the third-to-last hidden state, then a layer's output.
    text_encoder = qwen25_vl_model(tokenizer, seed=base + 1, layers=3)
    tokenizer_2 = ByT5Tokenizer()  # bytes are its tokens: no vocabulary file
    text_encoder_2 = t5_encoder(tokenizer_2, seed=base + 2)  # type: ignore[arg-type]
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


def _tiny_transformer(seed: int, text_dim: int, **config: Any) -> Any:
    """HunyuanImage 2.1's transformer scaled down to two double and two single blocks of four 16-wide
    heads and one refiner block; `config` overrides (the refiner's 3-D patches and channels)."""
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import HunyuanImageTransformer2DModel

    settings: dict[str, Any] = dict(
        in_channels=_LATENTS,
        out_channels=_LATENTS,
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=1,
        patch_size=(1, 1),
        text_embed_dim=text_dim,
        rope_axes_dim=(8, 8),  # sums to attention_head_dim, as (64, 64) does to 128
    )
    with seeded(seed):
        return finish(HunyuanImageTransformer2DModel(**{**settings, **config}))


def _checked(pipe: Any) -> Any:
    """`pipe`, once its tokenizer is known to spend exactly the cropped tokens on the system prompt."""
    spent = len(pipe.tokenizer(pipe.prompt_template_encode.split("{}")[0]).input_ids)
    if spent != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny HunyuanImage tokenizer: the system prompt is {spent} tokens, "
            f"but the pipeline crops {pipe.prompt_template_encode_start_idx}"
        )
    return pipe


def build_tiny(seed: int = 0) -> "HunyuanImagePipeline":
    """A tiny HunyuanImage 2.1 look-alike: real classes, configs scaled down, random seeded weights.

    Two double and two single blocks of four 16-wide heads. The VAE keeps the real 32x compression
    (six levels of 32 channels, the deepest 64; pixel-shuffle up-sampling), so 64x64 images give 2x2
    latents, 4 image tokens (patch 1), next to the text stream the transformer joins: 128 ByT5 and
    1000 Qwen tokens (the pipeline's padding lengths), valid ones first. Real CFG: the guider calls the
    transformer on the prompt, then on the negative prompt, every step; the `ocr_guider` (the same
    config) takes over for prompts with quoted text.
    """
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    # Offsets: 1-2 text encoders, 3 transformer, 4 VAE, 5-6 build_tiny_refiner's transformer and VAE,
    # 7 build_tiny_distilled's transformer.
    base = seed * 8
    text = _text_parts(base)
    transformer = _tiny_transformer(
        base + 3,
        text_dim=text["text_encoder"].config.text_config.hidden_size,
        text_embed_2_dim=text["text_encoder_2"].config.d_model,
    )
    with seeded(base + 4):
        # HunyuanImage 2.1's VAE shape: 32x spatial compression in five pixel-shuffle steps. Its
        # GroupNorms take 32 groups, so 32 channels a level is the narrowest; the deepest level has 64,
        # two a group, so a 32 px picture's 1x1 latent still normalises (one value a group is refused).
        vae = finish(
            AutoencoderKLHunyuanImage(
                in_channels=3,
                out_channels=3,
                latent_channels=_LATENTS,
                block_out_channels=(32,) * 5 + (64,),
                layers_per_block=1,
                spatial_compression_ratio=32,
                sample_size=64,
                scaling_factor=0.75289,
            )
        )
    return _checked(
        HunyuanImagePipeline(
            # Flow matching with a fixed shift (the checkpoint's scheduler config was not at hand: any shift
            # gives a tiny run the same structure).
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0),
            vae=vae,
            transformer=transformer,
            guider=_guider(),
            ocr_guider=_guider(),
            **text,
        )
    )


def build_tiny_distilled(seed: int = 0) -> "HunyuanImagePipeline":
    """build_tiny as HunyuanImage-2.1-Distilled: its transformer embeds the guidance scale and MeanFlow's
    second timestep (the next step's), and it holds no guider: one transformer call per step."""
    from diffusers import HunyuanImagePipeline

    pipe = build_tiny(seed)
    transformer = _tiny_transformer(
        seed * 8 + 7,
        text_dim=pipe.text_encoder.config.text_config.hidden_size,
        text_embed_2_dim=pipe.text_encoder_2.config.d_model,
        guidance_embeds=True,
        use_meanflow=True,
    )
    return HunyuanImagePipeline(**{**pipe.components, "transformer": transformer, "guider": None, "ocr_guider": None})


def build_tiny_refiner(seed: int = 0) -> "HunyuanImageRefinerPipeline":
    """A tiny HunyuanImage 2.1 refiner look-alike: build_tiny's Qwen stack, another transformer and VAE.

    The refiner encodes the picture with a causal 3-D VAE (16x spatial, 4x temporal), folds its
    first latent frame twice into channels, and the transformer reads noise and those latents side
    by side in 3-D patches of 1: 64x64 gives 4x4 = 16 image tokens. It is guidance-distilled (no
    guider: one call per step, the scale embedded). diffusers crops a fixed 36 tokens off its
    Llama-3-style template; the tiny tokenizer spends 65 on the template's prefix (Llama's header
    tokens are no Qwen specials: a Qwen vocabulary spells them out too), so the prefix's tail stays
    with the prompt.
    """
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import AutoencoderKLHunyuanImageRefiner, FlowMatchEulerDiscreteScheduler, HunyuanImageRefinerPipeline

    base = seed * 8
    text = _text_parts(base)
    transformer = _tiny_transformer(
        base + 5,
        text_dim=text["text_encoder"].config.text_config.hidden_size,
        in_channels=4 * _REFINER_LATENTS,
        out_channels=2 * _REFINER_LATENTS,
        patch_size=(1, 1, 1),
        rope_axes_dim=(4, 6, 6),
        guidance_embeds=True,
    )
    with seeded(base + 6):
        vae = finish(
            AutoencoderKLHunyuanImageRefiner(
                latent_channels=_REFINER_LATENTS,
                block_out_channels=(8, 8, 16, 16, 16),
                layers_per_block=1,
            )
        )
    return HunyuanImageRefinerPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=4.0),
        vae=vae,
        transformer=transformer,
        text_encoder=text["text_encoder"],
        tokenizer=text["tokenizer"],
    )


FAMILY = Family(
    name="hunyuanimage",
    title="HunyuanImage 2.1",
    pipeline_class="HunyuanImagePipeline",
    transformer_class="HunyuanImageTransformer2DModel",
    vae="AutoencoderKLHunyuanImage",
    repo="hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
    output="image",
    dtype="bfloat16",
    # diffusers' documented use: 50 steps at 2048x2048, the guider's scale 3.5 (the distilled
    # checkpoint takes 8 steps and its distilled_guidance_scale, 3.25 by default, instead).
    defaults=GenerationDefaults(steps=50, height=2048, width=2048, guidance_scale=3.5),
    # Latents are pixels / 32 (rounded down) and tokens are latents: multiples of 32 are made as asked
    # (diffusers warns below multiples of 64, but resizes nothing).
    size_step=32,
    prompt_tokenizers=("tokenizer",),  # ByT5 reads only the quoted text to render
    acceleration=Acceleration(
        blocks=(
            BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
            BlockList("single_transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
        ),
        # The blocks are HunyuanVideo's, module for module: the same tensor split.
        tensor=TENSOR_PLAN,
        # HunyuanVideo's plan too, on image tokens (see joint_plan).
        parallel=joint_plan("image"),
        # The guider (its guidance_scale; accel sets it, on the ocr_guider too, from [generate]
        # guidance_scale) runs the prompt and the negative prompt as two transformer calls per step. That
        # scale drives plain CFG for the first six steps (and whether guidance runs at all); adaptive
        # projected guidance after them uses the guider's own adaptive_projected_guidance_scale.
        cfg="calls",
    ),
    heads=28,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=3.5),
    # diffusers' pipeline fails on a batch of several prompts (a RuntimeError in a reshape).
    batches=False,
    variants=(
        # The refiner: the picture's latents concatenated in channels, 3-D latents of one frame; the
        # same tokens and plan. Guidance-distilled, 4 steps by default.
        Variant(
            "HunyuanImageRefinerPipeline",
            image="image",
            tiny=build_tiny_refiner,
            vae="AutoencoderKLHunyuanImageRefiner",
            defaults=GenerationDefaults(steps=4, height=2048, width=2048),
        ),
    ),
)
