"""Kandinsky 6.0 (accel/models/kandinsky6.py): what its shared matrix rows do not show. The MP4 that
`accel run` writes carries the generated sound; a picture to start from joins the video tokens as
one more latent frame, cut with them; CFG halves answer each other's audio prediction beside the
video's, and without audio only the video's. The shared rows compare the frames with the audio
samples appended (tests/parallel_cases.output_of), so every mode there checks the sound too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from variant_cases import run_written

import parallel_cases as cases
from family_parallel import TOLERANCE, reference
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
import torch
from fakecuda import Grid, HEADS, Layout, randn
from accel.models import kandinsky6


# Kandinsky 6's (44.1 kHz over a 1024-sample hop: 218 for 5 s): replicated too.
K6_AUDIO = 11


# Kandinsky 6.0 Pro's transformer (accel/models/flagships.py's widths; one text and two fused blocks): 32 video heads of
# 128, 16 audio heads of 128, Qwen2.5-VL-7B's 3584-wide text, the MMAudio VAE's 40 latent channels.
KANDINSKY6 = dict(
    in_visual_dim=16,
    out_visual_dim=16,
    in_text_dim=3584,
    in_text_dim2=768,
    time_dim=1024,
    patch_size=(1, 2, 2),
    model_dim=4096,
    ff_dim=16384,
    num_text_blocks=1,
    num_visual_blocks=2,
    axes_dims=(32, 48, 48),
    visual_cond=True,
    in_audio_dim=40,
    out_audio_dim=40,
    model_dim_a=2048,
    ff_dim_a=7168,
    time_dim_a=1024,
    text_token_padding=True,
    ca_rope=True,
    cross_gates=True,
    fix_modulation=True,
    visual_token_type_num_embeddings=2,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """As Kandinsky 5's, with K6_AUDIO audio tokens and the prompt's padding mask (the pipeline pads to 1024)."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    channels = 2 * config["in_visual_dim"] + 1 if config["visual_cond"] else config["in_visual_dim"]
    mask = torch.arange(text, device="cuda").expand(batch, text) < text - 3
    return dict(
        hidden_states=randn(batch, f, 2 * h, 2 * w, channels),
        audio_hidden_states=randn(batch, K6_AUDIO, config["in_audio_dim"]),
        encoder_hidden_states=randn(batch, text, config["in_text_dim"]),
        pooled_projections=randn(batch, config["in_text_dim2"]),
        timestep=t,
        encoder_attention_mask=mask,
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (
        batch,
        grid.frames,
        2 * grid.rows,
        2 * grid.cols,
        config["out_visual_dim"],
    )  # (B, F, H, W, C), as its latents; the audio prediction comes beside it


def fake_overrides(config: dict[str, Any]) -> dict[str, Any]:
    # the same as Kandinsky 5's for its video and its audio stream
    return {
        "model_dim": HEADS * sum(config["axes_dims"]),
        "model_dim_a": HEADS * sum(config["axes_dims_a"]),
        "num_text_blocks": 1,
    }


# -- kandinsky6: 2 text blocks per stream, then 2 fused blocks returning (video, audio); 32 video, 5 audio tokens --
def block_transformer() -> nn.Module:
    from diffusers import Kandinsky6Transformer3DModel

    from accel.models.kandinsky6 import random_modulation

    def build() -> nn.Module:
        # The released checkpoints' switches; the audio heads as wide as the video's (the cross-modal rotary tables need
        # it).
        model = Kandinsky6Transformer3DModel(
            in_visual_dim=4,
            out_visual_dim=4,
            in_text_dim=block_cases.TEXT_DIM,
            in_text_dim2=16,
            time_dim=32,
            model_dim=block_cases.HEADS * block_cases.HEAD_DIM,
            ff_dim=64,
            num_text_blocks=2,
            num_visual_blocks=2,
            axes_dims=(4, 6, 6),
            in_audio_dim=4,
            out_audio_dim=4,
            text_token_padding=True,
            ca_rope=True,
            cross_gates=True,
            fix_modulation=True,
            visual_token_type_num_embeddings=2,
        )
        random_modulation(model)  # diffusers zeroes it: every block would be an identity
        return model

    return block_cases.seeded(24, build)


def block_inputs(drift: float) -> block_cases.Inputs:
    # (B, frames, H, W, C) latents with the condition channels and mask (2 x 4 + 1), (B, tokens, C) audio latents.
    return dict(
        hidden_states=block_cases.latents((1, 2, 8, 8, 9), drift),
        audio_hidden_states=block_cases.latents((1, 5, 4), drift),
        encoder_hidden_states=block_cases.text(),
        pooled_projections=block_cases.noise(torch.Generator().manual_seed(2), 1, 16),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        encoder_attention_mask=block_cases.text_mask().bool(),
        return_dict=False,
    )


CASE = FamilyCase(
    # Two calls a step; 2 latent frames x 4x4 patches = 32 video tokens, which 3 ranks do not divide
    # (the odd size is this one: no second reference run), beside 53 audio tokens, whole on every rank.
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),
    odd={},
    threshold=0.2,
    tiny=TinyCase(
        name="kandinsky6",
        build=kandinsky6.build_tiny,
        pipeline_class=diffusers.Kandinsky6TI2VAPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("video_text_transformer_blocks", "audio_text_transformer_blocks", "visual_transformer_blocks"),
        transformer_calls=8,  # CFG: a positive and a negative call per step
        # (B, frames, H, W, C): 16 noise channels, 16 (unused) condition channels and a condition mask
        latent_shape=(1, 2, 8, 8, 33),
        text_shape=(1, 1024, 32),  # Qwen padded to the pipeline's 1024 tokens after the template's 129 are cropped
        components=("text_encoder", "text_encoder_2", "transformer", "vae", "audio_vae", "vocoder"),
        reload_tolerance=1e-5,  # seen: 0
    ),
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        overrides=fake_overrides,
        # Kandinsky 6.0 at 512x768, 121 frames: 31 x 32 x 48 = 47616 video tokens, 1024 text tokens; its two calls a
        # step on CFG halves x Ulysses 4, with the cache; the audio whole on every rank.
        real_config=KANDINSKY6,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(31, 32, 48, 1024)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)


