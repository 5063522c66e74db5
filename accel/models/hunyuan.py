"""HunyuanVideo family: double-stream then single-stream blocks, both returning (video, text).

`build_tiny` makes a seeded, random-weight HunyuanVideo-shaped pipeline offline for tests;
`build_tiny_skyreels` its SkyReels-V1 image-to-video twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    JOINT_ATTENTION,
    LeadingCount,
    Packed,
    ParallelPlan,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import HunyuanSkyreelsImageToVideoPipeline, HunyuanVideoImageToVideoPipeline, HunyuanVideoPipeline

_LATENT_CHANNELS = 16  # HunyuanVideo's latent width


def _tiny_transformer(seed: int, text_dim: int, pooled_dim: int, **config: Any) -> Any:
    """HunyuanVideo's transformer scaled down to two double and two single blocks of four 16-wide
    heads; `config` overrides (an image-to-video model's input channels)."""
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import HunyuanVideoTransformer3DModel

    settings: dict[str, Any] = dict(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=4,
        attention_head_dim=16,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=1,
        mlp_ratio=4.0,
        patch_size=2,
        patch_size_t=1,
        qk_norm="rms_norm",
        guidance_embeds=True,  # HunyuanVideo is guidance-distilled
        text_embed_dim=text_dim,
        pooled_projection_dim=pooled_dim,
        rope_theta=256.0,
        rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
    )
    with seeded(seed):
        return finish(HunyuanVideoTransformer3DModel(**{**settings, **config}))


def build_tiny(seed: int = 0) -> "HunyuanVideoPipeline":
    """A tiny HunyuanVideo look-alike: real classes, HunyuanVideo configs scaled down, random seeded weights.

    Two double and two single blocks with four heads keep the structure the cache and
    context-parallel code see on the real model; 5 frames at 64x64 give 2x8x8 latents, i.e. 32
    video tokens after (1, 2, 2) patching, next to the Llama text tokens (256 by default: the
    pipeline pads to `max_sequence_length` after cropping its prompt template's prefix).
    """
    from accel.models.tiny.clip import clip_text_model, clip_tokenizer  # heavy (transformers): only when building
    from accel.models.tiny.llama import llama_model, llama_tokenizer
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.vaes import hunyuan_video_vae
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    # Offsets: 1-2 text encoders, 3 transformer, 4 VAE, 5 build_tiny_skyreels' transformer,
    # 6-7 build_tiny_i2v's LLaVA and transformer.
    base = seed * 8
    # The pipeline encodes `template.format(prompt)` and drops a fixed `crop_start` tokens (the
    # system prompt and headers): the tokenizer gives the template's words one token each, as
    # Llama 3's does, so the crop lands exactly at the prompt.
    template, crop_start = DEFAULT_PROMPT_TEMPLATE["template"], DEFAULT_PROMPT_TEMPLATE["crop_start"]
    tokenizer = llama_tokenizer(template)
    prefix_tokens = len(tokenizer(template.split("{}")[0]).input_ids)
    if prefix_tokens != crop_start:
        raise RuntimeError(
            f"tiny HunyuanVideo tokenizer: the prompt template's prefix is {prefix_tokens} tokens, "
            f"but the pipeline crops {crop_start}"
        )
    tokenizer_2 = clip_tokenizer()
    text_encoder = llama_model(tokenizer, seed=base + 1)
    text_encoder_2 = clip_text_model(tokenizer_2, seed=base + 2)

    transformer = _tiny_transformer(
        base + 3, text_dim=text_encoder.config.hidden_size, pooled_dim=text_encoder_2.config.hidden_size
    )
    with seeded(base + 4):
        vae = finish(hunyuan_video_vae())
    # HunyuanVideo's scheduler config: flow matching with a fixed shift of 7.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0)
    return HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def build_tiny_skyreels(seed: int = 0) -> "HunyuanSkyreelsImageToVideoPipeline":
    """A tiny SkyReels-V1-Hunyuan-I2V look-alike: build_tiny's text stacks, VAE and scheduler, another transformer.

    As SkyReels' I2V transformer, it reads 32 channels (the 16 noise latents, then the picture's
    latents followed by zero frames) and predicts 16: the token count is the text-to-video one.
    """
    from diffusers import HunyuanSkyreelsImageToVideoPipeline

    pipe = build_tiny(seed)
    transformer = _tiny_transformer(
        seed * 8 + 5,
        text_dim=pipe.text_encoder.config.hidden_size,
        pooled_dim=pipe.text_encoder_2.config.hidden_size,
        in_channels=2 * _LATENT_CHANNELS,  # noise + picture latents
    )
    return HunyuanSkyreelsImageToVideoPipeline(
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        transformer=transformer,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        text_encoder_2=pipe.text_encoder_2,
        tokenizer_2=pipe.tokenizer_2,
    )


def build_tiny_i2v(seed: int = 0) -> "HunyuanVideoImageToVideoPipeline":
    """A tiny HunyuanVideo-I2V look-alike (its default, 16-channel "token_replace" model): build_tiny's
    CLIP text tower, VAE and scheduler, a LLaVA image-text encoder and another transformer.

    The picture conditions twice. LLaVA reads the prompt template's "<image>" placeholder as the
    picture's 576 CLIP patch tokens (a 336 px CLIP tower of 14 px patches, as llava-llama-3-8b's),
    every fourth of which joins the text stream ahead of the prompt: 144 + 252 = 396 text tokens.
    And the picture's latents replace the first latent frame, whose tokens the transformer
    modulates as a clean frame (timestep 0) in every block: the plan rebases that token count
    to each rank's shard (LeadingCount).
    """
    from accel.models.tiny.clip import clip_image_processor
    from accel.models.tiny.llama import LLAVA_IMAGE_SIZE, llama_tokenizer, llava_model
    from diffusers import HunyuanVideoImageToVideoPipeline
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_image2video import DEFAULT_PROMPT_TEMPLATE

    base = seed * 8
    pipe = build_tiny(seed)
    # As build_tiny's: the template's words one token each, so the fixed crop lands at the prompt,
    # and "<image>" one token at the template's `image_emb_start`.
    template = DEFAULT_PROMPT_TEMPLATE["template"]
    tokenizer = llama_tokenizer(template, extra_specials=("<image>",))
    ids = tokenizer(template.split("{}")[0]).input_ids
    image_at = ids.index(tokenizer.convert_tokens_to_ids("<image>"))
    if (len(ids), image_at) != (DEFAULT_PROMPT_TEMPLATE["crop_start"], DEFAULT_PROMPT_TEMPLATE["image_emb_start"]):
        raise RuntimeError(
            f"tiny HunyuanVideo I2V tokenizer: the prompt template's prefix is {len(ids)} tokens with <image> at "
            f"{image_at}, "
            f"but the pipeline crops {DEFAULT_PROMPT_TEMPLATE['crop_start']} with it at "
            f"{DEFAULT_PROMPT_TEMPLATE['image_emb_start']}"
        )
    text_encoder = llava_model(tokenizer, seed=base + 6)
    transformer = _tiny_transformer(
        base + 7,
        text_dim=text_encoder.config.text_config.hidden_size,
        pooled_dim=pipe.text_encoder_2.config.hidden_size,
        image_condition_type="token_replace",  # HunyuanVideo-I2V's; its 33-channel sibling concatenates latents
    )
    return HunyuanVideoImageToVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=pipe.vae,
        scheduler=pipe.scheduler,
        text_encoder_2=pipe.text_encoder_2,
        tokenizer_2=pipe.tokenizer_2,
        image_processor=clip_image_processor(LLAVA_IMAGE_SIZE),
    )


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn", JOINT_ATTENTION),
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
        **split_layers("transformer_blocks.*.ff_context", DIFFUSERS_MLP),
        **split_layers("single_transformer_blocks.*.attn", (("to_q", "to_k", "to_v"), ())),
        "single_transformer_blocks.*.proj_mlp": "colwise",
        # Its input is the attention output and the MLP's hidden width side by side (mlp_ratio 4).
        "single_transformer_blocks.*.proj_out": Packed("rowwise", (1, 4)),
    },
    per_rank=("heads",),
)


