"""LTX-2 specifics the shared matrices do not show by themselves: the plan derived from diffusers'
`_cp_plan` with the audio stream replicated, the audio in every comparison and in the MP4,
image-to-video through the command line, and LTX-2.5 DFR's two passes (a pass's latents saved with
`--out NAME.pt`, its temporal refine round reading them with `--input latents=NAME.pt`).

The shared cases (tests/test_parallel_families.py) compare `parallel_cases.output_of`, which for
LTX-2 is the frames with the audio samples appended, so every mode there checks the sound too.
"""

from __future__ import annotations

import copy
import tempfile
import sys
from pathlib import Path
from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
import commands
import torch
from cli_runs import accel_run
from typer.testing import CliRunner

from variant_cases import run_written

from accel.cli import app
from accel.media import read_audio, read_video
from accel.models.registry import FAMILIES
from accel.models.variants import variant_of
from accel.parallel.plan import resolve_plan
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from fakecuda import DTYPE, Grid, HEADS, Layout, out_channels, randn
from accel.models import ltx2_tiny


# LTX-2's audio tokens (25 a second; 126 for 5 s): replicated on every rank, so any count does.
LTX2_AUDIO = 13


def dfr_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """LTX-2.5 DFR's transformer: a per-token keyframe marker (the first latent frame's tokens, 1) and
    per-token timesteps (its conditioning lowers some), both cut with the video tokens."""
    if not config.get("use_keyframes_abs_pos_embedding"):
        return {}
    first = torch.arange(grid.tokens, device="cuda") < grid.rows * grid.cols
    scalar = t.reshape(-1)[:1].expand(
        batch
    )  # the schedule's sigma, the audio's timestep and sigma as the pipeline passes them
    return dict(
        video_keyframes_mask=first.to(DTYPE).expand(batch, -1).unsqueeze(-1),
        timestep=scalar[:, None] * (~first).to(DTYPE),
        sigma=scalar,
        audio_timestep=scalar,
        audio_sigma=scalar,
        use_cross_timestep=True,
    )


