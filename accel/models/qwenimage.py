"""Qwen-Image family: a double-stream MMDiT (every block joint over text then image) with a
Qwen2.5-VL text encoder and a Wan-style causal VAE; the edit pipelines add the input picture's
latents to the image sequence and show the picture to the text encoder.

`build_tiny` makes a seeded, random-weight Qwen-Image-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant, img2img_and_inpaint
from accel.parallel.plan_format import FromDiffusers, SequenceSplit, TensorPlan

if TYPE_CHECKING:
    from diffusers import QwenImagePipeline

# The pipelines' prompt template (its first 34 tokens, the system prompt, are cropped off).
_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
_EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the "
    "user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
_Z_DIM = 16


def build_tiny(seed: int = 0, pipeline: str = "QwenImagePipeline", **transformer: Any) -> "QwenImagePipeline":
    """A tiny Qwen-Image look-alike: real classes, configs scaled down, random seeded weights.

    Two blocks of four 16-wide heads; 64x64 images give 8x8 latents, 4x4 = 16 image tokens after
    2x2 patching, next to the prompt's tokens (the template's prefix cropped). `pipeline` builds an
    edit pipeline on the same parts, with a Qwen2-VL processor that shows the picture to the text
    encoder in a few patches. `transformer` overrides transformer settings.
    """
    import diffusers
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    from accel.models.tiny.qwen import qwen25_vl_model, qwen2_tokenizer, qwen2_vl_processor
    from accel.models.tiny.seeding import finish, seeded

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = qwen2_tokenizer(_TEMPLATE + _EDIT_TEMPLATE)
    text_encoder = qwen25_vl_model(tokenizer, seed=base + 1)
    settings: dict[str, Any] = dict(
        patch_size=2,
        in_channels=_Z_DIM * 4,  # latents are packed in 2x2 patches
        out_channels=_Z_DIM,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=text_encoder.config.text_config.hidden_size,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
    )
    with seeded(base + 2):
        model = finish(QwenImageTransformer2DModel(**{**settings, **transformer}))
    with seeded(base + 3):
        # Qwen-Image's VAE shape (Wan 2.1's): 8x spatial compression, 16 latent channels.
        vae = finish(
            AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=_Z_DIM,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=1,
                attn_scales=[],
                temperal_downsample=[False, True, True],
            )
        )
    # Qwen-Image's scheduler config: exponential dynamic shift with a terminal sigma.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    parts_of_pipe: dict[str, Any] = dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model
    )
    if pipeline != "QwenImagePipeline":
        parts_of_pipe["processor"] = qwen2_vl_processor(tokenizer)
    return getattr(diffusers, pipeline)(**parts_of_pipe)


def build_tiny_edit(seed: int = 0) -> Any:
    return build_tiny(seed, "QwenImageEditPipeline")


def build_tiny_edit_plus(seed: int = 0) -> Any:
    """Qwen-Image-Edit-2511's shape: `zero_cond_t` gives the input picture's tokens timestep 0, so
    every block takes a per-token `modulate_index` that is cut with the image tokens."""
    return build_tiny(seed, "QwenImageEditPlusPipeline", zero_cond_t=True)


TENSOR_PLAN = TensorPlan(from_diffusers=True)


FAMILY = Family(
    name="qwenimage",
    title="Qwen-Image",
    pipeline_class="QwenImagePipeline",
    transformer_class="QwenImageTransformer2DModel",
    vae="AutoencoderKLQwenImage",
    repo="Qwen/Qwen-Image",
    output="image",
    dtype="bfloat16",
    # Qwen's own examples: 50 steps, true CFG 4 with a blank negative prompt, 1328x1328.
    defaults=GenerationDefaults(steps=50, height=1328, width=1328, negative_prompt=" ", true_cfg_scale=4.0),
    size_step=16,
    acceleration=Acceleration(
        blocks=(BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),),
        # diffusers' _cp_plan cuts the image and text tokens at the first block, the per-token text mask
        # and modulate index at every block, and the two tables the rotary module returns (image, then
        # text); it gathers at proj_out. Every attention is joint over (text, image). The ControlNet
        # pipelines pass per-block residuals for the image tokens (a list of whole-sequence tensors,
        # added after each block): accel cuts them as the image, which diffusers' plan does not.
        tensor=TENSOR_PLAN,
        parallel=FromDiffusers(
            streams=(
                ("hidden_states", "image"),
                ("encoder_hidden_states", "text"),
                ("modulate_index", "image"),
                ("encoder_hidden_states_mask", "text"),
                ("pos_embed[0]", "image"),
                ("pos_embed[1]", "text"),
            ),
            attention_keys=("text", "image"),
            output_stream="image",
            extra_splits=(SequenceSplit("controlnet_block_samples", "image", dim=1),),
        ),
        # True CFG (true_cfg_scale > 1 with a negative prompt): a second transformer call per step.
        cfg="calls",
        cfg_scale="true_cfg_scale",
        cfg_needs_negative=True,
    ),
    true_cfg=True,
    heads=24,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, negative_prompt=" ", true_cfg_scale=4.0),
    # The edit pipelines put the input picture's latents after the generated ones in the image stream.
    variants=(
        *img2img_and_inpaint("QwenImagePipeline", "QwenImage"),
        Variant("QwenImageEditPipeline", image="image", tiny=build_tiny_edit),
        # Several pictures to combine (Qwen-Image-Edit-2509: one to three): --image, then --reference.
        Variant("QwenImageEditPlusPipeline", image="image", tiny=build_tiny_edit_plus, pictures=3),
        Variant(
            "QwenImageEditInpaintPipeline",
            image="image",
            mask="mask_image",
            tiny=build_tiny_edit,
            same_weights_as="QwenImageEditPipeline",
        ),
    ),
)
