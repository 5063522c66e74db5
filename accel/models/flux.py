"""FLUX.1 family: an MMDiT with double-stream (joint text/image) and single-stream blocks.

`build_tiny` makes a seeded, random-weight FLUX.1-dev-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant, img2img_and_inpaint
from accel.parallel.plan_format import FromDiffusers, SequenceSplit, TensorPlan

if TYPE_CHECKING:
    from diffusers import FluxPipeline


def build_tiny(seed: int = 0, pipeline: str = "FluxPipeline", conditions: int = 0) -> "FluxPipeline":
    """A tiny FLUX.1-dev look-alike: real classes, FLUX configs scaled down, random seeded weights.

    Two double and two single blocks with four heads keep the structure the cache and
    context-parallel code see on the real model; 64x64 images give 16 image tokens next to the
    text tokens (512 by default, as the pipeline pads T5 to `max_sequence_length`).
    `conditions` extra packed input channels make the Fill (320: masked image and mask) and Control
    (64: control image latents) transformers, run by the `pipeline` class named.
    """
    from accel.models.tiny.clip import clip_text_model, clip_tokenizer  # heavy (transformers): only when building
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.t5 import t5_encoder, t5_tokenizer
    from accel.models.tiny.vaes import flux1_vae
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    text_encoder = clip_text_model(tokenizer, seed=base + 1)
    text_encoder_2 = t5_encoder(tokenizer_2, seed=base + 2)

    latent_channels = 16
    with seeded(base + 3):
        transformer = finish(
            FluxTransformer2DModel(
                patch_size=1,
                in_channels=latent_channels * 4 + conditions,  # latents are packed in 2x2 patches
                out_channels=latent_channels * 4,
                num_layers=2,
                num_single_layers=2,
                attention_head_dim=16,
                num_attention_heads=4,
                joint_attention_dim=text_encoder_2.config.d_model,
                pooled_projection_dim=text_encoder.config.hidden_size,
                guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
                axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
            )
        )
    with seeded(base + 4):
        vae = finish(flux1_vae())
    # FLUX.1-dev's scheduler config: the shift grows with the image token count.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return getattr(diffusers, pipeline)(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def build_tiny_fill(seed: int = 0) -> "FluxPipeline":
    """FLUX.1-Fill-dev's shape: the packed masked-image latents (64) and mask (8x8x4 = 256) join the input."""
    return build_tiny(seed, "FluxFillPipeline", conditions=320)


def build_tiny_control(seed: int = 0) -> "FluxPipeline":
    """FLUX.1-Canny/Depth-dev's shape: the packed control-image latents (64) join the input."""
    return build_tiny(seed, "FluxControlPipeline", conditions=64)


# The ControlNet pipelines' residuals, added to the image tokens after each block (diffusers'
# _cp_plan does not cut them).
CONTROLNET_SPLITS = (
    SequenceSplit("controlnet_block_samples", "image", dim=1),
    SequenceSplit("controlnet_single_block_samples", "image", dim=1),
)

TENSOR_PLAN = TensorPlan(from_diffusers=True)


FAMILY = Family(
    name="flux",
    title="FLUX.1",
    pipeline_class="FluxPipeline",
    transformer_class="FluxTransformer2DModel",
    vae="AutoencoderKL",
    repo="black-forest-labs/FLUX.1-dev",
    output="image",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=28, height=1024, width=1024, guidance_scale=3.5),
    size_step=16,
    acceleration=Acceleration(
        blocks=(
            BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
            BlockList("single_transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        ),
        # diffusers' _cp_plan cuts text and image tokens and their ids at the forward and gathers at
        # proj_out. Every attention is joint over (text, image), and the transformer builds its rotary
        # embedding from the (cut) ids, so it matches the local tokens. A ControlNet pipeline passes
        # per-block residuals for the image tokens (lists of whole-sequence tensors): cut as the image.
        tensor=TENSOR_PLAN,
        parallel=FromDiffusers(
            streams=(
                ("hidden_states", "image"),
                ("img_ids", "image"),
                ("encoder_hidden_states", "text"),
                ("txt_ids", "text"),
            ),
            attention_keys=("text", "image"),
            output_stream="image",
            extra_splits=CONTROLNET_SPLITS,
        ),
        # FLUX.1-dev is guidance-distilled: real CFG runs only with true_cfg_scale > 1 and a negative
        # prompt, as a second transformer call per step.
        cfg="calls",
        cfg_scale="true_cfg_scale",
        cfg_needs_negative=True,
    ),
    true_cfg=True,
    heads=24,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=3.5),
    # Kontext and Kontext inpaint put the reference image's tokens after the generated ones in the
    # image stream, so they are cut with it. The ControlNet pipelines need a ControlNet model, and
    # the Control img2img / inpaint ones a second (control) image: build them in a script and apply.
    variants=(
        *img2img_and_inpaint("FluxPipeline", "Flux"),
        Variant("FluxKontextPipeline", image="image", area="max_area"),
        Variant(
            "FluxKontextInpaintPipeline",
            image="image",
            mask="mask_image",
            area="max_area",
            fixed=(("_auto_resize", False),),
        ),
        Variant("FluxFillPipeline", image="image", mask="mask_image", tiny=build_tiny_fill),
        Variant("FluxControlPipeline", image="control_image", tiny=build_tiny_control),
    ),
)
