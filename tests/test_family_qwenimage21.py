"""Qwen-Image 2.1 with a condition picture: the Qwen3-VL encoder sees it in the slots it reserves, and
its latent tokens join the joint sequence before the target's. CFG halves (each branch's first call
returns its own prompt's length, the picture's tokens and the target's) with the cache equal one
process, calls cached alike; so does Ring 3, which cuts the target's tokens of the cached calls."""

from __future__ import annotations

import numpy as np

import parallel_cases as cases
from test_parallel_families import FAMILY_CASES, TOLERANCE

# 8 steps, so the cache (from the third step on: the first computes the prompt too) has calls to skip.
CALL = dict(FAMILY_CASES["qwenimage21"].call, num_inference_steps=8, output_resolution=64)
CACHE = {"cache": {"threshold": FAMILY_CASES["qwenimage21"].threshold}}


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
