"""SSIM against its closed forms and a slow direct implementation; report figures by size and pixels."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFont

from accel import figures
from accel.figures import GAP, LABEL_BAND, ROW_LABEL, TILE, Tile, comparison_grid, save_grid, speedup_chart
from accel.quality import ssim

C1, C2 = 0.01**2, 0.03**2


def slow_ssim(x: np.ndarray, y: np.ndarray, size: int = 11, sigma: float = 1.5) -> float:
    """Windowed means, variances and covariance by direct sums at every valid position of (H, W, C)."""
    offsets = np.arange(size) - size // 2
    weights = np.exp(-(offsets[:, None] ** 2 + offsets[None, :] ** 2) / (2 * sigma**2))
    weights /= weights.sum()
    height, width, channels = x.shape
    scores = []
    for c in range(channels):
        for i in range(height - size + 1):
            for j in range(width - size + 1):
                px, py = x[i : i + size, j : j + size, c], y[i : i + size, j : j + size, c]
                mx, my = (weights * px).sum(), (weights * py).sum()
                vx, vy = (weights * (px - mx) ** 2).sum(), (weights * (py - my) ** 2).sum()
                cov = (weights * (px - mx) * (py - my)).sum()
                scores.append((2 * mx * my + C1) * (2 * cov + C2) / ((mx**2 + my**2 + C1) * (vx + vy + C2)))
    return float(np.mean(scores))


def smooth_image(height: int = 48, width: int = 48) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    return np.stack([0.5 + 0.4 * np.sin(6 * x), 0.5 + 0.4 * np.cos(5 * y), 0.3 + 0.5 * x * y], axis=-1)


def test_ssim_identical_is_exactly_one() -> None:
    rng = np.random.default_rng(0)
    assert ssim(smooth_image(), smooth_image()) == 1.0
    video = rng.random((3, 24, 20, 3)).astype(np.float32)
    assert ssim(video, video.copy()) == 1.0


def test_ssim_is_symmetric() -> None:
    rng = np.random.default_rng(1)
    a, b = rng.random((32, 40, 3)), rng.random((32, 40, 3))
    assert ssim(a, b) == pytest.approx(ssim(b, a), rel=1e-12)
    assert ssim(a, b) < 0.5  # unrelated images, so the equality above is not 1 == 1


@pytest.mark.parametrize(("a", "b"), [(0.3, 0.6), (0.0, 1.0), (0.9, 0.1), (0.5, 0.5)])
def test_ssim_of_constant_images_is_the_closed_form(a: float, b: float) -> None:
    expected = (2 * a * b + C1) / (a**2 + b**2 + C1)  # variances and covariance are zero
    assert ssim(np.full((16, 16, 3), a), np.full((16, 16, 3), b)) == pytest.approx(expected, abs=1e-9)


def test_ssim_of_independent_noise_is_near_zero() -> None:
    rng = np.random.default_rng(2)
    assert abs(ssim(rng.random((64, 64, 3)), rng.random((64, 64, 3)))) < 0.05


def test_ssim_falls_with_more_noise() -> None:
    rng = np.random.default_rng(3)
    clean = smooth_image()
    noise = rng.standard_normal(clean.shape)
    light = ssim(np.clip(clean + 0.02 * noise, 0, 1), clean)
    heavy = ssim(np.clip(clean + 0.1 * noise, 0, 1), clean)
    assert 0.5 < light < 0.999
    assert heavy < light


def test_ssim_of_video_is_mean_over_frames() -> None:
    rng = np.random.default_rng(4)
    clean = np.stack([np.roll(smooth_image(), 3 * f, axis=1) for f in range(4)])
    noisy = np.clip(clean + rng.uniform(0.0, 0.04 * np.arange(1, 5)[:, None, None, None], clean.shape), 0, 1)
    per_frame = [ssim(noisy[f], clean[f]) for f in range(4)]
    assert len(set(per_frame)) == 4  # frames differ, so the mean is a real check
    assert ssim(noisy, clean) == pytest.approx(float(np.mean(per_frame)), abs=1e-12)


def test_ssim_matches_direct_computation() -> None:
    rng = np.random.default_rng(5)
    x = rng.random((20, 20, 3))
    y = np.clip(0.7 * x + 0.3 * rng.random((20, 20, 3)), 0, 1)
    assert ssim(x, y) == pytest.approx(slow_ssim(x, y), abs=1e-9)


def test_ssim_shrinks_the_window_for_tiny_images() -> None:
    rng = np.random.default_rng(6)
    x = rng.random((8, 8, 3))
    y = np.clip(x + 0.1 * rng.standard_normal(x.shape), 0, 1)
    value = ssim(x, y)
    assert value == pytest.approx(slow_ssim(x, y, size=7), abs=1e-9)  # largest odd window in 8 px
    assert ssim(x[:5, :6], y[:5, :6]) == pytest.approx(slow_ssim(x[:5, :6], y[:5, :6], size=5), abs=1e-9)
    assert ssim(x, x) == 1.0


def test_ssim_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"SSIM needs equal shapes, got \(8, 8, 3\) and \(8, 9, 3\)"):
        ssim(np.zeros((8, 8, 3)), np.zeros((8, 9, 3)))


def scaled(height: int, width: int) -> tuple[int, int]:
    """Frame size in the grid, from the documented rule."""
    longer = max(height, width)
    return max(1, round(height * TILE / longer)), max(1, round(width * TILE / longer))


def frame_box(column: int, row: int, fh: int, fw: int, video: bool) -> tuple[slice, slice]:
    left = GAP + (ROW_LABEL + GAP if video else 0)
    x, y = left + column * (fw + GAP), GAP + LABEL_BAND + row * (fh + GAP)
    return slice(y, y + fh), slice(x, x + fw)


def test_image_grid_size_and_labels(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tiles = [Tile(f"variant {i}", f"{1 + i}.00× · 3{i}.0 dB", rng.random((64, 96, 3))) for i in range(3)]
    path = tmp_path / "grid.png"
    save_grid(tiles, path)
    fh, fw = scaled(64, 96)
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (GAP + 3 * (fw + GAP), GAP + LABEL_BAND + fh + GAP)
        pixels = np.asarray(image.convert("RGB"))
    for column in range(3):
        _, xs = frame_box(column, 0, fh, fw, video=False)
        band = pixels[GAP : GAP + LABEL_BAND, xs]
        assert (band.max(axis=-1) < 100).sum() > 20  # dark text, in every column's band
    assert (pixels[:GAP] == 255).all()  # top margin stays white


def test_video_grid_has_first_middle_and_last_frame() -> None:
    levels = np.arange(9) / 8
    video = np.broadcast_to(levels[:, None, None, None], (9, 40, 64, 3)).copy()
    grid = comparison_grid([Tile("baseline", "1.00×", video), Tile("cache", "2.00×", video)])
    fh, fw = scaled(40, 64)
    assert grid.size == (GAP + ROW_LABEL + GAP + 2 * (fw + GAP), GAP + LABEL_BAND + 3 * (fh + GAP))
    pixels = np.asarray(grid)
    for row, index in enumerate([0, 4, 8]):
        for column in range(2):
            assert (pixels[frame_box(column, row, fh, fw, video=True)] == round(levels[index] * 255)).all()
        ys, _ = frame_box(0, row, fh, fw, video=True)
        assert (pixels[ys, GAP : GAP + ROW_LABEL].max(axis=-1) < 100).any()  # "frame N" label


def test_grid_enlarges_by_nearest_neighbour_exactly() -> None:
    rng = np.random.default_rng(8)
    pattern = rng.integers(0, 256, (128, 64, 3), dtype=np.uint8)  # longer side 128 → 2x
    other = np.zeros((128, 64, 3))
    grid = np.asarray(comparison_grid([Tile("a", "", other), Tile("b", "pattern", pattern / 255.0)]))
    fh, fw = scaled(128, 64)
    assert (fh, fw) == (256, 128)
    expected = np.repeat(np.repeat(pattern, 2, axis=0), 2, axis=1)
    np.testing.assert_array_equal(grid[frame_box(1, 0, fh, fw, video=False)], expected)
    assert (grid[frame_box(0, 0, fh, fw, video=False)] == 0).all()


def test_grid_shrinks_large_frames() -> None:
    grid = comparison_grid([Tile("big", "", np.full((300, 600, 3), 0.2))])
    fh, fw = scaled(300, 600)
    assert grid.size == (GAP + fw + GAP, GAP + LABEL_BAND + fh + GAP)
    assert (np.asarray(grid)[frame_box(0, 0, fh, fw, video=False)] == 51).all()


def test_long_labels_stay_inside_their_column() -> None:
    narrow = np.full((120, 20, 3), 0.5)
    title = "cache + int8dq + compile + parallel ulysses 2"
    grid = np.asarray(comparison_grid([Tile(title, "2.31× · 34.2 dB", narrow), Tile(title, title, narrow)]))
    fh, fw = scaled(120, 20)
    band = grid[GAP : GAP + LABEL_BAND]
    outside = np.ones(band.shape[1], dtype=bool)
    for column in range(2):
        _, xs = frame_box(column, 0, fh, fw, video=False)
        outside[xs] = False
        assert (band[:, xs].max(axis=-1) < 150).any()  # something legible was kept
    assert (band[:, outside] == 255).all()


def test_fallback_font_spells_missing_glyphs_in_ascii(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(figures, "_font_file", lambda bold: None)
    monkeypatch.setattr(figures, "_font", lambda size, bold: ImageFont.load_default(size=size))
    frame = np.zeros((32, 32, 3))
    with_sign = np.asarray(comparison_grid([Tile("a", "2.31×", frame)]))
    spelled = np.asarray(comparison_grid([Tile("a", "2.31x", frame)]))
    np.testing.assert_array_equal(with_sign, spelled)


def test_grid_rejects_mismatched_or_missing_tiles() -> None:
    with pytest.raises(ValueError, match="one shape.*'b'"):
        comparison_grid([Tile("a", "", np.zeros((64, 96, 3))), Tile("b", "", np.zeros((64, 64, 3)))])
    with pytest.raises(ValueError, match="one shape"):
        comparison_grid([Tile("a", "", np.zeros((64, 96, 3))), Tile("b", "", np.zeros((2, 64, 96, 3)))])
    with pytest.raises(ValueError, match="at least one tile"):
        comparison_grid([])
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        comparison_grid([Tile("gray", "", np.zeros((64, 96)))])


@pytest.mark.parametrize("speedups", [[2.31], [1.0, None, 3.5, 0.8]])
def test_speedup_chart_size(tmp_path: Path, speedups: list[float | None]) -> None:
    pyplot_before = "matplotlib.pyplot" in sys.modules
    path = tmp_path / "chart.png"
    speedup_chart([f"variant {i}" for i in range(len(speedups))], speedups, path, "speedup")
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (800, round((1.2 + 0.45 * len(speedups)) * 100))
        pixels = np.asarray(image.convert("RGB")).astype(int)
    blue = (abs(pixels - np.array([31, 119, 180])).sum(axis=-1) < 10).sum()
    assert blue > 500  # the bars were drawn
    assert pyplot_before or "matplotlib.pyplot" not in sys.modules


def test_speedup_chart_rejects_mismatched_lengths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="one speedup per name"):
        speedup_chart(["a", "b"], [1.0], tmp_path / "chart.png", "speedup")
    assert not (tmp_path / "chart.png").exists()


def test_a_video_kept_as_its_shown_frames_draws_the_same_grid() -> None:
    rng = np.random.default_rng(3)
    video = rng.random((9, 40, 64, 3))
    frames, numbers = figures.shown_frames(video)
    assert numbers == (0, 4, 8) and frames.shape == (3, 40, 64, 3)
    whole = comparison_grid([Tile("a", "b", video)])
    kept = comparison_grid([Tile("a", "b", frames, numbers)])
    assert np.array_equal(np.asarray(whole), np.asarray(kept))