def joint_plan(stream: str, leading_counts: tuple[LeadingCount, ...] = ()) -> ParallelPlan:
    """The context-parallel plan of a Hunyuan double- then single-stream transformer (HunyuanVideo's,
    HunyuanImage 2.1's): `stream` (the latent tokens) and the text are both cut where the blocks
    start, after the token refiner, which runs whole on every rank (its attention stays within the
    prompt); the key mask over `stream` then text that the forward hands every block is cut stream by
    stream, the rotary table with `stream`. The output is gathered where the final projection returns."""
    return ParallelPlan(
        splits=(
            SequenceSplit("output", stream, dim=0, module="rope"),
            SequenceSplit("hidden_states", stream, dim=1, module="transformer_blocks.0"),
            SequenceSplit("encoder_hidden_states", "text", dim=1, module="transformer_blocks.0"),
            *(
                SequenceSplit("attention_mask", (stream, "text"), dim=-1, module=f"{blocks}.*")
                for blocks in ("transformer_blocks", "single_transformer_blocks")
            ),
        ),
        attention_keys=(stream, "text"),
        output_stream=stream,
        output_dim=1,
        output_module="proj_out",
        local_attention=("context_embedder",),
        leading_counts=leading_counts,
    )


FAMILY = Family(
    name="hunyuan",
    title="HunyuanVideo",
    pipeline_class="HunyuanVideoPipeline",
    transformer_class="HunyuanVideoTransformer3DModel",
    vae="AutoencoderKLHunyuanVideo",
    repo="hunyuanvideo-community/HunyuanVideo",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=720, width=1280, frames=129, guidance_scale=6.0),
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        blocks=(
            BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
            BlockList("single_transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),
        ),
        # The image-to-video model's token-replace blocks modulate the first latent frame's tokens apart,
        # counted by `num_tokens`: each rank gets the count within its own shard.
        tensor=TENSOR_PLAN,
        parallel=joint_plan(
            "video",
            leading_counts=tuple(
                LeadingCount("num_tokens", "video", module=blocks, when=("image_condition_type", "token_replace"))
                for blocks in ("transformer_blocks.*", "single_transformer_blocks.*")
            ),
        ),
        cfg="calls",
        cfg_scale="true_cfg_scale",
        cfg_needs_negative=True,
    ),
    frames_arg="num_frames",
    fps=15,
    heads=24,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=6.0),
    # HunyuanVideo is guidance-distilled: real CFG runs only with true_cfg_scale > 1 and a negative
    # prompt, as a second transformer call per step.
    true_cfg=True,
    variants=(
        # SkyReels-V1 image-to-video concatenates the picture's latents in channels: the same tokens
        # and plan. Its own true CFG default (true_cfg_scale 6) runs once a negative prompt is given.
        Variant(
            "HunyuanSkyreelsImageToVideoPipeline",
            image="image",
            tiny=build_tiny_skyreels,
            transformer_config=(("in_channels", 2 * _LATENT_CHANNELS),),
        ),
        # HunyuanVideo-I2V: the picture through LLaVA into the text stream and as the first latent
        # frame (token replace; the 33-channel checkpoint concatenates its latents instead).
        Variant("HunyuanVideoImageToVideoPipeline", image="image", tiny=build_tiny_i2v),
    ),
)
