"""Kandinsky 5.0 Video family: text blocks refine the Qwen2.5-VL prompt, then visual blocks run
self-attention over the video tokens and cross-attention to that text; HunyuanVideo's VAE. The
Image Lite pipelines (T2I, I2I) run the same transformer class on one frame and decode with FLUX.1's VAE.

`build_tiny` makes a seeded, random-weight Kandinsky-5.0-T2V-Lite-shaped pipeline offline for tests;
`build_tiny_t2i` and `build_tiny_i2i` the Image Lite-shaped ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import ParallelPlan, SequenceSplit, TensorPlan, split_layers

if TYPE_CHECKING:
    from diffusers import Kandinsky5T2VPipeline

_Z_DIM = 16  # HunyuanVideo's latent width
# The text-to-video (and image-to-video) pipelines' prompt template; they crop the first 128 tokens
# of its encoding (the system part and the user header), which the tiny tokenizer spends as the real one does.
_TEMPLATE = "\n".join(
    [
        "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
        "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
        "Describe the location of the video, main characters or objects and their action.",
        "Describe the dynamism of the video and presented actions.",
        "Name the visual style of the video: whether it is a professional footage, user generated content, some kind "
        "of animation, video game or scren content.",
        "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
        "Pay attention to the order of key actions shown in the scene.<|im_end|>",
        "<|im_start|>user\n{}<|im_end|>",
    ]
)
_CROP = 128


def _heads(config: Mapping[str, Any]) -> int:
    """The config states no head count: heads are model_dim wide over heads of sum(axes_dims)."""
    return int(config["model_dim"]) // sum(config["axes_dims"])


def random_modulation(transformer: Any) -> None:
    """Random weights for every adaLN modulation, which diffusers starts at zero: each block would
    then add nothing, an identity no test could tell from a broken block. At 0.3 of torch's default
    Linear init, as trained modulation stays near its start: at the full default the tiny model is
    so sensitive that int8 weights alone cost it 57 dB (66 dB at 0.3). Call it inside `seeded`."""
    for module in transformer.modules():
        if type(module).__name__ == "Kandinsky5Modulation":
            module.out_layer.reset_parameters()
            for parameter in module.out_layer.parameters():
                parameter.data.mul_(0.3)


def build_tiny(seed: int = 0) -> "Kandinsky5T2VPipeline":
    """A tiny Kandinsky-5.0-T2V-Lite look-alike: real classes, Lite's config scaled down, random seeded weights.

    Two text and two visual blocks of four 16-wide heads (Lite: 2 and 32 blocks of 28 heads of 64)
    keep what the cache and context-parallel code see; `visual_cond` as on Lite, so the
    image-to-video pipeline runs the same transformer. 5 frames at 64x64 give 2x8x8 latents, i.e.
    32 video tokens after (1, 2, 2) patching. A Qwen2 tokenizer takes the Qwen2-VL processor's
    place (both pipelines pass it text alone, and a processor cannot be saved without its
    torchvision-only video processor); it spends as many tokens on the prompt template's system
    part as the real one, which the pipeline crops off. CLIP gives the pooled vector.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline

    from accel.models.tiny.seeding import finish, seeded  # heavy (transformers): only when building
    from accel.models.tiny.vaes import hunyuan_video_vae

    base = seed * 8
    tokenizer, text_encoder, tokenizer_2, text_encoder_2, transformer = _tiny_text_and_transformer(
        _TEMPLATE, _CROP, base, visual_cond=True
    )
    with seeded(base + 4):
        vae = finish(hunyuan_video_vae())
    # Kandinsky 5's scheduler config: flow matching with a fixed shift of 5.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0)
    pipe = Kandinsky5T2VPipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=scheduler,
    )
    prefix = len(tokenizer(pipe.prompt_template.split("{}")[0]).input_ids)
    if pipe.prompt_template != _TEMPLATE or prefix != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny Kandinsky 5: the pipeline's prompt template prefix is {prefix} tokens here, "
            f"but the pipeline crops {pipe.prompt_template_encode_start_idx}"
        )
    return pipe


