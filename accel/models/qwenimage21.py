"""Qwen-Image 2.1 family: a single-stream DiT over one joint sequence. The Qwen3-VL encoder's text
(with condition pictures in the vision slots it reserved) comes first, the target picture's latent
tokens last; attention is block-causal (text causal, each picture's block bidirectional, the target
attending to everything). Text and condition tokens are modulated at t = 0, so the pipeline keeps
their keys and values after the first step (a K/V cache) and later steps compute the target alone.
The VAE (Wan 2.2's shape) compresses 16x and reads and writes RGBA.

Context parallelism cuts the target's tokens of the cached calls. diffusers has no `_cp_plan`, and
the first call of a generation (or of each CFG branch) cannot be cut: its attention processor
slices the joint sequence at whole-sequence positions (one attention call per prompt segment, then
the target's), as a block-causal mask. That call fills the K/V cache and runs whole on every rank
(`split_only_when`: one step of the run, repeated on each). Every later call passes "cached" and
computes the target's tokens alone, attending to the cached prompt keys and its own: those calls are
cut along the target (its rotary table and modulation mask with it), each rank attending to the
prompt keys it holds whole and to the target keys of all ranks, merged by log-sum-exp; the output
is gathered before the final norm. The automatic plan, which sees only the first call, refuses it
(an attention of 64 queries to 76 keys it cannot place). CFG parallelism (one rank per branch, each
with its own K/V cache), the cache, quantization, compile and tensor parallelism (diffusers'
`_tp_plan`) apply as well.

`build_tiny` makes a seeded, random-weight Qwen-Image-2.1-shaped pipeline offline for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import ParallelPlan, SequenceSplit, TensorPlan

if TYPE_CHECKING:
    from diffusers import QwenImage21Pipeline

# The pipeline's system prompt and its image-conditioned template (the text-only one is a subset).
_SYSTEM = "Comprehend and analyze the provided prompt."
_TEMPLATE = (
    f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n<image1><|vision_start|><|image_pad|><|vision_end|>{{}}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
# The target's tokens of the calls that read the K/V cache; the cached prompt keys ("prompt": text
# and condition pictures) are held whole by every rank, before the target's in every attention.
PARALLEL_PLAN = ParallelPlan(
    splits=(
        SequenceSplit("hidden_states", "target", dim=1, module="transformer_blocks.0"),
        SequenceSplit("rotary_emb", "target", dim=0, module="transformer_blocks.*"),
        SequenceSplit("target_token_mask", "target", dim=0, module="transformer_blocks.*"),
        # The padding mask of a cached call spans the prompt's keys and the target's.
        SequenceSplit("attention_mask", ("prompt", "target"), dim=-1, module="transformer_blocks.*"),
    ),
    attention_keys=("prompt", "target"),
    output_stream="target",
    output_dim=1,
    output_module="norm_out",
    output_before=True,
    whole_streams=("prompt",),
    split_only_when=("kv_cache_mode", "cached"),
)
_Z_DIM = 16  # the real VAE has 64 latent channels; any count works, the transformer reads it from its config


def build_tiny(seed: int = 0) -> "QwenImage21Pipeline":
    """A tiny Qwen-Image 2.1 look-alike: real classes, configs scaled down, random seeded weights.

    Two blocks of four 16-wide heads; the VAE compresses 16x as the real one does, so 64x64 images
    give 4x4 = 16 target tokens (one encoder slot per 2x2 of them) after the prompt's tokens. The
    Qwen3-VL processor shows a condition picture to the one-block vision tower as a few 32 px tokens.
    """
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    from accel.models.tiny.qwen import qwen2_tokenizer, qwen3_vl_model, qwen3_vl_processor
    from accel.models.tiny.seeding import finish, seeded

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = qwen2_tokenizer(_TEMPLATE)
    text_encoder = qwen3_vl_model(tokenizer, seed=base + 1)
    with seeded(base + 2):
        transformer = finish(
            QwenImage21Transformer2DModel(
                in_channels=_Z_DIM,
                out_channels=_Z_DIM,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=4,
                context_in_dim=text_encoder.config.text_config.hidden_size,
                axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
            )
        )
    with seeded(base + 3):
        # Four spatial downsamplings (16x) and three temporal ones, as in the real VAE; unit latent statistics.
        vae = finish(
            AutoencoderKLQwenImage21(
                base_dim=8,
                decoder_base_dim=8,
                z_dim=_Z_DIM,
                dim_mult=[1, 2, 2, 2, 2],
                num_res_blocks=1,
                latents_mean=[0.0] * _Z_DIM,
                latents_std=[1.0] * _Z_DIM,
            )
        )
    # The pipeline's own shift: calculate_shift over the target's token count (its defaults).
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True)
    return QwenImage21Pipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        processor=qwen3_vl_processor(tokenizer),
        transformer=transformer,
    )


FAMILY = Family(
    name="qwenimage21",
    title="Qwen-Image 2.1",
    pipeline_class="QwenImage21Pipeline",
    transformer_class="QwenImage21Transformer2DModel",
    vae="AutoencoderKLQwenImage21",
    repo="Qwen/Qwen-Image-2.1",
    output="image",
    dtype="bfloat16",
    # QwenImage21Pipeline.__call__'s defaults: 40 steps, 1024x1024, no guidance (true_cfg_scale 1: the
    # model is meant to be sampled without it).
    defaults=GenerationDefaults(steps=40, height=1024, width=1024, true_cfg_scale=1.0),
    # The pipeline floors sizes to 32 px (16x VAE, one encoder slot per 2x2 latent tokens).
    size_step=32,
    acceleration=Acceleration(
        # One list of single-stream blocks over the joint sequence (text, condition pictures, target).
        blocks=(BlockList("transformer_blocks", returns=("hidden_states",)),),
        # diffusers' _tp_plan: Q, K, V and the SwiGLU's two input projections column-wise, the
        # attention's and the MLP's output projections row-wise (bias-free, unfused: nothing packed).
        tensor=TensorPlan(from_diffusers=True),
        parallel=PARALLEL_PLAN,
        # True CFG (true_cfg_scale > 1 with a negative prompt): a second transformer call per step, with
        # its own K/V cache.
        cfg="calls",
        cfg_scale="true_cfg_scale",
        cfg_needs_negative=True,
        # The first call of each branch returns its prompt's tokens with the target's (the pipeline keeps
        # the target's), and a negative prompt is seldom as long as the prompt.
        cfg_outputs_vary=True,
    ),
    true_cfg=True,
    heads=32,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, negative_prompt=" ", true_cfg_scale=4.0),
    # The same pipeline takes condition pictures (`image=`, optional): the encoder sees them and
    # their latents come before the target's in the joint sequence.
    # diffusers' pipeline fails on a batch of prompts of different lengths.
    batches=False,
    variants=(Variant("QwenImage21Pipeline", image="image", optional=("image",)),),
)
