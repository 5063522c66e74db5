"""Kandinsky 5.0 Video family: text blocks refine the Qwen2.5-VL prompt, then visual blocks run
self-attention over the video tokens and cross-attention to that text; HunyuanVideo's VAE.

`build_tiny` makes a seeded, random-weight Kandinsky-5.0-T2V-Lite-shaped pipeline offline for tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accel.models.base import BlockList, Family, GenerationDefaults, ParallelPlan, SequenceSplit, Variant

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
        "Name the visual style of the video: whether it is a professional footage, user generated content, some kind of animation, video game or scren content.",
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
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel

    from accel.models import _tiny_parts as parts  # heavy (transformers): only when building

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    base = seed * 8
    tokenizer = parts.qwen2_tokenizer(_TEMPLATE, prefix_tokens=_CROP)
    text_encoder = parts.qwen25_vl_model(tokenizer, seed=base + 1)
    tokenizer_2 = parts.clip_tokenizer()
    text_encoder_2 = parts.clip_text_model(tokenizer_2, seed=base + 2)
    with parts.seeded(base + 3):
        transformer = parts.finish(
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
                axes_dims=(4, 6, 6),  # sums to the head width, as (16, 24, 24) does to 64
                visual_cond=True,
            )
        )
        random_modulation(transformer)
    with parts.seeded(base + 4):
        vae = parts.finish(parts.hunyuan_video_vae())
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
    # The visual blocks only: the text blocks see no latents, so their residual says nothing about
    # how far the video moved between steps; they run every call (two of 34 blocks on Lite).
    blocks=(BlockList("visual_transformer_blocks", returns=("visual_embed",)),),
    primary_stream="visual_embed",
    frames_arg="num_frames",
    fps=24,
    heads=28,
    tiny_heads=4,
    heads_of_config=_heads,
    # The video tokens are cut where the visual blocks start, with the rotary table every visual
    # block gets (the same tensor: cut once); the text stays whole on every rank, so the text blocks
    # and the cross-attention run unchanged. The transformer reshapes the tokens to the video grid
    # right after the last visual block, so the output is gathered there.
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
        refuses=(("attention_type", "nabla", "(NABLA sparse attention, a block mask over the whole sequence) cannot be split over ranks"),),
    ),
    # CFG with the default negative prompt whenever guidance_scale > 1: a second transformer call per step.
    cfg="calls",
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=5.0),
    # Image to video: the picture's latents replace the first latent frame (and its condition
    # channels), so the tokens and the plan are the text-to-video ones. It needs 17 frames or more:
    # the pipeline renormalises the first 4 latent frames against those after them (NaN without).
    # Kandinsky5T2IPipeline and Kandinsky5I2IPipeline run this transformer class too, but make
    # pictures through FLUX.1's AutoencoderKL: not listed until a variant can have its own output kind.
    variants=(Variant("Kandinsky5I2VPipeline", image="image"),),
)
