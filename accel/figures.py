"""The pictures a benchmark report shows: variants side by side, and their speedups as a bar chart.

Comparison grid geometry, in pixels, so a reader (or a test) can predict every position:

- each frame is resized so its longer side is TILE; the other side becomes
  max(1, round(side * TILE / longer)) (Python's round). Nearest-neighbour when enlarging, so small
  outputs stay crisp and pixel-exact; Lanczos when shrinking.
- one column per tile, as wide as the resized frame (fw x fh); a LABEL_BAND-high band above the
  frames holds two centred lines, the title and the caption, shrunk or cut with "…" to fit.
- images take one row; videos three rows (frames 0, F // 2 and F - 1), labelled in a ROW_LABEL-wide
  column on the left ("frame 24").
- GAP pixels around the whole grid and between columns and rows; the band sits right on the frames.

    left   = GAP + (ROW_LABEL + GAP if video else 0)
    width  = left + n_tiles * (fw + GAP)
    height = GAP + LABEL_BAND + rows * (fh + GAP)
    frame of tile i, row r at x = left + i * (fw + GAP), y = GAP + LABEL_BAND + r * (fh + GAP)

Speedup chart: CHART_WIDTH_IN x (CHART_BASE_IN + CHART_ROW_IN * n) inches at CHART_DPI, so
800 x round((1.2 + 0.45 * n) * 100) pixels for n variants.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from accel.files.publish import OVERWRITE_HINT, by_descriptor, write_file
from accel.media import to_uint8

TILE = 256  # longer side of every frame in the grid
LABEL_BAND = 44  # title + caption band above each column
GAP = 6  # margin around the grid and between columns and rows
ROW_LABEL = 80  # width of the "frame N" column, videos only

TITLE_FONT, CAPTION_FONT, ROW_FONT, MIN_FONT = 15, 13, 13, 8  # font sizes in pixels
TEXT_PAD = 3  # horizontal room kept free at both ends of a label
BACKGROUND = (255, 255, 255)
TITLE_COLOR, CAPTION_COLOR = (20, 20, 20), (70, 70, 70)

CHART_WIDTH_IN, CHART_BASE_IN, CHART_ROW_IN, CHART_DPI = 8.0, 1.2, 0.45, 100

# Pillow's built-in font (the fallback) lacks these glyphs and would draw boxes.
_ASCII = str.maketrans({"×": "x", "—": "-", "–": "-", "−": "-", "∞": "inf", "→": "->"})


@dataclass(frozen=True)
class Tile:
    """One variant's column: output is float in [0, 1], (H, W, 3) image or (F, H, W, 3) video."""

    title: str
    caption: str
    output: np.ndarray
    # For a video given as only the frames the grid shows (see `shown_frames`): their numbers.
    frame_numbers: tuple[int, ...] | None = None


