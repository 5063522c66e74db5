"""The quality a tuned cache must keep: `--target psnr=32` or `--target ssim=0.95`, against the
uncached output of the same recipe, on every calibration prompt (the worst one counts)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from accel.errors import UserError

Metric = Literal["psnr", "ssim"]
EXAMPLE = "--target psnr=32 or --target ssim=0.95"


@dataclass(frozen=True)
class Target:
    metric: Metric
    value: float

    def met(self, psnr_db: float, ssim: float) -> bool:
        return (psnr_db if self.metric == "psnr" else ssim) >= self.value

    def of(self, psnr_db: float, ssim: float) -> float:
        """The targeted metric of a measurement."""
        return psnr_db if self.metric == "psnr" else ssim

    def describe(self) -> str:
        return f"PSNR ≥ {self.value:g} dB" if self.metric == "psnr" else f"SSIM ≥ {self.value:g}"


def parse_target(text: str) -> Target:
    """`psnr=32` / `ssim=0.95`; anything else, or a target only the uncached run meets, is one line."""
    metric, sep, raw = text.partition("=")
    metric = metric.strip().lower()
    if not sep or metric not in ("psnr", "ssim"):
        raise UserError(f"--target {text}: write METRIC=VALUE with METRIC psnr or ssim, e.g. {EXAMPLE}")
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"--target {text}: {raw.strip()!r} is not a number; e.g. {EXAMPLE}") from None
    if metric == "psnr" and not (0 < value < math.inf):
        raise UserError(
            f"--target {text}: a PSNR target is a finite number of dB above 0 (e.g. psnr=32); "
            "an identical output needs no cache"
        )
    if metric == "ssim" and not (0 < value < 1):
        raise UserError(
            f"--target {text}: an SSIM target lies between 0 and 1 (e.g. ssim=0.95); "
            "1 means an identical output, which needs no cache"
        )
    return Target(metric, value)  # type: ignore[arg-type]
