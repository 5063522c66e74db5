"""Every pipeline of a supported transformer: the variants each family lists run with every
accelerator and equal one process; `--pipeline`, `--image` and `--mask` through the CLI; and the
variant lists stay in step with the pipelines diffusers ships."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import diffusers
import numpy as np
import pytest
import variant_cases as cases
from PIL import Image
from test_parallel_families import FAMILY_CASES
from typer.testing import CliRunner

from accel.cli import app
from accel.media import read_video
from accel.models.registry import FAMILIES
from accel.runner import guided_by_guider

TOLERANCE = 1e-4
ACCEL = str(Path(sys.executable).parent / "accel")

# diffusers pipelines of a supported transformer that `accel run` cannot give their inputs: they need
# another model or a second picture. In a script, build them and call accel.apply (the family is the
# transformer's, so every accelerator applies): the ControlNet residuals of FLUX.1, Qwen-Image, SD 3.5
# and Z-Image are split with the tokens they are added to and halved with batched CFG branches
# (tests/test_controlnet.py).
NEEDS_MORE = {
    "FluxControlNetPipeline": "a ControlNet model",
    "FluxControlNetImg2ImgPipeline": "a ControlNet model",
    "FluxControlNetInpaintPipeline": "a ControlNet model",
    "FluxControlImg2ImgPipeline": "a control image besides the image",
    "FluxControlInpaintPipeline": "a control image besides the image and mask",
    "VisualClozePipeline": "in-context example images and a resolution",
    "VisualClozeGenerationPipeline": "in-context example images and a resolution",
    "QwenImageControlNetPipeline": "a ControlNet model",
    "QwenImageControlNetInpaintPipeline": "a ControlNet model",
    "QwenImageLayeredPipeline": "Qwen-Image-Layered's own transformer (layer-aware rotary) and returns a stack of layers",
    "ZImageControlNetPipeline": "a ControlNet model",
    "ZImageControlNetInpaintPipeline": "a ControlNet model",
    "ZImageOmniPipeline": "a SigLIP image encoder",
    "StableDiffusion3ControlNetPipeline": "a ControlNet model",
    "StableDiffusion3ControlNetInpaintingPipeline": "a ControlNet model",
    "StableDiffusion3PAGPipeline": "perturbed-attention guidance layers",
    "StableDiffusion3PAGImg2ImgPipeline": "perturbed-attention guidance layers",
}


def diffusers_pipelines_of(transformer_class: str) -> set[str]:
    """Every pipeline class diffusers exports whose `transformer` component is `transformer_class`."""
    found = set()
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        cls = getattr(diffusers, name, None)
        if not isinstance(cls, type) or not issubclass(cls, diffusers.DiffusionPipeline):
            continue
        parameter = inspect.signature(cls.__init__).parameters.get("transformer")
        annotation = getattr(parameter, "annotation", None)
        if parameter is not None and transformer_class in (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")):
            found.add(name)
    return found


# Video families whose every diffusers pipeline is listed (or named in NEEDS_MORE); the others'
# image- and video-to-video pipelines are not variants yet.
VIDEO_FAMILIES = ["hunyuan15"]


def image_families() -> list[str]:
    """The families checked here: every image family, and the video families above."""
    return [name for name, family in FAMILIES.items() if family.output == "image" or name in VIDEO_FAMILIES]


@pytest.mark.parametrize("family", image_families())
def test_every_diffusers_pipeline_of_the_transformer_is_a_variant_or_named(family: str) -> None:
    shipped = diffusers_pipelines_of(FAMILIES[family].transformer_class)
    listed = {name for other in FAMILIES.values() if other.transformer_class == FAMILIES[family].transformer_class
              for name in other.pipeline_classes}
    assert FAMILIES[family].pipeline_class in shipped
    assert shipped - listed - set(NEEDS_MORE) == set(), "add these to the family's variants (or say what they need)"
    assert listed <= shipped


# A family's own pipeline listed among its variants only gains an optional input (FLUX.2's reference
# pictures): tests/test_family_flux2.py splits those.
# Variants sequence parallelism cannot cut (Flux2KleinKVPipeline) are tested on their own below.
VARIANTS = [(name, variant.pipeline_class) for name in image_families() for variant in FAMILIES[name].variants
            if variant.pipeline_class != FAMILIES[name].pipeline_class and not variant.not_split]
MODES = {"ulysses2": ({"ulysses": 2}, False, False), "ring3, odd size": ({"ring": 3}, True, False),
         "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, False, True), "ulysses2 + cache": ({"ulysses": 2}, False, True)}


# Qwen-Image's edit pipelines encode the input picture at one megapixel whatever the output size
# (4096 reference tokens, seconds per call on a CPU rank): one mode each, a different one per variant.
ONE_MODE = {"QwenImageEditPipeline": "cfg2 x ulysses2 + cache", "QwenImageEditPlusPipeline": "ring3, odd size",
            "QwenImageEditInpaintPipeline": "ulysses2",
            # HunyuanVideo 1.5 image-to-video: the guider's two calls a step on CFG halves, Ulysses in each, the cache.
            "HunyuanVideo15ImageToVideoPipeline": "cfg2 x ulysses2 + cache"}


def modes_of(family: str, pipeline_class: str) -> list[str]:
    """CFG parallelism where the variant runs real CFG (FluxFillPipeline has no true CFG), else the cache on Ulysses."""
    if pipeline_class in ONE_MODE:
        return [ONE_MODE[pipeline_class]]
    real_cfg = FAMILIES[family].cfg_scale in cases.call_parameters(pipeline_class) or guided_by_guider(getattr(diffusers, pipeline_class))
    return [mode for mode in MODES if mode != ("ulysses2 + cache" if real_cfg else "cfg2 x ulysses2 + cache")]


CASES = [(family, pipeline_class, mode) for family, pipeline_class in VARIANTS for mode in modes_of(family, pipeline_class)]

_references: dict[tuple[str, str, bool, bool], np.ndarray] = {}


def reference(family: str, pipeline_class: str, odd: bool, cache: bool) -> tuple[dict, dict, np.ndarray, int]:
    case = FAMILY_CASES[family]
    call = dict(case.call, **case.odd) if odd else case.call
    recipe = {"cache": {"threshold": case.threshold}} if cache else {}
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
    runs = rank_pools(world).run(cases.variant_run, family, pipeline_class, {**recipe, "parallel": parallel}, call)
    if parallel.get("cfg", 1) > 1 and FAMILIES[family].cfg == "calls":  # each half caches its own branch's calls
        assert runs[0][1] + runs[-1][1] == skipped
    else:
        assert [run[1] for run in runs] == [skipped] * world
    for output, _, bytes_sent in runs:
        assert bytes_sent > 0
        assert output.shape == expected.shape
        assert np.abs(output - expected).max() <= TOLERANCE


def test_kontext_reference_tokens_join_the_split_image_sequence() -> None:
    """Kontext hands the transformer the generated tokens and then the reference image's: one image
    stream, longer than the output's (which the split above cuts and gathers whole)."""
    pipe = cases.variant_pipeline("flux", "FluxKontextPipeline")
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    try:
        cases.variant_run("flux", "FluxKontextPipeline", {}, dict(FAMILY_CASES["flux"].call, height=48, width=80))
    finally:
        hook.remove()
    assert set(seen) == {2 * 15}  # 3x5 generated tokens, then the 3x5 of the reference picture


