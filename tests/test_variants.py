"""Every pipeline of a supported transformer: the variants each family lists run with every
accelerator and equal one process; `--pipeline`, `--image`, `--mask` and `--video` through the CLI;
and the variant lists stay in step with the pipelines diffusers ships, for image and video families."""

from __future__ import annotations

from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
import variant_cases as cases
from PIL import Image
from cli_runs import accel_run
from families import FAMILY_CASES
from family_parallel import by_world
from typer.testing import CliRunner

from accel.cli import app
from accel.media import read_video
from accel.models.registry import FAMILIES
from accel.models.input_files import condition_object
from accel.models.variants import variant_of
from accel.models.call import guided_by_guider

TOLERANCE = 1e-4


def transformer_classes_of(family: str) -> list[str]:
    """The family's transformer class and its variants' own (Wan VACE's)."""
    return list(FAMILIES[family].transformer_classes)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_diffusers_pipeline_of_the_transformer_is_a_variant_or_named(family: str) -> None:
    """Image and video families alike, for every transformer class the family recognises."""
    classes = set(transformer_classes_of(family))
    shipped = set().union(*(cases.diffusers_pipelines_of(name) for name in classes))
    listed = {
        name
        for other in FAMILIES.values()
        if classes & set(other.transformer_classes)
        for name in other.pipeline_classes
    }
    assert FAMILIES[family].pipeline_class in shipped
    assert shipped - listed - set(cases.NEEDS_MORE) == set(), (
        "add these to the family's variants (or say what they need)"
    )
    assert listed <= shipped


def test_the_video_rule_sees_union_annotations_and_variant_transformers() -> None:
    """WanPipeline annotates its transformer `WanTransformer3DModel | None`; VACE has its own class."""
    assert {"WanPipeline", "LucyEditPipeline", "WanImageToVideoPipeline"} <= cases.diffusers_pipelines_of(
        "WanTransformer3DModel"
    )
    assert "WanVACEPipeline" not in cases.diffusers_pipelines_of("WanTransformer3DModel")
    assert cases.diffusers_pipelines_of("WanVACETransformer3DModel") == {"WanVACEPipeline"}


# A family's own pipeline listed among its variants only gains an optional input (FLUX.2's reference
# pictures): tests/test_family_flux2.py splits those.
# Variants sequence parallelism cannot cut (Flux2KleinKVPipeline) are tested on their own below; Wan
# Animate's split (its face adapter by latent frame, two segments, replace mode) in its own file.
OWN_FILE = {"WanAnimatePipeline": "tests/test_family_wan_animate.py"}
VARIANTS = [
    (name, variant.pipeline_class)
    for name in FAMILIES
    for variant in FAMILIES[name].variants
    if variant.pipeline_class != FAMILIES[name].pipeline_class
    and not variant.not_split
    and variant.pipeline_class not in OWN_FILE
]
MODES = {
    "ulysses2": ({"ulysses": 2}, False, False),
    "ring3, odd size": ({"ring": 3}, True, False),
    "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, False, True),
    "ulysses2 + cache": ({"ulysses": 2}, False, True),
}


# Qwen-Image's edit pipelines encode the input picture at one megapixel whatever the output size
# (4096 reference tokens, seconds per call on a CPU rank): one mode each, a different one per variant.
ONE_MODE = {
    "QwenImageEditPipeline": "cfg2 x ulysses2 + cache",
    "QwenImageEditPlusPipeline": "ring3, odd size",
    "QwenImageEditInpaintPipeline": "ulysses2",
    # HunyuanVideo 1.5 image-to-video: the guider's two calls a step on CFG halves, Ulysses in each, the cache.
    "HunyuanVideo15ImageToVideoPipeline": "cfg2 x ulysses2 + cache",
    # Same transformer calls as a variant the whole matrix covers (SkyReels-V2 diffusion forcing;
    # CogVideoX I2V's channel-concatenated condition, batched for CFG): the odd size on Ring 3.
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline": "ring3, odd size",
    "CogVideoXFunControlPipeline": "ring3, odd size",
    # LTX-2's keyframes: a first-frame one and an appended one, in the odd-size case.
    "LTX2ConditionPipeline": "ring3, odd size",
    "LTX2InContextPipeline": "ring3, odd size",
}


# Pipelines built to hold a guider whose checkpoints are guidance-distilled and hold none: one
# transformer call per step, the scale embedded (HunyuanImage 2.1's refiner, as diffusers runs it).
DISTILLED = {"HunyuanImageRefinerPipeline"}


def modes_of(family: str, pipeline_class: str) -> list[str]:
    """Ring 3 at the odd size, and the cache on CFG halves x Ulysses 2 where the variant runs real CFG
    (FluxFillPipeline has no true CFG), else the cache on Ulysses 2. Ulysses 2 without the cache is not
    run apart: the calls the cache computes (the first steps always) run every block through the same
    split, and the output is compared with one process's there too (as for the families' matrix)."""
    if pipeline_class in ONE_MODE:
        return [ONE_MODE[pipeline_class]]
    real_cfg = FAMILIES[family].cfg_scale in cases.call_parameters(pipeline_class) or (
        guided_by_guider(getattr(diffusers, pipeline_class)) and pipeline_class not in DISTILLED
    )
    cached = "cfg2 x ulysses2 + cache" if real_cfg else "ulysses2 + cache"
    return ["ring3, odd size", cached]


CASES = by_world(
    [(family, variant, mode) for family, variant in VARIANTS for mode in modes_of(family, variant)],
    lambda case: MODES[case[2]][0],
)

_references: dict[tuple[str, str, bool, bool], np.ndarray] = {}

