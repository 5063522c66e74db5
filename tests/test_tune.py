"""`accel tune --target`: the search on synthetic lines (bisection, early stops, the Pareto front),
the target's parsing, and the whole command on tiny-flux, on one process and on two gloo ranks;
the chosen recipe is run again and must meet the target."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import commands
import tomli_w
from PIL import Image
from typer.testing import CliRunner, Result

from accel.cache.config import CACHE_METHODS
from accel.cli import app
from accel.errors import UserError
from accel.recipe import load_recipe
from accel.tune.search import (
    THRESHOLDS,
    Line,
    Search,
    Trial,
    describe,
    lines,
    mark_pareto,
    parse_methods,
    run_search,
    warmup_lines,
)
from accel.tune.target import Target, parse_target
from accel.tune.trials import with_cache

PSNR_40 = Target("psnr", 40.0)


class Synthetic:
    """A probe whose quality falls and speed rises along each line's knob index, as caching does."""

    def __init__(self, quality: dict[str, list[float]], speed: dict[str, list[float]], hits: float = 0.5) -> None:
        self.quality, self.speed, self.hits = quality, speed, hits
        self.calls: list[tuple[str, int]] = []

    def __call__(self, cache: dict[str, Any], line: str, to_beat: float) -> Trial:
        knob = "interval" if cache["method"] == "taylorseer" else "threshold"
        index = list(THRESHOLDS if knob == "threshold" else (2, 3, 4, 5, 6, 8)).index(cache[knob])
        self.calls.append((line, index))
        quality = self.quality[line][index]
        return Trial(line, cache, self.speed[line][index], quality, 1.0, self.hits, 2, quality >= 40.0)


def falling(start: float, step: float, count: int = len(THRESHOLDS)) -> list[float]:
    return [start - step * i for i in range(count)]


@pytest.mark.parametrize("last_passing", [-1, 0, 3, 8, 15, 16])
def test_bisection_finds_the_most_caching_setting_that_meets_the_target(last_passing: int) -> None:
    line = Line("fbcache", {"method": "fbcache"}, "threshold", THRESHOLDS)
    quality = [45.0 if i <= last_passing else 35.0 - i for i in range(len(THRESHOLDS))]
    probe = Synthetic({"fbcache": quality}, {"fbcache": [1.0 + 0.1 * i for i in range(len(THRESHOLDS))]})
    search = Search(PSNR_40, probe)
    search.run_line(line)
    if last_passing < 0:
        assert search.best is None
    else:
        assert search.best is not None and search.best.cache["threshold"] == THRESHOLDS[last_passing]
    assert len(probe.calls) <= 1 + math.ceil(math.log2(len(THRESHOLDS) + 1)), "bisection, not a sweep"
    assert probe.calls[0] == ("fbcache", len(THRESHOLDS) - 1), "the most caching setting first"


def test_a_line_whose_fastest_setting_cannot_beat_the_best_costs_one_measurement() -> None:
    count = len(THRESHOLDS)
    probe = Synthetic(
        {"fast": falling(45.0, 0.1), "slow": falling(50.0, 2.0)},
        {"fast": [3.0] * count, "slow": [1.0 + 0.1 * i for i in range(count)]},
    )
    search = Search(PSNR_40, probe)
    search.run_line(Line("fast", {"method": "fbcache"}, "threshold", THRESHOLDS))
    assert len(probe.calls) == 1 and search.best is not None and search.best.speedup == 3.0, (
        "its top meets: nothing to bisect"
    )
    search.run_line(Line("slow", {"method": "dbcache"}, "threshold", THRESHOLDS))
    assert [call for call in probe.calls if call[0] == "slow"] == [("slow", count - 1)]
    assert search.best.line == "fast"


