"""Every family's tiny pipeline under every parallel mode equals the single-process output (gloo ranks).

Calls run with classifier-free guidance on, so CFG parallelism has branches to split: batched
(CogVideoX, Mochi, LTX-Video) or one transformer call per branch (FLUX and HunyuanVideo true
CFG, Wan). Each family's cache threshold caches some but not all calls of an 8-step run.
"""

from __future__ import annotations


import numpy as np
import pytest

import parallel_cases as cases
from families import FAMILY_CASES
from family_parallel import (
    MODES,
    TOLERANCE,
    by_world,
    check_cache_method_on_ranks,
    check_cache_on_ranks,
    check_equals_one_process,
    splits_sequence,
    world_of,
)

from accel.models.registry import FAMILIES


CACHE_MODES = {**{k: v for k, v in MODES.items() if k != "ring2"}, "ring3": {"ring": 3}}


def family_modes(modes: dict[str, dict[str, int]]) -> list[tuple[str, str]]:
    """(family, mode) pairs; the CFG modes only for families whose pipelines run CFG (FLUX.2-dev
    embeds its guidance scale instead: cfg = 2 is refused for it, see tests/test_family_flux2.py),
    the modes that cut the sequence only for families whose pipeline can be cut."""
    return [
        (family, mode)
        for family in FAMILY_CASES
        for mode in modes
        if ("cfg" not in modes[mode] or FAMILIES[family].cfg is not None)
        and (world_of(modes[mode]) == modes[mode].get("cfg", 1) or splits_sequence(family))
    ]


def test_every_family_has_a_plan_and_a_cfg_style() -> None:
    assert set(FAMILY_CASES) == set(FAMILIES)
    for family in FAMILIES.values():
        assert family.parallel is not None, family.name
        assert family.cfg is not None or family.name == "flux2", family.name  # guidance-distilled: no branches


# Every other mode of MODES runs against one process with the cache on (test_cache_decides_on_every_rank_as_one_
# process): the calls the cache computes (the first steps always) run every block split, and the outputs are
# compared there too. Ring 2 runs here without the cache; Ring 3 there, and at odd token counts below.
UNCACHED_MODES = {mode: MODES[mode] for mode in MODES if mode not in CACHE_MODES}


@pytest.mark.parametrize("family, mode", by_world(family_modes(UNCACHED_MODES), lambda case: MODES[case[1]]))
def test_parallel_equals_single_process(rank_pools, family: str, mode: str) -> None:
    check_equals_one_process(rank_pools, family, MODES[mode], FAMILY_CASES[family].call)


def cache_family_modes() -> list[tuple[str, str]]:
    """family_modes(CACHE_MODES) but Ulysses 2 and CFG 2 alone where the family runs CFG 2 x Ulysses 2:
    that mode runs both engines, each as alone (Ulysses inside a half is the same split, ring 1; the
    halves the same branches), at the cost of one 4-rank run instead of three. Ulysses on both CFG
    branches batched together runs in tests/test_tensor_parallel.py's tp2xulysses2, every family."""
    pairs = family_modes(CACHE_MODES)
    both = {family for family, mode in pairs if mode == "cfg2xulysses2"}
    return [(family, mode) for family, mode in pairs if not (family in both and mode in ("ulysses2", "cfg2"))]


@pytest.mark.parametrize("family, mode", by_world(cache_family_modes(), lambda case: CACHE_MODES[case[1]]))
def test_cache_decides_on_every_rank_as_one_process(rank_pools, family: str, mode: str) -> None:
    """Each rank caches exactly the calls one process caches (with two-call CFG split over the halves,
    the calls of its own branch), with the same block-0 change, and the outputs agree: every mode's
    matrix against one process (but Ring 2's, above). Ring 3 runs at the family's odd size, whose token
    counts 3 ranks do not divide: the padded split, cached or computed, equals one process."""
    case = FAMILY_CASES[family]
    size = case.odd if mode == "ring3" else None
    check_cache_on_ranks(rank_pools, family, CACHE_MODES[mode], {"threshold": case.threshold}, size)


# Each method on each of the three families once, the modes rotated so that every family and every
# method meets all three (Ulysses, Ring at a token count 3 does not divide, CFG halves x Ulysses).
METHOD_MODES = {
    "flux-dbcache": "ulysses2",
    "wan-calibrator": "ring3",
    "ltx-calibrator": "cfg2xulysses2",
    "flux-taylorseer": "ring3",
    "wan-taylorseer": "cfg2xulysses2",
    "ltx-taylorseer": "ulysses2",
    "flux-magcache": "cfg2xulysses2",
    "wan-magcache": "ulysses2",
    "ltx-magcache": "ring3",
}


