"""SD 3.5 medium: the image-only second attention of its first blocks (the plan's module keys)
under context parallelism equals one process, with and without the cache."""

from __future__ import annotations

import numpy as np
import pytest
from test_parallel_families import FAMILY_CASES, MODES, world_of

import parallel_cases as cases

MEDIUM = "accel.models.sd3:build_tiny_medium"
TOLERANCE = 1e-4


def test_the_medium_builder_has_dual_attention_blocks() -> None:
    transformer = cases.tiny_pipeline(MEDIUM).transformer
    assert transformer.config.dual_attention_layers == (0,)
    assert transformer.transformer_blocks[0].attn2 is not None
    assert getattr(transformer.transformer_blocks[1], "attn2", None) is None


@pytest.mark.parametrize(
    "mode, odd, cache", [("ulysses2", False, False), ("usp2x2", True, True), ("cfg2xulysses2", False, True)]
)
def test_medium_equals_one_process(rank_pools, mode: str, odd: bool, cache: bool) -> None:
    case = FAMILY_CASES["sd3"]
    call = dict(case.call, **case.odd) if odd else case.call
    recipe = {"cache": {"threshold": case.threshold}} if cache else {}
    expected, records, _ = cases.tiny_run(MEDIUM, recipe, call)
    parallel = MODES[mode]
    for output, got, bytes_sent in rank_pools(world_of(parallel)).run(
        cases.tiny_run, MEDIUM, {**recipe, "parallel": parallel}, call
    ):
        assert bytes_sent > 0
        if cache:  # the same calls cached, after the same block-0 change (up to float rounding)
            assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in records]
            assert [r[2] or -1.0 for r in got] == pytest.approx([r[2] or -1.0 for r in records], rel=1e-5)
        assert np.abs(output - expected).max() <= TOLERANCE
