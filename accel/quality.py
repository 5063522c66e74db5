"""Output quality against a reference output."""

from __future__ import annotations

import math

import numpy as np

SSIM_WINDOW = 11  # Gaussian window side (Wang et al. 2004); shrunk for smaller images
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def psnr(output: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for arrays in [0, 1]; inf when they are identical."""
    if output.shape != reference.shape:
        raise ValueError(f"PSNR needs equal shapes, got {output.shape} and {reference.shape}")
    mse = float(np.mean((output.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def ssim(output: np.ndarray, reference: np.ndarray) -> float:
    """Mean structural similarity (Wang et al. 2004) for arrays in [0, 1], (H, W, C) or (F, H, W, C).

    Gaussian 11x11 window, sigma 1.5, K1 = 0.01, K2 = 0.03, data range 1, "valid" positions only,
    like the reference implementation; PSNR alone misses structure that caching or quantization
    blurs. Each frame and channel is scored on its own and the scores are averaged. Images smaller
    than the window get the largest odd window that fits. Identical inputs give exactly 1.0.
    """
    if output.shape != reference.shape:
        raise ValueError(f"SSIM needs equal shapes, got {output.shape} and {reference.shape}")
    if output.ndim not in (3, 4):
        raise ValueError(f"SSIM needs (H, W, C) or (F, H, W, C) arrays, got shape {output.shape}")
    if output.size == 0:
        raise ValueError(f"SSIM needs non-empty arrays, got shape {output.shape}")
    frames_x = output.reshape((-1, *output.shape[-3:]))
    frames_y = reference.reshape((-1, *reference.shape[-3:]))
    height, width = frames_x.shape[1:3]
    side = min(SSIM_WINDOW, height, width)
    window = _gaussian(side if side % 2 else side - 1, SSIM_SIGMA)
    scores = [  # frame by frame keeps memory to one frame's statistics for long videos
        _ssim_maps(np.moveaxis(x, -1, 0), np.moveaxis(y, -1, 0), window).mean(axis=(1, 2))
        for x, y in zip(frames_x, frames_y)
    ]
    return float(np.mean(scores))


def _gaussian(size: int, sigma: float) -> np.ndarray:
    """Normalized 1-D Gaussian; the 2-D window is its outer product, so filtering is separable."""
    offsets = np.arange(size, dtype=np.float64) - (size - 1) / 2
    weights = np.exp(-(offsets**2) / (2 * sigma**2))
    return weights / weights.sum()


def _filter_valid(planes: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Weighted window mean of (N, H, W) planes at every position where the window fits."""
    size = window.shape[0]
    rows = np.lib.stride_tricks.sliding_window_view(planes, size, axis=1) @ window
    return np.lib.stride_tricks.sliding_window_view(rows, size, axis=2) @ window


def _ssim_maps(x: np.ndarray, y: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Per-position SSIM of (C, H, W) planes, shape (C, H', W')."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    c1, c2 = SSIM_K1**2, SSIM_K2**2  # data range 1
    mu_x, mu_y = _filter_valid(x, window), _filter_valid(y, window)
    mu_xx, mu_yy, mu_xy = mu_x * mu_x, mu_y * mu_y, mu_x * mu_y
    var_x = _filter_valid(x * x, window) - mu_xx
    var_y = _filter_valid(y * y, window) - mu_yy
    cov = _filter_valid(x * y, window) - mu_xy
    return ((2 * mu_xy + c1) * (2 * cov + c2)) / ((mu_xx + mu_yy + c1) * (var_x + var_y + c2))
