"""Pipelines on one set of modules (`Other.from_pipe(pipe)`): `handle.attach(sibling)` gives a sibling
the accelerators of the pipeline it was built from, equal to accelerating it alone, on one process
and across ranks; and the server picks the sibling a request's pictures ask for (accel/serve/tasks.py)."""

from __future__ import annotations

from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import accel
import parallel_cases as cases
from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.models.variants import variant_of
from accel.serve.tasks import pipeline_for, siblings_of
from conftest import FLUX_CALL
from families import FAMILY_CASES

TOLERANCE = 1e-4
FOX = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
MASK = Image.fromarray(np.kron(np.eye(2, dtype=np.uint8) * 255, np.ones((32, 32), np.uint8)))
# Six steps at threshold 0.5: the tiny FLUX's later steps are cached, so the cache's calls count.
CACHED = {"cache": {"threshold": 0.5}}
EDITS = {
    "FluxImg2ImgPipeline": dict(FLUX_CALL, num_inference_steps=6, image=FOX, strength=0.9),
    "FluxInpaintPipeline": dict(FLUX_CALL, num_inference_steps=6, image=FOX, mask_image=MASK, strength=0.9),
}


ALONE = [
    *(("tiny-flux", name, call) for name, call in sorted(EDITS.items())),
    # LTX-2 makes a video (and its sound) from a prompt or a picture with one checkpoint
    ("tiny-ltx2", "LTX2ImageToVideoPipeline", dict(FAMILY_CASES["ltx2"].call, image=FOX, image_crf=0)),
]


@pytest.mark.parametrize("model, pipeline_class, call", ALONE, ids=[row[1] for row in ALONE])
def test_an_attached_sibling_equals_the_sibling_accelerated_alone(
    model: str, pipeline_class: str, call: dict[str, Any]
) -> None:
    alone, alone_calls = cases.sibling_run(model, pipeline_class, CACHED, call, attached=False)
    attached, attached_calls = cases.sibling_run(model, pipeline_class, CACHED, call)
    assert np.array_equal(attached, alone)
    assert attached_calls == alone_calls and any(cached for *_, cached in attached_calls)


def test_remove_undoes_the_sibling_and_the_base_alike(tiny_flux: Any) -> None:
    """After remove() both pipelines are as they were: bit-identical outputs, and either may be
    accelerated again."""
    sibling = diffusers.FluxInpaintPipeline.from_pipe(tiny_flux)
    sibling.set_progress_bar_config(disable=True)
    call = EDITS["FluxInpaintPipeline"]

    def run(pipe: Any, **kwargs: Any) -> np.ndarray:
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").images

    before = run(sibling, **call), run(tiny_flux, **FLUX_CALL)
    handle = accel.apply(tiny_flux, CACHED)
    handle.attach(sibling)
    assert handle.siblings == [sibling]
    run(sibling, **call)
    handle.remove()
    assert handle.siblings == []
    assert np.array_equal(run(sibling, **call), before[0]) and np.array_equal(run(tiny_flux, **FLUX_CALL), before[1])
    accel.apply(sibling, CACHED).remove()


def test_attach_refuses_a_pipeline_of_other_modules_and_one_already_accelerated(tiny_flux: Any) -> None:
    own = cases.tiny_pipeline("tiny-flux", key="another copy")
    handle = accel.apply(tiny_flux, CACHED)
    try:
        stranger = diffusers.FluxImg2ImgPipeline.from_pipe(own)
        with pytest.raises(UserError) as refused:
            handle.attach(stranger)
        assert str(refused.value) == (
            "accel attach: a FluxImg2ImgPipeline must run this FluxPipeline's transformer; build it with "
            "FluxImg2ImgPipeline.from_pipe(pipe)"
        )
        sibling = diffusers.FluxImg2ImgPipeline.from_pipe(tiny_flux)
        handle.attach(sibling)
        with pytest.raises(UserError) as twice:
            handle.attach(sibling)
        assert str(twice.value) == (
            "accel attach: this FluxImg2ImgPipeline is already accelerated; remove() its handle first"
        )
        with pytest.raises(UserError, match="already accelerated"):
            accel.apply(sibling, CACHED)
    finally:
        handle.remove()


# Across ranks: Ulysses with the cache on FLUX's inpaint pipeline; CFG halves on SD 3.5's img2img
# pipeline with one rank encoding for both ([memory] text_encoder = "rank0": the sibling's encode
# is that rank's too).
RANKED = [
    ("tiny-flux", "FluxInpaintPipeline", {"parallel": {"ulysses": 2}, **CACHED}, EDITS["FluxInpaintPipeline"]),
    (
        "tiny-sd3",
        "StableDiffusion3Img2ImgPipeline",
        {"parallel": {"cfg": 2}, "memory": {"text_encoder": "rank0"}},
        dict(prompt="a red fox", height=64, width=64, num_inference_steps=3, guidance_scale=5.0, image=FOX),
    ),
]


