"""The runner as a library: progress driven by scheduler events, metrics, settings resolution."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from variant_cases import needs_picture, picture

from accel.errors import UserError
from accel.models.registry import FAMILIES
from accel.recipe import Recipe
from accel.models.call import generation_kwargs
from accel.runner import run


class RecordingBar:
    def __init__(self, label: str, log: list[tuple[str, str, int]]) -> None:
        self.label, self.log = label, log

    def start(self, total: int) -> None:
        self.log.append((self.label, "start", total))

    def advance(self) -> None:
        self.log.append((self.label, "advance", 1))


def test_progress_follows_every_denoising_step(tmp_path: Path) -> None:
    log: list[tuple[str, str, int]] = []

    @contextmanager
    def progress(label: str) -> Iterator[RecordingBar]:
        yield RecordingBar(label, log)

    recipe = Recipe.from_dict({"model": {"name": "tiny-wan"}, "generate": {"steps": 3}, "cache": {"threshold": 0.5}})
    metrics = run(recipe, out=tmp_path / "v.mp4", warmup=1, progress=progress)
    expected = []
    for label in ("generating: warm-up 1/1", "generating"):
        expected += [(label, "start", 3)] + [(label, "advance", 1)] * 3
    assert log == expected
    assert metrics.cache is not None and metrics.cache["transformer_calls"] == 6  # cond + uncond per step
    assert metrics.output_kind == "video" and (tmp_path / "v.mp4").stat().st_size > 0


def test_run_restores_the_pipeline_and_reports_settings(tmp_path: Path) -> None:
    recipe = Recipe.from_dict({"model": {"name": "tiny-flux"}, "generate": {"steps": 2, "seed": 7, "prompt": "owl"}})
    metrics = run(recipe, out=tmp_path / "a.png", warmup=0)
    assert metrics.recipe["generate"] == {
        "prompt": "owl",
        "steps": 2,
        "height": 64,
        "width": 64,
        "guidance_scale": 3.5,
        "seed": 7,
    }
    assert Recipe.from_dict(metrics.recipe).generate.steps == 2
    assert metrics.cache is None and metrics.baseline_s is None and metrics.psnr_db is None
    assert np.asarray(Image.open(tmp_path / "a.png")).shape == (64, 64, 3)


def test_generation_kwargs_take_recipe_values_over_family_defaults() -> None:
    wan = FAMILIES["wan"]
    recipe = Recipe.from_dict({"generate": {"frames": 9, "negative_prompt": "dark"}})
    assert generation_kwargs(wan, True, recipe) == {
        "prompt": "a red fox in the snow, photograph",
        "num_inference_steps": 4,
        "height": 64,
        "width": 64,
        "guidance_scale": 5.0,
        "negative_prompt": "dark",
        "num_frames": 9,
    }
    full = generation_kwargs(wan, False, Recipe.from_dict({}))
    assert (full["height"], full["width"], full["num_frames"], full["num_inference_steps"]) == (480, 832, 81, 50)


@pytest.mark.parametrize(
    "family, generate, message",
    [
        ("flux", {"frames": 5}, "[generate] frames: FLUX.1 makes images; remove frames"),
        ("wan", {"true_cfg_scale": 2.0}, "[generate] true_cfg_scale: Wan 2.1 / 2.2 pipelines have no true CFG scale"),
    ],
)
def test_settings_a_family_cannot_take_are_refused(family: str, generate: dict, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        generation_kwargs(FAMILIES[family], True, Recipe.from_dict({"generate": generate}))


def test_flux_true_cfg_is_passed_through() -> None:
    kwargs = generation_kwargs(
        FAMILIES["flux"], True, Recipe.from_dict({"generate": {"true_cfg_scale": 4.0, "negative_prompt": "x"}})
    )
    assert kwargs["true_cfg_scale"] == 4.0 and kwargs["negative_prompt"] == "x"


def test_cpu_peak_memory_is_this_block_s_peak_not_the_process_lifetime_peak() -> None:
    import time

    import torch

    from accel.measure import PeakMemory

    with PeakMemory(torch.device("cpu")) as big:
        block = np.ones(300 * 2**20 // 8)  # 300 MiB, touched
        time.sleep(0.2)
        del block
    with PeakMemory(torch.device("cpu")) as small:
        time.sleep(0.05)
    assert big.peak - small.peak > 200 * 2**20  # the later block does not inherit the earlier peak


def test_every_default_size_is_one_the_family_makes_as_asked() -> None:
    """Family.size_step / frame_step against the defaults accel itself starts from: none is refused."""
    for family in FAMILIES.values():
        for defaults in (family.defaults, family.tiny_defaults, *(v.defaults for v in family.variants)):
            if defaults is None:
                continue
            for key in ("height", "width", "frames"):
                value = getattr(defaults, key)
                assert value is None or family.size_problem(key, value) is None, (family.name, key, value)


def test_size_problem_names_the_neighbours_it_makes() -> None:
    wan, ltx = FAMILIES["wan"], FAMILIES["ltx"]
    assert wan.size_problem("height", 64) is None and wan.size_problem("frames", 9) is None
    assert (
        wan.size_problem("height", 17)
        == "[generate] height 17: Wan 2.1 / 2.2 makes heights in multiples of 16 pixels; use 16 or 32"
    )
    assert (
        wan.size_problem("width", 20)
        == "[generate] width 20: Wan 2.1 / 2.2 makes widths in multiples of 16 pixels; use 16 or 32"
    )
    assert (
        ltx.size_problem("frames", 12) == "[generate] frames 12: LTX-Video makes 8k+1 frames (1, 9, 17, …); use 9 or 17"
    )
    assert (
        ltx.size_problem("height", 16)
        == "[generate] height 16: LTX-Video makes heights in multiples of 32 pixels; use 32"
    )


def test_a_size_the_pipeline_changed_anyway_is_a_note() -> None:
    from accel.outputs import size_notes

    assert size_notes({"width": 50, "height": 64, "num_frames": 4}, (48, 64, 5), "num_frames", True) == [
        "width: 50 asked, 48 made (the pipeline rounds it)",
        "frames: 4 asked, 5 made (the pipeline rounds it)",
    ]
    assert (
        size_notes({"width": 64, "height": 64, "num_frames": 4}, (64, 64, 8), "num_frames", False) == []
    )  # DFR doubles its frames
    assert size_notes({"width": 50, "height": 64}, None, None, True) == []  # latents


def test_the_effective_recipe_gives_every_family_the_same_call(tmp_path: Path) -> None:
    """What the run JSON records, read back, makes the very call the run made: defaults written out
    in recipe key names, and nothing a family refuses (a true CFG scale where it has none)."""
    from accel.models.call import effective_recipe

    picture().save(tmp_path / "in.png")
    for family in FAMILIES.values():
        for tiny in (True, False):
            image = (
                {"image": str(tmp_path / "in.png")} if needs_picture(family.name) else {}
            )  # ChronoEdit's call needs one
            given = Recipe.from_dict({"generate": {"seed": 3, **image}})
            call = generation_kwargs(family, tiny, given)
            written = effective_recipe(given, call, family.frames_arg, "cpu", "float32")
            again = Recipe.from_dict(written.to_dict())
            assert generation_kwargs(family, tiny, again) == call, (family.name, tiny)
            assert again.generate.steps == call["num_inference_steps"] and again.model.device == "cpu"