# -- a variant context parallelism cannot cut ----------------------------------------------------
KV = "Flux2KleinKVPipeline"
KV_REFUSAL = ("[parallel] ulysses × ring = 2: context parallelism cannot split Flux2KleinKVPipeline: its attention processors "
              "cut text, reference and image tokens at whole-sequence positions, and its reference K/V cache holds the whole "
              "reference; set ulysses = 1 and ring = 1 (the cache, quantization and compile still apply)")


def kv_call() -> dict:
    call = FAMILY_CASES["flux2-klein"].call
    return {key: value for key, value in call.items() if key in cases.call_parameters(KV)}  # distilled: no guidance scale


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
    result = CliRunner().invoke(app, ["run", "tiny-flux2-klein", "--pipeline", KV, "--image", str(image), "--gpus", "2",
                                      "-o", str(tmp_path / "o.png")])
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
    done = subprocess.run([ACCEL, "run", "tiny-flux", "--pipeline", "FluxFillPipeline", "--image", str(image), "--mask", str(mask),
                           "--steps", "2", "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Image.open(out).size == (64, 64)
    expected = cases.variant_run("flux", "FluxFillPipeline", {}, dict(FAMILY_CASES["flux"].call, num_inference_steps=2,
                                 true_cfg_scale=1.0, negative_prompt=None, prompt="a red fox in the snow, photograph",
                                 guidance_scale=3.5))[0][0]
    assert np.abs(np.asarray(Image.open(out), dtype=np.float32) - np.round(expected * 255)).max() <= 1


def test_image_to_video_runs_from_the_command_line(tmp_path: Path) -> None:
    """HunyuanVideo 1.5's image-to-video pipeline sizes its video from the picture (it takes no
    height or width) and guides through its guider, whose scale accel sets."""
    image = tmp_path / "in.png"
    cases.picture((64, 64)).save(image)
    out = tmp_path / "video.mp4"
    done = subprocess.run([ACCEL, "run", "tiny-hunyuan15", "--pipeline", "HunyuanVideo15ImageToVideoPipeline", "--image", str(image),
                           "--steps", "2", "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_video(out).shape == (5, 64, 64, 3)  # the tiny defaults' 5 frames, at the picture's size


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pipeline", "FluxInpaintPipeline", "--image", "{image}"], "FluxInpaintPipeline needs an input mask: pass --mask PATH ([generate] mask)"),
        (["--pipeline", "FluxKontextPipeline"], "FluxKontextPipeline needs an input image: pass --image PATH ([generate] image)"),
        (["--mask", "{mask}"], "[generate] mask: FluxPipeline takes no mask; remove --mask"),
        (["--pipeline", "FluxKontextPipeline", "--image", "{missing}"], "[generate] image: {missing} does not exist; pass an image file (PNG, JPEG, WebP, …)"),
        (["--pipeline", "WanPipeline"], "[model] pipeline: WanPipeline is not a pipeline accel runs for FLUX.1 (FluxTransformer2DModel); use one of "
         "FluxPipeline, FluxImg2ImgPipeline, FluxInpaintPipeline, FluxKontextPipeline, FluxKontextInpaintPipeline, FluxFillPipeline, "
         "FluxControlPipeline, or build it in your own script and call accel.apply"),
    ],
    ids=["no mask", "no image", "mask for text-to-image", "missing file", "another family's pipeline"],
)
def test_a_missing_or_wrong_input_is_one_line_before_loading(tmp_path: Path, args: list[str], message: str) -> None:
    image, mask = write_inputs(tmp_path)
    paths = {"image": str(image), "mask": str(mask), "missing": str(tmp_path / "nope.png")}
    result = CliRunner().invoke(app, ["run", "tiny-flux", "--steps", "1", "-o", str(tmp_path / "o.png"),
                                      *(arg.format(**paths) for arg in args)])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: " + message.format(**paths)
    assert not (tmp_path / "o.png").exists()


def test_a_file_that_is_not_a_picture_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.png"
    text.write_text("not a picture")
    result = CliRunner().invoke(app, ["run", "tiny-flux", "--pipeline", "FluxImg2ImgPipeline", "--image", str(text)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: [generate] image: {text} is not an image Pillow can read (")
