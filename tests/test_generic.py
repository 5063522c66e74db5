"""Pipelines no accel family describes, accelerated through the generic path (accel/models/generic.py,
issue 34): the record learned from the model (blocks, what they return, where streams are joined,
call defaults from the signature), the cache and compile on it equal to what they must be, accel run
on a saved folder, and context parallelism refused in one line until the automatic plan.

Chroma (FLUX-like: double blocks, then single blocks on text and image concatenated) and PixArt-Sigma
(one list of BasicTransformerBlock, cross-attention) are built tiny here from their diffusers classes,
with the tiny T5 and VAEs accel's families use.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach a model hub

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import diffusers  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import accel  # noqa: E402
from accel.cli import app  # noqa: E402
from accel.errors import NotAvailableError  # noqa: E402
from accel.models import _tiny_parts as parts  # noqa: E402
from accel.models.base import BlockList, GenerationDefaults  # noqa: E402
from accel.models.registry import family_of  # noqa: E402
from accel.parallel.plan import plan_of  # noqa: E402
from accel.quality import psnr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

STEPS = 4


def tiny_chroma() -> Any:
    tokenizer = parts.t5_tokenizer()
    encoder = parts.t5_encoder(tokenizer, 1)
    with parts.seeded(2):
        vae = parts.finish(parts.flux1_vae())
        transformer = parts.finish(diffusers.ChromaTransformer2DModel(
            in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=parts.T5_HIDDEN, axes_dims_rope=(4, 6, 6), approximator_num_channels=16,
            approximator_hidden_dim=32, approximator_layers=2))
    return diffusers.ChromaPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder,
                                    tokenizer=tokenizer, transformer=transformer)


def tiny_pixart_sigma() -> Any:
    tokenizer = parts.t5_tokenizer()
    encoder = parts.t5_encoder(tokenizer, 1)
    with parts.seeded(2):
        vae = parts.finish(diffusers.AutoencoderKL(
            block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            latent_channels=4, norm_num_groups=4, layers_per_block=1, sample_size=32))
        transformer = parts.finish(diffusers.PixArtTransformer2DModel(
            num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=3, cross_attention_dim=16,
            caption_channels=parts.T5_HIDDEN, sample_size=32, norm_num_groups=4))
    return diffusers.PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae, transformer=transformer,
                                         scheduler=diffusers.DPMSolverMultistepScheduler())


BUILDERS = {"chroma": tiny_chroma, "pixart": tiny_pixart_sigma}
_PIPES: dict[str, Any] = {}


def pipeline(name: str) -> Any:
    if name not in _PIPES:
        pipe = BUILDERS[name]()
        pipe.set_progress_bar_config(disable=True)
        _PIPES[name] = pipe
    return _PIPES[name]


def generate(pipe: Any) -> np.ndarray:
    extra = {"use_resolution_binning": False} if isinstance(pipe, diffusers.PixArtSigmaPipeline) else {}
    return pipe(prompt="a red fox", num_inference_steps=STEPS, height=64, width=64, output_type="np",
                generator=torch.Generator().manual_seed(0), **extra).images


def test_the_record_is_learned_from_the_model() -> None:
    chroma = family_of(pipeline("chroma"))
    assert (chroma.learned, chroma.title, chroma.transformer_class, chroma.output) == (
        True, "ChromaPipeline", "ChromaTransformer2DModel", "image")
    # The single blocks run on text then image in one tensor: seen in the probe call, not declared anywhere.
    assert chroma.blocks == (
        BlockList("transformer_blocks", returns=("encoder_hidden_states", "hidden_states")),
        BlockList("single_transformer_blocks", returns=("hidden_states",), joins=("encoder_hidden_states", "hidden_states")))
    assert chroma.primary_stream == "hidden_states" and chroma.heads == 2 and chroma.vae == "AutoencoderKL"
    # ChromaPipeline.__call__'s own defaults (35 steps, guidance 5.0); no size in its signature: 1024².
    assert chroma.defaults == GenerationDefaults(steps=35, height=1024, width=1024, guidance_scale=5.0)
    pixart = family_of(pipeline("pixart"))
    assert pixart.blocks == (BlockList("transformer_blocks", returns=("hidden_states",)),)
    assert (pixart.defaults.steps, pixart.defaults.guidance_scale, pixart.name) == (20, 4.5, "pix-art-sigma")
    assert family_of(pipeline("chroma")) is chroma  # learned once per process


@pytest.mark.parametrize("name", ["chroma", "pixart"])
def test_the_cache_skips_after_warmup_and_off_is_the_reference(name: str) -> None:
    pipe = pipeline(name)
    reference = generate(pipe)
    handle = accel.apply(pipe, {"cache": {"threshold": 1e9, "warmup_steps": 1}})
    try:
        cached = generate(pipe)
        records = [record.cached for record in handle.cache_stats.records]
    finally:
        handle.remove()
    calls = len(records) // STEPS  # Chroma runs guidance as two transformer calls a step
    assert records == [False] * calls + [True] * (len(records) - calls)
    assert not np.array_equal(cached, reference), "skipping blocks must change the output"
    np.testing.assert_array_equal(generate(pipe), reference)  # remove() restores the eager blocks


def test_regional_compile_equals_eager() -> None:
    pipe = pipeline("chroma")
    reference = generate(pipe)
    handle = accel.apply(pipe, {"compile": {"enabled": True}})
    try:
        compiled = generate(pipe)
        assert len(handle.compiled[0].modules) == 5  # both lists' blocks
    finally:
        handle.remove()
    np.testing.assert_allclose(compiled, reference, atol=1e-4, rtol=0)


def test_quantization_applies_to_the_blocks() -> None:
    pipe = BUILDERS["pixart"]()  # quantization replaces weights for good: a pipeline of its own
    pipe.set_progress_bar_config(disable=True)
    reference = generate(pipe)
    handle = accel.apply(pipe, {"quant": {"type": "int8wo"}})
    assert handle.quant.quantized
    assert psnr(generate(pipe), reference) >= 40.0


def test_context_parallelism_is_refused_in_one_line() -> None:
    with pytest.raises(NotAvailableError) as refused:
        plan_of(family_of(pipeline("pixart")), "--ulysses")
    assert str(refused.value) == (
        "--ulysses: PixArtSigmaPipeline is not a family accel was taught, and context parallelism for it waits on the "
        "automatic plan; run it on one process (cache, quantization and compile apply)")
    assert family_of(pipeline("pixart")).cfg_off({"guidance_scale": 4.5}) == (
        "accel has not learned how PixArtSigmaPipeline runs classifier-free guidance (no family describes it)")


def test_accel_run_takes_a_saved_folder_of_an_unknown_pipeline(tmp_path: Path) -> None:
    pipeline("chroma").save_pretrained(tmp_path / "chroma")
    out = tmp_path / "fox.png"
    result = CliRunner().invoke(app, ["run", str(tmp_path / "chroma"), "--steps", "3", "--height", "64", "--width", "64",
                                      "--cache", "0.1", "--dtype", "float32", "--out", str(out)],
                                env={"COLUMNS": "200"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with Image.open(out) as image:
        assert image.size == (64, 64)
