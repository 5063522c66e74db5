"""Writing generated images (PNG), videos (MP4 through imageio-ffmpeg's bundled ffmpeg) and linear
HDR videos (their float32 frames as .npy, or an SDR preview MP4).

Both go through `accel.files.publish.write_file`: a temporary name first, the final one only when whole."""

from __future__ import annotations

import re
import subprocess
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from accel.files.exclusive_create import created, open_created
from accel.files.publish import OVERWRITE_HINT, Write, by_descriptor, write_file


@dataclass(frozen=True)
class Audio:
    """Sound made with a video: `samples` (channels, samples) in [-1, 1] at `rate` Hz."""

    samples: np.ndarray
    rate: int

    @property
    def seconds(self) -> float:
        return self.samples.shape[-1] / self.rate


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Pipeline output in [0, 1] (output_type="np") → uint8 pixels."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def save_image(image: np.ndarray, path: Path, *, replace: bool = False, hint: str = OVERWRITE_HINT) -> Path:
    """Write a PNG; an existing `path` is refused (UserError) unless `replace`."""
    return write_file(path, image_writer(image), replace=replace, hint=hint)


def save_video(
    frames: np.ndarray,
    path: Path,
    fps: int,
    *,
    audio: Audio | None = None,
    replace: bool = False,
    hint: str = OVERWRITE_HINT,
) -> Path:
    """Write an MP4 (with `audio` as its sound track); an existing `path` is refused (UserError) unless `replace`."""
    return write_file(path, video_writer(frames, fps, audio), replace=replace, hint=hint)


def sdr_preview(linear: np.ndarray) -> np.ndarray:
    """Linear light in [0, inf) → the [0, 1] values an sRGB display shows: clipped to [0, 1] (no tone
    curve: what the reference LTX-2 HDR code does by default), then the sRGB transfer function."""
    clipped = np.clip(np.asarray(linear, dtype=np.float32), 0.0, 1.0)
    return np.where(clipped <= 0.0031308, clipped * 12.92, 1.055 * np.power(clipped, 1.0 / 2.4) - 0.055).astype(
        np.float32
    )


def viewable(output: np.ndarray, kind: str) -> np.ndarray:
    """The output as [0, 1] values, as shown and as quality is measured: an HDR video's SDR preview."""
    return sdr_preview(output) if kind == "hdr-video" else output


def output_writer(output: np.ndarray, kind: str, suffix: str, fps: int, audio: Audio | None = None) -> Write:
    """The writer of a pipeline's output of `kind` ("image", "video", "hdr-video") to a file ending in
    `suffix`, one of those accel.models.base.OUTPUT_FILES lists for the kind."""
    if kind == "image":
        return image_writer(output)
    if kind == "hdr-video" and suffix.lower() == ".npy":
        return array_writer(output)
    return video_writer(viewable(output, kind), fps, audio)


def array_writer(frames: np.ndarray) -> Write:
    """Writes `frames` as float32 .npy, losslessly (linear HDR frames for grading tools)."""
    data = np.ascontiguousarray(frames, dtype=np.float32)
    # a file object: np.save would add .npy to the temporary name
    return by_descriptor(lambda file: np.save(file, data, allow_pickle=False))


def image_writer(image: np.ndarray) -> Write:
    """Writes `image` (H, W, 3) in [0, 1] to the path it is given, format from its suffix, through
    the descriptor that created it (accel.files.exclusive_create.open_created): PIL takes a file object."""
    from PIL import Image

    pixels = to_uint8(image)

    def write(path: Path) -> None:
        form = Image.registered_extensions().get(path.suffix.lower())  # a file object has no suffix to go by
        by_descriptor(lambda file: Image.fromarray(pixels).save(file, format=form))(path)

    return write


def video_writer(frames: np.ndarray, fps: float, audio: Audio | None = None) -> Write:
    """Writes frames (F, H, W, 3) in [0, 1] as H.264 to the path it is given, with `audio` muxed in
    as AAC. H and W are padded to even sizes, which H.264 requires."""
    pixels = to_uint8(frames)
    pad_h, pad_w = pixels.shape[1] % 2, pixels.shape[2] % 2
    if pad_h or pad_w:
        pixels = np.pad(pixels, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")

    def write(path: Path) -> None:
        """By name: ffmpeg opens its output itself (imageio-ffmpeg takes no file object, and an MP4
        through a pipe would need a fragmented file). The name was created exclusively just before,
        without following a link; someone who can write the folder could swap it in between."""
        import imageio_ffmpeg

        height, width = pixels.shape[1:3]
        writer = imageio_ffmpeg.write_frames(
            str(path),
            (width, height),
            fps=fps,
            codec="libx264",
            macro_block_size=1,
            quality=8,
            pix_fmt_out="yuv420p",
            ffmpeg_log_level="error",
        )
        writer.send(None)
        try:
            for frame in pixels:
                writer.send(np.ascontiguousarray(frame))
        finally:
            writer.close()

    if audio is None:
        return write

    def write_with_audio(path: Path) -> None:
        silent, sound = path.with_name(path.name + ".video.mp4"), path.with_name(path.name + ".audio.wav")
        try:  # names next to the temporary, as predictable: never through a planted link
            with created(silent), created(sound):
                write(silent)
                _write_wav(audio, sound)
            _ffmpeg(
                "-i",
                str(silent),
                "-i",
                str(sound),
                "-map",
                "0:v",
                "-map",
                "1:a",
                "-c:v",
                "copy",
                "-c:a",
                "aac",
                "-b:a",
                "192k",
                "-f",
                "mp4",
                str(path),
            )
        finally:
            silent.unlink(missing_ok=True)
            sound.unlink(missing_ok=True)

    return write_with_audio


def _write_wav(audio: Audio, path: Path) -> None:
    """16-bit PCM WAV, the lossless hand-over to ffmpeg's AAC encoder; through the descriptor that
    created `path` (wave takes a file object)."""
    samples = np.atleast_2d(np.asarray(audio.samples, dtype=np.float32))
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with open_created(path) as file, wave.open(file, "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(audio.rate))
        out.writeframes(np.ascontiguousarray(pcm.T).tobytes())


def _ffmpeg(*args: str) -> subprocess.CompletedProcess[bytes]:
    import imageio_ffmpeg

    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-y", "-loglevel", "error", *args]
    return subprocess.run(command, check=True, capture_output=True)


def read_video(path: Path) -> np.ndarray:
    """Decoded frames (F, H, W, 3) uint8, to check what was written."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3) for raw in reader]
    return np.stack(frames)


def read_audio(path: Path) -> Audio | None:
    """The sound track of a written video, decoded (None: it has none), to check what was written."""
    import imageio_ffmpeg

    probe = subprocess.run(
        [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(path)], capture_output=True, text=True
    )
    stream = re.search(r"Audio: .*?(\d+) Hz, (mono|stereo|(\d+) channels)", probe.stderr)
    if stream is None:
        return None
    channels = {"mono": 1, "stereo": 2}.get(stream.group(2)) or int(stream.group(3))
    raw = _ffmpeg("-i", str(path), "-vn", "-f", "f32le", "-acodec", "pcm_f32le", "-").stdout
    samples = np.frombuffer(raw, dtype="<f4").reshape(-1, channels).T
    return Audio(samples, int(stream.group(1)))