def test_bisection_stops_once_a_failing_setting_is_no_faster_than_the_best() -> None:
    count = len(THRESHOLDS)
    probe = Synthetic(
        {"other": [45.0] * count, "steep": falling(60.0, 5.0)},
        {"other": [2.0] * count, "steep": [1.0 + 0.2 * i for i in range(count)]},
    )
    search = Search(PSNR_40, probe)
    search.run_line(Line("other", {"method": "fbcache"}, "threshold", THRESHOLDS))
    search.run_line(Line("steep", {"method": "dbcache"}, "threshold", THRESHOLDS))
    # steep: top (index 16, 4.2x) fails; index 7 (2.4x) fails; index 3 (1.6x) passes but is slower than 2x;
    # index 5 (2.0x) fails and is no faster than the best: everything below it is slower, so it stops.
    assert [index for line, index in probe.calls if line == "steep"] == [16, 7, 3, 5]
    assert search.best is not None and search.best.line == "other"


def test_a_setting_that_caches_nothing_is_never_the_choice() -> None:
    probe = Synthetic({"fbcache": [45.0] * len(THRESHOLDS)}, {"fbcache": [1.2] * len(THRESHOLDS)}, hits=0.0)
    search = Search(PSNR_40, probe)
    search.run_line(Line("fbcache", {"method": "fbcache"}, "threshold", THRESHOLDS))
    assert search.best is None and search.trials[0].meets


def test_the_search_runs_every_line_then_the_winner_with_longer_warm_ups() -> None:
    names = [line.name for line in lines(4, 8, ((1.0, 0.9),))]
    assert names == [
        "fbcache",
        "fbcache + taylorseer",
        "dbcache F2B0",
        "dbcache F2B0 + taylorseer",
        "dbcache F1B1",
        "dbcache F1B1 + taylorseer",
        "taylorseer",
        "taylorseer early",
        "taylorseer early+1",
        "magcache",
    ]
    deep = [line.name for line in lines(57, 3, None)]
    assert "dbcache F4B4 + taylorseer" in deep and "magcache" not in deep
    assert next(line for line in lines(57, 3, None) if line.name == "taylorseer").values == (2,), (
        "intervals shorter than the run"
    )
    quality = {line.name: falling(55.0, 2.0) for line in lines(4, 12, None)}
    speed = {name: [1.0 + 0.1 * i for i in range(len(THRESHOLDS))] for name in quality}
    for name in ("taylorseer", "taylorseer early", "taylorseer early+1"):
        quality[name] = falling(55.0, 5.0, 6)
        speed[name] = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
    for line, start in zip(
        warmup_lines(next(line for line in lines(4, 12, None) if line.name == "fbcache"), 12), (50.0, 52.0, 57.0)
    ):
        quality[line.name] = falling(start, 1.0)  # the longer the warm-up, the better at the same threshold
        speed[line.name] = [1.0 + 0.1 * i for i in range(len(THRESHOLDS))]
    probe = Synthetic(quality, speed)
    search = run_search(PSNR_40, probe, 4, 12, None)
    assert search.best is not None and search.best.line == "fbcache, warmup_steps 4"
    assert search.best.cache == {"method": "fbcache", "warmup_steps": 4, "threshold": THRESHOLDS[16]}
    assert describe(search.best.cache) == "fbcache t=1.28 warm-up 4"


def test_methods_keep_only_their_lines_and_the_search_measures_no_other() -> None:
    ratios = ((1.0, 0.9),)
    assert [line.name for line in lines(4, 8, ratios, frozenset({"fbcache"}))] == ["fbcache", "fbcache + taylorseer"]
    assert [line.name for line in lines(4, 8, ratios, frozenset({"taylorseer", "magcache"}))] == [
        "taylorseer",
        "taylorseer early",
        "taylorseer early+1",
        "magcache",
    ]
    assert lines(4, 8, ratios, None) == lines(4, 8, ratios), "no filter: every line"
    every = lines(4, 12, None)
    quality = {line.name: falling(55.0, 2.0) for line in every}
    for line in every:
        for warm in warmup_lines(line, 12):
            quality[warm.name] = falling(57.0, 1.0)
    speed = {name: [1.0 + 0.1 * i for i in range(len(THRESHOLDS))] for name in quality}
    speed["fbcache"] = [2.0 + 0.1 * i for i in range(len(THRESHOLDS))]  # the winner, were it searched
    probe = Synthetic(quality, speed)
    search = run_search(PSNR_40, probe, 4, 12, None, methods=frozenset({"dbcache"}))
    measured = {line for line, _ in probe.calls}
    assert measured >= {"dbcache F2B0", "dbcache F1B1 + taylorseer"}
    assert all(trial.cache["method"] == "dbcache" for trial in search.trials), measured
    assert search.best is not None and search.best.line.startswith("dbcache ") and "warmup_steps" in search.best.line


