"""Parallel VAE decode on CPU gloo ranks: the split decode equals the single-process decode.

Each supported VAE at a tiny config, on 2 and 3 ranks with latent heights the ranks do not
divide; with tiling; pixels on rank 0 only or on every rank; the peak tensor per rank; the
generic engine on plain torch layers and its refusals; and whole pipelines with the transformer
parallel or not.
"""

from __future__ import annotations

import numpy as np
import pytest
import vae_cases
from families import FAMILY_CASES
from family_parallel import reference, splits_sequence

import parallel_cases as cases
from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.models.vaes import VAE_PLANS

TOLERANCE = 1e-4  # float32 max abs, as the issue asks

# (tiny pipeline or builder, latent frames; None: an image VAE)
VAES = {
    "AutoencoderKL": ("tiny-flux", None),
    "AutoencoderKLHunyuanVideo": ("tiny-hunyuan", 2),
    "AutoencoderKLWan": ("tiny-wan", 2),
    "AutoencoderKLWan 2.2": ("accel.models.wan:build_tiny_22", 2),
    "AutoencoderKLCogVideoX": ("tiny-cogvideox", 3),
    "AutoencoderKLMochi": ("tiny-mochi", 2),
    "AutoencoderKLLTXVideo": ("tiny-ltx", 2),
    "AutoencoderKLLTXVideo with noise": ("ltx-noise", 2),
    "AutoencoderKLQwenImage": ("tiny-qwenimage", 1),
    "AutoencoderKLFlux2": ("tiny-flux2-klein", None),
    "AutoencoderKLHunyuanVideo15": ("tiny-hunyuan15", 2),
    "AutoencoderKLLTX2Video": ("tiny-ltx2", 2),
    "AutoencoderKLHunyuanImage": ("tiny-hunyuanimage", None),
    "AutoencoderKLHunyuanImageRefiner": ("accel.models.hunyuanimage:build_tiny_refiner", 1),
    "AutoencoderKLQwenImage21": ("tiny-qwenimage21", 1),
}
KL_TILES = {"tile_sample_min_size": 32, "tile_latent_min_size": 4, "tile_overlap_factor": 0.25}
WAN_TILES = {
    "tile_sample_min_height": 32,
    "tile_sample_min_width": 32,
    "tile_sample_stride_height": 24,
    "tile_sample_stride_width": 24,
}


def test_every_family_vae_has_a_plan() -> None:
    for family in FAMILIES.values():
        assert family.vae in VAE_PLANS, family.name
        assert type(cases.tiny_pipeline(f"tiny-{family.name}").vae).__name__ == family.vae
    assert {name.split(" ")[0] for name in VAES} == set(VAE_PLANS)


@pytest.mark.parametrize("vae", list(VAES))
@pytest.mark.parametrize("world, rows", [(2, 7), (3, 5)])  # the outer loop: the pool regroups once
def test_split_decode_equals_the_single_process_decode(rank_pools, vae: str, world: int, rows: int) -> None:
    model, frames = VAES[vae]
    first, *others = rank_pools(world).run(vae_cases.vae_decode_case, model, rows, 6, frames)
    assert first["calls"] >= 1, "the decode was not split"
    assert first["shape"] == first["reference_shape"]
    assert first["error"] <= TOLERANCE
    for other in others:  # only rank 0 needs the pixels: the others get zeros of the same shape
        assert other["zeros"] and other["shape"] == first["shape"] and other["calls"] == first["calls"]
    assert all(result["undone_equal"] for result in (first, *others))


@pytest.mark.parametrize("vae", ["AutoencoderKL", "AutoencoderKLWan"])
def test_every_rank_gets_the_pixels_when_asked(rank_pools, vae: str) -> None:
    model, frames = VAES[vae]
    for result in rank_pools(3).run(vae_cases.vae_decode_case, model, 7, 6, frames, None, True):
        assert result["error"] <= TOLERANCE


@pytest.mark.parametrize("vae, tiles", [("AutoencoderKL", KL_TILES), ("AutoencoderKLWan", WAN_TILES)])
def test_each_tile_is_split_under_tiling(rank_pools, vae: str, tiles: dict) -> None:
    model, frames = VAES[vae]
    first, second = rank_pools(2).run(vae_cases.vae_decode_case, model, 11, 9, frames, tiles)
    assert first["calls"] > 1  # one split decoder call per tile
    assert first["error"] <= TOLERANCE  # against the single-process tiled decode
    assert second["zeros"]


@pytest.mark.parametrize("vae", ["AutoencoderKL", "AutoencoderKLCogVideoX"])
def test_the_largest_tensor_per_rank_falls_as_ranks_are_added(rank_pools, vae: str) -> None:
    model, frames = VAES[vae]
    two = rank_pools(2).run(vae_cases.vae_decode_case, model, 12, 12, frames)
    three = rank_pools(3).run(vae_cases.vae_decode_case, model, 12, 12, frames)
    single = two[0]["largest_single"]
    largest_two, largest_three = (max(r["largest_split"] for r in runs) for runs in (two, three))
    assert largest_three < largest_two < 0.7 * single


