"""Timings a user can trust: the CPU thread policy, median and min–max in the tables, the single-repeat
note, interleaved --compare runs, the speedup chart's whiskers and legend, and the demo's repeats."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
from matplotlib.container import ErrorbarContainer
from rich.console import Console

from accel.bench.results import BenchResult, VariantResult
from accel.figures import LEGEND_LABELS, speedup_figure
from accel.preflight import cpu_cores
from accel.recipe import Recipe
from accel.bench.report import bench_markdown, bench_notes, bench_rows
from accel.report import run_table
from accel.measure import compare_order
from accel.metrics import Metrics
from accel.threads import default_threads

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import torch
from accel.threads import cpu_threads
for device in ("cuda", "cpu"):
    with cpu_threads(torch.device(device)) as threads:
        inside = torch.get_num_threads()
    print(inside, threads.count, threads.source, torch.get_num_threads(), sep="|")
"""


def _probe(omp: str | None) -> list[list[str]]:
    """Thread counts in a fresh interpreter (torch reads OMP_NUM_THREADS once, at start): inside the
    policy's block, the count it reports, why, and after the block; first for a CUDA run, then a CPU one."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return [line.split("|") for line in done.stdout.splitlines()]


@pytest.mark.skipif(cpu_cores() < 2, reason="one core: the user's count and the default are both 1")
def test_the_users_omp_num_threads_wins_and_the_default_applies_otherwise() -> None:
    mine = "2" if default_threads(cpu_cores()) == 1 else "1"  # not the default (torch caps it at the cores)
    assert _probe(mine)[1] == [mine, mine, "OMP_NUM_THREADS", mine]
    cuda, cpu = _probe(None)
    own = cuda[0]  # torch's own count, untouched on a CUDA run
    assert cuda == [own, own, "torch", own]
    chosen = str(default_threads(cpu_cores()))
    assert chosen != own  # so the next line can tell the policy from torch's default
    assert cpu == [chosen, chosen, "accel default", own]  # and restored after the block


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (3, 1), (8, 4), (16, 8), (64, 8)])
def test_the_default_is_half_the_cores_between_one_and_eight(cores: int, threads: int) -> None:
    assert default_threads(cores) == threads


def test_compiling_or_quantizing_recipes_compare_sequentially() -> None:
    base = Recipe.from_dict({"model": {"name": "tiny-flux"}, "cache": {"threshold": 0.4}})
    assert compare_order(base) == "interleaved"
    assert compare_order(base.with_overrides({"quant": {"type": "int8wo"}})) == "sequential"
    assert compare_order(base.with_overrides({"compile": {"enabled": True}})) == "sequential"
    for placement in ("rank0", "cpu", "sharded"):  # the encoders dropped or split stay so
        assert (
            compare_order(base.with_overrides({"parallel": {"ulysses": 2}, "memory": {"text_encoder": placement}}))
            == "sequential"
        )


def _metrics(times: list[float], baseline: list[float] | None, order: str = "interleaved") -> Metrics:
    return Metrics(
        model="tiny-flux",
        family="flux",
        output_kind="image",
        device="cpu",
        dtype="float32",
        recipe={"generate": {"width": 64, "height": 64}},
        load_s=1.0,
        warmup_s=0.5,
        generate_s=sorted(times)[len(times) // 2],
        steps=12,
        peak_memory_bytes=1 << 20,
        peak_memory_kind="process RSS",
        times_s=times,
        baseline_s=sorted(baseline)[len(baseline) // 2] if baseline else None,
        baseline_times_s=baseline or [],
        compare_order=order if baseline else None,
        threads={"count": 1, "source": "accel default"},
        psnr_db=30.0 if baseline else None,
        ssim=0.9 if baseline else None,
    )


def _cells(table: Any) -> dict[str, str]:
    """The rendered table's rows as {measure: value}."""
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(table)
    rows = [line.split("│") for line in console.export_text().splitlines() if line.count("│") == 3]
    return {row[1].strip(): row[2].strip() for row in rows}


def test_the_run_table_shows_median_and_min_max_or_says_single_repeat() -> None:
    times, baseline = [0.2, 0.3, 0.25], [0.5, 0.6, 0.9]
    spread = _cells(run_table(_metrics(times, baseline)))
    assert spread["generation"] == "250.0 ms (200.0–300.0 ms)"
    assert spread["baseline generation"] == "600.0 ms (500.0–900.0 ms)"
    # Alternating runs pair up: 0.5 / 0.2, 0.6 / 0.3, 0.9 / 0.25; their median and min–max.
    assert spread["speedup"] == "2.50× (2.00–3.60×, interleaved)"
    assert spread["CPU threads"] == "1 (accel default; OMP_NUM_THREADS overrides)"
    # One side after the other: median over median (0.6 / 0.25); fastest baseline / slowest run up to
    # slowest baseline / fastest run (0.5 / 0.3, 0.9 / 0.2).
    assert _cells(run_table(_metrics(times, baseline, "sequential")))["speedup"] == "2.40× (1.67–4.50×, sequential)"
    single = _cells(run_table(_metrics([0.25], [0.6])))
    assert single["generation"] == "250.0 ms (single repeat)"
    assert single["speedup"] == "2.40× (single repeat: noisy, use --repeats 5)"
    document = _metrics(times, baseline).as_dict()
    assert (document["min_s"], document["max_s"], document["speedup"]) == (0.2, 0.3, 2.5)
    assert (document["speedup_min"], document["speedup_max"]) == (2.0, pytest.approx(3.6))


