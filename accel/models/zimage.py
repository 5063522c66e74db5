"""Z-Image family: a single-stream DiT. Image tokens and caption tokens are refined apart (two
`noise_refiner` and two `context_refiner` blocks), then joined per sample, image first, into one
unified sequence that the main `layers` run on; a Qwen3 text encoder and FLUX.1's VAE.

`build_tiny` makes a seeded, random-weight Z-Image-Turbo-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import img2img_and_inpaint
from accel.parallel.plan_format import ParallelPlan, SELF_ATTENTION, SequenceSplit, TensorPlan, split_layers

if TYPE_CHECKING:
    from diffusers import ZImagePipeline

_LATENT_CHANNELS = 16  # FLUX.1's VAE


def build_tiny(seed: int = 0) -> "ZImagePipeline":
    """A tiny Z-Image-Turbo look-alike: real classes, configs scaled down, random seeded weights.

    Two main layers and two refiner blocks of each kind, four 16-wide heads. 64x64 images give 8x8
    latents, 4x4 = 16 image tokens after 2x2 patching; the transformer pads the image and the
    caption to multiples of 32 tokens each (the pipeline passes the prompt's real tokens, chat
    framing included), so the unified sequence holds 64 tokens for a short prompt. The pipeline
    takes the Qwen3 encoder's second-to-last hidden state, so two layers make it a layer's output.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from accel.models.tiny.qwen import qwen3_model, qwen3_tokenizer
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.vaes import flux1_vae

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = qwen3_tokenizer("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")
    text_encoder = qwen3_model(tokenizer, seed=base + 1, layers=2)
    with seeded(base + 2):
        transformer = finish(
            ZImageTransformer2DModel(
                all_patch_size=(2,),
                all_f_patch_size=(1,),
                in_channels=_LATENT_CHANNELS,
                dim=64,
                n_layers=2,
                n_refiner_layers=2,
                n_heads=4,
                n_kv_heads=4,
                cap_feat_dim=text_encoder.config.hidden_size,
                axes_dims=[4, 6, 6],  # sums to the head width, as (32, 48, 48) does to 128
                axes_lens=[1024, 512, 512],
            )
        )
    with seeded(base + 3):
        vae = finish(flux1_vae())  # Z-Image decodes with FLUX.1's VAE
    # Z-Image-Turbo's scheduler config: a fixed shift of 3 (the pipeline's `mu` is then unused).
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("layers.*.attention", SELF_ATTENTION),
        # SwiGLU in three layers: w1 and w3 make the hidden width, w2 reads it.
        **split_layers("layers.*.feed_forward", (("w1", "w3"), ("w2",))),
    },
    per_rank=("heads",),
)


FAMILY = Family(
    name="zimage",
    title="Z-Image",
    pipeline_class="ZImagePipeline",
    transformer_class="ZImageTransformer2DModel",
    vae="AutoencoderKL",
    repo="Tongyi-MAI/Z-Image-Turbo",
    output="image",
    dtype="bfloat16",
    # Z-Image-Turbo's model card: 9 steps (8 transformer calls), guidance 0 (distilled: no CFG).
    defaults=GenerationDefaults(steps=9, height=1024, width=1024, guidance_scale=0.0),
    size_step=16,
    acceleration=Acceleration(
        # The main layers. The refiners run before them on the image and on the caption apart, so
        # they always run; the cache compares the unified sequence after layers.0.
        blocks=(BlockList("layers", returns=("x",)),),
        primary_stream="x",
        heads_key="n_heads",
        # diffusers has no _cp_plan for Z-Image. The refiners run whole on every rank (their attention
        # stays local: image alone, caption alone); the unified sequence (image then caption per
        # sample, padded to the longest sample with a key mask) is cut at the main layers together
        # with its rotary table and mask, and gathered after the final layer, before unpatchify. The
        # ControlNet pipeline passes {layer index: residual of the unified sequence}, added after that
        # layer; the sequence exists only inside the forward, so they are cut where layers.0 starts.
        # They carry the batch (the CFG branches), padded to the batch's longest sample as the unified
        # sequence is: a CFG half with shorter samples keeps its own length of them.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("x", "unified", dim=1, module="layers.0"),
                SequenceSplit("freqs_cis", "unified", dim=1, module="layers.*"),
                SequenceSplit("attn_mask", "unified", dim=1, module="layers.*"),
                SequenceSplit("controlnet_block_samples", "unified", dim=1, at="layers.0"),
            ),
            attention_keys=("unified",),
            output_stream="unified",
            output_dim=1,
            output_module="all_final_layer.*",
            local_attention=("noise_refiner.*", "context_refiner.*"),
            # Lists of per-sample latents and caption features, and the timesteps.
            batch_args=("x", "cap_feats", "t"),
            batch_items=("controlnet_block_samples",),
        ),
        # The pipeline batches positive then negative prompts into one call whenever guidance_scale > 0
        # (the negative prompt defaults to ""); Turbo runs with 0, the base model Tongyi-MAI/Z-Image with CFG.
        cfg="batch",
        cfg_above=0.0,
    ),
    heads=30,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, guidance_scale=0.0),
    # Same transformer call; the input picture only sets the starting latents (and the mask blends).
    # The Omni pipeline needs a SigLIP2 image tower and the ControlNet ones a ControlNet model.
    variants=(*img2img_and_inpaint("ZImagePipeline", "ZImage"),),
)
