"""Tiny pipelines of every family: real classes, offline, seeded, deterministic, prompt-driven, reloadable.

Later cache and context-parallel tests compare outputs bit for bit, so these pin down the
properties they rely on.
"""

from __future__ import annotations

import inspect
import os

# huggingface_hub reads this once at import: set it before diffusers comes in, in case this
# module is the first to import it. Loading below also passes local_files_only=True.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from accel.models import (
    chronoedit,
    cogvideox,
    cosmos3,
    flux,
    flux2,
    helios,
    hunyuan,
    hunyuan15,
    hunyuanimage,
    kandinsky5,
    kandinsky6,
    ltx,
    ltx2_tiny,
    mochi,
    qwenimage,
    qwenimage21,
    sd3,
    skyreels2,
    wan,
    zimage,
)  # noqa: E402
from accel.models.registry import FAMILIES  # noqa: E402
from variant_cases import picture  # noqa: E402
from test_pipeline_contract import NO_RELOAD  # noqa: E402


@dataclass(frozen=True)
class Case:
    """How to build, call and check one tiny family."""

    name: str
    build: Callable[[int], diffusers.DiffusionPipeline]
    pipeline_class: type
    call: dict[str, Any]
    output_attr: str
    output_shape: tuple[int, ...]
    # Transformer attributes holding each kind of repeated block (each needs >= 2 blocks).
    block_lists: tuple[str, ...]
    # Transformer calls per pipeline call: one per step, two with classifier-free guidance.
    transformer_calls: int
    # Shapes the transformer must see: image/video latents and text tokens.
    latent_shape: tuple[int, ...]
    text_shape: tuple[int, ...]
    components: tuple[str, ...] = field(default=())
    # Pipelines that encode each prompt at its own length (no padding): the negative call's text.
    negative_text_shape: tuple[int, ...] | None = None
    # Max-abs difference allowed after save and reload: weights are equal bit for bit, but loaded
    # tensors sit at other memory alignments, which sends some matmuls down another BLAS path.
    reload_tolerance: float = 0.0
    # The transformer's latent and text arguments; Z-Image's are lists with one tensor per sample.
    inputs: tuple[str, str] = ("hidden_states", "encoder_hidden_states")


