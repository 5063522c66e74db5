"""Writing generated images (PNG) and videos (MP4 through imageio-ffmpeg's bundled ffmpeg).

Both go through `accel.files.write_file`: a temporary name first, the final one only when whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from accel.files import OVERWRITE_HINT, Write, write_file


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Pipeline output in [0, 1] (output_type="np") → uint8 pixels."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def save_image(image: np.ndarray, path: Path, *, replace: bool = False, hint: str = OVERWRITE_HINT) -> Path:
    """Write a PNG; an existing `path` is refused (UserError) unless `replace`."""
    return write_file(path, image_writer(image), replace=replace, hint=hint)


def save_video(frames: np.ndarray, path: Path, fps: int, *, replace: bool = False, hint: str = OVERWRITE_HINT) -> Path:
    """Write an MP4; an existing `path` is refused (UserError) unless `replace`."""
    return write_file(path, video_writer(frames, fps), replace=replace, hint=hint)


def image_writer(image: np.ndarray) -> Write:
    """Writes `image` (H, W, 3) in [0, 1] to the path it is given, format from its suffix."""
    from PIL import Image

    pixels = to_uint8(image)
    return lambda path: Image.fromarray(pixels).save(path)


def video_writer(frames: np.ndarray, fps: int) -> Write:
    """Writes frames (F, H, W, 3) in [0, 1] as H.264 to the path it is given. H and W are padded
    to even sizes, which H.264 requires."""
    pixels = to_uint8(frames)
    pad_h, pad_w = pixels.shape[1] % 2, pixels.shape[2] % 2
    if pad_h or pad_w:
        pixels = np.pad(pixels, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")

    def write(path: Path) -> None:
        import imageio_ffmpeg

        height, width = pixels.shape[1:3]
        writer = imageio_ffmpeg.write_frames(
            str(path), (width, height), fps=fps, codec="libx264", macro_block_size=1, quality=8,
            pix_fmt_out="yuv420p", ffmpeg_log_level="error",
        )
        writer.send(None)
        try:
            for frame in pixels:
                writer.send(np.ascontiguousarray(frame))
        finally:
            writer.close()

    return write


def read_video(path: Path) -> np.ndarray:
    """Decoded frames (F, H, W, 3) uint8, to check what was written."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3) for raw in reader]
    return np.stack(frames)
