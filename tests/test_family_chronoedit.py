"""ChronoEdit (accel/models/chronoedit.py): what its shared matrix rows do not show. Temporal reasoning
cuts the clip to its first and last latent frames after `num_temporal_reasoning_steps`, so the video
token count drops mid-run: the split layout and the cache's comparison follow it. `accel run` takes
the picture to edit with `--image` and writes the clip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import parallel_cases as cases
from family_parallel import check_cache_on_ranks, reference
from typer.testing import CliRunner
from variant_cases import picture

from accel.cli import app
from accel.media import read_video
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import Grid, Layout, out_channels, randn
from test_family_wan import WAN_14B
from accel.models import chronoedit


# ChronoEdit-14B's transformer (Wan2.1-I2V-14B's shape; diffusers' defaults for the rest, two of its 40 blocks): 40
# heads of
# 128, UMT5-XXL's 4096-wide text, CLIP ViT-H/14's 1280-wide picture tokens, 36 channels in (noise, mask, picture
# latents).
CHRONOEDIT_14B = dict(WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Noise, first-frame mask and picture latents in channels; CLIP ViT-H/14's 257 picture tokens."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    return dict(
        hidden_states=randn(batch, config["in_channels"], f, 2 * h, 2 * w),
        timestep=t,
        encoder_hidden_states=randn(batch, text, config["text_dim"]),
        encoder_hidden_states_image=randn(batch, 257, config["image_dim"]),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, out_channels(config), grid.frames, 2 * grid.rows, 2 * grid.cols)


def fake_more_overrides(config: dict[str, Any], width: int) -> dict[str, Any]:
    # the picture's keys and values are projected from the blocks' width
    return {"added_kv_proj_dim": width}


# -- chronoedit: Wan's blocks, the picture's CLIP tokens before the text (own key and value projections) --
def block_transformer() -> nn.Module:
    return block_cases.wan_shaped(
        "ChronoEditTransformer3DModel", 23, image_dim=16, added_kv_proj_dim=block_cases.HEADS * block_cases.HEAD_DIM
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    # 2 latent frames: the rotary table puts the second 7 frames after the first, as for a 5-frame edit.
    return dict(
        hidden_states=block_cases.latents((1, 4, 2, 8, 8), drift),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_hidden_states=block_cases.text(),
        encoder_hidden_states_image=block_cases.noise(torch.Generator().manual_seed(2), 1, 5, 16),
        return_dict=False,
    )


CASE = FamilyCase(
    # The picture to edit, resized by the pipeline to the call's size; 5 frames, as it makes without temporal
    # reasoning.
    dict(PROMPT, image=picture(), height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
    odd=dict(height=80, width=112),  # 2 latent frames x 5x7 patches = 70 video tokens (3, 4, 8 do not divide)
    threshold=0.1,
    tiny=TinyCase(
        name="chronoedit",
        build=chronoedit.build_tiny,
        pipeline_class=diffusers.ChronoEditPipeline,
        call=dict(
            image=picture(),
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),  # the picture first, the edit last
        block_lists=("blocks",),
        transformer_calls=8,  # CFG: a conditional and an unconditional call per step
        latent_shape=(1, 36, 2, 8, 8),  # noise, first-frame mask and picture latents; 5 frames -> 2 latent frames
        text_shape=(1, 512, 32),
        components=("text_encoder", "image_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,  # seen: 1.2e-6
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        more_overrides=fake_more_overrides,
        # ChronoEdit at 720x1280, its 5 frames: 2 x 45 x 80 = 7200 video tokens, 512 text tokens; CFG halves x Ulysses
        # 4.
        real_config=CHRONOEDIT_14B,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(2, 45, 80, 512)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    one_per_prompt="diffusers 0.42's ChronoEdit repeats the picture's CLIP tokens per prompt, not per video",
)

# 13 frames make 4 latent frames of 4x4 patches (64 tokens) for three steps, then 2 (32): Ring 3 divides neither.
REASONING = dict(num_frames=13, enable_temporal_reasoning=True, num_temporal_reasoning_steps=3)
THRESHOLD = {"threshold": 0.1}


def test_temporal_reasoning_drops_latent_frames_mid_run_and_ring3_with_the_cache_equals_one_process(
    rank_pools: Any,
) -> None:
    """Each rank caches the calls one process caches, the first call after the cut computing afresh
    (no residual of the new shape to compare with), and the outputs agree."""
    frames: list[int] = []
    hook = cases.tiny_pipeline("tiny-chronoedit").transformer.register_forward_pre_hook(
        lambda _module, _args, kwargs: frames.append(kwargs["hidden_states"].shape[2]), with_kwargs=True
    )
    try:
        _, records = reference("chronoedit", dict(CASE.call, **REASONING, num_inference_steps=8), THRESHOLD)
    finally:
        hook.remove()
    assert frames == [4] * 6 + [2] * 10  # two calls a step: 3 reasoning steps, then 5 on the first and last frames
    assert [cached for step, _, _, cached in records if step == 3] == [False, False]
    check_cache_on_ranks(rank_pools, "chronoedit", {"ring": 3}, THRESHOLD, size=REASONING)


def test_accel_run_edits_the_picture_it_is_given_into_a_clip(tmp_path: Path) -> None:
    image, out = tmp_path / "in.png", tmp_path / "edit.mp4"
    picture().save(image)
    result = CliRunner().invoke(
        app,
        ["run", "tiny-chronoedit", "--image", str(image), "--steps", "2", "--warmup", "0", "--out", str(out)],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert read_video(out).shape == (5, 64, 64, 3)  # the picture first, the edit last
    missing = CliRunner().invoke(app, ["run", "tiny-chronoedit", "--steps", "2", "--out", str(tmp_path / "none.mp4")])
    assert missing.exit_code == 2
    assert (
        missing.stderr.strip() == "error: ChronoEditPipeline needs an input image: pass --image PATH ([generate] image)"
    )


def test_without_temporal_reasoning_the_call_makes_five_frames_whatever_it_is_asked() -> None:
    """What the family's default of 5 frames, and the note accel prints for another count, rest on."""
    output, _, _ = cases.tiny_run("tiny-chronoedit", {}, dict(CASE.call, num_frames=9, num_inference_steps=1))
    assert output.shape == (1, 5, 64, 64, 3)