def test_methods_parse_from_the_cache_registry() -> None:
    assert parse_methods(" FBCache , taylorseer,") == frozenset({"fbcache", "taylorseer"})
    assert parse_methods("fbcache,dbcache,taylorseer,magcache") == frozenset(CACHE_METHODS)


def test_methods_with_no_line_on_this_pipeline_are_refused() -> None:
    with pytest.raises(UserError) as refused:
        run_search(PSNR_40, Synthetic({}, {}), 2, 2, None, methods=frozenset({"dbcache", "taylorseer"}))
    assert str(refused.value) == (
        "--methods dbcache,taylorseer: no dbcache or taylorseer setting fits this pipeline (2 blocks, 2 steps); "
        "add another method"
    )


def test_warm_up_lines_use_the_method_s_own_key() -> None:
    taylor = Line("taylorseer", {"method": "taylorseer"}, "interval", (2, 3))
    assert [line.base for line in warmup_lines(taylor, 12)] == [
        {"method": "taylorseer", "disable_before": w} for w in (1, 2, 4)
    ]
    assert [
        line.base["warmup_steps"] for line in warmup_lines(Line("f", {"method": "fbcache"}, "threshold", (0.1,)), 6)
    ] == [1, 2]


def test_the_pareto_front_is_what_no_other_complete_setting_beats_in_both() -> None:
    def trial(speedup: float, psnr_db: float, stopped: str | None = None) -> Trial:
        return Trial("l", {"method": "fbcache", "threshold": 0.1}, speedup, psnr_db, 1.0, 0.5, 2, True, stopped)

    trials = [
        trial(1.5, 50.0),
        trial(2.0, 45.0),
        trial(1.4, 49.0),
        trial(2.0, 44.0),
        trial(3.0, 60.0, "below the target on prompt 1"),
    ]
    mark_pareto(trials, PSNR_40)
    assert [t.pareto for t in trials] == [True, True, False, False, False]


def test_describe_names_every_knob() -> None:
    assert (
        describe(
            {"method": "dbcache", "first_blocks": 2, "last_blocks": 1, "calibrator": "taylorseer", "threshold": 0.226}
        )
        == "dbcache F2B1 +taylorseer t=0.226"
    )
    assert describe({"method": "taylorseer", "interval": 4, "disable_before": 2}) == "taylorseer every 4 from step 2"
    assert describe({"method": "taylorseer", "interval": 2, "extrapolate_early": True}) == "taylorseer every 2 early"
    assert (
        describe(
            {
                "method": "taylorseer",
                "interval": 4,
                "extrapolate_early": True,
                "disable_before": 1,
                "interval_offset": 1,
            }
        )
        == "taylorseer every 4 early offset 1 from step 1"
    )
    assert describe({"method": "magcache", "threshold": 0.08, "mag_ratios": ((1.0,),)}) == "magcache t=0.08"


@pytest.mark.parametrize(("text", "target"), [("psnr=32", Target("psnr", 32.0)), ("SSIM = 0.95", Target("ssim", 0.95))])
def test_targets_parse(text: str, target: Target) -> None:
    assert parse_target(text) == target


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "lpips=0.1",
            "--target lpips=0.1: write METRIC=VALUE with METRIC psnr or ssim, e.g. --target psnr=32 or --target "
            "ssim=0.95",
        ),
        ("psnr=high", "--target psnr=high: 'high' is not a number; e.g. --target psnr=32 or --target ssim=0.95"),
        (
            "psnr=inf",
            "--target psnr=inf: a PSNR target is a finite number of dB above 0 (e.g. psnr=32); an identical output "
            "needs no cache",
        ),
        (
            "ssim=1",
            "--target ssim=1: an SSIM target lies between 0 and 1 (e.g. ssim=0.95); 1 means an identical output, "
            "which needs no cache",
        ),
    ],
)
def test_bad_targets_are_one_line(text: str, message: str) -> None:
    with pytest.raises(UserError) as refused:
        parse_target(text)
    assert str(refused.value) == message


