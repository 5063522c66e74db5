"""Every family's tiny pipeline under every parallel mode equals the single-process output (gloo ranks).

Calls run with classifier-free guidance on, so CFG parallelism has branches to split: batched
(CogVideoX, Mochi, LTX-Video) or one transformer call per branch (FLUX and HunyuanVideo true
CFG, Wan). Each family's cache threshold caches some but not all calls of an 8-step run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import parallel_cases as cases
from variant_cases import picture

from accel.models.registry import FAMILIES
from accel.models.variants import variant_of

TOLERANCE = 1e-4
PROMPT = dict(prompt="a red fox", negative_prompt="blurry")


@dataclass(frozen=True)
class FamilyCase:
    call: dict[str, Any]
    # A size whose token counts 3 ranks do not divide (the text lengths do not divide either).
    odd: dict[str, Any]
    threshold: float


FAMILY_CASES = {
    "flux": FamilyCase(
        dict(PROMPT, true_cfg_scale=2.0, height=64, width=64, num_inference_steps=4, guidance_scale=3.5),
        odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 512 text tokens
        threshold=0.5,
    ),
    "wan": FamilyCase(
        dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
        odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 patches = 40 tokens
        threshold=0.1,
    ),
    "skyreels2": FamilyCase(
        dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0),
        odd=dict(
            height=80, width=112, num_frames=17
        ),  # 5 latent frames x 5x7 patches = 175 tokens (3, 4, 8 do not divide)
        threshold=0.1,
    ),
    "hunyuan": FamilyCase(
        dict(PROMPT, true_cfg_scale=2.0, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0),
        odd=dict(height=64, width=80, num_frames=5),  # 40 video tokens, 256 text tokens
        threshold=0.3,
    ),
    "cogvideox": FamilyCase(
        dict(PROMPT, height=64, width=64, num_frames=9, num_inference_steps=4, guidance_scale=6.0),
        odd=dict(height=64, width=80, num_frames=17),  # 5 latent frames x 4x5 = 100 video tokens, 226 text
        threshold=0.8,
    ),
    "mochi": FamilyCase(
        dict(PROMPT, height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5),
        odd=dict(height=64, width=80, num_frames=7),  # 2 latent frames x 4x5 = 40 video tokens
        threshold=0.3,
    ),
    "ltx": FamilyCase(
        dict(PROMPT, height=96, width=128, num_frames=9, num_inference_steps=4, guidance_scale=3.0),
        odd=dict(height=128, width=160, num_frames=9),  # 2 latent frames x 4x5 = 40 video tokens
        threshold=0.1,
    ),
    "qwenimage": FamilyCase(
        dict(PROMPT, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=4),
        odd=dict(height=48, width=80),  # 3x5 = 15 image tokens; 4 and 2 prompt tokens, unpadded
        threshold=0.5,
    ),
    "flux2-klein": FamilyCase(
        dict(
            prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=4.0
        ),  # CFG on the empty prompt
        odd=dict(height=64, width=80),  # 4x5 = 20 image tokens, 512 text tokens (inpaint needs 64 px at least)
        threshold=0.8,
    ),
    "sd3": FamilyCase(
        dict(PROMPT, height=64, width=64, num_inference_steps=4, guidance_scale=3.5),  # batched CFG
        odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 333 text tokens
        threshold=0.5,
    ),
    "flux2": FamilyCase(
        dict(
            prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=4.0
        ),  # embedded guidance, no CFG
        odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 512 text tokens
        threshold=0.7,
    ),
    "zimage": FamilyCase(
        dict(
            PROMPT, height=64, width=64, num_inference_steps=4, guidance_scale=4.0
        ),  # batched CFG, as the base model runs
        # 5x7 = 35 image tokens and 17 caption tokens, each padded to 32s: 96 unified tokens; the
        # negative's 43 caption tokens make 128, so the batch pads the positive with a key mask.
        odd=dict(height=80, width=112, negative_prompt="blurry, low quality, jpeg artifacts"),
        threshold=1.15,  # block 0's residual changes by ~100 % a step with random adaLN weights
    ),
    "hunyuan15": FamilyCase(
        dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4),  # the guider's CFG: two calls a step
        odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 = 40 video tokens, 1985 text tokens
        threshold=0.3,
    ),
    "kandinsky5": FamilyCase(
        dict(
            PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0
        ),  # two calls per step
        odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 patches = 40 video tokens
        threshold=0.2,
    ),
    "ltx2": FamilyCase(
        # Batched CFG, plus the pipeline's spatio-temporal and modality guidance calls (batch 1) each step.
        dict(PROMPT, height=64, width=96, num_frames=9, num_inference_steps=4, guidance_scale=4.0),
        odd=dict(height=64, width=160, num_frames=9),  # 2 latent frames x 2x5 = 20 video tokens; 9 audio tokens
        threshold=0.3,
    ),
    "chronoedit": FamilyCase(
        # The picture to edit, resized by the pipeline to the call's size; 5 frames, as it makes without temporal
        # reasoning.
        dict(PROMPT, image=picture(), height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
        odd=dict(height=80, width=112),  # 2 latent frames x 5x7 patches = 70 video tokens (3, 4, 8 do not divide)
        threshold=0.1,
    ),
    "hunyuanimage": FamilyCase(
        dict(PROMPT, height=64, width=64, num_inference_steps=4),  # the guider's CFG (scale 3.5): two calls a step
        # 2x5 = 10 image tokens (32x VAE, patch 1); 1128 text tokens (the pipeline pads Qwen to 1000, ByT5
        # to 128), which 3 ranks divide: the image stream pads alone.
        odd=dict(height=64, width=160),
        threshold=0.5,
    ),
    "qwenimage21": FamilyCase(
        dict(PROMPT, true_cfg_scale=4.0, height=64, width=64, num_inference_steps=4),  # true CFG: two calls a step
        odd=dict(height=64, width=160),  # 4x10 = 40 target tokens after 37 prompt tokens: the cached calls cut the 40
        threshold=1.0,  # block 0's output changes by ~100 % a step with random weights; this caches 3 of 16 calls
    ),
    "helios": FamilyCase(
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
    ),
    "cosmos3": FamilyCase(
        # Two calls a step (the prompt and the negative differ in length), the sound track with the video.
        dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0, enable_sound=True),
        odd=dict(
            height=80, width=112
        ),  # 2 latent frames x 5x7 patches = 70 video tokens and 6 sound tokens: 76, cut as one stream
        threshold=0.06,
    ),
    "kandinsky6": FamilyCase(
        # Two calls a step; 2 latent frames x 4x4 patches = 32 video tokens, which 3 ranks do not divide
        # (the odd size is this one: no second reference run), beside 53 audio tokens, whole on every rank.
        dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
        odd={},
        threshold=0.2,
    ),
}

MODES = {
    "ulysses2": {"ulysses": 2},
    "ring2": {"ring": 2},
    "usp2x2": {"ulysses": 2, "ring": 2},
    "cfg2": {"cfg": 2},
    "cfg2xulysses2": {"cfg": 2, "ulysses": 2},
}
CACHE_MODES = {**{k: v for k, v in MODES.items() if k != "ring2"}, "ring3": {"ring": 3}}


def splits_sequence(family: str) -> bool:
    """Whether Ulysses and Ring may cut the family's own pipeline (a pipeline that refuses them says why
    in its variant's `not_split`; every family's own pipeline is cut today)."""
    return variant_of(FAMILIES[family], FAMILIES[family].pipeline_class).not_split is None


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


def world_of(parallel: dict[str, int]) -> int:
    return parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1) * parallel.get("tp", 1)


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


def test_every_family_has_a_plan_and_a_cfg_style() -> None:
    assert set(FAMILY_CASES) == set(FAMILIES)
    for family in FAMILIES.values():
        assert family.parallel is not None, family.name
        assert family.cfg is not None or family.name == "flux2", family.name  # guidance-distilled: no branches


# Every other mode of MODES runs against one process with the cache on (test_cache_decides_on_every_rank_as_one_
# process): the calls the cache computes (the first steps always) run every block split, and the outputs are
# compared there too. Ring 2 runs here without the cache; Ring 3 there, and at odd token counts below.
UNCACHED_MODES = {mode: MODES[mode] for mode in MODES if mode not in CACHE_MODES}


@pytest.mark.parametrize("family, mode", family_modes(UNCACHED_MODES))
def test_parallel_equals_single_process(rank_pools, family: str, mode: str) -> None:
    check_equals_one_process(rank_pools, family, MODES[mode], FAMILY_CASES[family].call)


def check_equals_one_process(rank_pools: Any, family: str, parallel: dict[str, int], call: dict[str, Any]) -> None:
    """The family's tiny pipeline under `parallel`: every rank exchanged something and returns the
    whole output, equal to one process's."""
    expected, _ = reference(family, call)
    runs = rank_pools(world_of(parallel)).run(cases.tiny_run, f"tiny-{family}", {"parallel": parallel}, call)
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0, "no rank exchanged anything: the mode did not engage"
        assert output.shape == expected.shape
        assert np.abs(output - expected).max() <= TOLERANCE


