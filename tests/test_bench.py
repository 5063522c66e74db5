"""`accel bench`: the recipe library, variants run side by side, reports, refusals."""

from __future__ import annotations

import json
import os
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import commands
from PIL import Image
from typer.testing import CliRunner

from conftest import cold_compile_env
from variant_cases import needs_picture
from accel import figures
from accel.bench.plan import plan_bench
from accel.bench.run import run_bench
from accel.cli import app
from accel.media import read_video
from accel.models.registry import FAMILIES
from accel.recipe import Recipe, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
README = (ROOT / "README.md").read_text()
FAMILY_NAMES = sorted(FAMILIES)
runner = CliRunner()


def _documented(marker: str) -> set[str]:
    """The backticked field names of one README paragraph."""
    paragraph = README.split(marker, 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`([a-z_]+)`", paragraph))


TOP_FIELDS = {
    "recipe",
    "model",
    "family",
    "output_kind",
    "device",
    "dtype",
    "world_size",
    "repeats",
    "warmup",
    "settings",
    "peak_memory_kind",
    "threads",
    "baseline",
    "folder",
    "files",
    "variants",
}
VARIANT_FIELDS = {
    "name",
    "overrides",
    "status",
    "skip_reason",
    "world_size",
    "layout",
    "times_s",
    "median_s",
    "min_s",
    "max_s",
    "warmup_s",
    "steps",
    "per_step_s",
    "speedup",
    "speedup_min",
    "speedup_max",
    "cache_hit_rate",
    "peak_memory_bytes",
    "planned_peak_bytes",
    "psnr_db",
    "ssim",
    "output_path",
    "quant",
    "compile",
    "bytes_sent_per_rank",
}


def test_the_readme_documents_exactly_the_json_fields() -> None:
    assert TOP_FIELDS <= _documented("`bench.json` holds one object:")
    assert VARIANT_FIELDS <= _documented("Each entry of `variants`:")


# --- the recipe library -----------------------------------------------------------------------


def test_there_is_a_real_and_a_tiny_recipe_per_family() -> None:
    names = {path.stem for path in RECIPES.glob("*.toml")}
    assert names == set(FAMILY_NAMES) | {f"tiny-{name}" for name in FAMILY_NAMES}


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_validates_with_every_variant(path: Path, tmp_path: Path) -> None:
    recipe = load_recipe(path)
    family = path.stem.removeprefix("tiny-")
    assert recipe.model.name == (f"tiny-{family}" if path.stem.startswith("tiny-") else family)
    if needs_picture(
        family
    ):  # the user's picture, as the recipe's comment asks: its paths are read from where accel runs
        assert recipe.generate.image is None
        Image.new("RGB", (64, 64), (200, 120, 40)).save(tmp_path / "in.png")
        recipe = recipe.with_overrides({"generate": {"image": str(tmp_path / "in.png")}})
    assert recipe.variants, "a shipped recipe compares variants"
    baseline = recipe.variant(recipe.variants[0].name)
    assert baseline.cache.threshold == 0 and not baseline.compile.enabled and baseline.quant.type == "none"
    assert baseline.world_size == 1
    # Degrees checked against the real (or tiny) model's heads, generation settings, 8 processes.
    plan = plan_bench(recipe, gpus=8)
    assert [v.name for v in plan.variants] == [v.name for v in recipe.variants]
    assert all(v.world_size <= 8 for v in plan.variants)


# --- running ----------------------------------------------------------------------------------


def _grid_size(frame_hw: tuple[int, int], tiles: int, video: bool) -> tuple[int, int]:
    """The documented geometry (figures module docstring): longer side 256, label band, gaps."""
    height, width = frame_hw
    longer = max(height, width)
    fh, fw = (max(1, round(side * figures.TILE / longer)) for side in (height, width))
    left = figures.GAP + (figures.ROW_LABEL + figures.GAP if video else 0)
    rows = 3 if video else 1
    return left + tiles * (fw + figures.GAP), figures.GAP + figures.LABEL_BAND + rows * (fh + figures.GAP)


def _bench(*args: str, cwd: Path, compiles: bool) -> subprocess.CompletedProcess[str]:
    """A recipe that `compiles` runs from a cold inductor cache as a new user's first bench does, so in
    a new interpreter (the compile pool's exit is tests/test_rank_exit.py's); another in a fork of the
    preloaded fork server (tests/commands.py)."""
    return commands.run(
        [sys.executable, "-m", "accel.cli", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
        env=cold_compile_env(cwd, pool=False) if compiles else None,
    )


# One bench run per kind of output: an image with compile variants, a video with true CFG, a video
# with sound. Every other recipe is validated above; each family's layouts equal one process in
# tests/test_parallel_families.py and its apply / remove in tests/test_pipeline_contract.py, so a
# run of its recipe here would only repeat those (about 35 s each on two cores).
BENCHED = ("flux", "wan", "ltx2")


@pytest.mark.parametrize("family", BENCHED)
def test_tiny_recipe_runs_on_two_ranks_and_writes_every_report(family: str, tmp_path: Path) -> None:
    path = RECIPES / f"tiny-{family}.toml"
    recipe = load_recipe(path)
    out = tmp_path / "report"
    # One timed run and no warm-up per variant: a third of the recipe's generations, the same reports.
    compiles = any(recipe.variant(variant.name).compile.enabled for variant in recipe.variants)
    args = (str(path), "--gpus", "2", "--out", str(out), "--repeats", "1", "--warmup", "0")
    done = _bench(*args, cwd=tmp_path, compiles=compiles)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"accel bench {path}" in done.stdout
    document = json.loads((out / "bench.json").read_text())
    assert set(document) == TOP_FIELDS
    assert document["world_size"] == 2 and document["baseline"] == recipe.variants[0].name
    rows = {row["name"]: row for row in document["variants"]}
    assert list(rows) == [v.name for v in recipe.variants]
    ran = [row for row in document["variants"] if row["status"] == "ran"]
    count = len(recipe.variants)
    for index, row in enumerate(document["variants"], 1):
        assert set(row) == VARIANT_FIELDS
        # Progress: each variant's line as it starts and as it ends (or why it was skipped).
        ended = "skipped (" if row["status"] == "skipped" else "median "
        assert f"[{index}/{count}] {row['name']}: {ended}" in done.stdout
        wanted = recipe.variant(row["name"]).world_size
        if wanted > 2:  # reported, with its reason, in the table notes and the JSON
            assert row["status"] == "skipped" and row["times_s"] == [] and row["speedup"] is None
            reason = f"needs {wanted} processes; this run has 2 (--gpus {wanted})"
            assert row["skip_reason"] == reason and f"{row['name']} skipped: {reason}" in done.stdout
            continue
        assert row["status"] == "ran" and len(row["times_s"]) == 1
        assert row["min_s"] <= row["median_s"] <= row["max_s"] and row["per_step_s"] > 0
        assert row["peak_memory_bytes"] > 0
    assert rows[document["baseline"]]["speedup"] == 1.0 and rows[document["baseline"]]["psnr_db"] is None
    for row in ran[1:]:
        variant = recipe.variant(row["name"])
        psnr = math.inf if row["psnr_db"] == "inf" else row["psnr_db"]
        assert 0 < row["ssim"] <= 1.0 and psnr > 20
        exact = variant.cache.threshold == 0 and variant.quant.type == "none" and not variant.compile.enabled
        if exact:  # parallel layouts equal the single-process baseline
            assert psnr > 80, row
        assert (row["cache_hit_rate"] is None) == (variant.cache.threshold == 0)
    # Each output is readable, of the size the settings ask for.
    settings = document["settings"]
    video = document["output_kind"] == "video"
    for row in ran:
        file = Path(row["output_path"])
        assert file.parent == out
        if video:
            frames = read_video(file)
            assert frames.shape[1:] == (settings["height"], settings["width"], 3)
        else:
            assert Image.open(file).size == (settings["width"], settings["height"])
    grid = Image.open(out / "grid.png")
    assert grid.size == _grid_size((settings["height"], settings["width"]), len(ran), video)
    chart = Image.open(out / "speedup.png")
    assert chart.size == (800, round((1.2 + 0.45 * len(rows)) * 100))
    markdown = (out / "bench.md").read_text()
    assert "| variant | layout | median |" in markdown and all(f"| {name} |" in markdown for name in rows)
    assert "![grid](grid.png)" in markdown


def _tiny_recipe(variants: list[dict[str, Any]], **generate: Any) -> Recipe:
    return Recipe.from_dict(
        {
            "model": {"name": "tiny-flux"},
            "generate": {"steps": 3, **generate},
            "bench": {"repeats": 1, "warmup": 0, "variants": variants},
        }
    )


def test_a_quantized_variant_is_followed_by_a_fresh_pipeline(tmp_path: Path) -> None:
    recipe = _tiny_recipe([{"name": "plain"}, {"name": "int8wo", "quant": {"type": "int8wo"}}, {"name": "plain again"}])
    result = run_bench(plan_bench(recipe, gpus=1), tmp_path)
    assert result is not None
    plain, quantized, again = result.variants
    assert quantized.quant is not None and quantized.quant["quantized_layers"] > 0
    assert math.isfinite(quantized.psnr_db)
    assert again.psnr_db == math.inf and again.ssim == 1.0  # not still quantized
    assert [Path(v.output_path).name for v in result.variants] == [
        "01-plain.png",
        "02-int8wo.png",
        "03-plain_again.png",
    ]


def test_no_variants_compares_the_recipe_with_every_accelerator_off(tmp_path: Path) -> None:
    recipe = Recipe.from_dict(
        {
            "model": {"name": "tiny-flux"},
            "generate": {"steps": 6},
            "cache": {"threshold": 0.4},
            "bench": {"repeats": 1, "warmup": 0},
        }
    )
    plan = plan_bench(recipe, gpus=1)
    assert [v.name for v in plan.variants] == ["baseline", "recipe"]
    result = run_bench(plan, None)
    assert result is not None
    baseline, accelerated = result.variants
    assert baseline.cache_hit_rate is None and accelerated.cache_hit_rate is not None and accelerated.cache_hit_rate > 0
    assert accelerated.speedup is not None and accelerated.output_path is None


def _bench_on_rank(recipe_dict: dict[str, Any]) -> dict[str, Any] | None:
    result = run_bench(plan_bench(Recipe.from_dict(recipe_dict), gpus=4), None)
    return None if result is None else {v.name: (v.layout, v.psnr_db, v.times_s) for v in result.variants}


def test_smaller_variants_run_on_the_first_ranks_of_a_larger_job(rank_pools: Any) -> None:
    recipe = {
        "model": {"name": "tiny-flux"},
        "generate": {"steps": 2, "height": 48, "width": 80},
        "bench": {
            "repeats": 1,
            "warmup": 0,
            "variants": [
                {"name": "one"},
                {"name": "ulysses", "parallel": {"ulysses": 2}},
                {"name": "usp", "parallel": {"ulysses": 2, "ring": 2}},
                {"name": "ring", "parallel": {"ring": 2}},
            ],
        },
    }
    lead, *others = rank_pools(4).run(_bench_on_rank, recipe)
    assert others == [None, None, None]
    assert lead["ulysses"][0] == "ulysses 2" and lead["usp"][0] == "ulysses 2 × ring 2" and lead["ring"][0] == "ring 2"
    for name in ("ulysses", "usp", "ring"):
        assert lead[name][1] > 80, (name, lead[name])
        assert len(lead[name][2]) == 1


def test_a_cached_cfg_split_on_two_of_four_ranks_decides_as_one_process(rank_pools: Any) -> None:
    """Batched CFG split over a sub-job: the cache sums block 0's change over that sub-job's ranks
    and the ranks outside it stay out of every collective."""
    recipe = {
        "model": {"name": "tiny-cogvideox"},
        "generate": {"steps": 6},
        "cache": {"threshold": 0.7},
        "bench": {
            "repeats": 1,
            "warmup": 0,
            "variants": [
                {"name": "one"},
                {"name": "cfg", "parallel": {"cfg": 2}},
            ],
        },
    }
    lead, *others = rank_pools(4).run(_bench_on_rank, recipe)
    assert others == [None, None, None]
    assert lead["cfg"][0] == "cfg 2" and lead["cfg"][1] > 80, lead


# --- refusals: one line, exit 2, before any rank starts ---------------------------------------


def _write(tmp_path: Path, variants: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(f'[model]\nname = "tiny-flux"\n[bench]\nvariants = [ {{ name = "baseline" }}, {variants} ]\n')
    return path


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        (
            '{ name = "x", cache = { treshold = 0.1 } }',
            "[bench] variant 'x': unknown key [cache] treshold (did you mean 'threshold'?)",
        ),
        (
            '{ name = "x", cache = { threshold = -1 } }',
            "[bench] variant 'x': [cache] threshold must be a number >= 0, got -1",
        ),
        (
            '{ name = "x", parallel = { ulysses = 8 } }',
            "[bench] variant 'x': [parallel] ulysses = 8 is more than the 4 attention heads of tiny-flux",
        ),
        ('{ name = "x", model = { name = "tiny-wan" } }', "[bench] variant 'x' changes [model] name"),
        ('{ name = "x", model = { lora = ["style.safetensors"] } }', "[bench] variant 'x' changes [model] lora"),
        (
            '{ name = "x", generate = { frames = 3 } }',
            "[bench] variant 'x': [generate] frames: FLUX.1 makes images; remove frames",
        ),
        ('{ name = "baseline" }', "[bench] variant name 'baseline' is used twice"),
    ],
)
def test_a_bad_variant_is_refused_with_one_line(tmp_path: Path, variant: str, message: str) -> None:
    result = runner.invoke(app, ["bench", str(_write(tmp_path, variant)), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


def test_bench_refuses_an_unknown_only_and_anything_it_would_overwrite(tmp_path: Path) -> None:
    recipe = _write(tmp_path, '{ name = "cache", cache = { threshold = 0.4 } }')
    only = runner.invoke(app, ["bench", str(recipe), "--only", "cahce"])
    assert only.exit_code == 2 and "[bench] has no variant 'cahce' (did you mean 'cache'?)" in only.stderr
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    full = runner.invoke(app, ["bench", str(recipe), "--out", str(taken)])
    assert full.exit_code == 2 and "is not an empty folder; bench never overwrites" in full.stderr
    (tmp_path / "x.json").write_text("{}")
    existing = runner.invoke(app, ["bench", str(recipe), "--json", str(tmp_path / "x.json")])
    assert existing.exit_code == 2 and "x.json already exists" in existing.stderr
    assert (taken / "keep.txt").read_text() == "mine" and (tmp_path / "x.json").read_text() == "{}"


def test_bench_in_process_writes_a_fresh_folder_each_time_and_copies(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    recipe = _write(tmp_path, '{ name = "cache", cache = { threshold = 0.4 } }')
    first = runner.invoke(
        app, ["bench", str(recipe), "--repeats", "1", "--warmup", "0", "--json", "copy.json", "--markdown", "copy.md"]
    )
    assert first.exit_code == 0, first.output
    second = runner.invoke(app, ["bench", str(recipe), "--repeats", "1", "--warmup", "0", "--only", "cache"])
    assert second.exit_code == 0, second.output
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["bench-r", "bench-r-1"]
    copied = json.loads((tmp_path / "copy.json").read_text())
    assert copied == json.loads((tmp_path / "outputs" / "bench-r" / "bench.json").read_text())
    assert copied["repeats"] == 1 and [v["name"] for v in copied["variants"]] == ["baseline", "cache"]
    assert copied["threads"]["source"] in ("OMP_NUM_THREADS", "accel default") and copied["threads"]["count"] >= 1
    cache = copied["variants"][1]
    assert cache["speedup_min"] == cache["speedup_max"] == pytest.approx(cache["speedup"])  # one run each: one ratio
    assert "single repeat per variant and may be noise" in (tmp_path / "copy.md").read_text()
    assert (tmp_path / "copy.md").read_text() == (tmp_path / "outputs" / "bench-r" / "bench.md").read_text()
    assert np.asarray(Image.open(tmp_path / "outputs" / "bench-r-1" / "grid.png")).ndim == 3
    assert [p.name for p in tmp_path.iterdir() if ".accel" in p.name] == []  # claims released, no temporaries


def test_bench_refuses_a_report_copy_another_run_is_writing_before_it_measures(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from accel.files.claims import claim

    monkeypatch.chdir(tmp_path)
    recipe = _write(tmp_path, '{ name = "cache", cache = { threshold = 0.4 } }')
    with claim(tmp_path / "held.json"):  # as a concurrent bench aiming at the same copy
        result = runner.invoke(app, ["bench", str(recipe), "--json", "held.json"])
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        == f"error: held.json is being written by another accel run (pid {os.getpid()}); choose another name or wait "
        "for it"
    )
    assert not (tmp_path / "outputs").exists()  # refused before any measuring


def test_tensor_parallel_variants_and_a_fresh_pipeline_after_them(rank_pools: Any) -> None:
    """TP on the first two ranks and on all four (with Ulysses), text encoders on rank 0 only; the
    split and the dropped encoders cannot be undone, so the last variant gets a fresh pipeline and
    equals the first to the bit."""
    recipe = {
        "model": {"name": "tiny-flux"},
        "generate": {"steps": 2},
        "bench": {
            "repeats": 1,
            "warmup": 0,
            "variants": [
                {"name": "one"},
                {"name": "tp", "parallel": {"tp": 2}},
                {"name": "tp-usp", "parallel": {"tp": 2, "ulysses": 2}, "memory": {"text_encoder": "rank0"}},
                {"name": "one again"},
            ],
        },
    }
    lead, *others = rank_pools(4).run(_bench_on_rank, recipe)
    assert others == [None, None, None]
    assert lead["tp"][0] == "tp 2" and lead["tp-usp"][0] == "tp 2 × ulysses 2"
    assert lead["tp"][1] > 80 and lead["tp-usp"][1] > 80, lead
    assert lead["one again"][1] == math.inf
