"""tiny-flux under context parallelism equals the single-process output, on 2-4 gloo ranks."""

from __future__ import annotations

import numpy as np
import pytest

import parallel_cases as cases
from conftest import FLUX_CALL, generate

TOLERANCE = 1e-4


@pytest.mark.parametrize(
    "parallel",
    [{"ulysses": 2}, {"ring": 2}, {"ring": 3}, {"ulysses": 2, "ring": 2}, {"gpus": 4}],
    ids=["ulysses2", "ring2", "ring3", "usp2x2", "auto4"],
)
def test_parallel_equals_single_process(rank_pools, tiny_flux, flux_reference, parallel) -> None:
    world = parallel.get("gpus") or parallel.get("ulysses", 1) * parallel.get("ring", 1)
    outputs = rank_pools(world).run(cases.tiny_output, "tiny-flux", {"parallel": parallel}, FLUX_CALL)
    for output in outputs:  # every rank returns the full image
        assert output.shape == flux_reference.shape
        assert np.abs(output - flux_reference).max() <= TOLERANCE


@pytest.mark.parametrize(
    "parallel", [{"ulysses": 2}, {"ring": 3}, {"ulysses": 2, "ring": 2}], ids=["ulysses2", "ring3", "usp2x2"]
)
def test_token_count_that_does_not_divide_the_world(rank_pools, tiny_flux, parallel) -> None:
    """48x80 gives 3x5 = 15 image tokens (and 512 text tokens, which 3 does not divide either)."""
    call = dict(FLUX_CALL, height=48, width=80)
    reference = generate(tiny_flux, call)
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1)
    outputs = rank_pools(world).run(cases.tiny_output, "tiny-flux", {"parallel": parallel}, call)
    for output in outputs:
        assert np.abs(output - reference).max() <= TOLERANCE


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 3}], ids=["ulysses2", "ring3-padded"])
def test_cache_under_parallelism_decides_as_one_process(rank_pools, tiny_flux, parallel) -> None:
    """The residual change is summed over the ranks' real tokens only (ring 3 pads 16 image tokens
    to 18), so every rank caches the calls one process caches and the images agree."""
    import accel

    call = dict(FLUX_CALL, num_inference_steps=12)
    handle = accel.apply(tiny_flux, {"cache": {"threshold": 0.4}})
    try:
        reference = generate(tiny_flux, call)
        expected = [(r.step, r.branch, r.change, r.cached) for r in handle.cache_stats.records]
    finally:
        handle.remove()
    assert 0 < sum(r[3] for r in expected) < len(expected)  # a run that caches some calls
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1)
    runs = rank_pools(world).run(cases.tiny_run, "tiny-flux", {"parallel": parallel, "cache": {"threshold": 0.4}}, call)
    for output, records, _ in runs:
        assert [(step, branch, cached) for step, branch, _, cached in records] == [(s, b, c) for s, b, _, c in expected]
        changes = [-1.0 if r[2] is None else r[2] for r in records]  # None: no previous residual yet
        expected_changes = [-1.0 if r[2] is None else r[2] for r in expected]
        assert changes == pytest.approx(expected_changes, rel=1e-5)  # padding would shift these
        assert np.abs(output - reference).max() <= TOLERANCE
