"""Every table `accel` prints stays readable in an 80-column terminal: no line is longer, and every
number it shows arrives whole with its unit (a squeezed rich table would print '404.' for 404 ms)."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from accel import report
from accel.bench.report import BENCH_COLUMNS, bench_rows, bench_table
from accel.bench.results import BenchResult, VariantResult
from accel.models.registry import FAMILIES
from accel.metrics import Metrics

NUMBER = re.compile(r"\d+(?:\.\d+)?(?:–\d+(?:\.\d+)?)?(?: ?(?:ms|s|GiB|MiB|KiB|B|dB)\b|×|%)?")

METRICS = Metrics(
    model="tiny-flux",
    family="flux",
    output_kind="image",
    device="cpu",
    dtype="float32",
    recipe={"generate": {"prompt": "a red fox", "width": 1024, "height": 1024, "steps": 28}},
    load_s=12.345,
    warmup_s=3.21,
    generate_s=0.40412,
    steps=28,
    peak_memory_bytes=123456789,
    peak_memory_kind="process RSS",
    output_path="outputs/tiny-flux-20261124-224016-3.png",
    cache={"hit_rate": 0.4286, "cached_calls": 12, "transformer_calls": 28, "calls": []},
    parallel={
        "world_size": 8,
        "ulysses": 2,
        "ring": 2,
        "cfg": 2,
        "chosen": True,
        "vae_split": True,
        "bytes_sent_per_rank": None,
    },
    quant={"type": "int8dq", "quantized_layers": 120, "kept_layers": {"small": 3, "excluded": 2}},
    compile={
        "scope": "blocks",
        "mode": "max-autotune-no-cudagraphs",
        "compiled_modules": 57,
        "graphs_warmup": 3,
        "graphs_timed": 0,
    },
    times_s=[0.40412],
    baseline_s=1.61648,
    baseline_times_s=[1.61648],
    compare_order="interleaved",
    psnr_db=41.2345,
    ssim=0.98765,
)


def _variant(name: str, layout: str, times: list[float], **numbers: float) -> VariantResult:
    return VariantResult(
        name=name, overrides={}, world_size=4 if "×" in layout else 1, layout=layout, times_s=times, steps=28, **numbers
    )


BENCH = BenchResult(
    recipe="recipes/tiny-flux.toml",
    model="tiny-flux",
    family="flux",
    output_kind="image",
    device="cpu",
    dtype="float32",
    world_size=4,
    repeats=3,
    warmup=1,
    settings={"width": 1024, "height": 1024, "num_inference_steps": 28},
    peak_memory_kind="process RSS",
    baseline="baseline",
    variants=[
        _variant("baseline", "1 process", [1.61648, 1.7, 1.65], speedup=1.0, peak_memory_bytes=1234567890),
        _variant(
            "fbcache-0.12",
            "1 process",
            [0.40412, 0.41, 0.43],
            speedup=4.0001,
            cache_hit_rate=0.5714,
            peak_memory_bytes=1234567890,
            psnr_db=38.4567,
            ssim=0.97654,
        ),
        _variant(
            "usp-ulysses2-ring2",
            "ulysses 2 × ring 2",
            [0.51234, 0.52, 0.6],
            speedup=3.1555,
            peak_memory_bytes=234567890,
            psnr_db=float("inf"),
            ssim=1.0,
        ),
        VariantResult(name="int8dq-compile", overrides={}, world_size=1, layout="1 process", skip_reason="needs CUDA"),
    ],
)


def _render(renderable: object, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def _numbers(cells: list[str]) -> list[str]:
    return [number for cell in cells for number in NUMBER.findall(cell)]


def _assert_fits_with_numbers_whole(lines: list[str], numbers: list[str]) -> None:
    assert max(len(line) for line in lines) <= 80
    for number in numbers:
        assert any(re.search(rf"(?<![\d.]){re.escape(number)}(?![\d.])", line) for line in lines), number


def test_run_table_fits_80_columns_with_every_number_whole() -> None:
    lines = _render(report.run_table(METRICS), 80)
    expected = [
        "12.35 s",
        "3.21 s",
        "404.1 ms",
        "14.4 ms",
        "69.29",
        "43%",
        "12/28",
        "1024×1024",
        "28 steps",
        "117.7 MiB",
        "1.62 s",
        "4.00×",
        "41.23 dB",
        "0.9877",
        "120 Linear layers",
        "5 kept",
        "57 blocks",
    ]
    _assert_fits_with_numbers_whole(lines, expected)
    assert "ulysses 2 × ring 2 × cfg 2 on 8 processes" in " ".join(line.strip(" │") for line in lines)


@pytest.mark.parametrize("width", [80, 100])
def test_bench_table_fits_narrow_terminals_with_every_number_whole(width: int) -> None:
    lines = _render(bench_table(BENCH), width)
    rows = bench_rows(BENCH)
    shown = [cell for row in rows for column, cell in zip(BENCH_COLUMNS, row) if column != "per step"]
    _assert_fits_with_numbers_whole(lines, _numbers(shown))
    text = "\n".join(lines)
    for expected in ("404.1–430.0 ms", "ulysses 2 × ring 2", "identical (∞)", "usp-ulysses2-ring2", "int8dq-compile"):
        assert expected in text
    assert "per step" not in text  # the one column left out below the wide layout: median over the caption's steps


def test_bench_table_is_the_full_table_where_it_fits() -> None:
    text = "\n".join(_render(bench_table(BENCH), 200))
    for column in BENCH_COLUMNS:
        assert column in text
    for number in _numbers([cell for row in bench_rows(BENCH) for cell in row]):
        assert number in text


@pytest.mark.parametrize("width", [80, 120, 250])
def test_models_table_keeps_every_name_whole(width: int) -> None:
    lines = _render(report.models_table(list(FAMILIES.values())), width)
    assert max(len(line) for line in lines) <= width
    words = {word for line in lines for word in re.split(r"[\s,·│┃]+", line) if word}
    for family in FAMILIES.values():
        assert {family.name, family.repo, *family.pipeline_classes} <= words
        assert family.tiny_alias in words
    text = "\n".join(lines)
    assert text.count("vae: patch-parallel") == len(FAMILIES)


@pytest.mark.parametrize(
    ("layout", "shown"),
    [
        ({"ulysses": 2, "ring": 1, "cfg": 1, "chosen": True}, "ulysses 2 (chosen for 2 processes)"),
        (
            {"ulysses": 1, "ring": 1, "cfg": 2, "chosen": True},
            "cfg 2 on 2 processes",
        ),  # --gpus 2 --cfg-parallel: asked, not chosen
        ({"ulysses": 2, "ring": 1, "cfg": 2, "chosen": True}, "ulysses 2 × cfg 2 on 4 processes (ulysses 2 chosen)"),
        ({"ulysses": 2, "ring": 1, "cfg": 2, "chosen": False}, "ulysses 2 × cfg 2 on 4 processes"),
    ],
)
def test_parallel_row_says_only_what_was_chosen(layout: dict[str, object], shown: str) -> None:
    world = 2 * (2 if layout["ulysses"] == 2 and layout["cfg"] == 2 else 1)
    assert report._parallel(dict(layout, world_size=world, vae_split=False)) == shown


def test_accel_models_in_an_80_column_terminal() -> None:
    from typer.testing import CliRunner

    from accel.cli import app

    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    words = {word for line in lines for word in re.split(r"[\s,·]+", line) if word}
    assert {
        name for family in FAMILIES.values() for name in (family.name, family.repo, *family.pipeline_classes)
    } <= words