def test_too_few_latent_rows_decode_whole_on_every_rank(rank_pools) -> None:
    for result in rank_pools(3).run(vae_cases.vae_decode_case, "tiny-flux", 2, 6, None):
        assert result["calls"] == 0
    assert rank_pools(3).run(vae_cases.vae_decode_case, "tiny-flux", 2, 6, None)[0]["error"] == 0.0


@pytest.mark.parametrize("world, rows", [(2, 9), (3, 11)])
def test_plain_torch_layers_split_without_a_plan(rank_pools, world: int, rows: int) -> None:
    for error in rank_pools(world).run(vae_cases.toy_decode_case, "conv", rows):
        assert error <= TOLERANCE


@pytest.mark.parametrize(
    "last, rows, message",
    [
        (
            "bilinear",
            9,
            "NotAvailableError: parallel VAE: the decoder resizes with 'bilinear' interpolation, "
            "which blends neighbouring rows; set [vae] parallel = false",
        ),
        (
            "transposed",
            9,
            "NotAvailableError: parallel VAE: the decoder upsamples with a transposed convolution, "
            "which the row split does not handle; set [vae] parallel = false",
        ),
        (
            "wide",
            3,
            "NotAvailableError: parallel VAE: an operation reaches 3 rows past a rank that holds only 1 "
            "at this resolution; decode on fewer ranks or a larger image",
        ),
    ],
)
def test_layers_the_split_cannot_follow_stop_every_rank_with_one_message(
    rank_pools, last: str, rows: int, message: str
) -> None:
    assert rank_pools(3).run(vae_cases.toy_decode_case, last, rows) == [message] * 3


def test_a_vae_without_a_plan_is_refused() -> None:
    from accel.vae import plan_for

    with pytest.raises(UserError) as error:
        plan_for(vae_cases.ToyVae())
    assert str(error.value) == (
        "[vae] parallel: accel has no parallel decode for ToyVae (it has for AutoencoderKL, AutoencoderKLHunyuanVideo, "
        "AutoencoderKLWan, AutoencoderKLCogVideoX, AutoencoderKLMochi, AutoencoderKLLTXVideo, AutoencoderKLQwenImage, "
        "AutoencoderKLQwenImage21, AutoencoderKLFlux2, AutoencoderKLHunyuanVideo15, AutoencoderKLLTX2Video, "
        "AutoencoderKLHunyuanImage, AutoencoderKLHunyuanImageRefiner); set parallel = false"
    )


def test_one_process_leaves_the_decode_alone(tiny_flux) -> None:
    import accel

    handle = accel.apply(tiny_flux, {"vae": {"parallel": True}})
    try:
        assert handle.vae_decode is None
        assert "forward" not in vars(tiny_flux.vae.decoder)  # no override installed
    finally:
        handle.remove()


def test_the_run_table_says_the_decode_is_split() -> None:
    from accel.report import _parallel

    layout = {"world_size": 2, "ulysses": 2, "ring": 1, "cfg": 1, "chosen": True}
    assert _parallel(dict(layout, vae_split=True)) == "ulysses 2 (chosen for 2 processes), VAE decode split"
    assert _parallel(dict(layout, vae_split=False)) == "ulysses 2 (chosen for 2 processes)"


PIPELINE_MODES = {
    "ulysses2": ({"ulysses": 2}, 2),
    "cfg2": ({"cfg": 2}, 2),
    "ring3": ({"ring": 3}, 3),
    "transformer whole": ({}, 2),  # the transformer replicated, only the decode split
}
# Every family with Ulysses and with the transformer whole; CFG halves and 3 ranks for one image
# and one video family.
PIPELINE_CASES = [
    (family, mode)
    for family in FAMILY_CASES
    for mode in ("ulysses2", "transformer whole")
    if mode != "ulysses2" or splits_sequence(family)
]
PIPELINE_CASES += [(family, mode) for family in ("flux", "wan") for mode in ("cfg2", "ring3")]


@pytest.mark.parametrize("family, mode", sorted(PIPELINE_CASES, key=lambda case: PIPELINE_MODES[case[1]][1]))
def test_pipelines_with_the_split_decode_equal_one_process(rank_pools, family: str, mode: str) -> None:
    parallel, world = PIPELINE_MODES[mode]
    case = FAMILY_CASES[family]
    call = dict(case.call, **case.odd) if world == 3 else case.call  # latent rows 3 ranks do not divide
    expected, _ = reference(family, call)
    recipe = {"parallel": parallel, "vae": {"parallel": True}}
    runs = rank_pools(world).run(cases.tiny_run, f"tiny-{family}", recipe, call)
    output = runs[0][0]  # rank 0 writes the file; the others decoded zeros
    assert output.shape == expected.shape
    assert np.abs(output - expected).max() <= TOLERANCE
    if not parallel:  # only the decode moves bytes: it was split
        assert all(bytes_sent > 0 for _, _, bytes_sent in runs)
