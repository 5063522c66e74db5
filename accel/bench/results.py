"""A bench's results: one row per variant and the whole bench, as the reports and the JSON show them."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from accel.figures import Tile

# What a refused bench file tells the user (accel.files).
BENCH_HINT = "bench never overwrites, choose another name"


@dataclass
class VariantResult:
    """One variant's numbers (all None when it was skipped); `as_dict()` is its JSON object."""

    name: str
    overrides: dict[str, Any]
    world_size: int
    layout: str
    skip_reason: str | None = None
    times_s: list[float] = field(default_factory=list)
    warmup_s: float | None = None
    steps: int | None = None
    speedup: float | None = None
    # The speedup's spread over the repeats (metrics.speedup_range); None when skipped or without a baseline.
    speedup_min: float | None = None
    speedup_max: float | None = None
    cache_hit_rate: float | None = None
    peak_memory_bytes: int | None = None
    planned_peak_bytes: int | None = None
    psnr_db: float | None = None
    ssim: float | None = None
    output_path: str | None = None
    quant: dict[str, Any] | None = None
    compile: dict[str, Any] | None = None
    bytes_sent_per_rank: dict[str, int] | None = None

    @property
    def ran(self) -> bool:
        return self.skip_reason is None

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def per_step_s(self) -> float | None:
        median = self.median_s
        return median / self.steps if median is not None and self.steps else None

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(
            status="ran" if self.ran else "skipped",
            median_s=self.median_s,
            min_s=min(self.times_s) if self.times_s else None,
            max_s=max(self.times_s) if self.times_s else None,
            per_step_s=self.per_step_s,
        )
        return data


@dataclass
class BenchResult:
    """The whole bench; `as_dict()` is the JSON document (its fields are listed in the README)."""

    recipe: str
    model: str
    family: str
    output_kind: str
    device: str
    dtype: str
    world_size: int
    repeats: int
    warmup: int
    settings: dict[str, Any]
    peak_memory_kind: str
    baseline: str
    variants: list[VariantResult]
    folder: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    # CPU threads each rank computed with and what chose them (accel.threads.Threads.as_dict).
    threads: dict[str, Any] | None = None
    # What the comparison grid shows, for each variant that ran (a video's three frames, not all).
    tiles: list[Tile] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("variants", "tiles")}
        data["variants"] = [v.as_dict() for v in self.variants]
        return data
