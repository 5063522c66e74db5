"""What `accel bench` shows and writes: the variants' table (fitted to the terminal), its notes, the
Markdown file, and the bench folder's JSON, grid and speedup chart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from accel.files.publish import by_descriptor, write_file
from accel.formatting import SINGLE_REPEAT, Fit, format_bytes, format_seconds, format_size, format_span, format_threads
from accel.report import write_json

if TYPE_CHECKING:
    from accel.bench.results import BenchResult, VariantResult


BENCH_COLUMNS = (
    "variant",
    "layout",
    "median",
    "min–max",
    "per step",
    "speedup",
    "cache hits",
    "peak memory",
    "PSNR",
    "SSIM",
)


def bench_rows(result: BenchResult) -> list[list[str]]:
    """The bench table's cells, shared by the terminal table and the Markdown file."""
    rows = []
    for row in result.variants:
        if not row.ran:
            rows.append([row.name, "skipped (below)", *("—" for _ in BENCH_COLUMNS[2:])])
            continue
        baseline = row.name == result.baseline
        rows.append(
            [
                row.name,
                row.layout,
                format_seconds(row.median_s),
                format_span(min(row.times_s), max(row.times_s)) if len(row.times_s) > 1 else SINGLE_REPEAT,
                format_seconds(row.per_step_s),
                f"{row.speedup:.2f}×" if row.speedup is not None else "—",
                f"{row.cache_hit_rate:.0%}" if row.cache_hit_rate is not None else "off",
                _peak_cell(row),
                "baseline" if baseline else _psnr(row.psnr_db),
                "baseline" if baseline else (f"{row.ssim:.4f}" if row.ssim is not None else "—"),
            ]
        )
    return rows


def _peak_cell(row: VariantResult) -> str:
    """The measured peak, and accel plan's estimate beside it where the plan applied (a flagship checkpoint)."""
    measured = format_bytes(row.peak_memory_bytes) if row.peak_memory_bytes is not None else "—"
    return measured if row.planned_peak_bytes is None else f"{measured} (plan {format_bytes(row.planned_peak_bytes)})"


def bench_notes(result: BenchResult) -> list[str]:
    """Lines under the table: why each skipped variant did not run; a warning when each time is one run."""
    notes = [f"{row.name} skipped: {row.skip_reason}" for row in result.variants if not row.ran]
    if result.repeats == 1:
        notes.append(
            f"speedups are from a {SINGLE_REPEAT} per variant and may be noise; pass --repeats 5 for a median and "
            "spread"
        )
    return notes


def _psnr(value: float | None) -> str:
    if value is None:
        return "—"
    return "identical (∞)" if math.isinf(value) else f"{value:.2f} dB"


def _bench_title(result: BenchResult) -> str:
    return f"accel bench {result.recipe}"


def _bench_context(result: BenchResult) -> str:
    settings = result.settings
    # A pipeline without a step count (LTX-2.5 DFR's distilled sigmas) has the steps its variants ran.
    steps = settings.get("num_inference_steps") or next((row.steps for row in result.variants if row.steps), "?")
    return (
        f"{result.model} ({result.family}, {result.dtype}, {result.device}); "
        f"{format_size(settings, result.output_kind)}, {steps} steps; "
        f"{result.world_size} process{'es' if result.world_size > 1 else ''}; "
        f"{result.warmup} warm-up + {result.repeats} timed runs per variant; peak memory is {result.peak_memory_kind}"
        + (
            f"; CPU threads: {format_threads(result.threads)}"
            if result.threads is not None and result.device.startswith("cpu")
            else ""
        )
    )


def bench_table(result: BenchResult) -> Fit:
    """Every column where it fits; else two lines a variant (layout under its name, min–max under the
    median, cache hits under the speedup, SSIM under PSNR) without the time per step (the median over
    the caption's steps); else without min–max too. Never a cut number."""
    return Fit(
        lambda _width: _bench_wide(result),
        lambda _width: _bench_stacked(result, spans=True),
        lambda _width: _bench_stacked(result, spans=False),
    )


