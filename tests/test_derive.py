"""Plans derived from diffusers' `_cp_plan`: the translation, its refusals, and FLUX.1's derived
plan against the plan accel wrote by hand before (same cuts, same output on gloo ranks)."""

from __future__ import annotations

import dataclasses

import diffusers
import pytest
import torch
from toy_transformers import FLUX_HAND_PLAN, flux_plan_outputs

from accel.parallel.plan_format import FromDiffusers, SequenceSplit
from accel.models.registry import FAMILIES
from accel.parallel.derive import PlanDerivationError, derive_plan
from accel.parallel.plan import resolve_plan


def absolute(split: SequenceSplit, ndim: int) -> tuple[str, str, str, int]:
    return split.module, split.value, str(split.stream), split.dim % ndim


def test_flux_derived_plan_cuts_what_the_hand_written_plan_cut() -> None:
    derived = resolve_plan(
        FAMILIES["flux"].parallel, diffusers.FluxTransformer2DModel.__new__(diffusers.FluxTransformer2DModel)
    )
    ranks = {"hidden_states": 3, "encoder_hidden_states": 3, "img_ids": 2, "txt_ids": 2}  # what FluxPipeline passes
    controlnet = {
        "controlnet_block_samples": 3,
        "controlnet_single_block_samples": 3,
    }  # accel's extra cuts (lists of these)
    ranks_all = {**ranks, **controlnet}
    assert sorted(absolute(s, ranks_all[s.value]) for s in derived.splits) == sorted(
        absolute(s, ranks_all[s.value]) for s in FLUX_HAND_PLAN.splits
    )
    assert {s.value: s.ndim for s in derived.splits} == {**ranks, **dict.fromkeys(controlnet)}
    assert (derived.attention_keys, derived.output_stream) == (
        FLUX_HAND_PLAN.attention_keys,
        FLUX_HAND_PLAN.output_stream,
    )
    assert (derived.output_module, derived.output_dim) == ("proj_out", 1)  # diffusers gathers at proj_out


@pytest.mark.parametrize("parallel", [(1, 2), (3, 1), (2, 2)], ids=["ulysses2", "ring3", "usp2x2"])
def test_flux_derived_plan_gives_the_hand_written_plans_output(rank_pools, parallel: tuple[int, int]) -> None:
    ulysses, ring = parallel
    for hand, derived, single in rank_pools(ulysses * ring).run(flux_plan_outputs, ring, ulysses):
        assert torch.equal(hand, derived)
        assert (derived - single).abs().max().item() <= 1e-5


def test_items_of_a_returned_tuple_get_their_own_streams() -> None:
    """Qwen-Image's rotary module returns (image table, text table): each item is its own stream."""
    spec = FromDiffusers(
        streams=(
            ("hidden_states", "image"),
            ("encoder_hidden_states", "text"),
            ("modulate_index", "image"),
            ("encoder_hidden_states_mask", "text"),
            ("pos_embed[0]", "image"),
            ("pos_embed[1]", "text"),
        ),
        attention_keys=("text", "image"),
        output_stream="image",
    )
    plan = derive_plan(diffusers.QwenImageTransformer2DModel._cp_plan, spec)
    rotary = sorted((s.element, s.stream, s.dim) for s in plan.splits if s.module == "pos_embed")
    assert rotary == [(0, "image", 0), (1, "text", 0)]
    assert all(s.value == "output" for s in plan.splits if s.module == "pos_embed")
    blocks = {s.value: (s.stream, s.dim, s.ndim) for s in plan.splits if s.module == "transformer_blocks.*"}
    assert blocks == {"modulate_index": ("image", 1, 2), "encoder_hidden_states_mask": ("text", 1, 2)}
    assert (plan.output_module, plan.output_dim) == ("proj_out", 1)


def flux_spec(**streams: str) -> FromDiffusers:
    names = {
        "hidden_states": "image",
        "img_ids": "image",
        "encoder_hidden_states": "text",
        "txt_ids": "text",
        **streams,
    }
    return FromDiffusers(
        streams=tuple((k, v) for k, v in names.items() if v), attention_keys=("text", "image"), output_stream="image"
    )


@pytest.mark.parametrize(
    "spec, cp_plan, message",
    [
        (
            flux_spec(txt_ids=""),
            None,
            "_cp_plan cuts 'txt_ids', but the family does not say which stream it belongs to",
        ),
        (flux_spec(guidance="image"), None, "the family names a stream for 'guidance', which _cp_plan does not cut"),
        (
            flux_spec(),
            {
                "": {},
                "proj_out": diffusers.FluxTransformer2DModel._cp_plan["proj_out"],
                "norm_out": diffusers.FluxTransformer2DModel._cp_plan["proj_out"],
            },
            "_cp_plan gathers at 2 places; accel gathers one output",
        ),
        (
            dataclasses.replace(flux_spec(), keep_whole=("guidance",)),
            None,
            "the family keeps 'guidance' whole, which _cp_plan does not cut",
        ),
    ],
    ids=["unnamed stream", "stream of nothing", "two outputs", "whole of nothing"],
)
def test_a_plan_the_family_does_not_fit_is_refused_with_one_line(spec: FromDiffusers, cp_plan, message: str) -> None:
    with pytest.raises(PlanDerivationError) as error:
        derive_plan(cp_plan or diffusers.FluxTransformer2DModel._cp_plan, spec)
    assert str(error.value) == message


def test_a_transformer_without_a_cp_plan_is_named() -> None:
    with pytest.raises(
        PlanDerivationError, match="^SD3Transformer2DModel has no diffusers _cp_plan to derive the parallel plan from"
    ):
        resolve_plan(
            FAMILIES["flux"].parallel, diffusers.SD3Transformer2DModel.__new__(diffusers.SD3Transformer2DModel)
        )


@pytest.mark.parametrize("parallel", [(2, 1), (1, 3), (2, 2)], ids=["ulysses2", "ring3", "usp2x2"])
def test_tuple_items_and_per_module_keys_equal_one_process(rank_pools, parallel: tuple[int, int]) -> None:
    """A toy with SD 3.5 medium's image-only second attention (module_keys) and Qwen-Image's
    (image table, text table) rotary tuple (element): 7 image and 5 text tokens, which no world divides."""
    from toy_transformers import dual_attention_error

    assert max(rank_pools(parallel[0] * parallel[1]).run(dual_attention_error, *parallel)) <= 1e-5


@pytest.mark.parametrize("at", ["", "layers.0"], ids=["at the forward", "deferred"])
@pytest.mark.parametrize("parallel", [(2, 1), (1, 3)], ids=["ulysses2", "ring3"])
def test_a_mapping_of_residuals_is_cut_item_by_item(rank_pools, parallel: tuple[int, int], at: str) -> None:
    """Z-Image's ControlNet residuals, {layer: tensor} on a sequence the forward builds: cut at the
    forward, or deferred to the layer where that sequence is cut (13 tokens, which no world divides)."""
    from toy_transformers import residual_mapping_error

    assert max(rank_pools(parallel[0] * parallel[1]).run(residual_mapping_error, *parallel, at)) <= 1e-5


def test_cuts_kept_whole_are_left_out() -> None:
    """LTX-2 keeps the text diffusers cuts whole: those cuts, and only those, leave the plan."""
    spec = dataclasses.replace(
        flux_spec(encoder_hidden_states="", txt_ids=""), keep_whole=("encoder_hidden_states", "txt_ids")
    )
    plan = derive_plan(diffusers.FluxTransformer2DModel._cp_plan, spec)
    assert sorted(s.value for s in plan.splits) == ["hidden_states", "img_ids"]