def _tiny_text_and_transformer(template: str, crop: int, base: int, visual_cond: bool) -> tuple[Any, ...]:
    """The tiny Qwen2.5-VL and CLIP text stacks (a tokenizer spending `crop` tokens on the template's
    system part, as the real one does) and the transformer over them: two text and two visual blocks
    of four 16-wide heads, axes (4, 6, 6) summing to the head width in the real (16, 24, 24) and Image
    Lite (32, 48, 48) proportions. One seed per component from `base`, so each part is reproducible alone."""
    from diffusers import Kandinsky5Transformer3DModel

    from accel.models.tiny.clip import clip_text_model, clip_tokenizer
    from accel.models.tiny.qwen import qwen25_vl_model, qwen2_tokenizer
    from accel.models.tiny.seeding import finish, seeded

    tokenizer = qwen2_tokenizer(template, prefix_tokens=crop)
    text_encoder = qwen25_vl_model(tokenizer, seed=base + 1)
    tokenizer_2 = clip_tokenizer()
    text_encoder_2 = clip_text_model(tokenizer_2, seed=base + 2)
    with seeded(base + 3):
        transformer = finish(
            Kandinsky5Transformer3DModel(
                in_visual_dim=_Z_DIM,
                out_visual_dim=_Z_DIM,
                in_text_dim=text_encoder.config.text_config.hidden_size,
                in_text_dim2=text_encoder_2.config.hidden_size,
                time_dim=32,
                patch_size=(1, 2, 2),
                model_dim=64,
                ff_dim=128,
                num_text_blocks=2,
                num_visual_blocks=2,
                axes_dims=(4, 6, 6),
                visual_cond=visual_cond,
            )
        )
        random_modulation(transformer)
    return tokenizer, text_encoder, tokenizer_2, text_encoder_2, transformer


def _image_template(pipeline_class: type) -> tuple[str, int]:
    """An image pipeline's prompt template and the tokens it crops off the front, as the installed
    diffusers sets them in `__init__` (read from an instance holding no components)."""
    empty = pipeline_class(*([None] * 7))
    return empty.prompt_template, empty.prompt_template_encode_start_idx


# The sizes the tiny image pipelines make as asked: every side a multiple of 16 (8x the VAE's
# downsampling, times the 2x2 patches) up to 256. The real pipelines snap any other size to the
# closest aspect ratio of seven near-megapixel resolutions (`resolutions`, set per instance in
# `__init__`); the tiny ones keep that snapping for sizes off this grid.
_TINY_IMAGE_SIZES = [(width, height) for width in range(16, 257, 16) for height in range(16, 257, 16)]


