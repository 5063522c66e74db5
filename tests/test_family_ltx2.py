"""LTX-2 specifics the shared matrices do not show by themselves: the plan derived from diffusers'
`_cp_plan` with the audio stream replicated, the audio in every comparison and in the MP4,
image-to-video through the command line, and LTX-2.5 DFR's two passes (a pass's latents saved with
`--out NAME.pt`, its temporal refine round reading them with `--input latents=NAME.pt`).

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
from accel.models.variants import variant_of
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


# -- DFR's two passes: a pass's latents saved with --out NAME.pt, its temporal refine round reading them --------------
ACCEL = str(Path(sys.executable).parent / "accel")
DFR, REFINE = "LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline"


def test_a_dfr_pass_then_its_temporal_refine_round_through_the_command_line(tmp_path: Path) -> None:
    """The pass saves its canvas (25 frames for 9 asked), audio, keyframe slots and their positions;
    the refine round, on 2 ranks, reads them, doubles the canvas in time (49 frames) and writes them
    at twice the frame rate with the pass's sound."""
    saved, out = tmp_path / "pass.pt", tmp_path / "refined.mp4"
    first = subprocess.run([ACCEL, "run", "tiny-ltx2", "--pipeline", DFR, "--warmup", "0", "--out", str(saved)],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    payload = torch.load(saved, weights_only=True)
    assert payload["pipeline"] == DFR and payload["fields"]["keyframe_positions"] == [24]
    assert payload["fields"]["frames"].shape == (1, 16, 4, 2, 3) and payload["fields"]["keyframes"].shape == (1, 16, 1, 2, 3)
    second = subprocess.run([ACCEL, "run", "tiny-ltx2", "--pipeline", REFINE, "--input", f"latents={saved}", "--gpus", "2",
                             "--oversubscribe", "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert read_video(out).shape == (49, 64, 96, 3)
    sound = read_audio(out)
    assert sound is not None and sound.samples.shape[0] == 2 and sound.seconds == pytest.approx(49 / 48, abs=0.05)
    import imageio_ffmpeg

    assert imageio_ffmpeg.count_frames_and_secs(str(out)) == (49, pytest.approx(49 / 48, abs=0.05))  # played at 48 fps


@pytest.fixture(scope="module")
def dfr_pass(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFR pass's .pt as --out writes it (the runner's own writer, no subprocess)."""
    from accel.runner import _write_output, generate_with_audio

    import accel

    pipe = accel.load_pipeline("tiny-ltx2", pipeline=DFR)
    pipe.set_progress_bar_config(disable=True)
    fields, _ = generate_with_audio(pipe, dict(prompt="a red fox", height=64, width=96, num_frames=9, sigmas=[1.0, 0.5]), 0,
                                    variant_of(FAMILY, DFR).latent_output)
    return _write_output("pass", 24, "video", tmp_path_factory.mktemp("dfr") / "pass.pt", False, fields)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], f"{REFINE} needs an input latents: pass --input latents=PATH ([generate] inputs), the .pt file "
             f"`accel run --pipeline {DFR} --out NAME.pt` wrote"),
        (["--input", "latents={other}"], f"[generate] inputs latents: {{other}} is not the latent output of a {DFR} or {REFINE} pass; "
                                         f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote"),
        (["--input", "latents={clip}"], f"[generate] inputs latents: {{clip}} is not a latent pass (.pt); "
                                        f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote"),
        (["--input", "latents={missing}"], f"[generate] inputs latents: {{missing}} does not exist; "
                                           f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote"),
        (["--input", "latents={garbage}"], f"[generate] inputs latents: {{garbage}} is not a file of tensors torch can load safely "
                                           f"(weights only); pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote"),
        (["--input", "latents={pass}", "--frames", "9"],
         "[generate] frames: the latent pass {pass} holds num_frames = 25, not 9; remove frames (the pass sets it)"),
        (["--input", "latents={pass}", "--arg", "keyframe_positions=[8]"],
         "[generate] arguments: keyframe_positions is one accel fills itself; set it with [generate] inputs"),
        (["--input", "latents={pass}", "--component", "upsampler={folder}"],
         f"[model] components: {REFINE} takes no component upsampler (it takes temporal_latent_upsampler, scheduler)"),
        (["--input", "latents={pass}", "--component", "temporal_latent_upsampler={missing}"],
         "[model] components: temporal_latent_upsampler: {missing} is not a folder; pass the folder a LTX2LatentUpsamplerModel "
         "was saved to (save_pretrained)"),
    ],
    ids=["missing", "not a pass", "wrong suffix", "missing file", "not a torch file", "frames against the pass", "argument the pass fills",
         "unknown component", "component folder missing"],
)
def test_a_bad_latent_input_is_one_line_before_any_rank_starts(tmp_path: Path, dfr_pass: Path, args: list[str], message: str) -> None:
    other, clip = tmp_path / "other.pt", tmp_path / "clip.mp4"
    torch.save({"frames": torch.zeros(1, 16, 4, 2, 3)}, other)
    clip.write_bytes(b"")
    (tmp_path / "garbage.pt").write_text("not a checkpoint")
    paths = {"other": str(other), "clip": str(clip), "missing": str(tmp_path / "nope.pt"), "pass": str(dfr_pass), "folder": str(tmp_path),
             "garbage": str(tmp_path / "garbage.pt")}
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--pipeline", REFINE, "--gpus", "2", "-o", str(tmp_path / "o.mp4"),
                                      *(arg.format(**paths) for arg in args)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: " + message.format(**paths)


def test_latents_are_written_only_by_a_pipeline_that_hands_them_on(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "-o", str(tmp_path / "o.pt")])
    assert result.stderr.strip() == f"error: --out {tmp_path / 'o.pt'}: LTX2Pipeline hands on no latents, so the name must end in .mp4"
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--pipeline", DFR, "--compare", "-o", str(tmp_path / "o.pt")])
    assert result.stderr.strip() == (f"error: --compare measures the picture against the baseline's; --out {tmp_path / 'o.pt'} saves "
                                     "latents, so drop --compare")


def test_the_refine_round_on_real_weights_needs_its_upsampler_folder_and_builds_its_scheduler(tmp_path: Path) -> None:
    """A DFR checkpoint (saved as LTX2DFRPipeline, as LTX-2.5's is) runs as the refine round with the
    temporal upsampler from --component's folder and the ancestral scheduler the round requires;
    without the folder, one line before loading."""
    import accel
    from accel.errors import UserError
    from accel.models.ltx2 import build_tiny_dfr, tiny_temporal_upsampler
    from accel.recipe import Recipe
    from accel.runner import generation_kwargs

    build_tiny_dfr().save_pretrained(tmp_path / "dfr")
    tiny_temporal_upsampler(seed=3).save_pretrained(tmp_path / "upsampler")
    recipe = Recipe.from_dict({"model": {"name": str(tmp_path / "dfr"), "pipeline": REFINE}})
    with pytest.raises(UserError) as refused:
        generation_kwargs(FAMILY, False, recipe, loads_as=DFR)
    assert str(refused.value) == (f"{REFINE} needs a temporal_latent_upsampler (LTX2LatentUpsamplerModel) the model does not hold: "
                                  "pass --component temporal_latent_upsampler=FOLDER ([model] components), the folder it was saved to")
    pipe = accel.load_pipeline(str(tmp_path / "dfr"), "float32", pipeline=REFINE,
                               components={"temporal_latent_upsampler": str(tmp_path / "upsampler")})
    assert type(pipe).__name__ == REFINE and type(pipe.scheduler).__name__ == "LTXEulerAncestralRFScheduler"
    expected = tiny_temporal_upsampler(seed=3).state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in pipe.temporal_latent_upsampler.state_dict().items())


def test_a_refine_round_of_two_tiles_equals_one_process_on_usp_with_the_cache(rank_pools: Any) -> None:
    """A pass of 49 frames has two keyframe segments, so its refine round runs two tiles, each its own
    denoising (its schedule restarted): 9 and 17 latent frames with their keyframes, 54 and 102
    tokens, which 4 ranks do not divide. The cache decides per call on every rank alike."""
    import variant_cases

    call, recipe = dict(prompt="a red fox", height=64, width=96, num_frames=49), {"cache": {"threshold": 0.3}}
    seen: list[int] = []
    pipe = variant_cases.variant_pipeline("ltx2", REFINE)
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    try:
        expected, skipped, _ = variant_cases.variant_run("ltx2", REFINE, recipe, call)
    finally:
        hook.remove()
    assert sorted(set(seen)) == [54, 102] and expected.shape == (1, 97, 64, 96, 3) and 0 < skipped < 8
    runs = rank_pools(4).run(variant_cases.variant_run, "ltx2", REFINE, {**recipe, "parallel": {"ulysses": 2, "ring": 2}}, call)
    for output, cached, bytes_sent in runs:
        assert bytes_sent > 0 and cached == skipped
        assert np.abs(output - expected).max() <= 1e-4


def test_the_dfr_tiny_builders_are_seeded_and_share_the_plain_tiny_weights() -> None:
    """The DFR transformer is tiny-ltx2's plus a seeded, non-zero keyframe marker; the refine round's
    components are the pass's plus a seeded temporal upsampler; building leaves the caller's RNG alone."""
    from accel.models.ltx2 import build_tiny, build_tiny_dfr, build_tiny_dfr_refine

    state = torch.random.get_rng_state()
    plain, dfr, refine = build_tiny().transformer.state_dict(), build_tiny_dfr().transformer.state_dict(), build_tiny_dfr_refine()
    assert torch.equal(torch.random.get_rng_state(), state)
    marker = dfr.pop("keyframes_abs_pos_embedding")
    assert marker.abs().min() > 0 and dfr.keys() == plain.keys() and all(torch.equal(dfr[name], plain[name]) for name in plain)
    again = build_tiny_dfr_refine()
    for module in ("transformer", "temporal_latent_upsampler"):
        first, second = getattr(refine, module).state_dict(), getattr(again, module).state_dict()
        assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "4"], f"[generate] steps: {DFR} takes no num_inference_steps; remove it (its steps are its schedule: --arg sigmas=[…])"),
        (["--gpus", "2", "--cfg-parallel"], f"[parallel] cfg = 2 splits the classifier-free guidance branches, and {DFR} runs none "
                                            "(its call takes no guidance_scale); set cfg = 1"),
    ],
    ids=["steps", "cfg"],
)
def test_the_dfr_pass_says_where_its_steps_are_and_that_it_runs_no_guidance(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--pipeline", DFR, "-o", str(tmp_path / "o.mp4"), *args])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == "error: " + message  # after torch's import-time warnings, when first
