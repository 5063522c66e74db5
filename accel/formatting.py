"""How accel's reports write numbers and fit tables to a terminal: a number is never folded or cut,
and a run's and a bench's tables say sizes, times and memory alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement


SINGLE_REPEAT = "single repeat"


class Fit:
    """The first of `layouts` (each made for the width there is) whose natural width fits, else the
    last: a wide table where there is room, the same cells stacked, fewer or as blocks where there
    is not. A number is never folded or cut, which a squeezed rich table does."""

    def __init__(self, *layouts: Callable[[int], RenderableType]) -> None:
        self.layouts = layouts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        for make in self.layouts[:-1]:
            layout = make(width)
            if Measurement.get(console, options.update_width(10_000), layout).maximum <= width:
                yield layout
                return
        yield self.layouts[-1](width)


def packed(items: Iterable[str], width: int, separator: str) -> str:
    """`items` joined by `separator`, broken into lines of at most `width` only between items: a
    pipeline class or a feature name is never split (one longer than `width` gets a line of its own)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(separator) + len(item) <= width:
            lines[-1] += separator + item
        else:
            if lines:
                lines[-1] += separator.rstrip()
            lines.append(item)
    return "\n".join(lines)


def format_seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def format_bytes(value: int) -> str:
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def format_span(low: float, high: float) -> str:
    """'93.7–101.2 ms': a min–max range in one unit."""
    if high < 1:
        return f"{low * 1000:.1f}–{high * 1000:.1f} ms"
    return f"{low:.2f}–{high:.2f} s"


def format_threads(threads: dict[str, Any]) -> str:
    if threads["source"] == "accel default":
        return f"{threads['count']} (accel default; OMP_NUM_THREADS overrides)"
    return f"{threads['count']} ({threads['source']})"


def format_size(settings: dict[str, Any], output_kind: str) -> str:
    """'64×48' or '64×48, 5 frames' from a pipeline call's arguments (the frames key varies by family);
    a pipeline that takes no size (HunyuanVideo 1.5 image-to-video) makes the input picture's."""
    size = f"{settings['width']}×{settings['height']}" if "width" in settings else "input picture's size"
    if output_kind != "image":
        frames = settings.get("frames") or next((v for k, v in settings.items() if k.endswith("frames")), None)
        size += f", {frames} frames"
    return size
