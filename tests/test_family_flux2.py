"""FLUX.2 specifics: reference images join the split image sequence; FLUX.2-dev has no CFG to split;
dev and Klein share a transformer class and are told apart by their pipelines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from cli_runs import accel_run
from typer.testing import CliRunner

import accel
import parallel_cases as cases
from accel.cli import app
from accel.errors import NotAvailableError
from accel.models.registry import FAMILIES, family_of, family_of_classes
import diffusers
from family_case import FakeCuda, FamilyCase, TinyCase, case_of
import block_cases
from torch import nn
from test_family_flux2_klein import block_inputs as klein_block_inputs
import torch
from fakecuda import Grid, Layout
from test_family_flux2_klein import fake_inputs
from accel.models import flux2


# FLUX.2-dev's transformer (the diffusers defaults): 48 heads, text of three stacked 5120-wide Mistral layers.
FLUX2_DEV = dict(
    patch_size=1,
    in_channels=128,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    guidance_embeds=True,
)


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.rows * grid.cols, config["in_channels"])


# -- flux2 (dev): the same transformer with the guidance embedding of a guidance-distilled model --------
def block_transformer() -> nn.Module:
    from diffusers import Flux2Transformer2DModel

    return block_cases.seeded(
        19,
        lambda: Flux2Transformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=2,
            num_single_layers=2,
            attention_head_dim=block_cases.HEAD_DIM,
            num_attention_heads=block_cases.HEADS,
            joint_attention_dim=block_cases.TEXT_DIM,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=True,
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    return dict(klein_block_inputs(drift), guidance=torch.tensor([4.0]))


CASE = FamilyCase(
    dict(
        prompt="a red fox", height=64, width=64, num_inference_steps=4, guidance_scale=4.0
    ),  # embedded guidance, no CFG
    odd=dict(height=48, width=80),  # 3x5 = 15 image tokens, 512 text tokens
    threshold=0.7,
    tiny=TinyCase(
        name="flux2",
        build=flux2.build_tiny,
        pipeline_class=diffusers.Flux2Pipeline,
        call=dict(height=64, width=64, num_inference_steps=4, guidance_scale=4.0, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=4,  # guidance-distilled: one call per step, the scale embedded
        latent_shape=(1, 16, 128),  # 64x64 -> 8x8 latents of 32 channels -> 4x4 packed tokens of 128
        text_shape=(1, 512, 24),  # Mistral 3 hidden states 10, 20 and 30 stacked (3 x 8), padded to 512
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        # FLUX.2-dev at 1024x1024: 64x64 packed latents = 4096 image tokens, 512 Mistral tokens; Ulysses 8 with the
        # cache.
        real_config=FLUX2_DEV,
        real_layout=Layout(world=8, ulysses=8, cache=True, grid=Grid(1, 64, 64, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)

TOLERANCE = 1e-4


def reference_picture() -> Any:
    """A 64x64 input picture: 4x4 = 16 reference tokens after the generated ones."""
    return cases.gradient_image(64)


def reference_call(family: str) -> dict[str, Any]:
    # 48x80 makes 3x5 = 15 generated tokens; with the reference's 16, 31 image tokens that neither
    # 2 nor 3 ranks divide (and 512 text tokens, which 3 does not divide either).
    return dict(case_of(family).call, height=48, width=80, image=reference_picture())


@pytest.mark.parametrize("parallel", [{"ulysses": 2}, {"ring": 3}], ids=["ulysses2", "ring3"])
@pytest.mark.parametrize("family", ["flux2", "flux2-klein"])
def test_reference_image_tokens_are_split_with_the_image(rank_pools, family: str, parallel: dict[str, int]) -> None:
    call = reference_call(family)
    expected, _, _ = cases.tiny_run(f"tiny-{family}", {}, call)
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1)
    for output, _, bytes_sent in rank_pools(world).run(cases.tiny_run, f"tiny-{family}", {"parallel": parallel}, call):
        assert bytes_sent > 0
        assert output.shape == expected.shape == (1, 48, 80, 3)
        assert np.abs(output - expected).max() <= TOLERANCE


def test_the_reference_tokens_follow_the_generated_ones() -> None:
    """What the test above splits: the transformer gets 15 generated then 16 reference tokens, with
    their ids (the reference's time coordinate set apart), and the pipeline keeps the first 15 outputs."""
    pipe = cases.tiny_pipeline("tiny-flux2")
    seen: list[tuple[int, int, float]] = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(
            (kw["hidden_states"].shape[1], kw["img_ids"].shape[1], float(kw["img_ids"][0, -1, 0]))
        ),
        with_kwargs=True,
    )
    try:
        output, _, _ = cases.tiny_run("tiny-flux2", {}, reference_call("flux2"))
    finally:
        hook.remove()
    assert set(seen) == {(31, 31, 10.0)}
    assert output.shape == (1, 48, 80, 3)


def test_cfg_parallel_is_refused_for_the_guidance_distilled_dev_model() -> None:
    pipe = cases.tiny_pipeline("tiny-flux2")
    with pytest.raises(NotAvailableError) as error:
        accel.apply(pipe, {"parallel": {"cfg": 2}})
    assert (
        str(error.value)
        == "[parallel] cfg = 2: FLUX.2 [dev] pipelines have no classifier-free guidance to split; set cfg = 1"
    )
    assert FAMILIES["flux2"].cfg_off(CASE.call) == "FLUX.2 [dev] pipelines have no classifier-free guidance"