# Video variants' odd size: a video token count that 3, 4 and 8 ranks do not divide. 17 frames at
# 80x112 make 5 latent frames of 5x7 patches, 175 tokens; VACE puts its reference picture's latent
# frame before the video's, so 13 frames make (4 + 1) x 5x7 = 175 too. CogVideoX's VAE compresses
# as Wan's (4x in time, 8x in space, 2x2 patches): the same 175 video tokens.
_ODD_VIDEO = dict(height=80, width=112, num_frames=17)
ODD = {
    "WanImageToVideoPipeline": _ODD_VIDEO,
    "WanVideoToVideoPipeline": _ODD_VIDEO,
    "LucyEditPipeline": _ODD_VIDEO,
    "WanVACEPipeline": dict(_ODD_VIDEO, num_frames=13),
    "Kandinsky5I2VPipeline": _ODD_VIDEO,
    "CogVideoXVideoToVideoPipeline": _ODD_VIDEO,
    "CogVideoXFunControlPipeline": _ODD_VIDEO,
    # LTX-Video and LTX-2 compress 32x in space and 8x in time, patch size 1: 2 latent frames of 5x7 = 70 tokens.
    "LTXImageToVideoPipeline": dict(height=160, width=224, num_frames=9),
    "LTX2ImageToVideoPipeline": dict(height=160, width=224, num_frames=9),
    # Its keyframe at the last latent frame joins as 5x7 extra tokens: 25 frames, (4 + 1) x 35 = 175.
    "LTX2ConditionPipeline": dict(height=160, width=224, num_frames=25),
    # IC-LoRA: 2 latent frames of video, the last one's keyframe and a 2-frame reference clip, 70 + 35 + 70 = 175.
    "LTX2InContextPipeline": dict(height=160, width=224, num_frames=9),
    # HDR: 3 latent frames of video and a 9-frame reference clip's 2 (the pipeline cuts a reference to
    # the video's length, so the reference is the shorter), (3 + 2) x 5x7 = 175 tokens.
    "LTX2HDRPipeline": dict(
        height=160,
        width=224,
        num_frames=17,
        reference_conditions=[
            condition_object(
                variant_of(FAMILIES["ltx2"], "LTX2HDRPipeline").references, cases.clip((224, 160), 9), 0, 1.0, tiny=True
            )
        ],
    ),
    # LTX-2.5 DFR pads 33 frames to no more (one 32-frame segment): 5 latent frames, the last one's keyframe
    # and one generated slot, (5 + 1 + 1) x 35 = 245 tokens.
    "LTX2DFRPipeline": dict(height=160, width=224, num_frames=33),
    # Its refine round on that pass: 65 frames, one tile of 9 latent frames, its seam keyframe and a new
    # slot, (9 + 1 + 1) x 35 = 385 tokens.
    "LTX2DFRTemporalRefinePipeline": dict(height=160, width=224, num_frames=33),
    # LTX's condition pipeline puts the picture's latent frame (at frame_index 8) before the video's:
    # 25 frames make 4 latent frames, so (1 + 4) x 5x7 = 175 tokens.
    "LTXConditionPipeline": dict(height=160, width=224, num_frames=25),
    # Two windows of 175 tokens: 6 latent frames in windows of 4 overlapping by 1; the first is 4 frames and
    # the picture's, the second 3, the first window's tail and the picture's: 5 x 5x7 each.
    "LTXI2VLongMultiPromptPipeline": dict(height=160, width=224, num_frames=41),
    # CogVideoX 1.5 patches latent frames in pairs: 9 frames make 3 latent frames, padded to 4 by the
    # pipeline (the picture's frame repeated, dropped before decoding): 2 x 5x7 = 70 tokens.
    "CogVideoXImageToVideoPipeline": dict(_ODD_VIDEO, num_frames=9),
    # Kandinsky 5's image pipelines: one latent frame of 5x7 patches at 80x112, 35 tokens.
    "Kandinsky5T2IPipeline": dict(height=80, width=112),
    "Kandinsky5I2IPipeline": dict(height=80, width=112),
    # HunyuanVideo's VAE compresses as Wan's, 2x2 patches: 5 frames make 2 latent frames of 5x7 = 70 tokens.
    "HunyuanSkyreelsImageToVideoPipeline": dict(height=80, width=112, num_frames=5),
    "HunyuanVideoImageToVideoPipeline": dict(height=80, width=112, num_frames=5),
    # Helios's pyramid: two chunks at 64x192 (its stages need sides in multiples of 64 px, see NO_ODD_TOKENS).
    "HeliosPyramidPipeline": dict(height=64, width=192, num_frames=9),
}
# Variants whose odd size cannot make token counts 3 does not divide, and why. Their padding is tested
# in their family's file (tests/test_family_helios.py: the pyramid on 4 ranks).
NO_ODD_TOKENS = {
    "HeliosPyramidPipeline": "its stages at a quarter, half and the whole latent size need sides in multiples "
    "of 64 px, where each stage's tokens (42, 48 and 72 per 64x64 tile, history included) are multiples of 6"
}
# Calls a variant needs beyond its family's: Kandinsky 5's image-to-video renormalises its first
# four latent frames against later ones, so it needs 17 frames (5 latent frames) or more.
# SkyReels-V2's video extension continues the clip's last `overlap_history` frames, which must be
# fewer latent frames than it generates: 5 frames (2 latent) before 9 new ones (3 latent).
VARIANT_CALL = {
    "Kandinsky5I2VPipeline": dict(num_frames=17),
    "SkyReelsV2DiffusionForcingVideoToVideoPipeline": dict(num_frames=9, overlap_history=5),
    # LTX's condition pipeline: the picture (no clip, no condition objects) at frame 8, so its tokens join the sequence.
    "LTXConditionPipeline": dict(conditions=None, video=None, frame_index=8, strength=0.9),
    # The long multi-prompt pipeline: two windows (of 32 frames overlapping by 8), a prompt each;
    # one decode tile (its default 4 x 4 tiles of a 3x4 latent overlap wholly).
    "LTXI2VLongMultiPromptPipeline": dict(
        prompt="a red fox in the snow | a white owl in a tree",
        num_frames=41,
        temporal_tile_size=32,
        temporal_overlap=8,
        decode_horizontal_tiles=1,
        decode_vertical_tiles=1,
    ),
    # Helios's pyramid from text (its picture and clip inputs are the base pipeline's, tested there).
    "HeliosPyramidPipeline": dict(image=None, video=None),
}
# Cache thresholds a variant needs instead of its family's, so that its cached run skips some calls
# (SkyReels-V1's 32-channel transformer changes block 0's residual by over 0.3 a step: 6 of 8 calls
# cached at 0.5, none at 0.3). The others: just above the first change their one-process run
# measures (Qwen-Image img2img 0.54, inpaint 0.59; FLUX.2 klein inpaint 1.02; SD3 inpaint 0.55 at
# its third step; HunyuanVideo 1.5 I2V 0.45), where the family's threshold cached none of their calls.
VARIANT_THRESHOLD = {
    "HunyuanSkyreelsImageToVideoPipeline": 0.5,
    "QwenImageImg2ImgPipeline": 0.56,
    "QwenImageInpaintPipeline": 0.62,
    "Flux2KleinInpaintPipeline": 1.06,
    "StableDiffusion3InpaintPipeline": 0.6,
    "HunyuanVideo15ImageToVideoPipeline": 0.46,
}


HY_I2V = "HunyuanVideoImageToVideoPipeline"


def odd_call(family: str, pipeline_class: str) -> dict:
    case = FAMILY_CASES[family]
    return {**case.call, **VARIANT_CALL.get(pipeline_class, {}), **case.odd, **ODD.get(pipeline_class, {})}


def reference(family: str, pipeline_class: str, odd: bool, cache: bool) -> tuple[dict, dict, np.ndarray, int]:
    case = FAMILY_CASES[family]
    call = odd_call(family, pipeline_class) if odd else {**case.call, **VARIANT_CALL.get(pipeline_class, {})}
    recipe = {"cache": {"threshold": VARIANT_THRESHOLD.get(pipeline_class, case.threshold)}} if cache else {}
    key = (family, pipeline_class, odd, cache)
    if key not in _references:
        _references[key] = cases.variant_run(family, pipeline_class, recipe, call)[:2]
    output, skipped = _references[key]
    return call, recipe, output, skipped


