"""The shared parallel checks: one process's reference output, and a family's tiny pipeline under a parallel
layout on gloo ranks against it (read by test_parallel_families and every module that runs a family split)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import parallel_cases as cases
from family_case import case_of

from accel.models.registry import FAMILIES
from accel.models.variants import variant_of

TOLERANCE = 1e-4


MODES = {
    "ulysses2": {"ulysses": 2},
    "ring2": {"ring": 2},
    "usp2x2": {"ulysses": 2, "ring": 2},
    "cfg2": {"cfg": 2},
    "cfg2xulysses2": {"cfg": 2, "ulysses": 2},
}


def splits_sequence(family: str) -> bool:
    """Whether Ulysses and Ring may cut the family's own pipeline (a pipeline that refuses them says why
    in its variant's `not_split`; every family's own pipeline is cut today)."""
    return variant_of(FAMILIES[family], FAMILIES[family].pipeline_class).not_split is None


def world_of(parallel: dict[str, int]) -> int:
    return parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1) * parallel.get("tp", 1)


def by_world(cases: list[Any], layout_of: Callable[[Any], dict[str, int]]) -> list[Any]:
    """`cases` in order of the ranks their layout runs on (stable otherwise): the session's rank pool
    forms a group of each size once per matrix instead of once per case (tests/rankpool.py)."""
    return sorted(cases, key=lambda case: world_of(layout_of(case)))


_references: dict[tuple[str, str], Any] = {}


def reference(family: str, call: dict[str, Any], cache: float | dict[str, Any] = 0.0) -> tuple[np.ndarray, Any]:
    """The single-process output (and cache records) in this process, computed once per case;
    `cache` is a threshold or a whole [cache] table."""
    key = (family, repr(sorted(call.items())) + repr(cache))
    if key not in _references:
        recipe = {"cache": cache if isinstance(cache, dict) else {"threshold": cache}} if cache else {}
        output, records, _ = cases.tiny_run(f"tiny-{family}", recipe, call)
        _references[key] = (output, records)
    return _references[key]


def check_equals_one_process(rank_pools: Any, family: str, parallel: dict[str, int], call: dict[str, Any]) -> None:
    """The family's tiny pipeline under `parallel`: every rank exchanged something and returns the
    whole output, equal to one process's."""
    expected, _ = reference(family, call)
    runs = rank_pools(world_of(parallel)).run(cases.tiny_run, f"tiny-{family}", {"parallel": parallel}, call)
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0, "no rank exchanged anything: the mode did not engage"
        assert output.shape == expected.shape
        assert np.abs(output - expected).max() <= TOLERANCE


# DBCache and the TaylorSeer calibrator, the same way: FLUX with a head of two blocks (its double
# list) and a tail of one (in its single list), extrapolating to order 2; Wan (two-call CFG) and
# LTX-Video (batched CFG) with the calibrator on their two-block tiny transformers. TaylorSeer inside
# the blocks (method = "taylorseer": its schedule needs no exchange) and MagCache (its curve's) on the same three.
CACHE_METHODS = {
    "flux-dbcache": (
        "flux",
        {"method": "dbcache", "first_blocks": 2, "last_blocks": 1, "calibrator": "taylorseer", "taylor_order": 2},
    ),
    "wan-calibrator": ("wan", {"calibrator": "taylorseer"}),
    "ltx-calibrator": ("ltx", {"calibrator": "taylorseer"}),
    "flux-taylorseer": ("flux", {"method": "taylorseer", "interval": 3, "taylor_order": 2}),
    "wan-taylorseer": ("wan", {"method": "taylorseer", "interval": 3}),
    "ltx-taylorseer": ("ltx", {"method": "taylorseer", "interval": 3}),
    # MagCache on the curve a calibration run measures on one process (accel tune --calibrate's).
    "flux-magcache": ("flux", {"method": "magcache", "threshold": 0.1}),
    "wan-magcache": ("wan", {"method": "magcache", "threshold": 0.02}),
    "ltx-magcache": ("ltx", {"method": "magcache", "threshold": 0.02}),
}


def check_cache_method_on_ranks(rank_pools: Any, case: str, parallel: dict[str, int]) -> None:
    """CACHE_METHODS[case] under `parallel`, with the family's threshold (MagCache: on its calibrated curve)."""
    family, cache = CACHE_METHODS[case]
    threshold = {} if cache.get("method") == "taylorseer" else {"threshold": case_of(family).threshold}
    if cache.get("method") == "magcache":
        cache = dict(
            cache,
            mag_ratios=cases.magcache_curve(f"tiny-{family}", dict(case_of(family).call, num_inference_steps=8)),
        )
    check_cache_on_ranks(rank_pools, family, parallel, {**threshold, **cache})


def check_cache_on_ranks(
    rank_pools: Any, family: str, parallel: dict[str, int], cache: dict[str, Any], size: dict[str, Any] | None = None
) -> None:
    """`size` replaces the case's size (its `odd` one: token counts the ranks do not divide)."""
    case = case_of(family)
    call = dict(case.call, **(size or {}), num_inference_steps=8)
    expected, records = reference(family, call, cache)
    assert 0 < sum(r[3] for r in records) < len(records)  # a run that caches some calls, not all
    world = world_of(parallel)
    runs = rank_pools(world).run(cases.tiny_run, f"tiny-{family}", {"parallel": parallel, "cache": cache}, call)
    split_calls = parallel.get("cfg", 1) > 1 and FAMILIES[family].cfg == "calls"
    for rank, (output, got, bytes_sent) in enumerate(runs):
        assert bytes_sent > 0
        half = rank // (world // parallel.get("cfg", 1))  # mesh dims are (cfg, ring, ulysses, tp)
        mine = [r for r in records if not split_calls or r[1] == half]
        assert [(s, b, c) for s, b, _, c in got] == [(s, b, c) for s, b, _, c in mine]
        changes = [-1.0 if r[2] is None else r[2] for r in got]  # None: no previous residual yet
        assert changes == pytest.approx([-1.0 if r[2] is None else r[2] for r in mine], rel=1e-4)
        assert np.abs(output - expected).max() <= TOLERANCE