def test_dev_and_klein_are_told_apart_by_their_pipeline() -> None:
    assert family_of(cases.tiny_pipeline("tiny-flux2")).name == "flux2"
    assert family_of(cases.tiny_pipeline("tiny-flux2-klein")).name == "flux2-klein"
    assert family_of_classes("Flux2Transformer2DModel", "Flux2Pipeline") is FAMILIES["flux2"]
    assert family_of_classes("Flux2Transformer2DModel", "Flux2KleinInpaintPipeline") is FAMILIES["flux2-klein"]


def test_a_reference_picture_is_optional_through_the_command_line(tmp_path: Path) -> None:
    """FLUX.2's own pipelines take --image (optional): the PNG equals the library call with it, and
    the call without it is the text-to-image one."""
    picture, out = tmp_path / "reference.png", tmp_path / "out.png"
    reference_picture().save(picture)
    result = accel_run("tiny-flux2-klein", "--image", str(picture), "--steps", "2", "--warmup", "0", "--out", str(out))
    assert result.exit_code == 0, result.output[-2000:]
    call = dict(
        prompt="a red fox in the snow, photograph", height=64, width=64, num_inference_steps=2, guidance_scale=4.0
    )
    with_picture, _, _ = cases.tiny_run("tiny-flux2-klein", {}, dict(call, image=Image.open(picture).convert("RGB")))
    without, _, _ = cases.tiny_run("tiny-flux2-klein", {}, call)
    written = np.asarray(Image.open(out), dtype=np.float32)
    assert np.abs(written - np.round(with_picture[0] * 255)).max() <= 1
    assert np.abs(written - np.round(without[0] * 255)).max() > 1


def test_flux2_pipelines_take_no_mask(tmp_path: Path) -> None:
    mask = tmp_path / "mask.png"
    reference_picture().save(mask)
    result = CliRunner().invoke(app, ["run", "tiny-flux2", "--mask", str(mask), "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: [generate] mask: Flux2Pipeline takes no mask; remove --mask"


def _pictures(tmp_path: Path, count: int) -> list[Path]:
    """`count` different seeded pictures, as files."""
    paths = []
    for index in range(count):
        path = tmp_path / f"picture-{index}.png"
        pixels = np.random.default_rng(index).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def test_several_pictures_reach_the_call_as_one_list_in_order(tmp_path: Path) -> None:
    """--image and each --reference are FLUX.2's list of reference pictures, in that order: the call's
    keyword gets the list, and the PNG equals the library call with it (the first picture alone makes
    another one)."""
    from accel.models.call import generation_kwargs
    from accel.models.input_files import open_inputs
    from accel.recipe import Recipe

    first, second, third = _pictures(tmp_path, 3)
    settings = {"image": str(first), "references": (str(second), str(third))}
    recipe = Recipe().with_overrides({"model": {"name": "tiny-flux2-klein"}, "generate": settings}, source="test")
    kwargs = generation_kwargs(FAMILIES["flux2-klein"], True, recipe, cases.tiny_pipeline("tiny-flux2-klein"))
    opened = open_inputs(kwargs)["image"]
    expected = [np.asarray(Image.open(path).convert("RGB")) for path in (first, second, third)]
    assert len(opened) == 3
    assert all(np.array_equal(np.asarray(picture), want) for picture, want in zip(opened, expected))
    out = tmp_path / "out.png"
    command = ["run", "tiny-flux2-klein", "--image", str(first), "--reference", str(second), "--reference", str(third)]
    result = CliRunner().invoke(app, [*command, "--steps", "2", "--guidance", "4", "--warmup", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    call = dict(
        prompt="a red fox in the snow, photograph", height=64, width=64, num_inference_steps=2, guidance_scale=4.0
    )
    together, _, _ = cases.tiny_run("tiny-flux2-klein", {}, dict(call, image=list(opened)))
    alone, _, _ = cases.tiny_run("tiny-flux2-klein", {}, dict(call, image=list(opened[:1])))
    written = np.asarray(Image.open(out), dtype=np.float32)
    assert np.abs(written - np.round(together[0] * 255)).max() <= 1
    assert np.abs(written - np.round(alone[0] * 255)).max() > 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--reference", "{0}"],
            "[generate] references: Flux2Pipeline takes them after the first picture; pass --image too",
        ),
        (
            ["--image", "{0}"] + ["--reference", "{0}"] * 10,
            "[generate] references: Flux2Pipeline takes at most 10 pictures (--image and 9 --reference), got 11",
        ),
        (["--image", "{0}", "--reference", "{1}"], "[generate] references: {1} does not exist; pass an image file"),
    ],
)
def test_a_bad_list_of_pictures_is_one_line(flags: list[str], message: str, tmp_path: Path) -> None:
    (first,) = _pictures(tmp_path, 1)
    missing = tmp_path / "missing.png"
    flags = [flag.format(first, missing) for flag in flags]
    result = CliRunner().invoke(app, ["run", "tiny-flux2", *flags, "--out", str(tmp_path / "o.png")])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: " + message.format(first, missing)), result.stderr
