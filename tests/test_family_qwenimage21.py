"""Qwen-Image 2.1 with a condition picture: the Qwen3-VL encoder sees it in the slots it reserves, and
its latent tokens join the joint sequence before the target's. CFG halves (each branch's first call
returns its own prompt's length, the picture's tokens and the target's) with the cache equal one
process, calls cached alike; so does Ring 3, which cuts the target's tokens of the cached calls."""

from __future__ import annotations

from typing import Any

import numpy as np

import parallel_cases as cases
from family_parallel import TOLERANCE
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import Grid, Layout, out_channels, randn
from accel.models import qwenimage21


# Qwen-Image 2.1's transformer (its class defaults, the released widths; two of its 32 blocks): 32 heads of 128, a
# 4096-wide Qwen3-VL context, 64 latent channels.
QWENIMAGE21 = dict(
    in_channels=64,
    out_channels=64,
    num_attention_heads=32,
    attention_head_dim=128,
    context_in_dim=4096,
    num_layers=2,
    causal_condition=True,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Unpatched latents; the encoder's slot mask: the text, then one slot per 2x2 target tokens."""
    h, w, text = grid.rows, grid.cols, grid.text
    slots = torch.cat(
        [
            torch.zeros(batch, text, device="cuda", dtype=torch.bool),
            torch.ones(batch, 4 * h * w // 4, device="cuda", dtype=torch.bool),
        ],
        dim=1,
    )
    return dict(
        hidden_states=randn(batch, 4 * h * w, config["in_channels"]),
        encoder_hidden_states=randn(batch, text, config["context_in_dim"]),
        timestep=t / 1000,
        img_shapes=[[(1, 2 * h, 2 * w)]] * batch,
        img_mask=slots,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (
        batch,
        grid.text * prefill + 2 * grid.rows * 2 * grid.cols,
        out_channels(config),
    )  # unpatched; the prefill call returns the prompt's tokens too


def fake_model_syncs(config: dict[str, Any], batch: int, cached: bool) -> int:
    # its token layout from the slot mask: two repeats, three masked writes, a list, positions, a count
    return 8


def fake_kv_caches(config: dict[str, Any], calls: int) -> list[Any]:
    """Its K/V caches, one per CFG branch, as its pipeline makes them."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    return [QwenImage21KVCache(config["num_layers"]) for _ in range(calls)]


# -- qwenimage21: 2 single-stream blocks over the joint sequence (8 text tokens, then 16 target tokens) --
def block_transformer() -> nn.Module:
    from diffusers import QwenImage21Transformer2DModel

    return block_cases.seeded(
        22,
        lambda: QwenImage21Transformer2DModel(
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            context_in_dim=block_cases.TEXT_DIM,
            axes_dims_rope=(4, 6, 6),
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    # Unpatched 4x4 target latents; the encoder's mask holds one slot per 2x2 of them after the text.
    slots = torch.cat(
        [torch.zeros(1, block_cases.TEXT_TOKENS, dtype=torch.bool), torch.ones(1, 4, dtype=torch.bool)], dim=1
    )
    return dict(
        hidden_states=block_cases.latents((1, 16, 4), drift),
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([0.7 - drift]),
        img_shapes=[[(1, 4, 4)]],
        img_mask=slots,
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=4),  # true CFG: two calls a step
    odd=dict(height=64, width=160),  # 4x10 = 40 target tokens after 37 prompt tokens: the cached calls cut the 40
    threshold=1.0,  # block 0's output changes by ~100 % a step with random weights; this caches 3 of 16 calls,
    tiny=TinyCase(
        name="qwenimage21",
        build=qwenimage21.build_tiny,
        pipeline_class=diffusers.QwenImage21Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            true_cfg_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 4),  # its VAE decodes RGBA
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # true CFG: a second call per step for the negative prompt
        latent_shape=(1, 16, 16),  # 64x64 -> 4x4 latents (16x VAE), unpatched: 16 tokens of 16 channels
        text_shape=(1, 37, 32),  # the user and assistant turns around the prompt (the system turn dropped), unpadded
        negative_text_shape=(1, 27, 32),
        reload_tolerance=1e-5,
        components=("text_encoder", "transformer", "vae"),
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        model_syncs=fake_model_syncs,
        kv_caches=fake_kv_caches,
        shared_keys="prompt",
        host_values=True,
        # Qwen-Image 2.1 at 1024x1024: 64 x 64 = 4096 target tokens (16x VAE, unpatched; 32 x 32 encoder slots), a
        # 512-token prompt cached whole by each branch's first call; its cached calls' target on CFG halves x Ulysses 4,
        # with the cache.
        real_config=QWENIMAGE21,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(1, 32, 32, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    no_reload=(
        "diffusers loads a processor only of transformers' own classes, and Qwen3VLProcessor's loads a video "
        "processor, which needs torchvision"
    ),
    # Its first step also computes the prompt's tokens (kept as keys and values after), so its second step's block
    # output has another shape and no residual to compare: the third is the first that can reuse.
    contract_steps=3,
    compile_call=dict(true_cfg_scale=1.0, negative_prompt=None),
    refused_automatically="it cuts only the calls after its first, which the automatic plan never sees",
)

# 8 steps, so the cache (from the third step on: the first computes the prompt too) has calls to skip.
CALL = dict(CASE.call, num_inference_steps=8, output_resolution=64)
CACHE = {"cache": {"threshold": CASE.threshold}}


def test_a_condition_picture_on_cfg_halves_with_the_cache_equals_one_process(rank_pools) -> None:
    call = dict(CALL, image=cases.gradient_image(64))
    expected, records, _ = cases.tiny_run("tiny-qwenimage21", CACHE, call)
    assert 0 < sum(cached for *_, cached in records) < len(records)
    runs = rank_pools(2).run(cases.tiny_run, "tiny-qwenimage21", {**CACHE, "parallel": {"cfg": 2}}, call)
    for half, (output, got, bytes_sent) in enumerate(runs):
        assert bytes_sent > 0
        assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records if b == half]
        assert np.abs(output - expected).max() <= TOLERANCE


def test_a_condition_picture_on_ring_3_with_the_cache_equals_one_process(rank_pools) -> None:
    """The picture's tokens join the prompt that the first call caches whole on every rank; the cached
    calls after it cut the 16 target tokens over 3 ranks (padded), each attending to the whole prompt
    keys it holds: the output and which calls are cached equal one process's."""
    call = dict(CALL, image=cases.gradient_image(64))
    expected, records, _ = cases.tiny_run("tiny-qwenimage21", CACHE, call)
    runs = rank_pools(3).run(cases.tiny_run, "tiny-qwenimage21", {**CACHE, "parallel": {"ring": 3}}, call)
    for output, got, bytes_sent in runs:
        assert bytes_sent > 0
        assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records]
        assert np.abs(output - expected).max() <= TOLERANCE


def _measured_notes(recipe: dict[str, Any], call: dict[str, Any]) -> tuple[Any, list[str]]:
    """The tiny pipeline measured under `recipe` as `accel run` measures it: its output and the run's notes."""
    from accel.recipe import Recipe
    from accel.measure import measure_recipe

    measured = measure_recipe(cases.tiny_pipeline("tiny-qwenimage21"), Recipe.from_dict(recipe), dict(call), warmup=0)
    return np.asarray(measured.measurement.output), measured.notes


def test_without_the_kv_cache_ring_2_runs_every_call_whole_and_says_so(rank_pools) -> None:
    """use_kv_cache=False: no call passes kv_cache_mode="cached", so the plan cuts none. The run equals one
    process (every rank computes the whole of each call) and its report says the sequence degree gained nothing."""
    call = dict(CALL, num_inference_steps=2, use_kv_cache=False)
    expected, notes = _measured_notes({}, call)
    assert notes == []
    for output, notes in rank_pools(2).run(_measured_notes, {"parallel": {"ring": 2}}, call):
        assert np.abs(output - expected).max() <= TOLERANCE
        assert notes == [
            "context parallelism cut none of QwenImage21Transformer2DModel's calls: its plan cuts only calls passing "
            "kv_cache_mode='cached', so every rank computed each call whole (no speedup from the sequence degree; "
            "the pipeline's own caching options decide which calls those are)"
        ]
    for _, notes in rank_pools(2).run(_measured_notes, {"parallel": {"ring": 2}}, dict(call, use_kv_cache=True)):
        assert notes == []