@pytest.mark.parametrize("case, mode", list(METHOD_MODES.items()))
def test_cache_methods_decide_on_every_rank_as_one_process(rank_pools, case: str, mode: str) -> None:
    check_cache_method_on_ranks(rank_pools, case, CACHE_MODES[mode])


@pytest.mark.parametrize(
    "family, off, detail",
    [
        ("wan", dict(guidance_scale=1.0), "the pipeline called the transformer once per step"),
        ("flux", dict(true_cfg_scale=1.0), "the pipeline called the transformer once per step"),
        ("ltx", dict(guidance_scale=1.0), "the transformer got a batch of 1"),
    ],
)
def test_cfg_parallel_without_guidance_stops_every_rank_with_one_message(
    rank_pools, family: str, off: dict, detail: str
) -> None:
    """accel.apply cannot see the call's settings beforehand: the first step with nothing to split
    stops every rank with the same message (no hang, no half-computed output)."""
    call = dict(FAMILY_CASES[family].call, **off)
    errors = rank_pools(4).run(cases.tiny_error, f"tiny-{family}", {"parallel": {"cfg": 2, "ulysses": 2}}, call)
    assert (
        errors
        == [
            f"UserError: [parallel] cfg = 2 splits the classifier-free guidance branches, but {detail}; turn guidance "
            "on "
            "(a guidance scale above 1, with a negative prompt where the model needs one) or set cfg = 1"
        ]
        * 4
    )


# Wan 2.1 I2V (and VACE, video-to-video, Lucy-Edit) are pipeline variants: tests/test_variants.py.
WAN_VARIANTS = {
    # Wan 2.2 A14B: a high-noise and a low-noise transformer, two steps each.
    "2.2": ("accel.models.wan:build_tiny_22", dict(FAMILY_CASES["wan"].call, guidance_scale=4.0, guidance_scale_2=3.0)),
}


@pytest.mark.parametrize("mode", ["ulysses2", "ring2", "cfg2xulysses2"])
@pytest.mark.parametrize("variant", list(WAN_VARIANTS))
def test_wan_two_expert_variant(rank_pools, variant: str, mode: str) -> None:
    builder, call = WAN_VARIANTS[variant]
    expected, _, _ = cases.tiny_run(builder, {}, call)
    parallel = MODES[mode]
    for output, _, bytes_sent in rank_pools(world_of(parallel)).run(
        cases.tiny_run, builder, {"parallel": parallel}, call
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


@pytest.mark.parametrize("parallel", [(2, 1), (1, 3)], ids=["ulysses2", "ring3"])
def test_wan_per_token_timesteps_are_cut_with_the_video(rank_pools, parallel: tuple[int, int]) -> None:
    """Wan 2.2 TI2V gives every video token its own timestep: those are cut like the tokens."""
    errors = rank_pools(parallel[0] * parallel[1]).run(cases.wan_per_token_timestep_error, *parallel)
    assert max(errors) <= TOLERANCE


@pytest.mark.parametrize("parallel", [(1, 3), (4, 1), (4, 2)], ids=["ring3", "ulysses4", "usp4x2"])
def test_video_splits_at_a_token_count_3_4_and_8_ranks_do_not_divide(rank_pools, parallel: tuple[int, int]) -> None:
    """50 video tokens over 3, 4 and 8 ranks: Wan's per-token timesteps, VACE's control tokens and
    hints, SkyReels-V2's per-frame (diffusion forcing) modulation are cut with the video, and Wan
    Animate's face adapter runs by latent frame."""
    runs = rank_pools(parallel[0] * parallel[1]).run(cases.video_split_errors, *parallel)
    assert max(max(errors) for errors in runs) <= TOLERANCE


@pytest.mark.parametrize("mode", ["ulysses2", "usp2x2"])
def test_heads_the_ulysses_degree_does_not_divide(rank_pools, mode: str) -> None:
    """Three heads over Ulysses 2: the ranks pad to four head slots and still equal one process."""
    builder, call = "parallel_cases:tiny_wan_three_heads", FAMILY_CASES["wan"].call
    expected, _, _ = cases.tiny_run(builder, {}, call)
    assert cases.tiny_pipeline(builder).transformer.config.num_attention_heads == 3
    parallel = MODES[mode]
    for output, _, bytes_sent in rank_pools(world_of(parallel)).run(
        cases.tiny_run, builder, {"parallel": parallel}, call
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE
