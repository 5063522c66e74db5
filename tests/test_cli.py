"""`accel run / models / env` in-process (Typer's runner) and as the installed console script."""

from __future__ import annotations

import dataclasses

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import commands
from PIL import Image
from typer.testing import CliRunner

from accel.cli import app
from accel.media import read_video
from accel.recipe.sections import SECTIONS

ACCEL = str(Path(sys.executable).parent / "accel")
runner = CliRunner()


def invoke(*args: str) -> object:
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_run_tiny_flux_writes_a_png_and_json(tmp_path: Path) -> None:
    out, report = tmp_path / "fox.png", tmp_path / "m.json"
    result = invoke("run", "tiny-flux", "--steps", "3", "--out", str(out), "--json", str(report), "--cache", "0.3")
    assert result.exit_code == 0, result.output
    image = Image.open(out)
    assert image.size == (64, 64) and image.mode == "RGB"
    metrics = json.loads(report.read_text())
    assert metrics["model"] == "tiny-flux" and metrics["family"] == "flux" and metrics["steps"] == 3
    assert metrics["cache"]["transformer_calls"] == 3
    assert metrics["generate_s"] > 0 and metrics["per_step_s"] == pytest.approx(metrics["generate_s"] / 3)
    for label in ("load", "warm-up", "generation", "per step", "steps/s", "cache hit rate", "peak memory"):
        assert label in result.stdout


def test_run_with_dbcache_and_taylorseer_caches_every_call_after_the_first(tmp_path: Path) -> None:
    report = tmp_path / "m.json"
    result = invoke(
        "run",
        "tiny-flux",
        "--steps",
        "4",
        "-o",
        str(tmp_path / "a.png"),
        "--json",
        str(report),
        "--warmup",
        "0",
        "--cache",
        "1e9",
        "--cache-method",
        "dbcache",
        "--first-blocks",
        "2",
        "--last-blocks",
        "1",
        "--calibrator",
        "taylorseer",
        "--taylor-order",
        "2",
        "--max-cached-steps",
        "2",
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads(report.read_text())
    assert [call["cached"] for call in metrics["cache"]["calls"]] == [False, True, True, False]  # two at most


def test_json_has_exactly_the_documented_fields(tmp_path: Path) -> None:
    report = tmp_path / "m.json"
    assert (
        invoke(
            "run", "tiny-flux", "--steps", "1", "-o", str(tmp_path / "a.png"), "--json", str(report), "--warmup", "0"
        ).exit_code
        == 0
    )
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    documented = readme.split("`--json PATH` writes one object:", 1)[1].split("\n\n", 1)[0]
    fields = set(json.loads(report.read_text()))
    assert fields == {
        "model",
        "family",
        "output_kind",
        "device",
        "dtype",
        "recipe",
        "command",
        "versions",
        "load_s",
        "warmup_s",
        "generate_s",
        "times_s",
        "per_step_s",
        "steps_per_s",
        "steps",
        "peak_memory_bytes",
        "peak_memory_kind",
        "planned_peak_bytes",
        "output_path",
        "cache",
        "parallel",
        "quant",
        "compile",
        "baseline_s",
        "speedup",
        "psnr_db",
        "ssim",
        "output_frames",
        "output_width",
        "output_height",
        "notes",
        "min_s",
        "max_s",
        "threads",
        "speedup_min",
        "speedup_max",
        "baseline_times_s",
        "compare_order",
    }
    assert all(f"`{name}`" in documented for name in fields)


def test_the_json_reruns_the_run_to_the_same_bytes(tmp_path: Path) -> None:
    """`--json` holds the effective recipe (recipe key names), the command line and the versions;
    `accel run --recipe THAT.json` rebuilds the run: the same PNG, byte for byte. A prompt longer than
    the CLIP tokenizer's 77 tokens (30 words, each of 3 byte tokens, plus 2 specials: 92) is a note."""
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    prompt = " ".join(["fox"] * 30)
    args = [
        "run",
        "tiny-flux",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--prompt",
        prompt,
        "--cache",
        "0.2",
        "--warmup",
        "0",
    ]
    result = invoke(*args, "-o", str(tmp_path / "a.png"), "--json", str(first))
    assert result.exit_code == 0, result.output
    note = "prompt: 77 of 92 tokens kept (CLIPTokenizer's limit, tokenizer)"
    assert f"note: {note}" in result.stdout
    document = json.loads(first.read_text())
    assert document["notes"] == [note]
    assert document["recipe"]["generate"] == {
        "prompt": prompt,
        "steps": 2,
        "height": 32,
        "width": 48,
        "guidance_scale": 3.5,
        "seed": 0,
    }
    assert document["recipe"]["model"] == {"name": "tiny-flux", "dtype": "float32", "device": "cpu", "pipeline": ""}
    assert document["recipe"]["cache"]["threshold"] == 0.2 and set(document["recipe"]) == set(SECTIONS)
    assert (document["output_width"], document["output_height"], document["device"]) == (48, 32, "cpu")
    assert set(document["versions"]) == {"python", "accel", "torch", "diffusers", "transformers", "torchao"}
    assert document["command"][0] == "accel"
    result = invoke("run", "--recipe", str(first), "-o", str(tmp_path / "b.png"), "--json", str(again), "--warmup", "0")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "b.png").read_bytes() == (tmp_path / "a.png").read_bytes()
    assert json.loads(again.read_text())["recipe"] == document["recipe"]


