"""LTX-2 specifics the shared matrices do not show by themselves: the plan derived from diffusers'
`_cp_plan` with the audio stream replicated, the audio in every comparison and in the MP4, and
image-to-video through the command line.

The shared cases (tests/test_parallel_families.py) compare `parallel_cases.output_of`, which for
LTX-2 is the frames with the audio samples appended, so every mode there checks the sound too.
"""

from __future__ import annotations

import copy
import tempfile
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


# -- HDR IC-LoRA: an SDR reference clip in, linear light out ----------------------------------------
HDR = "LTX2HDRPipeline"


def srgb(linear: np.ndarray) -> np.ndarray:
    """The preview's tone map as the README states it: linear clipped to [0, 1], then sRGB's transfer function."""
    clipped = np.clip(linear.astype(np.float64), 0, 1)
    return np.where(clipped <= 0.0031308, 12.92 * clipped, 1.055 * clipped ** (1 / 2.4) - 0.055)


def test_hdr_through_the_command_line_writes_linear_npy_and_an_sdr_preview(tmp_path: Path) -> None:
    """`--reference clip.mp4@1.0` (flags) and `[generate] references` (a recipe): the .npy holds the
    pipeline's own linear float32 frames, the .mp4 their tone-mapped preview at the video's size."""
    import accel
    from accel.media import save_video
    from accel.models.variants import read_clip
    from diffusers.pipelines.ltx2.pipeline_ltx2_hdr_lora import LTX2HDRReferenceCondition

    clip = tmp_path / "clip.mp4"
    save_video(np.stack([np.asarray(cases.gradient_image(), dtype=np.float32) / 255] * 9), clip, fps=24)
    recipe = tmp_path / "hdr.toml"
    recipe.write_text(f'[model]\nname = "tiny-ltx2"\npipeline = "{HDR}"\n[generate]\nsteps = 2\nreferences = ["{clip}@1.0"]\n')
    accel_bin = str(Path(sys.executable).parent / "accel")
    for args in (["tiny-ltx2", "--pipeline", HDR, "--reference", f"{clip}@1.0", "--steps", "2", "--out", str(tmp_path / "hdr.mp4")],
                 ["--recipe", str(recipe), "--out", str(tmp_path / "hdr.npy")]):
        done = subprocess.run([accel_bin, "run", *args, "--warmup", "0"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    pipe = accel.load_pipeline("tiny-ltx2", pipeline=HDR)
    expected = pipe(prompt="a red fox in the snow, photograph", reference_conditions=[LTX2HDRReferenceCondition(read_clip(str(clip)), 1.0)],
                    height=64, width=96, num_frames=9, num_inference_steps=2, guidance_scale=4.0,
                    generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames[0]
    assert expected.dtype == np.float32 and expected.min() >= -0.02 and expected.max() > 1  # linear light, past SDR's white
    frames = np.load(tmp_path / "hdr.npy")
    assert frames.dtype == np.float32 and frames.shape == (9, 64, 96, 3)
    assert np.array_equal(frames, expected)
    preview = read_video(tmp_path / "hdr.mp4")
    assert preview.shape == (9, 64, 96, 3) and read_audio(tmp_path / "hdr.mp4") is None  # no sound: the pipeline makes none
    # H.264 at 4:2:0 cannot keep the tiny model's pixel noise, so: the file is what encoding the
    # tone-mapped frames gives (as in tests/test_variants.py), and its 8x8 block means match theirs
    # within a few levels (the untone-mapped frames are 35 levels off on average).
    tone_mapped = srgb(expected)
    save_video(tone_mapped, tmp_path / "want.mp4", fps=24)
    assert np.abs(preview.astype(np.int16) - read_video(tmp_path / "want.mp4").astype(np.int16)).mean() < 0.5
    blocks = lambda frames: frames.astype(np.float64).reshape(9, 8, 8, 12, 8, 3).mean(axis=(2, 4))  # noqa: E731
    difference = np.abs(blocks(preview) - blocks(np.round(tone_mapped * 255)))
    assert difference.mean() < 3 and difference.max() < 10


def test_the_sdr_preview_and_the_npy_writer() -> None:
    """Clipped, then sRGB's curve (its linear toe below 0.0031308); the .npy is written to the very
    path given (a temporary name first: np.save would add .npy to it) and reads back bit for bit."""
    from accel.media import array_writer, sdr_preview, viewable

    linear = np.array([-0.5, 0.0, 0.002, 0.0031308, 0.18, 1.0, 55.0], dtype=np.float32)
    assert np.allclose(sdr_preview(linear), srgb(linear), atol=1e-6)
    assert sdr_preview(linear)[[0, 1, -2, -1]].tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0], abs=1e-6)
    assert sdr_preview(linear)[4] == pytest.approx(0.4614, abs=1e-4)
    assert viewable(linear, "video") is linear
    frames = np.random.default_rng(0).exponential(2.0, (3, 4, 5, 3)).astype(np.float32)
    path = Path(tempfile.mkdtemp()) / "frames.tmp"
    array_writer(frames)(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["frames.tmp"]
    assert np.array_equal(np.load(path), frames)


def test_bench_keeps_and_shows_an_hdr_video_as_its_sdr_preview(tmp_path: Path) -> None:
    """A bench variant's file is the preview MP4, its grid tile the preview's frames in [0, 1]."""
    from accel.bench import _save_output, _tile
    from accel.media import save_video

    linear = np.random.default_rng(0).exponential(0.5, (9, 64, 96, 3)).astype(np.float32)
    written = _save_output(linear, tmp_path, 1, "cache", FAMILY, "hdr-video")
    assert written == tmp_path / "01-cache.mp4"
    save_video(srgb(linear), tmp_path / "want.mp4", fps=FAMILY.fps)
    assert np.array_equal(read_video(written), read_video(tmp_path / "want.mp4"))
    tile = _tile("cache", "", linear, "hdr-video")
    assert tile.frame_numbers == (0, 4, 8) and np.allclose(tile.output, srgb(linear[[0, 4, 8]]), atol=1e-6)


def hdr_connector_embeds() -> tuple[torch.Tensor, torch.Tensor]:
    """Connector outputs precomputed from a prompt, as the HDR LoRA ships them (one sample, no mask)."""
    import accel

    pipe = accel.load_pipeline("tiny-ltx2", pipeline=HDR)
    embeds, mask, _, _ = pipe.encode_prompt("a white owl", do_classifier_free_guidance=False, device="cpu")
    with torch.no_grad():
        video, audio, _ = pipe.connectors(embeds, mask, padding_side=pipe.tokenizer_padding_side)
    return video, audio


def test_hdr_with_precomputed_connector_embeds_equals_one_process(rank_pools: Any) -> None:
    """The pipeline's optional `connector_video_embeds` / `connector_audio_embeds` (tensors, so from a
    script with accel.apply, not the CLI) replace the prompt: the text the transformer attends is
    theirs, kept whole on every rank like the prompt's; Ulysses 2 with the cache equals one process."""
    import variant_cases

    video, audio = hdr_connector_embeds()
    call = dict(CALL, num_inference_steps=3, guidance_scale=1.0, connector_video_embeds=video, connector_audio_embeds=audio)
    expected, _, _ = variant_cases.variant_run("ltx2", HDR, {}, call)
    prompted, _, _ = variant_cases.variant_run("ltx2", HDR, {}, dict(call, connector_video_embeds=None, connector_audio_embeds=None))
    assert np.abs(expected - prompted).max() > 1e-2  # the embeds (of another prompt), not the call's prompt, made it
    recipe = {"parallel": {"ulysses": 2}, "cache": {"threshold": 0.3}}
    reference, _, _ = variant_cases.variant_run("ltx2", HDR, {"cache": {"threshold": 0.3}}, call)
    for output, _, bytes_sent in rank_pools(2).run(variant_cases.variant_run, "ltx2", HDR, recipe, call):
        assert bytes_sent > 0
        assert np.abs(variant_cases.as_decoded(output, "ltx2", HDR) - variant_cases.as_decoded(reference, "ltx2", HDR)).max() <= 1e-4


def test_hdr_converts_the_whole_reference_clip_unless_frames_say_otherwise(tmp_path: Path) -> None:
    """The reference clip's length is the call's frame count; `[generate] frames` wins; a picture sets none."""
    from accel.media import save_video
    from accel.recipe import Recipe
    from accel.runner import generation_kwargs

    clip, picture = tmp_path / "clip.mp4", tmp_path / "still.png"
    save_video(np.zeros((17, 64, 64, 3), dtype=np.float32), clip, fps=24)
    cases.gradient_image().save(picture)
    for references, frames, expected in (([f"{clip}@0.9"], None, 17), ([str(clip)], 9, 9), ([str(picture), str(clip)], None, 9)):
        recipe = Recipe.from_dict({"model": {"pipeline": HDR}, "generate": {"references": references, "frames": frames}})
        assert generation_kwargs(FAMILY, True, recipe)["num_frames"] == expected