@pytest.mark.parametrize("family, pipeline_class, mode", CASES)
def test_variant_equals_one_process(rank_pools, family: str, pipeline_class: str, mode: str) -> None:
    parallel, odd, cache = MODES[mode]
    call, recipe, expected, skipped = reference(family, pipeline_class, odd, cache)
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1) * parallel.get("cfg", 1)
    if cache:
        assert skipped > 0, "the cached run skipped no call: raise the variant's VARIANT_THRESHOLD"
    runs = rank_pools(world).run(cases.variant_run, family, pipeline_class, {**recipe, "parallel": parallel}, call)
    if parallel.get("cfg", 1) > 1 and FAMILIES[family].cfg == "calls":  # each half caches its own branch's calls
        assert runs[0][1] + runs[-1][1] == skipped
    else:
        assert [run[1] for run in runs] == [skipped] * world
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0
        assert output.shape == expected.shape
        assert (
            np.abs(
                cases.as_decoded(output, family, pipeline_class) - cases.as_decoded(expected, family, pipeline_class)
            ).max()
            <= TOLERANCE
        )


def test_kontext_reference_tokens_join_the_split_image_sequence() -> None:
    """Kontext hands the transformer the generated tokens and then the reference image's: one image
    stream, longer than the output's (which the split above cuts and gathers whole)."""
    pipe = cases.variant_pipeline("flux", "FluxKontextPipeline")
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        cases.variant_run("flux", "FluxKontextPipeline", {}, dict(FAMILY_CASES["flux"].call, height=48, width=80))
    finally:
        hook.remove()
    assert set(seen) == {2 * 15}  # 3x5 generated tokens, then the 3x5 of the reference picture


# The video families' variants whose cases above include the odd size (HunyuanVideo 1.5's image-to-video
# runs one mode), Kandinsky 5's image pipelines among them.
VIDEO_VARIANTS = [
    (family, pipeline_class)
    for family, pipeline_class in VARIANTS
    if FAMILIES[family].output == "video"
    and "ring3, odd size" in modes_of(family, pipeline_class)
    and pipeline_class not in NO_ODD_TOKENS
]


@pytest.mark.parametrize("family, pipeline_class", VIDEO_VARIANTS)
def test_video_variants_odd_size_makes_a_token_count_three_ranks_do_not_divide(
    family: str, pipeline_class: str
) -> None:
    """The ring-3 case above runs a video token count 3 does not divide (nor 4, nor 8)."""
    pipe = cases.variant_pipeline(family, pipeline_class)
    seen: list[int] = []
    first = getattr(pipe.transformer, FAMILIES[family].blocks[0].attr)[0]
    hook = first.register_forward_pre_hook(
        lambda _m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).shape[1]), with_kwargs=True
    )
    try:
        cases.variant_run(family, pipeline_class, {}, dict(odd_call(family, pipeline_class), num_inference_steps=2))
    finally:
        hook.remove()
    assert seen and all(tokens % 3 and tokens % 4 and tokens % 8 for tokens in seen), seen


# -- LTX-2 IC-LoRA below full strength: an additive pair mask over the video tokens ------------------
IC = "LTX2InContextPipeline"
IC_MODES = {
    "ring3, odd size": MODES["ring3, odd size"],
    "ulysses2 + cache": MODES["ulysses2 + cache"],
    "usp2x2 + cache": ({"ulysses": 2, "ring": 2}, False, True),
}


@pytest.mark.parametrize("mode", IC_MODES)
def test_ic_lora_below_full_strength_equals_one_process(rank_pools, mode: str) -> None:
    """`conditioning_attention_strength` < 1 makes the transformer an (L, L) float bias between the
    video and reference tokens, which diffusers' attention pads and repeats per head: each rank takes
    its rows, heads and key blocks of it (padded keys excluded; 175 tokens on Ring 3, 30 on USP 2x2)."""
    parallel, odd, cache = IC_MODES[mode]
    call, recipe, full_strength, _ = reference("ltx2", IC, odd, cache)
    call = dict(call, conditioning_attention_strength=0.5)
    expected, skipped, _ = cases.variant_run("ltx2", IC, recipe, call)
    assert np.abs(expected - full_strength).max() > 1e-3  # the mask changes the video
    world = parallel.get("ulysses", 1) * parallel.get("ring", 1)
    for output, cached, _ in rank_pools(world).run(
        cases.variant_run, "ltx2", IC, {**recipe, "parallel": parallel}, call
    ):
        assert cached == skipped and (not cache or skipped > 0)
        assert np.abs(output - expected).max() <= TOLERANCE


# -- SkyReels-V2 diffusion forcing's asynchronous mode ---------------------------------------------
DF = "SkyReelsV2DiffusionForcingPipeline"


def test_asynchronous_diffusion_forcing_and_its_causal_blocks_split(rank_pools) -> None:
    """`ar_step` > 0 staggers the latent frames' timesteps (per-frame timesteps, cut with the tokens);
    `causal_block_size` > 1 also lets a block of frames see only itself and earlier blocks, a
    block-causal (L, L) mask the model builds for the whole sequence, which each rank slices for its
    queries and each block of keys. Both equal one process on Ring 3 (padded) and Ulysses 2."""
    staggered = dict(odd_call("skyreels2", DF), ar_step=1, causal_block_size=1)
    outputs = [cases.diffusion_forcing_run({}, odd_call("skyreels2", DF))]  # synchronous
    for call in (staggered, dict(staggered, causal_block_size=2)):
        expected = cases.diffusion_forcing_run({}, call)
        assert (
            min(np.abs(expected - other).max() for other in outputs) > 1e-3
        )  # another schedule (or mask), another video
        outputs.append(expected)
        for parallel in ({"ring": 3}, {"ulysses": 2}):
            for output in rank_pools(parallel.get("ring", 2)).run(
                cases.diffusion_forcing_run, {"parallel": parallel}, call
            ):
                assert np.abs(output - expected).max() <= TOLERANCE, (call["causal_block_size"], parallel)


# -- a variant context parallelism cannot cut ----------------------------------------------------
KV = "Flux2KleinKVPipeline"
KV_REFUSAL = (
    "[parallel] ulysses × ring = 2: context parallelism cannot split Flux2KleinKVPipeline: its attention processors "
    "cut text, reference and image tokens at whole-sequence positions, and its reference K/V cache holds the whole "
    "reference; set ulysses = 1 and ring = 1 (the cache, quantization and compile still apply)"
)


def kv_call() -> dict:
    call = FAMILY_CASES["flux2-klein"].call
    return {
        key: value for key, value in call.items() if key in cases.call_parameters(KV)
    }  # distilled: no guidance scale