def shown_frames(video: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    """The frames a video's grid rows show, and their numbers: a bench keeps these, not the video."""
    numbers = (0, len(video) // 2, len(video) - 1)
    return video[list(numbers)], numbers


def comparison_grid(tiles: Sequence[Tile]) -> Image.Image:
    """The variants side by side under their labels; geometry as in the module docstring."""
    shape = _common_shape(tiles)
    video = len(shape) == 4
    height, width = shape[-3:-1]
    longer = max(height, width)
    fh, fw = (max(1, round(side * TILE / longer)) for side in (height, width))
    resample = Image.Resampling.NEAREST if longer < TILE else Image.Resampling.LANCZOS
    numbers = tiles[0].frame_numbers
    indices = ([0, shape[0] // 2, shape[0] - 1] if numbers is None else list(range(len(numbers)))) if video else [None]
    left = GAP + (ROW_LABEL + GAP if video else 0)
    grid = Image.new("RGB", (left + len(tiles) * (fw + GAP), GAP + LABEL_BAND + len(indices) * (fh + GAP)), BACKGROUND)
    for column, tile in enumerate(tiles):
        x = left + column * (fw + GAP)
        grid.paste(_label_band(tile, fw), (x, GAP))
        for row, index in enumerate(indices):
            frame = tile.output if index is None else tile.output[index]
            picture = Image.fromarray(to_uint8(frame)).resize((fw, fh), resample)
            grid.paste(picture, (x, GAP + LABEL_BAND + row * (fh + GAP)))
    for row, index in enumerate(indices):
        if index is not None:
            label = Image.new("RGB", (ROW_LABEL, fh), BACKGROUND)
            number = index if numbers is None else numbers[index]
            _centred(ImageDraw.Draw(label), f"frame {number}", ROW_LABEL, fh / 2, ROW_FONT, False, TITLE_COLOR, "mm")
            grid.paste(label, (GAP, GAP + LABEL_BAND + row * (fh + GAP)))
    return grid


def save_grid(tiles: Sequence[Tile], path: Path, *, replace: bool = False, hint: str = OVERWRITE_HINT) -> None:
    """The grid as a PNG, written whole (accel.files); an existing `path` is refused unless `replace`."""
    grid = comparison_grid(tiles)
    write_file(path, by_descriptor(lambda file: grid.save(file, format="PNG")), replace=replace, hint=hint)


FASTER, SLOWER, WHISKER = "tab:blue", "tab:orange", "0.15"  # bar colours and the min–max whiskers
LEGEND_LABELS = ("faster than baseline", "slower than baseline", "min–max over repeats")


def speedup_chart(
    names: Sequence[str],
    speedups: Sequence[float | None],
    path: Path,
    title: str,
    *,
    replace: bool = False,
    hint: str = OVERWRITE_HINT,
    spreads: Sequence[tuple[float, float] | None] | None = None,
) -> None:
    """`speedup_figure` as a PNG, written whole (accel.files); an existing `path` is refused unless `replace`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # slow imports, only when drawing

    canvas = FigureCanvasAgg(speedup_figure(names, speedups, title, spreads))  # no pyplot: no global figure state
    # print_png, not savefig: rc settings such as savefig.bbox = tight would change the size
    write_file(path, by_descriptor(canvas.print_png), replace=replace, hint=hint)


def speedup_figure(
    names: Sequence[str],
    speedups: Sequence[float | None],
    title: str,
    spreads: Sequence[tuple[float, float] | None] | None = None,
) -> Any:
    """Horizontal bars, first variant on top, value at each bar's end; None is drawn as "skipped".
    `spreads` (low, high) per variant draw min–max whiskers (None: that bar has none); a legend
    names the colours and, where drawn, the whiskers."""
    if len(names) != len(speedups) or (spreads is not None and len(spreads) != len(names)):
        raise ValueError(
            f"speedup chart needs one speedup per name (and one spread, where given), got {len(names)} names, "
            f"{len(speedups)} speedups" + (f" and {len(spreads)} spreads" if spreads is not None else "")
        )
    if not names:
        raise ValueError("speedup chart needs at least one variant")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = list(range(len(names)))
    height_px = round((CHART_BASE_IN + CHART_ROW_IN * len(names)) * CHART_DPI)
    # A quarter pixel over, since matplotlib truncates the pixel size and 2.55 in * 100 is 254.99...
    figure = Figure(figsize=(CHART_WIDTH_IN, (height_px + 0.25) / CHART_DPI), dpi=CHART_DPI, layout="constrained")
    axes = figure.add_subplot()
    values = [0.0 if speedup is None else speedup for speedup in speedups]
    colors = [FASTER if value >= 1.0 else SLOWER for value in values]
    axes.barh(rows, values, color=colors, height=0.6)
    spans = [
        (row, value, spread)
        for row, value, spread in zip(rows, values, spreads or [None] * len(names))
        if spread is not None and value > 0
    ]
    if spans:
        low = [max(0.0, value - spread[0]) for _, value, spread in spans]
        high = [max(0.0, spread[1] - value) for _, value, spread in spans]
        axes.errorbar(
            [value for _, value, _ in spans],
            [row for row, _, _ in spans],
            xerr=[low, high],
            fmt="none",
            ecolor=WHISKER,
            elinewidth=1.2,
            capsize=4,
            label=LEGEND_LABELS[2],
        )
    axes.set_yticks(rows, labels=list(names))
    axes.invert_yaxis()  # first variant on top, as listed
    axes.axvline(1.0, color="0.3", linestyle="--", linewidth=1)
    reach = [max(value, spread[1]) for _, value, spread in spans] if spans else []
    axes.set_xlim(0.0, max(1.0, *values, *reach) * 1.18)  # room for the value text past the longest bar
    ends = {row: spread[1] for row, _, spread in spans}  # the value sits past its whisker
    for row, speedup in zip(rows, speedups):
        text = " skipped" if speedup is None else f" {speedup:.2f}×"
        x = 0.0 if speedup is None else max(speedup, ends.get(row, speedup))
        axes.text(x, row, text, va="center", color="0.3" if speedup is None else "0")
    handles: list[Any] = [Patch(color=FASTER, label=LEGEND_LABELS[0]), Patch(color=SLOWER, label=LEGEND_LABELS[1])]
    if spans:
        handles.append(axes.containers[-1])  # the whiskers' ErrorbarContainer
    # Below the plot, not on it: no bar or value is ever hidden under the legend.
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize="small", frameon=False)
    axes.set_xlabel("speedup over baseline (median; whiskers: min–max)" if spans else "speedup over baseline")
    axes.set_title(title)
    return figure


def _common_shape(tiles: Sequence[Tile]) -> tuple[int, ...]:
    if not tiles:
        raise ValueError("comparison grid needs at least one tile")
    for tile in tiles:
        shape = tile.output.shape
        if len(shape) not in (3, 4) or shape[-1] != 3 or 0 in shape:
            raise ValueError(f"tile {tile.title!r}: output must be (H, W, 3) or (F, H, W, 3), got shape {shape}")
    first = tiles[0]
    for tile in tiles[1:]:
        if tile.output.shape != first.output.shape:
            raise ValueError(
                f"comparison grid needs tiles of one shape, got {first.output.shape} for {first.title!r} "
                f"and {tile.output.shape} for {tile.title!r}"
            )
    return first.output.shape


def _label_band(tile: Tile, width: int) -> Image.Image:
    """Title and caption in a band of their own: drawing into a column-wide image clips anything the
    font metrics get wrong, so no label ever spills into a neighbour."""
    band = Image.new("RGB", (width, LABEL_BAND), BACKGROUND)
    draw = ImageDraw.Draw(band)
    _centred(draw, tile.title, width, LABEL_BAND * 0.43, TITLE_FONT, True, TITLE_COLOR, "ms")
    _centred(draw, tile.caption, width, LABEL_BAND * 0.86, CAPTION_FONT, False, CAPTION_COLOR, "ms")
    return band


def _centred(
    draw: ImageDraw.ImageDraw,
    text: str,
    width: int,
    y: float,
    size: int,
    bold: bool,
    color: tuple[int, int, int],
    anchor: str,
) -> None:
    """Text centred on x = width / 2, placed at y by the anchor ("ms": baseline, "mm": middle)."""
    fitted, font = _fit(text, width - 2 * TEXT_PAD, size, bold)
    if fitted:
        draw.text((width / 2, y), fitted, font=font, fill=color, anchor=anchor)


def _fit(text: str, room: int, size: int, bold: bool) -> tuple[str, ImageFont.FreeTypeFont | ImageFont.ImageFont]:
    """The text at the largest size from size down to MIN_FONT that fits in room pixels, else cut
    with "…" at MIN_FONT; empty when not even "…" fits."""
    if _font_file(bold) is None:
        text = text.translate(_ASCII)
    font = _font(size, bold)
    for candidate in range(size, MIN_FONT - 1, -1):
        font = _font(candidate, bold)
        if font.getlength(text) <= room:
            return text, font
    while text and font.getlength(text.rstrip() + "…") > room:
        text = text[:-1]
    cut = text.rstrip() + "…"
    return (cut, font) if font.getlength(cut) <= room else ("", font)


@functools.cache
def _font_file(bold: bool) -> Path | None:
    """DejaVu Sans as shipped with matplotlib, found without importing it: unlike Pillow's built-in
    font it has "×", "∞", dashes and accented letters."""
    spec = importlib.util.find_spec("matplotlib")
    if spec is None or spec.origin is None:
        return None
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    path = Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf" / name
    return path if path.is_file() else None


@functools.cache
def _font(size: int, bold: bool) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    path = _font_file(bold)
    return ImageFont.truetype(str(path), size) if path else ImageFont.load_default(size=size)
