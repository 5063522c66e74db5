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
from accel.models.registry import FAMILIES

TOLERANCE = 1e-4
ACCEL = str(Path(sys.executable).parent / "accel")

# diffusers pipelines of a supported transformer that `accel run` cannot give their inputs: they need
# another model or a second picture. In a script, build them and call accel.apply (the family is the
# transformer's): FLUX.1's ControlNet residuals are split with the image (tests/test_controlnet.py);
# Qwen-Image's, SD 3.5's and Z-Image's are not yet, so their ControlNet pipelines run on one process
# or with CFG parallelism only.
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
    "Flux2KleinKVPipeline": "not split yet: its reference K/V cache assumes the reference tokens' positions in the whole sequence",
    "QwenImageLayeredPipeline": "Qwen-Image-Layered's own transformer (layer-aware rotary) and returns a stack of layers",
    "ZImageControlNetPipeline": "a ControlNet model",
    "ZImageControlNetInpaintPipeline": "a ControlNet model",
    "ZImageOmniPipeline": "a SigLIP image encoder",
    "StableDiffusion3ControlNetPipeline": "a ControlNet model",
    "StableDiffusion3ControlNetInpaintingPipeline": "a ControlNet model",
    "StableDiffusion3PAGPipeline": "perturbed-attention guidance layers",
    "StableDiffusion3PAGImg2ImgPipeline": "perturbed-attention guidance layers",
    # Kandinsky 5's image pipelines run the video family's transformer class (Kandinsky 5.0 Image
    # Lite checkpoints) but make pictures with FLUX.1's AutoencoderKL: a Variant has no output kind
    # or VAE of its own yet, and I2I also shows the picture to Qwen2.5-VL through a Qwen2-VL processor.
    "Kandinsky5T2IPipeline": "an image output and AutoencoderKL in a video family (Variant has no output kind of its own yet)",
    "Kandinsky5I2IPipeline": "an image output and AutoencoderKL in a video family (Variant has no output kind of its own yet)",
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


def image_families() -> list[str]:
    return [name for name, family in FAMILIES.items() if family.output == "image"]


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
VARIANTS = [(name, variant.pipeline_class) for name in image_families() for variant in FAMILIES[name].variants
            if variant.pipeline_class != FAMILIES[name].pipeline_class]
MODES = {"ulysses2": ({"ulysses": 2}, False, False), "ring3, odd size": ({"ring": 3}, True, False),
         "cfg2 x ulysses2 + cache": ({"cfg": 2, "ulysses": 2}, False, True), "ulysses2 + cache": ({"ulysses": 2}, False, True)}


# Qwen-Image's edit pipelines encode the input picture at one megapixel whatever the output size
# (4096 reference tokens, seconds per call on a CPU rank): one mode each, a different one per variant.
ONE_MODE = {"QwenImageEditPipeline": "cfg2 x ulysses2 + cache", "QwenImageEditPlusPipeline": "ring3, odd size",
            "QwenImageEditInpaintPipeline": "ulysses2"}


def modes_of(family: str, pipeline_class: str) -> list[str]:
    """CFG parallelism where the variant runs real CFG (FluxFillPipeline has no true CFG), else the cache on Ulysses."""
    if pipeline_class in ONE_MODE:
        return [ONE_MODE[pipeline_class]]
    real_cfg = FAMILIES[family].cfg_scale in cases.call_parameters(pipeline_class)
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
