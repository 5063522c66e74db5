"""HunyuanVideo 1.5 specifics the shared matrices do not show by themselves.

Its pipeline takes no guidance scale: a `guider` component holds it, which accel sets from
[generate] guidance_scale for the call. Its transformer joins image, glyph (ByT5) and prompt tokens
into one text stream, valid tokens first: a quoted word in the prompt brings glyph tokens in, and
the parallel split must still equal one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
from conftest import generate as run_pipe
from family_parallel import MODES, check_equals_one_process, reference

from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.recipe import Recipe
from accel.generate import generate
from accel.models.call import generation_kwargs
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import DTYPE, Grid, Layout, out_channels, randn
from accel.models import hunyuan15


# HunyuanVideo 1.5's transformer (the diffusers defaults, two of its 54 blocks): 16 heads of 128, Qwen2.5-VL-7B's
# 3584-wide text, ByT5's 1472, SigLIP's 1152; 32 latent channels (65 in: noise, condition latents, mask).
HUNYUAN15 = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=2,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    target_size=640,
    task_type="t2v",
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Patch size 1: the latent grid is the token grid; 3 image tokens (zero: text-to-video), 4 glyph tokens."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    mask = lambda tokens: torch.ones(batch, tokens, device="cuda", dtype=torch.long)  # noqa: E731
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, h, w),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        encoder_attention_mask=mask(text),
        encoder_hidden_states_2=randn(batch, 4, config["text_embed_2_dim"]),
        encoder_attention_mask_2=mask(4),
        image_embeds=torch.zeros(batch, 3, config["image_embed_dim"], device="cuda", dtype=DTYPE),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, grid.rows, grid.cols)  # patch size 1


def fake_model_syncs(config: dict[str, Any], batch: int, cached: bool) -> int:
    # its check whether the image embeddings are all zero, then its reordering of each sample's text stream, valid
    # tokens first, with twelve boolean-mask selections
    return 1 + 12 * batch


# -- hunyuan15: 2 double-stream blocks, 2 latent frames of 4x4 (32 tokens, patch 1), a joint text stream --
def block_transformer() -> nn.Module:
    from diffusers import HunyuanVideo15Transformer3DModel

    return block_cases.seeded(
        21,
        lambda: HunyuanVideo15Transformer3DModel(
            in_channels=9,
            out_channels=4,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            num_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=block_cases.TEXT_DIM,
            text_embed_2_dim=16,
            image_embed_dim=16,
            rope_axes_dim=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    # The text stream the transformer joins: 3 image tokens (zero: text-to-video, masked), 4 glyph and 8 prompt tokens.
    return dict(
        hidden_states=block_cases.latents((1, 9, 2, 4, 4), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        encoder_attention_mask=block_cases.text_mask(),
        encoder_hidden_states_2=block_cases.noise(torch.Generator().manual_seed(2), 1, 4, 16),
        encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]]),
        image_embeds=torch.zeros(1, 3, 16),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4),  # the guider's CFG: two calls a step
    odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 = 40 video tokens, 1985 text tokens
    threshold=0.3,
    tiny=TinyCase(
        name="hunyuan15",
        build=hunyuan15.build_tiny,
        pipeline_class=diffusers.HunyuanVideo15Pipeline,
        # The guider's scale (6.0 in the tiny pipeline) turns CFG on: no guidance keyword to pass.
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # real CFG: the guider calls the transformer on the prompt, then the negative
        latent_shape=(1, 17, 2, 4, 4),  # noise, condition latents, mask; 5 frames -> 2, 64x64 -> 4x4 (16x)
        text_shape=(1, 1000, 32),  # Qwen tokens after the 108-token system prompt, padded to 1000
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        model_syncs=fake_model_syncs,
        masking=True,
        # HunyuanVideo 1.5 at 720p, 121 frames: 31 x 45 x 80 = 111600 video tokens (16x VAE, patch 1), 1000 prompt
        # tokens; the guider's two calls on CFG halves x Ulysses 4, with the cache.
        real_config=HUNYUAN15,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(31, 45, 80, 1000)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    one_per_prompt="diffusers 0.42's HunyuanVideo 1.5 reshapes its text mask for one video per prompt only",
)

TOLERANCE = 1e-4
GLYPH = dict(CASE.call, prompt='a shop sign that reads "OPEN"')


def test_the_guidance_scale_goes_to_the_guider_for_the_call_only() -> None:
    pipe = cases.tiny_pipeline("tiny-hunyuan15")
    recipe = Recipe.from_dict({"model": {"name": "tiny-hunyuan15"}, "generate": {"steps": 1, "guidance_scale": 1.0}})
    kwargs = generation_kwargs(FAMILIES["hunyuan15"], True, recipe, pipe)
    assert kwargs["guidance_scale"] == 1.0 and "height" in kwargs  # kept, though the call takes no such keyword
    calls: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        generate(pipe, kwargs, seed=0)
    finally:
        hook.remove()
    assert len(calls) == 1  # scale 1: the guider runs the prompt alone
    assert pipe.guider.guidance_scale == 6.0  # the pipeline's own scale is back


def test_cfg_parallel_is_refused_where_the_guider_would_not_guide() -> None:
    recipe = Recipe.from_dict(
        {"model": {"name": "tiny-hunyuan15"}, "generate": {"guidance_scale": 1.0}, "parallel": {"cfg": 2}}
    )
    with pytest.raises(UserError, match="guidance_scale is 1.0, and guidance runs only above 1"):
        generation_kwargs(FAMILIES["hunyuan15"], True, recipe)


def test_quoted_text_brings_glyph_tokens_in() -> None:
    plain, _ = reference("hunyuan15", CASE.call)
    glyph, _ = reference("hunyuan15", GLYPH)
    assert np.abs(plain - glyph).mean() > 1e-4


@pytest.mark.parametrize("mode", ["ring2"])
def test_glyph_tokens_split_with_the_text_equal_one_process(rank_pools: Any, mode: str) -> None:
    check_equals_one_process(rank_pools, "hunyuan15", MODES[mode], GLYPH)


def test_key_mask_attention_makes_diffusers_picture_bit_for_bit_and_goes_with_remove() -> None:
    import accel
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    from accel.models.hunyuan15 import KeyMaskAttention

    pipe = cases.tiny_pipeline("tiny-hunyuan15")
    attn = pipe.transformer.transformer_blocks[0].attn
    call = dict(CASE.call, num_inference_steps=1)
    masks: list[Any] = []
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(lambda _, args: masks.append(args[3]))
    try:
        plain = run_pipe(pipe, call)
    finally:
        hook.remove()
    assert 0 < int(masks[0].sum()) < masks[0].shape[-1]  # the text stream is mostly padding: rows differ
    handle = accel.apply(pipe, {})
    try:
        assert isinstance(attn.processor, KeyMaskAttention)
        lean = run_pipe(pipe, call)
    finally:
        handle.remove()
    assert isinstance(attn.processor, HunyuanVideo15AttnProcessor2_0)
    assert np.array_equal(plain, lean)


def test_key_mask_attention_holds_no_token_pair_mask() -> None:
    """At L joint tokens diffusers' processor holds two (L, L) boolean masks at once; accel's none."""
    import torch
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    from accel.memory.tracker import tracked_peak
    from accel.models.hunyuan15 import KeyMaskAttention

    attn = cases.tiny_pipeline("tiny-hunyuan15").transformer.transformer_blocks[0].attn
    video, text = 1536, 512
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, video, attn.to_q.in_features, generator=generator)
    context = torch.randn(1, text, attn.add_q_proj.in_features, generator=generator)
    mask = torch.arange(text).unsqueeze(0) < 100
    pair_bytes = (video + text) ** 2
    peaks, outputs = {}, {}
    for processor in (HunyuanVideo15AttnProcessor2_0(), KeyMaskAttention()):
        outputs[type(processor)] = processor(attn, hidden, context, mask)
        peak = tracked_peak(lambda: processor(attn, hidden, context, mask), attn, device="cpu")
        assert peak is not None
        peaks[type(processor)] = peak.working
    assert peaks[HunyuanVideo15AttnProcessor2_0] > 2 * pair_bytes
    assert peaks[KeyMaskAttention] < pair_bytes
    diffusers_video, diffusers_text = outputs[HunyuanVideo15AttnProcessor2_0]
    lean_video, lean_text = outputs[KeyMaskAttention]
    assert torch.equal(diffusers_video, lean_video)  # the video stream: every row a real token
    assert torch.equal(diffusers_text[:, :100], lean_text[:, :100])  # the prompt's real tokens