CALL = CASE.call


def test_accel_run_writes_the_sound_into_the_mp4_at_the_calls_frame_rate(tmp_path: Path) -> None:
    """At 12 frames a second the pipeline makes sound for 5/12 s: 16 kHz over a 64-sample latent hop is
    105 audio latents, 210 mel frames of 32 samples; the MP4 plays its 5 frames at 12 fps, as long."""
    import imageio_ffmpeg

    out = tmp_path / "fox.mp4"
    video, sound = run_written(out, "tiny-kandinsky6", "--arg", "frame_rate=12")
    assert video.shape == (5, 64, 64, 3)
    assert next(imageio_ffmpeg.read_frames(str(out)))["fps"] == 12
    assert sound is not None and sound.rate == 16000 and sound.samples.shape[0] == 1  # mono, the audio VAE's rate
    assert sound.samples.shape[1] == 105 * 64  # the whole waveform
    assert np.abs(sound.samples).max() > 0


def test_a_picture_to_start_from_on_ring2_equals_one_process(rank_pools: Any) -> None:
    """The picture's latents join the video as a third latent frame (token type 1, the first frame's
    rotary position): 48x80 makes 3 x 3x5 = 45 video tokens, which 2 ranks do not divide."""
    call = dict(CALL, image=cases.gradient_image(64), height=48, width=80, num_inference_steps=3)
    tokens: list[int] = []
    pipe = cases.tiny_pipeline("tiny-kandinsky6")
    hook = pipe.transformer.visual_transformer_blocks[0].register_forward_pre_hook(
        lambda _m, args: tokens.append(args[0].shape[1])
    )
    try:
        expected, _ = reference("kandinsky6", call)
    finally:
        hook.remove()
    assert tokens == [45] * 6
    for output, _, bytes_sent in rank_pools(2).run(cases.tiny_run, "tiny-kandinsky6", {"parallel": {"ring": 2}}, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_cfg_halves_without_audio_answer_the_video_alone(rank_pools: Any) -> None:
    """sample_audio=False: the transformer gets no audio latents and returns the video's prediction
    alone, so each half answers the other's call with one placeholder, not two."""
    call = dict(CALL, sample_audio=False, num_inference_steps=2)
    expected, _ = reference("kandinsky6", call)
    assert expected.shape == (1, 5, 64, 64, 3)  # no audio samples appended
    for output, _, bytes_sent in rank_pools(2).run(cases.tiny_run, "tiny-kandinsky6", {"parallel": {"cfg": 2}}, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


DISTILLED = "accel.models.kandinsky6:build_tiny_distilled"


def test_the_distilled_pipeline_on_ulysses2_with_the_cache_equals_one_process(rank_pools: Any) -> None:
    """A distilled checkpoint's shape: a PiflowScheduler (one copy for the audio, as the pipeline
    deep-copies it) and a transformer predicting two values per latent channel of each stream, one call
    a step (no guidance). Each rank caches the calls one process caches, and the outputs agree."""
    pipe = cases.tiny_pipeline(DISTILLED)
    assert type(pipe.scheduler).__name__ == "PiflowScheduler" and pipe.transformer.config.out_visual_dim == 32
    call = dict(CALL, guidance_scale=1.0, num_inference_steps=4)
    recipe = {"cache": {"threshold": CASE.threshold}}
    expected, records, _ = cases.tiny_run(DISTILLED, recipe, call)
    assert 0 < sum(cached for *_, cached in records) < len(records) == 4
    runs = rank_pools(2).run(cases.tiny_run, DISTILLED, {**recipe, "parallel": {"ulysses": 2}}, call)
    for output, got, bytes_sent in runs:
        assert bytes_sent > 0
        assert [(step, cached) for step, _, _, cached in got] == [(step, cached) for step, _, _, cached in records]
        assert np.abs(output - expected).max() <= TOLERANCE