def _bench_wide(result: BenchResult) -> Table:
    table = Table(title=_bench_title(result), caption=_bench_context(result), header_style="bold")
    for column in BENCH_COLUMNS:
        table.add_column(column, justify="left" if column in ("variant", "layout") else "right", no_wrap=True)
    for cells in bench_rows(result):
        table.add_row(*cells)
    return table


def _bench_stacked(result: BenchResult, spans: bool) -> Table:
    table = Table(
        title=_bench_title(result), caption=_bench_context(result), header_style="bold", show_edge=False, pad_edge=False
    )
    table.add_column("variant\nlayout")
    table.add_column("median\nmin–max" if spans else "median", justify="right", no_wrap=True)
    table.add_column("speedup\ncache", justify="right", no_wrap=True)
    table.add_column("peak\nmemory", justify="right", no_wrap=True)
    table.add_column("PSNR\nSSIM", justify="right", no_wrap=True)
    for row, cells in zip(result.variants, bench_rows(result), strict=True):
        cell = dict(zip(BENCH_COLUMNS, cells, strict=True))
        if not row.ran:
            table.add_row(f"{cell['variant']}\nskipped", "—", "—", "—", "—")
            continue
        table.add_row(
            f"{cell['variant']}\n{cell['layout']}",
            cell["median"] + (f"\n{cell['min–max']}" if spans else ""),
            f"{cell['speedup']}\n{cell['cache hits']}",
            cell["peak memory"],
            cell["PSNR"] + ("" if cell["SSIM"] == "baseline" else f"\n{cell['SSIM']}"),
        )
    return table


def bench_markdown(result: BenchResult) -> str:
    lines = [f"# {_bench_title(result)}", "", _bench_context(result) + ".", ""]
    lines.append("| " + " | ".join(BENCH_COLUMNS) + " |")
    lines.append("|" + "|".join("---" if c in ("variant", "layout") else "--:" for c in BENCH_COLUMNS) + "|")
    for cells in bench_rows(result):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    lines.append("")
    lines += [f"- {note}" for note in bench_notes(result)]
    if bench_notes(result):
        lines.append("")
    for name in ("grid", "chart"):
        if name in result.files:
            lines += [f"![{name}]({Path(result.files[name]).name})", ""]
    return "\n".join(lines)


def write_bench(
    result: BenchResult, folder: Path, json_copy: Path | None = None, markdown_copy: Path | None = None
) -> None:
    """Into the bench's folder: bench.json, bench.md, grid.png (the variants' outputs side by side)
    and speedup.png; the paths are recorded in `result.files` (and so in the JSON). Each file is
    written whole, and none replaces an existing one (UserError): bench never overwrites."""
    from accel.bench.results import BENCH_HINT
    from accel.figures import save_grid, speedup_chart

    hint = BENCH_HINT  # what each refusal says
    folder.mkdir(parents=True, exist_ok=True)
    files = {"json": folder / "bench.json", "markdown": folder / "bench.md"}
    if result.tiles:
        files["grid"] = folder / "grid.png"
        save_grid(result.tiles, files["grid"], hint=hint)
    files["chart"] = folder / "speedup.png"
    speedup_chart(
        [row.name for row in result.variants],
        [row.speedup if row.ran else None for row in result.variants],
        files["chart"],
        f"{result.model}: speedup vs {result.baseline}",
        hint=hint,
        spreads=[
            (row.speedup_min, row.speedup_max)
            if row.speedup_min is not None and row.speedup_max is not None and len(row.times_s) > 1
            else None
            for row in result.variants
        ],
    )
    result.files = {name: str(path) for name, path in files.items()}
    markdown = bench_markdown(result)
    write_file(files["markdown"], by_descriptor(lambda file: file.write(markdown.encode())), replace=False, hint=hint)
    write_json(result.as_dict(), files["json"], hint=hint)
    if json_copy is not None:
        write_json(result.as_dict(), json_copy, hint=hint)
    if markdown_copy is not None:
        write_file(markdown_copy, by_descriptor(lambda file: file.write(markdown.encode())), replace=False, hint=hint)