def _bench(repeats: int) -> BenchResult:
    times = {"baseline": [0.6, 0.5, 0.7][:repeats], "cache": [0.25, 0.2, 0.3][:repeats]}
    rows = [
        VariantResult(
            name,
            {},
            1,
            "1 process",
            times_s=times[name],
            steps=12,
            speedup=sorted(times["baseline"])[repeats // 2] / sorted(times[name])[repeats // 2],
        )
        for name in times
    ]
    rows.append(VariantResult("ulysses", {}, 2, "ulysses 2", skip_reason="needs 2 processes"))
    return BenchResult(
        "r.toml",
        "tiny-flux",
        "flux",
        "image",
        "cpu",
        "float32",
        1,
        repeats,
        0,
        {"width": 64, "height": 64, "num_inference_steps": 12},
        "process RSS",
        "baseline",
        rows,
        threads={"count": 2, "source": "OMP_NUM_THREADS"},
    )


def test_the_bench_table_says_when_each_time_is_a_single_repeat() -> None:
    single = _bench(1)
    assert [row[3] for row in bench_rows(single)] == ["single repeat", "single repeat", "—"]
    assert bench_notes(single)[-1] == (
        "speedups are from a single repeat per variant and may be noise; pass --repeats 5 for a median and spread"
    )
    three = _bench(3)
    assert [row[2:4] for row in bench_rows(three)[:2]] == [
        ["600.0 ms", "500.0–700.0 ms"],
        ["250.0 ms", "200.0–300.0 ms"],
    ]
    assert bench_notes(three) == ["ulysses skipped: needs 2 processes"]
    assert "; CPU threads: 2 (OMP_NUM_THREADS)." in bench_markdown(three)


def _whiskers(axes: Any) -> list[list[tuple[float, float]]]:
    """Each whisker's two ends, (x, y), from the chart's ErrorbarContainer."""
    container = next(c for c in axes.containers if isinstance(c, ErrorbarContainer))
    segments = container.lines[2][0].get_segments()
    return [[tuple(map(float, point)) for point in segment] for segment in segments]


def test_the_speedup_chart_draws_min_max_whiskers_and_a_legend_for_its_colours() -> None:
    spreads = [(0.8, 1.25), None, (2.0, 3.0), None]
    figure = speedup_figure(["baseline", "skipped", "cache", "one run"], [1.0, None, 2.4, 0.9], "speedup", spreads)
    axes = figure.axes[0]
    assert _whiskers(axes) == [
        [(0.8, 0.0), (1.25, 0.0)],
        [(pytest.approx(2.0), 2.0), (pytest.approx(3.0), 2.0)],
    ]  # rows 0, 2 only
    assert [text.get_text() for text in figure.legends[0].get_texts()] == list(LEGEND_LABELS)
    colours = [patch.get_facecolor() for patch in axes.patches]
    assert colours[0] == colours[2] != colours[3]  # faster: one colour, slower: the other
    plain = speedup_figure(["a", "b"], [1.5, 0.7], "speedup")
    assert [text.get_text() for text in plain.legends[0].get_texts()] == list(LEGEND_LABELS[:2])
    assert not any(isinstance(c, ErrorbarContainer) for c in plain.axes[0].containers)
    with pytest.raises(
        ValueError,
        match="one speedup per name \\(and one spread, where given\\), got 2 names, 2 speedups and 1 spreads",
    ):
        speedup_figure(["a", "b"], [1.0, 2.0], "speedup", [None])


@contextmanager
def _bar(labels: list[str], label: str) -> Iterator[Any]:
    labels.append(label)

    class Bar:
        def start(self, total: int) -> None: ...
        def advance(self) -> None: ...

    yield Bar()


def test_compare_interleaves_baseline_and_accelerated_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.runner import run

    monkeypatch.chdir(tmp_path)  # the picture goes under outputs/ here
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    labels: list[str] = []
    recipe = Recipe.from_dict(
        {"model": {"name": "tiny-flux", "device": "cpu"}, "generate": {"steps": 2}, "cache": {"threshold": 0.4}}
    )
    metrics = run(recipe, compare=True, warmup=1, repeats=2, progress=lambda label: _bar(labels, label), out=None)
    assert labels == [
        "baseline: run 1/2: warm-up 1/1",
        "baseline: run 1/2",
        "accelerated: run 1/2: warm-up 1/1",
        "accelerated: run 1/2",
        "baseline: run 2/2",
        "accelerated: run 2/2",
    ]
    assert len(metrics.times_s) == len(metrics.baseline_times_s) == 2 and metrics.compare_order == "interleaved"
    assert metrics.threads == {"count": default_threads(cpu_cores()), "source": "accel default"}
    assert metrics.speedup_spread[0] <= metrics.speedup <= metrics.speedup_spread[1]


def test_the_demo_repeats_its_compared_runs_as_the_readme_says() -> None:
    makefile = (ROOT / "Makefile").read_text()
    command = makefile.split("\ndemo:", 1)[1].splitlines()[1].strip().removeprefix("$(BIN)/")
    words = shlex.split(command)
    assert words[:2] == ["accel", "run"] and "--compare" in words
    assert int(words[words.index("--repeats") + 1]) >= 5
    readme = (ROOT / "README.md").read_text()
    assert f"runs `{command}`" in readme
    assert "$" not in command  # a plain command line: no make variables left in it


def test_env_says_how_many_threads_a_cpu_run_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    from accel.report import environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    count = default_threads(cpu_cores())
    assert environment()["devices"][0].endswith(
        f" {cpu_cores()} cores; {count} thread{'s' if count > 1 else ''} per run: accel default)"
    )
    import torch

    # OpenMP read the variable when torch started: a run honours it with the count torch has.
    given = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(given))
    assert environment()["devices"][0].endswith(f" {given} thread{'s' if given > 1 else ''} per run: OMP_NUM_THREADS)")