def _build_tiny_image(pipeline_name: str, seed: int, picture: bool) -> Any:
    """A tiny Kandinsky-5.0-Image-Lite look-alike for `pipeline_name` (T2I or I2I): Image Lite's
    config scaled down as the video one (2 text and 2 visual blocks of four 16-wide heads; Image Lite
    has 2 and 50 blocks of 20 heads of 128, axes (32, 48, 48)), FLUX.1's VAE narrowed, and the tiny
    Qwen2.5-VL and CLIP text stacks. The tokenizer spends as many tokens on the template's system
    part as the real one (40 for T2I, 54 for I2I), which the pipeline crops off. With an input
    `picture` (I2I), its latents join the transformer's input (`visual_cond`, Image Lite I2I's channel
    instruction) and Qwen2.5-VL sees it through a Qwen2-VL processor in the `tokenizer` slot."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from accel.models.tiny.qwen import qwen2_vl_processor
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.vaes import flux1_vae

    cls = getattr(diffusers, pipeline_name)
    template, crop = _image_template(cls)
    base = seed * 8
    tokenizer, text_encoder, tokenizer_2, text_encoder_2, transformer = _tiny_text_and_transformer(
        template, crop, base, visual_cond=picture
    )
    with seeded(base + 4):
        vae = finish(flux1_vae())
    pipe = cls(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=qwen2_vl_processor(tokenizer) if picture else tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=5.0
        ),  # the video pipelines' flow shift
    )
    pipe.resolutions = list(_TINY_IMAGE_SIZES)
    return pipe


def build_tiny_t2i(seed: int = 0) -> Any:
    """Tiny Kandinsky5T2IPipeline: the latents alone go in (no condition channels, as on Image Lite T2I)."""
    return _build_tiny_image("Kandinsky5T2IPipeline", seed, picture=False)


def build_tiny_i2i(seed: int = 0) -> Any:
    """Tiny Kandinsky5I2IPipeline: the picture's latents and a ones channel join the noise latents, and
    Qwen2.5-VL sees the picture."""
    return _build_tiny_image("Kandinsky5I2IPipeline", seed, picture=True)


# The image pipelines' own example: 1024x1024, 50 steps, guidance 3.5 (their call's default).
_IMAGE_DEFAULTS = GenerationDefaults(steps=50, height=1024, width=1024, guidance_scale=3.5)

TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers(
            "visual_transformer_blocks.*.self_attention", (("to_query", "to_key", "to_value"), ("out_layer",))
        ),
        **split_layers(
            "visual_transformer_blocks.*.cross_attention", (("to_query", "to_key", "to_value"), ("out_layer",))
        ),
        **split_layers("visual_transformer_blocks.*.feed_forward", (("in_layer",), ("out_layer",))),
    },
    per_rank=("num_heads",),
)


FAMILY = Family(
    name="kandinsky5",
    title="Kandinsky 5.0 Video",
    pipeline_class="Kandinsky5T2VPipeline",
    transformer_class="Kandinsky5Transformer3DModel",
    vae="AutoencoderKLHunyuanVideo",
    repo="kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
    output="video",
    dtype="bfloat16",
    # The pipeline's own example: 512x768, 121 frames (5 s at 24 fps), 50 steps, guidance 5.
    defaults=GenerationDefaults(steps=50, height=512, width=768, frames=121, guidance_scale=5.0),
    size_step=16,
    frame_step=4,
    acceleration=Acceleration(
        # The visual blocks only: the text blocks see no latents, so their residual says nothing about
        # how far the video moved between steps; they run every call (two of 34 blocks on Lite).
        blocks=(BlockList("visual_transformer_blocks", returns=("visual_embed",)),),
        primary_stream="visual_embed",
        heads_of_config=_heads,
        # The video tokens are cut where the visual blocks start, with the rotary table every visual
        # block gets (the same tensor: cut once); the text stays whole on every rank, so the text blocks
        # and the cross-attention run unchanged. The transformer reshapes the tokens to the video grid
        # right after the last visual block, so the output is gathered there.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("visual_embed", "video", dim=1, module="visual_transformer_blocks.0"),
                SequenceSplit("rope", "video", dim=1, module="visual_transformer_blocks.*"),
            ),
            attention_keys=("video",),
            output_stream="video",
            output_dim=1,
            output_module="visual_transformer_blocks.-1",
            local_attention=("text_transformer_blocks.*", "visual_transformer_blocks.*.cross_attention"),
            # The 10 s checkpoints' NABLA attention: a flex-attention block mask built from the whole sequence.
            refuses=(
                (
                    "attention_type",
                    "nabla",
                    "(NABLA sparse attention, a block mask over the whole sequence) cannot be split over ranks",
                ),
            ),
        ),
        # CFG with the default negative prompt whenever guidance_scale > 1: a second transformer call per step.
        cfg="calls",
    ),
    frames_arg="num_frames",
    fps=24,
    heads=28,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    # Image to video: the picture's latents replace the first latent frame (and its condition
    # channels), so the tokens and the plan are the text-to-video ones. It needs 17 frames or more:
    # the pipeline renormalises the first 4 latent frames against those after them (NaN without).
    # Text- and image-to-image (Kandinsky 5.0 Image Lite checkpoints): the same transformer class on
    # one latent frame, so the video plan cuts the picture's tokens; they make pictures through
    # FLUX.1's AutoencoderKL (its parallel decode is FLUX's). I2I's picture joins the latents as
    # condition channels, as I2V's first frame does, and Qwen2.5-VL sees it too. The pipelines snap the
    # size asked to the closest aspect ratio of seven near-megapixel resolutions (their example: 1024²).
    # A batch's prompts change each other's outputs (the tiny model's by up to half the range).
    batches=False,
    variants=(
        Variant("Kandinsky5I2VPipeline", image="image"),
        Variant(
            "Kandinsky5T2IPipeline", output="image", vae="AutoencoderKL", defaults=_IMAGE_DEFAULTS, tiny=build_tiny_t2i
        ),
        Variant(
            "Kandinsky5I2IPipeline",
            image="image",
            output="image",
            vae="AutoencoderKL",
            defaults=_IMAGE_DEFAULTS,
            tiny=build_tiny_i2i,
        ),
    ),
)