# --- the command on tiny-flux --------------------------------------------------------------------

PROMPTS = ("a red fox in the snow, photograph", "a lighthouse on a rocky coast at dusk")


@pytest.fixture(scope="module")
def small_recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux at 32×32 over 6 steps: enough calls to cache, quick to repeat."""
    data = load_recipe("recipes/tiny-flux.toml").to_dict()
    data["generate"].update(height=32, width=32, steps=6)
    data["cache"] = {"threshold": 0.4}
    data["bench"] = {"repeats": 1, "warmup": 0}
    path = tmp_path_factory.mktemp("tune") / "small.toml"
    path.write_bytes(tomli_w.dumps(data).encode())
    return path


def _prompts(folder: Path, texts: tuple[str, ...]) -> Path:
    path = folder / "prompts.txt"
    path.write_text("# calibration prompts\n\n" + "\n".join(texts) + "\n")
    return path


def _tune(recipe: Path, out: Path, prompts: tuple[str, ...], *args: str) -> Result:
    """`accel tune RECIPE ARGS --prompts (a file of prompts beside out) --out out`, in this process."""
    return CliRunner().invoke(
        app,
        ["tune", str(recipe), *args, "--prompts", str(_prompts(out.parent, prompts)), "--out", str(out)],
        catch_exceptions=False,
    )


def _image(recipe: Any) -> np.ndarray:
    import accel
    from accel.models.registry import family_of
    from accel.generate import generate
    from accel.models.call import generation_kwargs

    pipe = accel.load_pipeline(recipe.model.name)
    pipe.set_progress_bar_config(disable=True)
    family = family_of(pipe)
    handle = accel.apply(pipe, recipe)
    try:
        return generate(pipe, generation_kwargs(family, True, recipe, pipe), recipe.generate.seed)
    finally:
        handle.remove()


def test_tune_finds_a_setting_that_meets_the_target_and_its_recipe_does(small_recipe: Path, tmp_path: Path) -> None:
    from accel.quality import psnr

    out, plot = tmp_path / "tuned.toml", tmp_path / "curve.png"
    result = _tune(small_recipe, out, PROMPTS, "--target", "psnr=45", "--plot", str(plot))
    assert result.exit_code == 0, result.output
    assert "★" in result.stdout and f"wrote {out} and {plot}" in result.stdout
    tuned = load_recipe(out)
    assert tuned.cache.enabled and tuned.generate == load_recipe(small_recipe).generate and not tuned.variants
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 300
    for prompt in PROMPTS:  # the chosen setting, run again, meets the target on every prompt
        prompted = tuned.with_overrides({"generate": {"prompt": prompt}})
        assert psnr(_image(prompted), _image(with_cache(prompted, {}))) >= 45.0


def test_magcache_alone_needs_no_curve_in_the_recipe(small_recipe: Path, tmp_path: Path) -> None:
    """The search measures MagCache's curve itself, so a recipe without mag_ratios can be tuned to magcache."""
    assert not any(load_recipe(small_recipe).cache.mag_ratios)
    out = tmp_path / "mag.toml"
    result = _tune(small_recipe, out, PROMPTS[:1], "--target", "psnr=30", "--methods", "magcache")
    assert result.exit_code == 0, result.output
    assert "calibrating MagCache's curve" in result.stdout
    tuned = load_recipe(out)
    assert tuned.cache.method == "magcache" and any(tuned.cache.mag_ratios)


