"""Tensor parallelism: every family's tiny pipeline with its blocks split over TP ranks equals one
process, alone and inside every other mesh dimension (Ulysses, CFG halves, Ring at a token count
3 ranks do not divide), with and without the cache; each rank holds its share of the weights;
impossible degrees are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import parallel_cases as cases
from accel.errors import NotAvailableError, UserError
from accel.parallel.plan_format import TensorPlan
from accel.models.registry import FAMILIES
from accel.parallel.mesh import resolve_degrees
from accel.parallel.tensor import planned_layers, resolve_tensor_plan, width_problem
from accel.recipe.sections import ParallelSection
from families import FAMILY_CASES
from family_parallel import (
    TOLERANCE,
    by_world,
    check_cache_method_on_ranks,
    check_cache_on_ranks,
    reference,
    splits_sequence,
)

LAYOUTS = {
    "tp2": {"tp": 2},
    "tp2xulysses2": {"tp": 2, "ulysses": 2},
    "cfg2xtp2": {"cfg": 2, "tp": 2},
    "tp2xring3": {"tp": 2, "ring": 3},  # at each family's odd size: 3 ranks do not divide its tokens
}


def family_layouts() -> list[tuple[str, str]]:
    """(family, layout) pairs; CFG halves only for families whose pipelines run CFG, Ulysses and Ring
    only for families whose pipeline can be cut. TP 2 alone only where Ulysses cannot cut: TP inside
    Ulysses 2 splits the same weights and sums the same layers, on its share of the tokens."""
    return [
        (family, layout)
        for family in FAMILY_CASES
        for layout in LAYOUTS
        if ("cfg" not in LAYOUTS[layout] or FAMILIES[family].cfg is not None)
        and (splits_sequence(family) or not {"ulysses", "ring"} & set(LAYOUTS[layout]))
        and (layout != "tp2" or not splits_sequence(family))
    ]


def size_of(family: str, layout: str) -> dict:
    return FAMILY_CASES[family].odd if "ring" in LAYOUTS[layout] else {}


def test_every_family_has_a_tensor_plan() -> None:
    assert all(family.tensor is not None for family in FAMILIES.values())


@pytest.mark.parametrize("family, layout", by_world(family_layouts(), lambda case: LAYOUTS[case[1]]))
def test_tensor_parallel_with_the_cache_equals_one_process(rank_pools, family: str, layout: str) -> None:
    """The outputs agree with one process's, and each rank caches exactly the calls one process caches,
    with the same change (the TP ranks read one sum over the call's ranks). The calls the cache computes
    (the first steps always) run every block split, so this is also the matrix of TP against one process."""
    check_cache_on_ranks(
        rank_pools, family, LAYOUTS[layout], {"threshold": FAMILY_CASES[family].threshold}, size_of(family, layout)
    )


# Tiny FLUX.1's blocks as diffusers' _tp_plan splits them (parameters; weights and column-wise
# biases, a row-wise layer's bias stays whole). A double block: Q, K, V and their text twins
# 6 x (64 x 64 + 64), the two output projections 2 x 64 x 64, the two MLP inputs 2 x (256 x 64 +
# 256) and outputs 2 x 64 x 256: 99 200. A single block: Q, K, V 3 x (64 x 64 + 64), the MLP input
# 256 x 64 + 256, the packed output 64 x 320: 49 600. Two of each.
FLUX_SPLIT_PARAMETERS = 2 * 99_200 + 2 * 49_600


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_holds_its_share_of_the_split_weights(rank_pools, tp: int) -> None:
    call = FAMILY_CASES["flux"].call
    whole = sum(p.numel() * p.element_size() for p in cases.tiny_pipeline("tiny-flux").transformer.parameters())
    runs = rank_pools(tp).run(cases.held_bytes, "tiny-flux", {"parallel": {"tp": tp}}, call)
    split = FLUX_SPLIT_PARAMETERS * 4  # float32
    for held, widths in runs:
        assert held == whole - split + split // tp
        # to_q: (64 / tp) x 64 out x in; to_out.0: 64 x (64 / tp); ff.net.0.proj: (256 / tp) x 64.
        assert {(64 // tp) * 10_000 + 64, 64 * 10_000 + 64 // tp, (256 // tp) * 10_000 + 64} <= set(widths)


def test_tp_that_does_not_divide_the_heads_is_refused_naming_the_divisors() -> None:
    with pytest.raises(UserError) as error:
        resolve_degrees(ParallelSection(tp=5), 24, "FLUX.1")
    assert (
        str(error.value)
        == "[parallel] tp = 5 does not divide the 24 attention heads of FLUX.1; use tp = 2, 3, 4, 6, 8, 12 or 24"
    )
    with pytest.raises(UserError) as error:
        resolve_degrees(ParallelSection(gpus=6, tp=4), 24, "FLUX.1")
    assert str(error.value) == "[parallel] gpus = 6 does not split into tp = 4 ranks; use a multiple of 4 GPUs"
    with pytest.raises(UserError) as error:
        resolve_degrees(ParallelSection(ulysses=4, tp=2), 6, "m")
    assert str(error.value) == (
        "[parallel] ulysses = 4 is more than the 3 attention heads each of tp = 2 ranks holds of m's 6; "
        "use ulysses = 1, ring = 4 for 4 sequence-parallel ranks"
    )


def test_degrees_with_tp_are_chosen_for_the_ranks_left() -> None:
    from accel.parallel.mesh import Degrees

    assert resolve_degrees(ParallelSection(gpus=8, tp=2), 24, "FLUX.1") == Degrees(ulysses=4, ring=1, tp=2)
    assert resolve_degrees(ParallelSection(gpus=8, tp=2, cfg=2), 24, "FLUX.1") == Degrees(
        ulysses=2, ring=1, cfg=2, tp=2
    )
    # 40 heads over tp 4 leave 10 a rank: Ulysses 2 divides them, the other 2 sequence ranks run Ring.
    assert resolve_degrees(ParallelSection(gpus=16, tp=4), 40, "m") == Degrees(ulysses=4, ring=1, tp=4)


def test_a_width_the_degree_does_not_divide_is_refused_naming_it() -> None:
    from diffusers import WanTransformer3DModel

    plan = FAMILIES["wan"].tensor
    transformer = WanTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=130,
        num_layers=1,
    )
    assert width_problem(transformer, plan, 2, "WanTransformer3DModel") is None
    assert width_problem(transformer, plan, 4, "WanTransformer3DModel") == (
        "[parallel] tp = 4 does not divide blocks.0.ffn.net.0.proj (output width 130) of WanTransformer3DModel; use "
        "tp = 2"
    )


def test_a_plan_that_names_no_layer_is_refused() -> None:
    with pytest.raises(NotAvailableError) as error:
        planned_layers(torch.nn.Sequential(torch.nn.Linear(4, 4)), TensorPlan(layers={"blocks.*.to_q": "colwise"}))
    assert str(error.value) == "[parallel] tp: the tensor-parallel plan names no layer of Sequential; set tp = 1 for it"


def test_plans_derived_from_diffusers_keep_its_packed_layers() -> None:
    transformer = cases.tiny_pipeline("tiny-flux2").transformer
    plan = resolve_tensor_plan(FAMILIES["flux2"].tensor, transformer)
    packed = {layer.path: layer.parts for layer in planned_layers(transformer, plan) if len(layer.parts) > 1}
    # SwiGLU halves, then Q, K, V, gate and value of the single blocks' fused projection (inner 64,
    # MLP 3 x 64), and the single blocks' output reading attention and MLP side by side.
    assert packed["transformer_blocks.0.ff.linear_in"] == (192, 192)
    assert packed["single_transformer_blocks.0.attn.to_qkv_mlp_proj"] == (64, 64, 64, 192, 192)
    assert packed["single_transformer_blocks.0.attn.to_out"] == (64, 192)


def test_a_pipeline_quantized_before_it_was_split_is_refused(rank_pools) -> None:
    errors = rank_pools(2).run(cases.tp_after_quant_error, "tiny-flux", FAMILY_CASES["flux"].call)
    assert (
        errors
        == [
            "[parallel] tp = 2: pipe.transformer was quantized ('int8wo') before it was split; load the pipeline "
            "again and apply [quant] and tp together (accel splits first, then quantizes each rank's shard)"
        ]
        * 2
    )


@pytest.mark.parametrize("family, backend", [("flux", "aot_eager"), ("wan", "inductor")])
def test_compile_with_tensor_parallel_equals_single_process(rank_pools, family: str, backend: str) -> None:
    """The blocks compile with their all-reduces in the graph; the second call builds no graph.
    Inductor lowers the all-reduces of one family's kernels (Wan's: FLUX's blocks make three times as
    many kernels, about 60 s of CPU more); FLUX's split single blocks trace through AOT autograd."""
    builder, call = f"accel.models.{family}:build_tiny", FAMILY_CASES[family].call
    expected, _, _ = cases.counted_run(builder, {}, call, fresh=True)
    compile_recipe = {"enabled": True, "backend": backend}
    runs = rank_pools(2).run(cases.counted_run, builder, {"parallel": {"tp": 2}, "compile": compile_recipe}, call, True)
    for output, _, graphs in runs:
        assert np.abs(output - expected).max() <= TOLERANCE
        assert graphs[0] > 0 and graphs[1] == 0


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_int8_quantizes_each_ranks_shard(rank_pools, family: str) -> None:
    """torchao quantizes the shards (split first): a column-wise shard's per-channel scales are the
    whole layer's, a row-wise shard's span its own input columns. So the output is not one
    process's int8 output to the bit, but it differs from it by less than int8's own error
    (seen: 3.6e-4 and 4.0e-4 against that error's 7.6e-4 and 4.1e-4), and the ranks agree."""
    builder, call = f"accel.models.{family}:build_tiny", FAMILY_CASES[family].call
    plain, _, _ = cases.counted_run(builder, {}, call, fresh=True)
    quantized, _, _ = cases.counted_run(builder, {"quant": {"type": "int8wo"}}, call, fresh=True)
    int8_error = np.abs(quantized - plain).max()
    assert int8_error > 1e-5  # it quantized
    runs = rank_pools(2).run(
        cases.counted_run, builder, {"parallel": {"tp": 2}, "quant": {"type": "int8wo"}}, call, True
    )
    assert np.array_equal(runs[0][0], runs[1][0])
    assert np.abs(runs[0][0] - plain).max() > 1e-5
    assert np.abs(runs[0][0] - quantized).max() < int8_error