# LTX-2's transformer (diffusers' defaults, two blocks): 32 video heads of 128, 32 audio heads of 64, Gemma 3's
# 3840-wide text.
LTX2 = dict(
    in_channels=128,
    out_channels=128,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    num_layers=2,
    caption_channels=3840,
    rope_type="split",
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """Packed video tokens and LTX2_AUDIO audio tokens, each with its own text."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    mask = torch.ones(batch, text, device="cuda", dtype=torch.long)
    return {
        **dict(
            hidden_states=randn(batch, grid.tokens, config["in_channels"]),
            audio_hidden_states=randn(batch, LTX2_AUDIO, config["audio_in_channels"]),
            encoder_hidden_states=randn(batch, text, config["caption_channels"]),
            audio_encoder_hidden_states=randn(batch, text, config["caption_channels"]),
            timestep=t,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=f,
            height=h,
            width=w,
            audio_num_frames=LTX2_AUDIO,
            return_dict=False,
        ),
        **dfr_inputs(config, grid, batch, t),
    }


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (batch, grid.tokens, out_channels(config))  # the video; the audio prediction comes beside it


def fake_more_overrides(config: dict[str, Any], width: int) -> dict[str, Any]:
    # audio heads as many as video heads (as on LTX-2: the cross-modal rotary tables need it)
    return dict(
        cross_attention_dim=width,
        audio_num_attention_heads=HEADS,
        audio_cross_attention_dim=HEADS * config["audio_attention_head_dim"],
    )


# -- ltx2: 2 blocks that return (video, audio); 32 video tokens, 5 audio tokens --------------------
def block_transformer() -> nn.Module:
    from diffusers import LTX2VideoTransformer3DModel

    return block_cases.seeded(
        22,
        lambda: LTX2VideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            num_attention_heads=block_cases.HEADS,
            attention_head_dim=block_cases.HEAD_DIM,
            cross_attention_dim=block_cases.HEADS * block_cases.HEAD_DIM,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=block_cases.HEADS,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            caption_channels=block_cases.TEXT_DIM,
            rope_type="split",
        ),
    )


def block_inputs(drift: float) -> block_cases.Inputs:
    frames, height, width, audio = 2, 4, 4, 5
    return dict(
        hidden_states=block_cases.latents((1, frames * height * width, 8), drift),
        audio_hidden_states=block_cases.latents((1, audio, 4), drift),
        encoder_hidden_states=block_cases.text(),
        audio_encoder_hidden_states=block_cases.text(3),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=block_cases.text_mask(),
        audio_encoder_attention_mask=block_cases.text_mask(),
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio,
        return_dict=False,
    )


CASE = FamilyCase(
    # Batched CFG, plus the pipeline's spatio-temporal and modality guidance calls (batch 1) each step.
    dict(PROMPT, height=64, width=96, num_frames=9, num_inference_steps=4, guidance_scale=4.0),
    odd=dict(height=64, width=160, num_frames=9),  # 2 latent frames x 2x5 = 20 video tokens; 9 audio tokens
    threshold=0.3,
    tiny=TinyCase(
        name="ltx2",
        build=ltx2_tiny.build_tiny,
        pipeline_class=diffusers.LTX2Pipeline,
        # The spatio-temporal and modality guidance calls off (their defaults add two batch-1 calls a
        # step), so every call has one shape; tests/test_family_ltx2.py runs the defaults.
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=96,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=4.0,
            stg_scale=0.0,
            audio_stg_scale=0.0,
            modality_scale=1.0,
            audio_modality_scale=1.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 64, 96, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 12, 16),  # 9 frames -> 2 latent frames, 64x96 -> 2x3: 12 packed tokens
        text_shape=(2, 1024, 16),  # Gemma padded (left) to the pipeline's 1024 tokens, after the connectors
        components=("text_encoder", "connectors", "transformer", "vae", "audio_vae", "vocoder"),
        reload_tolerance=1e-5,
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        more_overrides=fake_more_overrides,
        # LTX-2 at 512x768, 121 frames: 16 x 16 x 24 = 6144 video tokens, 1024 text tokens; CFG halves x Ulysses 4.
        real_config=LTX2,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(16, 16, 24, 1024)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
    contract_size=dict(height=64, width=96),  # its audio VAE pads past a 32 px latent
)

FAMILY = FAMILIES["ltx2"]
CALL = dict(
    prompt="a red fox",
    negative_prompt="blurry",
    height=64,
    width=96,
    num_frames=9,
    num_inference_steps=2,
    guidance_scale=4.0,
)


def test_the_plan_follows_diffusers_and_keeps_text_and_audio_whole() -> None:
    pipe = cases.tiny_pipeline("tiny-ltx2")
    plan = resolve_plan(FAMILY.parallel, pipe.transformer)
    cut = {(split.module, split.value, split.element, split.ndim): split.stream for split in plan.splits}
    # diffusers' cuts of the video and its interleaved rotary tables, and accel's additions
    assert (
        cut[("", "hidden_states", None, 3)] == cut[("rope", "output", 0, 3)] == cut[("rope", "output", 1, 3)] == "video"
    )
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
    from accel.hooks import wrappers

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
    frames, sound = run_written(tmp_path / "fox.mp4", "tiny-ltx2")
    assert frames.shape == (9, 64, 96, 3)
    assert sound is not None and sound.rate == 24000 and sound.samples.shape[0] == 2
    expected, _, _ = cases.tiny_run(
        "tiny-ltx2",
        {},
        dict(
            prompt="a red fox in the snow, photograph",
            height=64,
            width=96,
            num_frames=9,
            num_inference_steps=2,
            guidance_scale=4.0,
        ),
    )
    samples = expected.size - 9 * 64 * 96 * 3
    assert sound.samples.shape[1] == samples // 2  # the whole waveform, 0.33 s
    assert sound.seconds == pytest.approx(samples / 2 / 24000)


def test_image_to_video_through_the_command_line(tmp_path: Path) -> None:
    picture, out = tmp_path / "first.png", tmp_path / "out.mp4"
    cases.gradient_image().save(picture)
    result = accel_run(
        *["tiny-ltx2", "--pipeline", "LTX2ImageToVideoPipeline", "--image", str(picture)],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert read_video(out).shape == (9, 64, 96, 3)
    assert read_audio(out) is not None


# 20 video tokens with per-token timesteps; no H.264 round trip of the picture (it needs PyAV), as accel runs the tiny
# variant
I2V = dict(CALL, num_inference_steps=3, width=160, image=cases.gradient_image(), image_crf=0)


@pytest.mark.parametrize("parallel", [{"ring": 3}, {"cfg": 2, "ulysses": 2}], ids=["ring3", "cfg2xulysses2"])
def test_image_to_video_equals_one_process(rank_pools: Any, parallel: dict[str, int]) -> None:
    """The conditioned first frame gives every video token its own timestep: cut with the tokens."""
    expected, _, _ = cases.tiny_run("parallel_cases:tiny_ltx2_i2v", {}, I2V)
    world = parallel.get("ring", 1) * parallel.get("ulysses", 1) * parallel.get("cfg", 1)
    for output, _, bytes_sent in rank_pools(world).run(
        cases.tiny_run, "parallel_cases:tiny_ltx2_i2v", {"parallel": parallel}, I2V
    ):
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
    from accel.models.input_files import read_clip
    from diffusers.pipelines.ltx2.pipeline_ltx2_hdr_lora import LTX2HDRReferenceCondition

    clip = tmp_path / "clip.mp4"
    save_video(np.stack([np.asarray(cases.gradient_image(), dtype=np.float32) / 255] * 9), clip, fps=24)
    recipe = tmp_path / "hdr.toml"
    recipe.write_text(
        f'[model]\nname = "tiny-ltx2"\npipeline = "{HDR}"\n[generate]\nsteps = 2\nreferences = ["{clip}@1.0"]\n'
    )
    for args in (
        [
            "tiny-ltx2",
            "--pipeline",
            HDR,
            "--reference",
            f"{clip}@1.0",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "hdr.mp4"),
        ],
        ["--recipe", str(recipe), "--out", str(tmp_path / "hdr.npy")],
    ):
        result = accel_run(*args, "--warmup", "0")
        assert result.exit_code == 0, result.output[-2000:]
    pipe = accel.load_pipeline("tiny-ltx2", pipeline=HDR)
    expected = pipe(
        prompt="a red fox in the snow, photograph",
        reference_conditions=[LTX2HDRReferenceCondition(read_clip(str(clip)), 1.0)],
        height=64,
        width=96,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=4.0,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="np",
    ).frames[0]
    assert (
        expected.dtype == np.float32 and expected.min() >= -0.02 and expected.max() > 1
    )  # linear light, past SDR's white
    frames = np.load(tmp_path / "hdr.npy")
    assert frames.dtype == np.float32 and frames.shape == (9, 64, 96, 3)
    assert np.array_equal(frames, expected)
    preview = read_video(tmp_path / "hdr.mp4")
    assert (
        preview.shape == (9, 64, 96, 3) and read_audio(tmp_path / "hdr.mp4") is None
    )  # no sound: the pipeline makes none
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
    from accel.bench.run import _save_output, _tile
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
    call = dict(
        CALL, num_inference_steps=3, guidance_scale=1.0, connector_video_embeds=video, connector_audio_embeds=audio
    )
    expected, _, _ = variant_cases.variant_run("ltx2", HDR, {}, call)
    prompted, _, _ = variant_cases.variant_run(
        "ltx2", HDR, {}, dict(call, connector_video_embeds=None, connector_audio_embeds=None)
    )
    assert np.abs(expected - prompted).max() > 1e-2  # the embeds (of another prompt), not the call's prompt, made it
    recipe = {"parallel": {"ulysses": 2}, "cache": {"threshold": 0.3}}
    reference, _, _ = variant_cases.variant_run("ltx2", HDR, {"cache": {"threshold": 0.3}}, call)
    for output, _, bytes_sent in rank_pools(2).run(variant_cases.variant_run, "ltx2", HDR, recipe, call):
        assert bytes_sent > 0
        assert (
            np.abs(
                variant_cases.as_decoded(output, "ltx2", HDR) - variant_cases.as_decoded(reference, "ltx2", HDR)
            ).max()
            <= 1e-4
        )


def test_hdr_converts_the_whole_reference_clip_unless_frames_say_otherwise(tmp_path: Path) -> None:
    """The reference clip's length is the call's frame count; `[generate] frames` wins; a picture sets none."""
    from accel.media import save_video
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    clip, picture = tmp_path / "clip.mp4", tmp_path / "still.png"
    save_video(np.zeros((17, 64, 64, 3), dtype=np.float32), clip, fps=24)
    cases.gradient_image().save(picture)
    for references, frames, expected in (
        ([f"{clip}@0.9"], None, 17),
        ([str(clip)], 9, 9),
        ([str(picture), str(clip)], None, 9),
    ):
        recipe = Recipe.from_dict(
            {"model": {"pipeline": HDR}, "generate": {"references": references, "frames": frames}}
        )
        assert generation_kwargs(FAMILY, True, recipe)["num_frames"] == expected


def test_a_dfr_pass_through_the_command_line_makes_the_requested_frames_with_sound(tmp_path: Path) -> None:
    """LTX2DFRPipeline pads 9 frames to a 25-frame canvas with a keyframe slot and, with --condition,
    an appended keyframe; the MP4 holds the 9 frames asked for and their 0.375 s of sound. It takes
    no step count: its distilled schedule (8 sigmas) is the steps."""
    picture, out = tmp_path / "last.png", tmp_path / "dfr.mp4"
    cases.gradient_image().save(picture)
    result = accel_run(
        *["tiny-ltx2", "--pipeline", "LTX2DFRPipeline", "--condition", f"{picture}@-1:0.8"],
        *["--warmup", "0", "--out", str(out), "--json", str(tmp_path / "run.json")],
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert read_video(out).shape == (9, 64, 96, 3)
    sound = read_audio(out)
    assert sound is not None and sound.samples.shape == (2, 9000)  # trimmed to 9 frames at 24 fps, 24 kHz
    import json

    assert json.loads((tmp_path / "run.json").read_text())["steps"] == 8


# -- DFR's two passes: a pass's latents saved with --out NAME.pt, its temporal refine round reading them --------------
DFR, REFINE = "LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline"


def test_a_dfr_pass_then_its_temporal_refine_round_through_the_command_line(tmp_path: Path) -> None:
    """The pass saves its canvas (25 frames for 9 asked), audio, keyframe slots and their positions;
    the refine round, on 2 ranks, reads them, doubles the canvas in time (49 frames) and writes them
    at twice the frame rate with the pass's sound."""
    saved, out = tmp_path / "pass.pt", tmp_path / "refined.mp4"
    first = accel_run("tiny-ltx2", "--pipeline", DFR, "--warmup", "0", "--out", str(saved))
    assert first.exit_code == 0, first.output[-2000:]
    payload = torch.load(saved, weights_only=True)
    assert payload["pipeline"] == DFR and payload["fields"]["keyframe_positions"] == [24]
    assert payload["fields"]["frames"].shape == (1, 16, 4, 2, 3) and payload["fields"]["keyframes"].shape == (
        1,
        16,
        1,
        2,
        3,
    )
    second = commands.run(
        [
            sys.executable,
            "-m",
            "accel.cli",
            "run",
            "tiny-ltx2",
            "--pipeline",
            REFINE,
            "--input",
            f"latents={saved}",
            "--gpus",
            "2",
            "--oversubscribe",
            "--warmup",
            "0",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert read_video(out).shape == (49, 64, 96, 3)
    sound = read_audio(out)
    assert sound is not None and sound.samples.shape[0] == 2 and sound.seconds == pytest.approx(49 / 48, abs=0.05)
    import imageio_ffmpeg

    assert imageio_ffmpeg.count_frames_and_secs(str(out)) == (49, pytest.approx(49 / 48, abs=0.05))  # played at 48 fps


@pytest.fixture(scope="module")
def dfr_pass(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DFR pass's .pt as --out writes it (the runner's own writer, no subprocess)."""
    from accel.generate import generate_with_audio
    from accel.outputs import write_output

    import accel

    pipe = accel.load_pipeline("tiny-ltx2", pipeline=DFR)
    pipe.set_progress_bar_config(disable=True)
    fields, _ = generate_with_audio(
        pipe,
        dict(prompt="a red fox", height=64, width=96, num_frames=9, sigmas=[1.0, 0.5]),
        0,
        variant_of(FAMILY, DFR).latent_output,
    )
    return write_output("pass", 24, "video", tmp_path_factory.mktemp("dfr") / "pass.pt", False, fields)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [],
            f"{REFINE} needs an input latents: pass --input latents=PATH ([generate] inputs), the .pt file "
            f"`accel run --pipeline {DFR} --out NAME.pt` wrote",
        ),
        (
            ["--input", "latents={other}"],
            f"[generate] inputs latents: {{other}} is not the latent output of a {DFR} or {REFINE} pass; "
            f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote",
        ),
        (
            ["--input", "latents={clip}"],
            f"[generate] inputs latents: {{clip}} is not a latent pass (.pt); "
            f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote",
        ),
        (
            ["--input", "latents={missing}"],
            f"[generate] inputs latents: {{missing}} does not exist; "
            f"pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote",
        ),
        (
            ["--input", "latents={garbage}"],
            f"[generate] inputs latents: {{garbage}} is not a file of tensors torch can load safely "
            f"(weights only); pass the .pt file `accel run --pipeline {DFR} --out NAME.pt` wrote",
        ),
        (
            ["--input", "latents={pass}", "--frames", "9"],
            "[generate] frames: the latent pass {pass} holds num_frames = 25, not 9; remove frames (the pass sets it)",
        ),
        (
            ["--input", "latents={pass}", "--arg", "keyframe_positions=[8]"],
            "[generate] arguments: keyframe_positions is one accel fills itself; set it with [generate] inputs",
        ),
        (
            ["--input", "latents={pass}", "--component", "upsampler={folder}"],
            f"[model] components: {REFINE} takes no component upsampler "
            "(it takes temporal_latent_upsampler, scheduler)",
        ),
        (
            ["--input", "latents={pass}", "--component", "temporal_latent_upsampler={missing}"],
            "[model] components: temporal_latent_upsampler: {missing} is not a folder; pass the folder a "
            "LTX2LatentUpsamplerModel "
            "was saved to (save_pretrained)",
        ),
    ],
    ids=[
        "missing",
        "not a pass",
        "wrong suffix",
        "missing file",
        "not a torch file",
        "frames against the pass",
        "argument the pass fills",
        "unknown component",
        "component folder missing",
    ],
)
def test_a_bad_latent_input_is_one_line_before_any_rank_starts(
    tmp_path: Path, dfr_pass: Path, args: list[str], message: str
) -> None:
    other, clip = tmp_path / "other.pt", tmp_path / "clip.mp4"
    torch.save({"frames": torch.zeros(1, 16, 4, 2, 3)}, other)
    clip.write_bytes(b"")
    (tmp_path / "garbage.pt").write_text("not a checkpoint")
    paths = {
        "other": str(other),
        "clip": str(clip),
        "missing": str(tmp_path / "nope.pt"),
        "pass": str(dfr_pass),
        "folder": str(tmp_path),
        "garbage": str(tmp_path / "garbage.pt"),
    }
    result = CliRunner().invoke(
        app,
        [
            "run",
            "tiny-ltx2",
            "--pipeline",
            REFINE,
            "--gpus",
            "2",
            "-o",
            str(tmp_path / "o.mp4"),
            *(arg.format(**paths) for arg in args),
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: " + message.format(**paths)


def test_latents_are_written_only_by_a_pipeline_that_hands_them_on(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "-o", str(tmp_path / "o.pt")])
    assert (
        result.stderr.strip()
        == f"error: --out {tmp_path / 'o.pt'}: LTX2Pipeline hands on no latents, so the name must end in .mp4"
    )
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--pipeline", DFR, "--compare", "-o", str(tmp_path / "o.pt")])
    assert result.stderr.strip() == (
        f"error: --compare measures the picture against the baseline's; --out {tmp_path / 'o.pt'} saves "
        "latents, so drop --compare"
    )


def test_the_refine_round_on_real_weights_needs_its_upsampler_folder_and_builds_its_scheduler(tmp_path: Path) -> None:
    """A DFR checkpoint (saved as LTX2DFRPipeline, as LTX-2.5's is) runs as the refine round with the
    temporal upsampler from --component's folder and the ancestral scheduler the round requires;
    without the folder, one line before loading."""
    import accel
    from accel.errors import UserError
    from accel.models.ltx2_tiny import build_tiny_dfr, tiny_temporal_upsampler
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    build_tiny_dfr().save_pretrained(tmp_path / "dfr")
    tiny_temporal_upsampler(seed=3).save_pretrained(tmp_path / "upsampler")
    recipe = Recipe.from_dict({"model": {"name": str(tmp_path / "dfr"), "pipeline": REFINE}})
    with pytest.raises(UserError) as refused:
        generation_kwargs(FAMILY, False, recipe, loads_as=DFR)
    assert str(refused.value) == (
        f"{REFINE} needs a temporal_latent_upsampler (LTX2LatentUpsamplerModel) the model does not hold: "
        "pass --component temporal_latent_upsampler=FOLDER ([model] components), the folder it was saved to"
    )
    pipe = accel.load_pipeline(
        str(tmp_path / "dfr"),
        "float32",
        pipeline=REFINE,
        components={"temporal_latent_upsampler": str(tmp_path / "upsampler")},
    )
    assert type(pipe).__name__ == REFINE and type(pipe.scheduler).__name__ == "LTXEulerAncestralRFScheduler"
    expected = tiny_temporal_upsampler(seed=3).state_dict()
    assert all(
        torch.equal(value, expected[name]) for name, value in pipe.temporal_latent_upsampler.state_dict().items()
    )


def test_a_refine_round_of_two_tiles_equals_one_process_on_usp_with_the_cache(rank_pools: Any) -> None:
    """A pass of 49 frames has two keyframe segments, so its refine round runs two tiles, each its own
    denoising (its schedule restarted): 9 and 17 latent frames with their keyframes, 54 and 102
    tokens, which 4 ranks do not divide. The cache decides per call on every rank alike."""
    import variant_cases

    call, recipe = dict(prompt="a red fox", height=64, width=96, num_frames=49), {"cache": {"threshold": 0.3}}
    seen: list[int] = []
    pipe = variant_cases.variant_pipeline("ltx2", REFINE)
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda _m, _a, kwargs: seen.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        expected, skipped, _ = variant_cases.variant_run("ltx2", REFINE, recipe, call)
    finally:
        hook.remove()
    assert sorted(set(seen)) == [54, 102] and expected.shape == (1, 97, 64, 96, 3) and 0 < skipped < 8
    runs = rank_pools(4).run(
        variant_cases.variant_run, "ltx2", REFINE, {**recipe, "parallel": {"ulysses": 2, "ring": 2}}, call
    )
    for output, cached, bytes_sent in runs:
        assert bytes_sent > 0 and cached == skipped
        assert np.abs(output - expected).max() <= 1e-4


def test_the_dfr_tiny_builders_are_seeded_and_share_the_plain_tiny_weights() -> None:
    """The DFR transformer is tiny-ltx2's plus a seeded, non-zero keyframe marker; the refine round's
    components are the pass's plus a seeded temporal upsampler; building leaves the caller's RNG alone."""
    from accel.models.ltx2_tiny import build_tiny, build_tiny_dfr, build_tiny_dfr_refine

    state = torch.random.get_rng_state()
    plain, dfr, refine = (
        build_tiny().transformer.state_dict(),
        build_tiny_dfr().transformer.state_dict(),
        build_tiny_dfr_refine(),
    )
    assert torch.equal(torch.random.get_rng_state(), state)
    marker = dfr.pop("keyframes_abs_pos_embedding")
    assert (
        marker.abs().min() > 0
        and dfr.keys() == plain.keys()
        and all(torch.equal(dfr[name], plain[name]) for name in plain)
    )
    again = build_tiny_dfr_refine()
    for module in ("transformer", "temporal_latent_upsampler"):
        first, second = getattr(refine, module).state_dict(), getattr(again, module).state_dict()
        assert all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--steps", "4"],
            f"[generate] steps: {DFR} takes no num_inference_steps; remove it (its steps are its schedule: --arg "
            "sigmas=[…])",
        ),
        (
            ["--gpus", "2", "--cfg-parallel"],
            f"[parallel] cfg = 2 splits the classifier-free guidance branches, and {DFR} runs none "
            "(its call takes no guidance_scale); set cfg = 1",
        ),
    ],
    ids=["steps", "cfg"],
)
def test_the_dfr_pass_says_where_its_steps_are_and_that_it_runs_no_guidance(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["run", "tiny-ltx2", "--pipeline", DFR, "-o", str(tmp_path / "o.mp4"), *args])
    assert result.exit_code == 2
    assert (
        result.stderr.strip().splitlines()[-1] == "error: " + message
    )  # after torch's import-time warnings, when first
