"""Kandinsky 5.0 Video specifics the shared matrices do not show by themselves.

diffusers' Kandinsky 5 attention processor rounds the rotated queries and keys to bfloat16 even
in a float32 model. Context parallelism changes only the last bits before that rounding (a ring
merge order), which at the tiny model's settings moves its output by a few 1e-6 (a 1e-7 relative
change of its input moves one process's own output by 4e-6), so the shared cases hold to 1e-4.
Inductor's fused rotation changes those values systematically, so compile is held to 1e-4 with the
rotation kept in float32 (Float32RotaryProcessor, on the test's instance only), and with diffusers'
own processor to 2e-3, the size of the bfloat16 steps that fusion causes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import parallel_cases as cases
import pytest
import torch
import variant_cases
from cli_runs import accel_run
from family_parallel import reference


from accel.media import read_video
from accel.models.registry import FAMILIES
from accel.parallel.matching import glob_modules
import diffusers
from family_case import FakeCuda, FamilyCase, PROMPT, TinyCase
import block_cases
from torch import nn
from fakecuda import Grid, HEADS, Layout, randn
from accel.models import kandinsky5


# Kandinsky 5.0 T2V Lite's transformer (one text and two visual blocks): 28 heads of 64, Qwen2.5-VL-7B's 3584-wide text.
KANDINSKY5_LITE = dict(
    in_visual_dim=16,
    out_visual_dim=16,
    in_text_dim=3584,
    in_text_dim2=768,
    time_dim=512,
    patch_size=(1, 2, 2),
    model_dim=1792,
    ff_dim=7168,
    num_text_blocks=1,
    num_visual_blocks=2,
    axes_dims=(16, 24, 24),
    visual_cond=True,
)


def fake_inputs(config: dict[str, Any], grid: Grid, batch: int, t: torch.Tensor) -> dict[str, Any]:
    """(B, F, H, W, C) latents with the condition channels and mask; rotary positions per axis."""
    f, h, w, text = grid.frames, grid.rows, grid.cols, grid.text
    channels = 2 * config["in_visual_dim"] + 1 if config["visual_cond"] else config["in_visual_dim"]
    positions = [torch.arange(n, device="cuda") for n in (f, h, w)]
    return dict(
        hidden_states=randn(batch, f, 2 * h, 2 * w, channels),
        encoder_hidden_states=randn(batch, text, config["in_text_dim"]),
        timestep=t,
        pooled_projections=randn(batch, config["in_text_dim2"]),
        visual_rope_pos=positions,
        text_rope_pos=torch.arange(text, device="cuda"),
        return_dict=False,
    )


def fake_output_shape(config: dict[str, Any], grid: Grid, batch: int, prefill: bool) -> tuple[int, ...]:
    return (
        batch,
        grid.frames,
        2 * grid.rows,
        2 * grid.cols,
        config["out_visual_dim"],
    )  # (B, F, H, W, C), as its latents


def fake_overrides(config: dict[str, Any]) -> dict[str, Any]:
    # no head count in its config: the width over the head width (sum of axes_dims)
    return {"model_dim": HEADS * sum(config["axes_dims"]), "num_text_blocks": 1}


# -- kandinsky5: 2 text blocks, then 2 visual blocks over 2x4x4 = 32 video tokens (the cache's) --
def block_transformer() -> nn.Module:
    from diffusers import Kandinsky5Transformer3DModel

    from accel.models.kandinsky5 import random_modulation

    def build() -> nn.Module:
        model = Kandinsky5Transformer3DModel(
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
        )
        random_modulation(model)  # diffusers zeroes it: every block would be an identity
        return model

    return block_cases.seeded(21, build)


def block_inputs(drift: float) -> block_cases.Inputs:
    # (B, frames, H, W, C) latents; the rotary positions the pipeline builds from the latent grid.
    return dict(
        hidden_states=block_cases.latents((1, 2, 8, 8, 4), drift),
        encoder_hidden_states=block_cases.text(),
        timestep=torch.tensor([700.0 - 1000 * drift]),
        pooled_projections=block_cases.noise(torch.Generator().manual_seed(2), 1, 16),
        visual_rope_pos=[torch.arange(2), torch.arange(4), torch.arange(4)],
        text_rope_pos=torch.arange(block_cases.TEXT_TOKENS),
        return_dict=False,
    )


CASE = FamilyCase(
    dict(PROMPT, height=64, width=64, num_frames=5, num_inference_steps=4, guidance_scale=5.0),  # two calls per step
    odd=dict(height=64, width=80, num_frames=5),  # 2 latent frames x 4x5 patches = 40 video tokens
    threshold=0.2,
    tiny=TinyCase(
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
    fake=FakeCuda(
        inputs=fake_inputs,
        output_shape=fake_output_shape,
        overrides=fake_overrides,
        # Kandinsky 5.0 T2V Lite at 512x768, 121 frames: 31 x 32 x 48 = 47616 video tokens; CFG halves (two calls) x
        # Ulysses 4.
        real_config=KANDINSKY5_LITE,
        real_layout=Layout(world=8, ulysses=4, cfg=2, cache=True, grid=Grid(31, 32, 48, 256)),
    ),
    block_transformer=block_transformer,
    block_inputs=block_inputs,
)

TOLERANCE = 1e-4
FAMILY = FAMILIES["kandinsky5"]
FLOAT32_ROTARY = "parallel_cases:tiny_kandinsky5_float32_rotary"


def test_every_kandinsky5_pipeline_is_a_variant_or_named() -> None:
    shipped = variant_cases.diffusers_pipelines_of(FAMILY.transformer_class)
    assert shipped - set(FAMILY.pipeline_classes) - set(variant_cases.NEEDS_MORE) == set()
    assert set(FAMILY.pipeline_classes) <= shipped


def test_the_prompt_reaches_the_transformer_without_the_template() -> None:
    """The pipeline crops 128 tokens of its prompt template; the tiny tokenizer spends exactly those on
    it, so the text the transformer sees is the prompt and the closing <|im_end|>."""
    pipe = cases.tiny_pipeline("tiny-kandinsky5")
    ids = pipe.tokenizer(pipe.prompt_template.format("a red fox")).input_ids
    assert pipe.prompt_template_encode_start_idx == 128
    assert pipe.tokenizer.decode(ids[128:]) == "a red fox<|im_end|>"
    embeds, cu_seqlens = pipe._encode_prompt_qwen(["a red fox"], device=torch.device("cpu"))
    assert cu_seqlens.tolist() == [0, len(ids) - 128] and embeds.shape[1] == len(ids) - 128


def test_the_output_is_gathered_after_the_last_visual_block() -> None:
    """A negative index in a plan's module pattern counts from the end of its list."""
    modules = dict(cases.tiny_pipeline("tiny-kandinsky5").transformer.named_modules())
    assert glob_modules(modules, "visual_transformer_blocks.-1") == [modules["visual_transformer_blocks.1"]]
    assert glob_modules(modules, "visual_transformer_blocks.-2") == [modules["visual_transformer_blocks.0"]]
    assert glob_modules(modules, "visual_transformer_blocks.-3") == []


def test_image_to_video_equals_one_process(rank_pools: Any) -> None:
    """Kandinsky5I2VPipeline puts the picture's latents in the first latent frame (and its condition
    channels): the same tokens, split the same way; CFG halves x Ulysses 2 with the cache. 17 frames
    (5 latent frames, 80 tokens): the pipeline renormalises the first 4 latent frames against the
    ones after them, and with fewer its own output is NaN."""
    call = dict(CASE.call, num_frames=17, num_inference_steps=8)
    recipe = {"cache": {"threshold": CASE.threshold}}
    expected, skipped, _ = variant_cases.variant_run("kandinsky5", "Kandinsky5I2VPipeline", recipe, call)
    assert np.isfinite(expected).all() and skipped > 0
    runs = rank_pools(4).run(
        variant_cases.variant_run,
        "kandinsky5",
        "Kandinsky5I2VPipeline",
        {**recipe, "parallel": {"cfg": 2, "ulysses": 2}},
        call,
    )
    assert runs[0][1] + runs[-1][1] == skipped  # each CFG half caches its own branch's calls
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_parallel_vae_decode_equals_one_process(rank_pools: Any) -> None:
    """HunyuanVideo's VAE, split over 2 ranks (rank 0 gets the pixels)."""
    expected, _ = reference("kandinsky5", CASE.call)
    lead, other = (
        run[0] for run in rank_pools(2).run(cases.tiny_run, "tiny-kandinsky5", {"vae": {"parallel": True}}, CASE.call)
    )
    assert np.abs(lead - expected).max() <= TOLERANCE