CASES = {
    "flux": Case(
        name="flux",
        build=flux.build_tiny,
        pipeline_class=diffusers.FluxPipeline,
        call=dict(height=64, width=64, num_inference_steps=4, guidance_scale=3.5, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=4,
        latent_shape=(1, 16, 64),  # 64x64 -> 8x8 latents -> 4x4 packed tokens of 16*4 channels
        text_shape=(1, 512, 32),  # T5 padded to the pipeline's default max_sequence_length
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
    ),
    "wan": Case(
        name="wan",
        build=wan.build_tiny,
        pipeline_class=diffusers.WanPipeline,
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
        block_lists=("blocks",),
        transformer_calls=8,
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
    ),
    "skyreels2": Case(
        name="skyreels2",
        build=skyreels2.build_tiny,
        pipeline_class=diffusers.SkyReelsV2Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=6.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("blocks",),
        transformer_calls=8,  # cond and uncond: two calls per step, as Wan
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
    ),
    "hunyuan": Case(
        name="hunyuan",
        build=hunyuan.build_tiny,
        pipeline_class=diffusers.HunyuanVideoPipeline,
        call=dict(height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=6.0, output_type="np"),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=4,  # distilled guidance: one call per step (true CFG needs true_cfg_scale > 1)
        latent_shape=(1, 16, 2, 8, 8),  # 5 frames -> 2 latent frames, 64x64 -> 8x8
        text_shape=(1, 256, 32),  # Llama tokens after the template crop, padded to max_sequence_length
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
    ),
    "cogvideox": Case(
        name="cogvideox",
        build=cogvideox.build_tiny,
        pipeline_class=diffusers.CogVideoXPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=6.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # one batched (negative, positive) call per step
        latent_shape=(2, 3, 16, 8, 8),  # CFG batch of 2; 9 frames -> 3 latent frames, (F, C, H, W)
        text_shape=(2, 226, 32),  # T5 padded to the pipeline's default max_sequence_length
        components=("text_encoder", "transformer", "vae"),
    ),
    "mochi": Case(
        name="mochi",
        build=mochi.build_tiny,
        pipeline_class=diffusers.MochiPipeline,
        call=dict(height=64, width=64, num_frames=7, num_inference_steps=4, guidance_scale=4.5, output_type="np"),
        output_attr="frames",
        output_shape=(1, 7, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 12, 2, 8, 8),  # 7 frames -> 2 latent frames, 64x64 -> 8x8, 12 channels
        text_shape=(2, 256, 128),  # T5 padded to the pipeline's default max_sequence_length (256)
        components=("text_encoder", "transformer", "vae"),
    ),
    "ltx": Case(
        name="ltx",
        build=ltx.build_tiny,
        pipeline_class=diffusers.LTXPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=96,
            width=128,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=3.0,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 96, 128, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on a batch of two
        latent_shape=(2, 24, 16),  # 9 frames -> 2 latent frames, 96x128 -> 3x4: 24 packed tokens
        text_shape=(2, 128, 32),  # T5 padded to the pipeline's default max_sequence_length (128)
        components=("text_encoder", "transformer", "vae"),
    ),
    "qwenimage": Case(
        name="qwenimage",
        build=qwenimage.build_tiny,
        pipeline_class=diffusers.QwenImagePipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            true_cfg_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # true CFG: a second call per step for the negative prompt
        latent_shape=(1, 16, 64),  # 64x64 -> 8x8 latents -> 4x4 packed tokens of 16*4 channels
        text_shape=(1, 29, 32),  # the prompt's tokens after the 34-token template prefix, unpadded
        negative_text_shape=(1, 21, 32),
        reload_tolerance=1e-5,  # seen: 4e-7 (a batch-1 timestep Linear on an unaligned weight)
        components=("text_encoder", "transformer", "vae"),
    ),
    "qwenimage21": Case(
        name="qwenimage21",
        build=qwenimage21.build_tiny,
        pipeline_class=diffusers.QwenImage21Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            true_cfg_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 4),  # its VAE decodes RGBA
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # true CFG: a second call per step for the negative prompt
        latent_shape=(1, 16, 16),  # 64x64 -> 4x4 latents (16x VAE), unpatched: 16 tokens of 16 channels
        text_shape=(1, 37, 32),  # the user and assistant turns around the prompt (the system turn dropped), unpadded
        negative_text_shape=(1, 27, 32),
        reload_tolerance=1e-5,
        components=("text_encoder", "transformer", "vae"),
    ),
    "flux2-klein": Case(
        name="flux2-klein",
        build=flux2.build_tiny_klein,
        pipeline_class=diffusers.Flux2KleinPipeline,
        call=dict(height=64, width=64, num_inference_steps=4, guidance_scale=4.0, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=8,  # real CFG (a base model): a second call per step on the empty prompt
        latent_shape=(1, 16, 128),  # 64x64 -> 8x8 latents of 32 channels -> 4x4 packed tokens of 128
        text_shape=(1, 512, 24),  # Qwen3 hidden states 9, 18 and 27 stacked (3 x 8), padded to 512
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    "sd3": Case(
        name="sd3",
        build=sd3.build_tiny,
        pipeline_class=diffusers.StableDiffusion3Pipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            guidance_scale=3.5,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=4,  # CFG is batched: one call per step on [negative, positive]
        latent_shape=(2, 16, 8, 8),  # the pipeline hands over unpatchified latents
        text_shape=(2, 333, 64),  # 77 CLIP tokens (padded to T5's width) then 256 T5 tokens
        components=("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"),
    ),
    "flux2": Case(
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
    "zimage": Case(
        name="zimage",
        build=zimage.build_tiny,
        pipeline_class=diffusers.ZImagePipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_inference_steps=4,
            guidance_scale=4.0,
            output_type="np",
        ),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("layers", "noise_refiner", "context_refiner"),
        transformer_calls=4,  # CFG is batched: one call per step on [positive, negative]
        inputs=("x", "cap_feats"),
        latent_shape=((16, 1, 8, 8),) * 2,  # one (C, F, H, W) latent per sample
        text_shape=((41, 8), (27, 8)),  # each prompt's real tokens (chat framing included), unpadded
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    "hunyuan15": Case(
        name="hunyuan15",
        build=hunyuan15.build_tiny,
        pipeline_class=diffusers.HunyuanVideo15Pipeline,
        # The guider's scale (6.0 in the tiny pipeline) turns CFG on: no guidance keyword to pass.
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 5, 64, 64, 3),
        block_lists=("transformer_blocks",),
        transformer_calls=8,  # real CFG: the guider calls the transformer on the prompt, then the negative
        latent_shape=(1, 17, 2, 4, 4),  # noise, condition latents, mask; 5 frames -> 2, 64x64 -> 4x4 (16x)
        text_shape=(1, 1000, 32),  # Qwen tokens after the 108-token system prompt, padded to 1000
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    "kandinsky5": Case(
        name="kandinsky5",
        build=kandinsky5.build_tiny,
        pipeline_class=diffusers.Kandinsky5T2VPipeline,
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
        block_lists=("text_transformer_blocks", "visual_transformer_blocks"),
        transformer_calls=8,  # CFG: a positive and a negative call per step
        # (B, frames, H, W, C): 16 noise channels, 16 condition channels and a condition mask (visual_cond)
        latent_shape=(1, 2, 8, 8, 33),
        text_shape=(1, 25, 32),  # each prompt's Qwen tokens after the template's 128 are cropped, unpadded
        negative_text_shape=(1, 18, 32),
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
        # The processor rounds rotated queries and keys to bfloat16, which lifts BLAS-path differences.
        reload_tolerance=5e-5,
    ),
    "ltx2": Case(
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
    "chronoedit": Case(
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
    "hunyuanimage": Case(
        name="hunyuanimage",
        build=hunyuanimage.build_tiny,
        pipeline_class=diffusers.HunyuanImagePipeline,
        # The guider's scale (3.5, as the real checkpoint's) turns CFG on: no guidance keyword to pass.
        call=dict(negative_prompt="blurry, low quality", height=64, width=64, num_inference_steps=4, output_type="np"),
        output_attr="images",
        output_shape=(1, 64, 64, 3),
        block_lists=("transformer_blocks", "single_transformer_blocks"),
        transformer_calls=8,  # real CFG: the guider calls the transformer on the prompt, then the negative
        latent_shape=(1, 16, 2, 2),  # 64x64 -> 2x2 latents (32x); patch 1: the latent grid is the token grid
        text_shape=(1, 1000, 32),  # Qwen tokens after the 34-token system prompt, padded to 1000
        components=("text_encoder", "text_encoder_2", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    "helios": Case(
        name="helios",
        build=helios.build_tiny,
        pipeline_class=diffusers.HeliosPipeline,
        # Chunks of 2 latent frames (the tiny family's): 9 frames are two chunks of 5, the second
        # continuing the first's latents as history.
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=9,
            num_inference_steps=4,
            guidance_scale=5.0,
            num_latent_frames_per_chunk=helios.TINY_CHUNK,
            output_type="np",
        ),
        output_attr="frames",
        output_shape=(1, 9, 64, 64, 3),  # two 5-frame chunks, cut to 4k + 1
        block_lists=("blocks",),
        transformer_calls=16,  # cond and uncond per step, four steps per chunk
        latent_shape=(1, 16, 2, 8, 8),  # one chunk: 2 latent frames of 8x8 (the history goes in other arguments)
        text_shape=(1, 512, 32),
        components=("text_encoder", "transformer", "vae"),
        reload_tolerance=1e-5,
    ),
    "cosmos3": Case(
        name="cosmos3",
        build=cosmos3.build_tiny,
        pipeline_class=diffusers.Cosmos3OmniPipeline,
        call=dict(
            negative_prompt="blurry, low quality",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=4,
            guidance_scale=5.0,
            enable_sound=True,
            output_type="np",
        ),
        output_attr="video",
        output_shape=(5, 64, 64, 3),  # one sample, no batch dim
        block_lists=("layers",),
        transformer_calls=8,  # CFG: the prompt's call, then the negative's, each step
        latent_shape=((1, 16, 2, 8, 8),),  # one sample's latents: 5 frames -> 2 latent frames of 8x8
        text_shape=(86,),  # the chat-templated prompt's token ids, with the duration and resolution sentences
        negative_text_shape=(79,),
        components=("transformer", "vae", "sound_tokenizer"),
        reload_tolerance=1e-5,
        inputs=("vision_tokens", "input_ids"),
    ),
    "kandinsky6": Case(
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
}

PROMPT = "a red fox in the snow, photograph"


def generate(pipe: diffusers.DiffusionPipeline, case: Case, prompt: str = PROMPT, seed: int = 0) -> np.ndarray:
    out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), **case.call)
    return getattr(out, case.output_attr)


def state(pipe: diffusers.DiffusionPipeline, case: Case) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value for name in case.components for key, value in getattr(pipe, name).state_dict().items()
    }


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def pipe(case: Case) -> diffusers.DiffusionPipeline:
    pipe = case.build(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def baseline(pipe: diffusers.DiffusionPipeline, case: Case) -> np.ndarray:
    return generate(pipe, case)


def test_real_pipeline_classes_in_float32_eval_mode(pipe: diffusers.DiffusionPipeline, case: Case) -> None:
    assert type(pipe) is case.pipeline_class
    for name in case.components:
        module = getattr(pipe, name)
        assert all(p.dtype == torch.float32 for p in module.parameters()), name
        assert not any(m.training for m in module.modules()), f"{name} left in training mode"


def test_structure_has_repeated_blocks_and_heads(pipe: diffusers.DiffusionPipeline, case: Case) -> None:
    transformer = pipe.transformer
    for attr in case.block_lists:
        assert len(getattr(transformer, attr)) >= 2, attr
    assert FAMILIES[case.name].heads_in(transformer.config) >= 4


def test_same_seed_gives_identical_weights(case: Case) -> None:
    first, second, other = state(case.build(0), case), state(case.build(0), case), state(case.build(1), case)
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    differing = [k for k in first if not torch.equal(first[k], other[k])]
    # Every randomly initialised part of every component must depend on the seed.
    for name in case.components:
        assert any(k.startswith(f"{name}.") for k in differing), name


def test_build_leaves_caller_rng_and_dtype_alone(case: Case) -> None:
    rng_before = torch.random.get_rng_state()
    case.build(3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32


def test_output_shape_and_range(baseline: np.ndarray, case: Case) -> None:
    assert baseline.shape == case.output_shape
    assert baseline.dtype == np.float32
    assert np.isfinite(baseline).all()
    assert baseline.min() >= 0.0 and baseline.max() <= 1.0
    assert baseline.std() > 0.01, "output is flat: the decoder or denoiser is degenerate"


def test_output_is_bit_identical_across_calls_and_builds(
    pipe: diffusers.DiffusionPipeline, case: Case, baseline: np.ndarray
) -> None:
    assert np.array_equal(generate(pipe, case), baseline)
    fresh = case.build(0)
    fresh.set_progress_bar_config(disable=True)
    assert np.array_equal(generate(fresh, case), baseline)


def test_prompt_and_noise_seed_change_output(
    pipe: diffusers.DiffusionPipeline, case: Case, baseline: np.ndarray
) -> None:
    other_prompt = generate(pipe, case, prompt="a blue car on a road")
    assert np.abs(other_prompt - baseline).mean() > 1e-5
    other_noise = generate(pipe, case, seed=1)
    assert np.abs(other_noise - baseline).mean() > 1e-3


def _shape(value: Any) -> tuple[Any, ...]:
    """A tensor's shape, or a list's per-sample shapes (Z-Image)."""
    return tuple(tuple(item.shape) for item in value) if isinstance(value, list) else tuple(value.shape)


def test_text_and_latent_tokens_reach_the_transformer(pipe: diffusers.DiffusionPipeline, case: Case) -> None:
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def record(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        arguments = inspect.signature(pipe.transformer.forward).bind(*args, **kwargs).arguments
        seen.append(tuple(_shape(arguments[name]) for name in case.inputs))

    handle = pipe.transformer.register_forward_pre_hook(record, with_kwargs=True)
    try:
        generate(pipe, case)
    finally:
        handle.remove()
    if case.negative_text_shape is None:
        assert seen == [(case.latent_shape, case.text_shape)] * case.transformer_calls
    else:  # positive then negative call in every step
        assert seen == [(case.latent_shape, case.text_shape), (case.latent_shape, case.negative_text_shape)] * (
            case.transformer_calls // 2
        )


def test_short_max_sequence_length_runs(pipe: diffusers.DiffusionPipeline, case: Case) -> None:
    if "max_sequence_length" not in inspect.signature(type(pipe).__call__).parameters:
        pytest.skip(f"{type(pipe).__name__} pads its prompts to fixed lengths and takes no max_sequence_length")
    out = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(0), max_sequence_length=32, **case.call)
    assert getattr(out, case.output_attr).shape == case.output_shape


@pytest.mark.parametrize("loader", ["own_class", "DiffusionPipeline"])
def test_save_and_reload_is_bit_identical(
    pipe: diffusers.DiffusionPipeline,
    case: Case,
    baseline: np.ndarray,
    loader: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if case.name == "wan":
        # WanTransformer3DModel keeps some modules in float32, and diffusers then insists on
        # low_cpu_mem_usage loading, which needs accelerate.
        pytest.importorskip("accelerate", reason="diffusers needs accelerate to load WanTransformer3DModel")
    if case.name == "qwenimage21":
        pytest.skip(NO_RELOAD["qwenimage21"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe.save_pretrained(tmp_path)
    cls = case.pipeline_class if loader == "own_class" else diffusers.DiffusionPipeline
    loaded = cls.from_pretrained(tmp_path, local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded) is case.pipeline_class
    for name in ("tokenizer", "tokenizer_2"):
        if hasattr(pipe, name):
            text = "Héllo, wörld! 123 fox"
            assert getattr(loaded, name)(text).input_ids == getattr(pipe, name)(text).input_ids
            assert getattr(loaded, name).model_max_length == getattr(pipe, name).model_max_length
    before, after = state(pipe, case), state(loaded, case)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert np.abs(generate(loaded, case) - baseline).max() <= case.reload_tolerance