@pytest.mark.parametrize("model, pipeline_class, recipe, call", RANKED, ids=[row[1] for row in RANKED])
def test_an_attached_sibling_on_two_ranks_equals_one_process(
    rank_pools: Any, model: str, pipeline_class: str, recipe: dict[str, Any], call: dict[str, Any]
) -> None:
    one = {key: value for key, value in recipe.items() if key not in ("parallel", "memory")}
    reference, reference_calls = cases.sibling_run(model, pipeline_class, one, call)
    (lead, calls), (other, _) = rank_pools(2).run(cases.sibling_run, model, pipeline_class, recipe, call)
    assert np.abs(lead - reference).max() <= TOLERANCE and np.abs(other - reference).max() <= TOLERANCE
    if reference_calls is not None:  # the same decisions, on changes equal up to the split's rounding
        assert [(step, branch, cached) for step, branch, _, cached in calls] == [
            (step, branch, cached) for step, branch, _, cached in reference_calls
        ]
        assert np.allclose([c[2] or 0 for c in calls], [c[2] or 0 for c in reference_calls], atol=1e-5)
        assert any(cached for *_, cached in calls)
    else:
        assert calls is None


def test_the_siblings_of_a_pipeline_are_those_on_its_checkpoint() -> None:
    flux = FAMILIES["flux"]
    on_flux = ["FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"]
    for served in on_flux:
        assert list(siblings_of(flux, variant_of(flux, served))) == [served] + [c for c in on_flux if c != served]
    assert list(siblings_of(flux, variant_of(flux, "FluxKontextPipeline"))) == ["FluxKontextPipeline"]
    qwen = FAMILIES["qwenimage"]
    assert list(siblings_of(qwen, variant_of(qwen, "QwenImageEditPipeline"))) == [
        "QwenImageEditPipeline",
        "QwenImageEditInpaintPipeline",
    ]


@pytest.mark.parametrize(
    "served, given, asked, chosen",
    [
        ("FluxPipeline", set(), None, None),  # a prompt alone: the served text-to-image pipeline
        ("FluxPipeline", {"image"}, None, "FluxImg2ImgPipeline"),
        ("FluxPipeline", {"image", "mask"}, None, "FluxInpaintPipeline"),
        ("FluxInpaintPipeline", {"image", "mask"}, None, None),
        ("FluxInpaintPipeline", {"image"}, None, "FluxImg2ImgPipeline"),  # no mask to repaint by
        ("FluxInpaintPipeline", set(), None, "FluxPipeline"),
        ("FluxPipeline", {"image"}, "FluxInpaintPipeline", "FluxInpaintPipeline"),  # asked: its checks then say
        ("FluxImg2ImgPipeline", set(), "FluxImg2ImgPipeline", None),
        ("FluxKontextPipeline", {"image", "mask"}, None, None),  # no sibling: the served one refuses the mask
    ],
)
def test_a_request_runs_on_the_pipeline_its_pictures_ask_for(
    served: str, given: set[str], asked: str | None, chosen: str | None
) -> None:
    flux = FAMILIES["flux"]
    variant = variant_of(flux, served)
    assert pipeline_for(flux, variant, siblings_of(flux, variant), "image", given, asked) == chosen


def test_a_pipeline_not_on_the_served_weights_is_refused_naming_those_that_are() -> None:
    flux = FAMILIES["flux"]
    variant = variant_of(flux, "FluxPipeline")
    with pytest.raises(ValueError) as refused:
        pipeline_for(flux, variant, siblings_of(flux, variant), "image", {"image"}, "FluxKontextPipeline")
    assert str(refused.value) == (
        "pipeline: this server runs FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, not 'FluxKontextPipeline'"
    )


def test_attach_under_model_offload_is_refused_in_one_line() -> None:
    own = cases.tiny_pipeline("tiny-flux", key="another copy")
    handle = accel.apply(own, {"memory": {"offload": "model"}})
    try:
        with pytest.raises(UserError) as refused:
            handle.attach(diffusers.FluxImg2ImgPipeline.from_pipe(own))
        assert str(refused.value) == (
            '[memory] offload = "model" moves modules in one pipeline\'s call order, so no other pipeline may share '
            'them; use offload = "group" (it offloads module by module, whichever pipeline calls)'
        )
        assert handle.siblings == []
    finally:
        handle.remove()
