"""HunyuanVideo 1.5 family: one list of double-stream blocks over video then a joint text stream
(Qwen2.5-VL prompt, ByT5 glyph text and SigLIP image tokens, valid tokens first), with classifier-free
guidance run by the pipeline's `guider` as two transformer calls per step.

`build_tiny` makes a seeded, random-weight HunyuanVideo-1.5-shaped pipeline offline for tests;
`build_tiny_i2v` its image-to-video twin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accel.models.base import Acceleration, BlockList, Family, GenerationDefaults
from accel.models.variant_format import Variant
from accel.parallel.plan_format import (
    DIFFUSERS_MLP,
    JOINT_ATTENTION,
    ParallelPlan,
    SequenceSplit,
    TensorPlan,
    split_layers,
)

if TYPE_CHECKING:
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

# HunyuanVideo 1.5's VAE: 32 latent channels; the tiny one keeps fewer.
_LATENTS = 8
# Side of the tiny SigLIP's square input: 8x8 patches give 16 image tokens (the real one, 729).
_SIGLIP_SIZE = 32


def _system_prefix() -> str:
    """The chat framing before the user's prompt, which the pipeline crops off (108 tokens)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def _tiny_parts(base: int, image_embed_dim: int) -> dict[str, Any]:
    """Every component but the image encoder: the Qwen2.5-VL and ByT5 text stacks (seeds `base + 1`,
    `base + 2`), the transformer (`base + 3`), the VAE (`base + 4`), scheduler and guider."""
    # heavy (transformers): only when building
    from accel.models.tiny.qwen import QWEN3_CHAT_TEMPLATE, QWEN_HIDDEN, qwen2_tokenizer
    from accel.models.tiny.seeding import finish, seeded
    from accel.models.tiny.t5 import t5_encoder
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    # The pipeline crops a fixed 108 tokens (the system prompt) off the chat-formatted prompt: the
    # tokenizer spends exactly that on it, as Qwen2.5-VL's does, so the crop lands at the prompt
    # (`_checked` compares with the pipeline's own number).
    tokenizer = qwen2_tokenizer(_system_prefix(), runs=True)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE  # Qwen2.5's framing of plain text turns
    ids = tokenizer.convert_tokens_to_ids
    text_config = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=QWEN_HIDDEN,
        intermediate_size=2 * QWEN_HIDDEN,
        num_hidden_layers=3,  # the pipeline takes the third-to-last hidden state: a layer's output
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [1, 1, 2]},
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )
    with seeded(base + 1):
        text_encoder = finish(Qwen2_5_VLTextModel(text_config))
    # ByT5 (the glyph encoder for quoted text) needs no vocabulary file: its tokens are bytes.
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = t5_encoder(tokenizer_2, seed=base + 2)  # type: ignore[arg-type]

    with seeded(base + 3):
        transformer = finish(
            HunyuanVideo15Transformer3DModel(
                in_channels=2 * _LATENTS + 1,  # noise, condition latents (zero for text-to-video), condition mask
                out_channels=_LATENTS,
                num_attention_heads=4,
                attention_head_dim=16,
                num_layers=2,
                num_refiner_layers=1,
                patch_size=1,
                patch_size_t=1,
                text_embed_dim=text_encoder.config.hidden_size,
                text_embed_2_dim=text_encoder_2.config.d_model,
                image_embed_dim=image_embed_dim,
                rope_axes_dim=(4, 6, 6),  # sums to attention_head_dim, as (16, 56, 56) does to 128
                target_size=64,  # the image-to-video pipeline sizes its output from this (diffusers default 640)
            )
        )
    with seeded(base + 4):
        # HunyuanVideo 1.5's VAE shape: 16x spatial and 4x temporal compression (4k+1 frames -> k+1 latents).
        vae = finish(
            AutoencoderKLHunyuanVideo15(
                latent_channels=_LATENTS,
                block_out_channels=(8, 8, 16, 16, 16),
                layers_per_block=1,
                spatial_compression_ratio=16,
                temporal_compression_ratio=4,
            )
        )
    return dict(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=7.0),  # flow matching, fixed shift
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )


def _checked(pipe: Any) -> Any:
    """`pipe`, once its tokenizer is known to spend exactly the cropped tokens on the system prompt."""
    spent = len(pipe.tokenizer(_system_prefix()).input_ids)
    if spent != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny HunyuanVideo 1.5 tokenizer: the system prompt is {spent} tokens, "
            f"but the pipeline crops {pipe.prompt_template_encode_start_idx}"
        )
    return pipe


def build_tiny(seed: int = 0) -> "HunyuanVideo15Pipeline":
    """A tiny HunyuanVideo 1.5 look-alike: real classes, configs scaled down, random seeded weights.

    Two double-stream blocks of four 16-wide heads; 5 frames at 64x64 give 2x4x4 latents, i.e. 32
    video tokens (patch size 1), next to the joint text stream the transformer assembles: the
    pipeline's 729 zero image tokens (masked for text-to-video), 256 ByT5 and 1000 Qwen tokens
    (the pipeline's padding lengths), 1985 in all. Real CFG: the guider calls the transformer on the
    prompt, then on the negative prompt, every step.
    """
    from diffusers import HunyuanVideo15Pipeline

    # One seed per component, disjoint across builder seeds, so each part is reproducible alone.
    # Offsets: 1-2 text encoders, 3 transformer, 4 VAE, 5 the image encoder of build_tiny_i2v.
    return _checked(HunyuanVideo15Pipeline(**_tiny_parts(seed * 8, image_embed_dim=16)))