def test_klein_kv_runs_with_the_cache_and_quantization_on_one_process() -> None:
    """The reference picture's tokens run in the first call only; the cache then skips later calls,
    and at threshold 0 it changes nothing. (Compile equals eager within 2e-6, checked by hand.)"""
    plain, skipped, _ = cases.variant_run("flux2-klein", KV, {}, kv_call())
    unchanged, none_skipped, _ = cases.variant_run("flux2-klein", KV, {"cache": {"threshold": 1e-9}}, kv_call())
    cached, cache_skipped, _ = cases.variant_run("flux2-klein", KV, {"cache": {"threshold": 5.0}}, kv_call())
    assert np.array_equal(unchanged, plain) and none_skipped == 0
    assert cache_skipped > 0 and 0 < np.abs(cached - plain).max() < 0.1
    quantized, _, _ = cases.variant_run("flux2-klein", KV, {"quant": {"type": "int8wo"}}, kv_call())
    assert 0 < np.abs(quantized - plain).max() < 0.01  # 2e-4 when written


def test_klein_kv_under_sequence_parallelism_is_one_line_before_start(tmp_path: Path) -> None:
    image, _ = write_inputs(tmp_path)
    result = CliRunner().invoke(
        app,
        [
            "run",
            "tiny-flux2-klein",
            "--pipeline",
            KV,
            "--image",
            str(image),
            "--gpus",
            "2",
            "-o",
            str(tmp_path / "o.png"),
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + KV_REFUSAL
    assert not (tmp_path / "o.png").exists()


def test_klein_kv_under_sequence_parallelism_is_refused_by_apply_before_any_collective() -> None:
    import accel
    from accel.errors import UserError

    with pytest.raises(UserError) as refused:  # one process, no process group: it refuses before joining one
        accel.apply(cases.variant_pipeline("flux2-klein", KV), {"parallel": {"ulysses": 2}})
    assert str(refused.value) == KV_REFUSAL


# -- the command line ---------------------------------------------------------------------------
def write_inputs(folder: Path) -> tuple[Path, Path]:
    image, mask = folder / "in.png", folder / "mask.png"
    cases.picture((64, 64)).save(image)
    cases.mask((64, 64)).save(mask)
    return image, mask


def test_fill_runs_from_the_command_line_with_image_and_mask(tmp_path: Path) -> None:
    image, mask = write_inputs(tmp_path)
    out = tmp_path / "filled.png"
    result = accel_run(
        *["tiny-flux", "--pipeline", "FluxFillPipeline", "--image", str(image), "--mask", str(mask)],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert Image.open(out).size == (64, 64)
    expected = cases.variant_run(
        "flux",
        "FluxFillPipeline",
        {},
        dict(
            FAMILY_CASES["flux"].call,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            negative_prompt=None,
            prompt="a red fox in the snow, photograph",
            guidance_scale=3.5,
        ),
    )[0][0]
    assert np.abs(np.asarray(Image.open(out), dtype=np.float32) - np.round(expected * 255)).max() <= 1


@pytest.mark.parametrize(
    "family, pipeline_class",
    [("hunyuan15", "HunyuanVideo15ImageToVideoPipeline"), ("hunyuan", "HunyuanVideoImageToVideoPipeline")],
)
def test_image_to_video_runs_from_the_command_line(tmp_path: Path, family: str, pipeline_class: str) -> None:
    """HunyuanVideo 1.5's image-to-video pipeline sizes its video from the picture (it takes no
    height or width) and guides through its guider, whose scale accel sets; HunyuanVideo-I2V shows
    the picture to its LLaVA text encoder and puts its latents in the first frame."""
    image = tmp_path / "in.png"
    cases.picture((64, 64)).save(image)
    out = tmp_path / "video.mp4"
    result = accel_run(
        *[f"tiny-{family}", "--pipeline", pipeline_class, "--image", str(image)],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    assert read_video(out).shape == (5, 64, 64, 3)  # the tiny defaults' 5 frames, at the picture's size


def test_hunyuan_i2v_first_frame_tokens_are_counted_within_each_rank_shard(rank_pools) -> None:
    """HunyuanVideo-I2V's token-replace blocks modulate the first latent frame's tokens apart, by
    a count of leading video tokens. At the odd size that is 35 of 70; Ring 3 cuts shards of 24, so
    the ranks hold 24, 11 and none of them (the equality runs above depend on it)."""
    call = dict(odd_call("hunyuan", HY_I2V), num_inference_steps=1)  # true CFG: two calls
    assert cases.block_argument("hunyuan", HY_I2V, {}, call, "single_transformer_blocks.1", "num_tokens") == [35, 35]
    seen = rank_pools(3).run(
        cases.block_argument, "hunyuan", HY_I2V, {"parallel": {"ring": 3}}, call, "transformer_blocks.0", "num_tokens"
    )
    assert seen == [[24, 24], [11, 11], [0, 0]]


def test_hunyuan_i2v_33_channel_checkpoint_equals_one_process_on_ring_3(rank_pools) -> None:
    """HunyuanVideo-I2V-33ch concatenates the picture's latents and a mask in channels: its blocks
    count no first-frame tokens, so the plan's rebase stays off (it applies to token-replace
    configs only) and Ring 3 at 70 video tokens equals one process."""
    import parallel_cases

    builder = "parallel_cases:tiny_hunyuan_i2v_33ch"
    call = cases.variant_call("hunyuan", HY_I2V, dict(odd_call("hunyuan", HY_I2V), num_inference_steps=2))
    expected, _, _ = parallel_cases.tiny_run(builder, {}, call)
    assert expected.shape == (1, 1, 80, 112, 3)  # the pipeline drops the decoded video's first 4 frames
    for output, _, bytes_sent in rank_pools(3).run(parallel_cases.tiny_run, builder, {"parallel": {"ring": 3}}, call):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pipeline", "FluxInpaintPipeline", "--image", "{image}"],
            "FluxInpaintPipeline needs an input mask: pass --mask PATH ([generate] mask)",
        ),
        (
            ["--pipeline", "FluxKontextPipeline"],
            "FluxKontextPipeline needs an input image: pass --image PATH ([generate] image)",
        ),
        (["--mask", "{mask}"], "[generate] mask: FluxPipeline takes no mask; remove --mask"),
        (
            ["--pipeline", "FluxKontextPipeline", "--image", "{missing}"],
            "[generate] image: {missing} does not exist; pass an image file (PNG, JPEG, WebP, …)",
        ),
        (
            ["--pipeline", "WanPipeline"],
            "[model] pipeline: WanPipeline is not a pipeline accel runs for FLUX.1 (FluxTransformer2DModel); use one "
            "of "
            "FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline, FluxKontextInpaintPipeline, "
            "FluxFillPipeline, "
            "FluxControlPipeline, or build it in your own script and call accel.apply",
        ),
    ],
    ids=["no mask", "no image", "mask for text-to-image", "missing file", "another family's pipeline"],
)
def test_a_missing_or_wrong_input_is_one_line_before_loading(tmp_path: Path, args: list[str], message: str) -> None:
    image, mask = write_inputs(tmp_path)
    paths = {"image": str(image), "mask": str(mask), "missing": str(tmp_path / "nope.png")}
    result = CliRunner().invoke(
        app, ["run", "tiny-flux", "--steps", "1", "-o", str(tmp_path / "o.png"), *(arg.format(**paths) for arg in args)]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(**paths)
    assert not (tmp_path / "o.png").exists()


def test_a_file_that_is_not_a_picture_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    result = CliRunner().invoke(app, ["run", "tiny-flux", "--pipeline", "FluxImg2ImgPipeline", "--image", str(text)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: [generate] image: {text} is not an image Pillow can read (")


# -- video inputs ----------------------------------------------------------------------------------
def write_clip(path: Path, frames: int = 5, size: tuple[int, int] = (64, 64)) -> Path:
    from accel.media import save_video

    save_video(
        np.stack([np.asarray(frame, dtype=np.float32) / 255 for frame in cases.clip(size, frames)]), path, fps=16
    )
    return path


@pytest.mark.parametrize(
    "pipeline_class, flag", [("WanImageToVideoPipeline", "--image"), ("WanVideoToVideoPipeline", "--video")]
)
def test_wan_image_and_video_to_video_run_from_the_command_line(tmp_path: Path, pipeline_class: str, flag: str) -> None:
    """The MP4 equals the library call on the same input (the clip as ffmpeg decodes it); the
    video-to-video output has the clip's 5 frames."""
    from accel.models.input_files import read_clip

    image, _ = write_inputs(tmp_path)
    source = image if flag == "--image" else write_clip(tmp_path / "clip.mp4")
    out = tmp_path / "out.mp4"
    result = accel_run(
        *["tiny-wan", "--pipeline", pipeline_class, flag, str(source)],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    given = {"image": Image.open(image).convert("RGB")} if flag == "--image" else {"video": read_clip(str(source))}
    call = dict(
        prompt="a red fox in the snow, photograph",
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=5.0,
        **given,
    )
    if flag == "--image":
        call["num_frames"] = 5
    assert_mp4_is_the_call(out, "wan", pipeline_class, call, tmp_path)


def assert_mp4_is_the_call(
    out: Path, family: str, pipeline_class: str, call: dict, folder: Path, shape: tuple[int, ...] = (5, 64, 64, 3)
) -> None:
    """The MP4 a CLI run wrote shows what the library call makes from a seed-0 generator."""
    from accel.media import read_video, save_video

    pipe = cases.variant_pipeline(family, pipeline_class)
    expected = pipe(**call, generator=torch.Generator("cpu").manual_seed(0), output_type="np").frames[0]
    save_video(
        expected, folder / "expected.mp4", fps=FAMILIES[family].fps
    )  # the CLI's rate: the encoder's choices follow it
    got, want = read_video(out), read_video(folder / "expected.mp4")
    assert got.shape == want.shape == shape
    # As in tests/test_launch.py: equal outputs encode alike on average; a wrong run is off by tens.
    assert np.abs(got.astype(np.int16) - want.astype(np.int16)).mean() < 0.5


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--pipeline", "WanVideoToVideoPipeline"],
            "WanVideoToVideoPipeline needs an input video: pass --video PATH ([generate] video)",
        ),
        (["--video", "{clip}"], "[generate] video: WanPipeline takes no video; remove --video"),
        (
            ["--pipeline", "WanVideoToVideoPipeline", "--video", "{missing}"],
            "[generate] video: {missing} does not exist; pass a video file (MP4, WebM, …)",
        ),
        (
            ["--pipeline", "WanVACEPipeline", "--mask", "{mask}"],
            "[generate] mask: WanVACEPipeline takes a mask only with an input video; pass --video PATH ([generate] "
            "video)",
        ),
        (
            ["--pipeline", "WanVACEPipeline", "--video", "{clip}", "--mask", "{missing}"],
            "[generate] mask: {missing} does not exist; pass a picture or a video",
        ),
    ],
    ids=["no video", "video for text-to-video", "missing clip", "VACE mask without video", "missing VACE mask"],
)
def test_a_missing_or_wrong_video_is_one_line_before_loading(tmp_path: Path, args: list[str], message: str) -> None:
    _, mask = write_inputs(tmp_path)
    paths = {"clip": str(write_clip(tmp_path / "clip.mp4")), "mask": str(mask), "missing": str(tmp_path / "nope.mp4")}
    result = CliRunner().invoke(
        app, ["run", "tiny-wan", "--steps", "1", "-o", str(tmp_path / "o.mp4"), *(arg.format(**paths) for arg in args)]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(**paths)
    assert not (tmp_path / "o.mp4").exists()


def test_a_file_that_is_not_a_video_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    result = CliRunner().invoke(app, ["run", "tiny-wan", "--pipeline", "WanVideoToVideoPipeline", "--video", str(text)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: [generate] video: {text} is not a video ffmpeg can read (")


def test_a_clip_sets_the_frames_and_a_vace_mask_picture_covers_every_frame(tmp_path: Path) -> None:
    """Pipelines that take a frame count and a video get the clip's length unless --frames says
    otherwise; VACE's mask picture arrives once per frame of the clip, a mask video frame by frame."""
    from accel.models.input_files import open_inputs
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    _, mask = write_inputs(tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", frames=9)
    masks = write_clip(tmp_path / "masks.mp4", frames=9)
    for mask_file in (mask, masks):
        recipe = Recipe.from_dict(
            {"model": {"pipeline": "WanVACEPipeline"}, "generate": {"video": str(clip), "mask": str(mask_file)}}
        )
        kwargs = generation_kwargs(FAMILIES["wan"], True, recipe)
        assert kwargs["num_frames"] == 9
        opened = open_inputs(kwargs)
        assert len(opened["video"]) == len(opened["mask"]) == 9
        assert opened["mask"][0].size == opened["video"][0].size == (64, 64)
    recipe = Recipe.from_dict(
        {"model": {"pipeline": "LucyEditPipeline"}, "generate": {"video": str(clip), "frames": 5}}
    )
    assert generation_kwargs(FAMILIES["wan"], True, recipe)["num_frames"] == 5


# -- LTX-Video's condition pipeline ---------------------------------------------------------------
CONDITION = "LTXConditionPipeline"


@pytest.mark.parametrize(
    "given, size, tokens, timestep",
    [
        # No condition: one timestep per sample, (batch, 1), which every rank keeps whole.
        (dict(image=None, video=None, conditions=None), dict(num_frames=9), 70, (2, 1)),
        # A clip at frame 8: its first 9 frames' 2 latent frames join the 3 of the video, (2 + 3) x 5x7.
        (dict(image=None, conditions=None, frame_index=8), dict(num_frames=17), 175, (2, 175)),
        # Condition objects (--condition): a picture blended into latent frame 0, one at frame 16 joining as
        # extra tokens, (1 + 4) x 5x7.
        (dict(image=None, video=None, conditions=[(0, 1.0), (16, 0.8)]), dict(num_frames=25), 175, (2, 175)),
    ],
    ids=["text-to-video", "clip at frame 8", "conditions"],
)
def test_ltx_condition_calls_equal_one_process_on_ring3(
    rank_pools, given: dict, size: dict, tokens: int, timestep: tuple[int, int]
) -> None:
    """The matrix above runs a picture at frame 8; these are the condition pipeline's other calls,
    at token counts 3 ranks do not divide: its per-sample timestep stays whole, a clip's or a
    condition's tokens (timestep 0 where the strength is 1) are cut with the video's."""
    call = {**FAMILY_CASES["ltx"].call, "height": 160, "width": 224, **size, **given}
    if given["conditions"]:  # (frame, strength) of each picture
        spec = variant_of(FAMILIES["ltx"], CONDITION).conditions
        call["conditions"] = [
            condition_object(spec, cases.picture((224, 160)), frame, strength, tiny=True)
            for frame, strength in given["conditions"]
        ]
    seen: list[tuple] = []
    pipe = cases.variant_pipeline("ltx", CONDITION)
    hook = pipe.transformer.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append((kw["hidden_states"].shape[1], tuple(kw["timestep"].shape))), with_kwargs=True
    )
    try:
        expected, _, _ = cases.variant_run("ltx", CONDITION, {}, call)
    finally:
        hook.remove()
    assert set(seen) == {(tokens, timestep)}
    for output, _, bytes_sent in rank_pools(3).run(
        cases.variant_run, "ltx", CONDITION, {"parallel": {"ring": 3}}, call
    ):
        assert bytes_sent > 0
        assert np.abs(output - expected).max() <= TOLERANCE


def test_ltx_condition_runs_from_the_command_line_with_a_picture_at_a_frame(tmp_path: Path) -> None:
    """`--image` conditions the video and `--arg` places it: the MP4 equals the library call."""
    image, _ = write_inputs(tmp_path)
    out = tmp_path / "out.mp4"
    result = accel_run(
        *["tiny-ltx", "--pipeline", CONDITION, "--image", str(image)],
        *["--arg", "frame_index=8", "--arg", "strength=0.9"],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    call = dict(
        prompt="a red fox in the snow, photograph",
        height=96,
        width=128,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=3.0,
        image=Image.open(image).convert("RGB"),
        frame_index=8,
        strength=0.9,
    )
    assert_mp4_is_the_call(out, "ltx", CONDITION, call, tmp_path, shape=(9, 96, 128, 3))


def test_ltx_condition_takes_a_picture_a_clip_or_conditions_not_several(tmp_path: Path) -> None:
    """Given a picture and a clip the pipeline would drop the clip, and it refuses conditions beside
    either only once loaded: one line before start instead."""
    image, _ = write_inputs(tmp_path)
    clip = write_clip(tmp_path / "clip.mp4")
    for given, last in (
        [["--image", str(image), "--video", str(clip)], "video"],
        [["--video", str(clip), "--condition", str(image)], "conditions"],
    ):
        result = CliRunner().invoke(
            app, ["run", "tiny-ltx", "--pipeline", CONDITION, *given, "-o", str(tmp_path / "o.mp4")]
        )
        assert result.exit_code == 2
        assert result.stderr.strip() == (
            f"error: [generate] {last}: LTXConditionPipeline takes one of --image, --video, --condition, "
            "not several; keep one"
        )


def test_ltx_conditions_become_ltx_video_conditions(tmp_path: Path) -> None:
    """`--condition PATH@FRAME:STRENGTH`: a picture under `image`, a clip under `video`, at the video
    frame and strength given; a clip given by --video arrives as a list of one clip."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    from accel.models.input_files import open_inputs
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    image, _ = write_inputs(tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", frames=9)
    recipe = Recipe.from_dict(
        {"model": {"pipeline": CONDITION}, "generate": {"conditions": [str(image), f"{clip}@16:0.5"]}}
    )
    first, last = open_inputs(generation_kwargs(FAMILIES["ltx"], True, recipe))["conditions"]
    assert isinstance(first, LTXVideoCondition) and isinstance(last, LTXVideoCondition)
    assert (first.frame_index, first.strength, first.image.size, first.video) == (0, 1.0, (64, 64), None)
    assert (last.frame_index, last.strength, last.image, len(last.video)) == (16, 0.5, None, 9)
    recipe = Recipe.from_dict({"model": {"pipeline": CONDITION}, "generate": {"video": str(clip)}})
    opened = open_inputs(generation_kwargs(FAMILIES["ltx"], True, recipe))
    assert len(opened["video"]) == 1 and len(opened["video"][0]) == 9 and opened["num_frames"] == 9


# -- LTX-Video's long multi-prompt pipeline ---------------------------------------------------------
LONG = "LTXI2VLongMultiPromptPipeline"


def test_ltx_long_multi_prompt_windows_are_seeded_from_the_run_seed(tmp_path: Path) -> None:
    """The pipeline seeds each window's generator from its own `seed` (0 unless given), not from the
    generator accel passes: accel gives it the run's seed, so --seed changes the video (and every
    rank, seeded alike, agrees with one process); `--arg seed` is refused as a setting accel fills."""
    from accel.recipe import Recipe
    from accel.generate import generate
    from accel.models.call import generation_kwargs

    recipe = Recipe.from_dict(
        {"model": {"pipeline": LONG}, "generate": {"seed": 7, "image": str(write_inputs(tmp_path)[0])}}
    )
    assert generation_kwargs(FAMILIES["ltx"], True, recipe)["seed"] == 7
    result = CliRunner().invoke(
        app, ["run", "tiny-ltx", "--pipeline", LONG, "--arg", "seed=3", "-o", str(tmp_path / "o.mp4")]
    )
    assert (
        result.stderr.strip()
        == "error: [generate] arguments: seed is one accel fills itself; set it with [generate] seed"
    )
    pipe = cases.variant_pipeline("ltx", LONG)
    call = dict(
        prompt="a red fox | a white owl",
        height=96,
        width=128,
        num_frames=9,
        num_inference_steps=2,
        guidance_scale=3.0,
        decode_horizontal_tiles=1,
        decode_vertical_tiles=1,
    )
    unseeded = [generate(pipe, call, seed) for seed in (0, 1)]
    assert np.array_equal(*unseeded)  # the generator alone does not reach the windows
    seeded = [generate(pipe, dict(call, seed=seed), seed) for seed in (0, 1)]
    assert np.array_equal(seeded[0], unseeded[0]) and np.abs(seeded[0] - seeded[1]).max() > 0.1


# -- Wan Animate from the command line: its own input files -------------------------------------------
def animate_call() -> dict:
    """A reference picture, 5 pose frames and 5 16x16 face crops (the tiny motion encoder's size)."""
    return dict(
        image=cases.picture(),
        pose_video=cases.clip((64, 64), 5),
        face_video=cases.clip((16, 16), 5),
        prompt="a red fox",
        negative_prompt="blurry",
        height=64,
        width=64,
        segment_frame_length=5,
        num_inference_steps=6,
        guidance_scale=5.0,
    )


def test_wan_animate_runs_from_the_command_line_with_its_pose_and_face_videos(tmp_path: Path) -> None:
    """`--input KEYWORD=PATH` gives a variant's own input files and `--arg` any other call argument:
    the MP4 equals the library call on the same clips as ffmpeg decodes them."""
    from accel.models.input_files import read_clip

    image, _ = write_inputs(tmp_path)
    pose, face = write_clip(tmp_path / "pose.mp4"), write_clip(tmp_path / "face.mp4", size=(16, 16))
    out = tmp_path / "out.mp4"
    result = accel_run(
        *["tiny-wan", "--pipeline", "WanAnimatePipeline", "--image", str(image)],
        *["--input", f"pose_video={pose}", "--input", f"face_video={face}"],
        *["--arg", "segment_frame_length=5", "--negative-prompt", "blurry"],
        *["--steps", "2", "--warmup", "0", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output[-2000:]
    call = dict(
        animate_call(),
        image=Image.open(image).convert("RGB"),
        pose_video=read_clip(str(pose)),
        face_video=read_clip(str(face)),
        prompt="a red fox in the snow, photograph",
        num_inference_steps=2,
    )
    assert_mp4_is_the_call(out, "wan", "WanAnimatePipeline", call, tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--input", "face_video={clip}"],
            "WanAnimatePipeline needs an input pose_video: pass --input pose_video=PATH ([generate] inputs), a video "
            "file",
        ),
        (
            [
                "--input",
                "pose_video={clip}",
                "--input",
                "face_video={clip}",
                "--arg",
                "mode=replace",
                "--input",
                "mask_video={clip}",
            ],
            "WanAnimatePipeline needs an input background_video when mode is 'replace': pass --input "
            "background_video=PATH "
            "([generate] inputs), a video file",
        ),
        (
            ["--input", "control_video={clip}"],
            "[generate] inputs: WanAnimatePipeline takes no input control_video (it takes pose_video, face_video, "
            "background_video, mask_video)",
        ),
        (
            ["--input", "image={mask}"],
            "[generate] inputs: WanAnimatePipeline takes its image from --image PATH ([generate] image); use that "
            "instead",
        ),
        (
            ["--input", "pose_video={missing}"],
            "[generate] inputs pose_video: {missing} does not exist; pass a video file (MP4, WebM, …)",
        ),
        (["--input", "pose.mp4"], "--input pose.mp4: write KEYWORD=VALUE, e.g. --input pose_video=pose.mp4"),
        (
            ["--input", "pose_video={clip}", "--input", "face_video={clip}", "--arg", "num_inference_steps=3"],
            "[generate] arguments: num_inference_steps is one accel fills itself; set it with [generate] steps",
        ),
        (
            ["--input", "pose_video={clip}", "--input", "face_video={clip}", "--arg", "segment_length=5"],
            "[generate] arguments: WanAnimatePipeline takes no argument segment_length (did you mean "
            "segment_frame_length?)",
        ),
        (
            ["--input", "pose_video={clip}", "--input", "face_video={clip}", "--arg", "output_type=pil"],
            "[generate] arguments: accel sets output_type for every call; remove it",
        ),
    ],
    ids=[
        "missing pose",
        "replace without background",
        "unknown input",
        "input with a flag",
        "missing file",
        "no keyword",
        "argument accel fills",
        "unknown argument",
        "argument accel sets",
    ],
)
def test_named_inputs_and_call_arguments_are_checked_in_one_line_before_loading(
    tmp_path: Path, args: list[str], message: str
) -> None:
    image, mask = write_inputs(tmp_path)
    paths = {"clip": str(write_clip(tmp_path / "clip.mp4")), "mask": str(mask), "missing": str(tmp_path / "nope.mp4")}
    result = CliRunner().invoke(
        app,
        [
            "run",
            "tiny-wan",
            "--pipeline",
            "WanAnimatePipeline",
            "--image",
            str(image),
            "--steps",
            "1",
            "-o",
            str(tmp_path / "o.mp4"),
            *(arg.format(**paths) for arg in args),
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(**paths)
    assert not (tmp_path / "o.mp4").exists()


def test_the_base_pipeline_takes_no_named_input_and_only_its_own_arguments(tmp_path: Path) -> None:
    clip = str(write_clip(tmp_path / "clip.mp4"))
    result = CliRunner().invoke(app, ["run", "tiny-wan", "--input", f"pose_video={clip}"])
    assert (
        result.stderr.strip()
        == "error: [generate] inputs: WanPipeline takes no input pose_video (it takes none besides --image / --mask / "
        "--video)"
    )
    result = CliRunner().invoke(app, ["run", "tiny-wan", "--arg", "attention_kwarg=1"])
    assert (
        result.stderr.strip()
        == "error: [generate] arguments: WanPipeline takes no argument attention_kwarg (did you mean attention_kwargs?)"
    )


def test_call_arguments_reach_the_call_as_toml_values_and_merge_with_the_recipe(tmp_path: Path) -> None:
    """`--arg` values TOML reads keep their type (17, true, [1, 2]); others are strings; flags add
    to a recipe's [generate] arguments and inputs key by key."""
    from accel.cli.options import pairs
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    assert pairs("--arg", ["a=17", "b=true", "c=[1, 2]", "mode=replace", "d=1.5", 'e="x y"'], "", parse=True) == {
        "a": 17,
        "b": True,
        "c": [1, 2],
        "mode": "replace",
        "d": 1.5,
        "e": "x y",
    }
    clip = str(write_clip(tmp_path / "clip.mp4"))
    base = Recipe.from_dict(
        {
            "model": {"pipeline": "WanAnimatePipeline"},
            "generate": {
                "image": str(write_inputs(tmp_path)[0]),
                "inputs": {"pose_video": clip},
                "arguments": {"mode": "animate"},
            },
        }
    )
    recipe = base.with_overrides(
        {"generate": {"inputs": {"face_video": clip}, "arguments": {"segment_frame_length": 5}}}
    )
    kwargs = generation_kwargs(FAMILIES["wan"], True, recipe)
    assert (kwargs["pose_video"], kwargs["face_video"], kwargs["mode"], kwargs["segment_frame_length"]) == (
        clip,
        clip,
        "animate",
        5,
    )
    assert "num_frames" not in kwargs  # Animate's length comes from the pose video
    assert Recipe.from_dict(recipe.to_dict()) == recipe
    # A variant's own argument default (SkyReels-V2 video extension's overlap) yields to the recipe's.
    extend = {"model": {"pipeline": "SkyReelsV2DiffusionForcingVideoToVideoPipeline"}, "generate": {"video": clip}}
    assert generation_kwargs(FAMILIES["skyreels2"], True, Recipe.from_dict(extend))["overlap_history"] == 17
    extend["generate"]["arguments"] = {"overlap_history": 5}
    assert generation_kwargs(FAMILIES["skyreels2"], True, Recipe.from_dict(extend))["overlap_history"] == 5


def test_conditions_become_the_pipelines_condition_objects(tmp_path: Path) -> None:
    """`--condition PATH@INDEX:STRENGTH`: a picture as one RGB image, a clip as its frames, at the
    index and strength given (0 and 1 when left out); the tiny variant's skip the PyAV re-encode."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    from accel.models.input_files import open_inputs
    from accel.recipe import Recipe
    from accel.models.call import generation_kwargs

    image, _ = write_inputs(tmp_path)
    clip = write_clip(tmp_path / "clip.mp4", frames=9)
    recipe = Recipe.from_dict(
        {"model": {"pipeline": "LTX2ConditionPipeline"}, "generate": {"conditions": [str(image), f"{clip}@-1:0.5"]}}
    )
    kwargs = generation_kwargs(FAMILIES["ltx2"], True, recipe)
    first, last = open_inputs(kwargs)["conditions"]
    assert isinstance(first, LTX2VideoCondition) and isinstance(last, LTX2VideoCondition)
    assert (first.index, first.strength, first.crf, first.frames.size) == (0, 1.0, 0, (64, 64))
    assert (last.index, last.strength, len(last.frames)) == (-1, 0.5, 9)
    assert (
        generation_kwargs(FAMILIES["ltx2"], False, recipe)["conditions"].tiny is False
    )  # real weights: the model's CRF
    # IC-LoRA's references have no position: PATH@STRENGTH, beside keyframes.
    from diffusers.pipelines.ltx2.pipeline_ltx2_ic_lora import LTX2ReferenceCondition

    recipe = Recipe.from_dict(
        {
            "model": {"pipeline": "LTX2InContextPipeline"},
            "generate": {"conditions": [str(image)], "references": [f"{clip}@0.5"]},
        }
    )
    opened = open_inputs(generation_kwargs(FAMILIES["ltx2"], True, recipe))
    (reference,), (keyframe,) = opened["reference_conditions"], opened["conditions"]
    assert type(reference) is LTX2ReferenceCondition and (reference.strength, len(reference.frames)) == (0.5, 9)
    assert (keyframe.index, keyframe.strength) == (0, 1.0)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--condition", "{image}@two"],
            "[generate] conditions: {image}@two: write PATH@INDEX:STRENGTH, INDEX a whole number "
            "(latent frames, 8 video frames each after the first; -1 is the last), STRENGTH from 0 to 1, e.g. "
            "end.png@-1:0.8",
        ),
        (
            ["--condition", "{image}@1:1.5"],
            "[generate] conditions: {image}@1:1.5: the strength must be from 0 to 1, got 1.5",
        ),
        (["--condition", "{missing}@1"], "[generate] conditions: {missing} does not exist; pass a picture or a video"),
        (
            ["--pipeline", "LTX2Pipeline", "--condition", "{image}"],
            "[generate] conditions: LTX2Pipeline takes no conditions; remove --condition",
        ),
        (
            ["--reference", "{image}"],
            "[generate] references: LTX2ConditionPipeline takes no references; remove --reference",
        ),
        (
            ["--pipeline", "LTX2InContextPipeline", "--reference", "{image}@1:0.5"],
            "[generate] references: {image}@1:0.5: write PATH@STRENGTH, STRENGTH from 0 to 1, e.g. depth.mp4@0.9",
        ),
        # HDR converts its reference clip: without one there is nothing to convert, on one process or before ranks
        # start.
        (
            ["--pipeline", "LTX2HDRPipeline"],
            "LTX2HDRPipeline needs a reference video: pass --reference PATH@STRENGTH ([generate] references)",
        ),
        (
            ["--pipeline", "LTX2HDRPipeline", "--gpus", "2"],
            "LTX2HDRPipeline needs a reference video: pass --reference PATH@STRENGTH ([generate] references)",
        ),
        (
            ["--pipeline", "LTX2HDRPipeline", "--reference", "{missing}@1.0"],
            "[generate] references: {missing} does not exist; pass a picture or a video",
        ),
    ],
    ids=[
        "index",
        "strength",
        "missing file",
        "no conditions",
        "no references",
        "reference with an index",
        "HDR without a reference",
        "HDR without a reference on 2 ranks",
        "HDR reference missing",
    ],
)
def test_a_bad_condition_is_one_line_before_loading(tmp_path: Path, args: list[str], message: str) -> None:
    image, _ = write_inputs(tmp_path)
    paths = {"image": str(image), "missing": str(tmp_path / "nope.png")}
    pipeline = [] if "--pipeline" in args else ["--pipeline", "LTX2ConditionPipeline"]
    result = CliRunner().invoke(
        app, ["run", "tiny-ltx2", *pipeline, "-o", str(tmp_path / "o.mp4"), *(arg.format(**paths) for arg in args)]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(**paths)
    assert not (tmp_path / "o.mp4").exists()


def test_an_hdr_reference_that_is_not_a_video_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    result = CliRunner().invoke(
        app,
        ["run", "tiny-ltx2", "--pipeline", "LTX2HDRPipeline", "--reference", str(text), "-o", str(tmp_path / "o.npy")],
    )
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: [generate] references: {text} is not a video ffmpeg can read (")


def test_a_checkpoint_of_another_wan_transformer_is_refused_as_a_variant(tmp_path: Path) -> None:
    """WanVACEPipeline holds WanVACETransformer3DModel: a T2V checkpoint cannot run as it (and a VACE
    checkpoint is recognised as Wan by its own transformer class)."""
    import accel
    from accel.errors import ModelError
    from accel.models.registry import family_of
    from accel.models.wan import build_tiny

    build_tiny().save_pretrained(tmp_path / "t2v")
    with pytest.raises(ModelError) as refused:
        accel.load_pipeline(str(tmp_path / "t2v"), pipeline="WanVACEPipeline")
    assert str(refused.value) == (
        "[model] pipeline: WanVACEPipeline needs a WanVACETransformer3DModel checkpoint, and this model's "
        "transformer is WanTransformer3DModel; load a checkpoint made for WanVACEPipeline"
    )
    assert family_of(cases.variant_pipeline("wan", "WanVACEPipeline")).name == "wan"


def test_a_checkpoint_of_another_config_is_refused_as_a_variant(tmp_path: Path) -> None:
    """SkyReels-V1 image-to-video reads 32 input channels: HunyuanVideo's 16-channel text-to-video
    checkpoint cannot run as it (it would fail on a shape mid-run); its own checkpoint loads."""
    import accel
    from accel.errors import ModelError
    from accel.models.hunyuan import build_tiny, build_tiny_skyreels

    build_tiny().save_pretrained(tmp_path / "t2v")
    with pytest.raises(ModelError) as refused:
        accel.load_pipeline(str(tmp_path / "t2v"), pipeline="HunyuanSkyreelsImageToVideoPipeline")
    assert str(refused.value) == (
        "[model] pipeline: HunyuanSkyreelsImageToVideoPipeline needs a transformer with in_channels = 32, "
        "and this model's has 16; load a checkpoint made for HunyuanSkyreelsImageToVideoPipeline"
    )
    build_tiny_skyreels().save_pretrained(tmp_path / "skyreels")
    assert type(accel.load_pipeline(str(tmp_path / "skyreels"))).__name__ == "HunyuanSkyreelsImageToVideoPipeline"