@pytest.fixture(scope="module")
def saved_wan(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny Wan saved as a diffusers folder (safetensors): a checkpoint to load slices of."""
    folder = tmp_path_factory.mktemp("saved") / "tiny-wan"
    cases.tiny_pipeline("accel.models.wan:build_tiny").save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_only_its_slice_of_the_checkpoint(rank_pools, saved_wan: str, tp: int) -> None:
    """Loaded as its TP slice, a rank holds only its share from the start (never the whole
    transformer), and under tp the output equals the whole model's on one process."""
    import accel

    call = FAMILY_CASES["wan"].call
    whole = accel.load_pipeline(saved_wan, "float32")
    whole.set_progress_bar_config(disable=True)
    expected = cases.output_of(whole(**call, generator=torch.Generator().manual_seed(0), output_type="np"))
    # Tiny Wan's split weights (parameters): per block, attn1's Q K V 3 x (64 x 64 + 64) and output
    # 64 x 64, attn2's the same, their Q and K norms 4 x 64, the MLP 128 x 64 + 128 and 64 x 128:
    # 49 920; two blocks.
    split = 2 * 49_920 * 4
    total = sum(p.numel() * p.element_size() for p in whole.transformer.parameters())
    for output, held, came_split in rank_pools(tp).run(cases.split_load_run, saved_wan, tp, call):
        assert came_split
        assert held == total - split + split // tp
        assert np.abs(output - expected).max() <= TOLERANCE


def test_ulysses_pads_the_heads_each_tp_rank_holds(rank_pools) -> None:
    """Six heads over tp 2 leave three a rank, which Ulysses 2 pads to four slots: still one process's output."""
    builder, call = "parallel_cases:tiny_wan_six_heads", FAMILY_CASES["wan"].call
    expected, _, _ = cases.tiny_run(builder, {}, call)
    for output, _, bytes_sent in rank_pools(4).run(
        cases.tiny_run, builder, {"parallel": {"tp": 2, "ulysses": 2}}, call
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


# Every cache method under TP, each method on FLUX, Wan and LTX-Video, the layouts rotated.
METHOD_LAYOUTS = {
    "flux-dbcache": "tp2",
    "wan-calibrator": "tp2xulysses2",
    "ltx-calibrator": "cfg2xtp2",
    "flux-taylorseer": "cfg2xtp2",
    "wan-taylorseer": "tp2",
    "ltx-taylorseer": "tp2xulysses2",
    "flux-magcache": "tp2xulysses2",
    "wan-magcache": "cfg2xtp2",
    "ltx-magcache": "tp2",
}


@pytest.mark.parametrize("case, layout", list(METHOD_LAYOUTS.items()))
def test_every_cache_method_with_tensor_parallel_decides_as_one_process(rank_pools, case: str, layout: str) -> None:
    check_cache_method_on_ranks(rank_pools, case, LAYOUTS[layout])


def test_parallel_vae_with_tensor_parallel_equals_single_process(rank_pools) -> None:
    call = FAMILY_CASES["flux"].call
    expected, _ = reference("flux", call)
    recipe = {"parallel": {"tp": 2, "ulysses": 2}, "vae": {"parallel": True, "all_ranks": True}}
    for output, _, _ in rank_pools(4).run(cases.tiny_run, "tiny-flux", recipe, call):
        assert np.abs(output - expected).max() <= TOLERANCE