def build_tiny_i2v(seed: int = 0) -> "HunyuanVideo15ImageToVideoPipeline":
    """build_tiny's parts plus a one-layer SigLIP vision tower, as HunyuanVideo-1.5 image-to-video.

    The picture conditions twice: its VAE latents fill the first latent frame of the condition
    channels (the mask channel marks it), and SigLIP's 16 patch tokens (8x8 patches of a 32x32
    resize) join the text stream, valid this time. The output takes the picture's size.
    """
    from accel.models.tiny.seeding import finish, seeded
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipVisionConfig, SiglipVisionModel

    try:  # transformers 5: the PIL backend by name, so preprocessing does not hinge on torchvision
        from transformers import SiglipImageProcessorPil as SiglipImageProcessor
    except ImportError:
        from transformers import SiglipImageProcessor  # type: ignore[assignment]

    base = seed * 8
    config = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=_SIGLIP_SIZE,
        patch_size=8,
    )
    with seeded(base + 5):
        image_encoder = finish(SiglipVisionModel(config))
    return _checked(
        HunyuanVideo15ImageToVideoPipeline(
            **_tiny_parts(base, image_embed_dim=config.hidden_size),
            image_encoder=image_encoder,
            feature_extractor=SiglipImageProcessor(size={"height": _SIGLIP_SIZE, "width": _SIGLIP_SIZE}),
        )
    )


class KeyMaskAttention:
    """HunyuanVideo 1.5's joint attention (video, then the text stream) with the text mask applied per
    key, (B, 1, 1, L), where diffusers' processor ANDs it with itself into a (B, 1, L, L) pair mask:
    L² bytes, twice, in every block (12 GiB each at 720p x 121), and a mask no fused kernel takes.

    Every real token's query row of the pair mask is the key mask itself, so real tokens attend
    exactly as in diffusers. Padding rows (text positions past the prompt) attend to the real keys
    instead of to nothing; they are never keys of a real token and never reach the output.
    """

    # Set by diffusers' `set_attention_backend` / context-parallel config, as on its own processors.
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __call__(
        self,
        attn: Any,
        hidden_states: Any,
        encoder_hidden_states: Any = None,
        attention_mask: Any = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        import torch
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if encoder_hidden_states is not None:
            text_query = heads(attn.add_q_proj(encoder_hidden_states))
            text_key = heads(attn.add_k_proj(encoder_hidden_states))
            text_value = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=1)
            key = torch.cat([key, text_key], dim=1)
            value = torch.cat([value, text_value], dim=1)

        keys = None
        if attention_mask is not None:  # the text's mask; every video token is a real key
            batch, tokens = query.shape[0], query.shape[1]
            video = torch.ones(batch, tokens - attention_mask.shape[1], dtype=torch.bool, device=attention_mask.device)
            keys = torch.cat([video, attention_mask.bool()], dim=1).view(batch, 1, 1, tokens)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=keys,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, encoder_hidden_states
        text_tokens = encoder_hidden_states.shape[1]
        out, encoder_hidden_states = out[:, :-text_tokens], out[:, -text_tokens:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return out, encoder_hidden_states


TENSOR_PLAN = TensorPlan(
    layers={
        **split_layers("transformer_blocks.*.attn", JOINT_ATTENTION),
        **split_layers("transformer_blocks.*.ff", DIFFUSERS_MLP),
        **split_layers("transformer_blocks.*.ff_context", DIFFUSERS_MLP),
    },
    per_rank=("heads",),
)


FAMILY = Family(
    name="hunyuan15",
    title="HunyuanVideo 1.5",
    pipeline_class="HunyuanVideo15Pipeline",
    transformer_class="HunyuanVideo15Transformer3DModel",
    vae="AutoencoderKLHunyuanVideo15",
    repo="hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
    output="video",
    dtype="bfloat16",
    defaults=GenerationDefaults(steps=50, height=720, width=1280, frames=121, guidance_scale=6.0),
    size_step=16,
    frame_step=4,
    prompt_tokenizers=("tokenizer",),
    acceleration=Acceleration(
        blocks=(BlockList("transformer_blocks", returns=("hidden_states", "encoder_hidden_states")),),
        # Video and the joint text stream are both cut where the blocks start (the Qwen token refiner
        # before them runs whole on every rank); the text mask each block gets is cut with the text,
        # the rotary table with the video. Each block's processor makes its (B, 1, L, L) mask as the
        # text mask (video counted valid) ANDed with itself: the engine reads the key mask off it.
        tensor=TENSOR_PLAN,
        parallel=ParallelPlan(
            splits=(
                SequenceSplit("output", "video", dim=0, module="rope"),
                SequenceSplit("hidden_states", "video", dim=1, module="transformer_blocks.0"),
                SequenceSplit("encoder_hidden_states", "text", dim=1, module="transformer_blocks.0"),
                SequenceSplit("attention_mask", "text", dim=-1, module="transformer_blocks.*"),
            ),
            attention_keys=("video", "text"),
            output_stream="video",
            output_dim=1,
            output_module="proj_out",
            local_attention=("context_embedder",),
            pairwise_mask=True,
        ),
        # The guider (its guidance_scale; accel sets it from [generate] guidance_scale) runs the prompt
        # and the negative prompt as two transformer calls per step.
        cfg="calls",
        processors=(("HunyuanVideo15AttnProcessor2_0", KeyMaskAttention),),
    ),
    frames_arg="num_frames",
    heads=16,
    tiny_heads=4,
    tiny=build_tiny,
    tiny_defaults=GenerationDefaults(steps=4, height=64, width=64, frames=5, guidance_scale=6.0),
    # diffusers' pipeline fails on a batch of several prompts (a RuntimeError in a reshape).
    batches=False,
    variants=(Variant("HunyuanVideo15ImageToVideoPipeline", image="image", tiny=build_tiny_i2v),),
)
