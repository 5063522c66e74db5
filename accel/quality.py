"""Output quality against a reference output."""

from __future__ import annotations

import math

import numpy as np


def psnr(output: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for arrays in [0, 1]; inf when they are identical."""
    if output.shape != reference.shape:
        raise ValueError(f"PSNR needs equal shapes, got {output.shape} and {reference.shape}")
    mse = float(np.mean((output.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)
