"""Writing generated images (PNG) and videos (MP4 through imageio-ffmpeg's bundled ffmpeg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Pipeline output in [0, 1] (output_type="np") → uint8 pixels."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def save_image(image: np.ndarray, path: Path) -> None:
    from PIL import Image

    Image.fromarray(to_uint8(image)).save(path)


def save_video(frames: np.ndarray, path: Path, fps: int) -> None:
    """frames: (F, H, W, 3) in [0, 1]. H and W are padded to even sizes, which H.264 requires."""
    import imageio_ffmpeg

    pixels = to_uint8(frames)
    pad_h, pad_w = pixels.shape[1] % 2, pixels.shape[2] % 2
    if pad_h or pad_w:
        pixels = np.pad(pixels, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    height, width = pixels.shape[1:3]
    writer = imageio_ffmpeg.write_frames(
        str(path), (width, height), fps=fps, codec="libx264", macro_block_size=1, quality=8,
        pix_fmt_out="yuv420p", ffmpeg_log_level="error",
    )
    writer.send(None)
    for frame in pixels:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def read_video(path: Path) -> np.ndarray:
    """Decoded frames (F, H, W, 3) uint8, to check what was written."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3) for raw in reader]
    return np.stack(frames)
