"""Metrics: everything `accel run` reports, and the speedup figures over repeated runs. No torch, so
the reports can read them."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Metrics:
    """Everything `accel run` reports; `as_dict()` is the --json document."""

    model: str
    family: str
    output_kind: str
    device: str
    dtype: str
    # The effective recipe (Recipe.to_dict, recipe key names): the one given, with every [generate]
    # key the family's defaults filled written out, so that `accel run --recipe` on the JSON rebuilds the run.
    recipe: dict[str, Any]
    load_s: float
    warmup_s: float
    generate_s: float
    steps: int
    peak_memory_bytes: int
    peak_memory_kind: str
    # accel plan's estimate of the peak per GPU (weights, the working phase, the reserve), where one applied.
    planned_peak_bytes: int | None = None
    output_path: str | None = None
    cache: dict[str, Any] | None = None
    # Context parallelism: degrees, whether they were chosen automatically, bytes this rank sent.
    parallel: dict[str, Any] | None = None
    # Quantization: scheme and layer counts; compile: scope, mode, graphs built (warm-up / timed).
    quant: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    # Every timed run (generate_s is their median).
    times_s: list[float] = field(default_factory=list)
    baseline_s: float | None = None
    psnr_db: float | None = None
    ssim: float | None = None
    # Frames of the video written (DFR's refine round makes twice its input's); None for pictures and latents.
    output_frames: int | None = None
    # Pixel size of the picture or video written; None for latents.
    output_width: int | None = None
    output_height: int | None = None
    # What the run changed or cut from what was asked (a long prompt, a size the pipeline rounded), one line each.
    notes: list[str] = field(default_factory=list)
    # Every timed baseline run with --compare (baseline_s is their median); how the two were ordered.
    baseline_times_s: list[float] = field(default_factory=list)
    compare_order: str | None = None
    # CPU threads the run computed with and what chose them (accel.threads.Threads.as_dict).
    threads: dict[str, Any] | None = None

    @property
    def per_step_s(self) -> float:
        return self.generate_s / self.steps if self.steps else float("nan")

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.generate_s if self.generate_s > 0 else float("nan")

    @property
    def speedup(self) -> float | None:
        """Baseline over accelerated: the median of the per-pair ratios when the runs alternated
        (`paired_ratios`), else baseline median / median; None without --compare."""
        if self._paired:
            return statistics.median(paired_ratios(self.baseline_times_s, self.times_s))
        return self.baseline_s / self.generate_s if self.baseline_s and self.generate_s > 0 else None

    @property
    def speedup_spread(self) -> tuple[float, float] | None:
        """The speedup's min–max over the repeats: of the per-pair ratios when the runs alternated,
        else `speedup_range`; None without --compare."""
        if self.speedup is None or not self.baseline_times_s or not self.times_s:
            return None
        if self._paired:
            ratios = paired_ratios(self.baseline_times_s, self.times_s)
            return min(ratios), max(ratios)
        return speedup_range(self.baseline_times_s, self.times_s)

    @property
    def _paired(self) -> bool:
        return self.compare_order == "interleaved" and 0 < len(self.baseline_times_s) == len(self.times_s)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        spread = self.speedup_spread
        data.update(
            per_step_s=self.per_step_s,
            steps_per_s=self.steps_per_s,
            speedup=self.speedup,
            min_s=min(self.times_s) if self.times_s else None,
            max_s=max(self.times_s) if self.times_s else None,
            speedup_min=spread[0] if spread else None,
            speedup_max=spread[1] if spread else None,
        )
        return data


def paired_ratios(baseline_times: list[float], times: list[float]) -> list[float]:
    """Baseline run i / accelerated run i: with alternating runs the two of a pair ran side by side,
    so a machine slowing down meanwhile cancels out of their ratio (measured on a shared 2-core VM:
    the median of these varied ±2 % between demo runs, the ratio of medians ±6 %)."""
    return [baseline / time for baseline, time in zip(baseline_times, times) if time > 0]


def speedup_range(baseline_times: list[float], times: list[float]) -> tuple[float, float]:
    """The widest spread the repeats allow: fastest baseline over
    slowest accelerated run, up to slowest baseline over fastest run. It always holds the ratio of
    medians, and a single repeat on both sides makes it that one ratio."""
    return min(baseline_times) / max(times), max(baseline_times) / min(times)
