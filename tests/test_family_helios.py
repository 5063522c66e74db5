"""Helios specifics the shared matrices do not show by themselves.

The base pipeline takes a picture (its first frame) or a clip (history the new chunks continue)
besides text; a transformer may scale its history tokens' keys per head (`is_amplify_history`),
which each rank must do to exactly the history keys its shard holds; the pyramid pipeline's first
stage at 64 px high pads on 4 ranks, and Helios-Mid's CFG-Zero* rescales the two guidance branches
together, which CFG parallelism must hand back whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
import variant_cases
from family_parallel import TOLERANCE

from accel.models.helios import TINY_CHUNK
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import Grid, Layout, out_channels, randn
from accel.models import helios


# Helios's history latent frames (the pipeline's history_sizes, 16, 2 and 1, plus the first frame's slot).
HELIOS_HISTORY = (16, 2, 2)


def helios_history_tokens(grid: Grid) -> int:
    """The history tokens Helios puts in front of the chunk's: 2x2 patches of the last frame and the first
    frame's slot, 4x4 over two frames of the 2 before, 8x8 over four of the 16 before (latents padded to whole
    patches)."""
    long, mid, short = HELIOS_HISTORY
    return (
        short * grid.rows * grid.cols
        + mid // 2 * -(-grid.rows // 2) * -(-grid.cols // 2)
        + long // 4 * -(-grid.rows // 4) * -(-grid.cols // 4)
    )


# Helios-Base's transformer (the diffusers defaults, two of its 40 blocks): 40 heads of 128, UMT5-XXL's 4096-wide text.
HELIOS_BASE = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=2,
    rope_dim=(44, 42, 42),
    guidance_cross_attn=True,
    zero_history_timestep=True,
    has_multi_term_memory_patch=True,
    is_amplify_history=False,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """The chunk's latents and the history's, with frame positions as the pipeline makes them (on the CPU)."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    long, mid, short = HELIOS_HISTORY
    latents = lambda frames: randn(batch, config["in_channels"], frames, 2 * h, 2 * w)  # noqa: E731
    positions = torch.arange(1 + long + mid + 1 + f).unsqueeze(0)
    return dict(
        hidden_states=latents(f),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_dim"]),
        indices_hidden_states=positions[:, -f:],
        indices_latents_history_long=positions[:, 1 : 1 + long],
        indices_latents_history_mid=positions[:, 1 + long : 1 + long + mid],
        indices_latents_history_short=positions[:, [0, 1 + long + mid]],
        latents_history_short=latents(short),
        latents_history_mid=latents(mid),
        latents_history_long=latents(long),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (
        batch,
        out_channels(config),
        grid.frames,
        2 * grid.rows,
        2 * grid.cols,
    )  # the chunk's prediction (its history tokens are dropped)


# -- helios: Wan's shape; 2 chunk latent frames of 8x8 (32 tokens) after 37 history tokens ------------
def block_transformer() -> nn.Module:
    from diffusers import HeliosTransformer3DModel

    return block_cases.seeded(
        23,
        lambda: HeliosTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=block_cases.TEXT_DIM,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_dim=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    """The pipeline's layout with history sizes (4, 2, 1) over 8x8 latents: the first frame's slot and
    the last frame at 2x2 patches (32 tokens), two frames at 4x4 over two frames (4), four at 8x8
    over four (1), in front of the chunk's tokens."""
    generator = torch.Generator().manual_seed(3)
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        indices_hidden_states=torch.tensor([[8, 9]]),
        indices_latents_history_short=torch.tensor([[0, 7]]),
        indices_latents_history_mid=torch.tensor([[5, 6]]),
        indices_latents_history_long=torch.tensor([[1, 2, 3, 4]]),
        latents_history_short=block_cases.noise(generator, 1, 4, 2, 8, 8),
        latents_history_mid=block_cases.noise(generator, 1, 4, 2, 8, 8),
        latents_history_long=block_cases.noise(generator, 1, 4, 4, 8, 8),
        return_dict=False,
    )


CASE = FamilyCase(
    # Chunks of 2 latent frames (the tiny family's), two calls a step: 5 frames are one chunk,
    # 2 x 4x4 chunk tokens after 40 history tokens.
    dict(
        PROMPT,
        height=64,
        width=64,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=5.0,
        num_latent_frames_per_chunk=2,
    ),
    # Two chunks (the second's history is the first's latents) of 2 x 3x5 = 30 tokens after 30 + 6 + 8
    # history tokens (2x2, 4x4 and 8x8 patches, padded): 74.
    odd=dict(height=48, width=80, num_frames=9),
    threshold=0.08,
    tiny=TinyCase(
        name="helios",
        build=helios.build_tiny,
        pipeline_class=diffusers.HeliosPipeline,
        # Chunks of 2 latent frames (the tiny family's): 9 frames are two chunks of 5, the second
        # continuing the first's latents as history.
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=5.0,
            num_latent_frames_per_chunk=helios.TINY_CHUNK,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 64, 64, 3),  # two 5-frame chunks, cut to 4k + 1
        block_lists=("blocks",),
        transformer_calls=16,  # cond and uncond per step, four steps per chunk
        latent_shape=(1, 16, 2, 8, 8),  # one chunk: 2 latent frames of 8x8 (the history goes in other arguments)
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        history_tokens=helios_history_tokens,
        # Helios-Base at 384x640: a 33-frame chunk of 9 x 24 x 40 = 8640 tokens after 2400 history tokens, 512 text
        # tokens; its two calls a step on CFG halves x Ulysses 4, with the cache.
        real_config=HELIOS_BASE,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(9, 24, 40, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    one_per_prompt="diffusers 0.42's Helios repeats the text per video but makes latents and history for one",
)

ODD = dict(CASE.call, **CASE.odd)  # two chunks of 30 tokens after 44 of history
RING3 = {"parallel": {"ring": 3}}


@pytest.mark.parametrize("given", ["image", "video"])
def test_picture_and_clip_inputs_equal_one_process_on_ring_3(rank_pools: Any, given: str) -> None:
    """The picture is encoded as the first frame (and the last latent frame of a clip repeating it as
    history); a clip's last whole chunks become the history the new video continues (of its 9 frames,
    the last 5: one chunk). Ring 3 at 74 tokens a call."""
    call = dict(ODD, **{"video" if given == "image" else "image": None})
    expected, _, _ = variant_cases.variant_run("helios", "HeliosPipeline", {}, call)
    plain, _, _ = variant_cases.variant_run("helios", "HeliosPipeline", {}, dict(call, image=None, video=None))
    assert np.abs(expected - plain).max() > 1e-3  # the input changes the video
    for output, _, bytes_sent in rank_pools(3).run(variant_cases.variant_run, "helios", "HeliosPipeline", RING3, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


@pytest.mark.parametrize("parallel", [{"ring": 3}, {"ulysses": 2}], ids=["ring3", "ulysses2"])
def test_amplified_history_keys_equal_one_process(rank_pools: Any, parallel: dict[str, int]) -> None:
    """Each rank scales the keys of its own history tokens (its chunk length is its shard's share):
    Ring 3 cuts the 44 history tokens at 25, Ulysses 2 at 37."""
    builder = "parallel_cases:tiny_helios_amplified"
    expected, _, _ = cases.tiny_run(builder, {}, ODD)
    plain, _ = cases.tiny_run("tiny-helios", {}, ODD)[:2]
    assert np.abs(expected - plain).max() > 1e-3  # the scales change the video
    world = parallel.get("ring", 1) * parallel.get("ulysses", 1)
    for output, _, bytes_sent in rank_pools(world).run(cases.tiny_run, builder, {"parallel": parallel}, ODD):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


# 64x192 (the narrowest pyramid CFG-Zero* runs at, see build_tiny_pyramid): 126, 144 and 216 tokens
# at the three stages, the first of which 4 ranks pad (to 128).
PYRAMID = dict(
    prompt="a red fox",
    negative_prompt="blurry",
    height=64,
    width=192,
    num_frames=5,
    guidance_scale=5.0,
    num_latent_frames_per_chunk=TINY_CHUNK,
    pyramid_num_inference_steps_list=(2, 1, 1),
)


@pytest.mark.parametrize("parallel", [{"ring": 4}, {"cfg": 2, "ring": 2}], ids=["ring4", "cfg2xring2"])
def test_pyramid_cfg_zero_star_equals_one_process(rank_pools: Any, parallel: dict[str, int]) -> None:
    builder = "parallel_cases:tiny_helios_cfg_zero_star"
    expected, _, _ = cases.tiny_run(builder, {}, PYRAMID)
    world = parallel.get("ring", 1) * parallel.get("cfg", 1)
    for output, _, bytes_sent in rank_pools(world).run(cases.tiny_run, builder, {"parallel": parallel}, PYRAMID):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_the_pyramids_steps_are_its_stages_steps() -> None:
    """It takes no num_inference_steps: the run's step count is the sum over its stages, given or default."""
    from diffusers import HeliosPyramidPipeline

    from accel.models.call import call_steps

    pipe = HeliosPyramidPipeline.__new__(HeliosPyramidPipeline)  # the class's signature is all call_steps reads
    assert call_steps(pipe, {}) == 30  # its default, [10, 10, 10]
    assert call_steps(pipe, {"pyramid_num_inference_steps_list": (2, 1, 1)}) == 4