def test_nabla_sparse_attention_is_refused_with_one_line(rank_pools: Any) -> None:
    errors = rank_pools(2).run(
        cases.tiny_error, "parallel_cases:tiny_kandinsky5_nabla", {"parallel": {"ulysses": 2}}, CASE.call
    )
    assert (
        errors
        == [
            "NotAvailableError: context parallelism: Kandinsky5Transformer3DModel with attention_type = 'nabla' "
            "(NABLA sparse "
            "attention, a block mask over the whole sequence) cannot be split over ranks; run it on one process"
        ]
        * 2
    )


def test_regional_compile_equals_eager() -> None:
    """Both block kinds compile, a second generation builds no graph, and with the rotation in float32
    the compiled output equals eager within 1e-4 (with diffusers' bfloat16 rounding of q and k,
    inductor's fused rotation moves it by about 5e-4, held to 2e-3)."""
    call = dict(CASE.call, num_inference_steps=2)
    for model, tolerance in ((FLOAT32_ROTARY, TOLERANCE), ("tiny-kandinsky5", 2e-3)):
        eager, _, _ = cases.tiny_run(model, {}, call)
        compiled, _, graphs = cases.counted_run(model, {"compile": {"enabled": True}}, call)
        assert np.abs(compiled - eager).max() <= tolerance, model
        assert graphs[1] == 0