def test_an_unreachable_target_is_refused_with_the_closest_setting(small_recipe: Path, tmp_path: Path) -> None:
    out = tmp_path / "never.toml"
    result = _tune(small_recipe, out, PROMPTS[:1], "--target", "psnr=300")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert line.startswith(
        "error: accel tune: no cache setting reaches PSNR ≥ 300 dB on every prompt; the closest, "
    ) and line.endswith("; lower the target"), line
    assert not out.exists() and not out.with_suffix(".png").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            [],
            "accel tune: pass --target psnr=32 (or ssim=0.95) to search for the fastest cache setting that meets it, "
            "or --calibrate to "
            "measure MagCache's curve",
        ),
        (
            ["--target", "psnr=30", "--calibrate"],
            "accel tune: pass --target psnr=32 (or ssim=0.95) to search for the fastest cache setting "
            "that meets it, or --calibrate to measure MagCache's curve; not both",
        ),
        (
            ["--target", "psnr"],
            "--target psnr: write METRIC=VALUE with METRIC psnr or ssim, e.g. --target psnr=32 or --target ssim=0.95",
        ),
        (
            ["--target", "psnr=30", "--prompts", "missing.txt"],
            "--prompts missing.txt: cannot read it (No such file or directory)",
        ),
        (
            ["--target", "psnr=30", "--methods", "fbcach"],
            "--methods fbcach: unknown cache method 'fbcach' (did you mean 'fbcache'?)",
        ),
        (
            ["--target", "psnr=30", "--gpus", "2", "--methods", "fbcache,lru"],
            "--methods fbcache,lru: unknown cache method 'lru' (valid methods: fbcache, dbcache, taylorseer, magcache)",
        ),
        (
            ["--target", "psnr=30", "--methods", " , "],
            "--methods is empty: name one or more cache methods, comma-separated (fbcache, dbcache, taylorseer, "
            "magcache)",
        ),
        (
            ["--calibrate", "--methods", "fbcache"],
            "--methods is for --target (the cache methods it searches); --calibrate measures MagCache's curve only",
        ),
        (["--target", "psnr=30", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--target", "psnr=30", "--gpus", "0"], "--gpus must be >= 1, got 0"),
        (
            ["--target", "psnr=30", "--out", "no/such/folder/x.toml"],
            "--out no/such/folder/x.toml: no folder no/such/folder; create it or pass another --out",
        ),
    ],
)
def test_tune_refusals_are_one_line_before_any_model_loads(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["tune", "recipes/tiny-flux.toml", *args], catch_exceptions=False)
    assert result.exit_code == 2 and result.stderr.strip() == f"error: {message}"


def test_tune_refuses_an_empty_prompt_file_and_an_existing_plot(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    runner = CliRunner()
    result = runner.invoke(
        app, ["tune", "recipes/tiny-flux.toml", "--target", "psnr=30", "--prompts", str(empty)], catch_exceptions=False
    )
    assert (
        result.exit_code == 2
        and result.stderr.strip() == f"error: --prompts {empty}: no prompt in it; write one prompt a line"
    )
    taken = tmp_path / "taken.png"
    taken.write_bytes(b"")
    result = runner.invoke(
        app,
        [
            "tune",
            "recipes/tiny-flux.toml",
            "--target",
            "psnr=30",
            "--out",
            str(tmp_path / "t.toml"),
            "--plot",
            str(taken),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --plot {taken} exists: accel tune never overwrites; pass another --plot"


def test_tune_on_two_ranks_searches_together_and_writes_one_recipe(small_recipe: Path, tmp_path: Path) -> None:
    out = tmp_path / "two.toml"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = commands.run(
        [
            sys.executable,
            "-m",
            "accel.cli",
            "tune",
            str(small_recipe),
            "--target",
            "psnr=40",
            "--gpus",
            "2",
            "--methods",
            "fbcache",
            "--prompts",
            str(_prompts(tmp_path, PROMPTS[:1])),
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("chosen: ") == 1, "rank 0 alone reports"
    searched = [line for line in done.stdout.splitlines() if line.startswith("line ")]
    assert searched and all(line.startswith("line fbcache") for line in searched), searched
    assert "calibrating MagCache's curve" not in done.stdout, "no magcache line, so no curve to measure"
    tuned = load_recipe(out)
    assert tuned.parallel.world_size == 2 and tuned.cache.enabled and tuned.cache.method == "fbcache"
    assert out.with_suffix(".png").is_file()
