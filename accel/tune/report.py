"""What `accel tune --target` shows: a table of every setting tried (the Pareto front and the choice
marked) and a plot of speedup against quality."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from accel.tune.search import Trial, describe

if TYPE_CHECKING:
    from rich.table import Table

    from accel.tune.job import TuneResult


def tune_table(result: TuneResult) -> Table:
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"accel tune {result.model}: {result.target.describe()} on every prompt ({len(result.prompts)})",
        caption="★ chosen  ◆ Pareto front  ✗ misses the target  · stopped early, slower than the best. "
        "t: threshold. re-timed: interleaved with the baseline. PSNR, SSIM: the worst prompt's.",
        box=box.SIMPLE_HEAD,
    )
    for name, justify in (
        ("", "left"),
        ("setting", "left"),
        ("speedup", "right"),
        ("re-timed", "right"),
        ("PSNR", "right"),
        ("SSIM", "right"),
        ("hits", "right"),
        ("prompts", "right"),
    ):
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for trial in sorted(result.trials, key=lambda t: -t.final_speedup):
        table.add_row(
            _mark(trial, result.best),
            describe(trial.cache),
            f"{trial.speedup:.2f}×",
            f"{trial.retimed:.2f}×" if trial.retimed is not None else "",
            _db(trial.psnr_db),
            f"{trial.ssim:.4f}",
            f"{trial.hit_rate:.0%}",
            f"{trial.prompts}/{len(result.prompts)}",
        )
    return table


def _mark(trial: Trial, best: Trial | None) -> str:
    if trial is best:
        return "★"
    if trial.meets is False:
        return "✗"
    if trial.meets is None:
        return "·"
    return "◆" if trial.pareto else ""


def summary(result: TuneResult) -> str:
    seconds = ", ".join(f"{s:.3g} s" for s in result.baseline_s)
    return (
        f"{len(result.trials)} settings in {result.generations} generations on {result.device}"
        f"{f' × {result.world_size} processes' if result.world_size > 1 else ''}; uncached baseline {seconds} "
        f"({result.blocks} blocks, {result.steps} steps)"
    )


def write_plot(result: TuneResult, path: Path) -> None:
    """Speedup against worst-prompt PSNR (identical outputs drawn at the right edge), the target
    line, the Pareto front and the choice; never over an existing file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accel.files.publish import by_descriptor, write_file

    finite = [t.psnr_db for t in result.trials if math.isfinite(t.psnr_db)]
    edge = (max(finite) if finite else 60.0) + 5.0
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for method in sorted({t.cache["method"] for t in result.trials}):
        shown = [t for t in result.trials if t.cache["method"] == method]
        axes.scatter([_x(t, edge) for t in shown], [t.final_speedup for t in shown], s=18, alpha=0.7, label=method)
    front = sorted((t for t in result.trials if t.pareto), key=lambda t: _x(t, edge))
    if front:
        axes.plot(
            [_x(t, edge) for t in front],
            [t.final_speedup for t in front],
            color="black",
            linewidth=1,
            label="Pareto front",
        )
    if result.best is not None:
        axes.scatter(
            [_x(result.best, edge)],
            [result.best.final_speedup],
            marker="*",
            s=220,
            color="gold",
            edgecolors="black",
            zorder=5,
            label="chosen",
        )
    if result.target.metric == "psnr":
        axes.axvline(result.target.value, color="red", linestyle="--", linewidth=1, label=result.target.describe())
    axes.set_xlabel("worst-prompt PSNR against the uncached output (dB)")
    axes.set_ylabel("speedup over the uncached recipe (×)")
    axes.set_title(f"accel tune {result.model}")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()

    try:
        write_file(
            path,
            by_descriptor(lambda file: figure.savefig(file, format="png", dpi=110)),
            replace=False,
            hint="accel tune never overwrites; pass another --plot",
        )
    finally:
        plt.close(figure)


def _x(trial: Trial, edge: float) -> float:
    return trial.psnr_db if math.isfinite(trial.psnr_db) else edge


def _db(value: float) -> str:
    return "identical" if math.isinf(value) else f"{value:.1f} dB"
