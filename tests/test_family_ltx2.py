"""LTX-2 specifics the shared matrices do not show by themselves: the plan derived from diffusers'
`_cp_plan` with the audio stream replicated, the audio in every comparison and in the MP4, and
image-to-video through the command line.

The shared cases (tests/test_parallel_families.py) compare `parallel_cases.output_of`, which for
LTX-2 is the frames with the audio samples appended, so every mode there checks the sound too.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
import torch
from typer.testing import CliRunner

from accel.cli import app
from accel.media import read_audio, read_video
from accel.models.registry import FAMILIES
from accel.parallel.derive import resolve_plan

FAMILY = FAMILIES["ltx2"]
CALL = dict(prompt="a red fox", negative_prompt="blurry", height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=4.0)


def test_the_plan_follows_diffusers_and_keeps_text_and_audio_whole() -> None:
    pipe = cases.tiny_pipeline("tiny-ltx2")
    plan = resolve_plan(FAMILY.parallel, pipe.transformer)
    cut = {(split.module, split.value, split.element, split.ndim): split.stream for split in plan.splits}
    # diffusers' cuts of the video and its interleaved rotary tables, and accel's additions
    assert cut[("", "hidden_states", None, 3)] == cut[("rope", "output", 0, 3)] == cut[("rope", "output", 1, 3)] == "video"
    assert cut[("rope", "output", None, 4)] == cut[("cross_attn_rope", "output", None, 4)] == "video"
    assert cut[("", "timestep", None, 2)] == "video"
    assert cut[("", "video_keyframes_mask", None, None)] == "video"  # LTX-2.5 DFR's marker of single-frame latents
    # nothing of the text or the audio is cut
    assert not any("encoder" in value or "audio" in value or module.startswith("audio") for module, value, _, _ in cut)
    assert plan.output_module == "proj_out" and plan.output_dim == 1
    assert plan.whole_queries == ("transformer_blocks.*.video_to_audio_attn",)


def test_output_carries_the_audio_and_is_deterministic() -> None:
    first, _, _ = cases.tiny_run("tiny-ltx2", {}, CALL)
    second, _, _ = cases.tiny_run("tiny-ltx2", {}, CALL)
    frames = 9 * 64 * 96 * 3
    assert first.shape[0] > frames  # the audio samples follow the frames
    assert np.array_equal(first, second)
    audio = first[frames:]
    assert np.isfinite(audio).all() and audio.std() > 0


def test_a_deep_copied_scheduler_leaves_accel_behind() -> None:
    """The pipeline deep-copies its scheduler for the audio: the copy is the scheduler's own class
    with only accel's step events following it (the video scheduler's step, first after each
    transformer call, ends the step; the audio copy's adds nothing), never a copy of what the
    original's wrappers hold (process groups do not deep-copy)."""
    import accel
    from accel.instance import wrappers

    pipe = cases.tiny_pipeline("tiny-ltx2")
    handle = accel.apply(pipe, {"cache": {"threshold": 0.3}})
    try:
        duplicate = copy.deepcopy(pipe.scheduler)
        assert type(duplicate) is type(pipe.scheduler) and duplicate is not pipe.scheduler
        assert wrappers(duplicate, "step") == ["accel.steps"]
        assert all(not wrappers(duplicate, method) for method in ("set_timesteps", "scale_noise"))
    finally:
        handle.remove()
    assert "__deepcopy__" not in vars(pipe.scheduler)


def test_accel_run_writes_the_sound_into_the_mp4(tmp_path: Path) -> None:
    out = tmp_path / "fox.mp4"
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--steps", "2", "--warmup", "0", "--out", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert read_video(out).shape == (9, 64, 96, 3)
    sound = read_audio(out)
    assert sound is not None and sound.rate == 24000 and sound.samples.shape[0] == 2
    expected, _, _ = cases.tiny_run("tiny-ltx2", {}, dict(prompt="a red fox in the snow, photograph", height=64, width=96,
                                                         num_frames=9, num_inference_steps=2, guidance_scale=4.0))
    samples = expected.size - 9 * 64 * 96 * 3
    assert sound.samples.shape[1] == samples // 2  # the whole waveform, 0.33 s
    assert sound.seconds == pytest.approx(samples / 2 / 24000)


def test_image_to_video_through_the_command_line(tmp_path: Path) -> None:
    picture, out = tmp_path / "first.png", tmp_path / "out.mp4"
    cases.gradient_image().save(picture)
    accel_bin = str(Path(sys.executable).parent / "accel")
    done = subprocess.run(
        [accel_bin, "run", "tiny-ltx2", "--pipeline", "LTX2ImageToVideoPipeline", "--image", str(picture), "--steps", "2",
         "--warmup", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_video(out).shape == (9, 64, 96, 3)
    assert read_audio(out) is not None


# 20 video tokens with per-token timesteps; no H.264 round trip of the picture (it needs PyAV), as accel runs the tiny variant
I2V = dict(CALL, num_inference_steps=3, width=160, image=cases.gradient_image(), image_crf=0)


@pytest.mark.parametrize("parallel", [{"ring": 3}, {"cfg": 2, "ulysses": 2}], ids=["ring3", "cfg2xulysses2"])
def test_image_to_video_equals_one_process(rank_pools: Any, parallel: dict[str, int]) -> None:
    """The conditioned first frame gives every video token its own timestep: cut with the tokens."""
    expected, _, _ = cases.tiny_run("parallel_cases:tiny_ltx2_i2v", {}, I2V)
    world = parallel.get("ring", 1) * parallel.get("ulysses", 1) * parallel.get("cfg", 1)
    for output, _, bytes_sent in rank_pools(world).run(cases.tiny_run, "parallel_cases:tiny_ltx2_i2v", {"parallel": parallel}, I2V):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= 1e-4


def test_a_dfr_pass_through_the_command_line_makes_the_requested_frames_with_sound(tmp_path: Path) -> None:
    """LTX2DFRPipeline pads 9 frames to a 25-frame canvas with a keyframe slot and, with --condition,
    an appended keyframe; the MP4 holds the 9 frames asked for and their 0.375 s of sound. It takes
    no step count: its distilled schedule (8 sigmas) is the steps."""
    picture, out = tmp_path / "last.png", tmp_path / "dfr.mp4"
    cases.gradient_image().save(picture)
    done = subprocess.run(
        [str(Path(sys.executable).parent / "accel"), "run", "tiny-ltx2", "--pipeline", "LTX2DFRPipeline", "--condition",
         f"{picture}@-1:0.8", "--warmup", "0", "--out", str(out), "--json", str(tmp_path / "run.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_video(out).shape == (9, 64, 96, 3)
    sound = read_audio(out)
    assert sound is not None and sound.samples.shape == (2, 9000)  # trimmed to 9 frames at 24 fps, 24 kHz
    import json

    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 8