def test_run_tiny_wan_writes_a_readable_mp4(tmp_path: Path) -> None:
    out = tmp_path / "fox.mp4"
    result = invoke("run", "tiny-wan", "--steps", "2", "--frames", "5", "--out", str(out), "--warmup", "0")
    assert result.exit_code == 0, result.output
    frames = read_video(out)
    assert frames.shape == (5, 64, 64, 3)


def test_compare_reports_speedup_and_psnr(tmp_path: Path) -> None:
    report = tmp_path / "m.json"
    result = invoke(
        "run",
        "tiny-flux",
        "--cache",
        "1e9",
        "--compare",
        "--steps",
        "4",
        "-o",
        str(tmp_path / "a.png"),
        "--json",
        str(report),
        "--warmup",
        "0",
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads(report.read_text())
    assert metrics["cache"]["cached_calls"] == 3
    assert metrics["baseline_s"] > 0 and metrics["speedup"] == pytest.approx(
        metrics["baseline_s"] / metrics["generate_s"]
    )
    assert 0 < metrics["psnr_db"] < 100
    assert 0 < metrics["ssim"] < 1
    assert "speedup" in result.stdout and "PSNR vs baseline" in result.stdout and "SSIM vs baseline" in result.stdout


def test_repeats_times_every_run_and_reports_the_median(tmp_path: Path) -> None:
    report = tmp_path / "m.json"
    result = invoke(
        "run",
        "tiny-flux",
        "--steps",
        "2",
        "--repeats",
        "3",
        "--warmup",
        "0",
        "-o",
        str(tmp_path / "a.png"),
        "--json",
        str(report),
    )
    assert result.exit_code == 0, result.output
    metrics = json.loads(report.read_text())
    assert len(metrics["times_s"]) == 3 and metrics["generate_s"] == sorted(metrics["times_s"])[1]
    assert invoke("run", "tiny-flux", "--repeats", "0").exit_code == 2


def test_threshold_zero_compare_is_identical(tmp_path: Path) -> None:
    report = tmp_path / "m.json"
    result = invoke(
        "run",
        "tiny-flux",
        "--compare",
        "--steps",
        "2",
        "-o",
        str(tmp_path / "a.png"),
        "--json",
        str(report),
        "--warmup",
        "0",
    )
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["psnr_db"] == "inf"
    assert json.loads(report.read_text())["ssim"] == 1.0
    assert "identical" in result.stdout


def test_recipe_file_and_flags_combine(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[model]\nname = "tiny-flux"\n[generate]\nsteps = 3\nheight = 48\nwidth = 80\n[cache]\nthreshold = 0.2\n'
    )
    report = tmp_path / "m.json"
    result = invoke("run", "-r", str(recipe), "--height", "32", "-o", str(tmp_path / "a.png"), "--json", str(report))
    assert result.exit_code == 0, result.output
    metrics = json.loads(report.read_text())
    generate = metrics["recipe"]["generate"]
    assert generate["height"] == 32 and generate["width"] == 80 and generate["steps"] == 3 and metrics["steps"] == 3
    assert metrics["recipe"]["cache"]["threshold"] == 0.2
    assert Image.open(tmp_path / "a.png").size == (80, 32)


def test_default_output_names_never_overwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert invoke("run", "tiny-flux", "--steps", "1", "--warmup", "0").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["tiny-flux-1.png", "tiny-flux.png"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "tiny-flx"], "unknown model 'tiny-flx' (did you mean 'tiny-flux'?)"),
        (["run"], "no model given: pass MODEL (e.g. tiny-flux) or set [model] name in the recipe"),
        (["run", "tiny-flux", "--cache", "-1"], "command line: [cache] threshold must be a number >= 0, got -1.0"),
        (["run", "tiny-flux", "--steps", "0"], "command line: [generate] steps must be an integer >= 1, got 0"),
        (
            ["run", "tiny-flux", "--dtype", "float64"],
            "command line: [model] dtype must be one of auto, float32, float16, bfloat16, got 'float64'",
        ),
        (
            ["run", "tiny-flux", "--quant", "int3"],
            "command line: [quant] type must be one of none, int8wo, int8dq, fp8dq, fp8wo, int4wo, got 'int3'",
        ),
        (["run", "tiny-flux", "--gpus", "0"], "--gpus must be >= 1, got 0"),
        (
            ["run", "tiny-flux", "--gpus", "6", "--ulysses", "6", "--oversubscribe"],
            "[parallel] ulysses = 6 is more than the 4 attention heads of tiny-flux; use ulysses = 2, ring = 3 for 6 "
            "sequence-parallel ranks",
        ),
        (
            ["run", "tiny-flux", "--gpus", "4", "--ulysses", "3", "--oversubscribe"],
            "[parallel] ulysses 3 × ring 1 × cfg 1 = 3 processes, but gpus = 4; make the product 4 or leave the "
            "degrees out to have them chosen",
        ),
        (
            ["run", "tiny-flux", "--ulysses", "8", "--oversubscribe"],
            "[parallel] ulysses = 8 is more than the 4 attention heads of tiny-flux; use ulysses = 4, ring = 2 for 8 "
            "sequence-parallel ranks",
        ),
        (
            ["run", "tiny-flux", "--gpus", "4", "--nnodes", "3"],
            "4 processes do not split evenly over --nnodes 3; use a multiple of 3 GPUs",
        ),
        (
            ["run", "tiny-flux", "--gpus", "4", "--nnodes", "2"],
            "--nnodes > 1 needs --master-addr (the address of node 0) on every node",
        ),
        (
            ["run", "tiny-wan", "--gpus", "2", "--cfg-parallel", "--guidance", "1"],
            "[parallel] cfg = 2 splits the classifier-free guidance branches, but guidance_scale is 1.0, and guidance "
            "runs only above 1; turn guidance on or set cfg = 1",
        ),
        (
            ["run", "tiny-flux", "--gpus", "2", "--cfg-parallel"],
            "[parallel] cfg = 2 splits the classifier-free guidance branches, but true_cfg_scale is not set, and "
            "guidance runs only above 1; turn guidance on or set cfg = 1",
        ),
        (
            ["run", "tiny-flux2", "--gpus", "2", "--cfg-parallel"],
            "[parallel] cfg = 2: FLUX.2 [dev] pipelines have no classifier-free guidance to split; set cfg = 1",
        ),
        (
            ["run", "tiny-hunyuan", "--cfg-parallel", "--true-cfg", "3"],
            "[parallel] cfg = 2 splits the classifier-free guidance branches, but there is no negative prompt, which "
            "HunyuanVideo needs for true CFG; turn guidance on or set cfg = 1",
        ),
        (["launch", "missing.py"], "missing.py: no such script"),
        (["launch", "--gpus", "0", "missing.py"], "--gpus must be >= 1, got 0"),
        (["run", "tiny-flux", "--frames", "9"], "[generate] frames: FLUX.1 makes images; remove frames"),
        (["run", "tiny-flux", "-o", "x.mp4"], "--out x.mp4: FLUX.1 makes images, so the name must end in .png"),
        (["run", "tiny-flux", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        # Sizes the pipeline would round: refused, naming the sizes it makes (before the model loads).
        (
            ["run", "tiny-flux", "--height", "50", "--width", "50"],
            "[generate] height 50: FLUX.1 makes heights in multiples of 16 pixels; use 48 or 64",
        ),
        (["run", "tiny-flux", "--width", "8"], "command line: [generate] width must be an integer >= 16, got 8"),
        (
            ["run", "tiny-wan", "--frames", "4"],
            "[generate] frames 4: Wan 2.1 / 2.2 makes 4k+1 frames (1, 5, 9, …); use 1 or 5",
        ),
        (
            ["run", "tiny-ltx2", "--width", "100"],
            "[generate] width 100: LTX-2 makes widths in multiples of 32 pixels; use 96 or 128",
        ),
        (
            ["run", "tiny-flux", "--first-blocks", "2"],
            'command line: [cache] first_blocks is for method = "dbcache", not "fbcache"; '
            'set method = "dbcache" or remove first_blocks',
        ),
        (
            ["run", "tiny-flux", "--calibrator", "taylor"],
            "command line: [cache] calibrator must be none or taylorseer, got 'taylor'",
        ),
        (
            [
                "run",
                "tiny-flux",
                "--cache",
                "0.3",
                "--cache-method",
                "dbcache",
                "--first-blocks",
                "3",
                "--last-blocks",
                "1",
            ],
            "[cache] first_blocks (3) + last_blocks (1) leave none of FluxTransformer2DModel's 4 blocks to cache; "
            "make their sum at most 3",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {message}" or result.stderr.strip().startswith(f"error: {message}")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_bad_recipe_file_names_the_file(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[cache]\ntreshold = 0.1\n")
    result = invoke("run", "tiny-flux", "-r", str(recipe))
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {recipe}: unknown key [cache] treshold (did you mean 'threshold'?)"
    recipe.write_text("[cache\n")
    result = invoke("run", "tiny-flux", "-r", str(recipe))
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {recipe}: not valid TOML: ")


def test_existing_output_is_refused_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "a.png"
    out.write_bytes(b"keep me")
    result = invoke("run", "tiny-flux", "-o", str(out))
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == f"error: {out} already exists; pass --overwrite to replace it or choose another --out"
    )
    assert out.read_bytes() == b"keep me"
    result = invoke("run", "tiny-flux", "-o", str(out), "--overwrite", "--steps", "1", "--warmup", "0")
    assert result.exit_code == 0 and Image.open(out).size == (64, 64)


def test_models_lists_the_registry() -> None:
    result = runner.invoke(app, ["models"], env={"COLUMNS": "160"})  # a terminal wide enough for whole names
    assert result.exit_code == 0
    for name in (
        "flux",
        "hunyuan",
        "wan",
        "cogvideox",
        "mochi",
        "ltx",
        "tiny-flux",
        "tiny-wan",
        "FluxPipeline",
        "fbcache",
        "FluxKontextPipeline",
        "FluxFillPipeline",
        "WanVACEPipeline",
        "skyreels2",
        "tiny-skyreels2",
        "SkyReelsV2DiffusionForcingPipeline",
    ):  # the variants a family runs, under its own pipeline
        assert name in result.stdout
    from accel.models.registry import FAMILIES
    from accel.report import family_features

    assert family_features(FAMILIES["flux"]) == [
        "fbcache",
        "ulysses/ring/usp",
        "cfg: two calls",
        "vae-tiling",
        "vae: patch-parallel",
        "quant",
        "compile",
    ]
    assert family_features(FAMILIES["ltx"]) == [
        "fbcache",
        "ulysses/ring/usp",
        "cfg: batched",
        "vae-tiling",
        "vae: patch-parallel",
        "quant",
        "compile",
    ]
    unplanned = dataclasses.replace(FAMILIES["flux"].with_acceleration(parallel=None), vae="AutoencoderTiny")
    assert family_features(unplanned) == ["fbcache", "vae-tiling", "quant", "compile"]
    assert family_features(FAMILIES["qwenimage21"]) == [
        "fbcache",
        "ulysses/ring/usp",
        "cfg: two calls",
        "vae-tiling",
        "vae: patch-parallel",
        "quant",
        "compile",
    ]
    assert family_features(FAMILIES["cosmos3"]) == [
        "fbcache",
        "ulysses/ring/usp",
        "cfg: two calls",
        "vae-tiling",
        "vae: patch-parallel",
        "quant",
        "compile",
    ]
    assert result.stdout.count("ulysses/ring/usp") == len(FAMILIES)  # every family, unabridged
    assert result.stdout.count("vae: patch-parallel") == len(FAMILIES)


def test_env_reports_versions_and_kernels() -> None:
    import torch

    result = invoke("env", "--json")
    assert result.exit_code == 0
    info = json.loads(result.stdout)
    assert info["versions"]["torch"] == torch.__version__.split("+")[0] or info["versions"]["torch"].startswith(
        torch.__version__.split("+")[0]
    )
    assert info["attention_kernels"]["cpu flash (out + lse)"] is True
    assert info["devices"][0].startswith("cpu")


def test_console_script_runs_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    ok = subprocess.run(
        [ACCEL, "run", "tiny-flux", "--steps", "2", "-o", str(tmp_path / "x.png"), "--warmup", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0, ok.stderr
    assert np.asarray(Image.open(tmp_path / "x.png")).shape == (64, 64, 3)
    assert "generation" in ok.stdout and ok.stderr == ""
    video = commands.run(  # a video through a process of its own (forked: the console script is the other two)
        [
            sys.executable,
            "-m",
            "accel.cli",
            "run",
            "tiny-wan",
            "--steps",
            "2",
            "--cache",
            "0.5",
            "-o",
            str(tmp_path / "x.mp4"),
            "--warmup",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert video.returncode == 0, video.stderr
    assert read_video(tmp_path / "x.mp4").shape == (5, 64, 64, 3)
    assert "cache hit rate" in video.stdout
    bad = subprocess.run([ACCEL, "run", "tiny-flux", "--cache", "-2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr == "error: command line: [cache] threshold must be a number >= 0, got -2.0\n"
    assert "Traceback" not in bad.stdout + bad.stderr