def test_image_to_video_from_the_command_line(tmp_path: Path) -> None:
    image = tmp_path / "in.png"
    variant_cases.picture((64, 64)).save(image)
    out = tmp_path / "clip.mp4"
    result = accel_run(
        *["tiny-kandinsky5", "--pipeline", "Kandinsky5I2VPipeline", "--image", str(image), "--frames", "17"],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    frames = read_video(out)
    assert frames.shape == (17, 64, 64, 3) and frames.std() > 1


# -- the Image Lite pipelines: a video family's variants that make pictures ---------------------------
T2I, I2I = "Kandinsky5T2IPipeline", "Kandinsky5I2IPipeline"


def test_image_lite_heads_follow_the_width_over_the_head_width() -> None:
    """Image Lite states no head count either: 2560 wide over heads of 32 + 48 + 48 is 20 (the tiny: 4)."""
    assert FAMILY.heads_in({"model_dim": 2560, "axes_dims": [32, 48, 48]}) == 20
    for pipeline_class in (T2I, I2I):
        transformer = variant_cases.variant_pipeline("kandinsky5", pipeline_class).transformer
        assert FAMILY.heads_in(transformer.config) == FAMILY.tiny_heads == 4


@pytest.mark.parametrize(
    "pipeline_class, crop, rest",
    [(T2I, 40, "a red fox<|im_end|>"), (I2I, 54, "a red fox<|vision_start|><|image_pad|><|vision_end|><|im_end|>")],
)
def test_the_image_pipelines_crop_exactly_their_template_prefix(pipeline_class: str, crop: int, rest: str) -> None:
    """The tiny tokenizers spend on each template's system part as many tokens as the pipeline crops."""
    pipe = variant_cases.variant_pipeline("kandinsky5", pipeline_class)
    tokenizer = getattr(pipe.tokenizer, "tokenizer", pipe.tokenizer)  # I2I's is a Qwen2-VL processor
    ids = tokenizer(pipe.prompt_template.format("a red fox")).input_ids
    assert pipe.prompt_template_encode_start_idx == crop
    assert tokenizer.decode(ids[crop:]) == rest


def test_image_variants_make_pictures_without_a_frame_count() -> None:
    """The variant's output kind, not the family's: no num_frames in the call, a frame count or an
    .mp4 refused in one line naming the pipeline, and the pipelines' own 1024² example as real defaults."""
    from accel.errors import UserError
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs
    from accel.models.variants import made_by
    from accel.outputs import check_out

    recipe = Recipe.from_dict({"model": {"pipeline": T2I}})
    assert generation_kwargs(FAMILY, False, recipe) == {
        "prompt": "a red fox in the snow, photograph",
        "num_inference_steps": 50,
        "height": 1024,
        "width": 1024,
        "guidance_scale": 3.5,
    }
    assert "num_frames" not in generation_kwargs(FAMILY, True, recipe)
    with pytest.raises(UserError, match=r"^\[generate\] frames: Kandinsky5T2IPipeline makes images; remove frames$"):
        generation_kwargs(FAMILY, True, Recipe.from_dict({"model": {"pipeline": T2I}, "generate": {"frames": 5}}))
    assert made_by(FAMILY, I2I) == (I2I, "image") and made_by(FAMILY, "Kandinsky5I2VPipeline") == (
        "Kandinsky 5.0 Video",
        "video",
    )
    with pytest.raises(
        UserError, match=r"^--out x.mp4: Kandinsky5I2IPipeline makes images, so the name must end in .png$"
    ):
        check_out(Path("x.mp4"), False, made_by(FAMILY, I2I))


def test_image_variants_decode_with_flux_vae_split_over_ranks(rank_pools: Any) -> None:
    """The parallel decode picks AutoencoderKL's plan (FLUX.1's) from the variant's VAE; split over 2
    ranks, the picture (rank 0's) equals one process."""
    from accel.models.vaes import VAE_PLANS

    assert "vae: patch-parallel" in __import__("accel.report", fromlist=["family_features"]).family_features(FAMILY)
    assert FAMILY.vaes == ("AutoencoderKLHunyuanVideo", "AutoencoderKL") and "AutoencoderKL" in VAE_PLANS
    call = dict(CASE.call, width=80, num_inference_steps=2)
    expected, _, _ = variant_cases.variant_run("kandinsky5", T2I, {}, call)
    lead, _ = (
        run[0]
        for run in rank_pools(2).run(variant_cases.variant_run, "kandinsky5", T2I, {"vae": {"parallel": True}}, call)
    )
    assert lead.shape == expected.shape == (1, 64, 80, 3)
    assert np.abs(lead - expected).max() <= TOLERANCE


def test_image_to_image_from_the_command_line_writes_the_picture(tmp_path: Path) -> None:
    """`accel run tiny-kandinsky5 --pipeline Kandinsky5I2IPipeline --image …` writes a PNG equal to
    the library call on the same picture."""
    from PIL import Image

    image = tmp_path / "in.png"
    variant_cases.picture((64, 64)).save(image)
    out = tmp_path / "picture.png"
    result = accel_run(
        *["tiny-kandinsky5", "--pipeline", I2I, "--image", str(image)],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    call = dict(
        prompt="a red fox in the snow, photograph", height=64, width=64, num_inference_steps=2, guidance_scale=5.0
    )  # tiny defaults
    expected = variant_cases.variant_run("kandinsky5", I2I, {}, call)[0][0]
    assert Image.open(out).size == (64, 64)
    assert np.abs(np.asarray(Image.open(out), dtype=np.float32) - np.round(expected * 255)).max() <= 1


def test_a_saved_image_pipeline_is_known_to_make_pictures_before_loading(tmp_path: Path) -> None:
    """A folder's model_index.json names its pipeline class: the --out suffix and the settings are
    checked against the picture it makes before any load, as for the registry's aliases."""
    from accel.errors import UserError
    from accel.models.loading import resolve_model
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs
    from accel.runner import run

    variant_cases.variant_pipeline("kandinsky5", T2I).save_pretrained(tmp_path / "t2i")
    ref = resolve_model(str(tmp_path / "t2i"))
    assert (ref.family, ref.pipeline) == (FAMILY, T2I)
    assert "num_frames" not in generation_kwargs(FAMILY, False, Recipe.from_dict({}), loads_as=ref.pipeline)
    with pytest.raises(
        UserError, match=r"^--out .*x\.mp4: Kandinsky5T2IPipeline makes images, so the name must end in \.png$"
    ):
        run(Recipe.from_dict({"model": {"name": str(tmp_path / "t2i")}}), out=tmp_path / "x.mp4")