@pytest.mark.parametrize("family, mode", family_modes(CACHE_MODES))
def test_cache_decides_on_every_rank_as_one_process(rank_pools, family: str, mode: str) -> None:
    """Each rank caches exactly the calls one process caches (with two-call CFG split over the halves,
    the calls of its own branch), with the same block-0 change, and the outputs agree: every mode's
    matrix against one process (but Ring 2's, above). Ring 3 runs at the family's odd size, whose token
    counts 3 ranks do not divide: the padded split, cached or computed, equals one process."""
    case = FAMILY_CASES[family]
    size = case.odd if mode == "ring3" else None
    check_cache_on_ranks(rank_pools, family, CACHE_MODES[mode], {"threshold": case.threshold}, size)


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


def check_cache_method_on_ranks(rank_pools: Any, case: str, parallel: dict[str, int]) -> None:
    """CACHE_METHODS[case] under `parallel`, with the family's threshold (MagCache: on its calibrated curve)."""
    family, cache = CACHE_METHODS[case]
    threshold = {} if cache.get("method") == "taylorseer" else {"threshold": FAMILY_CASES[family].threshold}
    if cache.get("method") == "magcache":
        cache = dict(
            cache,
            mag_ratios=cases.magcache_curve(f"tiny-{family}", dict(FAMILY_CASES[family].call, num_inference_steps=8)),
        )
    check_cache_on_ranks(rank_pools, family, parallel, {**threshold, **cache})


def check_cache_on_ranks(
    rank_pools: Any, family: str, parallel: dict[str, int], cache: dict[str, Any], size: dict[str, Any] | None = None
) -> None:
    """`size` replaces the case's size (its `odd` one: token counts the ranks do not divide)."""
    case = FAMILY_CASES[family]
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
