"""HunyuanImage 2.1 specifics the shared matrices do not show by themselves.

Its pipeline takes no guidance scale: a `guider` holds it, and an `ocr_guider` takes over for prompts
that quote text to render; accel sets both from [generate] guidance_scale for the call. A checkpoint
loaded without a guider (the distilled one) takes the call without the keyword. Quoted text brings
ByT5 glyph tokens into the text stream, which the transformer reorders valid tokens first: the
parallel split must still equal one process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
from family_parallel import MODES, TOLERANCE, check_equals_one_process, reference, world_of

from accel.models.registry import FAMILIES
from accel.recipe import Recipe
from accel.generate import generate
from accel.models.call import generation_kwargs
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import Grid, Layout, out_channels, randn
from accel.models import hunyuanimage


# HunyuanImage 2.1's transformer (the diffusers class defaults, which are its shape; one block of each of its 20 double
# and 40 single): 28 heads of 128, 64 latent channels (32x VAE, patch 1), Qwen2.5-VL-7B's 3584-wide text, ByT5-small's
# 1472.
HUNYUANIMAGE = dict(
    in_channels=64,
    out_channels=64,
    num_attention_heads=28,
    attention_head_dim=128,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=(1, 1),
    qk_norm="rms_norm",
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    rope_theta=256.0,
    rope_axes_dim=(64, 64),
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """(B, C, H, W) latents, patch 1: the latent grid is the token grid (2-D: no frames); 4 glyph tokens."""
    h, w, text = grid.rows, grid.cols, grid.text
    mask = lambda tokens: torch.ones(batch, tokens, device="cuda", dtype=torch.long)  # noqa: E731
    return dict(
        hidden_states=randn(batch, config["in_channels"], h, w),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_embed_dim"]),
        encoder_attention_mask=mask(text),
        encoder_hidden_states_2=randn(batch, 4, config["text_embed_2_dim"]),
        encoder_attention_mask_2=mask(4),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.rows, grid.cols)  # patch size 1, one picture


def fake_model_syncs(config: dict[str, Any], batch: int, cached: bool) -> int:
    # the same reordering as HunyuanVideo 1.5's, with no image embeddings: eight selections a sample
    return 8 * batch


# -- hunyuanimage: 2 double-stream + 2 single-stream blocks, 4x4 latents (16 tokens, patch 1), 8 prompt and 4 glyph
# tokens --
def block_transformer() -> nn.Module:
    from diffusers import HunyuanImageTransformer2DModel

    return block_cases.seeded(
        23,
        lambda: HunyuanImageTransformer2DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            num_layers=2,
            num_single_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            text_embed_dim=block_cases.TEXT_DIM,
            text_embed_2_dim=16,
            rope_axes_dim=(8, 8),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    # The forward joins the glyph tokens and the prompt tokens, valid ones first, into one text stream.
    return dict(
        hidden_states=block_cases.latents((1, 4, 4, 4), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        encoder_attention_mask=block_cases.text_mask(),
        encoder_hidden_states_2=block_cases.noise(torch.Generator().manual_seed(2), 1, 4, 16),
        encoder_attention_mask_2=torch.tensor([[1, 1, 0, 0]]),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_inference_steps=4),  # the guider's CFG (scale 3.5): two calls a step
    # 2x5 = 10 image tokens (32x VAE, patch 1); 1128 text tokens (the pipeline pads Qwen to 1000, ByT5
    # to 128), which 3 ranks divide: the image stream pads alone.
    odd=dict(height=64, width=160),
    threshold=0.5,
    tiny=TinyCase(
        name="hunyuanimage",
        build=hunyuanimage.build_tiny,
        pipeline_class=diffusers.HunyuanImagePipeline,
        # The guider's scale (3.5, as the real checkpoint's) turns CFG on: no guidance keyword to pass.
        call=dict(negative_prompt="blurry, low quality", height=64, width=64, num_inference_steps=4, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=8,  # real CFG: the guider calls the transformer on the prompt, then the negative
        latent_shape=(1, 16, 2, 2),  # 64x64 -> 2x2 latents (32x); patch 1: the latent grid is the token grid
        text_shape=(1, 1000, 32),  # Qwen tokens after the 34-token system prompt, padded to 1000
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        model_syncs=fake_model_syncs,
        masking=True,
        # HunyuanImage 2.1 at 2048x2048: 64 x 64 = 4096 image tokens (32x VAE, patch 1), 1000 prompt tokens; the
        # guider's two calls on CFG halves x Ulysses 4 (28 heads: 7 a rank), with the cache.
        real_config=HUNYUANIMAGE,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(1, 64, 64, 1000)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)

GLYPH = dict(CASE.call, prompt='a shop sign that reads "OPEN"')


def _transformer_calls(pipe: Any, kwargs: dict[str, Any]) -> int:
    calls: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        generate(pipe, kwargs, seed=0)
    finally:
        hook.remove()
    return len(calls)


def _kwargs(pipe: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
    recipe = Recipe.from_dict(
        {
            "model": {"name": "tiny-hunyuanimage"},
            "generate": {"steps": 1, "prompt": prompt, "guidance_scale": guidance_scale},
        }
    )
    return generation_kwargs(FAMILIES["hunyuanimage"], True, recipe, pipe)


@pytest.mark.parametrize("prompt, guider", [("a red fox", "guider"), ('a sign that reads "OPEN"', "ocr_guider")])
def test_the_guidance_scale_reaches_the_guider_the_prompt_picks_for_the_call_only(prompt: str, guider: str) -> None:
    pipe = cases.tiny_pipeline("tiny-hunyuanimage")
    seen: list[float] = []
    chosen = getattr(pipe, guider)
    original = chosen.set_state
    chosen.set_state = lambda **state: (seen.append(chosen.guidance_scale), original(**state))[1]
    try:
        assert (
            _transformer_calls(pipe, _kwargs(pipe, prompt, 1.0)) == 1
        )  # scale 1: the chosen guider runs the prompt alone
    finally:
        del chosen.set_state
    assert seen == [1.0]  # that guider ran the step, at the scale asked
    assert (pipe.guider.guidance_scale, pipe.ocr_guider.guidance_scale) == (
        3.5,
        3.5,
    )  # the pipeline's own scales are back


def test_a_pipeline_loaded_without_a_guider_takes_the_call_without_the_scale() -> None:
    """The distilled checkpoint holds no guider: one call per step, and no `guidance_scale` keyword
    reaches a call that takes none (a TypeError before)."""
    pipe = cases.tiny_pipeline("tiny-hunyuanimage")
    distilled = type(pipe)(**{**pipe.components, "guider": None, "ocr_guider": None})
    distilled.set_progress_bar_config(disable=True)
    assert _transformer_calls(distilled, _kwargs(distilled, "a red fox", 3.5)) == 1


DISTILLED = "accel.models.hunyuanimage:build_tiny_distilled"


@pytest.mark.parametrize("mode", ["ring2"])
def test_the_distilled_transformer_equals_one_process(rank_pools: Any, mode: str) -> None:
    """HunyuanImage-2.1-Distilled: no guider (one call a step), the guidance scale and MeanFlow's next
    timestep embedded per sample, neither of which a split touches."""
    pipe = cases.tiny_pipeline(DISTILLED)
    assert (pipe.guider, pipe.transformer.config.use_meanflow, pipe.transformer.config.guidance_embeds) == (
        None,
        True,
        True,
    )
    call = dict(CASE.call, num_inference_steps=2)
    expected, _, _ = cases.tiny_run(DISTILLED, {}, call)
    for output, _, bytes_sent in rank_pools(world_of(MODES[mode])).run(
        cases.tiny_run, DISTILLED, {"parallel": MODES[mode]}, call
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_quoted_text_brings_glyph_tokens_in() -> None:
    plain, _ = reference("hunyuanimage", CASE.call)
    glyph, _ = reference("hunyuanimage", GLYPH)
    assert np.abs(plain - glyph).mean() > 1e-4


@pytest.mark.parametrize("mode", ["cfg2xulysses2"])
def test_glyph_tokens_split_with_the_text_equal_one_process(rank_pools: Any, mode: str) -> None:
    """The ocr_guider's two calls on CFG halves, Ulysses in each: the positive prompt's text stream
    starts with its valid glyph tokens, the negative's has none."""
    check_equals_one_process(rank_pools, "hunyuanimage", MODES[mode], GLYPH)
